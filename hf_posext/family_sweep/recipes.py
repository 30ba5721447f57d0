"""Per-family recipes: the config fields a family's tiny instance needs beyond the generic sizes.

Each entry says why in one line (shown in the support matrix's notes). A recipe holds sizes and layer
layouts only, never a position setting: every family is swept with the positions it ships.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECIPES", "UNBUILDABLE"]

_HYBRID = "one attention layer among the linear ones"

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
    "Qwen4ExpForCausalLM": (dict(layer_types=["linear_attention", "indexed_attention"]), _HYBRID),
    "RecurrentGemmaForCausalLM": (dict(num_hidden_layers=3), "three layers: two recurrent, one attention"),
    "GPTJForCausalLM": (dict(rotary_dim=4), "a rotary dim that fits the 8-wide heads"),
    "CodeGenForCausalLM": (dict(rotary_dim=4), "a rotary dim that fits the 8-wide heads"),
    "Gemma3nForCausalLM": (dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"]),
                           "no KV-shared layers in two"),
    "CohereCompassForCausalLM": (dict(layer_types=["sliding_attention", "full_attention"]), "both layer types present"),
    "Dots3NoteForCausalLM": (dict(num_key_value_heads=4), "as many key/value heads as query heads"),
    "Kolibri1_1ForCausalLM": (dict(head_dim=16, hidden_size=64), "a head dim that is a multiple of 16"),
    "ZayaForCausalLM": (dict(num_experts_per_tok=1), "one expert per token"),
    "Gemma4AssistantForCausalLM": (dict(hidden_size_per_layer_input=0), "no per-layer inputs"),
    "GPTNeoForCausalLM": (dict(attention_types=[[["global", "local"], 1]]), "one global and one local layer"),
    "Mamba2ForCausalLM": (dict(num_heads=4, head_dim=16, expand=2), "heads x head dim = expand x hidden"),
    "ZambaForCausalLM": (dict(layers_block_type=["mamba", "hybrid"], attn_layer_period=2, attn_layer_offset=1),
                         _HYBRID),
    "Zamba2ForCausalLM": (dict(layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1]), _HYBRID),
}

#: class name -> the one-line reason no tiny instance of it can run on this machine.
UNBUILDABLE: dict[str, str] = {}
