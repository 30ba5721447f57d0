"""Drafting heads (Gemma 4's assistants) in the family sweep: a tiny instance on synthetic target states, frequency
methods taken with describe's note that the target must carry the same scaling, attention-level methods refused.

A drafting head attends to keys its target model computed and rotated (``shared_kv_states``); only its queries are
rotated by its own rotary module. An attention-level method re-rotates keys to the positions it assigns them, which
needs the frequencies and positions they carry: the head cannot see them, so every such method is refused in one
line, found by structure (the forward takes ``shared_kv_states``), never by class name.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import hf_posext
from hf_posext.family_sweep import recipes
from hf_posext.family_sweep.sweep import OK, sweep_class
from hf_posext.family_sweep.tiny import WINDOW, build_tiny, model_inputs

HEADS = ["Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM"]
ATTENTION_METHODS = {"self-extend": {"group_size": 2, "neighbor_window": 8}, "dca": {"factor": 2}, "string": {"factor": 2},
                     "yarn+string": {"factor": 2}}


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("class_name", HEADS)
def test_a_drafting_head_runs_on_synthetic_target_states_beyond_the_window(class_name):
    model = build_tiny(class_name)
    inputs = model_inputs(model, WINDOW + 16, seed=1)
    states = inputs["shared_kv_states"]
    assert inputs["inputs_embeds"].shape == (1, 1, 2 * model.config.backbone_hidden_size)
    assert inputs["position_ids"].tolist() == [[WINDOW + 15]]  # the query sits past the window
    # per layer type its own head width; a sliding layer type gets the last tokens of its window only
    assert {layer_type: tuple(keys.shape) for layer_type, (keys, _) in states.items()} == {
        "sliding_attention": (1, 2, 16, 8), "full_attention": (1, 2, WINDOW + 16, 16)}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    assert logits.shape == (1, 1, model.config.get_text_config().vocab_size) and bool(torch.isfinite(logits).all())
    assert torch.equal(model_inputs(model, WINDOW + 16, seed=1)["inputs_embeds"], inputs["inputs_embeds"])  # deterministic


@pytest.mark.parametrize("class_name", HEADS)
def test_attention_level_methods_are_refused_on_a_drafting_head_in_one_line(class_name):
    model = build_tiny(class_name)
    for method, params in ATTENTION_METHODS.items():
        with pytest.raises(hf_posext.UnsupportedModelError) as refused:
            hf_posext.patch(model, method, **params)
        message = str(refused.value)
        assert "\n" not in message
        assert f"cannot be applied to {class_name}: it is a drafting head that attends to its target model's keys " \
               "(shared_kv_states)" in message and "Patch the target model with" in message, message
        assert hf_posext.describe(model).method != method  # nothing left patched


def test_a_drafting_head_is_found_by_its_forward_not_its_class_name():
    """Any model whose forward takes ``shared_kv_states`` is a drafting head; the same model without it is not."""
    from transformers import LlamaForCausalLM

    class DraftingLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, shared_kv_states=None, **kwargs):
            return super().forward(input_ids=input_ids, **kwargs)

    plain = build_tiny("LlamaForCausalLM")
    drafting = DraftingLlama(copy.deepcopy(plain.config)).eval()
    with pytest.raises(hf_posext.UnsupportedModelError, match="it is a drafting head that attends to its target"):
        hf_posext.patch(drafting, "string", factor=2)
    hf_posext.patch(plain, "string", factor=2)  # the same model, without the argument, takes it
    hf_posext.patch(drafting, "yarn", factor=2)
    assert any("a drafting head" in note for note in hf_posext.describe(drafting).notes)
    assert not any("drafting head" in note for note in hf_posext.describe(plain).notes)


def test_describe_says_the_target_must_carry_the_drafting_heads_scaling():
    model = build_tiny("Gemma4AssistantForCausalLM")
    unpatched = hf_posext.describe(model).notes
    assert any("a drafting head: the keys it attends to are its target model's (shared_kv_states)" in n for n in unpatched)
    with pytest.warns(UserWarning, match=r"a drafting head: .* patch the target with the same scaling \(hf_posext.patch\("
                                       r"target, 'yarn', factor=2\)\), or queries and keys disagree") as caught:
        hf_posext.patch(model, "yarn", factor=2)  # said at the patch too: a target left unscaled is silently wrong
    assert caught[0].filename == __file__
    notes = hf_posext.describe(model).notes
    assert any("patch the target with the same scaling (hf_posext.patch(target, 'yarn', factor=2))" in n for n in notes), notes


def test_a_drafting_head_matches_transformers_scaling_where_transformers_scales_it(monkeypatch):
    """Gemma 4's own global layers use proportional RoPE, which transformers scales with no other rope type (no parity
    in the sweep): with plain RoPE on both layer types the sweep compares the head with transformers' own scaling of its
    ``text_config``, on the same synthetic target states, and finds it equal."""
    name = "Gemma4AssistantForCausalLM"
    overrides, note = recipes.RECIPES[name]
    rope = {layer_type: {"rope_type": "default", "rope_theta": 10000.0} for layer_type in ("sliding_attention", "full_attention")}
    monkeypatch.setitem(recipes.RECIPES, name, ({**overrides, "text_config": {**overrides["text_config"], "rope_parameters": rope}},
                                                note))
    result = sweep_class(name, methods=["linear", "yarn"])
    assert [(m.method, m.outcome, m.parity) for m in result.methods] == [("linear", OK, True), ("yarn", OK, True)], result
