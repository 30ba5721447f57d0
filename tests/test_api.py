"""The public API over the backend registry: every method listed, failed re-patches keep the previous
patch, malformed saved records named with their file and field."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import hf_posext
from hf_posext.cli import main
from hf_posext.models import tiny_model


def snapshot(model):
    """Every parameter, buffer and config field, and the model's attention implementation."""
    return (
        {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        {k: v.clone() for k, v in model.named_buffers()},
        copy.deepcopy(model.config.to_dict()),
        model.config._attn_implementation,
    )


def assert_unchanged(model, before):
    tensors, buffers, config, attention = snapshot(model)
    assert tensors.keys() == before[0].keys() and all(torch.equal(tensors[k], before[0][k]) for k in tensors)
    assert buffers.keys() == before[1].keys() and all(torch.equal(buffers[k], before[1][k]) for k in buffers)
    assert config == before[2]
    assert attention == before[3]


def logits(model):
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def test_available_methods_lists_every_kind_and_the_cli_prints_them(capsys):
    methods = hf_posext.available_methods()
    for name in ("yarn", "self-extend", "linear (learned)", "none (alibi)", "linear (relative)", "none (relative)"):
        assert name in methods
    assert set(hf_posext.available_methods("attention")) == {"self-extend", "dca", "string"}
    assert main(["methods"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in methods)


@pytest.mark.parametrize(
    "first, second, message",
    [
        (("yarn", {"factor": 2}), ("self-extend", {"group_size": 0, "neighbor_window": 32}), "group_size must be an integer >= 1"),
        (("self-extend", {"group_size": 4, "neighbor_window": 16}), ("yran", {"factor": 2}), "Did you mean 'yarn'"),
        (("self-extend", {"group_size": 4, "neighbor_window": 16}), ("yarn", {"factor": float("nan")}), "finite"),
        (("yarn", {"factor": 2}), ("self-extend", {"group_size": 4, "neighbor_window": 64}), "must be smaller than the model's original window"),
        (("self-extend", {"group_size": 4, "neighbor_window": 16}), ("longrope", {"factor": 2, "long_factor": [1, 2]}), "needs 4 values"),
    ],
)
def test_a_failed_repatch_keeps_the_previous_patch(first, second, message):
    model = hf_posext.patch(tiny_model("llama"), first[0], **first[1])
    before, reference, report = snapshot(model), logits(model), hf_posext.describe(model)
    with pytest.raises(ValueError, match=message):
        hf_posext.patch(model, second[0], **second[1])
    assert_unchanged(model, before)
    assert torch.equal(logits(model), reference)
    assert hf_posext.describe(model) == report
    hf_posext.unpatch(model)  # and the kept patch still unpatches to the original model
    assert hf_posext.describe(model).method == "none"


_YARN = {"version": 1, "kind": "rope", "method": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "params": {}}
_SELF_EXTEND = {"version": 1, "kind": "attention", "method": "self-extend", "factor": 2.0,
                "original_max_position_embeddings": 64, "params": {"group_size": 4, "neighbor_window": 16}}
_DCA = {"version": 1, "kind": "attention", "method": "dca", "factor": 2.0, "original_max_position_embeddings": 64,
        "params": {"chunk_size": 48, "local_window": 4}}


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fail a test that reaches ``from_pretrained`` of a model class (a bad record is refused before)."""
    from transformers import PreTrainedModel

    def refuse(cls, *args, **kwargs):
        raise AssertionError("weights were loaded before the record was checked")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize(
    "record, field",
    [("yarn x4", "'hf_posext' must be a mapping"), ([1, 2], "'hf_posext' must be a mapping"),
     ({"factor": 2.0, "kind": "rope"}, "has no 'method'"), ({"method": "yarn", "kind": "rope"}, "has no 'factor'"),
     ({"method": "yarn", "factor": 2, "kind": "wavelet"}, "'hf_posext'.kind is 'wavelet'"),
     ({"method": "yarn", "factor": 2, "version": 99}, "version is 99"),
     # a mistyped or impossible field is named, never a Python TypeError or a blame on the model
     (_YARN | {"original_max_position_embeddings": "abc"}, "original_max_position_embeddings must be a positive integer"),
     (_YARN | {"original_max_position_embeddings": 0}, "original_max_position_embeddings must be a positive integer"),
     ({"method": "yarn", "factor": 2, "kind": "rope"}, "has no 'original_max_position_embeddings'"),
     (_YARN | {"version": 0}, "version is 0, not a record version"),
     (_YARN | {"version": -1}, "version is -1, not a record version"),
     (_YARN | {"version": True}, "version is True, not a record version"),
     (_YARN | {"factor": -2}, "factor must be a finite number >= 1, got -2"),
     (_YARN | {"kind": "attention"}, "kind is 'attention', but its method 'yarn' is of kind 'rope'"),
     (_YARN | {"kind": "relative"}, "kind is 'relative', but its method 'yarn' is of kind 'rope'"),
     (_YARN | {"kind": 3}, "kind must be the name of a kind of position"),
     (_YARN | {"method": "wavelet"}, "method is 'wavelet', which this hf_posext does not know"),
     (_YARN | {"params": {"beta_fast": "x"}}, "params: beta_fast must be a positive number, got 'x'"),
     (_YARN | {"kind": "relative", "method": "linear"}, "kind is 'relative', but this LlamaForCausalLM has no relative positions"),
     (_YARN | {"kind": "learned", "method": "linear"}, "kind is 'learned', but this LlamaForCausalLM has no learned"),
     (_SELF_EXTEND | {"params": {"group_size": 4, "neighbor_window": "x"}}, "params: neighbor_window must be an integer"),
     (_DCA | {"params": {"chunk_size": 16, "local_window": 16}}, "params: local_window=16 must be smaller than chunk_size=16")],
)
def test_load_names_the_file_and_field_of_a_malformed_record(tmp_path, record, field, no_weights_loaded):
    tiny_model("llama").save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["hf_posext"] = record
    config_file.write_text(json.dumps(config))
    with pytest.raises(hf_posext.RecordError) as caught:
        hf_posext.load(tmp_path)
    message = str(caught.value)
    assert message.startswith(str(config_file)) and field in message and "\n" not in message


def test_a_record_that_fits_its_model_still_loads_with_the_checks_above(tmp_path):
    """The record and model checks refuse only what is wrong: every kind of saved patch loads back."""
    import transformers

    cases = [
        (hf_posext.patch(tiny_model("llama"), "yarn", factor=2, beta_fast=16), "yarn"),
        (hf_posext.patch(tiny_model("llama"), "self-extend", group_size=4, neighbor_window=16), "self-extend"),
        (hf_posext.patch(tiny_model("llama"), "dca", factor=2), "dca"),
        (hf_posext.patch(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)), "linear", factor=2), "linear"),
    ]
    for index, (model, method) in enumerate(cases):
        model.save_pretrained(tmp_path / str(index))
        assert hf_posext.describe(hf_posext.load(tmp_path / str(index))).method == method


@pytest.mark.parametrize("factor", [np.float32(2), np.float64(2), np.int64(2), torch.tensor(2.0), torch.tensor(2)],
                         ids=["np.float32", "np.float64", "np.int64", "tensor-float", "tensor-int"])
def test_a_numeric_scalar_of_numpy_or_torch_is_a_factor(factor):
    model = hf_posext.patch(tiny_model("llama"), "yarn", factor=factor)
    report = hf_posext.describe(model)
    assert (report.factor, report.current_window) == (2.0, 128)
    assert type(model.config.hf_posext["factor"]) is float  # the saved record stays plain JSON
    assert torch.equal(logits(model), logits(hf_posext.patch(tiny_model("llama"), "yarn", factor=2.0)))
    assert hf_posext.describe(hf_posext.patch(tiny_model("llama"), "yarn", target_length=np.int64(128))).factor == 2.0


@pytest.mark.parametrize("factor", [torch.tensor([2.0, 3.0]), torch.tensor([2.0]), np.array([2.0]), torch.tensor(True),
                                    np.bool_(True), torch.tensor(float("nan")), np.float32("inf")],
                         ids=["two-elements", "one-element-1d", "np-1d", "tensor-bool", "np-bool", "tensor-nan", "np-inf"])
def test_a_tensor_that_is_not_a_finite_number_is_still_refused(factor):
    with pytest.raises(ValueError, match="factor must be a finite number >= 1"):
        hf_posext.patch(tiny_model("llama"), "yarn", factor=factor)


def test_saved_records_are_versioned(tmp_path):
    model = hf_posext.patch(tiny_model("llama"), "dynamic-yarn", factor=2)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hf_posext"]["version"] == 1
    loaded = hf_posext.load(tmp_path, attn_implementation=model.config._attn_implementation)
    assert torch.equal(logits(loaded), logits(model))
