"""Per-family recipes: the config fields a family's tiny instance needs beyond the generic sizes.

Each entry says why in one line (shown in the support matrix's notes). A recipe holds sizes and layer
layouts only, never a position setting: every family is swept with the positions it ships.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECIPES", "UNBUILDABLE"]

_HYBRID = "one attention layer among the linear ones"

#: A drafting head's recipe: its text config must satisfy the head's validation (no per-layer inputs, every layer
#: KV-shared, which the config sets itself), with one sliding and one global layer as its target has; a backbone
#: narrower than the head, so that the two widths cannot be mixed up. Its inputs are synthetic
#: (:func:`~hf_posext.family_sweep.tiny.drafting_inputs`).
_DRAFT_HEAD = (dict(backbone_hidden_size=24, text_config=dict(
    global_head_dim=16, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
    layer_types=["sliding_attention", "full_attention"])),
    "a drafting head, run on synthetic target states (a 24-wide backbone's inputs_embeds and shared_kv_states); its "
    "keys come from its target model, which must carry the same scaling")

#: class name -> (config overrides, why).
RECIPES: dict[str, tuple[dict[str, Any], str]] = {
    "BailingHybridForCausalLM": (dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]),
                                 _HYBRID),
    "BambaForCausalLM": (dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_expand=2), _HYBRID),
    "GraniteMoeHybridForCausalLM": (dict(layer_types=["linear_attention", "attention"], mamba_n_heads=4, mamba_d_head=16,
                                         mamba_expand=2), _HYBRID),
    "JambaForCausalLM": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1), _HYBRID),
    "KimiLinearForCausalLM": (dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]),
                              _HYBRID),
    "Qwen3NextForCausalLM": (dict(layer_types=["linear_attention", "full_attention"]), _HYBRID),
    "Qwen3_5ForCausalLM": (dict(layer_types=["linear_attention", "full_attention"]), _HYBRID),
    "Qwen3_5MoeForCausalLM": (dict(layer_types=["linear_attention", "full_attention"]), _HYBRID),
    "Llama4ForCausalLM": (dict(no_rope_layer_interval=2), "one NoPE layer in two (the 1-in-4 pattern, shortened)"),
    "RecurrentGemmaForCausalLM": (dict(num_hidden_layers=3), "three layers: two recurrent, one attention"),
    "GPTJForCausalLM": (dict(rotary_dim=4), "a rotary dim that fits the 8-wide heads"),
    "CodeGenForCausalLM": (dict(rotary_dim=4), "a rotary dim that fits the 8-wide heads"),
    "Gemma3nForCausalLM": (dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
                           "four layers, the last two KV-shared (they reuse the keys of the first two, as real Gemma 3n's last "
                           "layers do)"),
    "Dots3NoteForCausalLM": (dict(num_key_value_heads=4), "as many key/value heads as query heads"),
    "Kolibri1_1ForCausalLM": (dict(head_dim=16, hidden_size=64), "a head dim that is a multiple of 16"),
    "ZayaForCausalLM": (dict(num_experts_per_tok=1), "one expert per token"),
    "Dots1ForCausalLM": (dict(n_routed_experts=4, n_shared_experts=1), "four routed experts and one shared"),
    "XmodForCausalLM": (dict(default_language="en_XX"), "a default language adapter"),
    "MusicgenForCausalLM": (dict(num_codebooks=1), "one codebook"),
    "MusicgenMelodyForCausalLM": (dict(num_codebooks=1), "one codebook"),
    "RoCBertForCausalLM": (dict(shape_vocab_size=64, shape_embed_dim=16, pronunciation_vocab_size=64,
                                pronunciation_embed_dim=16), "small shape and pronunciation tables"),
    "CsmDepthDecoderForCausalLM": (dict(backbone_hidden_size=32), "a small backbone width"),
    "BltForCausalLM": (dict(encoder_hash_byte_group_vocab=64), "a small hash vocabulary"),
    "GPTNeoForCausalLM": (dict(attention_types=[[["global", "local"], 1]]), "one global and one local layer"),
    "Mamba2ForCausalLM": (dict(num_heads=4, head_dim=16, expand=2), "heads x head dim = expand x hidden"),
    "ZambaForCausalLM": (dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),
                         "two hybrid layers (their shared transformer is tied across them)"),
    "Zamba2ForCausalLM": (dict(layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1]), _HYBRID),
    "CohereCompassForCausalLM": (dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
        "per-layer-type rope_parameters (the class has no default)"),
    "DbrxForCausalLM": (dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), ffn_config=dict(ffn_hidden_size=64)),
                        "attention and expert sizes in their sub-configs"),
    "Lfm2MoeForCausalLM": (dict(layer_types=["conv", "full_attention"]), "one convolution and one attention layer"),
    "Gemma4ForCausalLM": (dict(global_head_dim=16), "a 16-wide head on the global layers (512 by default)"),
    "Gemma4UnifiedForCausalLM": (dict(global_head_dim=16), "a 16-wide head on the global layers (512 by default)"),
    "Lfm3ForCausalLM": (dict(layer_types=["conv", "sliding_attention", "full_attention"], num_hidden_layers=3),
                        "a convolution, a sliding and a global attention layer (the first two are convolutions)"),
    "Qwen4ExpForCausalLM": (dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
                                 indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4),
                            _HYBRID + ", a small indexer"),
    "Gemma4AssistantForCausalLM": _DRAFT_HEAD,
    "Gemma4UnifiedAssistantForCausalLM": _DRAFT_HEAD,
}

#: class name -> the one-line reason no tiny instance of it can run on this machine (none today).
UNBUILDABLE: dict[str, str] = {}
