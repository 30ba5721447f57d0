"""Self-Extend's math: neighbour and grouped attention over rotated q and k (Jin et al. 2024).

For a query at position i and a key at position j (d = i - j): inside the neighbour window W the usual score;
beyond it q is rotated to ``i // G + (W - W // G)`` and k to ``j // G``; the two score matrices are merged
before one softmax. Three ways to compute it, one result:

- :func:`grouped_attention`: scores materialised block by block (eager path, logit caps, dropout, per-row positions);
- :func:`split_grouped_attention`: fused attention calls merged by their log-sum-exp (the SDPA path);
- :func:`self_extend_decode`: a decode step past the window in a fixed handful of kernels.

:mod:`hf_posext.backends.attention.self_extend` picks one per call and installs the method; see its docstring for
the costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention.kernels import (
    StepTables, attention_with_lse, finish_decode, head_groups, probabilities, rotate, rotate_by_factors, rotate_with,
    rotation_factors,
)
from hf_posext.core.deprecation import renamed_keyword

__all__ = [
    "SelfExtendLayerSettings",
    "SCORE_BLOCK_ELEMENTS",
    "SPLIT_QUERY_BLOCK",
    "to_grouped",
    "grouped_attention",
    "split_grouped_attention",
    "self_extend_decode",
    "clear_decode_tables",
]

#: Elements of one block of attention scores (batch x heads x queries x keys), ~256 MB in float32.
SCORE_BLOCK_ELEMENTS = 1 << 26


@dataclass
class SelfExtendLayerSettings:
    """What one attention module needs: its rotary frequencies and the grouping (None: plain attention)."""

    inv_freq: torch.Tensor  # float64, rotary dim / 2 values
    rotary_dim: int
    interleaved: bool  # GPT-J pairs (x0, x1), (x2, x3)...; otherwise rotate_half halves
    group_size: int | None
    neighbor_window: int | None  # W
    mask_kind: str  # "sdpa" (bool or None) or "eager" (additive float)
    scaled: bool = True  # False: a layer type Self-Extend leaves alone (Gemma 3 sliding layers)
    # Keys rotated to grouped positions during generation: (grouped keys, first raw key row, last raw key
    # row, positions). A cached key's grouped rotation never changes, so each decode step rotates only
    # the new keys. Costs one more copy of the key cache per layer.
    grouped_keys: Any = field(default=None, repr=False, compare=False)


# (role, G, W, frequencies, device) -> (cos, sin) float32 tables [N, rotary_dim / 2] of the rotation that
# moves a vector from position p to its grouped position: every layer of a forward pass and every decode
# step reuses them instead of computing trigonometry over the whole KV cache again.
_GROUPED_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _grouped_table(role: str, length: int, group_size: int, neighbor_window: int, inv_freq: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Keyed by values, not identity (a freed tensor's memory may come back holding other frequencies), and by
    # every value: two scalings may differ only in their middle frequencies (YaRN's ramp with other betas).
    key = (role, group_size, neighbor_window, tuple(inv_freq.detach().double().cpu().tolist()), str(device))
    table = _GROUPED_TABLES.get(key)
    if table is None or table[0].shape[0] < length:
        size = 1 << max(10, int(length - 1).bit_length())
        positions = torch.arange(size, dtype=torch.float64)
        grouped = torch.div(positions, group_size, rounding_mode="floor")
        if role == "query":
            grouped = grouped + (neighbor_window - neighbor_window // group_size)
        angles = (grouped - positions)[:, None] * inv_freq.double().cpu()
        table = (angles.cos().float().to(device), angles.sin().float().to(device))
        if len(_GROUPED_TABLES) > 16:
            _GROUPED_TABLES.clear()
        _GROUPED_TABLES[key] = table
    return table


def to_grouped(states, positions, role, group_size, neighbor_window, inv_freq, rotary_dim, interleaved) -> torch.Tensor:
    """Rotate q (``role="query"``) or k to their grouped positions, via a cached table when possible."""
    low, high = int(positions.min()), int(positions.max())
    if low < 0 and role == "query":
        delta = torch.div(positions, group_size, rounding_mode="floor") + (neighbor_window - neighbor_window // group_size) - positions
        return rotate(states, delta, inv_freq, rotary_dim, interleaved)
    # Negative key positions only occur for left padding (masked keys): any rotation will do for them.
    cos, sin = _grouped_table(role, high + 1, group_size, neighbor_window, inv_freq, states.device)
    index = positions.clamp(min=0)
    return rotate_with(states, cos[index][:, None], sin[index][:, None], rotary_dim, interleaved)


def _count_at_most(positions: torch.Tensor, limits: torch.Tensor) -> int:
    """max over rows of #(positions[row] <= limits[row]) for non-decreasing rows."""
    return int(torch.searchsorted(positions, limits[:, None].contiguous(), right=True).max())


def _min_count_at_most(positions: torch.Tensor, limits: torch.Tensor) -> int:
    return int(torch.searchsorted(positions, limits[:, None].contiguous(), right=True).min())


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    group_size: int | None,
    neighbor_window: int | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    block_elements: int = SCORE_BLOCK_ELEMENTS,
    key_grouped: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-Extend attention over rotated q/k: neighbour scores inside ``neighbor_window``, grouped beyond it.

    Args:
        query: ``[batch, heads, q_len, head_dim]``, rotated to ``query_positions``.
        key, value: ``[batch, kv_heads, kv_len, head_dim]``; keys rotated to ``key_positions``.
        attention_mask: ``None`` (causal, aligned to the last key), a bool mask (True = attend) or an
            additive float mask, broadcastable to ``[batch, heads, q_len, kv_len]``.
        query_positions, key_positions: ``[batch, q_len]`` and ``[batch, kv_len]`` integer positions.
        inv_freq, rotary_dim, interleaved: the rotary embedding (see :func:`rotate`).
        group_size, neighbor_window: G and W; ``None`` computes plain attention (``window``: W's old name).
        scaling: score multiplier (default head_dim ** -0.5). softcap: Gemma 2 style logit cap.
        dropout, training: attention dropout, applied when training.
        block_elements: score elements materialised at once (sets the query block size).
        key_grouped: the keys already rotated to their grouped positions, if the caller has them.
        sinks: learned attention sinks, one logit per query head (gpt-oss), or None.

    Returns:
        ``[batch, q_len, heads, head_dim]`` (the layout transformers' attention functions return).
    """
    neighbor_window = renamed_keyword("window", window, "neighbor_window", neighbor_window, None)
    batch, heads, q_len, head_dim = query.shape
    scaling = head_dim ** -0.5 if scaling is None else scaling
    kv_len = key.shape[2]
    groups = head_groups(query, key)  # grouped-query attention: query heads kv*groups .. kv*groups+groups-1 share kv head kv
    query_positions = query_positions.to(key.device).expand(batch, q_len).contiguous()
    key_positions = key_positions.to(key.device).expand(batch, kv_len).contiguous()
    grouped = group_size is not None and neighbor_window is not None and group_size > 1
    if grouped and int((query_positions.max(dim=1).values - key_positions.min(dim=1).values).max()) < neighbor_window:
        grouped = False  # every pair is inside the neighbor_window: plain attention
    query_grouped = None
    if grouped:
        query = query * scaling  # scale once here instead of every score block
        query_grouped = to_grouped(query, query_positions, "query", group_size, neighbor_window, inv_freq, rotary_dim, interleaved)
        if key_grouped is None:
            key_grouped = to_grouped(key, key_positions, "key", group_size, neighbor_window, inv_freq, rotary_dim, interleaved)
    blocks = _ScoreBlocks(query, key, value, attention_mask, query_positions, key_positions, groups,
                          query_grouped, key_grouped if grouped else None, neighbor_window if grouped else None,
                          scaling, softcap, dropout if training else 0.0, sinks)
    block = max(1, min(q_len, block_elements // max(1, batch * heads * kv_len)))
    if grouped:
        block = min(block, max(64, neighbor_window))  # the band of both kinds per block is (block + W) keys wide
    outputs = [blocks.attend(start, min(start + block, q_len)) for start in range(0, q_len, block)]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


@dataclass
class _ScoreBlocks:
    """The tensors of one :func:`grouped_attention` call; :meth:`attend` computes one block of query rows.

    ``query_grouped`` None: plain attention (``query`` not yet scaled); otherwise ``query`` is already scaled and
    ``key_grouped``, ``neighbor_window`` are set. ``dropout``: the probability applied (0 when not training).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    groups: int
    query_grouped: torch.Tensor | None
    key_grouped: torch.Tensor | None
    neighbor_window: int | None
    scaling: float
    softcap: float | None
    dropout: float
    sinks: torch.Tensor | None = None  # one logit per query head (gpt-oss), or None

    def __post_init__(self) -> None:
        kv_len, key_positions = self.key.shape[2], self.key_positions
        self.monotone = bool((key_positions[:, 1:] >= key_positions[:, :-1]).all()) if kv_len > 1 else True
        self.offset = kv_len - self.query.shape[2]

    def per_kv_head(self, states: torch.Tensor) -> torch.Tensor:
        """[batch, heads, rows, dim] -> [batch, kv_heads, groups * rows, dim]: no copy of the keys per head."""
        batch, _, rows, head_dim = states.shape
        return states.reshape(batch, self.key.shape[1], self.groups * rows, head_dim)

    def attend(self, start: int, end: int) -> torch.Tensor:
        """Output rows ``[start, end)``: ``[batch, heads, end - start, head_dim]``."""
        batch, heads, _, head_dim = self.query.shape
        kv_heads, kv_len, groups, rows = self.key.shape[1], self.key.shape[2], self.groups, end - start
        key_positions, grouped = self.key_positions, self.query_grouped is not None
        q_pos = self.query_positions[:, start:end]
        high = _count_at_most(key_positions, q_pos.max(dim=1).values) if self.monotone else kv_len
        high = max(high, min(kv_len, end + self.offset))
        low = _min_count_at_most(key_positions, q_pos.min(dim=1).values - self.neighbor_window) if grouped and self.monotone else 0
        # Keys [0, low) are grouped for every query of the block, [low, high) hold the band where the two
        # kinds meet (and the causal diagonal): grouped scores over all keys, then the band overwritten.
        near = torch.matmul(self.per_kv_head(self.query[:, :, start:end]), self.key[:, :, low:high].transpose(2, 3))
        near = near.view(batch, kv_heads, groups, rows, high - low)
        if not grouped:
            near = near * self.scaling  # the order of transformers' eager attention: identical results
        if self.attention_mask is None:
            # Causal: only keys [start + offset, end + offset) can lie after a query of this block.
            diagonal = near[..., start + self.offset - low:]
            future = torch.ones(rows, diagonal.shape[-1], dtype=torch.bool, device=near.device).triu_(1)
            diagonal.masked_fill_(future, torch.finfo(near.dtype).min)
        if grouped:
            scores = torch.matmul(self.per_kv_head(self.query_grouped[:, :, start:end]), self.key_grouped[:, :, :high].transpose(2, 3))
            scores = scores.view(batch, kv_heads, groups, rows, high)
            distance = q_pos[:, None, None, :, None] - key_positions[:, None, None, None, low:high]
            scores[..., low:high] = torch.where(distance < self.neighbor_window, near, scores[..., low:high])
        else:
            scores = near
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.attention_mask is not None:
            scores = self.masked(scores, start, end, high)
        probs = probabilities(scores, self.sinks).to(self.value.dtype)
        if self.dropout:
            probs = nn.functional.dropout(probs, p=self.dropout, training=True)
        out = torch.matmul(probs.view(batch, kv_heads, groups * rows, high), self.value[:, :, :high])
        return out.view(batch, kv_heads, groups, rows, head_dim).reshape(batch, heads, rows, head_dim)

    def masked(self, scores: torch.Tensor, start: int, end: int, high: int) -> torch.Tensor:
        """``scores`` ``[batch, kv_heads, groups, rows, high]`` with the attention mask applied."""
        attention_mask, batch, heads = self.attention_mask, scores.shape[0], self.query.shape[1]
        mask = attention_mask[..., start:end, :high] if attention_mask.shape[-2] > 1 else attention_mask[..., :high]
        mask = mask.unsqueeze(2)  # [batch, 1 | heads, rows, keys] -> broadcast over the head groups
        if mask.shape[1] == heads and heads != self.key.shape[1]:
            mask = attention_mask[..., start:end, :high].reshape(batch, self.key.shape[1], self.groups, -1, high)
        if mask.dtype == torch.bool:
            return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return scores + mask


#: Queries per block on the split path: each block's masked band is (block + W) keys wide.
SPLIT_QUERY_BLOCK = 512


def split_grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_grouped: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
    group_size: int,
    neighbor_window: int | None = None,
    scaling: float | None = None,
    block: int = SPLIT_QUERY_BLOCK,
    window: int | None = None,
) -> torch.Tensor:
    """Self-Extend attention as fused attention calls merged by their log-sum-exp (same result as
    :func:`grouped_attention`, without materialising the long rows of scores).

    For a block of queries, the keys split into three sets: the neighbour band (exact q and k, keys at
    distance ``0 <= d < W``), the grouped band next to it (grouped q and k, ``d >= W``, masked) and the
    grouped bulk (grouped q and k, keys far enough for every query of the block: no mask). Each set is
    one fused attention call returning its output ``o_s`` and log-sum-exp ``l_s``; the softmax over the
    merged row is ``sum_s o_s * exp(l_s - logsumexp_s l_s)``, exactly (the paper merges the scores before
    one softmax: this is that softmax, taken in pieces).

    Needs the same positions in every batch row, non-decreasing key positions and a bool (or no) mask,
    and is for inference: PyTorch's fused CPU kernel returns the log-sum-exp without differentiating it,
    so gradients through the merge would be wrong. :func:`self_extend_attention` checks all of this and
    otherwise calls :func:`grouped_attention`.

    Args: as :func:`grouped_attention` (``window``: ``neighbor_window``'s old name); ``key_grouped`` are the keys rotated to their grouped positions,
    ``attention_mask`` None or bool broadcastable to ``[batch, heads, q_len, kv_len]``.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    neighbor_window = renamed_keyword("window", window, "neighbor_window", neighbor_window, None)
    batch, heads, q_len, head_dim = query.shape
    scaling = head_dim ** -0.5 if scaling is None else scaling
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q_pos = query_positions.to(key.device).reshape(-1, q_len)[0]
    k_pos = key_positions.to(key.device).reshape(-1, key.shape[2])[0].contiguous()
    query_grouped = to_grouped(query, q_pos[None], "query", group_size, neighbor_window, inv_freq, rotary_dim, interleaved)

    outputs = []
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        rows = q_pos[start:end]
        low_limit, high_limit = rows.min(), rows.max()
        # keys [0, bulk): grouped for every query; [bulk, grouped_end): grouped for some; [bulk, high): neighbours
        bulk, grouped_end, high = (int(i) for i in torch.searchsorted(
            k_pos, torch.stack((low_limit - neighbor_window, high_limit - neighbor_window, high_limit)), right=True))

        def part(q, k, first, last, band):
            distance = rows[:, None] - k_pos[None, first:last]
            mask = None if band is None else band(distance)
            if attention_mask is not None:
                allowed = attention_mask[..., start:end, first:last] if attention_mask.shape[-2] > 1 else attention_mask[..., first:last]
                mask = allowed if mask is None else allowed & mask
            # Grouped-query attention without copying keys per head: the query heads sharing a kv head
            # become extra rows of it (row g * rows + r is head g's query r), and the mask repeats per head.
            q = q[:, :, start:end].reshape(batch, kv_heads, groups * (end - start), head_dim)
            if mask is not None and groups > 1:
                mask = mask.expand(*mask.shape[:-2], end - start, last - first)
                mask = torch.cat([mask] * groups, dim=-2)
            output, lse = attention_with_lse(q, k[:, :, first:last], value[:, :, first:last], mask, scaling)
            return output.reshape(batch, heads, end - start, head_dim), lse.reshape(batch, heads, end - start)

        parts = [part(query, key, bulk, high, lambda d: (d >= 0) & (d < neighbor_window))]
        if grouped_end > bulk:
            parts.append(part(query_grouped, key_grouped, bulk, grouped_end, lambda d: d >= neighbor_window))
        if bulk > 0:
            parts.append(part(query_grouped, key_grouped, 0, bulk, None))
        lse = torch.stack([p[1] for p in parts]).logsumexp(dim=0)
        merged = sum(o.float() * torch.nan_to_num(torch.exp(l - lse), nan=0.0)[..., None] for o, l in parts)
        outputs.append(merged.to(value.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


# --------------------------------------------------------------------------------------------------
# Decode step: a fixed handful of kernels per layer
# --------------------------------------------------------------------------------------------------


@dataclass
class _DecodeTables:
    """What every layer of one decode step shares (built by the first layer, reused by the others).

    Attributes:
        query_cos, query_sin: ``[B', rows, head_dim]`` factors moving a query to its grouped position,
            the score scaling folded in. key_cos, key_sin: ``[B', kv_len, head_dim]`` moving each key to
            its grouped position (see :func:`rotate_by_factors`).
        neighbour: ``[B', rows, kv_len]`` bool, True where the key is inside the neighbor window.
        future: ``[rows, kv_len]`` bool, True for keys after a query (None: one query).
    """

    query_cos: torch.Tensor
    query_sin: torch.Tensor
    key_cos: torch.Tensor
    key_sin: torch.Tensor
    neighbour: torch.Tensor
    future: torch.Tensor | None


#: One decode step's tables, shared by its layers (see :class:`StepTables`).
_DECODE_TABLES = StepTables()


def _decode_tables(query_positions: torch.Tensor, kv_len: int, settings: SelfExtendLayerSettings, head_dim: int, scaling: float) -> _DecodeTables:
    """Build :class:`_DecodeTables` for queries at ``query_positions`` ``[B', rows]`` against ``kv_len``
    consecutive keys ending at the last query (angles in float64, as :func:`_grouped_table`)."""
    device = query_positions.device
    rows = query_positions.shape[-1]
    group_size, neighbor_window = settings.group_size, settings.neighbor_window
    inv_freq = settings.inv_freq.to(device=device, dtype=torch.float64)
    key_positions = query_positions[:, -1:] - torch.arange(kv_len - 1, -1, -1, device=device)
    grouped_query = torch.div(query_positions, group_size, rounding_mode="floor") + (neighbor_window - neighbor_window // group_size)
    # Negative key positions only occur for left padding (masked keys): any rotation will do for them.
    safe_keys = key_positions.clamp(min=0)
    grouped_key = torch.div(safe_keys, group_size, rounding_mode="floor")
    query_angles = (grouped_query - query_positions).to(torch.float64).unsqueeze(-1) * inv_freq
    key_angles = (grouped_key - safe_keys).to(torch.float64).unsqueeze(-1) * inv_freq
    rotary, interleaved = settings.rotary_dim, settings.interleaved
    query_cos, query_sin = rotation_factors(query_angles.cos().float(), query_angles.sin().float(), rotary, head_dim, interleaved, scaling)
    key_cos, key_sin = rotation_factors(key_angles.cos().float(), key_angles.sin().float(), rotary, head_dim, interleaved)
    neighbour = (query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)) < neighbor_window
    future = torch.ones(rows, kv_len, dtype=torch.bool, device=device).triu_(kv_len - rows + 1) if rows > 1 else None
    return _DecodeTables(query_cos, query_sin, key_cos, key_sin, neighbour, future)


def _cached_decode_tables(position_ids, query: torch.Tensor, key: torch.Tensor, settings: SelfExtendLayerSettings, scaling: float) -> _DecodeTables:
    """:func:`_decode_tables` for this call, reused across the layers of one step (same position_ids tensor)."""
    return _DECODE_TABLES.for_call(
        query, key, position_ids, scaling, settings.inv_freq,
        (id(settings.inv_freq), settings.rotary_dim, settings.interleaved, settings.group_size, settings.neighbor_window),
        "Self-Extend", lambda positions, kv_len: _decode_tables(positions, kv_len, settings, query.shape[-1], scaling))


def clear_decode_tables() -> None:
    """Forget the decode-step tables kept for the next layer (benchmarks: time a step's first layer)."""
    _DECODE_TABLES.clear()


def self_extend_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    settings: SelfExtendLayerSettings,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Self-Extend for a few new queries against a long key cache, in a fixed number of kernels.

    The same function as :func:`grouped_attention` (neighbour scores inside the window, grouped beyond,
    merged before one softmax), built for a GPU decode step that is not launch-bound: per layer the query
    is scaled and rotated to its grouped position, every cached key rotated to its grouped position
    (three kernels each, from factors built once per step for all layers), two matmuls, one ``where``
    picking each key's score, one softmax, one matmul with the values. No host synchronisation and no
    check of a kept key copy: the keys are rotated afresh, which costs a few passes over the key cache
    (bandwidth) instead of the reads back to the host that reusing them needs.

    Args:
        query: ``[batch, heads, q_len, head_dim]``. key, value: ``[batch, kv_heads, kv_len, head_dim]``,
            keys rotated to their positions, consecutive up to the last query.
        attention_mask: None (causal), bool (True = attend) or additive float, broadcastable to
            ``[batch, heads, q_len, kv_len]``. position_ids: the queries' positions (None: the last q_len).
        settings: the layer's rotary embedding and grouping (``group_size`` set). scaling: score multiplier.
        softcap: Gemma 2 logit cap.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = head_groups(query, key)
    tables = _cached_decode_tables(position_ids, query, key, settings, scaling)
    # Query heads sharing a kv head become rows of one matmul against it: [B, kv_heads, groups * rows, D].
    query_rows = query.reshape(batch, kv_heads, groups, q_len, head_dim)
    near_query = (query_rows * scaling).reshape(batch, kv_heads, groups * q_len, head_dim)
    geometry = (settings.rotary_dim, settings.interleaved)
    far_query = rotate_by_factors(query_rows, tables.query_cos[:, None, None], tables.query_sin[:, None, None], *geometry)
    far_key = rotate_by_factors(key, tables.key_cos[:, None], tables.key_sin[:, None], *geometry)
    near = torch.matmul(near_query, key.transpose(2, 3)).view(batch, kv_heads, groups, q_len, kv_len)
    far = torch.matmul(far_query.reshape(batch, kv_heads, groups * q_len, head_dim), far_key.transpose(2, 3))
    scores = torch.where(tables.neighbour[:, None, None], near, far.view(batch, kv_heads, groups, q_len, kv_len))
    return finish_decode(scores, attention_mask, tables.future, value, softcap)
