"""Every command that takes a dtype prints, in its first lines, the dtype it chose and why (``dtype: X (why)``).

The evaluation tasks' line is tested in tests/test_evaluation_loading_dtype.py; here: ``hf-posext train`` (the
recipe's ``model.precision``), ``hf-posext lm-eval-compare`` (``--model-args dtype=``) and ``hf-posext eval suite``.
"""

from __future__ import annotations

import pytest

from hf_posext.training.arguments import training_dtype
from hf_posext.training.config import load_config
from tests.training_helpers import REPO, TINY_RECIPE

TINY_MODEL = str(REPO / "tests" / "data" / "training" / "tiny-llama")


def test_train_prints_its_dtype_first(capsys, tmp_path, monkeypatch):
    from hf_posext.cli import main

    monkeypatch.chdir(REPO)
    assert main(["train", "--config", str(TINY_RECIPE), f"output.dir={tmp_path / 'run'}", "--stop-at-step", "1",
                 "--no-progress"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == "dtype: float32 (model.precision: fp32)"


@pytest.mark.parametrize("cuda_bf16, precision, mode, expected", [
    (False, "auto", "lora", "float32"),
    (True, "auto", "lora", "bfloat16"),
    (True, "bf16", "full", "float32 weights, bfloat16 compute"),
    (True, "fp32", "lora", "float32"),
])
def test_training_dtype_follows_the_precision_and_the_gpu(monkeypatch, cuda_bf16, precision, mode, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    config = load_config(TINY_RECIPE, [f"model.precision={precision}", f"finetune.mode={mode}"])
    dtype, why = training_dtype(config)
    assert dtype == expected and why.startswith(f"model.precision: {precision}")
    if precision == "auto" and not cuda_bf16:
        assert "no GPU with bfloat16 here" in why


def test_lm_eval_compare_prints_its_dtype_first(capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    from hf_posext.cli import main
    from hf_posext.integrations.lm_eval import compare

    monkeypatch.setattr(compare, "compare_methods", lambda *a, **k: [])
    assert main(["lm-eval-compare", TINY_MODEL, "--methods", "none", "--tasks", "niah_single_1"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        "dtype: float32 (no dtype in --model-args: lm-eval loads the checkpoint's own dtype, from its config.json; "
        "pass --model-args dtype=float32 to choose one)")
    assert main(["lm-eval-compare", TINY_MODEL, "--methods", "none", "--tasks", "niah_single_1",
                 "--model-args", "dtype=bfloat16"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == "dtype: bfloat16 (--model-args dtype=bfloat16, as given)"


@pytest.mark.parametrize("dtype, expected", [
    ("float32", "dtype: float32 (--dtype float32, as given)"),
    ("auto", "dtype: float32 (auto: perplexity stays float32"),
])
def test_eval_suite_prints_its_dtype_first(capsys, tmp_path, dtype, expected):
    from hf_posext.cli import main
    from tests.training_helpers import TINY_CORPUS

    assert main(["eval", "suite", "--models", TINY_MODEL, "--lengths", "64", "--tasks", "perplexity", "--trials", "1",
                 "--data", str(TINY_CORPUS), "--dtype", dtype, "--out", str(tmp_path / "suite"), "--no-progress"]) == 0
    assert capsys.readouterr().err.splitlines()[0].startswith(expected)


def test_a_train_refusal_stays_one_line_the_dtype_comes_once_the_checks_pass(capsys, tmp_path, monkeypatch):
    """The dtype line is printed after every check (exclusions, stage 2, the run folder), before the model loads: a
    refused run prints its one line only."""
    from hf_posext.cli import main

    monkeypatch.chdir(REPO)
    assert main(["train", "--config", str(TINY_RECIPE), f"output.dir={tmp_path / 'run'}", "data.exclude=[nosuch-book]",
                 "--no-progress"]) != 0
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "data.exclude" in error and "dtype:" not in error, error
    assert not (tmp_path / "run").exists()
