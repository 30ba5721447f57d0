"""A frequency scaling with an attention-level method stacked on it, in one call: ``patch(model, "yarn+string")``.

Every check runs on a tiny Llama with a large init range (0.1), whose logits depend strongly on position, at
150 tokens against a 64-token window (yarn x2: a 128-token window, STRING sized on it: S = int(0.33 * 128) = 42,
w = 21). The reference for the composition is the route users had before it: patch yarn, save, load the folder
with stock transformers (its config carries yarn), then patch string.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import hf_posext
from hf_posext.core.request import ScalingRequest
from hf_posext.models import tiny_model
from tests.conftest import assert_close_guarding, logits_of, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

WINDOW = 64


def _model():
    model = tiny_model("llama", initializer_range=0.1)
    model.set_attn_implementation("sdpa")
    return model


def _ids(length: int = 150) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(0))


def _state(model) -> tuple[dict, dict, str]:
    return ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(model.config.to_dict()),
            model.config._attn_implementation)


def _assert_same_state(model, state) -> None:
    weights, config, implementation = state
    now = model.state_dict()
    assert set(now) == set(weights) and all(torch.equal(now[k], weights[k]) for k in weights)
    assert model.config.to_dict() == config and model.config._attn_implementation == implementation


def _todays_route(tmp_path, factor: float = 2, **string_params):
    """yarn merged to disk, loaded with stock transformers (yarn in its config), then string on top."""
    from transformers import AutoModelForCausalLM

    model = _model()
    hf_posext.patch(model, "yarn", factor=factor)
    model.save_pretrained(tmp_path / "yarn")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "yarn")
    stock.set_attn_implementation("sdpa")
    hf_posext.patch(stock, "string", **string_params)
    return stock


def test_composition_equals_yarn_merged_to_disk_then_string(tmp_path):
    ids = _ids()
    model = _model()
    hf_posext.patch(model, "yarn+string", factor=2)
    yarn_only = _model()
    hf_posext.patch(yarn_only, "yarn", factor=2)
    reference = logits_of(_todays_route(tmp_path), ids)
    # the effect guarded: without STRING on top (yarn alone), the logits are far from the composition's
    assert_close_guarding(logits_of(model, ids), reference, logits_of(yarn_only, ids), atol=1e-5, rtol=1e-5)


def test_describe_reports_both_parts_and_string_is_sized_on_the_composed_window():
    model = _model()
    hf_posext.patch(model, "yarn+string", factor=2)
    report = hf_posext.describe(model)
    assert (report.method, report.kind, report.factor) == ("yarn+string", "rope+attention", 2.0)
    assert (report.original_window, report.current_window) == (WINDOW, 2 * WINDOW)
    frequency, attention = report.parts
    assert (frequency.method, frequency.kind, frequency.current_window) == ("yarn", "rope", 2 * WINDOW)
    assert (attention.method, attention.kind) == ("string", "attention")
    assert attention.params["shifted_offset"] == int(0.33 * 2 * WINDOW) == report.params["string.shifted_offset"]
    assert report.params["yarn.beta_fast"] == 32.0
    assert "part yarn" in str(report) and "part string" in str(report)
    assert report.to_dict()["parts"][1]["method"] == "string"
    # the report's parameters re-create the patch (what an adapter's record and an evaluation cell keep)
    again = _model()
    hf_posext.patch(again, report.method, report.factor, **report.params)
    assert torch.equal(logits_of(again, _ids()), logits_of(model, _ids()))
    # linear keeps L = 64 in the config it writes (transformers' linear type never reads it): STRING is still sized
    # on the composed 128-token window, not on what the config declares
    linear = _model()
    hf_posext.patch(linear, "linear", factor=2)
    assert linear.config.max_position_embeddings == WINDOW
    hf_posext.patch(model, "linear+string", factor=2)
    assert hf_posext.describe(model).parts[1].params["shifted_offset"] == 42


def test_unpatch_restores_the_original_to_the_bit():
    ids = _ids()
    model = _model()
    before, logits = _state(model), logits_of(model, ids)
    hf_posext.patch(model, "yarn+string", factor=2)
    assert (logits_of(model, ids) - logits).abs().max() > 0.1
    hf_posext.unpatch(model)
    _assert_same_state(model, before)
    assert torch.equal(logits_of(model, ids), logits)
    with pytest.raises(ValueError, match="not patched"):
        hf_posext.unpatch(model)


def test_save_pretrained_and_load_give_the_same_logits(tmp_path):
    ids = _ids()
    model = _model()
    hf_posext.patch(model, "yarn+string", factor=2, local_value=16)
    model.save_pretrained(tmp_path)
    loaded = hf_posext.load(tmp_path)
    assert hf_posext.describe(loaded).method == "yarn+string"
    assert hf_posext.describe(loaded).params["string.local_value"] == 16
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids))
    hf_posext.unpatch(loaded)
    assert (logits_of(loaded, ids) - logits_of(model, ids)).abs().max() > 0.1


def test_patching_again_replaces_the_whole_composition():
    ids = _ids()
    model = _model()
    hf_posext.patch(model, "yarn+string", factor=2)
    hf_posext.patch(model, "yarn+string", factor=3, shifted_offset=50)
    fresh = _model()
    hf_posext.patch(fresh, "yarn+string", factor=3, shifted_offset=50)
    assert torch.equal(logits_of(model, ids), logits_of(fresh, ids))
    hf_posext.patch(model, "yarn", factor=2)  # one method replaces a composition as a whole
    yarn = _model()
    hf_posext.patch(yarn, "yarn", factor=2)
    assert hf_posext.describe(model).method == "yarn" and not hf_posext.describe(model).parts
    assert torch.equal(logits_of(model, ids), logits_of(yarn, ids))
    hf_posext.patch(model, "yarn+string", factor=2)
    hf_posext.patch(model, "string")  # an attention method alone: on the original frequencies
    string = _model()
    hf_posext.patch(string, "string")
    assert torch.equal(logits_of(model, ids), logits_of(string, ids))


def test_a_failed_patch_leaves_the_previous_composition_in_place():
    ids = _ids()
    model = _model()
    hf_posext.patch(model, "yarn+string", factor=2)
    before, logits, report = _state(model), logits_of(model, ids), hf_posext.describe(model)
    # S = 128 cannot work on the composed 128-token window (S must be below it); 100 would
    with pytest.raises(ValueError, match="shifted_offset=128 must be smaller") as error:
        hf_posext.patch(model, "yarn+string", factor=2, shifted_offset=128)
    assert "\n" not in str(error.value)
    _assert_same_state(model, before)
    assert torch.equal(logits_of(model, ids), logits) and hf_posext.describe(model) == report
    with pytest.raises(ValueError, match="local_value"):
        hf_posext.patch(model, "yarn", factor=3, local_value=3)
    assert torch.equal(logits_of(model, ids), logits)


@pytest.mark.parametrize("method, kwargs, message", [
    ("yarn+ntk", {"factor": 2}, "two frequency scalings"),
    ("string+dca", {}, "two attention-level methods"),
    ("dynamic-yarn+string", {"factor": 2}, "is dynamic"),
    ("yarn+string", {"factor": 2, "attention_factor": 1.1}, r"string\.attention_factor="),
    ("yarn+string", {}, "needs the size of its frequency part"),
    ("yarn+self-extend", {"factor": 2}, r"self-extend is sized on the window yarn gives by its own group_size"),
    ("yarn+string", {"factor": 2, "shifted_ofset": 8}, "Did you mean 'shifted_offset'"),
])
def test_refused_in_one_line_before_anything_changes(method, kwargs, message):
    model = _model()
    hf_posext.patch(model, "linear", factor=2)
    before, logits = _state(model), logits_of(model, _ids())
    with pytest.raises(ValueError, match=message) as error:
        hf_posext.patch(model, method, **kwargs)
    assert "\n" not in str(error.value)
    _assert_same_state(model, before)
    assert torch.equal(logits_of(model, _ids()), logits) and hf_posext.describe(model).method == "linear"


def _not_rope(family: str):
    import transformers

    config = {
        "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=WINDOW),  # learned
        "xglm": lambda: transformers.XGLMConfig(vocab_size=128, d_model=32, num_layers=2, attention_heads=4,
                                                ffn_dim=64, max_position_embeddings=WINDOW),  # sinusoidal
        "bloom": lambda: transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4),  # ALiBi
        "t5": lambda: transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                            decoder_start_token_id=0),  # relative bias
    }[family]()
    return transformers.AutoModelForSeq2SeqLM.from_config(config) if family == "t5" else \
        transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["gpt2", "xglm", "bloom", "t5"])
def test_an_attention_part_on_positions_without_rope_is_refused(family):
    model = _not_rope(family)
    before = copy.deepcopy(model.config.to_dict())
    with pytest.raises(ValueError, match=r"attention-level method for rotary \(RoPE\) positions.*patch 'linear' alone"):
        hf_posext.patch(model, "linear+string", factor=2)
    assert model.config.to_dict() == before and not hf_posext.api.patched_backends(model)


def test_a_part_qualified_parameter_reaches_its_part_only():
    model = _model()
    hf_posext.patch(model, "yarn+string", factor=2, **{"string.attention_factor": 1.2, "yarn.attention_factor": 1.0})
    frequency, attention = hf_posext.describe(model).parts
    assert attention.params["attention_factor"] == 1.2 and frequency.params["attention_factor"] == 1.0


def test_every_spelling_reaches_the_same_request():
    """Python kwargs, the CLI, a recipe's scaling section and lm-eval model args all parse a composition."""
    python = ScalingRequest.from_kwargs("string+yarn", 4, local_value=64)
    cli = ScalingRequest.from_cli("yarn+string", 4, param_items=["local_value=64"])
    recipe = ScalingRequest.from_mapping({"method": "yarn+string", "factor": 4, "params": {"string.local_value": 64}})
    lm_eval, rest = ScalingRequest.from_model_args({"posext_method": "yarn+string", "posext_factor": "4",
                                                     "posext_local_value": "64", "pretrained": "x"})
    assert python == cli == recipe == lm_eval and rest == {"pretrained": "x"}
    assert python.method == "yarn+string" and python.parts[1].params_dict == {"local_value": 64}
    from hf_posext.evaluation.arguments import parse_methods

    assert [r.method for r in parse_methods("none,yarn+string")] == ["none", "yarn+string"]


def test_numpy_and_torch_integer_scalars_are_taken_as_parameters():
    import numpy as np

    request = ScalingRequest.from_kwargs("string", shifted_offset=np.int64(40), local_value=torch.tensor(8))
    assert request.params_dict == {"local_value": 8, "shifted_offset": 40}
    assert type(request.params_dict["shifted_offset"]) is int


def test_a_recipe_takes_a_composition_only_where_training_is_exact():
    """scaling.method: yarn+string trains without PoSE (STRING's near/far split follows the token order, which the
    position ids then follow); under PoSE, or with a kernel not checked for training, it is refused with the
    evaluation-only use named."""
    from hf_posext.training.config import ConfigError, load_config
    from tests.training_helpers import TINY_RECIPE

    config = load_config(TINY_RECIPE, ["scaling.method=yarn+string", "data.pose=false"])
    assert config.scaling.to_request().parts[1].method == "string"
    with pytest.raises(ConfigError, match=r"data.pose=true.*train with scaling.method: yarn .*--methods yarn\+string"):
        load_config(TINY_RECIPE, ["scaling.method=yarn+string", "data.pose=true"])
    with pytest.raises(ConfigError, match="dca's kernels are not checked for training"):
        load_config(TINY_RECIPE, ["scaling.method=yarn+dca", "data.pose=false"])
    with pytest.raises(ConfigError, match="two frequency scalings"):
        load_config(TINY_RECIPE, ["scaling.method=yarn+ntk"])


def _accepted_pairs() -> list[tuple[str, str]]:
    """Every (frequency, attention) pair that split_composition accepts."""
    from hf_posext.methods import METHODS, split_composition

    pairs = []
    for frequency in sorted(METHODS["rope"]):
        for attention in sorted(METHODS["attention"]):
            try:
                split_composition(f"{frequency}+{attention}")
            except ValueError:
                continue
            pairs.append((frequency, attention))
    return pairs


def test_the_accepted_pairs_are_the_static_scalings_with_each_attention_method():
    frequencies = {f for f, _ in _accepted_pairs()}
    assert frequencies == {"linear", "llama3", "ntk", "theta", "yarn"}
    assert {a for _, a in _accepted_pairs()} == {"dca", "self-extend", "string"}


@pytest.mark.parametrize("frequency, attention", _accepted_pairs())
def test_every_pair_the_splitter_accepts_patches_and_unpatches(frequency, attention):
    """Each accepted pair patches on its frequency part's factor alone (plus the attention part's own size parameter
    where it has one, Self-Extend's group_size, which a refusal names in one line before anything changes)."""
    ids = _ids(100)
    model = _model()
    before, logits = _state(model), logits_of(model, ids)
    name = f"{frequency}+{attention}"
    params = {"base": 40000.0} if frequency == "theta" else {}
    if attention == "self-extend":
        escaped = re.escape(name)
        with pytest.raises(ValueError, match=rf"{escaped}: the factor sizes {frequency}; .*group_size, which is missing.*"
                                             rf"{escaped}:factor=2:.*self-extend.group_size=4") as error:
            hf_posext.patch(model, name, factor=2, **params)
        assert "\n" not in str(error.value)
        _assert_same_state(model, before)
        params["group_size"] = 2
    hf_posext.patch(model, name, factor=2, **params)
    report = hf_posext.describe(model)
    assert report.method == name and [part.method for part in report.parts] == [frequency, attention]
    assert report.parts[0].current_window == 2 * WINDOW
    assert report.parts[1].original_window == 2 * WINDOW  # sized on the window the frequency part gives
    assert (logits_of(model, ids) - logits).abs().max() > 0.1
    hf_posext.unpatch(model)
    _assert_same_state(model, before)


def test_yarn_dca_equals_yarn_merged_to_disk_then_dca(tmp_path):
    """DCA stacked on yarn x2 is sized on yarn's 128-token window (its factor only declares a window: the
    frequency part's); chunks of 48 with a local window of 8 span 150 tokens, as DCA on the stock yarn model."""
    from transformers import AutoModelForCausalLM

    ids = _ids()
    model = _model()
    hf_posext.patch(model, "yarn+dca", factor=2, chunk_size=48, local_window=8)
    report = hf_posext.describe(model)
    assert report.parts[1].factor == 1.0 and report.current_window == 2 * WINDOW
    model.save_pretrained(tmp_path / "composed")
    loaded = hf_posext.load(tmp_path / "composed")
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids))
    yarn_only = _model()
    hf_posext.patch(yarn_only, "yarn", factor=2)
    yarn_only.save_pretrained(tmp_path / "yarn")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "yarn")
    stock.set_attn_implementation("sdpa")
    hf_posext.patch(stock, "dca", factor=2, chunk_size=48, local_window=8)
    assert_close_guarding(logits_of(model, ids), logits_of(stock, ids), logits_of(yarn_only, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, size", [("dca.factor", 2), ("self-extend.target_length", 300), ("string.factor", 1)])
def test_a_size_qualified_by_the_attention_part_is_refused_naming_the_one_size(name, size):
    method = name.partition(".")[0]
    with pytest.raises(ValueError, match=rf"'{name}': a composition has one size, its frequency part's: write "
                                         rf"{name.partition('.')[2]}=\.\.\. unqualified \(it sizes 'yarn'\)") as error:
        hf_posext.patch(_model(), f"yarn+{method}", factor=2, **{name: size})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text", ["yarn:factor=4", "yarn+string:factor=4", "string+yarn:factor=2:local_value=8"])
def test_a_whole_request_where_a_method_name_is_taken_names_both_ways_to_write_it(text):
    method = text.split(":")[0]
    with pytest.raises(ValueError, match=rf"^'{re.escape(text)}' is a whole request \(method:settings\), but a method "
                                         rf"name is taken here: write the method alone \('{re.escape(method)}'\).*"
                                         rf"--method {re.escape(text)}, posext={re.escape(text)}") as error:
        hf_posext.patch(_model(), text)
    assert "\n" not in str(error.value)
