"""Adapters carry what they were trained on, in PEFT's own format, with checksums: stock tools read them right,
and another base model (name or weights), another scaling or a damaged file is refused before anything loads."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import hf_posext
from hf_posext.adapters import (
    ADAPTER_RECORD, EXTRAS_FILE, MANIFEST_FILE, AdapterFileError, AdapterMismatchError, check_adapter, convert_adapter,
    finish_adapter_folder, load_adapted_model, read_adapter_record, save_merged, trained_module_names,
)
from hf_posext.cli import main
from hf_posext.core.errors import RecordError
from tests.training_helpers import TINY_MODEL, one_thread, tiny_config  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

IDS = torch.randint(0, 100, (1, 200), generator=torch.Generator().manual_seed(0))  # 200 > the base's window of 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from hf_posext.training.trainer import train

    out = tmp_path_factory.mktemp("adapter-run") / "run"
    train(tiny_config(out, "train.max_steps=4"), progress=False)
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def _base_model():
    from hf_posext.models import load_model

    return load_model(str(TINY_MODEL))


def as_old_format(adapter: Path, folder: Path) -> Path:
    """The adapter as recipes wrote it before: trained norms/embeddings in trainable_extras.safetensors, PEFT's
    modules_to_save null, a cache path as base_model_name_or_path, no manifest and no weights fingerprint."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, folder)
    (folder / MANIFEST_FILE).unlink()
    config = json.loads((folder / "adapter_config.json").read_text())
    modules = config["modules_to_save"]
    weights = load_file(str(folder / "adapter_model.safetensors"))
    lora = {k: v for k, v in weights.items() if "lora_" in k}
    extras = {k[len("base_model.model."):]: v for k, v in weights.items()
              if "lora_" not in k and k[len("base_model.model."):].rsplit(".", 1)[0] in modules}
    save_file(lora, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_file(extras, str(folder / EXTRAS_FILE))
    config.update(modules_to_save=None, ensure_weight_tying=False, base_model_name_or_path="/root/.cache/hf_posext/tiny")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    record.pop("base_weights")
    (folder / ADAPTER_RECORD).write_text(json.dumps({**record, "version": 1}))
    return folder


def _copy(run, tmp_path, name="adapter") -> Path:
    folder = tmp_path / name
    shutil.copytree(run / "adapter", folder)
    return folder


def test_the_recipe_writes_the_record(run):
    record = read_adapter_record(run / "adapter")
    assert (record.base_model, record.method, record.factor) == (str(TINY_MODEL), "yarn", 4.0)
    assert (record.original_window, record.current_window) == (64, 256)
    assert set(record.base_weights) == {"float32", "bfloat16"} and record.base_weights["float32"].startswith("sha256-all:")


def test_the_adapter_is_in_peft_format_with_a_hub_reader_base_name(run):
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(TINY_MODEL)  # a path the user gave stays as given
    assert "model.norm" in config["modules_to_save"] and "model.embed_tokens" in config["modules_to_save"]
    assert config["ensure_weight_tying"] is True  # the tiny model ties its head to the trained embeddings
    assert sorted(p.name for p in (run / "adapter").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", MANIFEST_FILE, ADAPTER_RECORD]
    listed = json.loads((run / "adapter" / MANIFEST_FILE).read_text())["files"]
    assert sorted(listed) == ["README.md", "adapter_config.json", "adapter_model.safetensors", ADAPTER_RECORD]


def test_the_weights_file_has_exactly_the_keys_peft_writes(run, tmp_path):
    # PEFT itself, asked for the same LoRA and modules_to_save on the same model, writes the same keys and config
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open

    ours = json.loads((run / "adapter" / "adapter_config.json").read_text())
    native = get_peft_model(_base_model(), LoraConfig(
        r=ours["r"], lora_alpha=ours["lora_alpha"], target_modules=ours["target_modules"], modules_to_save=ours["modules_to_save"],
        ensure_weight_tying=True, task_type="CAUSAL_LM"))
    native.save_pretrained(tmp_path / "native")
    shapes = {}
    for folder in (run / "adapter", tmp_path / "native"):
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as handle:
            shapes[folder.name] = {k: (tuple(handle.get_slice(k).get_shape()), handle.get_slice(k).get_dtype()) for k in handle.keys()}
    assert shapes["adapter"] == shapes["native"]
    assert "base_model.model.lm_head.weight" in shapes["native"]  # the tied head, as PEFT saves it
    theirs = json.loads((tmp_path / "native" / "adapter_config.json").read_text())
    assert (sorted(ours["modules_to_save"]), ours["ensure_weight_tying"]) == (sorted(theirs["modules_to_save"]), theirs["ensure_weight_tying"])


def test_module_names_wrap_exactly_the_trained_modules():
    # PEFT matches modules_to_save by string suffix: the names must not catch untrained modules (layers.1 vs 11)
    from peft import LoraConfig, get_peft_model

    from hf_posext.models import tiny_model
    from hf_posext.training.lora import extra_parameter_names

    model = tiny_model("llama", num_hidden_layers=12)
    trained = [n for n in extra_parameter_names(model, False, True) if "layers.1." in n or n == "model.norm.weight"]
    names, tied = trained_module_names(model, trained)
    assert tied is None and names == ["model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=names, task_type="CAUSAL_LM"))
    found = {n[len("base_model.model."):-len(".modules_to_save")] for n, _ in wrapped.named_modules() if n.endswith(".modules_to_save")}
    assert found == set(names)

    class Nested(torch.nn.Module):  # "norm" is a suffix of "block.norm": PEFT would wrap both
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4)
            self.block = torch.nn.Module()
            self.block.norm = torch.nn.LayerNorm(4)

    with pytest.raises(ValueError, match=r"would also wrap \['block.norm'\]"):
        trained_module_names(Nested(), ["norm.weight", "norm.bias"])
    with pytest.raises(ValueError, match="trained only in part"):
        trained_module_names(Nested(), ["norm.weight"])


def test_stock_transformers_and_peft_give_the_logits_of_load_adapted_model(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # a base folder whose config carries the scaling, as hf_posext.patch + save_pretrained write it
    hf_posext.patch(_base_model(), "yarn", factor=4).save_pretrained(tmp_path / "base")
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), run / "adapter")
    want = _logits(load_adapted_model(str(TINY_MODEL), run / "adapter"))
    got = _logits(stock)
    gap = float((got - want).abs().max())
    # the same adapter in the older format: stock PEFT drops the trained norms/embeddings and builds another model
    old = as_old_format(run / "adapter", tmp_path / "old")
    dropped = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), old))
    unscaled = _logits(PeftModel.from_pretrained(_base_model(), run / "adapter"))  # positions matter to this base
    assert gap <= 1e-5, gap
    assert float((dropped - want).abs().max()) >= 100 * max(gap, 1e-6)
    assert float((unscaled - want).abs().max()) >= 100 * max(gap, 1e-6)


def test_adapter_applied_to_its_base_equals_the_merged_model(run):
    # load_adapted_model rebuilds what the recipe merged: base + yarn x4 + LoRA + trained norms and embeddings
    adapted = load_adapted_model(str(TINY_MODEL), run / "adapter")
    merged = hf_posext.load(run / "merged")
    assert hf_posext.describe(adapted).method == "yarn" and hf_posext.describe(adapted).factor == 4.0
    got, want = _logits(adapted), _logits(merged)
    base = _logits(hf_posext.patch(_base_model(), "yarn", 4))
    gap = float((got - want).abs().max())
    effect = float((base - want).abs().max())  # what the adapter changes: the thing this test guards
    assert gap <= 1e-5 and effect >= 100 * max(gap, 1e-7), (gap, effect)


def test_an_old_adapter_loads_with_a_warning_and_converts_to_the_same_model(run, tmp_path):
    from peft import PeftModel

    old = as_old_format(run / "adapter", tmp_path / "old")
    want = _logits(load_adapted_model(str(TINY_MODEL), run / "adapter"))
    with pytest.warns(UserWarning) as caught:
        old_logits = _logits(load_adapted_model(str(TINY_MODEL), old))
    messages = [str(w.message) for w in caught]
    assert any(f"has no {MANIFEST_FILE}" in m and "hf-posext adapter convert" in m for m in messages)
    assert any("records no fingerprint of its base model's weights" in m for m in messages)
    assert all("\n" not in m for m in messages)
    assert torch.equal(old_logits, want)
    assert main(["adapter", "convert", str(old), str(tmp_path / "new")]) == 0
    new = tmp_path / "new"
    assert not (new / EXTRAS_FILE).exists() and (new / MANIFEST_FILE).is_file()
    assert read_adapter_record(new).base_weights == read_adapter_record(run / "adapter").base_weights
    assert json.loads((new / "adapter_config.json").read_text())["base_model_name_or_path"] == str(TINY_MODEL)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # a converted adapter loads without hf-posext's warnings
        warnings.simplefilter("always")
        assert torch.equal(_logits(load_adapted_model(str(TINY_MODEL), new)), want)
    assert not [w for w in caught if "adapter" in str(w.message)]
    stock = PeftModel.from_pretrained(hf_posext.patch(_base_model(), "yarn", 4), new)
    assert float((_logits(stock) - want).abs().max()) <= 1e-5
    convert_adapter(new)  # in place, again: the same files but the manifest's listing
    assert torch.equal(_logits(load_adapted_model(str(TINY_MODEL), new)), want)


def test_an_old_adapter_continues_as_init_adapter_like_its_conversion(run, tmp_path):
    # a recipe continuing the old format or its conversion starts from the same weights, trained in place
    from hf_posext.models import load_model
    from hf_posext.training.lora import check_init_adapter, setup_trainable

    old = as_old_format(run / "adapter", tmp_path / "old")
    convert_adapter(old, tmp_path / "new")
    states = []
    for folder in (old, tmp_path / "new"):
        config = tiny_config(tmp_path / "next", f"finetune.init_adapter={folder}").validate()
        check_init_adapter(config.finetune, config.model.name, "yarn", 4.0)
        model = setup_trainable(hf_posext.patch(load_model(str(TINY_MODEL)), "yarn", 4), config.finetune)
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
        assert not any("modules_to_save" in n for n in states[-1])  # the same model a fresh recipe trains
    assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.parametrize("base,method,factor,expected", [
    ("other-model", None, None, r"trained on base model '.*tiny-llama' \(posext_adapter.json\), not 'other-model': pass --model .*tiny-llama"),
    (None, "dynamic-ntk", None, r"trained with yarn x4 \(posext_adapter.json\), not dynamic-ntk x4: evaluate it without --methods \(it runs the scaling it was trained with\) or with --methods yarn:factor=4 "),
    (None, "yarn", 8.0, r"trained with yarn x4 \(posext_adapter.json\), not yarn x8"),
    (None, "none", None, r"not none x4"),
])
def test_another_base_or_scaling_is_refused_naming_both(run, base, method, factor, expected):
    with pytest.raises(AdapterMismatchError, match=expected) as raised:
        check_adapter(run / "adapter", base or str(TINY_MODEL), method, factor)
    assert "\n" not in str(raised.value)


def test_a_target_length_is_resolved_against_the_recorded_window(run):
    assert check_adapter(run / "adapter", str(TINY_MODEL), "yarn", target_length=256).factor == 4.0
    with pytest.raises(AdapterMismatchError, match=r"not yarn x8 \(target_length 512\)"):
        check_adapter(run / "adapter", str(TINY_MODEL), "yarn", target_length=512)


def test_a_recipe_continuing_a_x4_adapter_at_a_x8_target_length_is_refused(run, tmp_path):
    from hf_posext.training.config import ConfigError
    from hf_posext.training.trainer import train

    out = tmp_path / "next"
    config = tiny_config(out, f"finetune.init_adapter={run / 'adapter'}", "scaling.factor=null", "scaling.target_length=512")
    with pytest.raises(ConfigError, match=r"finetune.init_adapter: .*trained with yarn x4 .*not yarn x8 \(target_length 512\)"):
        train(config, progress=False)
    assert not out.exists()


def test_another_base_with_the_same_name_is_refused_by_its_weights(run, tmp_path):
    # the record names a folder; the folder now holds other weights (retrained in place): refused, naming both
    from transformers import AutoModelForCausalLM

    other = tmp_path / "base"
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    model.save_pretrained(other)
    folder = _copy(run, tmp_path)
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    (folder / ADAPTER_RECORD).write_text(json.dumps({**record, "base_model": str(other)}))
    finish_adapter_folder(folder)
    with pytest.raises(AdapterMismatchError, match=r"now holds other weights than the adapter .* was trained on \(its float32 "
                                                   r"weights are sha256-all:\w+\.\.\., the adapter's posext_adapter.json records "
                                                   r"sha256-all:\w+") as raised:
        load_adapted_model(str(other), folder)
    assert "\n" not in str(raised.value)
    # bfloat16 is checked against the recorded bfloat16 fingerprint: the original base passes, the other does not
    load_adapted_model(str(TINY_MODEL), run / "adapter", dtype=torch.bfloat16)
    with pytest.raises(AdapterMismatchError, match="its bfloat16 weights"):
        load_adapted_model(str(other), folder, dtype=torch.bfloat16)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _no_model_load(monkeypatch):
    import hf_posext.models

    def refuse(*args, **kwargs):
        raise AssertionError("the base model was loaded before the adapter was checked")

    monkeypatch.setattr(hf_posext.models, "load_model", refuse)


def test_a_flipped_byte_or_an_unlisted_file_is_refused_before_the_base_loads(run, tmp_path, monkeypatch):
    folder = _copy(run, tmp_path)
    _flip_a_byte(folder / "adapter_model.safetensors")
    _no_model_load(monkeypatch)
    with pytest.raises(AdapterFileError, match=r"adapter_model.safetensors does not match its sha256 in checksums.json") as raised:
        load_adapted_model(str(TINY_MODEL), folder)
    assert "\n" not in str(raised.value)
    other = _copy(run, tmp_path, "unlisted")
    (other / "notes.txt").write_text("added later")
    with pytest.raises(AdapterFileError, match=r"holds notes.txt, which checksums.json does not list"):
        load_adapted_model(str(TINY_MODEL), other)
    monkeypatch.undo()
    load_adapted_model(str(TINY_MODEL), run / "adapter")  # the intact folder passes the same checks


def test_every_path_that_applies_an_adapter_checks_its_files(run, tmp_path, capsys):
    from hf_posext.evaluation.loading import load_model_and_tokenizer
    from hf_posext.training.lora import check_init_adapter

    folder = _copy(run, tmp_path)
    _flip_a_byte(folder / "adapter_model.safetensors")
    config = tiny_config(tmp_path / "next", f"finetune.init_adapter={folder}").validate()
    with pytest.raises(AdapterFileError, match="adapter_model.safetensors does not match"):
        check_init_adapter(config.finetune, config.model.name, "yarn", 4.0)
    with pytest.raises(AdapterFileError, match="adapter_model.safetensors does not match"):
        load_model_and_tokenizer(str(TINY_MODEL), adapter=str(folder))
    from tests.training_helpers import TINY_CORPUS, TINY_RECIPE

    train = ["train", "--config", str(TINY_RECIPE), f"model.name={TINY_MODEL}", f"data.source={TINY_CORPUS}",
             f"output.dir={tmp_path / 'next'}", f"finetune.init_adapter={folder}"]
    assert main(train) == 1  # a damaged file: a runtime error, named, before the run folder exists
    # `hf-posext train` prints first the dtype it chose (one line of its own), then the error in one line
    err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("dtype: "))
    assert "finetune.init_adapter: " in err and "adapter_model.safetensors does not match its sha256" in err and "\n" not in err
    assert not (tmp_path / "next").exists()
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(folder), "--methods", "yarn",
            "--lengths", "64", "--data", str(TINY_MODEL.parent / "corpus"), "--out", str(tmp_path / "results")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "adapter_model.safetensors does not match its sha256" in err and "\n" not in err
    assert not (tmp_path / "results").exists()


def test_a_truncated_weights_file_of_an_adapter_without_manifest_is_named_before_the_base_loads(run, tmp_path, monkeypatch):
    old = as_old_format(run / "adapter", tmp_path / "old")
    path = old / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    _no_model_load(monkeypatch)
    with pytest.raises(AdapterFileError, match=r"adapter_model.safetensors is truncated or corrupt \(") as raised:
        load_adapted_model(str(TINY_MODEL), old)
    assert "\n" not in str(raised.value) and "SafetensorError" not in type(raised.value).__name__


def test_a_truncated_adapter_config_is_named_and_the_cli_exits_1(run, tmp_path, capsys):
    old = as_old_format(run / "adapter", tmp_path / "old")
    path = old / "adapter_config.json"
    path.write_text(path.read_text()[:40])
    with pytest.raises(AdapterFileError, match=r"adapter_config.json is not readable JSON .*restore the adapter folder"):
        check_adapter(old, str(TINY_MODEL))
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(old), "--methods", "yarn",
            "--lengths", "64", "--data", str(TINY_MODEL.parent / "corpus"), "--out", str(tmp_path / "results")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "adapter_config.json is not readable JSON" in err and "\n" not in err
    assert main(["adapter", "verify", str(old)]) == 1


def test_the_eval_command_refuses_a_mismatch_before_loading_or_writing(run, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--methods", "yarn",
            "--factor", "8", "--lengths", "64", "--data", str(TINY_MODEL.parent / "corpus"), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "trained with yarn x4" in err and "not yarn x8" in err and "\n" not in err
    assert not out.exists()


def test_the_eval_command_without_methods_runs_the_adapter_at_its_own_scaling(run, tmp_path):
    """No --methods with --adapter: the scaling the adapter was trained with (yarn x4), not the default comparison
    (none,yarn,dynamic-yarn), whose unscaled row the adapter refuses."""
    out = tmp_path / "results"
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--lengths", "128",
            "--data", str(TINY_MODEL.parent / "corpus"), "--max-segments", "1", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    (results,) = out.glob("perplexity-*.json")
    assert [(c["method"], c["factor"]) for c in json.loads(results.read_text())["cells"].values()] == [("yarn", 4.0)]


def test_the_eval_command_runs_the_adapter_with_its_scaling(run, tmp_path):
    out = tmp_path / "results"
    # no --factor: the adapter's x4, not longest length / window (128 / 64 = 2)
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--methods", "yarn",
            "--lengths", "128", "--data", str(TINY_MODEL.parent / "corpus"), "--max-segments", "1",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    (results,) = out.glob("perplexity-*.json")
    data = json.loads(results.read_text())
    assert data["config"]["model"] == f"{TINY_MODEL}+{run / 'adapter'}"
    (cell,) = data["cells"].values()
    assert cell["factor"] == 4.0
    merged = ["eval", "perplexity", "--model", str(run / "merged"), "--methods", "yarn", "--factor", "4", "--lengths", "128",
              "--data", str(TINY_MODEL.parent / "corpus"), "--max-segments", "1", "--out", str(tmp_path / "merged"), "--no-progress"]
    assert main(merged) == 0
    (reference,) = json.loads(next((tmp_path / "merged").glob("perplexity-*.json")).read_text())["cells"].values()
    assert cell["nll"] == pytest.approx(reference["nll"], abs=1e-5)


def test_save_merged_writes_model_and_tokenizer(run, tmp_path):
    out = save_merged(str(TINY_MODEL), run / "adapter", tmp_path / "merged")
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256
    got = _logits(hf_posext.load(out))
    assert float((got - _logits(load_adapted_model(str(TINY_MODEL), run / "adapter"))).abs().max()) <= 1e-5
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        save_merged(str(TINY_MODEL), run / "adapter", out)


@pytest.mark.parametrize("content,expected", [
    ("{", "is not readable JSON"),
    ('{"base_model": "m", "method": "yarn", "factor": "4"}', "has factor '4', not a number"),
    ('{"base_model": "m", "method": "yarn", "factor": 0.5}', "not a number >= 1"),
    ('[1]', "holds a JSON list"),
])
def test_a_damaged_record_is_named(run, tmp_path, content, expected):
    folder = _copy(run, tmp_path)
    (folder / ADAPTER_RECORD).write_text(content)
    with pytest.raises(RecordError, match=expected):
        read_adapter_record(folder)


def test_an_adapter_without_a_record_or_a_folder_that_is_not_an_adapter(run, tmp_path):
    folder = _copy(run, tmp_path)
    (folder / ADAPTER_RECORD).unlink()
    with pytest.raises(FileNotFoundError, match="has no posext_adapter.json"):
        read_adapter_record(folder)
    with pytest.raises(FileNotFoundError, match="is not a LoRA adapter folder"):
        read_adapter_record(tmp_path)


def test_parameters_are_compared_only_where_given(run):
    # the record holds yarn's resolved defaults (beta_fast=32, ...): not giving them is no mismatch, another value is
    assert check_adapter(run / "adapter", str(TINY_MODEL), "yarn", 4, {}).factor == 4.0
    assert check_adapter(run / "adapter", str(TINY_MODEL), "yarn", 4, {"beta_fast": 32}).method == "yarn"
    with pytest.raises(AdapterMismatchError, match=r"trained with yarn x4 beta_fast=32.0 .*not yarn x4 beta_fast=16"):
        check_adapter(run / "adapter", str(TINY_MODEL), "yarn", 4, {"beta_fast": 16})


def test_the_adapter_folder_carries_a_model_card_for_a_hub_reader(run):
    card = (run / "adapter" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n")  # a local base is no hub id: no base_model field
    assert "yarn` x4" in card and "window 256 tokens" in card and "PoSE: 32-token sequences" in card
    assert "4 steps" in card and "training loss" in card and "--adapter ADAPTER_DIR --methods yarn" in card
    assert "PeftModel.from_pretrained(base, 'ADAPTER_DIR')" in card and "peft=ADAPTER_DIR" in card
    assert str(TINY_MODEL.parent) not in card and "/root" not in card and "issue" not in card.lower()


def test_the_model_card_of_an_embedded_base_names_its_hub_id_and_keeps_measurements(tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.model_card import adapter_model_card, measured_section
    from tests.training_helpers import TINY_RECIPE

    record = {"base_model": "smollm2-135m", "method": "yarn", "factor": 4.0, "original_window": 8192, "current_window": 32768}
    config = load_config(TINY_RECIPE, ["data.source=/root/secret/books", "finetune.init_adapter=/root/runs/stage1/adapter"])
    old = "# x\n\n## Measured\n\n| | ppl |\n|---|---:|\n| this | 23.9 |\n\nPasskey 50/50 (issue 26's target: 95 %).\n"
    card = adapter_model_card(config, record, tmp_path / "log.jsonl", measured=measured_section(old))
    assert card.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n")
    assert "from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct')" in card and "load_adapted_model('smollm2-135m'" in card
    assert "| this | 23.9 |" in card and "the target set for this adapter: 95 %" in card
    assert "/root" not in card and "issue" not in card.lower()
    assert "`books`" in card and "`stage1/adapter`" in card


def test_the_model_card_names_far_pose_samples(tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.model_card import adapter_model_card
    from tests.training_helpers import TINY_RECIPE

    record = {"base_model": "tiny", "method": "yarn", "factor": 4.0, "original_window": 64, "current_window": 256}
    plain = adapter_model_card(load_config(TINY_RECIPE), record, tmp_path / "log.jsonl")
    far = adapter_model_card(load_config(TINY_RECIPE, ["data.pose_far_fraction=0.25"]), record, tmp_path / "log.jsonl")
    assert "pose_far_fraction" not in plain
    assert "25% of them with their last chunk at the end of that span (data.pose_far_fraction)" in far


def test_the_model_card_names_the_varied_retrieval_wording(tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.model_card import adapter_model_card
    from tests.training_helpers import TINY_RECIPE

    record = {"base_model": "tiny", "method": "yarn", "factor": 4.0, "original_window": 64, "current_window": 256}
    fixed = adapter_model_card(load_config(TINY_RECIPE, ["data.retrieval_records=2"]), record, tmp_path / "log.jsonl")
    varied = adapter_model_card(load_config(TINY_RECIPE, ["data.retrieval_records=2", "data.retrieval_wording=varied"]),
                                record, tmp_path / "log.jsonl")
    assert "Retrieval samples" in fixed and "retrieval_wording" not in fixed
    assert ("asks for them at the end (`hf_posext.training.retrieval_data`), each record and each question in one of "
            "several wordings (`data.retrieval_wording: varied`), trained on") in varied


def test_a_run_whose_gradient_goes_non_finite_stops_naming_the_step(run, tmp_path, monkeypatch):
    # an init adapter with NaN LoRA weights (re-signed: a diverged run elsewhere) used to train to finished: true
    import hf_posext.adapters.checks
    from safetensors.torch import load_file, save_file

    from hf_posext.training.trainer import NonFiniteTrainingError, train

    folder = _copy(run, tmp_path)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_B" in k)
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    finish_adapter_folder(folder)
    out = tmp_path / "next"
    with pytest.raises(AdapterFileError, match=r"lora_B.weight is not finite"):  # refused before anything loads
        train(tiny_config(out, f"finetune.init_adapter={folder}", "train.max_steps=3"), progress=False)
    # past that check (weights that go non-finite in training itself), the trainer stops at the step
    monkeypatch.setattr(hf_posext.adapters.checks, "tensor_problem", lambda path: None)
    with pytest.raises(NonFiniteTrainingError, match=r"training stopped at step 1: the gradient norm is nan \(not finite\)") as raised:
        train(tiny_config(out, f"finetune.init_adapter={folder}", "train.max_steps=3"), progress=False)
    assert "\n" not in str(raised.value)
    assert not (out / "adapter").exists() and not (out / "train_result.json").exists()


def test_an_attention_method_stacks_on_the_adapters_frequency_scaling_in_one_call(run):
    """``yarn+string`` on a yarn x4 adapter: its frequency part is checked against the record, STRING is stacked at
    evaluation (nothing of it trained); ``load_adapted_model(..., method=...)`` does it in the one call."""
    from hf_posext.core.request import ScalingRequest

    assert check_adapter(run / "adapter", str(TINY_MODEL), "yarn+string", 4.0, {"string.local_value": 8}).method == "yarn"
    with pytest.raises(AdapterMismatchError, match=r"trained with yarn x4 .*not ntk x4.*stacked on it: yarn\+string:factor=4"):
        check_adapter(run / "adapter", str(TINY_MODEL), "ntk+string", 4.0)
    with pytest.raises(AdapterMismatchError, match=r"not yarn x8"):
        check_adapter(run / "adapter", str(TINY_MODEL), "yarn+string", 8.0)
    with pytest.raises(AdapterMismatchError, match=r"beta_fast"):
        check_adapter(run / "adapter", str(TINY_MODEL), "yarn+string", 4.0, {"yarn.beta_fast": 8.0})
    one_call = load_adapted_model(str(TINY_MODEL), run / "adapter", method="yarn+string")
    report = hf_posext.describe(one_call)
    assert report.method == "yarn+string" and report.parts[1].params["shifted_offset"] == int(0.33 * 256)
    two_steps = load_adapted_model(str(TINY_MODEL), run / "adapter")
    adapter_alone = _logits(two_steps)
    hf_posext.patch(two_steps, "yarn+string", factor=4)
    assert torch.equal(_logits(one_call), _logits(two_steps))
    assert (_logits(one_call) - adapter_alone).abs().max() > 1e-4  # STRING is really on (the comparison above is exact)
    with pytest.raises(ValueError, match="Unknown method 'strng'"):
        load_adapted_model(str(TINY_MODEL), run / "adapter", method="yarn+strng")
    assert ScalingRequest.from_kwargs("yarn+string", 4).parts[0].method == "yarn"


def test_a_recipe_mismatch_names_recipe_keys_not_evaluation_flags(run):
    with pytest.raises(AdapterMismatchError, match=r"set scaling.method: yarn and scaling.factor: 4 in the recipe"):
        check_adapter(run / "adapter", str(TINY_MODEL), "ntk", 4.0, suggest="recipe")
    with pytest.raises(AdapterMismatchError, match=r"set model.name: .*tiny-llama in the recipe"):
        check_adapter(run / "adapter", "other-model", suggest="recipe")


def test_the_readme_route_on_the_tiny_model_train_load_in_one_call_evaluate_with_string(run, tmp_path):
    """README's three steps on the tiny model: the recipe's adapter, ``load_adapted_model(..., method="yarn+string")``
    and ``hf-posext eval ... --adapter DIR --methods yarn+string`` (the adapter's yarn x4 checked, STRING on top)."""
    cells = {}
    for method in ("yarn", "yarn+string"):
        out = tmp_path / method
        argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--methods", method,
                "--lengths", "200", "--data", str(TINY_MODEL.parent / "corpus"), "--max-segments", "1", "--out", str(out),
                "--no-progress"]
        assert main(argv) == 0
        (cells[method],) = json.loads(next(out.glob("perplexity-*.json")).read_text())["cells"].values()
    assert (cells["yarn+string"]["method"], cells["yarn+string"]["factor"]) == ("yarn+string", 4.0)
    assert cells["yarn+string"]["nll"] != cells["yarn"]["nll"]  # 200 tokens > S = 84: STRING changes the scores
    one_call = load_adapted_model(str(TINY_MODEL), run / "adapter", method="yarn+string")
    assert hf_posext.describe(one_call).method == "yarn+string"
    wrong = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--methods", "ntk+string",
             "--lengths", "200", "--data", str(TINY_MODEL.parent / "corpus"), "--out", str(tmp_path / "x"), "--no-progress"]
    assert main(wrong) == 2 and not (tmp_path / "x").exists()  # its frequency part is not the adapter's yarn x4


def test_loading_an_adapter_shows_no_peft_deprecation_noise(run):
    """transformers 5 deprecates ``is_gradient_checkpointing``, which PEFT 0.21 reads on every load: that one
    FutureWarning is kept from the user (the demo printed it), no other."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_adapted_model(str(TINY_MODEL), run / "adapter")
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
