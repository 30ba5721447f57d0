"""Result fingerprints on the paths their main tests leave out (found by bench/mutation.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
