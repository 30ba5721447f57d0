"""transformers' own scaling of a tiny model: the reference a patched model must equal where it exists.

For a method with a transformers ``rope_type`` (linear, dynamic, yarn, llama3, longrope) and a model whose
config holds ``rope_parameters``, the model is rebuilt by transformers from a copy of its config whose rope dict
carries that ``rope_type`` (every layer type's dict but the local ones: sliding-window layers never see distances
beyond their window), with the same weights. Nothing of hf_posext is used to build that reference.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from hf_posext.methods.transformers import rope_type_for

__all__ = ["LOCAL_LAYER_TYPES", "rotary_half_dim", "method_parameters", "stock_rope_parameters_for", "stock_scaled_logits"]

#: Layer types whose attention is local (a window shorter than the model's): their RoPE is left unscaled.
LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention", "local_attention")
#: Llama 3.1's published blend (transformers' test values).
LLAMA3_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
#: Keys of a rope dict that belong to its scaling rule, not to the model: a reference of another rule drops them
#: (a yarn dict's ``mscale_all_dim`` means nothing to linear).
SCALING_KEYS = frozenset({
    "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "truncate", "short_factor", "long_factor", "low_freq_factor", "high_freq_factor", "type",
})
#: The new base swept with ``theta``.
THETA_BASE = 1e5


def rotary_half_dim(model: nn.Module) -> int | None:
    """d/2 of the model's rotary frequencies: the length of its ``*inv_freq`` buffer (of the full-attention layers,
    which a per-layer-type model scales, whatever order transformers registers them in: 5.10's Gemma 4 registers
    the sliding layers' first), else half its config's ``rotary_dim`` or head dim (None without either)."""
    tables = [(name, buffer) for name, buffer in model.named_buffers() if name.endswith("inv_freq")]
    for name, buffer in sorted(tables, key=lambda item: "full_attention" not in item[0]):
        return int(buffer.shape[-1])
    config = model.config
    rotary_dim = getattr(config, "rotary_dim", None) or getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads if getattr(config, "num_attention_heads", None) else None)
    return int(rotary_dim) // 2 if rotary_dim else None


def method_parameters(method: str, model: nn.Module, factor: float) -> dict[str, Any]:
    """The parameters a method needs besides its factor (``theta``'s base, ``longrope``'s per-dimension factors)."""
    base = method.split("+")[0]
    if base == "theta":
        return {"base": THETA_BASE}
    if base == "longrope":
        half = rotary_half_dim(model)
        return {"long_factor": [factor] * half} if half else {}
    if base == "llama3":
        return dict(LLAMA3_FACTORS)
    return {}


def stock_rope_parameters_for(method: str, factor: float, window: int, params: dict[str, Any], half: int | None) -> dict | None:
    """One rope dict scaled by transformers' ``rope_type`` for ``method``, from the model's own dict ``params``.

    Returns:
        The scaled dict, or None where transformers has no rope type for ``method``.
    """
    rope_type = rope_type_for(method)
    if rope_type is None:
        return None
    # The model's own keys only, unless it already uses this rule: then its parameters stay, as patch keeps them.
    own = params if params.get("rope_type") == rope_type else {k: v for k, v in params.items() if k not in SCALING_KEYS}
    scaled = {**own, "rope_type": rope_type, "factor": factor}
    if rope_type != "dynamic":
        scaled["original_max_position_embeddings"] = params.get("original_max_position_embeddings") or window
    if rope_type == "llama3":
        scaled.update(LLAMA3_FACTORS)
    if rope_type == "longrope":
        if not half:
            return None
        scaled.update(long_factor=[factor] * half, short_factor=[1.0] * half)
    return scaled


def _scaled_config(config: Any, method: str, factor: float, half: int | None) -> Any | None:
    """A copy of ``config`` whose text config (the config itself, or a drafting head's ``text_config``) carries
    ``method``'s rope dict; None where transformers has no rope type for it."""
    text = config.get_text_config()
    parameters = getattr(text, "rope_parameters", None)
    if not isinstance(parameters, dict) or not parameters:
        return None
    window = getattr(text, "original_max_position_embeddings", None) or text.max_position_embeddings
    nested = all(isinstance(value, dict) for value in parameters.values())
    if nested:
        scaled = {layer: value if layer in LOCAL_LAYER_TYPES else stock_rope_parameters_for(method, factor, window, value, half)
                  for layer, value in parameters.items()}
        if any(value is None for value in scaled.values()):
            return None
    else:
        scaled = stock_rope_parameters_for(method, factor, window, parameters, half)
        if scaled is None:
            return None
    stock = copy.deepcopy(config)
    stock_text = stock.get_text_config()
    stock_text.rope_parameters = scaled
    if rope_type_for(method) == "dynamic":  # transformers' dynamic reads the pre-training window from here
        dicts = parameters.values() if nested else [parameters]
        original = next((d["original_max_position_embeddings"] for d in dicts if d.get("original_max_position_embeddings")), None)
        stock_text.max_position_embeddings = int(original or window)
    return stock


def _logits(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits.float()


def stock_scaled_logits(model: nn.Module, method: str, factor: float, config: Any, inputs: dict[str, Any],
                        state: dict[str, torch.Tensor], unscaled: torch.Tensor | None) -> torch.Tensor | None:
    """The logits of ``inputs`` from the model transformers builds with ``method`` in its ``rope_parameters``.

    Args:
        model: the (patched) model, for its class and rotary dimension.
        method: our method name.
        factor: the scale s.
        config: the model's unpatched config.
        inputs: the forward's keyword inputs (``input_ids``, or a drafting head's synthetic inputs).
        state: the model's unpatched state dict.
        unscaled: the unpatched model's logits of ``inputs`` (None when it cannot run them).

    Returns:
        The logits, or None where transformers does not scale this family with this method: no rope type for it,
        no ``rope_parameters``, a config or model it refuses to build, or a scaling it ignores (the logits come out
        equal to the unscaled model's).
    """
    try:
        stock_config = _scaled_config(config, method, factor, rotary_half_dim(model))
        if stock_config is None:
            return None
        stock = type(model)._from_config(stock_config, attn_implementation="eager", dtype=torch.float32).eval()
        stock.load_state_dict(state, strict=False)
        scaled = _logits(stock, inputs)
    except Exception:  # transformers refuses this rope type for this family: it does not scale it itself
        return None
    return None if unscaled is None or torch.equal(scaled, unscaled) else scaled
