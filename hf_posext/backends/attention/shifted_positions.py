"""STRING: shifted rotary positions, the largest distances never used (An et al. 2025, ICLR).

An, Zhang, Zhong, Li, Gong, Luo, Xu, Kong 2025, "Why Does the Effective Context Length of LLMs Fall
Short?" (arXiv:2410.18745). The position rule (pure numbers) is in
:mod:`hf_posext.methods.shifted_positions`: for a query at i and a key at j, ``d = i - j`` stays ``d``
when ``d < S`` and becomes ``d - S + w`` otherwise (S = ``shifted_offset``, w = ``local_value``).

How it hooks into transformers: like Self-Extend and DCA, through the public attention-function registry
(``AttentionInterface``, set up by :mod:`hf_posext.backends.attention.registration`), under
``hf_posext_string_sdpa`` / ``hf_posext_string_eager``. q and k arrive rotated to their true positions;
the shifted pass rotates the query by ``w - S`` more positions (RoPE rotations compose) and leaves every
key as it is, so the key cache is read as it is and no key is ever rotated again.

Cost. While every distance is below S nothing changes (the SDPA path calls transformers' SDPA function).
Past it, on the SDPA path, each block of queries runs attention calls merged exactly by their
log-sum-exp (:func:`string_split`): up to six fused calls per block of queries, none with a mask (the
causal diagonal, two unmasked ranges and the keys seen partly exact, partly shifted as two causal squares),
and one rotation of the queries; with a padding mask, two ``[block, block]`` bands carry it instead. A
decode step (a few queries, :func:`string_explicit`) scores the query twice against the key cache (exact
and shifted), picks per key with one ``where``, then one softmax and one matmul with the values: no host
synchronisation, the shift rotation's factors built once per layer. The eager path, a logit cap, training and per-row
positions use the same explicit scores block by block. ``bench/string_cost.py`` measures prefill and a
decode step against SDPA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention import registration
from hf_posext.backends.attention.kernels import attention_with_lse, call_positions, finish_block, fused_attention_with_lse, fused_start, head_groups, rotate_by_factors, rotation_factors
from hf_posext.backends.attention.registration import AttentionLayer, call_settings, plain_attention
from hf_posext.core.record import CONFIG_KEY, ScalingReport, make_record
from hf_posext.core.request import ScalingRequest
from hf_posext.methods.shifted_positions import (
    check_string_sizes,
    default_local_value,
    default_shifted_offset,
    max_covered_length,
)

__all__ = [
    "StringLayerSettings",
    "METHOD_NAMES",
    "IMPLEMENTATIONS",
    "StringSettings",
    "resolve_settings",
    "string_explicit",
    "string_split",
    "string_attention",
    "is_patched",
    "current_settings",
    "current_request",
    "string_window",
    "patch_string",
    "unpatch_string",
    "describe_string",
    "load_string",
    "METHOD",
]

#: Method names :func:`hf_posext.patch` routes here.
METHOD_NAMES = {"string"}
#: Registry names of our attention functions, keyed by the mask convention they expect.
IMPLEMENTATIONS = {"sdpa": "hf_posext_string_sdpa", "eager": "hf_posext_string_eager"}
_LAYER_ATTRIBUTE = "_hf_posext_string"
_STATE_ATTRIBUTE = "_hf_posext_string_state"
_LABEL = "STRING"
#: Score elements materialised at once on the explicit path (~256 MB in float32).
SCORE_BLOCK_ELEMENTS = 1 << 26
#: Queries per block on the fused path (at most S). Without masks the block size hardly changes the work (2 CPU
#: cores, 16384 tokens: 6.2 s at 512, 6.5 s at 2048, 6.0 s at 2703, ``bench/string_cost.py --split-blocks``), but
#: each block costs a few dozen small operations, which dominate on a GPU: few large blocks.
SPLIT_QUERY_BLOCK = 4096
#: Queries per block where a call writes out a ``[block, keys]`` mask or scores (a padding mask, or no fused kernel
#: for the device and dtype): this many, or more while they stay under SCORE_BLOCK_ELEMENTS.
MASKED_QUERY_BLOCK = 512
#: Calls with at most this many queries (decoding) skip the fused path (no host synchronisation).
DECODE_QUERIES = 16


@dataclass(frozen=True)
class StringSettings:
    """A validated STRING request.

    Attributes:
        shifted_offset: S; distances below it stay exact, the S largest are dropped.
        local_value: w; shifted keys are seen at distance ``d - S + w``.
        attention_factor: q and k multiplied by it (scores by its square); 1 = off.
        original_max_position_embeddings: L, the pre-training window.
        target_length: the window the model is declared to handle (STRING itself has no length limit;
            distances stay below L up to ``L + S - w`` tokens).
    """

    shifted_offset: int
    local_value: int
    attention_factor: float
    original_max_position_embeddings: int
    target_length: int

    @property
    def factor(self) -> float:
        return self.target_length / self.original_max_position_embeddings


@dataclass
class StringLayerSettings:
    """What one attention module needs: its rotary layout and the shift (None: plain attention)."""

    inv_freq: torch.Tensor  # float64, rotary dim / 2 values
    rotary_dim: int
    interleaved: bool
    shifted_offset: int | None
    local_value: int | None
    attention_factor: float
    mask_kind: str  # "sdpa" (bool or None) or "eager" (additive float)
    scaled: bool = True
    _factors: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def shift_factors(self, device, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors rotating a query by ``w - S`` positions (:func:`rotate_by_factors`), float32 ``[head_dim]``,
        built once per layer, device and sizes (angles in float64)."""
        key = (str(device), head_dim, self.shifted_offset, self.local_value)
        if key not in self._factors:
            angles = (self.local_value - self.shifted_offset) * self.inv_freq.double()
            cos, sin = angles.cos().float(), angles.sin().float()
            c, s = rotation_factors(cos, sin, self.rotary_dim, head_dim, self.interleaved)
            self._factors[key] = (c.to(device), s.to(device))
        return self._factors[key]


def _shifted_query(query: torch.Tensor, layer: StringLayerSettings) -> torch.Tensor:
    c, s = layer.shift_factors(query.device, query.shape[-1])
    return rotate_by_factors(query, c, s, layer.rotary_dim, layer.interleaved)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


def string_explicit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    layer: StringLayerSettings,
    scaling: float,
    softcap: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    block_elements: int = SCORE_BLOCK_ELEMENTS,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """STRING with the scores written out, block of queries by block (also a decode step).

    Each query is scored twice against every key in one matmul, at its true position and shifted by
    ``w - S``; a ``where`` keeps, per key, the exact score when ``d < S`` and the shifted one otherwise.
    With ``layer.shifted_offset`` None it is plain attention.

    Args:
        query: ``[batch, heads, q_len, head_dim]`` rotated to ``query_positions`` (``[batch | 1, q_len]``).
        key, value: ``[batch, kv_heads, kv_len, head_dim]``; keys rotated to ``key_positions``.
        attention_mask: None (causal, the queries being the last keys), bool (True = attend) or additive
            float, broadcastable to ``[batch, heads, q_len, kv_len]``.
        layer: rotary layout and the shift. scaling: score multiplier. softcap: Gemma 2 logit cap.
        dropout, training: attention dropout, applied when training.
        block_elements: score elements materialised at once.
        sinks: learned attention sinks, one logit per query head (gpt-oss), or None.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = head_groups(query, key)
    shifted = layer.shifted_offset is not None
    if shifted:
        query_positions = query_positions.to(key.device).expand(batch, q_len)
        key_positions = key_positions.to(key.device).expand(batch, kv_len)
        query, kinds = torch.stack((query, _shifted_query(query, layer))), 2
    else:
        query, kinds = query.unsqueeze(0), 1
    block = max(1, min(q_len, block_elements // max(1, batch * heads * kinds * kv_len)))
    offset = kv_len - q_len
    outputs = []
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        rows = end - start
        # [kinds, B, H, rows, D] -> [B, kv_heads, groups * kinds * rows, D]: the query heads sharing a kv
        # head become rows of one matmul against it (no copy of the keys per head).
        part = query[:, :, :, start:end].permute(1, 2, 0, 3, 4).reshape(batch, kv_heads, groups * kinds * rows, head_dim)
        scores = torch.matmul(part, key.transpose(2, 3)).view(batch, kv_heads, groups, kinds, rows, kv_len)
        if shifted:
            far = (query_positions[:, start:end, None] - key_positions[:, None, :]) >= layer.shifted_offset
            scores = torch.where(far[:, None, None], scores[:, :, :, 1], scores[:, :, :, 0])
        else:
            scores = scores[:, :, :, 0]
        outputs.append(finish_block(scores, value, attention_mask, start, offset, scaling, softcap, dropout, training, sinks))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _triangle_parts(call, block_query: torch.Tensor, block_shifted: torch.Tensor, rows: slice, edge: int, near: int) -> list:
    """The keys ``[edge, near)`` that a block of queries sees partly exact, partly shifted, as causal calls without a
    mask (:func:`string_split`; no attention mask).

    With n queries and m = ``near - edge`` keys (m <= n - 1), query r sees key c exactly when c >= r - (n - 1 - m),
    shifted otherwise. So the shifted keys of the last m queries form a causal square (query r sees keys up to
    r - (n - m)); the exact keys of the m queries before the last form the same square with queries and keys in
    reverse order; the queries before those see every key exactly (an unmasked call); the last query sees none of
    them exactly. Each part comes back padded to the block's n rows (output 0, log-sum-exp -inf where it has none).
    """
    n, m = rows.stop - rows.start, near - edge
    padded = []

    def pad(output: torch.Tensor, lse: torch.Tensor, first: int) -> None:
        after = n - first - output.shape[2]
        padded.append((torch.nn.functional.pad(output, (0, 0, first, after)),
                       torch.nn.functional.pad(lse, (first, after), value=float("-inf"))))

    pad(*call(block_shifted[:, :, n - m:], slice(rows.stop - m, rows.stop), edge, near, causal=True), n - m)
    output, lse = call(block_query[:, :, n - 1 - m:n - 1].flip(2), slice(rows.stop - 1 - m, rows.stop - 1), edge, near,
                       causal=True, flip=True)
    pad(output.flip(2), lse.flip(2), n - 1 - m)
    if n - 1 - m > 0:
        pad(*call(block_query[:, :, :n - 1 - m], slice(rows.start, rows.start + n - 1 - m), edge, near), 0)
    return padded


def string_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    first_query_position: int,
    layer: StringLayerSettings,
    scaling: float,
    block: int = SPLIT_QUERY_BLOCK,
) -> torch.Tensor:
    """STRING as fused attention calls merged by their log-sum-exp (inference; same result as
    :func:`string_explicit`).

    Needs one set of positions for the whole batch, consecutive: queries at ``first_query_position + r``
    and keys at ``first_query_position - (kv_len - q_len) + j`` (the queries are the last keys). For a
    block of queries at positions ``[a, b)`` (``b - a <= S``) the keys split into five sets, each one
    attention call returning its output ``o_s`` and log-sum-exp ``l_s``; the softmax over the whole row
    is ``sum_s o_s * exp(l_s - logsumexp_s l_s)``, exactly:

    * ``[a, b)``, the block's diagonal: true q, causal (no explicit mask);
    * ``[b - S, a)``: true q, within S of every query (no mask);
    * ``[a - S + 1, b - S)``: true q where ``j > i - S``, shifted q where ``j <= i - S``: two causal squares,
      one with queries and keys reversed (:func:`_triangle_parts`), or with a padding mask two calls with a
      ``[block, block]`` mask each;
    * ``[0, a - S + 1)``: shifted q, at least S from every query (no mask).

    All the work runs in fused kernels without a mask (with a padding mask, two small bands per block carry
    it). The reference code does the same with two flash-attention calls (a sliding window and a shifted
    causal pass). With a bool ``attention_mask`` (padding) each set takes its slice.

    Args: as :func:`string_explicit`; ``attention_mask`` None or bool ``[batch, 1, q_len, kv_len]``.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    shift = layer.shifted_offset
    if not fused_attention_with_lse(query, attention_mask):  # calls that write out [rows, keys]: bounded memory
        block = min(block, max(MASKED_QUERY_BLOCK, SCORE_BLOCK_ELEMENTS // max(1, batch * heads * kv_len)))
    block = max(1, min(block, shift))
    first_key_position = first_query_position - (kv_len - q_len)
    query_shifted = _shifted_query(query, layer)

    def index(position: int) -> int:
        return min(max(position - first_key_position, 0), kv_len)

    call = functools.partial(_string_call, key, value, attention_mask, scaling)
    outputs = []
    position, last = first_query_position, first_query_position + q_len
    while position < last:
        a, b = position, min(last, position + block)
        rows = slice(a - first_query_position, b - first_query_position)
        block_query, block_shifted = query[:, :, rows], query_shifted[:, :, rows]
        edge, near, diagonal, end = index(a - shift + 1), index(b - shift), index(a), index(b)
        parts = [call(block_query, rows, diagonal, end, causal=True)]
        if near < diagonal:
            parts.append(call(block_query, rows, near, diagonal))
        if edge < near and attention_mask is None:
            parts += _triangle_parts(call, block_query, block_shifted, rows, edge, near)
        elif edge < near:
            query_at = torch.arange(a, b, device=key.device)[:, None]
            key_at = torch.arange(edge, near, device=key.device)[None, :] + first_key_position
            exact = key_at > query_at - shift
            parts.append(call(block_query, rows, edge, near, band=exact))
            parts.append(call(block_shifted, rows, edge, near, band=~exact))
        if edge > 0:
            parts.append(call(block_shifted, rows, 0, edge))
        outputs.append(_merged(parts, value.dtype))
        position = b
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _string_call(key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                 q: torch.Tensor, rows: slice, low: int, high: int, causal: bool = False,
                 band: torch.Tensor | None = None, flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused call of :func:`string_split`: queries ``q`` (the call's rows ``rows``) against keys ``[low, high)``.

    ``causal``: the keys are the queries' own positions; ``band``: a ``[rows, keys]`` bool mask (True = attend);
    ``flip``: keys in reverse order (with ``causal``, each query sees the keys from its own on).

    Returns:
        The output ``[batch, heads, rows, head_dim]`` and its log-sum-exp ``[batch, heads, rows]``.
    """
    batch, heads, _, head_dim = q.shape
    kv_heads, rows_n = key.shape[1], rows.stop - rows.start
    groups = heads // kv_heads
    k, v = key[:, :, low:high], value[:, :, low:high]
    if flip:  # query and key order reversed: a causal call then sees, per query, the keys from its own on
        k, v = k.flip(2), v.flip(2)
    mask = None if attention_mask is None else attention_mask[:, :, rows, low:high]
    if band is not None:
        mask = band[None, None] if mask is None else mask & band
    if causal and mask is None and groups > 1:
        # Causal over the diagonal needs one row per key: repeat its few keys per query head instead.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return attention_with_lse(q, k, v, None, scaling, is_causal=True)
    if mask is not None and groups > 1:
        mask = mask.expand(batch, 1, rows_n, high - low).repeat(1, 1, groups, 1)
    q = q.reshape(batch, kv_heads, groups * rows_n, head_dim)
    output, lse = attention_with_lse(q, k, v, mask, scaling, is_causal=causal and mask is None)
    return output.reshape(batch, heads, rows_n, head_dim), lse.reshape(batch, heads, rows_n)


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The softmax over the whole row from its pieces: ``sum_s o_s * exp(l_s - logsumexp_s l_s)``."""
    if len(parts) == 1:
        return parts[0][0].to(dtype)
    lse = torch.stack([p[1] for p in parts]).logsumexp(dim=0)
    merged = sum(o.float() * torch.nan_to_num(torch.exp(l - lse), nan=0.0)[..., None] for o, l in parts)
    return merged.to(dtype)


def string_attention(
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

    Calls where every distance is below S (at most S keys, or a prefill whose last position is below S)
    run plain attention (transformers' own SDPA function on the SDPA path); prefills past S run
    :func:`string_split` where it applies; decode steps and everything else (eager, logit cap, training,
    per-row positions, learned attention sinks) run :func:`string_explicit`. Attention weights are not returned.
    """
    layer: StringLayerSettings
    layer, scaling = call_settings(module, query, scaling, kwargs, attribute=_LAYER_ATTRIBUTE, title="STRING attention", method="string")
    if layer.attention_factor != 1.0:
        scaling = scaling * layer.attention_factor ** 2
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # sinks: the written-out path only
    q_len, kv_len = query.shape[2], key.shape[2]
    plain = layer.shifted_offset is None or kv_len <= layer.shifted_offset  # keys consecutive: every d < S
    positions = None
    if not plain and q_len > DECODE_QUERIES:
        # A prefill: one host sync is cheap next to the work, and prompts shorter than S stay the model's.
        positions = call_positions(query, key, kwargs.get("position_ids"), _LABEL)
        plain = int(positions[0].max()) < layer.shifted_offset
    if plain and layer.mask_kind == "sdpa" and softcap is None and sinks is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    query_positions, key_positions = positions or call_positions(query, key, kwargs.get("position_ids"), _LABEL)
    if not plain and q_len > DECODE_QUERIES and sinks is None:
        start = fused_start(layer.mask_kind, attention_mask, query_positions, softcap, dropout, module.training, (query, key, value))
        if start is not None:
            return string_split(query, key, value, attention_mask, start, layer, scaling), None
    active = dataclasses.replace(layer, shifted_offset=None) if plain else layer
    output = string_explicit(
        query, key, value, attention_mask, query_positions, key_positions, active, scaling,
        softcap=softcap, dropout=dropout, training=module.training, sinks=sinks,
    )
    return output, None


# --------------------------------------------------------------------------------------------------
# patch / unpatch / describe / load
# --------------------------------------------------------------------------------------------------


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` runs STRING installed by :func:`patch_string`."""
    return registration.is_patched(model, METHOD)


def current_settings(model: nn.Module) -> StringSettings:
    """S, w, the attention factor, L and the target length of a model patched with STRING."""
    return registration.current_settings(model, METHOD)


def resolve_settings(
    factor: float | None, target_length: int | None, original_length: int, shifted_offset: int | None,
    local_value: int | None, attention_factor: float = 1.0,
) -> StringSettings:
    """Fill in the paper's defaults and validate (raises ValueError naming the bad value and the fix)."""
    from hf_posext.core.request import resolve_factor

    shifted_offset = default_shifted_offset(original_length) if shifted_offset is None else shifted_offset
    local_value = default_local_value(shifted_offset) if local_value is None else local_value
    check_string_sizes(shifted_offset, local_value, original_length)
    scale = resolve_factor(factor, target_length, original_length)
    target = target_length if target_length is not None else int(math.ceil(original_length * scale - 1e-9))
    return StringSettings(shifted_offset, local_value, float(attention_factor), original_length, target)


def _write_config(config, settings: StringSettings, base: str, max_positions: int | None) -> None:
    """The record, and ``max_position_embeddings`` raised to the target window (kept in the record so
    that load can put it back)."""
    setattr(config, CONFIG_KEY, make_record(
        "attention", "string", settings.factor, settings.original_max_position_embeddings,
        {"shifted_offset": settings.shifted_offset, "local_value": settings.local_value,
         "attention_factor": settings.attention_factor},
        attn_implementation=base, max_position_embeddings_before=max_positions,
    ))
    if max_positions is not None:
        config.max_position_embeddings = max(settings.target_length, max_positions)


def _layer(layer: AttentionLayer, mask_kind: str, settings: StringSettings) -> StringLayerSettings:
    return StringLayerSettings(
        layer.inv_freq, layer.rotary_dim, layer.interleaved,
        settings.shifted_offset if layer.scaled else None, settings.local_value if layer.scaled else None,
        settings.attention_factor if layer.scaled else 1.0, mask_kind, layer.scaled,
    )


def current_request(model: nn.Module) -> ScalingRequest:
    """The request that re-creates the current STRING patch."""
    settings = current_settings(model)
    return ScalingRequest.from_kwargs(
        "string", settings.factor, original_max_position_embeddings=settings.original_max_position_embeddings,
        shifted_offset=settings.shifted_offset, local_value=settings.local_value, attention_factor=settings.attention_factor,
    )


def string_window(model: nn.Module, request: ScalingRequest) -> int:
    """L, the window STRING's defaults and limits refer to: ``original_max_position_embeddings`` when the
    request gives it, the previous patch's when STRING is installed, else the window the model's config
    declares (``max_position_embeddings``), as the reference code takes it. For a model whose config
    carries a static frequency scaling (YaRN, llama3, linear) that is the scaled window it was trained or
    set up for, not the pre-scaling one: the paper's Llama 3.1 runs use L = 131072, not 8192.

    Raises:
        ValueError: see :func:`hf_posext.backends.attention.registration.original_length`.
    """
    original = registration.original_length(model, METHOD, request)  # also refuses a model carrying hf_posext's scaling
    if request.original_max_position_embeddings is not None or is_patched(model):
        return original
    declared = registration.declared_window(model)
    return declared if declared is not None and declared > original else original


def patch_string(model: nn.Module, request: ScalingRequest) -> nn.Module:
    """Install STRING (use :func:`hf_posext.patch`, which routes here).

    Args:
        model: a RoPE causal LM whose attention uses transformers' attention registry (5.x models).
        request: method ``"string"``; ``factor`` or ``target_length`` (default factor 1: STRING's home is
            inside the window; a larger one only declares the window, STRING has no length limit and keeps
            every distance below L up to ``L + S - w`` tokens); ``original_max_position_embeddings`` to
            override L (default: :func:`string_window`, the config's ``max_position_embeddings``); params
            ``shifted_offset`` (S, default ``int(0.33 L)``, below L), ``local_value`` (w, default 128, at most
            S / 2 on small windows; below S) and ``attention_factor`` (default 1; the reference code's
            ``0.1 ln 2 + 1`` multiplies q and k).

    Returns:
        The same model. Patching again replaces the previous settings (never compounds).

    Raises:
        ValueError: S >= L, w >= S, a negative or non-integer size, a bad factor, a model whose attention
            bypasses the registry or whose rotary embedding is dynamic. The model is unchanged in every case.

    Example:
        >>> hf_posext.patch(model, "string")                               # S = 0.33 L, w = 128
        >>> hf_posext.patch(model, "string", shifted_offset=2048, local_value=256)
    """
    original = string_window(model, request)
    params = request.params_dict
    settings = resolve_settings(request.factor, request.target_length, original, params.get("shifted_offset"),
                                params.get("local_value"), params.get("attention_factor", 1.0))
    if is_patched(model):
        return registration.update(model, METHOD, settings, lambda layer: dataclasses.replace(
            layer, shifted_offset=settings.shifted_offset, local_value=settings.local_value,
            attention_factor=settings.attention_factor), _write_config)
    return registration.install(model, METHOD, settings, lambda layer, mask_kind: _layer(layer, mask_kind, settings), _write_config)


def unpatch_string(model: nn.Module) -> nn.Module:
    """Remove STRING: the original attention implementation and config fields, exactly.

    Raises:
        ValueError: the model is not patched with STRING.
    """
    return registration.uninstall(model, METHOD)


def describe_string(model: nn.Module) -> ScalingReport:
    """A :class:`~hf_posext.core.record.ScalingReport` of kind ``"attention"`` for a STRING model."""
    settings = current_settings(model)
    s, w, window = settings.shifted_offset, settings.local_value, settings.original_max_position_embeddings
    notes = [
        f"distances < {s} exact; older keys seen from position i - {s} + {w} (distance d - {s} + {w}); the {s} largest "
        f"distances of the {window}-token window are never used",
        f"every distance stays below the {window}-token window up to {max_covered_length(window, s, w)} tokens (L + S - w)",
        "cost: past S, up to five attention calls per query block (two small masked triangles) merged by log-sum-exp; a decode step scores the "
        "query twice against the key cache as it is (see bench/string_cost.py)",
    ]
    if settings.attention_factor != 1.0:
        notes.append(f"q and k multiplied by {settings.attention_factor:g} (scores by its square)")
    return registration.report(
        model, METHOD, settings.factor, settings.target_length,
        {"shifted_offset": s, "local_value": w, "attention_factor": settings.attention_factor}, notes,
    )


def load_string(path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved with STRING (``config.hf_posext`` of kind ``"attention"``) and re-apply it."""
    from hf_posext.core.errors import RecordError

    params = dict(record.get("params", {}))
    source = f"{path}/config.json: field {CONFIG_KEY!r}"
    fix = f"re-save the model with hf_posext, or remove {CONFIG_KEY!r} to load it unscaled"
    for name in ("shifted_offset", "local_value"):
        value = params.get(name)
        if value is None:
            raise RecordError(f"{source}.params has no {name!r} (a STRING record needs shifted_offset and local_value); {fix}.")
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{source}.params.{name} must be an integer, got {value!r}; {fix}.")
    original = record["original_max_position_embeddings"]  # validated by hf_posext.core.record.validate_record
    shifted_offset, local_value = params["shifted_offset"], params["local_value"]
    attention_factor = float(params.get("attention_factor", 1.0))
    try:  # checked before any weight loads
        check_string_sizes(shifted_offset, local_value, original)
    except ValueError as error:
        raise RecordError(f"{source}.params: {error} The record cannot have been written by hf_posext; {fix}.") from None
    model, _ = registration.load_unpatched(path, record, METHOD, lambda config: None, **from_pretrained_kwargs)
    factor = float(record.get("factor") or 1.0)
    return patch_string(model, ScalingRequest.from_kwargs(
        "string", max(1.0, factor), original_max_position_embeddings=original, shifted_offset=shifted_offset,
        local_value=local_value, attention_factor=attention_factor,
    ))


#: How STRING plugs into transformers (see :mod:`hf_posext.backends.attention.registration`).
METHOD = registration.AttentionMethod(
    name="string",
    label=_LABEL,
    attention=string_attention,
    implementations=IMPLEMENTATIONS,
    layer_attribute=_LAYER_ATTRIBUTE,
    state_attribute=_STATE_ATTRIBUTE,
    config_keys=("max_position_embeddings",),
    scaled_word="shifted",
)
