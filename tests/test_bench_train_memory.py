"""bench/train_memory.py: the longest-length bisection finds the boundary with few probes and records what it
measured, and the memory watchdog kills a process tree that passes its limit (the probes themselves take
minutes to hours on SmolLM2 and run by hand; these checks use a fake probe and a small allocating child)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_memory", ROOT / "bench" / "train_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bisection_finds_the_longest_fitting_multiple(tmp_path, monkeypatch):
    script = _load_script()
    boundary = 40960
    probed = []

    def fake_probe(length, variant, data, old_tree, processes=1, limit_bytes=None, mmap_threshold=None):
        probed.append(length)
        fits = length <= boundary
        return {"length": length, "variant": variant, "processes": processes, "exceeded_limit": not fits,
                "sampled_sum_peak_gib": (limit_bytes / 2**30) * (0.9 if fits else 1.01), "peak_rss_gib": 1.0}

    monkeypatch.setattr(script, "run_probe", fake_probe)
    out = tmp_path / "longest.json"
    args = argparse.Namespace(limit_gb=20.0, out=str(out), processes=1, variant="chunked", lo=4096, hi=131072,
                              step=4096, data="unused", mmap_threshold=None)
    monkeypatch.setattr(sys, "argv", ["train_memory.py", "--longest"])
    assert script.measure_longest(args, Path("unused")) == 0
    search = json.loads(out.read_text())["searches"]["1proc_chunked_20GB"]
    assert search["longest_fitting"] == boundary
    assert search["shortest_failing"] == boundary + 4096
    assert len(probed) <= 6 and len(set(probed)) == len(probed)
    # A second invocation reuses the recorded probes and measures nothing again.
    probed.clear()
    assert script.measure_longest(args, Path("unused")) == 0
    assert probed == []


def test_watchdog_kills_a_process_tree_over_the_limit(tmp_path, monkeypatch):
    script = _load_script()
    grow = ("import time\nblocks = []\nfor _ in range(20):\n    blocks.append(bytearray(50 * 2**20))\n    time.sleep(0.05)\n")
    monkeypatch.setattr(script, "ENGINE_CHILD", grow)
    record = script.run_probe(1024, "chunked", "unused", Path("unused"), limit_bytes=400e6)
    assert record["exceeded_limit"] is True
    assert 0.3 < record["sampled_sum_peak_gib"] < 1.0


def test_each_child_imports_the_package_of_its_own_tree(tmp_path, monkeypatch):
    """Run from this checkout, the "old" child must import the old tree's package (a ``python -c`` child put the
    working directory first on sys.path and silently measured today's loop as the old one)."""
    script = _load_script()
    old_tree = tmp_path / "old_tree"
    (old_tree / "hf_posext").mkdir(parents=True)
    (old_tree / "hf_posext" / "__init__.py").write_text("")
    report_only = ("import sys, json\n" + script.PROBE.split("import transformers")[0]
                   + "state['peaks']['forward'] = rss()\nreport({'train_seconds': 0.0})\n")
    monkeypatch.setattr(script, "ENGINE_CHILD", report_only)
    monkeypatch.chdir(ROOT)  # where the benchmark is run from: this checkout holds a different hf_posext
    old = script.run_probe(1024, "old", "unused", old_tree)
    new = script.run_probe(1024, "chunked", "unused", old_tree)
    assert Path(old["package"]).resolve() == (old_tree / "hf_posext").resolve()
    assert Path(new["package"]).resolve() == (ROOT / "hf_posext").resolve()


def test_a_child_that_imported_another_tree_is_refused(tmp_path):
    script = _load_script()
    probes = [{"package": str(ROOT / "hf_posext")}]
    try:
        script.check_package(probes, tmp_path)
    except RuntimeError as error:
        assert "measured the wrong tree" in str(error) and "\n" not in str(error)
    else:
        raise AssertionError("a child that imported the wrong package was accepted")


def test_linear_fit_and_longest_length_extrapolation():
    script = _load_script()
    # Peaks on an exact line: 1 GiB + 0.25 GiB per 1024 tokens.
    points = [(n, 1.0 + 0.25 * n / 1024) for n in (4096, 8192, 16384)]
    base, per_token = script.linear_fit(points)
    assert abs(base - 1.0) < 1e-9 and abs(per_token * 1024 - 0.25) < 1e-12
    # 1 process within 9 GiB: (9 - 1) / 0.25 * 1024 = 32768 tokens.
    assert script.longest_within(9.0, base, per_token) == 32768
    # 3 ranks, each with its own 9 GiB, each holding a third of the tokens: 3x as long.
    assert script.longest_within(9.0, base, per_token, processes=3) == 3 * 32768
    # 3 ranks sharing 9 GiB: three bases come off first: (9 - 3) / 0.25 * 1024.
    assert script.longest_within(9.0, base, per_token, processes=3, summed=True) == 24576
    results = [{"length": n, "variant": "chunked", "processes": 1, "peak_rss_gib": y} for n, y in points]
    results.append({"length": 3072, "variant": "chunked", "processes": 3, "per_process_peak_rss_gib": [1.5, 1.75, 1.6]})
    out = script.estimate(results, limit_gb=9.0 * 2**30 / 1e9)
    entry = out["variants"]["chunked"]
    assert entry["longest_1_process"] == 32768
    # Largest rank 1.75 GiB at 1024 tokens per rank: base 1.5 GiB, so (9 - 1.5) / 0.25 * 1024 * 3 per-process.
    assert entry["sp3"]["longest_limit_per_process"] == 3 * 30720
    assert "estimate" in out["kind"]
    # A heap-inflated short point (glibc's default allocator at 2048 tokens) is left out with fit_from.
    skewed = results + [{"length": 2048, "variant": "chunked", "processes": 1, "peak_rss_gib": 5.0}]
    assert script.estimate(skewed, limit_gb=9.0 * 2**30 / 1e9)["variants"]["chunked"]["longest_1_process"] != 32768
    fitted = script.estimate(skewed, limit_gb=9.0 * 2**30 / 1e9, fit_from=4096)["variants"]["chunked"]
    assert fitted["longest_1_process"] == 32768 and [n for n, _ in fitted["measured"]] == [4096, 8192, 16384]


def test_each_tree_gets_the_length_key_it_knows():
    script = _load_script()
    from hf_posext.training.config import load_config

    new = script.overrides(4096, "chunked", "books", "/tmp/out")
    assert "data.sequence_length=4096" in new and not any(item.startswith("data.window=") for item in new)
    assert load_config(None, new).data.sequence_length == 4096  # today's config accepts every key, no warning needed
    old = script.overrides(4096, "old", "books", "/tmp/out")
    assert "data.window=4096" in old and not any(item.startswith("data.sequence_length=") for item in old)


def test_every_name_the_children_import_from_the_package_exists():
    """The children are source strings run in fresh processes, so a renamed library name breaks them only
    when someone runs the bench (the sequence-parallel child imported a ``ParallelismRequest`` that the
    package no longer had): check each ``from hf_posext... import name`` against today's package."""
    import ast
    import importlib

    script = _load_script()
    missing = []
    for child in (script.ENGINE_CHILD, script.SP_CHILD):
        for node in ast.walk(ast.parse(child)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_posext"):
                module = importlib.import_module(node.module)
                missing += [f"{node.module}.{alias.name}" for alias in node.names if not hasattr(module, alias.name)]
    assert missing == []
