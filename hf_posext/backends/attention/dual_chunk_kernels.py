"""Dual Chunk Attention's math: chunked position indices applied to rotated q and k (An et al. 2024).

Three ways to compute it, one result: :func:`dual_chunk_explicit` writes the scores out block by block (eager
path, logit caps, dropout, per-row positions), :func:`dual_chunk_fused` runs fused attention calls merged by their
log-sum-exp (the SDPA path), :func:`dual_chunk_decode` runs a decode step in a fixed handful of kernels.
:mod:`hf_posext.backends.attention.dual_chunk` picks one per call and installs the method; see its docstring for
the indices and the costs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from hf_posext.backends.attention.kernels import (
    StepTables, attention_with_lse, finish_block, finish_decode, head_groups, rotate_by_factors, rotate_with,
    rotation_factors,
)
from hf_posext.methods.dual_chunk import chunk_length

__all__ = [
    "DualChunkLayerSettings",
    "SCORE_BLOCK_ELEMENTS",
    "FUSED_QUERY_BLOCK",
    "DECODE_QUERIES",
    "score_scale",
    "dual_chunk_explicit",
    "dual_chunk_fused",
    "dual_chunk_decode",
    "clear_decode_tables",
]

_LABEL = "Dual Chunk Attention"
#: Score elements materialised at once on the explicit path (~256 MB in float32).
SCORE_BLOCK_ELEMENTS = 1 << 26
#: Queries per block on the fused path.
FUSED_QUERY_BLOCK = 2048
#: Calls with at most this many queries (decoding) take the explicit path, which needs no host sync.
DECODE_QUERIES = 16


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


def score_scale(last_positions: torch.Tensor, original_length: int) -> torch.Tensor:
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
    sinks: torch.Tensor | None = None,
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
        sinks: learned attention sinks, one logit per query head (gpt-oss), or None.

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
        outputs.append(finish_block(scores, value, attention_mask, start, offset, scaling, softcap, dropout, training, sinks))
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
    q_len, kv_len = query.shape[2], key.shape[2]
    s = chunk_length(layer.chunk_size, layer.local_window)
    first_key_position = first_query_position - (kv_len - q_len)
    key_positions = torch.arange(kv_len, device=key.device) + first_key_position
    key_rotated = _rotate_keys(key, key_positions[None], layer)

    def index(position: int) -> int:
        return min(max(position - first_key_position, 0), kv_len)

    def call(q: torch.Tensor, rows: slice, low: int, high: int, causal: bool, keys: torch.Tensor):
        return _fused_part(q, keys[:, :, low:high], value[:, :, low:high], attention_mask, rows, low, high, causal, scaling)

    last = first_query_position + q_len
    outputs = []
    position = first_query_position
    while position < last:
        chunk = position // s
        high_position = min(last, (chunk + 1) * s, position + block)
        rows = slice(position - first_query_position, high_position - first_query_position)
        positions = torch.arange(position, high_position, device=query.device)[None]
        block_query = query[:, :, rows]
        diagonal_low, diagonal_high = index(position), index(high_position)
        parts = [call(block_query, rows, diagonal_low, diagonal_high, True, key)]
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
        outputs.append(_merged(parts, value.dtype))
        position = high_position
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _fused_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, rows: slice,
                low: int, high: int, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused call of :func:`dual_chunk_fused`: queries ``q`` (rows ``rows``) against keys ``[low, high)``.

    Returns:
        The output ``[batch, heads, rows, head_dim]`` and its log-sum-exp ``[batch, heads, rows]``.
    """
    batch, heads, rows_n, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
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


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The softmax over the whole row from its pieces: ``sum_s o_s * exp(l_s - logsumexp_s l_s)``."""
    if len(parts) == 1:
        return parts[0][0].to(dtype)
    lse = torch.stack([p[1] for p in parts]).logsumexp(dim=0)
    merged = sum(o.float() * torch.nan_to_num(torch.exp(l - lse), nan=0.0)[..., None] for o, l in parts)
    return merged.to(dtype)


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
        scale = score_scale(query_positions[:, -1], layer.scale_length).view(1, -1, 1, 1)
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
    sinks: torch.Tensor | None = None,
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
        softcap: Gemma 2 logit cap. sinks: learned attention sinks, one logit per query head, or None.

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
    return finish_decode(scores, attention_mask, tables.future, value, softcap, sinks)
