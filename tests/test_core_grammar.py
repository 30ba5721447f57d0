"""The request grammar (``yarn:factor=4:beta_fast=16``), read the same way by every entry point.

One table of inputs goes through every place a user writes a request: the parser itself, ``hf-posext
patch --method``, ``hf-posext eval --methods``, the report card's model rows, ``lm-eval-compare --methods``,
lm-eval's ``posext=`` model argument and a recipe's ``scaling:``. Each must give the same request, or refuse
with the same one-line reason. The older spellings still work, each with one deprecation line naming the
new form.
"""

from __future__ import annotations

import warnings

import pytest

from hf_posext.cli.main import build_parser
from hf_posext.cli.scaling_arguments import request_from_arguments
from hf_posext.core.grammar import format_request, parse_request, split_top_level
from hf_posext.core.request import ScalingRequest
from hf_posext.evaluation.arguments import parse_methods
from hf_posext.card.spec import parse_model_specs
from hf_posext.training.config import ConfigError, config_from_dict

VALID = [
    ("yarn:factor=4", ScalingRequest("yarn", 4.0)),
    ("linear:target_length=32768", ScalingRequest("linear", target_length=32768)),
    ("yarn:factor=4:beta_fast=16", ScalingRequest("yarn", 4.0, params=(("beta_fast", 16),))),
    ("dynamic-ntk:factor=2:original_max_position_embeddings=2048",
     ScalingRequest("dynamic-ntk", 2.0, original_max_position_embeddings=2048)),
    ("yarn+string:factor=4:string.local_value=128",
     ScalingRequest("yarn+string", 4.0, params=(("string.local_value", 128),))),
    (" yarn : factor = 2 ", ScalingRequest("yarn", 2.0)),
]

INVALID = [
    ("yarn:factor", "is not NAME=VALUE"),
    ("yarn:4", "write e.g. yarn:factor=4"),
    ("yarn:factor=0.5", "below 1"),
    ("yran:factor=4", "yarn"),  # unknown method: the closest name is offered
    ("yarn:factor=4:factor=2", "twice"),
    ("yarn:factor=2:beta_fats=16", "beta_fast"),
    (":factor=4", "names no method"),
    ("yarn:factor=2:target_length=4096", "exactly one of factor"),
    ("linear:factor=2:scale=[1,2", "bracket"),
]


def _cli(text: str) -> ScalingRequest:
    args = build_parser().parse_args(["patch", "model", "--method", text, "--out", "out"])
    return request_from_arguments(args)


def _eval(text: str) -> ScalingRequest:
    (request,) = parse_methods(text)
    return request


def _card(text: str) -> ScalingRequest:
    (spec,) = parse_model_specs(f"row=smollm2-135m@{text}")
    ((method_text, factor),) = spec.methods
    assert factor is None
    return _eval(method_text)


def _recipe(text: str) -> ScalingRequest:
    try:
        return config_from_dict({"scaling": text}).scaling.to_request()
    except ConfigError as error:
        raise ValueError(str(error)) from error


def _lm_eval(text: str) -> ScalingRequest:
    model = pytest.importorskip("hf_posext.integrations.lm_eval.model")
    request, rest = model.parse_posext_args({"posext": text, "dtype": "float32"})
    assert rest == {"dtype": "float32"}
    return request


def _lm_eval_compare(text: str) -> ScalingRequest:
    compare = pytest.importorskip("hf_posext.integrations.lm_eval.compare")
    arguments = compare.parse_method_spec(text)
    assert list(arguments) == ["posext"]
    return parse_request(arguments["posext"])


ENTRY_POINTS = {
    "parser": parse_request, "patch --method": _cli, "eval --methods": _eval, "card --models": _card,
    "recipe scaling": _recipe, "lm-eval posext=": _lm_eval, "lm-eval-compare --methods": _lm_eval_compare,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("text,expected", VALID, ids=[text.strip() for text, _ in VALID])
def test_every_entry_point_reads_the_same_request(entry, text, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the new spelling is never called deprecated
        assert ENTRY_POINTS[entry](text).require_size() == expected.require_size()


#: Where a refused text is an older spelling that still works for one release (tested below).
STILL_READ = {("card --models", "yarn:4")}
REFUSALS = [(entry, text, message) for entry in ENTRY_POINTS for text, message in INVALID if (entry, text) not in STILL_READ]


@pytest.mark.parametrize("entry,text,message", REFUSALS, ids=[f"{entry}-{text}" for entry, text, _ in REFUSALS])
def test_every_entry_point_refuses_bad_requests_in_one_line(entry, text, message):
    with pytest.raises(ValueError) as caught:
        ENTRY_POINTS[entry](text)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text,expected", VALID, ids=[text.strip() for text, _ in VALID])
def test_format_reads_back_to_the_same_request(text, expected):
    assert parse_request(format_request(expected)) == expected


def test_a_list_value_keeps_its_commas():
    assert split_top_level("none,longrope:factor=2:long_factor=[1.0,1.5],yarn", ",") == [
        "none", "longrope:factor=2:long_factor=[1.0,1.5]", "yarn"]


def test_a_size_is_required_where_the_request_is_applied():
    with pytest.raises(ValueError, match="factor"):
        _cli("yarn")
    assert _cli("none") == ScalingRequest("none", 1.0)


OLD_SPELLINGS = [
    (lambda: _cli_old(["--method", "yarn", "--factor", "4", "--param", "beta_fast=16"]), "--method yarn:factor=4:beta_fast=16"),
    (lambda: parse_methods("yarn", {"beta_fast": 16}), "--methods yarn:beta_fast=16"),
    (lambda: parse_model_specs("row=smollm2-135m@yarn:4"), "yarn:factor=4"),
]


def _cli_old(flags: list[str]) -> ScalingRequest:
    return request_from_arguments(build_parser().parse_args(["patch", "model", *flags, "--out", "out"]))


@pytest.mark.parametrize("call,new_form", OLD_SPELLINGS, ids=["patch flags", "eval --param", "card METHOD:FACTOR"])
def test_old_spellings_work_with_one_deprecation_line_naming_the_new_form(call, new_form):
    with pytest.warns(FutureWarning) as caught:
        call()
    assert len(caught) == 1 and new_form in str(caught[0].message)


def test_old_lm_eval_spellings_still_work_with_the_new_form_named():
    model = pytest.importorskip("hf_posext.integrations.lm_eval.model")
    compare = pytest.importorskip("hf_posext.integrations.lm_eval.compare")
    with pytest.warns(FutureWarning, match="posext=yarn:factor=4:beta_fast=16"):
        request, _ = model.parse_posext_args({"posext_method": "yarn", "posext_factor": "4", "posext_beta_fast": "16"})
    assert request == ScalingRequest("yarn", 4.0, params=(("beta_fast", 16),))
    with pytest.warns(FutureWarning, match="'dynamic-yarn:target_length=16384:beta_fast=16'"):
        arguments = compare.parse_method_spec("dynamic-yarn:target_length=16384,beta_fast=16")
    assert arguments == {"posext": "dynamic-yarn:target_length=16384:beta_fast=16"}


def test_both_spellings_at_once_are_refused():
    model = pytest.importorskip("hf_posext.integrations.lm_eval.model")
    with pytest.raises(ValueError, match="leave out posext_factor"):
        model.parse_posext_args({"posext": "yarn:factor=4", "posext_factor": "4"})
    with pytest.raises(ValueError, match="leave out --factor"):
        _cli_old(["--method", "yarn:factor=4", "--factor", "4"])


def test_a_recipe_override_still_changes_a_scaling_written_as_text():
    from hf_posext.training.config import apply_overrides

    data = apply_overrides({"scaling": "yarn:factor=4"}, ["scaling.factor=8"])
    assert config_from_dict(data).scaling.to_request() == ScalingRequest("yarn", 8.0)
