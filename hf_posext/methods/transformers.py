"""The one table between our RoPE methods and transformers' ``rope_type`` values.

Used both ways: reading a model whose config already scales RoPE (``rope_type`` -> our method) and
writing ``rope_parameters`` so stock ``from_pretrained`` reproduces a patched model (method -> ``rope_type``).
"""

from __future__ import annotations

__all__ = [
    "ROPE_TYPES",
    "method_for_rope_type",
    "rope_type_for",
    "stock_rope_parameters",
    "window_is_scaled",
    "reads_top_level_original_window",
]

#: transformers ``rope_type`` -> (our method, the parameters both spell the same way).
ROPE_TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "default": ("none", ()),
    "linear": ("linear", ()),
    "dynamic": ("dynamic-ntk", ()),
    "yarn": ("yarn", ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")),
    "llama3": ("llama3", ("low_freq_factor", "high_freq_factor")),
    "longrope": ("longrope", ("long_factor", "short_factor", "attention_factor")),
    # Gemma 4 / LFM3 global layers: partial rotary with zero frequencies; its ``factor`` divides them (linear).
    "proportional": ("linear", ()),
}

#: rope types that fix a layout of their own (``proportional``: zeros past the rotating pairs); the only rules
#: transformers applies on top of them are the ones listed (as the type itself, with ``factor``).
_LAYOUT_TYPES: dict[str, tuple[str, ...]] = {"proportional": ("none", "linear")}


#: rope types whose config keeps ``max_position_embeddings`` at the pre-training window L: the unscaled
#: default, and ``dynamic``, which scales from L at run time. Every other type's config holds L * s there.
#: transformers rope types whose ``max_position_embeddings`` is the pre-training window L (the served
#: length is L * factor): ``dynamic`` scales from it, ``linear`` never reads it, and vLLM and SGLang
#: multiply it by the factor for both (as for lmsys/vicuna-13b-v1.5-16k: 4096 with linear x4).
_WINDOW_KEEPING_TYPES = ("default", "dynamic", "linear", "proportional")

#: rope types for which transformers 4.x reads L from the config's top-level ``original_max_position_embeddings``
#: (Phi-3 style), not from the rope dict.
_TOP_LEVEL_ORIGINAL_WINDOW_TYPES = ("longrope",)


def window_is_scaled(rope_type: str) -> bool:
    """Whether a config with this ``rope_type`` holds the scaled window L * s in ``max_position_embeddings``."""
    return rope_type not in _WINDOW_KEEPING_TYPES


def reads_top_level_original_window(rope_type: str) -> bool:
    """Whether transformers 4.x reads this ``rope_type``'s L from the config's top-level ``original_max_position_embeddings``."""
    return rope_type in _TOP_LEVEL_ORIGINAL_WINDOW_TYPES


def method_for_rope_type(rope_type: str) -> tuple[str, tuple[str, ...]] | None:
    """(our method, shared parameter names) for a transformers ``rope_type``; None when we have no equivalent."""
    return ROPE_TYPES.get(rope_type)


def rope_type_for(method: str) -> str | None:
    """The transformers ``rope_type`` computing the same rule as our RoPE ``method`` (None: none does).

    ``none`` maps to no rope_type here: the unscaled model needs no rope dict entry beyond ``default``.
    """
    return next(
        (rope_type for rope_type, (name, _) in ROPE_TYPES.items()
         if name == method and rope_type != "default" and rope_type not in _LAYOUT_TYPES),
        None,
    )


def stock_rope_parameters(
    method: str, factor: float, original_length: int, params: dict, theta: float, rotary_dim: int, identity: bool = False,
    base_rope_type: str = "default",
) -> dict | None:
    """transformers' rope dict computing what our RoPE ``method`` computes (None when it has no such rule).

    Args:
        method: our RoPE method name.
        factor: scale s.
        original_length: the pre-training window L.
        params: the method's parameters (None values are left out).
        theta: the model's rotary base b.
        rotary_dim: the rotary dimension d (NTK's base b * s^(d/(d-2)) depends on it).
        identity: the scaling changes nothing (factor 1 of a static method): the default rope dict.
        base_rope_type: the model's own rope type. A layout type (``proportional``) stays that type: linear
            scaling is its ``factor``, and no other rule exists for it (None).

    Returns:
        ``{"rope_type": ..., "rope_theta": ..., ...}`` without model-specific keys (the caller keeps
        e.g. ``partial_rotary_factor``).
    """
    params = {k: v for k, v in params.items() if v is not None}
    if base_rope_type in _LAYOUT_TYPES:
        if identity or method == "none":
            return {"rope_type": base_rope_type, "rope_theta": theta}
        if method in _LAYOUT_TYPES[base_rope_type]:
            return {"rope_type": base_rope_type, "rope_theta": theta, "factor": factor}
        return None
    if method == "none" or identity:
        return {"rope_type": "default", "rope_theta": theta}
    if method == "ntk":
        return {"rope_type": "default", "rope_theta": theta * factor ** (rotary_dim / (rotary_dim - 2))}
    if method == "theta":
        return {"rope_type": "default", "rope_theta": float(params["base"])}
    rope_type = rope_type_for(method)
    if rope_type is None:
        return None
    keys = ROPE_TYPES[rope_type][1]
    result = {"rope_type": rope_type, "rope_theta": theta, "factor": factor}
    if keys:
        result["original_max_position_embeddings"] = original_length
    for key in keys:
        if key in params:
            result[key] = list(params[key]) if isinstance(params[key], (list, tuple)) else params[key]
    if rope_type == "longrope":
        result.setdefault("short_factor", [1.0] * len(result["long_factor"]))
    return result
