"""``--dtype auto``: which dtype each evaluation task runs in (hf_posext.evaluation.loading.evaluation_dtype)."""

from __future__ import annotations

import json

import pytest

from hf_posext.evaluation import loading
from hf_posext.evaluation.loading import evaluation_dtype


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bfloat16_only_for_retrieval_on_a_cpu_that_has_it(monkeypatch, native):
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: native)
    expected = "bfloat16" if native else "float32"
    assert [evaluation_dtype("auto", task, "cpu") for task in ("passkey", "needle", "ruler")] == [expected] * 3
    assert evaluation_dtype("auto", "perplexity", "cpu") == "float32"
    assert evaluation_dtype("auto", "passkey", "cuda") == "float32"
    assert evaluation_dtype("auto", "passkey", None) == "float32"  # --device-map: spread over accelerators
    assert evaluation_dtype("float32", "passkey", "cpu") == "float32" and evaluation_dtype("bfloat16", "perplexity", "cpu") == "bfloat16"


def test_the_passkey_cli_keys_its_cells_by_the_dtype_it_ran(monkeypatch, tmp_path):
    """A run under ``auto`` records the resolved dtype, so a later float32 run never reads its cells."""
    from hf_posext.cli import main

    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: True)
    common = ["eval", "passkey", "--model", "tiny:llama:512", "--methods", "none", "--lengths", "400", "--trials", "1", "--depths", "0.5",
              "--device", "cpu", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "auto")]) == 0
    assert main([*common, "--out", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    (auto,) = (tmp_path / "auto").glob("passkey-*.json")
    (fp32,) = (tmp_path / "fp32").glob("passkey-*.json")
    assert json.loads(auto.read_text())["config"]["dtype"] == "bfloat16"
    assert json.loads(fp32.read_text())["config"]["dtype"] == "float32"


@pytest.mark.parametrize("native", [True, False])
def test_the_auto_note_names_each_dtype_and_why(monkeypatch, native):
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: native)
    note = loading.auto_dtype_note(["perplexity", "ruler", "ruler", "passkey"], "cpu")
    if native:
        assert note.startswith("--dtype auto: float32 for perplexity; bfloat16 for ruler, passkey (this CPU runs bfloat16 natively")
    else:
        assert note.startswith("--dtype auto: float32 for perplexity, ruler, passkey (this CPU has no native bfloat16")
    assert loading.auto_dtype_note(["passkey"], "cuda") == "--dtype auto: float32 for passkey (float32 off the CPU; pass --dtype bfloat16 to choose it)"


def test_the_passkey_cli_says_what_auto_chose(monkeypatch, tmp_path, capsys):
    from hf_posext.cli import main

    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: False)
    assert main(["eval", "passkey", "--model", "tiny:llama:512", "--methods", "none", "--lengths", "400", "--trials", "1", "--depths", "0.5",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path)]) == 0
    assert "dtype: float32 (auto: this CPU has no native bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["perplexity", "passkey"])
def test_an_eval_task_prints_its_dtype_and_why_first_even_when_given(tmp_path, capsys, task):
    from hf_posext.cli import main

    extra = ["--trials", "1", "--depths", "0.5"] if task == "passkey" else ["--data", "tests/data/training/corpus"]
    assert main(["eval", task, "--model", "tiny:llama:512", "--methods", "none", "--lengths", "400", "--device", "cpu",
                 "--no-progress", "--out", str(tmp_path), "--dtype", "float32", *extra]) == 0
    assert capsys.readouterr().err.splitlines()[0] == "dtype: float32 (--dtype float32, as given)"


@pytest.mark.parametrize("native", [True, False])
def test_resolve_dtype_says_which_dtype_and_why(monkeypatch, native):
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: native)
    monkeypatch.setattr(loading, "native_bfloat16_feature", lambda: "AMX-BF16")
    dtype, why = loading.resolve_dtype("auto", "passkey", "cpu")
    if native:
        assert dtype == "bfloat16" and why.startswith("auto: this CPU has AMX-BF16") and "--dtype float32" in why
        assert loading.resolve_dtype("auto", ["perplexity", "ruler"], "cpu")[0] == "float32 for perplexity; bfloat16 for ruler"
    else:
        assert (dtype, why) == ("float32", "auto: this CPU has no native bfloat16 (AVX-512 BF16 or AMX), where bfloat16 is "
                                           "slower than float32")
    assert loading.resolve_dtype("auto", "perplexity", "cpu")[0] == "float32"
    assert loading.resolve_dtype("auto", "needle", "cuda") == ("float32", "auto: float32 off the CPU; pass --dtype bfloat16 to choose it")
    assert loading.resolve_dtype("bfloat16", "perplexity", "cpu") == ("bfloat16", "--dtype bfloat16, as given")
    assert loading.dtype_line("float32", "why") == "dtype: float32 (why)"


def test_a_dtype_of_another_spelling_is_refused_naming_auto_among_the_choices(tmp_path, capsys):
    from hf_posext.cli import main

    code = main(["eval", "passkey", "--model", "tiny", "--methods", "none", "--lengths", "400", "--depths", "0.5",
                 "--trials", "1", "--no-generate", "--dtype", "AUTO", "--out", str(tmp_path / "out"), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and "'AUTO'" in error and "auto (the default), float32, bfloat16 or float16" in error, error
    assert not (tmp_path / "out").exists()
