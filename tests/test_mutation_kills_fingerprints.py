"""Result fingerprints on the paths their main tests leave out (found by bench/mutation.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_posext.evaluation import fingerprints
from hf_posext.evaluation.fingerprints import rope_frequencies, same_frequencies, sampled_weights_fingerprint, weights_fingerprint
from hf_posext.models import tiny_model


class _Mixed(nn.Module):
    """An empty parameter and an offloaded (meta) one before the real weights: both are skipped, not the rest."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.empty(0))
        self.offloaded = nn.Parameter(torch.empty(4, device="meta"))
        self.weight = nn.Parameter(torch.arange(6.0))


@pytest.mark.parametrize("fingerprint", [weights_fingerprint, sampled_weights_fingerprint])
def test_parameters_after_an_empty_or_offloaded_one_are_still_hashed(fingerprint):
    model = _Mixed()
    before = fingerprint(model)
    assert fingerprint(model) == before
    with torch.no_grad():
        model.weight[5] += 1.0
    assert fingerprint(model) != before


def test_frequencies_with_other_attention_texts_differ():
    entry = {"module": "rotary", "layer_type": None, "inv_freq": [1.0, 0.5]}
    assert same_frequencies([{**entry, "attention": "a"}], [{**entry, "attention": "a"}])
    assert not same_frequencies([{**entry, "attention": "a"}], [{**entry, "attention": "b"}])
    assert not same_frequencies([{**entry, "attention": "a"}], [{**entry, "attention": 1.0}])


def test_stock_rotary_with_several_layer_types_is_read_per_layer_type():
    entries = rope_frequencies(tiny_model("gemma3"), 32)
    assert [(e["module"], e["layer_type"]) for e in entries] == [
        ("model.rotary_emb", "full_attention"), ("model.rotary_emb", "sliding_attention")]


class _RecordingRotaryEmbedding(nn.Module):
    """A stock-looking rotary module (matched by class name) whose attention scale is a per-layer-type dict.

    With ``marker_device`` its first buffer sits on that device; the forward records the device of the dummy
    input it is given, so the test can see which device ``rope_frequencies`` chose.
    """

    def __init__(self, attention_scaling: dict[str, float], marker_device: str = "cpu"):
        super().__init__()
        self.register_buffer("device_marker", torch.empty(1, device=marker_device), persistent=False)
        self.register_buffer("full_attention_inv_freq", torch.tensor([1.0, 0.25]), persistent=False)
        self.register_buffer("sliding_attention_inv_freq", torch.tensor([1.0, 0.5]), persistent=False)
        self.attention_scaling = attention_scaling
        self.forward_devices: list[torch.device] = []

    def forward(self, x, position_ids):
        self.forward_devices.append(x.device)
        return x, x


def _with_recording_rotary(attention_scaling: dict[str, float], marker_device: str = "cpu"):
    model = tiny_model("llama")
    model.model.rotary_emb = _RecordingRotaryEmbedding(attention_scaling, marker_device)
    return model, model.model.rotary_emb


@pytest.fixture
def rope_kind(monkeypatch):
    """describe() runs the model to find its positions, which the recording stand-in cannot serve (and it refuses
    meta buffers): what is under test is only how a found rotary module is read."""
    monkeypatch.setattr(fingerprints, "describe", lambda model: SimpleNamespace(kind="rope"))


def test_the_dummy_forward_runs_on_the_device_of_the_rotary_buffers(rope_kind):
    # On a GPU a rotary module on cuda given a cpu tensor raises; the exception is swallowed, and a dynamic
    # rope type would then be read before its buffers were updated for the length. A CPU-only machine has
    # no second real device, so the marker buffer sits on meta.
    model, rotary = _with_recording_rotary({"full_attention": 1.0, "sliding_attention": 1.0}, marker_device="meta")
    rope_frequencies(model, 32)
    assert rotary.forward_devices == [torch.device("meta")]


def test_a_layer_type_missing_from_a_scaling_dict_reads_as_unscaled(rope_kind):
    model, _ = _with_recording_rotary({"full_attention": 1.25})
    entries = rope_frequencies(model, 32)
    assert [(e["layer_type"], e["attention"], e["inv_freq"]) for e in entries] == [
        ("full_attention", 1.25, [1.0, 0.25]), ("sliding_attention", 1.0, [1.0, 0.5])]
