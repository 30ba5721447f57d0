"""Sliding-window layers at a cost that grows with length x window, not length squared (CPU scoring).

transformers computes a sliding-window layer (Gemma 2/3, Mistral, Qwen2 with ``use_sliding_window``) with SDPA
under a [T x T] boolean mask: every query is multiplied against every key, and the mask alone keeps the
``sliding_window`` nearest ones. At 65536 tokens that mask is 4 GiB and the work is T² per head, where a
query needs only W = ``sliding_window`` keys. Here the queries are cut into blocks of ``block`` positions and
each block attends to the W - 1 keys before it and to its own, with the sliding mask of that small band:
cost T x (W + block), memory one band. The result equals the masked computation (test: a tiny Gemma 3,
float32, 1e-6).

How it hooks in: :func:`banded_sliding_attention` is a context manager that, for the duration of a forward,
switches the model's attention implementation to one registered in transformers' ``AttentionInterface``
under :data:`IMPLEMENTATION`. For a sliding layer of a padding-free prefill its mask builder returns a
:class:`BandMask` (a marker, where transformers would build the [T x T] band), and its attention function
computes that layer banded; every other call (full-attention layers, padding, a KV cache) is transformers' own SDPA with its
own mask. It changes nothing when the model is not set to ``sdpa`` or ``eager`` (an attention-level method of
hf_posext, flash attention), has no sliding layer, soft-caps its attention logits, or is not on a CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["IMPLEMENTATION", "BandMask", "banded_attention", "applies_to", "banded_sliding_attention", "register"]

#: The name under which the banded attention and its mask builder are registered in transformers.
IMPLEMENTATION = "hf_posext_banded_sdpa"

_REGISTERED: list[bool] = []


def banded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, scaling: float,
                     block: int | None = None) -> torch.Tensor:
    """Causal sliding-window attention computed block by block: query p sees keys k with 0 <= p - k < ``window``.

    Args:
        query: [batch, heads, tokens, head dim], already rotated.
        key, value: [batch, key-value heads, tokens, head dim] (grouped-query heads are shared).
        window: the sliding window (transformers' ``sliding_window``: a query sees itself and window - 1 before).
        scaling: the softmax scale.
        block: queries per block (default ``window``): work per block is block x (window + block - 1).

    Returns:
        [batch, tokens, heads, head dim], the layout transformers' attention functions return.

    Raises:
        ValueError: a window or block below 1, or keys and queries of different lengths.
    """
    block = window if block is None else block
    if window < 1 or block < 1:
        raise ValueError(f"window={window} and block={block} must be positive numbers of tokens.")
    tokens = query.shape[2]
    if key.shape[2] != tokens:
        raise ValueError(f"banded attention needs as many keys as queries (a prefill), got {key.shape[2]} and {tokens}.")
    grouped = query.shape[1] != key.shape[1]
    output = torch.empty_like(query)
    for start in range(0, tokens, block):
        end = min(tokens, start + block)
        first_key = max(0, start - window + 1)
        distance = torch.arange(start, end, device=query.device)[:, None] - torch.arange(first_key, end, device=query.device)
        band = (distance >= 0) & (distance < window)
        output[:, :, start:end] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, first_key:end], value[:, :, first_key:end], attn_mask=band,
            scale=scaling, enable_gqa=grouped)
    return output.transpose(1, 2).contiguous()


class BandMask:
    """Stands for the [T x T] sliding-window mask the mask builder did not build (a padding-free prefill).

    Only this module's attention function reads it; any other code that treats it as a tensor fails loudly
    instead of attending wrongly.

    Attributes:
        window: the sliding window. length: tokens (queries = keys).
    """

    def __init__(self, window: int, length: int) -> None:
        self.window, self.length = int(window), int(length)

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The boolean [1, 1, T, T] mask it stands for (True where a query may attend)."""
        distance = torch.arange(self.length, device=device)[:, None] - torch.arange(self.length, device=device)
        return ((distance >= 0) & (distance < self.window))[None, None]

    def __repr__(self) -> str:
        return f"BandMask(window={self.window}, length={self.length})"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    """The registered attention function: banded where the mask builder left a :class:`BandMask`, else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if isinstance(attention_mask, BandMask):
        if attention_mask.length != query.shape[2] or key.shape[2] != query.shape[2]:
            raise RuntimeError(f"{attention_mask!r} reached an attention call of {query.shape[2]} queries and "
                               f"{key.shape[2]} keys; call the model without hf_posext's banded attention.")
        if dropout == 0.0 and kwargs.get("s_aux") is None and not kwargs.get("softcap"):
            return banded_attention(query, key, value, attention_mask.window, scaling), None
        attention_mask = attention_mask.tensor(query.device)  # not computable banded: the mask it stands for
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _mask(*args: Any, local_size: int | None = None, **kwargs: Any):
    """transformers' SDPA mask builder, except that a padding-free prefill's sliding-window mask is a :class:`BandMask`."""
    from transformers.masking_utils import sdpa_mask

    q_length, kv_length, config = kwargs.get("q_length"), kwargs.get("kv_length"), kwargs.get("config")
    sliding = local_size is not None and local_size == getattr(config, "sliding_window", None)  # not chunked attention
    prefill = (q_length == kv_length and not args and isinstance(kwargs.get("q_offset", 0), int)
               and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0)
    if sliding and prefill and kwargs.get("allow_is_causal_skip", True) and q_length > local_size:
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None or bool(attention_mask.all()):
            return BandMask(local_size, q_length)
    return sdpa_mask(*args, local_size=local_size, **kwargs)


def register() -> None:
    """Register the banded attention and its mask builder in transformers (idempotent)."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _mask)
    _REGISTERED.append(True)


def applies_to(model: nn.Module) -> str | None:
    """Why the banded path does not apply to ``model`` (one line), or None when it does.

    It applies to a model set to transformers' ``sdpa`` or ``eager`` attention (not to an attention-level method),
    with at least one ``sliding_attention`` layer, no attention-logit soft-capping, on a CPU.
    """
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} (only 'sdpa' or 'eager' are replaced)"
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()) or not getattr(config, "sliding_window", None):
        return "no sliding-window layer"
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logits soft-capped ({config.attn_logit_softcapping})"
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return "not on a CPU"
    return None


@contextlib.contextmanager
def banded_sliding_attention(model: nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Compute ``model``'s sliding-window layers banded for the duration of the block (see the module docstring).

    Args:
        model: a causal LM (possibly patched by a frequency method; an attention-level method leaves it alone).
        enabled: False leaves the model as it is (to measure the masked path).

    Yields:
        True when the banded path is active, False when it does not apply (:func:`applies_to`).
    """
    if not enabled or applies_to(model) is not None:
        yield False
        return
    register()
    before = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        yield True
    finally:
        model.set_attn_implementation(before)
