"""The normal save path: what a patched model's ``save_pretrained`` writes and warns.

Per method: stock ``from_pretrained`` of the saved folder gives the patched logits on transformers 5.x and
4.57 (or ``describe`` says why not); the save writes the legacy RoPE fields where transformers 5's generic
config reader (Trainer resume) still reads the folder, and otherwise warns, and then the export loads to the
same logits on 4.57; linear keeps ``max_position_embeddings`` = L; a tokenizer given to ``patch`` saves the
served length.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import hf_posext
from hf_posext.models import tiny_model

L = 64
FACTOR = 4.0
SEQ = 200  # well past L, inside L * FACTOR
LONGROPE_FACTORS = [1.0, 1.5, 3.0, 4.5]  # tiny Llama: rotary dim 8 -> 4 frequencies
REPO = Path(__file__).resolve().parents[1]
TF457_PYTHON = Path(os.environ.get("HF_POSEXT_TF457_PYTHON", REPO / ".venv-tf457" / "bin" / "python"))


def test_dynamic_ntk_is_stock_loadable_on_a_smollm2_shaped_llama():
    """Head dim 64, theta 1e5, L 8192 (SmolLM2-135M's rotary shape), x8: the patch-time check must accept it.

    transformers computes the dynamic base from a 0-d int64 tensor, i.e. in float32; a float64 base was
    a few ulps off, which position 65535 turned into 1.9e-3 in cos/sin, and the check rejected the method.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny_model("llama", hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                       max_position_embeddings=8192, rope_theta=1e5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(model, "dynamic-ntk", 8.0)
    assert hf_posext.describe(model).stock_loadable is True
    rotary = model.model.rotary_emb
    for length in (8193, 20000, 65536):
        ours, _ = rotary.frequencies(length)
        stock, _ = ROPE_INIT_FUNCTIONS["dynamic"](model.config, "cpu", seq_len=torch.tensor(length))
        assert torch.equal(ours, stock), length


METHODS = {
    "linear": {},
    "ntk": {},
    "theta": {"base": 50000.0},
    "dynamic-ntk": {},
    "yarn": {},
    "yarn-betas": {"beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-attention_factor": {"attention_factor": 1.3},
    "yarn-mscale": {"mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn-truncate_false": {"truncate": False},
    "llama3": {},
    "longrope": {"long_factor": LONGROPE_FACTORS},
    "dynamic-yarn": {},  # no transformers rope type: describe says stock loads it unscaled
}
#: max_position_embeddings each method saves: L where transformers and the runtimes read it as the original
#: window (linear, dynamic), L * s where it is the served length.
SAVED_WINDOW = {"linear": L, "dynamic-ntk": L, "dynamic-yarn": L}


#: A base other than transformers 4.x's default: yarn, llama3 and longrope then get no legacy fields.
OTHER_THETA = 50000.0
OTHER_THETA_KEYS = ("linear", "yarn")


def _method_name(key: str) -> str:
    return "yarn" if key.startswith("yarn-") else key


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (1, SEQ), generator=torch.Generator().manual_seed(1))


def _tiny(theta: float = 10000.0):
    return tiny_model("llama", initializer_range=0.1, max_position_embeddings=L, rope_theta=theta).eval()


def _patched(key: str, theta: float = 10000.0):
    model = _tiny(theta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(model, _method_name(key), FACTOR, **METHODS[key])
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, bool]]:
    """Each method: the folder plain ``save_pretrained`` wrote, the patched logits, and describe's stock_loadable."""
    result = {}
    root = tmp_path_factory.mktemp("saved")
    for key in METHODS:
        model = _patched(key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(root / key)
        result[key] = (root / key, _logits(model), hf_posext.describe(model).stock_loadable)
    for key in OTHER_THETA_KEYS:
        model = _patched(key, OTHER_THETA)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(root / f"{key}-theta")
        result[f"{key}-theta"] = (root / f"{key}-theta", _logits(model), hf_posext.describe(model).stock_loadable)
    return result


@pytest.fixture(scope="module")
def unscaled_logits() -> torch.Tensor:
    return _logits(_tiny())


def _assert_same_logits(got: torch.Tensor, expected: torch.Tensor, unscaled: torch.Tensor, key: str) -> None:
    effect = (unscaled - expected).abs().max().item()
    assert effect > 1e-2, f"{key} does not change the logits of the tiny model ({effect})"
    diff = (got - expected).abs().max().item()
    assert diff < effect / 100 and diff < 1e-4, f"{key}: stock logits differ by {diff} (method effect {effect})"


ALL_SAVES = [*METHODS, *(f"{key}-theta" for key in OTHER_THETA_KEYS)]


@pytest.mark.parametrize("key", ALL_SAVES)
def test_plain_save_loads_with_stock_from_pretrained_or_describe_says_why_not(saved, unscaled_logits, key):
    from transformers import AutoModelForCausalLM

    folder, expected, stock_loadable = saved[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = AutoModelForCausalLM.from_pretrained(folder).eval()
    got = _logits(stock)
    if key == "dynamic-yarn":
        assert stock_loadable is False and "needs hf_posext.load" in str(hf_posext.describe(_patched(key)))
        assert torch.allclose(got, unscaled_logits, atol=1e-5)  # stock loads it unscaled, as describe says
        return
    assert stock_loadable is True
    _assert_same_logits(got, expected, unscaled_logits, key)


@pytest.mark.parametrize("key", [key for key in METHODS if key.startswith("yarn-")])
def test_each_non_default_yarn_parameter_changes_the_logits(saved, key):
    """The stock-load tests above guard these parameters only if they change what the model computes."""
    effect = (saved[key][1] - saved["yarn"][1]).abs().max().item()
    assert effect > 1e-2, f"{key} changes the logits of default yarn by only {effect}"


#: Where the generic config reader raises with a top-level rope_theta next to rope_scaling (docs/serving.md).
NO_TOP_LEVEL_THETA = ("yarn", "llama3", "longrope")


@pytest.mark.parametrize("key", ALL_SAVES)
def test_saved_config_has_the_served_window_legacy_fields_and_reads_back_through_the_generic_config_class(saved, key):
    """Legacy fields wherever transformers 5.24's PreTrainedConfig.from_json_file (which Trainer runs when it
    resumes from a checkpoint) still reads the folder: linear, ntk, theta, dynamic-ntk with a top-level
    rope_theta; yarn, llama3, longrope without it, and only when theta is 4.x's default (docs/serving.md)."""
    from transformers import PreTrainedConfig

    path = saved[key][0] / "config.json"
    config = json.loads(path.read_text())
    assert config["max_position_embeddings"] == SAVED_WINDOW.get(key.removesuffix("-theta"), int(L * FACTOR))
    method = _method_name(key.removesuffix("-theta"))
    if key.endswith("-theta") and method in NO_TOP_LEVEL_THETA:
        assert "rope_scaling" not in config and "rope_theta" not in config
    else:
        assert config["rope_scaling"] == config["rope_parameters"]
        assert ("rope_theta" in config) == (method not in NO_TOP_LEVEL_THETA)  # dynamic-yarn saves "default"
        assert config.get("rope_theta", 10000.0) == config["rope_parameters"]["rope_theta"]
    if method == "longrope":
        assert config["original_max_position_embeddings"] == L
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert PreTrainedConfig.from_json_file(path).transformers_version


def test_the_generic_config_class_cannot_read_the_legacy_fields_of_a_yarn_config(saved, tmp_path):
    """Why a plain save leaves them out (transformers 5.24; export writes them for older readers)."""
    from transformers import PreTrainedConfig

    from hf_posext.export import export

    out = export(saved["yarn"][0], "transformers", tmp_path / "out")
    try:
        PreTrainedConfig.from_json_file(out / "config.json")
    except AttributeError as error:
        assert "max_position_embeddings" in str(error)
    else:
        pytest.skip("this transformers reads legacy yarn fields generically: plain saves could now write them")


def test_a_save_that_older_readers_would_misread_warns_with_the_fix(tmp_path):
    model = _patched("yarn", OTHER_THETA)
    with pytest.warns(UserWarning, match="hf-posext export .* --for transformers"):
        model.save_pretrained(tmp_path / "patched")
    hf_posext.unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.save_pretrained(tmp_path / "plain")  # no scaling: 4.x reads it right
    for key, theta in (("linear", OTHER_THETA), ("yarn", 10000.0)):  # legacy fields written: nothing to warn
        model = _patched(key, theta)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            model.save_pretrained(tmp_path / f"{key}-{theta}")


def test_a_save_of_a_family_whose_4x_class_ignores_rope_scaling_warns_that_stock_4x_loads_it_unscaled(tmp_path):
    """transformers 4.57's Nemotron sets rope_type "default" whatever the config holds: no legacy field helps, and
    the warning says so (instead of suggesting an export that 4.x would read unscaled all the same)."""
    from hf_posext.family_sweep.tiny import build_tiny

    model = build_tiny("NemotronForCausalLM")
    hf_posext.patch(model, "linear", factor=2)
    with pytest.warns(UserWarning, match=r"transformers 4.x's nemotron ignores rope_scaling: .* hf_posext.load"):
        model.save_pretrained(tmp_path / "nemotron")
    hf_posext.unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save_pretrained(tmp_path / "plain")  # unscaled: 4.x reads it as it is


def test_a_nested_rope_dict_with_top_level_leftovers_reads_as_nested():
    """transformers 5.10's Laguna and Mellum keep ``"rope_type": "default", "rope_theta": None`` beside the per-layer-type
    dicts. Read as one flat dict, that None reached ``float()`` and every yarn save of those families crashed."""
    from hf_posext.core.saved_config import flat_rope_parameters, nested_legacy_fields, older_readers_differ

    layers = {"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 2.0, "partial_rotary_factor": 0.5,
                                 "original_max_position_embeddings": 32},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    config = {"model_type": "laguna", "rope_parameters": {**layers, "rope_type": "default", "rope_theta": None},
              "rope_theta": None}
    assert flat_rope_parameters(config) is None
    assert older_readers_differ(config) is False
    assert nested_legacy_fields(config) == nested_legacy_fields({"model_type": "laguna", "rope_parameters": layers})
    # and a flat dict is read as it was
    flat = {"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}
    assert flat_rope_parameters(flat) == flat["rope_parameters"] and older_readers_differ(flat) is True


def test_hf_posext_load_and_describe_give_the_served_length_of_a_linear_save(saved):
    folder, expected, _ = saved["linear"]
    model = hf_posext.load(folder)
    report = hf_posext.describe(model)
    assert (report.original_window, report.current_window) == (L, int(L * FACTOR))
    assert (_logits(model) - expected).abs().max().item() < 1e-5
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = AutoModelForCausalLM.from_pretrained(folder)
    report = hf_posext.describe(stock)  # read from the config alone
    assert (report.method, report.original_window, report.current_window) == ("linear", L, int(L * FACTOR))


TF457_SCRIPT = """
import sys, warnings, torch, transformers
warnings.simplefilter("ignore")
assert transformers.__version__.startswith("4.57"), transformers.__version__
from transformers import AutoModelForCausalLM
ids = torch.randint(0, 100, (1, int(sys.argv[1])), generator=torch.Generator().manual_seed(1))
for folder, out in zip(sys.argv[2::2], sys.argv[3::2]):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.save(model(ids).logits, out)
"""


@pytest.mark.skipif(not TF457_PYTHON.exists(), reason="no transformers 4.57 venv (.venv-tf457, made by scripts/test.sh)")
def test_on_transformers_4_57_plain_saves_and_exports_load_to_the_same_logits(saved, unscaled_logits, tmp_path):
    """On 4.57 (one subprocess): every plain save with legacy fields loads to the patched logits; the one
    that warns (yarn, theta 50000) loads as another model, as the warning says, and its export
    (``--for transformers``) loads to the patched logits, as does every method's export."""
    from hf_posext.export import export

    keys = [key for key in ALL_SAVES if key != "dynamic-yarn"]
    argv = [str(SEQ)]
    for key in keys:
        argv += [str(saved[key][0]), str(tmp_path / f"plain-{key}.pt")]
        argv += [str(export(saved[key][0], "transformers", tmp_path / key)), str(tmp_path / f"{key}.pt")]
    result = subprocess.run([str(TF457_PYTHON), "-c", TF457_SCRIPT, *argv], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    for key in keys:
        _assert_same_logits(torch.load(tmp_path / f"{key}.pt"), saved[key][1], unscaled_logits, f"{key} (4.57)")
        plain = torch.load(tmp_path / f"plain-{key}.pt")
        if key == "yarn-theta":
            assert (plain - saved[key][1]).abs().max().item() > 1e-2  # 4.x misreads it: the save warned
        else:
            _assert_same_logits(plain, saved[key][1], unscaled_logits, f"plain {key} (4.57)")


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "tests" / "data" / "training" / "tiny-llama")


def test_a_tokenizer_given_to_patch_saves_the_served_length_and_unpatch_restores_it(tmp_path):
    tokenizer = _tokenizer()
    before = tokenizer.model_max_length
    model = hf_posext.patch(_tiny(), "yarn", FACTOR, tokenizer=tokenizer)
    assert tokenizer.model_max_length == int(L * FACTOR)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] == int(L * FACTOR)
    hf_posext.patch(model, "linear", 2.0)  # a new patch without tokenizer= keeps the given one in step
    assert tokenizer.model_max_length == int(L * 2)
    hf_posext.unpatch(model)
    assert tokenizer.model_max_length == before


def test_a_bad_tokenizer_is_refused_before_anything_changes():
    model = _tiny()
    with pytest.raises(TypeError, match="tokenizer="):
        hf_posext.patch(model, "yarn", FACTOR, tokenizer=object())
    assert not hf_posext.describe(model).method != "none" and "save_pretrained" not in model.__dict__


def test_unpatch_saves_the_original_config_again(tmp_path):
    model = _patched("yarn")
    hf_posext.unpatch(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in config and "rope_theta" not in config and config["max_position_embeddings"] == L


def test_json_edits_are_atomic(tmp_path, monkeypatch):
    """A failed write leaves the old file whole and no temporary file (export's config and tokenizer edits)."""
    import hf_posext.core.saved_config as saved_config

    path = tmp_path / "config.json"
    path.write_text('{"max_position_embeddings": 64}')

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saved_config.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        saved_config.write_json_atomically(path, {"max_position_embeddings": 256})
    assert json.loads(path.read_text()) == {"max_position_embeddings": 64}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_cli_patch_saves_the_served_length_in_config_and_tokenizer(tmp_path, capsys):
    from hf_posext.cli.main import main

    out = tmp_path / "patched"
    source = REPO / "tests" / "data" / "training" / "tiny-llama"
    assert main(["patch", str(source), "--method", "linear", "--factor", "4", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == L and config["rope_parameters"]["factor"] == FACTOR
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == int(L * FACTOR)


def _yarn_config(model_type: str, theta: float) -> dict:
    params = {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": 64}
    return {"model_type": model_type, "max_position_embeddings": 256, "rope_parameters": params}


def test_yarn_gets_rope_scaling_without_rope_theta_only_when_theta_is_the_4_x_default_of_its_model_type():
    """4.57 reads its class's default theta when config.json has none: 10000 for Llama, 1e6 for Mixtral."""
    from hf_posext.core.saved_config import older_readers_differ, plain_save_legacy_fields

    for model_type, theta, gets_fields in (("llama", 1e4, True), ("llama", 1e6, False), ("mixtral", 1e6, True),
                                           ("mixtral", 1e4, False)):
        config = _yarn_config(model_type, theta)
        written = plain_save_legacy_fields(config)
        assert ("rope_scaling" in written) == gets_fields and "rope_theta" not in written, (model_type, theta)
        assert older_readers_differ(written) == (not gets_fields), (model_type, theta)
        if gets_fields:
            assert written["rope_scaling"] == config["rope_parameters"]


LEGACY_THETA_SCRIPT = """
import inspect, json, transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
other = {}
for model_type, name in CONFIG_MAPPING_NAMES.items():
    try:
        default = inspect.signature(getattr(transformers, name).__init__).parameters["rope_theta"].default
    except (AttributeError, KeyError, ImportError):
        continue
    if default != 10000.0:
        other[model_type] = float(default)
print(json.dumps(other))
"""


@pytest.mark.skipif(not TF457_PYTHON.exists(), reason="no transformers 4.57 venv (.venv-tf457, made by scripts/test.sh)")
def test_the_table_of_4_x_default_thetas_is_what_transformers_4_57_has():
    from hf_posext.core.saved_config import LEGACY_OTHER_DEFAULT_THETAS

    result = subprocess.run([str(TF457_PYTHON), "-c", LEGACY_THETA_SCRIPT], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == LEGACY_OTHER_DEFAULT_THETAS
