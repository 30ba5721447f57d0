"""Request parsing on the paths the API tests leave out (found by bench/mutation.py)."""

from __future__ import annotations

import pytest

from hf_posext.core.request import ScalingConfig, ScalingRequest


def test_lm_eval_errors_name_the_model_argument_and_chain_the_shown_error():
    with pytest.raises(ValueError, match=r"^posext_factor=0\.5 is below 1: .*\(posext_factor=1 leaves the model "
                                         r"unchanged\)\. \(method parameters are given as posext_<name>=<value>\)$") as info:
        ScalingRequest.from_model_args({"posext_method": "linear", "posext_factor": "0.5"})
    assert str(info.value.__cause__).startswith("factor=0.5 is below 1")
    # 'linear' exists for several position kinds: the error shown is the first kind's, and so is its cause.
    with pytest.raises(ValueError, match="has no parameter 'bogus'") as info:
        ScalingRequest.from_model_args({"posext_method": "linear", "posext_factor": 2, "posext_bogus": 1})
    inner = info.value.__cause__
    assert inner.__cause__ is not None and str(inner.__cause__) == str(inner)


def test_a_method_that_sizes_itself_lists_its_size_parameter():
    with pytest.raises(ValueError, match=r"posext_method=self-extend needs its size: exactly one of posext_factor "
                                         r"\(e\.g\. posext_factor=2\) or posext_target_length \(e\.g\. "
                                         r"posext_target_length=16384\), or posext_group_size\.$"):
        ScalingRequest.from_model_args({"posext_method": "self-extend"})
    with pytest.raises(ValueError, match=r"posext_target_length=16384\)\.$"):  # DCA has no size parameter
        ScalingRequest.from_model_args({"posext_method": "dca"})


def test_original_window_must_be_positive_and_identity_is_factor_one_of_a_static_method():
    with pytest.raises(ValueError, match="original_max_position_embeddings must be positive, got 0"):
        ScalingConfig("linear", 2, 0)
    assert ScalingConfig("linear", 1, 64).is_identity
    assert not ScalingConfig("linear", 2, 64).is_identity
    assert not ScalingConfig("dynamic-ntk", 1, 64).is_identity  # dynamic: not the identity past the window


def test_text_values_read_as_the_cli_means_them():
    from hf_posext.core.request import parse_value

    assert parse_value(" True ") is True and parse_value("FALSE") is False
    assert parse_value("none") is None and parse_value("4") == 4 and parse_value("[1, 2]") == [1, 2]
    assert parse_value("yarn") == "yarn" and parse_value(2.5) == 2.5


def test_parameters_without_a_method_are_named_with_their_prefix():
    with pytest.raises(ValueError, match=r"^posext_factor, posext_beta_fast given without posext_method\. "):
        ScalingRequest.from_model_args({"posext_factor": 2, "posext_beta_fast": 16, "pretrained": "x"})
    assert ScalingRequest.from_model_args({"pretrained": "x"}) == (None, {"pretrained": "x"})


def test_parameters_are_ordered_by_name_whatever_their_values():
    """Equal values or values of different types: the request is the same in any given order."""
    one = ScalingRequest("yarn", factor=2, params={"mscale": 1.0, "mscale_all_dim": 1.0, "truncate": True})
    two = ScalingRequest("yarn", factor=2, params={"truncate": True, "mscale_all_dim": 1.0, "mscale": 1.0})
    assert one == two and hash(one) == hash(two)
    assert [name for name, _ in one.params] == ["mscale", "mscale_all_dim", "truncate"]


def test_a_target_equal_to_the_window_is_factor_one():
    from hf_posext.core.request import resolve_factor

    assert resolve_factor(None, 4096, 4096) == 1.0
    with pytest.raises(ValueError, match="target_length=4095 is shorter than the model's original window"):
        resolve_factor(None, 4095, 4096)


def test_a_target_length_gives_the_exact_ratio_not_its_floor():
    from hf_posext.core.request import resolve_factor

    assert resolve_factor(None, 12000, 8192) == 12000 / 8192  # 1.46..., not 1
    assert resolve_factor(2.5, None, 8192) == 2.5


def test_resolve_factor_names_the_right_problem_at_each_boundary():
    from hf_posext.core.request import resolve_factor

    with pytest.raises(ValueError, match=r"^target_length must be a positive integer, got 0\.$"):
        resolve_factor(None, 0, 8192)
    with pytest.raises(ValueError, match=r"^target_length=1 is shorter than the model's original window"):
        resolve_factor(None, 1, 8192)  # positive: the window check, not the positivity check
    with pytest.raises(ValueError, match=r"^factor=0\.5 is below 1"):
        resolve_factor(0.5, None, 8192)
    assert resolve_factor(1, None, 8192) == 1.0


def test_a_request_refuses_a_factor_below_one_and_lengths_below_one():
    with pytest.raises(ValueError, match=r"^factor=0\.5 is below 1"):
        ScalingRequest("yarn", factor=0.5)
    with pytest.raises(ValueError, match=r"^factor=0 is below 1"):
        ScalingRequest("yarn", factor=0)
    assert ScalingRequest("yarn", factor=1).factor == 1.0
    for name in ("target_length", "original_max_position_embeddings"):
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got 0\.$"):
            ScalingRequest("yarn", **{name: 0})
        assert getattr(ScalingRequest("yarn", **{name: 1}), name) == 1


def test_a_method_at_home_inside_the_window_takes_its_default_factor():
    """STRING needs no size: require_size fills its registered default factor (1), other methods raise."""
    request = ScalingRequest("string").require_size()
    assert request.factor == 1.0 and request.target_length is None
    assert ScalingRequest("none").require_size().factor == 1.0
    with pytest.raises(ValueError, match=r"^method=yarn needs its size"):
        ScalingRequest("yarn").require_size()


def test_a_section_with_unknown_fields_names_the_first_one():
    with pytest.raises(ValueError, match=r"^scaling has no field 'factr'; its fields are: method, params, factor"):
        ScalingRequest.from_mapping({"method": "yarn", "factr": 2, "zzz": 1})


def test_neither_factor_nor_target_suggests_four_times_the_window():
    from hf_posext.core.request import resolve_factor

    with pytest.raises(ValueError, match=r"^Give exactly one of factor= \(e\.g\. factor=4\) or target_length= \(e\.g\. "
                                         r"target_length=32768\); got factor=None, target_length=None\.$"):
        resolve_factor(None, None, 8192)
