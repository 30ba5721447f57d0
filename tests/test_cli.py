"""The `hf-posext` command: methods, describe, patch (on a tiny model saved to a folder)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
import sys

import pytest
import torch

import hf_posext
from hf_posext.cli import main, parse_method_params
from hf_posext.models import tiny_model


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    return folder


def test_methods_lists_every_method(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in hf_posext.available_methods():
        assert name in out


def test_describe_prints_json(tiny_folder, capsys):
    assert main(["describe", str(tiny_folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "none" and report["original_window"] == 64


def test_patch_saves_a_loadable_model(tiny_folder, tmp_path, capsys):
    out = tmp_path / "patched"
    code = main(["patch", str(tiny_folder), "--method", "yarn", "--factor", "4", "--param", "beta_fast=16", "--out", str(out)])
    assert code == 0
    assert "current window:  256" in capsys.readouterr().out
    model = hf_posext.load(out)
    report = hf_posext.describe(model)
    assert (report.method, report.factor, report.params["beta_fast"]) == ("yarn", 4.0, 16)
    assert main(["describe", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["current_window"] == 256
    expected = hf_posext.patch(tiny_model("llama"), "yarn", factor=4, beta_fast=16)
    ids = torch.randint(3, 128, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)


def test_patch_saves_the_tokenizer_with_the_scaled_length(tmp_path, capsys):
    source = Path(__file__).parent / "data" / "training" / "tiny-llama"  # window 64, with a tokenizer
    out = tmp_path / "patched"
    assert main(["patch", str(source), "--method", "yarn", "--factor", "4", "--out", str(out)]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256
    assert (out / "tokenizer.json").read_bytes() != b""
    assert "note:" not in capsys.readouterr().err


def test_patch_of_a_folder_without_a_tokenizer_saves_the_model_and_says_so(tiny_folder, tmp_path, capsys):
    out = tmp_path / "patched"
    assert main(["patch", str(tiny_folder), "--method", "yarn", "--factor", "2", "--out", str(out)]) == 0
    assert "has no tokenizer files, so none was saved" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer_config.json").exists()


def test_bad_input_exits_2_with_a_message(tiny_folder, tmp_path, capsys):
    assert main(["patch", str(tiny_folder), "--method", "wavelet", "--factor", "2", "--out", str(tmp_path / "x")]) == 2
    assert "Unknown method 'wavelet'" in capsys.readouterr().err
    assert main(["patch", str(tiny_folder), "--method", "yarn", "--factor", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_patch_refuses_an_out_that_is_a_file_and_leaves_it(tiny_folder, tmp_path, capsys):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    assert main(["patch", str(tiny_folder), "--method", "yarn", "--factor", "2", "--out", str(existing)]) == 2
    assert f"--out {existing} is a file" in capsys.readouterr().err
    assert existing.read_text() == "keep me"


def test_param_parsing():
    assert parse_method_params(["beta_fast=32", "base=1e6", "truncate=false", "factors=f.json"]) == {
        "beta_fast": 32, "base": 1e6, "truncate": False, "factors": "f.json",
    }
    with pytest.raises(SystemExit):
        parse_method_params(["beta_fast"])


def _console_script() -> str:
    """The ``hf-posext`` entry point pip installed beside this interpreter (not ``python -m``)."""
    import shutil
    import sysconfig

    beside = Path(sysconfig.get_path("scripts")) / "hf-posext"
    found = str(beside) if beside.exists() else shutil.which("hf-posext")
    assert found, "the hf-posext console script is not installed: run `pip install -e .` (scripts/setup.sh does)"
    return found


def test_console_script_is_installed_and_runs():
    script = _console_script()
    result = subprocess.run([script, "methods"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "yarn" in result.stdout
    result = subprocess.run([script, "patch", "no/such/folder", "--method", "yarn", "--factor", "2", "--out", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "no such model folder: no/such/folder" in result.stderr and not Path("x").exists()


@pytest.mark.parametrize("bad, message", [
    (["--lengths", "inf"], "Bad length 'inf'"),
    (["--chunk-size", "0"], "--chunk-size must be a positive number of tokens"),
    (["--device", "cuda:0"], "no CUDA device here"),
    (["--out", "FILE"], "is a file; give a folder"),
])
def test_eval_refuses_bad_arguments_before_loading(bad, message, tmp_path, capsys, monkeypatch):
    if "cuda" in " ".join(bad) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    existing = tmp_path / "FILE"
    existing.write_text("keep")
    bad = [str(existing) if item == "FILE" else item for item in bad]
    out = ["--out", str(tmp_path / "results")] if "--out" not in bad else []
    import hf_posext.evaluation.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
    argv = ["eval", "perplexity", "--model", "some/model", "--methods", "none", "--lengths", "64", *out, *bad]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert existing.read_text() == "keep" and not (tmp_path / "results").exists()


@pytest.mark.parametrize("task", ["perplexity", "passkey"])
def test_eval_no_progress_draws_no_progress_bar(task, tmp_path, capsys):
    # Was: --no-progress still drew the grid's bars and transformers' "Loading weights" bar
    text = tmp_path / "text.txt"
    text.write_text("Some words to read here. " * 200)
    model = str(Path(__file__).parent / "data" / "training" / "tiny-llama")
    length = "48" if task == "perplexity" else "320"  # a passkey prompt needs room for its filler
    argv = ["eval", task, "--model", model, "--methods", "none", "--lengths", length, "--out", str(tmp_path / "r")]
    argv += ["--data", str(text), "--max-segments", "2"] if task == "perplexity" else ["--depths", "0.5", "--trials", "1", "--no-generate"]
    assert main(argv + ["--overwrite"]) == 0
    drawn = capsys.readouterr().err
    assert f"{task} none @ {length}" in drawn and "Loading weights" in drawn  # the bars this test must see go
    assert main(argv + ["--overwrite", "--no-progress"]) == 0
    quiet = capsys.readouterr().err
    assert "it/s" not in quiet and "%|" not in quiet and "Loading weights" not in quiet, quiet
