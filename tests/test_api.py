"""The public API over the backend registry: every method listed, failed re-patches keep the previous
patch, malformed saved records named with their file and field."""

from __future__ import annotations

import copy
import json

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


@pytest.mark.parametrize(
    "record, field",
    [("yarn x4", "'hf_posext' must be a mapping"), ([1, 2], "'hf_posext' must be a mapping"),
     ({"factor": 2.0, "kind": "rope"}, "has no 'method'"), ({"method": "yarn", "kind": "rope"}, "has no 'factor'"),
     ({"method": "yarn", "factor": 2, "kind": "wavelet"}, "'hf_posext'.kind is 'wavelet'"),
     ({"method": "yarn", "factor": 2, "version": 99}, "version is 99")],
)
def test_load_names_the_file_and_field_of_a_malformed_record(tmp_path, record, field):
    tiny_model("llama").save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["hf_posext"] = record
    config_file.write_text(json.dumps(config))
    with pytest.raises(hf_posext.RecordError) as caught:
        hf_posext.load(tmp_path)
    message = str(caught.value)
    assert message.startswith(str(config_file)) and field in message and "\n" not in message


def test_saved_records_are_versioned(tmp_path):
    model = hf_posext.patch(tiny_model("llama"), "dynamic-yarn", factor=2)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hf_posext"]["version"] == 1
    loaded = hf_posext.load(tmp_path, attn_implementation=model.config._attn_implementation)
    assert torch.equal(logits(loaded), logits(model))
