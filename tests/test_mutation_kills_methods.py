"""RoPE methods against transformers' ROPE_INIT_FUNCTIONS at non-default parameters and a realistic head size.

tests/test_methods_parity.py compares every shared method at its default parameters on a head of 8
(4 frequencies): a YaRN ramp bound, a Llama 3 band edge or a DeepSeek mscale that is computed wrongly
can agree there by chance. Here: head 64 (32 frequencies, so the ramps cross many dimensions), window
4096, and the parameters users set (betas, truncate, attention factor, mscale, band factors).
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_posext.backends.rope.sites import set_rope_parameters
from hf_posext.core.request import ScalingConfig
from hf_posext.methods import get_method
from hf_posext.methods.rope import RotaryBase, yarn_attention_factor
from hf_posext.models import tiny_config
from tests.conftest import transformers_major

WINDOW, HEAD, THETA = 4096, 64, 500000.0
LONG = [1.0 + 0.25 * i for i in range(HEAD // 2)]
SHORT = [1.0 + 0.01 * i for i in range(HEAD // 2)]

CASES = [
    ("yarn", {"beta_fast": 16.0, "beta_slow": 2.0}),
    ("yarn", {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
    ("yarn", {"attention_factor": 1.3}),
    ("yarn", {"mscale": 0.707, "mscale_all_dim": 1.0}),
    ("yarn", {"mscale": 1.0, "mscale_all_dim": 0.5}),
    ("llama3", {"low_freq_factor": 2.0, "high_freq_factor": 8.0}),
    ("llama3", {"low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ("longrope", {"long_factor": LONG, "short_factor": SHORT}),
    ("longrope", {"long_factor": LONG, "short_factor": SHORT, "attention_factor": 0.9}),
]


@pytest.mark.parametrize("factor", [2.0, 8.0, 5.5])
@pytest.mark.parametrize("method, params", CASES, ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={v[k]}" for k in v))
def test_non_default_parameters_match_transformers(method, params, factor):
    if "truncate" in params and transformers_major() < 5:
        pytest.skip("transformers 4.57 has no yarn truncate")
    config = tiny_config("llama", max_position_embeddings=int(WINDOW * factor), hidden_size=HEAD * 2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=HEAD)
    spec = get_method(method)
    set_rope_parameters(config, {"rope_type": spec.transformers_type, "rope_theta": THETA, "factor": factor,
                                 "original_max_position_embeddings": WINDOW, **params})
    ours = ScalingConfig(method, factor, WINDOW, dict(params)).parsed_params
    for seq_len in (WINDOW // 2, WINDOW + 1, int(WINDOW * factor)):
        expected, expected_attention = ROPE_INIT_FUNCTIONS[spec.transformers_type](config, None, seq_len=seq_len)
        got, attention = spec.compute(RotaryBase(THETA, HEAD), WINDOW, factor, seq_len, ours)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
        assert attention == pytest.approx(expected_attention, rel=1e-7)


def test_yarn_attention_factor_formulas():
    assert yarn_attention_factor(1.0) == 1.0 and yarn_attention_factor(0.5) == 1.0
    assert yarn_attention_factor(4.0) == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    # DeepSeek: get(s, mscale) / get(s, mscale_all_dim), get(s, m) = 0.1 m ln s + 1
    ln8 = torch.log(torch.tensor(8.0)).item()
    assert yarn_attention_factor(8.0, 0.707, 1.0) == pytest.approx((0.1 * 0.707 * ln8 + 1) / (0.1 * ln8 + 1))
    assert yarn_attention_factor(8.0, 0.707, None) == pytest.approx(0.1 * ln8 + 1)  # both needed for the ratio


def test_theta_replaces_the_base_and_keeps_it_when_equal():
    rope = RotaryBase(10000.0, 16)
    same, one = get_method("theta").compute(rope, 64, 2.0, None, ScalingConfig("theta", 2, 64, {"base": 10000.0}).parsed_params)
    assert torch.equal(same, rope.inv_freq()) and one == 1.0
    raised, _ = get_method("theta").compute(rope, 64, 2.0, None, ScalingConfig("theta", 2, 64, {"base": 1e6}).parsed_params)
    expected = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    torch.testing.assert_close(raised, expected, rtol=1e-6, atol=0)


def test_longrope_factor_count_is_checked_against_the_rotary_dim():
    params = ScalingConfig("longrope", 2, 64, {"long_factor": [1.0] * 3, "short_factor": [1.0] * 3}).parsed_params
    with pytest.raises(ValueError, match=r"long_factor needs 4 values \(rotary dim 8 / 2\), got 3"):
        get_method("longrope").compute(RotaryBase(10000.0, 8), 64, 2.0, 100, params)


STOCK_CASES = [
    ("linear", {}), ("ntk", {}), ("dynamic-ntk", {}), ("theta", {"base": 1e6}), ("yarn", {"beta_fast": 16.0}),
    ("llama3", {}), ("longrope", {"long_factor": LONG}),  # no short_factor: ones inside the window
]


@pytest.mark.parametrize("method, params", STOCK_CASES, ids=[c[0] for c in STOCK_CASES])
def test_stock_rope_parameters_compute_our_frequencies(method, params):
    """The rope dict written to config.json for stock transformers gives the frequencies our method computes."""
    from hf_posext.methods.transformers import stock_rope_parameters

    factor = 4.0
    scaling = ScalingConfig(method, factor, WINDOW, dict(params))
    stock = stock_rope_parameters(method, factor, WINDOW, scaling.params, THETA, HEAD)  # identity left at its default
    assert stock["rope_type"] != "default" or method in ("ntk", "theta")
    config = tiny_config("llama", max_position_embeddings=WINDOW if method == "dynamic-ntk" else int(WINDOW * factor),
                         hidden_size=HEAD * 2, num_attention_heads=2, num_key_value_heads=2, head_dim=HEAD)
    set_rope_parameters(config, stock)
    for seq_len in (WINDOW // 2, 3 * WINDOW):
        expected, expected_attention = ROPE_INIT_FUNCTIONS[stock["rope_type"]](config, None, seq_len=seq_len) \
            if stock["rope_type"] != "default" else (ROPE_INIT_FUNCTIONS_DEFAULT(config), 1.0)
        got, attention = get_method(method).compute(RotaryBase(THETA, HEAD), WINDOW, factor, seq_len, scaling.parsed_params)
        torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
        assert attention == pytest.approx(expected_attention, rel=1e-7)
    identity = stock_rope_parameters(method, 1.0, WINDOW, scaling.params, THETA, HEAD, identity=True)
    assert identity == {"rope_type": "default", "rope_theta": THETA}


def ROPE_INIT_FUNCTIONS_DEFAULT(config) -> torch.Tensor:  # noqa: N802 - transformers 5 has no "default" entry
    theta = config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters") else config.rope_theta
    return 1.0 / (theta ** (torch.arange(0, HEAD, 2, dtype=torch.int64).float() / HEAD))


@pytest.mark.parametrize("field", ["low_freq_factor", "high_freq_factor"])
def test_llama3_band_factors_must_be_given(field):
    with pytest.raises(ValueError, match=f"{field} must be a positive number, got None"):
        ScalingConfig("llama3", 4, 64, {field: None}).parsed_params


def test_a_method_of_another_kind_is_named_with_its_kind():
    with pytest.raises(ValueError, match=r"Method 'yarn' applies to rope position encodings, but this model uses relative "
                                         r"ones\. Methods valid here: linear, none\."):
        get_method("yarn", "relative")
    with pytest.raises(ValueError, match=r"Unknown method 'yran'\. Did you mean 'yarn'\?"):
        get_method("yran", "rope")


def test_identity_at_factor_one_is_declared_for_the_static_methods_only():
    from hf_posext.methods import available_methods

    identity = {name for name in available_methods("rope") if get_method(name, "rope").identity_at_one}
    assert identity == {"none", "linear", "ntk", "yarn", "llama3"}  # dynamic ones, theta and longrope are not


def test_renamed_parameters_warn_and_refuse_both_names():
    spec = get_method("self-extend", "attention")
    with pytest.warns(FutureWarning, match="'window' is now called 'neighbor_window'"):
        assert spec.canonical_params({"window": 12, "group_size": 3}) == {"neighbor_window": 12, "group_size": 3}
    with pytest.raises(ValueError, match="give neighbor_window= only"):
        spec.canonical_params({"window": 12, "neighbor_window": 12})
    assert spec.canonical_params({"neighbor_window": 12}) == {"neighbor_window": 12}


@pytest.mark.parametrize("field", ["beta_fast", "beta_slow"])
def test_yarn_betas_must_be_given(field):
    with pytest.raises(ValueError, match=f"{field} must be a positive number, got None"):
        ScalingConfig("yarn", 4, 64, {field: None}).parsed_params


def test_combined_method_names_are_composed_or_refused_with_the_reason():
    from hf_posext.methods.registry import check_method_name

    assert check_method_name(" YaRN ") == "yarn"
    assert check_method_name("dca+yarn") == "yarn+dca"  # a composition: the frequency part first
    with pytest.raises(ValueError, match=r"Methods are not listed with commas in one call \('linear, self-extend'\).*"
                                         r"join them with '\+'.*pick one of 'linear', 'self-extend'"):
        check_method_name("linear, self-extend")
    with pytest.raises(ValueError, match="Did you mean 'yarn'") as error:
        check_method_name("yarnn")
    assert "commas" not in str(error.value) and "stacks" not in str(error.value)


def test_default_neighbor_window_is_a_quarter_of_the_window_and_at_least_one():
    from hf_posext.methods.attention import default_neighbor_window

    assert [default_neighbor_window(n) for n in (2, 3, 4, 7, 8, 64, 4096)] == [1, 1, 1, 1, 2, 16, 1024]


def test_a_renamed_parameter_warning_points_at_the_users_line():
    """Whatever the path into the registry (the method spec, a request, ``hf_posext.patch``), the
    FutureWarning names this file, so the printed ``file:line`` is the line to change."""
    import hf_posext
    from hf_posext.core.request import ScalingRequest
    from hf_posext.models import tiny_model

    spec = get_method("self-extend", "attention")
    model = tiny_model("llama")
    calls = [
        lambda: spec.canonical_params({"window": 12}),
        lambda: ScalingRequest("self-extend", factor=2, params=(("window", 12),)),
        lambda: hf_posext.patch(model, "self-extend", group_size=2, window=12),
    ]
    for call in calls:
        with pytest.warns(FutureWarning, match="'window' is now called 'neighbor_window'") as caught:
            call()
        assert [w.filename for w in caught if w.category is FutureWarning] == [__file__]


def test_one_known_method_between_separators_is_unknown_not_a_combination():
    """'yarn+' is one part: the did-you-mean error, not a composition's (which needs two methods)."""
    from hf_posext.methods.registry import check_method_name

    with pytest.raises(ValueError, match=r"^Unknown method 'yarn\+'\. Did you mean 'yarn'\?"):
        check_method_name("yarn+")
    with pytest.raises(ValueError, match=r"^Method 'yarn\+ntk' stacks two frequency scalings"):
        check_method_name("yarn+ntk")


def test_string_reference_factor_and_defaults():
    """STRING's reference constant is YaRN's attention factor at s = 2 (0.1 ln 2 + 1 = 1.0693...), the default
    local window is the paper's 128 capped at S // 2, and an infinite or NaN attention factor is refused."""
    from hf_posext.methods.shifted_positions import REFERENCE_ATTENTION_FACTOR, StringParams, default_local_value

    assert REFERENCE_ATTENTION_FACTOR == pytest.approx(1.0693147, abs=1e-7)
    assert yarn_attention_factor(2.0) == pytest.approx(REFERENCE_ATTENTION_FACTOR, abs=1e-12)
    assert (default_local_value(1000), default_local_value(256), default_local_value(100)) == (128, 128, 50)
    for bad in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match=r"attention_factor must be a positive number \(1 = off, the reference code "
                                             r"uses 1\.0693\)"):
            StringParams(attention_factor=bad)


def test_string_sizes_accept_a_zero_local_value_and_refuse_a_negative_one():
    from hf_posext.methods.shifted_positions import StringParams, check_string_sizes

    assert StringParams().attention_factor == 1.0  # the paper's position matrix alone, no q/k factor
    check_string_sizes(10, 0, 64)  # w = 0: shifted keys start at distance 0 (valid)
    for check in (lambda: check_string_sizes(10, -1, 64), lambda: StringParams(local_value=-1)):
        with pytest.raises(ValueError, match=r"^local_value must be an integer >= 0, got -1\.$"):
            check()
    with pytest.raises(ValueError, match=r"^shifted_offset must be an integer >= 1, got 0\.$"):
        check_string_sizes(0, 0, 64)
