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
