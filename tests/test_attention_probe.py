"""Attention-level methods on every rotary geometry the probe finds, checked against the model's own rotary.

Reference: with one layer, the last token's logits depend only on how its query meets every key. Self-Extend
rotates that query to ``P = i // G + W - W // G`` and a key at distance ``d >= W`` to ``j // G``; a neighbour
key keeps its distance. The *unpatched* model given position ids ``P - d`` for neighbours, ``j // G`` for far
keys and ``P`` for the query computes exactly that with its own rotary module, whatever its channel pairing,
placement or direction. So a wrong geometry (pairs read as halves, rotary channels looked for in front of the
latent-attention channels, the reversed rotation of NanoChat) moves the last token's logits far beyond float noise.
"""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import probe
from hf_posext.family_sweep.tiny import build_tiny, tiny_family_config
from tests.conftest import transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

GROUP, NEIGHBOURS, LENGTH = 4, 6, 96  # 3x the tiny window of 32
SHARPEN = 8.0

#: class -> (the geometry the probe must find on layer 0: interleaved, rotary offset, reversed; config overrides)
GEOMETRIES = {
    "LlamaForCausalLM": ((False, 0, False), {}),
    "CohereForCausalLM": ((True, 0, False), {}),  # neighbouring pairs
    "Glm4ForCausalLM": ((True, 0, False), {}),  # neighbouring pairs on a partial rotary
    "DeepseekV3ForCausalLM": ((False, 4, False), {}),  # latent attention: rotary channels after 4 position-free ones
    "DeepseekV2ForCausalLM": ((True, 4, False), {}),  # the same with neighbouring pairs (complex rotary)
    "NanoChatForCausalLM": ((False, 0, True), {}),  # rotation by minus the angle
    "Llama4ForCausalLM": ((True, 0, False), {}),  # complex rotary: neighbouring pairs
    "Gemma4ForCausalLM": ((False, 0, False), {"layer_types": ["full_attention"]}),  # proportional: 1/4 of the pairs rotate
}


def _one_layer(class_name: str, overrides: dict) -> torch.nn.Module:
    config = tiny_family_config(class_name, num_hidden_layers=1, **overrides)
    if getattr(config, "layer_types", None) and "layer_types" not in overrides:
        config.layer_types = config.layer_types[:1]
    for name in ("first_k_dense_replace", "num_nextn_predict_layers"):
        if hasattr(config, name):
            setattr(config, name, 0)
    model = build_tiny(class_name, seed=3, config=config)
    # At the 0.02 init every attention row is nearly uniform, and positions barely move the logits: sharpen the
    # attention (every projection inside it, so latent and plain attention alike) until they do.
    with torch.no_grad():
        for path, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".self_attn." in f".{path}." and "o_proj" not in path:
                module.weight.mul_(SHARPEN)
    return model


def _reference_plain_extended(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Last-token logits of the unpatched model at the emulated Self-Extend positions (the reference) and at its own
    positions, then of the model patched with Self-Extend (left patched)."""
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=_self_extend_positions(ids.shape[1]),
                          use_cache=False).logits[0, -1]
        plain = model(input_ids=ids, use_cache=False).logits[0, -1]
    hf_posext.patch(model, "self-extend", group_size=GROUP, neighbor_window=NEIGHBOURS)
    with torch.no_grad():
        extended = model(input_ids=ids, use_cache=False).logits[0, -1]
    return reference, plain, extended


def _self_extend_positions(length: int) -> torch.Tensor:
    i = length - 1
    query = i // GROUP + NEIGHBOURS - NEIGHBOURS // GROUP
    positions = [query - (i - j) if i - j < NEIGHBOURS else j // GROUP for j in range(length)]
    return torch.tensor(positions)[None]


@pytest.mark.parametrize("class_name", sorted(GEOMETRIES))
def test_self_extend_matches_the_models_own_rotary_at_emulated_positions(class_name):
    (interleaved, offset, reversed_), overrides = GEOMETRIES[class_name]
    model = _one_layer(class_name, overrides)
    ids = torch.randint(3, int(model.config.vocab_size), (1, LENGTH), generator=torch.Generator().manual_seed(0))
    layers, _ = probe.find_attention_layers(model, "Self-Extend")
    first = layers[0]
    assert (first.interleaved, first.rotary_offset, bool(first.inv_freq[0] < 0)) == (interleaved, offset, reversed_)
    reference, plain, extended = _reference_plain_extended(model, ids)
    effect = float((plain - reference).abs().max())
    error = float((extended - reference).abs().max())
    print(f"{class_name}: effect {effect:.2e}, error {error:.2e}")
    assert effect > 1e-3, f"the grouped positions barely move {class_name}'s logits ({effect:.2e}): no test"
    assert error < effect / 1000, f"{class_name}: Self-Extend is {error:.2e} from the reference (effect {effect:.2e})"
    hf_posext.unpatch(model)


def test_a_nope_layer_is_left_as_plain_attention_and_described():
    model = build_tiny("Llama4ForCausalLM")  # layer 1 is a NoPE layer (no_rope_layers)
    layers, _ = probe.find_attention_layers(model, "STRING")
    assert [layer.position_free for layer in layers] == [False, True]
    assert [layer.scaled for layer in layers] == [True, False]
    hf_posext.patch(model, "string")
    notes = hf_posext.describe(model).notes
    assert any("1 of 2 attention layers (others: no rotary position (NoPE))" in note for note in notes), notes


def test_rotary_channels_last_are_moved_first_only_while_patched():
    model = build_tiny("DeepseekV3ForCausalLM")
    attention = model.model.layers[0].self_attn
    hf_posext.patch(model, "string")
    assert getattr(attention, probe.ROTARY_OFFSET_ATTRIBUTE) == 4
    hf_posext.unpatch(model)
    assert not hasattr(attention, probe.ROTARY_OFFSET_ATTRIBUTE)


def test_a_rotation_no_geometry_explains_is_refused_in_one_line(monkeypatch):
    model = build_tiny("LlamaForCausalLM")
    record = probe.probe_attention

    def scrambled(module, query, key, *args, **kwargs):  # q and k reach attention with their channels reversed
        return record(module, query.flip(-1), key.flip(-1), *args, **kwargs)

    monkeypatch.setattr(probe, "probe_attention", scrambled)
    from transformers import AttentionInterface

    AttentionInterface.register(probe.PROBE_IMPLEMENTATION, scrambled)
    try:
        with pytest.raises(hf_posext.UnsupportedModelError, match=r"are not rotated the way its rotary module describes "
                           r"\(rotary dim 8 of 8 channels; no pairing, placement or direction fits\)"):
            hf_posext.patch(model, "self-extend", group_size=2, neighbor_window=4)
    finally:
        AttentionInterface.register(probe.PROBE_IMPLEMENTATION, record)
    assert hf_posext.describe(model).method == "none"


#: Families whose attention adds learned sinks (``s_aux``): one logit per query head in every softmax denominator.
SINK_FAMILIES = ["GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM"]


def _with_sinks(class_name: str, values: torch.Tensor | float) -> torch.nn.Module:
    model = _one_layer(class_name, {"layer_types": ["full_attention"]})
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        attention.sinks.copy_(torch.as_tensor(values, dtype=attention.sinks.dtype).expand_as(attention.sinks))
    return model


@pytest.mark.parametrize("class_name", SINK_FAMILIES)
def test_self_extend_applies_learned_attention_sinks_as_the_model_does(class_name):
    """Self-Extend past the window equals the unpatched model (whose own attention applies the sinks) at the
    emulated positions; a kernel that dropped the sinks would sit at the sinks' whole effect from it."""
    sinks = torch.linspace(-1.0, 3.0, _one_layer(class_name, {"layer_types": ["full_attention"]}).config.num_attention_heads)
    model, no_sinks = _with_sinks(class_name, sinks), _with_sinks(class_name, -1e4)
    ids = torch.randint(3, int(model.config.vocab_size), (1, LENGTH), generator=torch.Generator().manual_seed(0))
    emulated = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": _self_extend_positions(LENGTH), "use_cache": False}
    with torch.no_grad():
        without = no_sinks(**emulated).logits[0, -1]
    reference, plain, extended = _reference_plain_extended(model, ids)
    assert float((plain - reference).abs().max()) > 1e-3, "the grouped positions barely move the logits: no test of the grouped path"
    effect, error = float((reference - without).abs().max()), float((extended - reference).abs().max())
    print(f"{class_name}: sinks' effect {effect:.2e}, error {error:.2e}")
    assert effect > 1e-3, f"the sinks barely move {class_name}'s logits ({effect:.2e}): no test"
    assert error < effect / 1000, f"{class_name}: Self-Extend with sinks is {error:.2e} from the reference (effect {effect:.2e})"


@pytest.mark.parametrize("method, params", [("self-extend", {"group_size": GROUP, "neighbor_window": 24}),
                                            ("dca", {"factor": 3}), ("string", {"factor": 3}), ("yarn+string", {"factor": 3})])
def test_learned_sinks_are_kept_inside_the_window_and_in_cached_decoding(method, params):
    """Inside the window (Self-Extend: its neighbour window) the attention-level methods leave gpt-oss as it was,
    its sinks included; past it, a decode step over the KV cache equals the full recompute (DCA's decode kernel
    applies the sinks too)."""
    model = _with_sinks("GptOssForCausalLM", 2.0)
    ids = torch.randint(3, int(model.config.vocab_size), (1, 48), generator=torch.Generator().manual_seed(1))
    inside = ids[:, :24]  # within the tiny window of 32
    with torch.no_grad():
        before = model(input_ids=inside, use_cache=False).logits
    hf_posext.patch(model, method, **params)
    with torch.no_grad():
        after = model(input_ids=inside, use_cache=False).logits
        full = model(input_ids=ids, use_cache=False).logits[0, -1]
        cache = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        step = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]
    if method != "yarn+string":  # yarn rescales every frequency, inside the window too
        assert float((after - before).abs().max()) < 1e-5, float((after - before).abs().max())
    assert float((step - full).abs().max()) < 1e-4, float((step - full).abs().max())


def test_a_sparse_attention_indexer_is_refused_in_one_line():
    """A DSA indexer (GLM-MoE-DSA, HY-V4) ranks keys by their rotary positions outside the attention function: with
    Self-Extend applied to the attention alone, HY-V4's logits sit at the positions' whole effect from the emulated reference (measured:
    error 1.9e-2 for an effect of 1.6e-2), so every attention-level method refuses it, and frequency methods remain."""
    model = build_tiny("GlmMoeDsaForCausalLM")
    for method in ("self-extend", "dca", "string", "yarn+string"):
        with pytest.raises(hf_posext.UnsupportedModelError) as refused:
            hf_posext.patch(model, method, factor=2) if method != "self-extend" else hf_posext.patch(model, method, group_size=2, neighbor_window=8)
        assert "holds GlmMoeDsaIndexer, a sparse-attention indexer" in str(refused.value) and "\n" not in str(refused.value)
        assert hf_posext.describe(model).method == "none"
    hf_posext.patch(model, "yarn", factor=2)
    assert hf_posext.describe(model).method == "yarn"


def _gemma3n_with_kv_shared_layers(layer_types: list[str], shared: int) -> torch.nn.Module:
    """A tiny Gemma 3n whose last ``shared`` layers reuse the keys and values of the last earlier layer of their type,
    as real Gemma 3n checkpoints' last layers do."""
    config = tiny_family_config("Gemma3nForCausalLM", num_hidden_layers=len(layer_types), num_kv_shared_layers=shared,
                                layer_types=layer_types)
    return build_tiny("Gemma3nForCausalLM", seed=3, config=config)


def test_self_extend_on_kv_shared_layers_matches_the_models_own_rotary_at_emulated_positions():
    """Layer 0 computes the only keys (from the embeddings, so their content does not depend on positions) and
    layers 1 and 2 reuse them: the last token's logits then depend only on how its query meets those keys in each
    layer, and the unpatched model at the emulated positions is the reference for all three layers. A Self-Extend
    that left the KV-shared layers plain, or re-rotated their keys to other positions than their source layer's,
    sits a large part of the effect away (measured once, effect 2.2e-1: leaving them plain, 1.5e-1 from the
    reference; their keys one position later than their source layer's, 3.9e-2; Self-Extend as it is, 1.5e-7)."""
    model = _gemma3n_with_kv_shared_layers(["full_attention"] * 3, shared=2)
    assert model.config.kv_sharing_modes == ["store", "reuse", "reuse"]
    ids = torch.randint(3, int(model.config.vocab_size), (1, LENGTH), generator=torch.Generator().manual_seed(0))
    reference, plain, extended = _reference_plain_extended(model, ids)
    effect, error = float((plain - reference).abs().max()), float((extended - reference).abs().max())
    print(f"Gemma 3n, KV-shared layers: effect {effect:.2e}, error {error:.2e}")
    assert effect > 1e-3, f"the grouped positions barely move the logits ({effect:.2e}): no test"
    assert error < effect / 1000, f"Self-Extend on KV-shared layers is {error:.2e} from the reference (effect {effect:.2e})"


def test_self_extend_on_kv_shared_layers_decodes_as_it_recomputes_at_the_source_layers_positions(monkeypatch):
    """The sweep's Gemma 3n (sliding, full, then both again KV-shared): each KV-shared layer gets the same keys at the
    same key positions as the layer it reuses (the grouped re-rotation of keys follows them), and a decode step
    over the KV cache past the window gives the full recompute's logits."""
    from hf_posext.backends.attention import self_extend

    model = _gemma3n_with_kv_shared_layers(["sliding_attention", "full_attention"] * 2, shared=2)
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    ids = torch.randint(3, int(model.config.vocab_size), (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits[0, -1]
    hf_posext.patch(model, "self-extend", group_size=GROUP, neighbor_window=NEIGHBOURS)
    seen, positions_of = [], self_extend.call_positions

    def recorded(query, key, position_ids, label):  # every layer's call, in layer order
        query_positions, key_positions = positions_of(query, key, position_ids, label)
        seen.append((key.clone(), key_positions.clone()))
        return query_positions, key_positions

    monkeypatch.setattr(self_extend, "call_positions", recorded)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0, -1]
    monkeypatch.setattr(self_extend, "call_positions", positions_of)
    assert len(seen) == 4
    for shared, source in ((2, 0), (3, 1)):
        assert torch.equal(seen[shared][0], seen[source][0]), f"KV-shared layer {shared} does not get layer {source}'s keys"
        assert torch.equal(seen[shared][1], seen[source][1]), f"KV-shared layer {shared} sees other key positions than layer {source}"
    with torch.no_grad():
        cache = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        step = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[0, -1]
    effect, error = float((full - plain).abs().max()), float((step - full).abs().max())
    print(f"Gemma 3n, KV-shared layers: Self-Extend's effect {effect:.2e}, decode step vs recompute {error:.2e}")
    assert effect > 1e-3, f"Self-Extend barely moves the logits ({effect:.2e}): no test"
    assert error < effect / 1000, f"a cached decode step is {error:.2e} from the full recompute (effect {effect:.2e})"
