"""Self-Extend: training-free context extension by grouped attention (Jin et al. 2024).

Jin, Han, Yang, Jiang, Liu, Chang, Chen, Hu 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window
Without Tuning" (arXiv:2401.01325, ICML 2024).

For a query at position i and a key at position j (relative distance d = i - j):

* neighbour attention, d < W: the usual score, q rotated to i and k rotated to j (exact positions);
* grouped attention, d >= W: q rotated to ``i // G + (W - W // G)`` and k to ``j // G``, so the relative
  distance becomes ``i // G - j // G + W - W // G``: floor-divided positions, shifted so that they
  continue where the neighbour window ends.

The two score matrices are merged entry by entry (neighbour inside the window, grouped outside it)
*before* the softmax, as in the paper; one softmax then runs over the merged row. With the original
window L every relative distance stays below L for sequences up to ``(L - W + W // G) * G`` tokens
(the paper's rule ``(L - W) * G + W``, made exact for integer positions).

How it hooks into transformers: through the public attention-function registry, registered, probed,
installed and removed by :mod:`hf_posext.backends.attention.registration` under
``hf_posext_self_extend_sdpa`` / ``hf_posext_self_extend_eager``; this module picks the path per call and
installs the method, :mod:`hf_posext.backends.attention.self_extend_kernels` keeps the math. q and k
arrive rotated to their true positions; RoPE rotations compose, so rotating them again by
``R(p' - p)`` moves them to the grouped position p'.

Cost (say it plainly): inside the window nothing changes (the SDPA path even calls transformers' SDPA
function). Past the window, on the SDPA path (the default), each query block runs up to three fused
attention calls (neighbour band, grouped band, grouped bulk) and merges them by their log-sum-exp
(:func:`split_grouped_attention`): the extra work is the re-rotation of q and k, a second pass over a
band of about W + 512 keys, and the masks of the two bands. On the eager path, or with a logit cap,
training dropout or per-row positions (a left-padded batch), the scores are materialised block by block
instead (:func:`grouped_attention`), about what eager attention costs. On an accelerator a decode step
past the window (:func:`self_extend_decode`) runs about a dozen kernels per layer, the same at any
length, with no host synchronisation: the query and every cached key rotated to grouped positions from factors built once
per step, two matmuls, one ``where``, one softmax, one matmul. A chunked prefill with a KV cache keeps
each layer's keys rotated to grouped positions (one more copy of the key cache) and rotates only the
new ones; on CPU, where host reads cost nothing and bandwidth is what counts, decode steps do the same. ``bench/self_extend_cost.py`` measures it (docs/beyond_rescaling.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention import registration
from hf_posext.backends.attention.kernels import attention_with_lse, call_positions, rotate, rotate_with
from hf_posext.backends.attention.registration import AttentionLayer, call_settings, find_attention_layers, plain_attention
from hf_posext.backends.attention.self_extend_kernels import (
    SCORE_BLOCK_ELEMENTS, SelfExtendLayerSettings, clear_decode_tables, grouped_attention, self_extend_decode,
    split_grouped_attention, to_grouped,
)
from hf_posext.core.record import CONFIG_KEY, ScalingReport, make_record
from hf_posext.core.request import ScalingRequest
from hf_posext.methods.attention import check_neighbor_window, default_neighbor_window, max_extended_length, size_for_target

__all__ = [
    "METHOD_NAMES",
    "SelfExtendSettings",
    "SelfExtendLayerSettings",
    "max_extended_length",
    "size_for_target",
    "grouped_attention",
    "split_grouped_attention",
    "self_extend_decode",
    "clear_decode_tables",
    "self_extend_attention",
    "is_patched",
    "patch_self_extend",
    "unpatch_self_extend",
    "describe_self_extend",
    "load_self_extend",
    "current_settings",
    "current_request",
    "METHOD",
    "SCORE_BLOCK_ELEMENTS",
    # Shared with Dual Chunk Attention; kept importable from here (their home is kernels / registration).
    "rotate",
    "rotate_with",
    "attention_with_lse",
    "AttentionLayer",
    "find_attention_layers",
]

#: Method names :func:`hf_posext.patch` routes here.
METHOD_NAMES = {"self-extend"}

#: Registry names of our attention functions, keyed by the mask convention they expect.
IMPLEMENTATIONS = {"sdpa": "hf_posext_self_extend_sdpa", "eager": "hf_posext_self_extend_eager"}
_LAYER_ATTRIBUTE = "_hf_posext_self_extend"
_STATE_ATTRIBUTE = "_hf_posext_self_extend_state"


# --------------------------------------------------------------------------------------------------
# Sizing
# --------------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


@dataclass(frozen=True)
class SelfExtendSettings:
    """A Self-Extend request resolved against a model: G, W and the model's L (see :mod:`hf_posext.core.request`).

    Attributes:
        group_size: G, the floor divisor of positions beyond the neighbor window (1 = unchanged model).
        neighbor_window: W, the distances below which positions stay exact.
        original_max_position_embeddings: L, the pre-training window.
    """

    group_size: int
    neighbor_window: int
    original_max_position_embeddings: int

    @property
    def max_length(self) -> int:
        """Longest sequence whose grouped distances all stay inside the original window."""
        return max_extended_length(self.original_max_position_embeddings, self.group_size, self.neighbor_window)

    @property
    def factor(self) -> float:
        return self.max_length / self.original_max_position_embeddings


# --------------------------------------------------------------------------------------------------
# The attention function (the math is in :mod:`hf_posext.backends.attention.self_extend_kernels`)
# --------------------------------------------------------------------------------------------------

#: Calls with at most this many queries (decoding) take :func:`self_extend_decode`.
DECODE_QUERIES = 16
#: Device types whose decode steps take :func:`self_extend_decode`. Not the CPU: there a step is not
#: launch-bound, host reads are free, and rotating every cached key again costs about twice what
#: reusing the kept rotated keys costs (``bench/results/self_extend_decode_cpu.json``).
DECODE_DEVICES = ("cuda", "xpu", "mps")


def self_extend_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered in transformers' ``AttentionInterface`` (same signature as SDPA's).

    Reads the module's settings (attached by :func:`patch_self_extend`); layers without grouping
    (Gemma 3 sliding layers) and calls where every pair is inside the window run plain attention
    (transformers' own SDPA function on the SDPA path); decode steps past the window (at most
    ``DECODE_QUERIES`` queries) on an accelerator (``DECODE_DEVICES``) run :func:`self_extend_decode`; longer calls run
    :func:`split_grouped_attention` where it applies, else :func:`grouped_attention`. Learned attention sinks
    (``s_aux``, gpt-oss) are applied by :func:`grouped_attention`, which every call with them takes. Attention
    weights are not returned.
    """
    settings: SelfExtendLayerSettings
    settings, scaling = call_settings(module, query, scaling, kwargs, attribute=_LAYER_ATTRIBUTE, title="Self-Extend", method="self-extend")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # sinks: the written-out path only
    q_len, kv_len = query.shape[2], key.shape[2]
    if (sinks is None and query.device.type in DECODE_DEVICES and settings.group_size is not None and settings.group_size > 1
            and q_len <= DECODE_QUERIES and kv_len > settings.neighbor_window and not (dropout and module.training)):
        return self_extend_decode(query, key, value, attention_mask, kwargs.get("position_ids"), settings, scaling, softcap), None
    query_positions, key_positions = call_positions(query, key, kwargs.get("position_ids"), "Self-Extend")
    plain = settings.group_size is None or settings.group_size == 1 or int(
        (query_positions.max() - key_positions.min())
    ) < settings.neighbor_window
    if plain and settings.mask_kind == "sdpa" and softcap is None and sinks is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    key_grouped = None if plain else _grouped_keys(settings, key, key_positions, query.shape[2])
    if not plain and sinks is None and _can_split(settings, attention_mask, query_positions, key_positions, softcap, dropout, module, (query, key, value)):
        output = split_grouped_attention(
            query, key, value, key_grouped, attention_mask, query_positions, key_positions,
            settings.inv_freq, settings.rotary_dim, settings.interleaved, settings.group_size, settings.neighbor_window, scaling,
        )
        return output, None
    output = grouped_attention(
        query, key, value, attention_mask, query_positions, key_positions,
        settings.inv_freq, settings.rotary_dim, settings.interleaved,
        None if plain else settings.group_size, None if plain else settings.neighbor_window,
        scaling, softcap=softcap, dropout=dropout, training=module.training, key_grouped=key_grouped, sinks=sinks,
    )
    return output, None


def _can_split(settings, attention_mask, query_positions, key_positions, softcap, dropout, module, tensors=()) -> bool:
    """Whether :func:`split_grouped_attention` applies: SDPA convention (bool or no mask), no logit cap,
    no training dropout, no gradient (the fused CPU kernel does not differentiate its log-sum-exp, so
    training goes through the explicit scores), one set of positions for the whole batch, keys in
    position order."""
    if settings.mask_kind != "sdpa" or softcap is not None or (dropout and module.training):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1):
        return False
    for positions in (query_positions, key_positions):
        if positions.shape[0] > 1 and not bool((positions == positions[:1]).all()):
            return False
    keys = key_positions[0]
    return keys.numel() < 2 or bool((keys[1:] >= keys[:-1]).all())


def _grouped_keys(settings: SelfExtendLayerSettings, key: torch.Tensor, key_positions: torch.Tensor, q_len: int) -> torch.Tensor:
    """Keys at their grouped positions, reusing the rotation of keys this layer saw at the previous step.

    Reused only when this call continues the previous one: the cache grew by exactly the new queries,
    the key positions agree, and the cached raw keys are the ones rotated last time (same per-head sums
    over all cached keys, same first and last key vector). Anything else — a new prompt, a reordered
    beam-search cache, a cropped cache — rotates every key again.
    """
    batch, kv_len = key.shape[0], key.shape[2]
    key_positions = key_positions.to(key.device).expand(batch, kv_len)

    def rotated(part: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return to_grouped(part, positions, "key", settings.group_size, settings.neighbor_window, settings.inv_freq,
                           settings.rotary_dim, settings.interleaved)

    cached = settings.grouped_keys
    result = None
    if cached is not None and q_len < kv_len:
        grouped, sums, first, last, positions = cached
        done = grouped.shape[2]
        if (done == kv_len - q_len and grouped.shape[:2] == key.shape[:2] and grouped.dtype == key.dtype
                and grouped.device == key.device and torch.equal(key_positions[:, :done], positions)
                and torch.equal(key[:, :, 0], first) and torch.equal(key[:, :, done - 1], last)
                and torch.allclose(key[:, :, :done].sum(dim=2, dtype=torch.float32), sums, rtol=1e-5, atol=1e-5)):
            result = torch.cat((grouped, rotated(key[:, :, done:], key_positions[:, done:])), dim=2)
    if result is None:
        result = rotated(key, key_positions)
    if key.requires_grad and torch.is_grad_enabled():
        settings.grouped_keys = None  # never keep an autograd graph alive between calls
    else:
        settings.grouped_keys = (result, key.sum(dim=2, dtype=torch.float32), key[:, :, 0].clone(),
                                 key[:, :, -1].clone(), key_positions.clone())
    return result


def _resolve_settings(
    factor: float | None, target_length: int | None, original_length: int, group_size: int | None, neighbor_window: int | None
) -> SelfExtendSettings:
    from hf_posext.core.request import resolve_factor

    if group_size is not None:
        _check_int("group_size", group_size, 1)
    if neighbor_window is not None:
        check_neighbor_window(neighbor_window, original_length)
    if factor is None and target_length is None:
        if group_size is None:
            raise ValueError(
                "Self-Extend needs its size: give group_size= (and optionally neighbor_window=), or factor= / "
                "target_length= to choose them by the paper's rule, e.g. "
                f"patch(model, 'self-extend', target_length={4 * original_length})."
            )
        neighbor_window = default_neighbor_window(original_length) if neighbor_window is None else neighbor_window
        return SelfExtendSettings(group_size, neighbor_window, original_length)
    scale = resolve_factor(factor, target_length, original_length)
    target = target_length if target_length is not None else int(math.ceil(original_length * scale - 1e-9))
    if group_size is None:
        group_size, neighbor_window = size_for_target(original_length, target, neighbor_window)
    else:
        neighbor_window = default_neighbor_window(original_length) if neighbor_window is None else neighbor_window
        reach = max_extended_length(original_length, group_size, neighbor_window)
        if reach < target:
            needed, _ = size_for_target(original_length, target, neighbor_window)
            raise ValueError(
                f"group_size={group_size} with neighbor_window={neighbor_window} reaches only {reach} tokens, short of the "
                f"{target} requested (original neighbor_window {original_length}); use group_size >= {needed}, or leave "
                "group_size out to have it chosen."
            )
    return SelfExtendSettings(group_size, neighbor_window, original_length)


def _layer(layer: AttentionLayer, mask_kind: str, settings: SelfExtendSettings) -> SelfExtendLayerSettings:
    return SelfExtendLayerSettings(
        layer.inv_freq, layer.rotary_dim, layer.interleaved, settings.group_size if layer.scaled else None,
        settings.neighbor_window if layer.scaled else None, mask_kind, layer.scaled,
    )


def _write_config(config, settings: SelfExtendSettings, base: str, max_positions: int | None) -> None:
    """What ``config.hf_posext`` holds for a Self-Extend model (``save_pretrained`` writes it)."""
    setattr(config, CONFIG_KEY, make_record(
        "attention", "self-extend", settings.factor, settings.original_max_position_embeddings,
        {"group_size": settings.group_size, "neighbor_window": settings.neighbor_window}, attn_implementation=base,
    ))


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` runs Self-Extend attention installed by :func:`patch_self_extend`."""
    return registration.is_patched(model, METHOD)


def current_settings(model: nn.Module) -> SelfExtendSettings:
    """G, W and L of a model patched with Self-Extend."""
    return registration.current_settings(model, METHOD)


def current_request(model: nn.Module) -> ScalingRequest:
    """The request that re-creates the current Self-Extend patch."""
    settings = current_settings(model)
    return ScalingRequest.from_kwargs(
        "self-extend", None, original_max_position_embeddings=settings.original_max_position_embeddings,
        group_size=settings.group_size, neighbor_window=settings.neighbor_window,
    )


def patch_self_extend(model: nn.Module, request: ScalingRequest) -> nn.Module:
    """Install Self-Extend attention (use :func:`hf_posext.patch`, which routes here).

    Args:
        model: a RoPE causal LM whose attention uses transformers' attention registry (5.x models).
        request: method ``"self-extend"``; ``factor`` or ``target_length`` (G is then chosen so that the
            length fits; neighbor window default L/4), ``original_max_position_embeddings`` to override L,
            params ``group_size`` (G) and ``neighbor_window`` (W). With neither factor nor target_length,
            ``group_size`` is required.

    Returns:
        The same model. Patching again replaces the previous settings (never compounds).

    Raises:
        ValueError: bad G / W / factor, a G too small for the requested length, a model whose attention
            bypasses the registry or whose rotary embedding is dynamic. The model is unchanged in every case.

    Example:
        >>> hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=2048)
        >>> hf_posext.patch(model, "self-extend", target_length=32768)  # G, W by the paper's rule
    """
    original = registration.original_length(model, METHOD, request)
    params = request.params_dict
    settings = _resolve_settings(request.factor, request.target_length, original, params.get("group_size"), params.get("neighbor_window"))
    if is_patched(model):
        return registration.update(model, METHOD, settings, lambda layer: dataclasses.replace(
            layer, group_size=settings.group_size, neighbor_window=settings.neighbor_window, grouped_keys=None), _write_config)
    return registration.install(model, METHOD, settings, lambda layer, mask_kind: _layer(layer, mask_kind, settings), _write_config)


def unpatch_self_extend(model: nn.Module) -> nn.Module:
    """Remove Self-Extend: the original attention implementation and config fields, exactly.

    Raises:
        ValueError: the model is not patched with Self-Extend.
    """
    return registration.uninstall(model, METHOD)


def describe_self_extend(model: nn.Module) -> ScalingReport:
    """A :class:`~hf_posext.core.record.ScalingReport` of kind ``"attention"`` for a Self-Extend model."""
    settings = current_settings(model)
    notes = [
        f"relative distances < {settings.neighbor_window} exact; beyond, positions // {settings.group_size} shifted by "
        f"{settings.neighbor_window - settings.neighbor_window // settings.group_size}",
        "cost: past the window, scores are computed explicitly in blocks (no fused SDPA kernel) plus a band of "
        "neighbour scores and a re-rotation of q and k (see bench/self_extend_cost.py)",
    ]
    return registration.report(
        model, METHOD, settings.factor, settings.max_length,
        {"group_size": settings.group_size, "neighbor_window": settings.neighbor_window}, notes,
    )


def load_self_extend(path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved with Self-Extend (``config.hf_posext`` of kind ``"attention"``) and re-apply it."""
    params = dict(record.get("params", {}))
    if record.get("method") != "self-extend" or "group_size" not in params:
        raise ValueError(f"{path}: unrecognised attention-level record {record!r}; expected method 'self-extend' with group_size.")
    model, _ = registration.load_unpatched(path, record, METHOD, lambda config: None, **from_pretrained_kwargs)
    return patch_self_extend(model, ScalingRequest.from_kwargs(
        "self-extend", None,
        original_max_position_embeddings=int(record["original_max_position_embeddings"]),
        group_size=int(params["group_size"]),
        neighbor_window=int(params.get("neighbor_window", params.get("window"))),  # "window": saved before the rename
    ))


#: How Self-Extend plugs into transformers (see :mod:`hf_posext.backends.attention.registration`).
METHOD = registration.AttentionMethod(
    name="self-extend",
    label="Self-Extend",
    attention=self_extend_attention,
    implementations=IMPLEMENTATIONS,
    layer_attribute=_LAYER_ATTRIBUTE,
    state_attribute=_STATE_ATTRIBUTE,
    scaled_word="grouped",
)
