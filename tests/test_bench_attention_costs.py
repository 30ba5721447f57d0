"""The attention cost benchmarks run end to end at a tiny length: the GPU stages call them (bench/gpu_session.sh
`checks` and `string`), so a rename in the library must fail here, on CPU, not on a lent GPU.

bench/string_cost.py still called ``shifted_positions._LayerSettings`` after the class became
``StringLayerSettings``; nothing ran it until the GPU stage would have. Each run here takes a few seconds.
"""

from __future__ import annotations

import json

import pytest

from tests.bench_helpers import load_bench_script


@pytest.mark.parametrize("name, argv", [
    ("string_cost", ["--lengths", "512", "--repeats", "1", "--no-eager", "--shifted-offset", "200",
                     "--local-value", "32", "--split-blocks", "64,128"]),
    ("dca_cost", ["--lengths", "512", "--chunk-size", "256", "--local-window", "32", "--repeats", "1", "--no-eager"]),
    ("self_extend_cost", ["--attention-only", "--lengths", "512", "--window", "128", "--group-size", "4",
                          "--repeats", "1"]),
])
def test_an_attention_cost_benchmark_runs_and_writes_its_row(name, argv, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / f"{name}.json"
    script = load_bench_script(name)
    assert script.main([*argv, "--out", str(out)]) in (0, None)
    rows = json.loads(out.read_text())["rows"]
    assert [row["length"] for row in rows] == [512]
    if name == "string_cost":  # each query-block size asked for is timed, and its table written
        assert all(rows[0][f"string_split_b{b}_prefill_ms"] > 0 for b in (64, 128))
        assert "block 128" in out.with_suffix(".md").read_text()
