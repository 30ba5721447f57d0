"""Checksums prove that an adapter's files are the ones written, not that what was written is sane: weights that are
not finite or far outside any trained adapter's, a record that contradicts itself or its run's recipe, an
adapter_config whose rank its weights do not have, are refused before the base loads, even with checksums
recomputed; ``adapter convert`` never certifies such weights, nor writes into the folder it reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_posext.adapters import ADAPTER_RECORD, MANIFEST_FILE, AdapterFileError, check_adapter, convert_adapter, finish_adapter_folder
from hf_posext.cli import main
from tests.training_helpers import TINY_MODEL, one_thread, tiny_config  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from hf_posext.training.trainer import train

    out = tmp_path_factory.mktemp("adapter-run") / "run"
    train(tiny_config(out, "train.max_steps=4"), progress=False)
    return out


@pytest.fixture
def no_model_load(monkeypatch):
    import hf_posext.models

    monkeypatch.setattr(hf_posext.models, "load_model", lambda *a, **k: pytest.fail("the base model loaded"))


def copied_run(run: Path, tmp_path: Path) -> Path:
    """A copy of the run folder (its adapter beside its train_config.yaml); returns the adapter folder."""
    shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoint-*", "merged"))
    return tmp_path / "run" / "adapter"


def edit_weights(folder: Path, edit, resign: bool = True) -> str:
    """Apply ``edit`` to the first LoRA B matrix of the adapter; recompute the checksums (as a forger would)."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    weights = load_file(str(path))
    name = sorted(k for k in weights if "lora_B" in k)[0]
    weights[name] = edit(weights[name].clone())
    save_file(weights, str(path), metadata={"format": "pt"})
    if resign:
        finish_adapter_folder(folder)
    return name


@pytest.mark.parametrize("edit, problem", [
    (lambda t: t.fill_(2e6), "largest magnitude 2e+06"),
    (lambda t: t.index_fill_(0, torch.tensor([0]), float("nan")), "is not finite (NaN or inf)"),
], ids=["far-out", "nan"])
def test_damaged_weights_under_recomputed_checksums_are_refused_before_the_base_loads(run, tmp_path, no_model_load, edit, problem):
    folder = copied_run(run, tmp_path)
    name = edit_weights(folder, edit)
    with pytest.raises(AdapterFileError) as refused:
        check_adapter(folder, str(TINY_MODEL))
    message = str(refused.value)
    assert message.startswith(f"{folder / 'adapter_model.safetensors'}: tensor {name} ") and problem in message, message
    assert "restore the adapter folder from the training run" in message and "\n" not in message


def test_a_record_edited_to_another_factor_under_recomputed_checksums_is_refused(run, tmp_path, no_model_load):
    folder = copied_run(run, tmp_path)
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    (folder / ADAPTER_RECORD).write_text(json.dumps({**record, "factor": 8.0}))
    finish_adapter_folder(folder)
    with pytest.raises(AdapterFileError, match=r"has factor 8, but its windows 64 -> 256 are x4"):
        check_adapter(folder, str(TINY_MODEL), "yarn", 8.0)
    (folder / ADAPTER_RECORD).write_text(json.dumps({**record, "factor": 8.0, "current_window": 512}))
    finish_adapter_folder(folder)  # the windows edited alike: the run's recipe beside it still says x4
    with pytest.raises(AdapterFileError, match=r"has yarn x8, but the recipe of its run .*train_config.yaml\) says yarn x4"):
        check_adapter(folder, str(TINY_MODEL), "yarn", 8.0)


def test_an_adapter_config_rank_its_weights_lack_is_refused(run, tmp_path, no_model_load):
    folder = copied_run(run, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    finish_adapter_folder(folder)
    with pytest.raises(AdapterFileError, match=r"adapter_config.json has r 8, but .*lora_A.* has rank 4"):
        check_adapter(folder, str(TINY_MODEL))


def test_convert_into_or_inside_its_source_is_refused_before_anything_is_written(run, tmp_path, capsys):
    folder = copied_run(run, tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    for out in (folder / "sub", folder / "sub" / "deeper", folder.parent):
        code = main(["adapter", "convert", str(folder), str(out), "--overwrite"])
        error = capsys.readouterr().err.strip()
        assert code == 2 and "cannot be written inside the adapter folder it converts" in error or \
            code == 2 and "holds the adapter folder it converts" in error, error
        assert len(error.splitlines()) == 1
    assert sorted(p.name for p in folder.iterdir()) == before
    assert main(["adapter", "verify", str(folder)]) == 0


def test_convert_of_an_adapter_without_checksums_refuses_damaged_weights(run, tmp_path, capsys):
    folder = copied_run(run, tmp_path)
    (folder / MANIFEST_FILE).unlink()
    edit_weights(folder, lambda t: t.fill_(float("inf")), resign=False)
    with pytest.warns(UserWarning, match=r"checks its weights") as warned:
        with pytest.raises(AdapterFileError, match="is not finite"):
            convert_adapter(folder)
    assert "no checksums.json" in str(warned[0].message)
    assert not (folder / MANIFEST_FILE).exists()  # nothing certified
    assert main(["adapter", "verify", str(folder)]) == 1
    assert "is not finite" in capsys.readouterr().err


def test_convert_refuses_trained_modules_the_base_does_not_fit(run, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copied_run(run, tmp_path)
    (folder / MANIFEST_FILE).unlink()
    path = folder / "adapter_model.safetensors"
    weights = load_file(str(path))
    name = next(k for k in sorted(weights) if k.endswith("norm.weight"))
    weights[name] = weights[name][: weights[name].shape[0] // 2].clone()  # finite, of trained size, the wrong shape
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(AdapterFileError, match=r"trained module tensor .*norm.weight is \(\d+,\), but the base model's is \(\d+,\)"):
        convert_adapter(folder)
    assert not (folder / MANIFEST_FILE).exists()


def test_a_modules_to_save_entry_the_weights_lack_is_named_before_the_base_loads(run, tmp_path, no_model_load):
    folder = copied_run(run, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["modules_to_save"] = [*config["modules_to_save"], "model.layers.0.mlp_norm"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    finish_adapter_folder(folder)
    with pytest.raises(AdapterFileError) as refused:
        check_adapter(folder, str(TINY_MODEL))
    message = str(refused.value)
    assert "adapter_config.json lists 'model.layers.0.mlp_norm' in modules_to_save, but adapter_model.safetensors holds " \
           "no weights of it" in message and "\n" not in message, message


def test_a_byte_identical_copy_of_the_base_is_accepted_by_its_weights_not_refused_by_its_path(run, tmp_path):
    from hf_posext.adapters import AdapterMismatchError, load_adapted_model

    copy = tmp_path / "base-copy"
    shutil.copytree(TINY_MODEL, copy)
    folder = copied_run(run, tmp_path)
    check_adapter(folder, str(copy))  # the path differs: the weights decide, once they load
    merged = load_adapted_model(str(copy), folder)
    reference = load_adapted_model(str(TINY_MODEL), folder)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, reference(ids).logits)
    from hf_posext.models import tiny_model

    other = tmp_path / "other-base"  # another model at another path: refused by its weights
    tiny_model("llama", seed=5, **_tiny_shape()).save_pretrained(other)
    with pytest.raises(AdapterMismatchError, match="does not have the weights the adapter"):
        load_adapted_model(str(other), folder)


def test_convert_on_a_byte_identical_copy_of_the_base_is_judged_by_its_weights_not_refused_by_its_path(run, tmp_path, capsys):
    """``adapter convert --model COPY`` (the base moved, or copied elsewhere) converts; another model's weights at
    another path are refused in one line, and nothing is written."""
    from hf_posext.models import tiny_model

    copy = tmp_path / "base-copy"
    shutil.copytree(TINY_MODEL, copy)
    folder = copied_run(run, tmp_path)
    assert main(["adapter", "convert", str(folder), str(tmp_path / "converted"), "--model", str(copy)]) == 0
    assert main(["adapter", "verify", str(tmp_path / "converted")]) == 0
    other = tmp_path / "other-base"
    tiny_model("llama", seed=5, **_tiny_shape()).save_pretrained(other)
    capsys.readouterr()
    assert main(["adapter", "convert", str(folder), str(tmp_path / "refused"), "--model", str(other)]) != 0
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # beside the load's bar
    assert "does not have the weights the adapter" in error, error
    assert not (tmp_path / "refused").exists()


def test_an_adapter_without_a_fingerprint_whose_base_folder_is_gone_names_a_fix_that_works(run, tmp_path, capsys):
    """An adapter written before base fingerprints, whose recorded base folder moved: judged by path, its fix named
    the folder that is gone. It now says so and how to record a fingerprint, after which the moved base is taken."""
    from hf_posext.adapters import AdapterMismatchError, load_adapted_model

    gone, moved = tmp_path / "base", tmp_path / "moved-base"
    shutil.copytree(TINY_MODEL, moved)
    folder = copied_run(run, tmp_path)
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    record.pop("base_weights", None)
    (folder / ADAPTER_RECORD).write_text(json.dumps({**record, "base_model": str(gone)}))
    finish_adapter_folder(folder)
    with pytest.raises(AdapterMismatchError) as refused:
        check_adapter(folder, str(moved))
    message = str(refused.value)
    assert f"{gone} no longer exists" in message and "put the base back there" in message, message
    assert f"pass --model {gone}" not in message and "\n" not in message
    gone.symlink_to(moved)  # the fix: the base back at its recorded place, then convert records its fingerprint
    assert main(["adapter", "convert", str(folder)]) == 0
    gone.unlink()
    load_adapted_model(str(moved), folder)  # judged by its weights now
    with pytest.raises(AdapterMismatchError, match=f"{gone} no longer exists: give a local folder holding the base's"):
        check_adapter(folder, "org/other-model")  # a hub id is not judged by weights: the fix names a folder


def test_a_base_folder_that_now_holds_other_weights_names_a_fix_other_than_itself(run, tmp_path):
    from hf_posext.adapters import AdapterMismatchError, load_adapted_model
    from hf_posext.models import tiny_model

    base = tmp_path / "base"
    shutil.copytree(TINY_MODEL, base)
    folder = copied_run(run, tmp_path)
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    (folder / ADAPTER_RECORD).write_text(json.dumps({**record, "base_model": str(base)}))
    finish_adapter_folder(folder)
    tiny_model("llama", seed=5, **_tiny_shape()).save_pretrained(base)  # the folder's weights replaced since
    with pytest.raises(AdapterMismatchError) as refused:
        load_adapted_model(str(base), folder)
    message = str(refused.value)
    assert f"{base} now holds other weights than the adapter {folder} was trained on" in message, message
    assert "restore that folder's weights, or pass a copy of the original base" in message
    assert f"load the base model it was trained on ({base})" not in message


def _tiny_shape() -> dict:
    """The tiny training model's shape (its config), for another model of the same shape."""
    config = json.loads((TINY_MODEL / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")
    return {key: config[key] for key in keys if key in config}
