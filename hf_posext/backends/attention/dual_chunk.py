"""Dual Chunk Attention: training-free context extension by chunked position indices (An et al. 2024).

An, Huang, Zhang, Gong, Qiu, Zhou, Kong 2024, "Training-Free Long-Context Scaling of Large Language
Models" (arXiv:2402.17463, ICML 2024; ChunkLlama). The position indices (pure numbers) are in
:mod:`hf_posext.methods.dual_chunk`: with chunk length ``s = chunk_size - local_window`` keys sit at
``j mod s`` and a query sits at ``i mod s`` (intra-chunk), ``min(i mod s + s, chunk_size)``
(successive chunk) or ``min(2s - 1, chunk_size)`` (inter-chunk) depending on how many chunks lie
between it and the key, so no relative distance exceeds ``chunk_size``.

How it hooks into transformers: like Self-Extend, through the public attention-function registry
(``AttentionInterface``, set up by :mod:`hf_posext.backends.attention.registration`), under
``hf_posext_dca_sdpa`` / ``hf_posext_dca_eager``. q and k arrive rotated to their true positions;
rotating them again by ``R(p' - p)`` moves them to the DCA index ``p'`` (RoPE rotations compose). Keys
move by ``-s * (j // s)`` (a multiple of the chunk length); queries by one of three offsets.

Cost. Up to the chunk length nothing changes (the SDPA path calls transformers' SDPA function). Past it,
on the SDPA path, each block of queries inside one chunk runs at most four fused attention calls with
no explicit mask — intra-chunk keys before the block, the block's causal diagonal, the previous chunk,
the older chunks — merged exactly by their log-sum-exp (the softmax over the whole row, taken in
pieces). A decode step (a few new queries, :func:`dual_chunk_decode`) leaves the key cache as it is:
per layer, the query rotated to its index for every chunk distance at once (one copy of channel
partners, two multiplies), one matmul against the cached keys, one gather picking each key's score, one
softmax, one matmul with the values — about seven kernels, the same at any length, no host
synchronisation; the rotation factors and key index are built once per step for all layers. The eager
path, a logit cap, training and per-row positions use an explicit pass with the keys moved to
``j mod s`` and each query rotated three ways. ``bench/dca_cost.py`` measures prefill and decode step.

Length scale (``attention_scale=True``, Qwen2.5-1M as SGLang serves it; docs/serving.md (S7)): every score
of a call times ``f(T)^2``, ``f(T) = max(1, 0.1 ln(T / L) + 1)``, T the last query's position + 1 of each
batch row. It is folded into the decode tables' rotation factors (no extra kernel), the fused path's
scaling (one T for the batch) and the explicit path's per-row scaling; 1 up to L, so shorter calls are
untouched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention import registration
from hf_posext.backends.attention.kernels import (
    StepTables, attention_with_lse, call_positions, finish_block, fused_start, finish_decode, head_groups, rotate_by_factors, rotate_with,
    rotation_factors,
)
from hf_posext.backends.attention.registration import AttentionLayer, call_settings, plain_attention
from hf_posext.core.record import CONFIG_KEY, ScalingReport, make_record
from hf_posext.core.request import ScalingRequest
from hf_posext.methods.dual_chunk import (
    check_chunk_sizes,
    chunk_length,
    default_chunk_size,
    default_local_window,
    length_scale,
)

__all__ = [
    "METHOD_NAMES",
    "VLLM_CONFIG_KEY",
    "DualChunkSettings",
    "DualChunkLayerSettings",
    "resolve_settings",
    "vllm_config",
    "dual_chunk_explicit",
    "dual_chunk_fused",
    "dual_chunk_decode",
    "clear_decode_tables",
    "dual_chunk_attention",
    "is_patched",
    "current_settings",
    "patch_dual_chunk",
    "unpatch_dual_chunk",
    "describe_dual_chunk",
    "load_dual_chunk",
    "current_request",
    "record_from_vllm_config",
    "METHOD",
]

#: Method names :func:`hf_posext.patch` routes here.
METHOD_NAMES = {"dca"}
#: The config field vLLM reads (Qwen2.5-1M checkpoints carry it): chunk_size, local_size,
#: original_max_position_embeddings.
VLLM_CONFIG_KEY = "dual_chunk_attention_config"
#: Registry names of our attention functions, keyed by the mask convention they expect.
IMPLEMENTATIONS = {"sdpa": "hf_posext_dca_sdpa", "eager": "hf_posext_dca_eager"}
_LAYER_ATTRIBUTE = "_hf_posext_dca"
_STATE_ATTRIBUTE = "_hf_posext_dca_state"
_LABEL = "Dual Chunk Attention"
#: Score elements materialised at once on the explicit path (~256 MB in float32).
SCORE_BLOCK_ELEMENTS = 1 << 26
#: Queries per block on the fused path.
FUSED_QUERY_BLOCK = 2048
#: Calls with at most this many queries (decoding) take the explicit path, which needs no host sync.
DECODE_QUERIES = 16


@dataclass(frozen=True)
class DualChunkSettings:
    """A validated Dual Chunk Attention request.

    Attributes:
        chunk_size: c, the largest position index a query takes.
        local_window: w; the chunk length is ``c - w``.
        original_max_position_embeddings: L, the pre-training window.
        target_length: the window the model is declared to handle (DCA itself has no length limit).
        attention_scale: scores multiplied by ``length_scale(T, L) ** 2`` (SGLang's Qwen2.5-1M scale).
    """

    chunk_size: int
    local_window: int
    original_max_position_embeddings: int
    target_length: int
    attention_scale: bool = False

    @property
    def chunk_length(self) -> int:
        return chunk_length(self.chunk_size, self.local_window)

    @property
    def factor(self) -> float:
        return self.target_length / self.original_max_position_embeddings


@dataclass
class DualChunkLayerSettings:
    """What one attention module needs: its rotary frequencies and the chunking (None: plain attention)."""

    inv_freq: torch.Tensor  # float64, rotary dim / 2 values
    rotary_dim: int
    interleaved: bool
    chunk_size: int | None
    local_window: int | None
    mask_kind: str  # "sdpa" (bool or None) or "eager" (additive float)
    scaled: bool = True
    scale_length: int | None = None  # L when scores scale by length_scale(T, L) ** 2, else None
    _frequencies: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def frequencies(self, device) -> torch.Tensor:
        """inv_freq as float64 on ``device`` (cached: no host-to-device copy per call)."""
        key = str(device)
        if key not in self._frequencies:
            self._frequencies[key] = self.inv_freq.to(device=device, dtype=torch.float64)
        return self._frequencies[key]

    def chunk_step(self, device) -> torch.Tensor:
        """The angles of a rotation by ``-s`` positions, reduced to [0, 2*pi), float32 on ``device``.

        A key moves by ``-s * (j // s)``: its angles are ``(j // s) * chunk_step``, exact to float32 for
        any realistic chunk count (the error grows with ``j // s``, about 1e-6 rad at 20 chunks), which
        keeps the trigonometry over the key cache in float32.
        """
        key = ("step", str(device), self.chunk_size, self.local_window)
        if key not in self._frequencies:
            s = chunk_length(self.chunk_size, self.local_window)
            step = torch.remainder(-s * self.inv_freq.double(), 2 * math.pi)
            self._frequencies[key] = step.to(device=device, dtype=torch.float32)
        return self._frequencies[key]


# --------------------------------------------------------------------------------------------------
# Position indices as tensors (the same rule as hf_posext.methods.dual_chunk.relative_distance)
# --------------------------------------------------------------------------------------------------


def _query_offsets(positions: torch.Tensor, chunk_size: int, local_window: int) -> torch.Tensor:
    """Rotations moving a query from p to its intra-, successive- and inter-chunk indices: ``[3, *positions.shape]``."""
    s = chunk_length(chunk_size, local_window)
    inside = positions - s * torch.div(positions, s, rounding_mode="floor")  # p mod s, also for p < 0
    intra = inside - positions
    successive = torch.clamp(inside + s, max=chunk_size) - positions
    inter = min(2 * s - 1, chunk_size) - positions
    return torch.stack((intra, successive, inter))


def _query_offsets_by_distance(positions: torch.Tensor, kv_len: int, chunk_size: int, local_window: int) -> tuple[torch.Tensor, int]:
    """Rotations that give a query the right score against a key *at its true position* ``d`` chunks back.

    For a key in chunk ``b = a - d`` (the query in chunk ``a``, ``r = i mod s``) the wanted distance is
    ``T_d - (j mod s)`` with ``T_0 = r``, ``T_1 = min(r + s, c)``, ``T_d = min(2s - 1, c)`` beyond; the
    true one is ``s * d + r - (j mod s)``; so the query moves by ``T_d - s * d - r`` (0 for ``d = 0``).
    Keys are consecutive up to the last query, so ``d <= (kv_len - 1) // s + 1``: the count is known
    without reading any position back from the device.

    Returns:
        ``[distances, *positions.shape]`` offsets and the number of distances.
    """
    s = chunk_length(chunk_size, local_window)
    distances = (kv_len - 1) // s + 2
    inside = (positions - s * torch.div(positions, s, rounding_mode="floor")).unsqueeze(0)
    d = torch.arange(distances, device=positions.device).view(-1, *([1] * positions.dim()))
    target = torch.where(d == 0, inside, torch.where(d == 1, torch.clamp(inside + s, max=chunk_size),
                                                     torch.full_like(inside, min(2 * s - 1, chunk_size))))
    return target - s * d - inside, distances


def _rotate_keys(key: torch.Tensor, key_positions: torch.Tensor, layer: DualChunkLayerSettings) -> torch.Tensor:
    """Keys ``[B, kv_heads, T, D]`` at positions ``[B, T]`` moved to ``p mod s`` (see ``chunk_step``)."""
    s = chunk_length(layer.chunk_size, layer.local_window)
    chunks = torch.div(key_positions, s, rounding_mode="floor").to(torch.float32)
    angles = (chunks.unsqueeze(-1) * layer.chunk_step(key.device)).unsqueeze(-3)
    return rotate_with(key, angles.cos(), angles.sin(), layer.rotary_dim, layer.interleaved)


def _rotate(states: torch.Tensor, offsets: torch.Tensor, layer: DualChunkLayerSettings) -> torch.Tensor:
    """Rotate ``states`` ``[..., B, heads, T, D]`` by ``offsets`` ``[..., B, T]`` more positions (angles in float64)."""
    angles = offsets.to(dtype=torch.float64).unsqueeze(-1) * layer.frequencies(states.device)
    angles = angles.unsqueeze(-3)  # broadcast over heads
    if layer.rotary_dim < states.shape[-1]:  # partial rotary: the pass-through channels need the full shape too
        states = states.expand(*torch.broadcast_shapes(states.shape[:-1], angles.shape[:-1]), states.shape[-1])
    return rotate_with(states, angles.cos(), angles.sin(), layer.rotary_dim, layer.interleaved)


def _score_scale(last_positions: torch.Tensor, original_length: int) -> torch.Tensor:
    """``length_scale(T, L) ** 2`` per row, ``T`` = the last query position + 1, as float32 ``[rows]``.

    The length is the one SGLang uses (``orig_seq_lens``: the prompt length in a prefill, the length
    with the new token in a decode step), read from the positions on the device (no host sync).
    """
    length = last_positions.to(torch.float64) + 1
    factor = torch.clamp(0.1 * torch.log(length / original_length) + 1.0, min=1.0)
    return (factor * factor).to(torch.float32)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


def dual_chunk_explicit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    layer: DualChunkLayerSettings,
    scaling: float,
    softcap: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    block_elements: int = SCORE_BLOCK_ELEMENTS,
) -> torch.Tensor:
    """Dual Chunk Attention with the scores written out, block of queries by block.

    Each query is rotated to its three indices and scored against every key rotated to ``j mod s`` in
    one matmul; a gather keeps, per key, the score of the kind its chunk distance calls for (0: same
    chunk, 1: previous chunk, 2: older). With ``layer.chunk_size`` None it is plain attention.

    Args:
        query: ``[batch, heads, q_len, head_dim]`` rotated to ``query_positions`` (``[batch, q_len]``).
        key, value: ``[batch, kv_heads, kv_len, head_dim]``; keys rotated to ``key_positions``.
        attention_mask: None (causal, the queries being the last keys), bool (True = attend) or additive
            float, broadcastable to ``[batch, heads, q_len, kv_len]``.
        layer: rotary frequencies and chunking. scaling: score multiplier. softcap: Gemma 2 logit cap.
        dropout, training: attention dropout, applied when training.
        block_elements: score elements materialised at once.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = head_groups(query, key)
    chunked = layer.chunk_size is not None
    if chunked:
        s = chunk_length(layer.chunk_size, layer.local_window)
        query_positions = query_positions.to(key.device).expand(batch, q_len)
        key_positions = key_positions.to(key.device).expand(batch, kv_len)
        query_chunk = torch.div(query_positions, s, rounding_mode="floor")
        key_chunk = torch.div(key_positions, s, rounding_mode="floor")
        if q_len <= DECODE_QUERIES:
            # Few queries: leave the key cache as it is and rotate each query once per chunk distance instead.
            offsets, kinds = _query_offsets_by_distance(query_positions, kv_len, layer.chunk_size, layer.local_window)
        else:
            key = _rotate_keys(key, key_positions, layer)
            offsets, kinds = _query_offsets(query_positions, layer.chunk_size, layer.local_window), 3
        query = _rotate(query.unsqueeze(0), offsets, layer)
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
        if chunked:
            kind = (query_chunk[:, start:end, None] - key_chunk[:, None, :]).clamp_(0, kinds - 1)
            scores = scores.gather(3, kind[:, None, None, None].expand(batch, kv_heads, groups, 1, rows, kv_len))
        scores = scores.squeeze(3)
        outputs.append(finish_block(scores, value, attention_mask, start, offset, scaling, softcap, dropout, training))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def dual_chunk_fused(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    first_query_position: int,
    layer: DualChunkLayerSettings,
    scaling: float,
    block: int = FUSED_QUERY_BLOCK,
) -> torch.Tensor:
    """Dual Chunk Attention as fused attention calls merged by log-sum-exp (inference; same result as
    :func:`dual_chunk_explicit`).

    Needs one set of positions for the whole batch, consecutive: queries at ``first_query_position + r``
    and keys at ``first_query_position - (kv_len - q_len) + j`` (the queries are the last keys). For each
    block of queries inside one chunk ``a`` (positions ``[lo, hi)``) the keys split into: intra-chunk keys
    before the block (raw q and k: same chunk, true distances), the block's diagonal (raw, causal), the
    previous chunk (successive-chunk queries against re-rotated keys) and older chunks (inter-chunk
    queries). None of them needs a mask; with a bool ``attention_mask`` (padding) each takes its slice.

    Args: as :func:`dual_chunk_explicit`; ``attention_mask`` None or bool ``[batch, 1, q_len, kv_len]``.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    s = chunk_length(layer.chunk_size, layer.local_window)
    first_key_position = first_query_position - (kv_len - q_len)
    key_positions = torch.arange(kv_len, device=key.device) + first_key_position
    key_rotated = _rotate_keys(key, key_positions[None], layer)

    def index(position: int) -> int:
        return min(max(position - first_key_position, 0), kv_len)

    def call(q: torch.Tensor, rows: slice, low: int, high: int, causal: bool, keys: torch.Tensor):
        rows_n = rows.stop - rows.start
        k, v = keys[:, :, low:high], value[:, :, low:high]
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, :, rows, low:high]
            if groups > 1:
                mask = mask.repeat(1, 1, groups, 1)
        if causal and attention_mask is None and groups > 1:
            # Causal over the diagonal needs one row per key: repeat its few keys per query head instead.
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            output, lse = attention_with_lse(q, k, v, None, scaling, is_causal=True)
            return output, lse
        q = q.reshape(batch, kv_heads, groups * rows_n, head_dim)
        output, lse = attention_with_lse(q, k, v, mask, scaling, is_causal=causal and mask is None)
        return output.reshape(batch, heads, rows_n, head_dim), lse.reshape(batch, heads, rows_n)

    last = first_query_position + q_len
    outputs = []
    position = first_query_position
    while position < last:
        chunk = position // s
        high_position = min(last, (chunk + 1) * s, position + block)
        rows = slice(position - first_query_position, high_position - first_query_position)
        positions = torch.arange(position, high_position, device=query.device)[None]
        block_query = query[:, :, rows]
        parts = []
        diagonal_low, diagonal_high = index(position), index(high_position)
        parts.append(call(block_query, rows, diagonal_low, diagonal_high, True, key))
        chunk_low = index(chunk * s)
        if chunk_low < diagonal_low:
            parts.append(call(block_query, rows, chunk_low, diagonal_low, False, key))
        previous_low = index((chunk - 1) * s)
        offsets = _query_offsets(positions, layer.chunk_size, layer.local_window)
        if previous_low < chunk_low:
            successive = _rotate(block_query, offsets[1], layer)
            parts.append(call(successive, rows, previous_low, chunk_low, False, key_rotated))
        if previous_low > 0:
            inter = _rotate(block_query, offsets[2], layer)
            parts.append(call(inter, rows, 0, previous_low, False, key_rotated))
        if len(parts) == 1:
            outputs.append(parts[0][0].to(value.dtype))
        else:
            lse = torch.stack([p[1] for p in parts]).logsumexp(dim=0)
            merged = sum(o.float() * torch.nan_to_num(torch.exp(l - lse), nan=0.0)[..., None] for o, l in parts)
            outputs.append(merged.to(value.dtype))
        position = high_position
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()




# --------------------------------------------------------------------------------------------------
# Decode step: a fixed handful of kernels per layer
# --------------------------------------------------------------------------------------------------


@dataclass
class _DecodeTables:
    """What every layer of one decode step shares (built by the first layer, reused by the others).

    Attributes:
        cos, sin: ``[B', distances, rows, head_dim]`` float32 factors (the score scaling folded in) that
            rotate a query to its index for each chunk distance (:func:`rotate_by_factors`).
        kind: ``[B', rows, kv_len]`` chunk distance of each key from each query, capped at the last one.
        future: ``[rows, kv_len]`` bool, True for keys after a query (None: none, e.g. one query).
        distances: how many chunk distances ``cos`` / ``sin`` hold.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    kind: torch.Tensor
    future: torch.Tensor | None
    distances: int


#: One decode step's tables, shared by its layers (see :class:`StepTables`).
_DECODE_TABLES = StepTables()


def _decode_tables(query_positions: torch.Tensor, kv_len: int, layer: DualChunkLayerSettings, head_dim: int, scaling: float) -> _DecodeTables:
    """Build :class:`_DecodeTables` for queries at ``query_positions`` ``[B', rows]`` against ``kv_len`` keys
    (consecutive, the last one at the last query's position)."""
    device = query_positions.device
    rows = query_positions.shape[-1]
    s = chunk_length(layer.chunk_size, layer.local_window)
    offsets, distances = _query_offsets_by_distance(query_positions, kv_len, layer.chunk_size, layer.local_window)
    angles = offsets.to(torch.float64).unsqueeze(-1) * layer.frequencies(device)  # [distances, B', rows, rotary / 2]
    cos, sin = rotation_factors(angles.cos().float(), angles.sin().float(), layer.rotary_dim, head_dim, layer.interleaved, scaling)
    if layer.scale_length is not None:  # SGLang's length scale, per row, folded into the query's factors
        scale = _score_scale(query_positions[:, -1], layer.scale_length).view(1, -1, 1, 1)
        cos, sin = cos * scale, sin * scale
    key_positions = query_positions[:, -1:] - torch.arange(kv_len - 1, -1, -1, device=device)
    query_chunk = torch.div(query_positions, s, rounding_mode="floor")
    key_chunk = torch.div(key_positions, s, rounding_mode="floor")
    kind = (query_chunk.unsqueeze(-1) - key_chunk.unsqueeze(-2)).clamp_(0, distances - 1)
    future = None
    if rows > 1:
        future = torch.ones(rows, kv_len, dtype=torch.bool, device=device).triu_(kv_len - rows + 1)
    return _DecodeTables(cos.transpose(0, 1).contiguous(), sin.transpose(0, 1).contiguous(), kind, future, distances)


def _cached_decode_tables(position_ids, query: torch.Tensor, key: torch.Tensor, layer: DualChunkLayerSettings, scaling: float) -> _DecodeTables:
    """:func:`_decode_tables` for this call, reused across the layers of one step (same position_ids tensor)."""
    return _DECODE_TABLES.for_call(
        query, key, position_ids, scaling, layer.inv_freq,
        (id(layer.inv_freq), layer.rotary_dim, layer.interleaved, layer.chunk_size, layer.local_window, layer.scale_length),
        _LABEL,
        lambda positions, kv_len: _decode_tables(positions, kv_len, layer, query.shape[-1], scaling))


def clear_decode_tables() -> None:
    """Forget the decode-step tables kept for the next layer (benchmarks: time a step's first layer)."""
    _DECODE_TABLES.clear()


def dual_chunk_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    layer: DualChunkLayerSettings,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dual Chunk Attention for a few new queries against a long key cache, in a fixed number of kernels.

    The same function as :func:`dual_chunk_explicit` for ``q_len <= DECODE_QUERIES`` (the key cache left as
    it is, each query rotated once per chunk distance ``d``, see :func:`_query_offsets_by_distance`), built
    for a GPU decode step that is not launch-bound: per layer one copy of channel partners and two
    multiplies rotate the query to all its indices at once (the score scaling folded in), one matmul scores
    them against every cached key, one gather keeps each key's score for its chunk distance, then one
    softmax and one matmul with the values. No loop over chunks, no read back to the host. The rotation
    factors and the per-key distance index depend only on the positions, so the first layer of a step
    builds them and the others reuse them (:func:`_cached_decode_tables`).

    Args:
        query: ``[batch, heads, q_len, head_dim]``. key, value: ``[batch, kv_heads, kv_len, head_dim]``,
            keys rotated to their positions, consecutive up to the last query.
        attention_mask: None (causal), bool (True = attend) or additive float, broadcastable to
            ``[batch, heads, q_len, kv_len]``. position_ids: the queries' positions (None: the last q_len).
        layer: rotary frequencies and chunking (``layer.chunk_size`` set). scaling: score multiplier.
        softcap: Gemma 2 logit cap.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = head_groups(query, key)
    tables = _cached_decode_tables(position_ids, query, key, layer, scaling)
    distances = tables.distances
    # [B, H, rows, D] -> [B, kv_heads, groups, 1, rows, D] against [B', 1, 1, distances, rows, D] factors:
    # the product is laid out as the matmul wants it (query heads of a kv head, then distances, as rows).
    rotated = rotate_by_factors(
        query.reshape(batch, kv_heads, groups, 1, q_len, head_dim),
        tables.cos.view(-1, 1, 1, distances, q_len, head_dim), tables.sin.view(-1, 1, 1, distances, q_len, head_dim),
        layer.rotary_dim, layer.interleaved,
    )
    scores = torch.matmul(rotated.reshape(batch, kv_heads, groups * distances * q_len, head_dim), key.transpose(2, 3))
    index = tables.kind.view(-1, 1, 1, 1, q_len, kv_len).expand(batch, kv_heads, groups, 1, q_len, kv_len)
    scores = scores.view(batch, kv_heads, groups, distances, q_len, kv_len).gather(3, index).squeeze(3)
    return finish_decode(scores, attention_mask, tables.future, value, softcap)


def dual_chunk_attention(
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

    Layers DCA leaves alone (Gemma 3 sliding layers) and prefills that fit in one chunk run plain
    attention (transformers' own SDPA function on the SDPA path); decode steps (at most
    ``DECODE_QUERIES`` queries) run :func:`dual_chunk_decode`; prefills past one chunk run
    :func:`dual_chunk_fused` where it applies; everything else (eager prefill, logit cap, training
    dropout, per-row positions) runs :func:`dual_chunk_explicit`. Attention weights are not returned.
    """
    layer: DualChunkLayerSettings
    layer, scaling = call_settings(module, query, scaling, kwargs, attribute=_LAYER_ATTRIBUTE, title="Dual Chunk Attention", method="dca")
    softcap = kwargs.get("softcap")
    q_len = query.shape[2]
    if layer.chunk_size is not None and q_len <= DECODE_QUERIES and not (dropout and module.training):
        return dual_chunk_decode(query, key, value, attention_mask, kwargs.get("position_ids"), layer, scaling, softcap), None
    query_positions, key_positions = call_positions(query, key, kwargs.get("position_ids"), _LABEL)
    plain = layer.chunk_size is None
    if not plain and q_len > DECODE_QUERIES:
        # A prefill: one host sync is cheap next to the work, and prompts inside one chunk stay bit for bit the
        # model's (prompts of at most DECODE_QUERIES tokens took the decode kernel above: equal values, not SDPA's bits).
        plain = int(query_positions.max()) < chunk_length(layer.chunk_size, layer.local_window)
    if plain and layer.mask_kind == "sdpa" and softcap is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if not plain and q_len > DECODE_QUERIES:
        start = fused_start(layer.mask_kind, attention_mask, query_positions, softcap, dropout, module.training, (query, key, value))
        if start is not None:
            if layer.scale_length is not None:
                scaling = scaling * length_scale(start + q_len, layer.scale_length) ** 2
            return dual_chunk_fused(query, key, value, attention_mask, start, layer, scaling), None
    active = dataclasses.replace(layer, chunk_size=None) if plain else layer
    if not plain and layer.scale_length is not None:  # one scale per batch row (left padding: its own length)
        scaling = scaling * _score_scale(query_positions[:, -1], layer.scale_length).view(-1, 1, 1, 1, 1)
    output = dual_chunk_explicit(
        query, key, value, attention_mask, query_positions, key_positions, active, scaling,
        softcap=softcap, dropout=dropout, training=module.training,
    )
    return output, None




# --------------------------------------------------------------------------------------------------
# patch / unpatch / describe / load
# --------------------------------------------------------------------------------------------------

def is_patched(model: nn.Module) -> bool:
    """True when ``model`` runs Dual Chunk Attention installed by :func:`patch_dual_chunk`."""
    return registration.is_patched(model, METHOD)


def current_settings(model: nn.Module) -> DualChunkSettings:
    """c, w, L and the target length of a model patched with DCA."""
    return registration.current_settings(model, METHOD)


def resolve_settings(
    factor: float | None, target_length: int | None, original_length: int, chunk_size: int | None, local_window: int | None,
    attention_scale: bool = False,
) -> DualChunkSettings:
    """Fill in the paper's defaults and validate (raises ValueError naming the bad value and the fix)."""
    from hf_posext.core.request import resolve_factor

    chunk_size = default_chunk_size(original_length) if chunk_size is None else chunk_size
    local_window = default_local_window(original_length) if local_window is None else local_window
    check_chunk_sizes(chunk_size, local_window, original_length)
    scale = resolve_factor(factor, target_length, original_length)
    target = target_length if target_length is not None else int(math.ceil(original_length * scale - 1e-9))
    return DualChunkSettings(chunk_size, local_window, original_length, target, bool(attention_scale))


def vllm_config(settings: DualChunkSettings) -> dict[str, int]:
    """The ``dual_chunk_attention_config`` vLLM (and Qwen2.5-1M's config.json) use for these settings.

    ``original_max_position_embeddings`` is written only with ``attention_scale``: SGLang's backend turns
    its length scale on exactly when that field is above 0 (docs/serving.md), so the field says whether the
    scores are scaled, for SGLang and for :func:`hf_posext.load` alike.
    """
    field = {"chunk_size": settings.chunk_size, "local_size": settings.local_window}
    if settings.attention_scale:
        field["original_max_position_embeddings"] = settings.original_max_position_embeddings
    return field


def _write_config(config, settings: DualChunkSettings, base: str, max_positions: int | None) -> None:
    """The record, vLLM's field, and ``max_position_embeddings`` raised to the target window (vLLM sizes its
    context from it: Qwen2.5-1M has 1010000 beside an original 262144); ``max_positions`` is its value
    before patching (kept in the record so that load can put it back)."""
    setattr(config, CONFIG_KEY, make_record(
        "attention", "dca", settings.factor, settings.original_max_position_embeddings,
        {"chunk_size": settings.chunk_size, "local_window": settings.local_window, "attention_scale": settings.attention_scale},
        attn_implementation=base,
        max_position_embeddings_before=max_positions,
    ))
    setattr(config, VLLM_CONFIG_KEY, vllm_config(settings))
    if max_positions is not None:
        config.max_position_embeddings = max(settings.target_length, max_positions)



def _layer(layer: AttentionLayer, mask_kind: str, settings: DualChunkSettings) -> DualChunkLayerSettings:
    return DualChunkLayerSettings(
        layer.inv_freq, layer.rotary_dim, layer.interleaved,
        settings.chunk_size if layer.scaled else None, settings.local_window if layer.scaled else None,
        mask_kind, layer.scaled, _scale_length(settings) if layer.scaled else None,
    )


def _scale_length(settings: DualChunkSettings) -> int | None:
    return settings.original_max_position_embeddings if settings.attention_scale else None


def current_request(model: nn.Module) -> ScalingRequest:
    """The request that re-creates the current DCA patch."""
    settings = current_settings(model)
    return ScalingRequest.from_kwargs(
        "dca", settings.factor, original_max_position_embeddings=settings.original_max_position_embeddings,
        chunk_size=settings.chunk_size, local_window=settings.local_window, attention_scale=settings.attention_scale,
    )


def patch_dual_chunk(model: nn.Module, request: ScalingRequest) -> nn.Module:
    """Install Dual Chunk Attention (use :func:`hf_posext.patch`, which routes here).

    Args:
        model: a RoPE causal LM whose attention uses transformers' attention registry (5.x models).
        request: method ``"dca"``; ``factor`` or ``target_length``: the window the model is declared to
            handle (DCA has no length limit of its own: this sets ``describe``'s current window and the
            saved ``max_position_embeddings``); ``original_max_position_embeddings`` to override L; params
            ``chunk_size`` (c, default 3L/4, at most L) and ``local_window`` (w, default L/16, below c);
            ``attention_scale`` (default False): scores times ``(0.1 ln(T / L) + 1) ** 2`` past L, T the
            sequence length, as SGLang serves Qwen2.5-1M (a save then writes
            ``original_max_position_embeddings`` into ``dual_chunk_attention_config``, which is what turns
            the scale on in SGLang; without it the field is left out).

    Returns:
        The same model. Patching again replaces the previous settings (never compounds).

    Raises:
        ValueError: chunk_size > L, local_window >= chunk_size, a bad factor, a model whose attention
            bypasses the registry or whose rotary embedding is dynamic. The model is unchanged in every case.

    Example:
        >>> hf_posext.patch(model, "dca", factor=4)                       # c = 3L/4, w = L/16
        >>> hf_posext.patch(model, "dca", target_length=32768, chunk_size=6144, local_window=512)
    """
    original = registration.original_length(model, METHOD, request)
    params = request.params_dict
    settings = resolve_settings(request.factor, request.target_length, original, params.get("chunk_size"), params.get("local_window"),
                                bool(params.get("attention_scale", False)))
    if is_patched(model):
        return registration.update(model, METHOD, settings, lambda layer: dataclasses.replace(
            layer, chunk_size=settings.chunk_size, local_window=settings.local_window,
            scale_length=_scale_length(settings)), _write_config)
    return registration.install(model, METHOD, settings, lambda layer, mask_kind: _layer(layer, mask_kind, settings), _write_config)


def unpatch_dual_chunk(model: nn.Module) -> nn.Module:
    """Remove Dual Chunk Attention: the original attention implementation and config fields, exactly.

    Raises:
        ValueError: the model is not patched with DCA.
    """
    return registration.uninstall(model, METHOD)


def describe_dual_chunk(model: nn.Module) -> ScalingReport:
    """A :class:`~hf_posext.core.record.ScalingReport` of kind ``"attention"`` for a DCA model."""
    settings = current_settings(model)
    notes = [
        f"chunks of {settings.chunk_length} tokens; every relative distance <= chunk_size = {settings.chunk_size} "
        f"(original window {settings.original_max_position_embeddings}); no length limit of its own",
        "cost: past one chunk, up to four fused attention calls per query block merged by log-sum-exp; a decode "
        "step rotates the new query once per chunk distance and reads the key cache as it is (see bench/dca_cost.py)",
        (f"scores times (0.1 ln(T / {settings.original_max_position_embeddings}) + 1)^2 past the original window, "
         "T the sequence length (SGLang's Qwen2.5-1M scale)") if settings.attention_scale else
        "no length scale (attention_scale=False, ChunkLlama's DCA)",
        f"saved config carries vLLM's {VLLM_CONFIG_KEY} (chunk_size, local_size"
        + (", original_max_position_embeddings: SGLang scales" if settings.attention_scale else "; no original_max_position_embeddings: SGLang does not scale") + ")",
    ]
    return registration.report(
        model, METHOD, settings.factor, settings.target_length,
        {"chunk_size": settings.chunk_size, "local_window": settings.local_window, "attention_scale": settings.attention_scale}, notes,
    )


def _saved_sizes(path: str, record: dict[str, Any], config: Any) -> tuple[int, int, int, bool]:
    """L, c, w and the length scale of a saved DCA model: vLLM's ``dual_chunk_attention_config`` (so an
    edit there is what loads; the scale is on when it holds ``original_max_position_embeddings`` > 0, as
    SGLang reads it), else the ``hf_posext`` record."""
    from hf_posext.core.errors import RecordError

    params = dict(record.get("params", {}))
    vllm = getattr(config, VLLM_CONFIG_KEY, None) or {}
    if not isinstance(vllm, dict):
        raise RecordError(f"{path}/config.json: {VLLM_CONFIG_KEY} must be an object, got {vllm!r}.")
    try:
        original = int(vllm.get("original_max_position_embeddings", record["original_max_position_embeddings"]))
        chunk_size = int(vllm.get("chunk_size", params["chunk_size"]))
        local_window = int(vllm.get("local_size", params["local_window"]))
    except (KeyError, TypeError, ValueError) as error:
        raise RecordError(
            f"{path}/config.json: a DCA record needs chunk_size and local_window (or {VLLM_CONFIG_KEY} with "
            f"chunk_size, local_size, original_max_position_embeddings); got {record!r}."
        ) from error
    if getattr(config, VLLM_CONFIG_KEY, None) is not None:
        attention_scale = _scale_on(vllm)
    else:
        attention_scale = bool(params.get("attention_scale", False))
    return original, chunk_size, local_window, attention_scale


def _scale_on(field: dict[str, Any]) -> bool:
    """SGLang's rule: the length scale is on when the field's ``original_max_position_embeddings`` is above 0."""
    value = field.get("original_max_position_embeddings", 0)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def record_from_vllm_config(config: Any, source: str) -> dict[str, Any] | None:
    """A DCA record for a config that carries only vLLM's ``dual_chunk_attention_config`` (Qwen2.5-1M
    checkpoints), so that :func:`hf_posext.load` applies DCA; None when the config has no such field.

    The sizes are the field's ``chunk_size`` and ``local_size``; the original window L its
    ``original_max_position_embeddings``, else the config's (top level or in its rope parameters), else
    ``max_position_embeddings``; the factor is ``max_position_embeddings / L`` (at least 1); the length
    scale (``attention_scale``) is on when the field holds ``original_max_position_embeddings`` > 0, as in
    SGLang, which serves Qwen2.5-1M that way.

    Raises:
        RecordError: the field is not an object, or its sizes are missing, not integers, or break DCA's
            rules (chunk_size <= L, local_size < chunk_size), naming ``source`` and the fix; raised before
            any weight is loaded.
    """
    from hf_posext.core.errors import RecordError

    field = getattr(config, VLLM_CONFIG_KEY, None)
    if field is None:
        return None
    where = f"{source}: {VLLM_CONFIG_KEY}"
    if not isinstance(field, dict):
        raise RecordError(f"{where} must be an object with chunk_size and local_size, got {field!r}.")
    chunk_size, local_size = _integer(field.get("chunk_size")), _integer(field.get("local_size"))
    if chunk_size is None or local_size is None:
        raise RecordError(f"{where} needs integer chunk_size and local_size (as Qwen2.5-1M writes them), got {field!r}.")
    max_positions = _integer(getattr(config, "max_position_embeddings", None))
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    candidates = (field.get("original_max_position_embeddings"), getattr(config, "original_max_position_embeddings", None),
                  rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None, max_positions)
    original = next((value for value in candidates if value is not None), None)
    if _integer(original) is None or original < 2:
        raise RecordError(f"{where}: original_max_position_embeddings must be an integer >= 2, got {original!r}.")
    try:
        check_chunk_sizes(chunk_size, local_size, original)
    except ValueError as error:
        raise RecordError(f"{where}: {error} Fix the field in config.json.") from error
    factor = max(1.0, (max_positions or original) / original)
    return make_record("attention", "dca", factor, original,
                       {"chunk_size": chunk_size, "local_window": local_size, "attention_scale": _scale_on(field)})


def load_dual_chunk(path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved with DCA and re-apply it.

    The sizes come from the config's ``dual_chunk_attention_config`` (vLLM's fields, so an edit there is
    what loads) and otherwise from the ``hf_posext`` record; the window from the record's ``factor``.
    """
    model, (original, chunk_size, local_window, attention_scale) = registration.load_unpatched(
        path, record, METHOD, lambda config: _saved_sizes(path, record, config), **from_pretrained_kwargs,
    )
    factor = float(record.get("factor") or 1.0)
    return patch_dual_chunk(model, ScalingRequest.from_kwargs(
        "dca", max(1.0, factor), original_max_position_embeddings=original, chunk_size=chunk_size, local_window=local_window,
        attention_scale=attention_scale,
    ))


#: How DCA plugs into transformers (see :mod:`hf_posext.backends.attention.registration`).
METHOD = registration.AttentionMethod(
    name="dca",
    label=_LABEL,
    attention=dual_chunk_attention,
    implementations=IMPLEMENTATIONS,
    layer_attribute=_LAYER_ATTRIBUTE,
    state_attribute=_STATE_ATTRIBUTE,
    config_keys=(VLLM_CONFIG_KEY, "max_position_embeddings"),
    scaled_word="chunked",
)
