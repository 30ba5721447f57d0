"""Which base names are one model: the same name, one local folder, or one embedded model under its alias."""

from __future__ import annotations

from hf_posext.adapters.base_weights import same_base_model


def test_an_embedded_model_and_its_alias_are_one_base():
    assert same_base_model("smollm2-135m-instruct", "smollm2-135m")
    assert same_base_model("SmolLM2-135M", "smollm2-135m-instruct")  # names are read in any case
    assert not same_base_model("gemma3-270m", "smollm2-135m")


def test_one_folder_under_two_spellings_is_one_base(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "x").mkdir()
    assert same_base_model(str(tmp_path / "base"), str(tmp_path / "x" / ".." / "base"))
    assert not same_base_model(str(tmp_path / "base"), str(tmp_path / "other"))
