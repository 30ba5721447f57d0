"""bench/gpu_checks.py runs on GPU machines, which CI lacks: run its checks on CPU so the script cannot rot,
and show that each check fails on a broken variant (a check that cannot fail proves nothing on the GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import hf_posext

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "bench" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _failed(results: list[dict]) -> set[str]:
    return {r["check"] for r in results if not r["passed"]}


def test_every_check_passes_on_cpu_with_a_margin_and_is_written(tmp_path):
    script = _load_script()
    out = tmp_path / "checks.json"
    with pytest.warns(UserWarning, match="stored in torch.bfloat16"):  # the bf16 check casts a model
        failures = script.main(["--device", "cpu", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert failures == 0 and len(results) == 10
    assert all(r["passed"] and r["margin"] >= 100 for r in results)
    names = " / ".join(r["check"] for r in results)
    assert "cached generation vs full recompute" in names and "unpatch restores the exact logits" in names


def test_a_patch_that_does_nothing_fails_every_check(monkeypatch):
    script = _load_script()
    monkeypatch.setattr(script.hf_posext, "patch", lambda model, *args, **kwargs: model)
    monkeypatch.setattr(script.hf_posext, "unpatch", lambda model: model)
    results = script.run_checks("cpu")
    assert _failed(results) == {r["check"] for r in results}


def test_frequencies_that_follow_a_bfloat16_cast_fail_the_half_precision_check(monkeypatch):
    """The fix the bf16 check guards: patched frequency tables stay float32 when the model is half precision."""
    script = _load_script()
    real_patch = hf_posext.patch

    def patch_then_round_tables(model, *args, **kwargs):
        real_patch(model, *args, **kwargs)
        dtype = next(model.parameters()).dtype
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype).float()  # rounded, as a plain .to(dtype) would
        return model

    monkeypatch.setattr(script.hf_posext, "patch", patch_then_round_tables)
    with pytest.warns(UserWarning, match="stored in torch.bfloat16"):
        results = script.run_checks("cpu")
    assert _failed(results) == {"yarn on a bfloat16-cast model: rotary cos/sin equal float32 tables rounded once"}


def test_a_cache_that_drops_self_extend_fails_the_cache_checks(monkeypatch):
    script = _load_script()
    real_cached = script.cached_logits

    def cached_without_self_extend(model, ids, prefix, step):
        hf_posext.unpatch(model)
        try:
            return real_cached(model, ids, prefix, step)
        finally:
            hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=10)

    monkeypatch.setattr(script, "cached_logits", cached_without_self_extend)
    results = script.run_checks("cpu")
    assert _failed(results) == {"self-extend sdpa: cached generation vs full recompute",
                                "self-extend eager: cached generation vs full recompute"}
