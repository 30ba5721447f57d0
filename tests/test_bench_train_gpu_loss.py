"""bench/train_gpu_loss.py runs on GPU machines, which CI lacks: check that every recipe it measures is a
valid training config (so the script cannot rot into configs the engine refuses) and that its table
reports ratios against the plain loss."""

from __future__ import annotations


import pytest

from tests.bench_helpers import load_bench_script

from hf_posext.training.config import load_config


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "liger"])
def test_every_measured_recipe_is_a_valid_config(tmp_path, mode, variant):
    script = load_bench_script("train_gpu_loss")
    data = tmp_path / "book.txt"
    data.write_text("words " * 100)
    config = load_config(None, script.overrides(32768, variant, mode, str(data), str(tmp_path / "run"), "fp32", 4))
    config.validate()
    assert config.train.loss == ("chunked" if variant == "chunked" else "plain")
    assert config.finetune.mode == mode
    assert config.data.sequence_length == 32768 and config.scaling.factor == 4


def test_table_reports_ratios_against_plain_and_failures():
    script = load_bench_script("train_gpu_loss")
    records = [
        {"mode": "lora", "length": 8, "variant": "plain", "peak_allocated_gib": 4.0, "tokens_per_second": 100.0, "first_loss": 3.0},
        {"mode": "lora", "length": 8, "variant": "chunked", "peak_allocated_gib": 1.0, "tokens_per_second": 90.0, "first_loss": 3.0},
        {"mode": "lora", "length": 8, "variant": "liger", "error": "ModuleNotFoundError: liger_kernel"},
    ]
    rows = script.table(records).splitlines()
    assert "| lora | 8 | chunked | 1.0 | 90.0 | 0.25 | 0.90 |" in rows[3]
    assert "failed: ModuleNotFoundError" in rows[4]


def test_longest_search_treats_only_out_of_memory_as_not_fitting(tmp_path, monkeypatch):
    """--longest on a GPU: a probe over the cap ends in CUDA's out-of-memory error (does not fit), any other
    error stops the search (it must not pass for "too long"); probes are written and reused."""
    import argparse
    import json

    script = load_bench_script("train_gpu_loss")
    probed = []

    def fake_measure(length, variant, mode, args, limit_bytes=None):
        probed.append(length)
        assert limit_bytes == 20e9
        if variant == "plain":
            return {"length": length, "error": "RuntimeError: NCCL error"}
        if length > 98304:
            return {"length": length, "error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return {"length": length, "peak_allocated_gib": length / 8192}

    monkeypatch.setattr(script, "measure", fake_measure)
    out = tmp_path / "longest.json"
    args = argparse.Namespace(limit_gb=20.0, lo=8192, hi=262144, step=8192, precision="bf16")
    assert script.measure_longest(args, {"device": "test"}, out, ["lora"], ["chunked"]) == 0
    search = json.loads(out.read_text())["longest"]["lora_chunked_20GB"]
    assert (search["longest_fitting"], search["shortest_failing"]) == (98304, 106496)
    assert len(probed) <= 6
    probed.clear()
    assert script.measure_longest(args, {"device": "test"}, out, ["lora"], ["chunked"]) == 0
    assert probed == []  # resumed from the file
    assert script.measure_longest(args, {"device": "test"}, out, ["lora"], ["plain"]) == 1
