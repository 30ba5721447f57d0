"""Our RoPE methods against transformers' own ROPE_INIT_FUNCTIONS and rope_parameters models.

Where transformers has the same rule (linear, dynamic, yarn, llama3, longrope), the frequencies must
agree to float32 precision and the logits of a patched model must equal those of a model built with
that rope config to 1e-5. Runs on transformers 5.x (rope_parameters) and 4.57 (rope_scaling).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import hf_posext
from hf_posext.core.request import ScalingConfig
from hf_posext.backends.rope.sites import set_rope_parameters
from hf_posext.methods import available_methods, get_method
from hf_posext.methods.rope import RotaryBase
from hf_posext.models import tiny_config, tiny_model
from tests.conftest import logits_of

HALF_DIM = 4  # tiny llama: head_dim 8
LONG = [1.0, 1.5, 3.0, 6.0]
SHORT = [1.0, 1.0, 1.2, 1.5]

# method -> (transformers rope dict extras, our params)
CASES = {
    "linear": ({}, {}),
    "dynamic-ntk": ({}, {}),
    "yarn": ({"beta_fast": 32.0, "beta_slow": 1.0}, {}),
    "llama3": ({"low_freq_factor": 1.0, "high_freq_factor": 4.0}, {}),
    "longrope": ({"long_factor": LONG, "short_factor": SHORT}, {"long_factor": LONG, "short_factor": SHORT}),
}


def _stock_rope(method: str, factor: float, window: int, theta: float, extras: dict) -> dict:
    spec = get_method(method)
    params = {"rope_type": spec.transformers_type, "rope_theta": theta, "factor": factor, **extras}
    if spec.transformers_type in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = window
    return params


def _stock_model(method: str, factor: float, reference, extras: dict):
    """A model built by transformers with the rope config, holding ``reference``'s weights."""
    config = copy.deepcopy(reference.config)
    config.__dict__.pop("hf_posext", None)
    set_rope_parameters(config, _stock_rope(method, factor, 64, 10000.0, extras))
    if get_method(method).transformers_type not in ("dynamic",):
        config.max_position_embeddings = int(64 * factor)
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    stock.load_state_dict(reference.state_dict())
    return stock.eval()


@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0, 7.5])
@pytest.mark.parametrize("method", list(CASES))
def test_frequencies_match_transformers(method, factor):
    extras, ours = CASES[method]
    config = tiny_config("llama", max_position_embeddings=64)
    set_rope_parameters(config, _stock_rope(method, factor, 64, 10000.0, extras))
    if method != "dynamic-ntk":
        config.max_position_embeddings = int(64 * factor)
    spec = get_method(method)
    scaling = ScalingConfig(method, factor, 64, ours)
    for seq_len in (32, 64, 65, 200):
        expected, expected_attention = ROPE_INIT_FUNCTIONS[spec.transformers_type](config, None, seq_len=seq_len)
        got, attention = spec.compute(RotaryBase(10000.0, 8), 64, factor, seq_len, scaling.parsed_params)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
        assert attention == pytest.approx(expected_attention, rel=1e-7)


@pytest.mark.parametrize("method", list(CASES))
def test_patched_logits_equal_transformers_model(method, token_ids):
    extras, ours = CASES[method]
    model = tiny_model("llama")
    stock = _stock_model(method, 4.0, model, extras)
    hf_posext.patch(model, method, factor=4, **ours)
    torch.testing.assert_close(logits_of(model, token_ids), logits_of(stock, token_ids), rtol=1e-5, atol=1e-5)


def test_ntk_equals_default_rope_with_raised_base(token_ids):
    model = tiny_model("llama")
    config = copy.deepcopy(model.config)
    set_rope_parameters(config, {"rope_type": "default", "rope_theta": 10000.0 * 4 ** (8 / 6)})
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    stock.load_state_dict(model.state_dict())
    hf_posext.patch(model, "ntk", factor=4)
    torch.testing.assert_close(logits_of(model, token_ids), logits_of(stock.eval(), token_ids), rtol=1e-5, atol=1e-5)


def test_ntk_closed_form():
    """NTK-aware: the lowest frequency is divided by exactly s, the highest kept (bloc97 2023)."""
    rope = RotaryBase(10000.0, 64)
    inv, _ = get_method("ntk").compute(rope, 4096, 8.0, None, ScalingConfig("ntk", 8, 4096).parsed_params)
    base = rope.inv_freq()
    assert inv[0] == base[0]
    assert inv[-1].item() == pytest.approx(base[-1].item() / 8, rel=1e-5)


def test_yarn_ramp_follows_paper():
    """Dimensions rotating > beta_fast times in L are kept, < beta_slow are divided by s, in between blend."""
    rope, window, factor = RotaryBase(10000.0, 128), 4096, 4.0
    inv, attention = get_method("yarn").compute(rope, window, factor, None, ScalingConfig("yarn", factor, window).parsed_params)
    base = rope.inv_freq()
    rotations = window * base / (2 * math.pi)
    kept = rotations > 33  # a margin of one dimension for the reference implementation's rounding
    interpolated = rotations < 0.9
    torch.testing.assert_close(inv[kept], base[kept])
    torch.testing.assert_close(inv[interpolated], base[interpolated] / factor)
    middle = ~kept & ~interpolated
    assert torch.all(inv[middle] <= base[middle]) and torch.all(inv[middle] >= base[middle] / factor)
    assert attention == pytest.approx(0.1 * math.log(4) + 1)


def test_dynamic_yarn_is_yarn_at_current_length():
    rope = RotaryBase(10000.0, 64)
    params = ScalingConfig("dynamic-yarn", 4, 1024).parsed_params
    inside, a_inside = get_method("dynamic-yarn").compute(rope, 1024, 4.0, 1024, params)
    assert torch.equal(inside, rope.inv_freq()) and a_inside == 1.0
    at_3x, attention = get_method("dynamic-yarn").compute(rope, 1024, 4.0, 3072, params)
    static, static_attention = get_method("yarn").compute(rope, 1024, 3.0, None, ScalingConfig("yarn", 3, 1024).parsed_params)
    assert torch.equal(at_3x, static) and attention == static_attention


def test_every_method_is_listed_with_a_description():
    listed = available_methods()
    for name in ("linear", "ntk", "dynamic-ntk", "yarn", "dynamic-yarn", "theta", "llama3", "longrope"):
        assert name in listed and len(listed[name]) > 20
        spec = get_method(name)
        assert spec.compute.__doc__ and "20" in spec.compute.__doc__  # formula docstring cites a year/paper
