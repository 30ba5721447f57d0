"""Small named rules for families whose layers do not all carry the same RoPE.

Each rule reads the config or the module structure, never a class name:

- :func:`scaled_layer_types` (per-layer-type RoPE: Gemma 3/4, LFM3, DeepSeek-V4, Ergo, MiMo-V2): which layer
  types a patch scales;
- :func:`layers_without_rope` (NoPE and non-attention layers: Llama 4, SmolLM3, Granite SWA, the Qwen3.5 /
  Qwen3-Next / Jamba hybrids): which layers no rotary module reaches, for ``describe``;
- :func:`kept_rope_keys` (model-specific keys of a rope dict: Mistral 4 / Ministral 3's
  ``llama_4_scaling_beta``, Qwen's ``mrope_section``): what a rewritten rope dict must keep;
- :func:`kept_method_parameters` (a family's own flavour of its method: gpt-oss's YaRN ``truncate=False``,
  DeepSeek's ``mscale`` / ``mscale_all_dim``, DeepSeek-V4's ``attention_factor=1``): re-scaling with the method
  the model already uses keeps the parameters the model was trained with, unless the call sets them;
- :func:`reads_target_states` (drafting heads: Gemma 4's assistants): the model attends to keys its target model
  computed and rotated, so only its queries carry its own rotary positions.
"""

from __future__ import annotations

import inspect
from typing import Any

from hf_posext.core.request import ScalingConfig

__all__ = ["scaled_layer_types", "layers_without_rope", "kept_rope_keys", "kept_method_parameters", "reads_target_states",
           "TARGET_STATES_ARGUMENT", "SCALING_KEYS"]

#: The forward argument through which a drafting head receives its target model's keys and values.
TARGET_STATES_ARGUMENT = "shared_kv_states"

#: Keys that say how a rope dict scales (any transformers rope type); every other key is the model's own.
SCALING_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor",
    "low_freq_factor", "high_freq_factor",
})

#: Words in a layer type's name that mark layers without attention RoPE (linear attention, convolutions, SSMs).
_NO_ROPE_WORDS = ("linear", "conv", "mamba", "recurrent", "ssm", "mlp", "moe")
#: Words that mark local (sliding-window) attention, left unscaled when other layer types attend globally.
_LOCAL_WORDS = ("sliding", "local", "window", "chunk")


def scaled_layer_types(current: dict[str | None, ScalingConfig]) -> tuple[str | None, ...]:
    """The layer types a patch scales, given what each computes now.

    Rule, first that applies: the types the config already scales, when the others are unscaled (DeepSeek-V4's
    ``compress``); the types named full or global (Gemma 3/4's ``full_attention``); every type that is not
    local (sliding window); else all of them.
    """
    types = [t for t in current if t is not None]
    if not types:
        return (None,)
    scaled = [t for t in types if not current[t].spec.baseline and not current[t].is_identity]
    if 0 < len(scaled) < len(types):
        return tuple(scaled)
    named = [t for t in types if "full" in t or "global" in t]
    if named:
        return tuple(named)
    not_local = [t for t in types if not any(word in t for word in _LOCAL_WORDS)]
    return tuple(not_local) if 0 < len(not_local) < len(types) else tuple(types)


def layers_without_rope(config: Any) -> list[int]:
    """Indices of the layers that carry no RoPE, read from the config.

    ``no_rope_layers`` (1: RoPE, 0: NoPE; Llama 4, SmolLM3), ``layer_rope_theta`` (0: NoPE; Granite SWA) and
    ``layer_types`` named for linear attention, convolutions or SSMs (Qwen3.5, LFM, Jamba) say so.
    """
    flags = getattr(config, "no_rope_layers", None)
    if isinstance(flags, (list, tuple)) and flags:
        return [i for i, uses_rope in enumerate(flags) if not uses_rope]
    thetas = getattr(config, "layer_rope_theta", None)
    if isinstance(thetas, (list, tuple)) and thetas:
        return [i for i, theta in enumerate(thetas) if not theta]
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        return [i for i, t in enumerate(layer_types) if isinstance(t, str) and any(w in t for w in _NO_ROPE_WORDS)]
    return []


def kept_rope_keys(base: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    """The model's own keys of rope dict ``base`` that ``written`` (a new rope dict) must keep.

    Every key that is not a scaling parameter (``partial_rotary_factor``, ``mrope_section``,
    ``llama_4_scaling_beta``...), and ``original_max_position_embeddings`` when the model reads it beside a
    scaling-free key (Mistral 4 / Ministral 3 scale attention by it with ``llama_4_scaling_beta``).
    """
    kept = {k: v for k, v in base.items() if k not in SCALING_KEYS and k not in written}
    if kept and "original_max_position_embeddings" in base and "original_max_position_embeddings" not in written:
        kept["original_max_position_embeddings"] = base["original_max_position_embeddings"]
    return kept


def kept_method_parameters(current: ScalingConfig, method: str, requested: dict[str, Any]) -> dict[str, Any]:
    """The parameters a patch with ``method`` runs with: the model's own ones for that method, then ``requested``.

    Args:
        current: the scaling the model's config applies now (at its scaled layer types).
        method: the requested method. requested: the parameters given in the call (they win).
    """
    if current.method != method:
        return dict(requested)
    return {**{k: v for k, v in current.params.items() if v is not None}, **requested}


def reads_target_states(model: Any) -> bool:
    """True for a drafting head: its forward takes :data:`TARGET_STATES_ARGUMENT`, the keys and values its target
    model computed (and rotated, with the target's frequencies at the target's positions), so it computes no keys
    of its own and only its queries are rotated by its own rotary module (Gemma 4's assistant heads)."""
    forward = getattr(type(model), "forward", None)
    try:
        return forward is not None and TARGET_STATES_ARGUMENT in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature takes no such argument by name
        return False
