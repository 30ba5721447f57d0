"""A saved record edited by hand is not read as true: ``hf_posext.load`` refuses a record that disagrees with the
config it sits in, or whose content no longer matches the digest it was saved with, in one line naming the file and
the field: a contradiction before any weight loads, any other edit before the model is returned."""

from __future__ import annotations

import json
import warnings

import pytest

import hf_posext
from hf_posext.core.errors import RecordError
from hf_posext.models import tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A yarn+string x2 save of a 128-window tiny Llama, and its config.json as written."""
    folder = tmp_path_factory.mktemp("saved") / "yarn-string"
    model = tiny_model("llama", max_position_embeddings=128)
    hf_posext.patch(model, "yarn+string", factor=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text())


def edited(tmp_path, saved, edit):
    """A copy of the save whose config.json has had ``edit`` applied to it."""
    folder, config = saved
    copy = tmp_path / "edited"
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads(json.dumps(config))
    edit(config)
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


def no_weights(monkeypatch):
    import hf_posext.api as api

    monkeypatch.setattr(api, "check_weight_files", lambda *a, **k: pytest.fail("went on to the weights"))


def test_an_unedited_save_loads_and_unpatches_to_its_original_window(saved):
    folder, _ = saved
    model = hf_posext.load(folder)
    assert hf_posext.describe(model).current_window == 256
    hf_posext.unpatch(model)
    assert model.config.max_position_embeddings == 128


def test_a_record_factor_the_rope_parameters_contradict_is_refused_before_loading(saved, tmp_path, monkeypatch):
    def edit(config):
        config["hf_posext"]["frequency_scaling"]["factor"] = 4.0  # rope_parameters still say x2

    folder = edited(tmp_path, saved, edit)
    no_weights(monkeypatch)
    with pytest.raises(RecordError) as refused:
        hf_posext.load(folder)
    message = str(refused.value)
    assert message.startswith(f"{folder / 'config.json'}") and "'hf_posext'.frequency_scaling.factor is 4" in message, message
    assert "rope_parameters" in message and "factor 2" in message and "\n" not in message


def test_an_edited_original_config_is_refused_by_the_records_digest(saved, tmp_path):
    def edit(config):
        config["hf_posext"]["frequency_scaling"]["original_config"]["max_position_embeddings"] = 4096

    folder = edited(tmp_path, saved, edit)
    with pytest.raises(RecordError) as refused:  # after the backends' own checks (which name the field they refuse)
        hf_posext.load(folder)
    message = str(refused.value)
    assert message.startswith(f"{folder / 'config.json'}") and "was edited after hf_posext saved it" in message, message
    assert "re-save the model with hf_posext" in message and "\n" not in message


def test_a_record_saved_before_digests_still_loads_and_says_it_is_not_checked(saved, tmp_path):
    """A record without a digest (saved before digests, or the digest removed by hand) loads, with one warning line
    saying a hand edit of it cannot be detected; a sealed record loads without it."""
    import warnings

    def edit(config):
        config["hf_posext"].pop("digest")
        config["hf_posext"]["frequency_scaling"].pop("digest", None)

    with pytest.warns(UserWarning, match=r"field 'hf_posext' has no digest \(saved by a release before digests, or removed "
                                         r"by hand\), so a hand edit of it cannot be detected; re-save the model") as seen:
        model = hf_posext.load(edited(tmp_path, saved, edit))
    assert hf_posext.describe(model).current_window == 256
    assert all("\n" not in str(w.message) for w in seen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_posext.load(saved[0])


def test_a_folder_of_a_model_type_transformers_lacks_is_refused_in_one_line_before_loading(tmp_path):
    import json

    import hf_posext
    from hf_posext.models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="llama99", transformers_version="9.0.0")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        hf_posext.load(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "holds a 'llama99' model, which transformers" in message
    assert "it was saved by transformers 9.0.0: load it with a transformers that has 'llama99' (>= 9.0.0)." in message


def test_a_folder_this_transformers_saved_but_cannot_read_back_says_so_instead_of_asking_for_itself(tmp_path):
    """transformers 5.0 saves Clvp's, Emu3's and Mllama's text models under a model type its AutoConfig lacks: the
    refusal named the installed release as the one to load it with."""
    import json

    import transformers

    import hf_posext
    from hf_posext.models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="llama_text_only", transformers_version=transformers.__version__)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        hf_posext.load(tmp_path)
    message = str(info.value)
    assert "\n" not in message and f"which transformers {transformers.__version__} (installed) saves but cannot load back" in message
    assert ">=" not in message and "a later transformers release whose AutoConfig has it" in message
