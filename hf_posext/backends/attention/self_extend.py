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
``hf_posext_self_extend_sdpa`` / ``hf_posext_self_extend_eager``; this module keeps the math. q and k
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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention import registration
from hf_posext.backends.attention.kernels import (
    StepTables, attention_with_lse, call_positions, finish_decode, head_groups, rotate, rotate_by_factors, rotate_with,
    rotation_factors,
)
from hf_posext.backends.attention.registration import AttentionLayer, call_settings, find_attention_layers, plain_attention
from hf_posext.core.deprecation import renamed_keyword
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
#: Elements of one block of attention scores (batch x heads x queries x keys), ~256 MB in float32.
SCORE_BLOCK_ELEMENTS = 1 << 26


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
# The attention function
# --------------------------------------------------------------------------------------------------


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


def _to_grouped(states, positions, role, group_size, neighbor_window, inv_freq, rotary_dim, interleaved) -> torch.Tensor:
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

    Returns:
        ``[batch, q_len, heads, head_dim]`` (the layout transformers' attention functions return).
    """
    neighbor_window = renamed_keyword("window", window, "neighbor_window", neighbor_window, None)
    batch, heads, q_len, head_dim = query.shape
    scaling = head_dim ** -0.5 if scaling is None else scaling
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = head_groups(query, key)  # grouped-query attention: query heads kv*groups .. kv*groups+groups-1 share kv head kv
    query_positions = query_positions.to(key.device).expand(batch, q_len).contiguous()
    key_positions = key_positions.to(key.device).expand(batch, kv_len).contiguous()
    grouped = group_size is not None and neighbor_window is not None and group_size > 1
    if grouped and int((query_positions.max(dim=1).values - key_positions.min(dim=1).values).max()) < neighbor_window:
        grouped = False  # every pair is inside the neighbor_window: plain attention
    if grouped:
        query = query * scaling  # scale once here instead of every score block
        query_grouped = _to_grouped(query, query_positions, "query", group_size, neighbor_window, inv_freq, rotary_dim, interleaved)
        if key_grouped is None:
            key_grouped = _to_grouped(key, key_positions, "key", group_size, neighbor_window, inv_freq, rotary_dim, interleaved)
    monotone = bool((key_positions[:, 1:] >= key_positions[:, :-1]).all()) if kv_len > 1 else True
    block = max(1, min(q_len, block_elements // max(1, batch * heads * kv_len)))
    if grouped:
        block = min(block, max(64, neighbor_window))  # the band of both kinds per block is (block + W) keys wide
    offset = kv_len - q_len

    def per_kv_head(states: torch.Tensor) -> torch.Tensor:
        # [batch, heads, rows, dim] -> [batch, kv_heads, groups * rows, dim]: no copy of the keys per head.
        return states.reshape(batch, kv_heads, groups * states.shape[2], head_dim)

    outputs = []
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        rows = end - start
        q_pos = query_positions[:, start:end]
        high = _count_at_most(key_positions, q_pos.max(dim=1).values) if monotone else kv_len
        high = max(high, min(kv_len, end + offset))
        if grouped and monotone:
            low = _min_count_at_most(key_positions, q_pos.min(dim=1).values - neighbor_window)
        else:
            low = 0
        # Keys [0, low) are grouped for every query of the block, [low, high) hold the band where the two
        # kinds meet (and the causal diagonal): grouped scores over all keys, then the band overwritten.
        near = torch.matmul(per_kv_head(query[:, :, start:end]), key[:, :, low:high].transpose(2, 3))
        near = near.view(batch, kv_heads, groups, rows, high - low)
        if not grouped:
            near = near * scaling  # the order of transformers' eager attention: identical results
        if attention_mask is None:
            # Causal: only keys [start + offset, end + offset) can lie after a query of this block.
            first = start + offset - low
            diagonal = near[..., first:]
            future = torch.ones(rows, diagonal.shape[-1], dtype=torch.bool, device=near.device).triu_(1)
            diagonal.masked_fill_(future, torch.finfo(near.dtype).min)
        if grouped:
            scores = torch.matmul(per_kv_head(query_grouped[:, :, start:end]), key_grouped[:, :, :high].transpose(2, 3))
            scores = scores.view(batch, kv_heads, groups, rows, high)
            distance = q_pos[:, None, None, :, None] - key_positions[:, None, None, None, low:high]
            scores[..., low:high] = torch.where(distance < neighbor_window, near, scores[..., low:high])
        else:
            scores = near
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            mask = attention_mask[..., start:end, :high] if attention_mask.shape[-2] > 1 else attention_mask[..., :high]
            mask = mask.unsqueeze(2)  # [batch, 1 | heads, rows, keys] -> broadcast over the head groups
            if mask.shape[1] == heads and heads != kv_heads:
                mask = attention_mask[..., start:end, :high].reshape(batch, kv_heads, groups, -1, high)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        if dropout and training:
            probs = nn.functional.dropout(probs, p=dropout, training=True)
        out = torch.matmul(probs.view(batch, kv_heads, groups * rows, high), value[:, :, :high])
        outputs.append(out.view(batch, kv_heads, groups, rows, head_dim).reshape(batch, heads, rows, head_dim))
        del scores, probs, near
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


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
    query_grouped = _to_grouped(query, q_pos[None], "query", group_size, neighbor_window, inv_freq, rotary_dim, interleaved)

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

#: Calls with at most this many queries (decoding) take :func:`self_extend_decode`.
DECODE_QUERIES = 16
#: Device types whose decode steps take :func:`self_extend_decode`. Not the CPU: there a step is not
#: launch-bound, host reads are free, and rotating every cached key again costs about twice what
#: reusing the kept rotated keys costs (``bench/results/self_extend_decode_cpu.json``).
DECODE_DEVICES = ("cuda", "xpu", "mps")


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
    :func:`split_grouped_attention` where it applies, else :func:`grouped_attention`. Attention weights
    are not returned.
    """
    settings: SelfExtendLayerSettings
    settings, scaling = call_settings(module, query, scaling, kwargs, attribute=_LAYER_ATTRIBUTE, title="Self-Extend", method="self-extend")
    softcap = kwargs.get("softcap")
    q_len, kv_len = query.shape[2], key.shape[2]
    if (query.device.type in DECODE_DEVICES and settings.group_size is not None and settings.group_size > 1
            and q_len <= DECODE_QUERIES and kv_len > settings.neighbor_window and not (dropout and module.training)):
        return self_extend_decode(query, key, value, attention_mask, kwargs.get("position_ids"), settings, scaling, softcap), None
    query_positions, key_positions = call_positions(query, key, kwargs.get("position_ids"), "Self-Extend")
    plain = settings.group_size is None or settings.group_size == 1 or int(
        (query_positions.max() - key_positions.min())
    ) < settings.neighbor_window
    if plain and settings.mask_kind == "sdpa" and softcap is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    key_grouped = None if plain else _grouped_keys(settings, key, key_positions, query.shape[2])
    if not plain and _can_split(settings, attention_mask, query_positions, key_positions, softcap, dropout, module, (query, key, value)):
        output = split_grouped_attention(
            query, key, value, key_grouped, attention_mask, query_positions, key_positions,
            settings.inv_freq, settings.rotary_dim, settings.interleaved, settings.group_size, settings.neighbor_window, scaling,
        )
        return output, None
    output = grouped_attention(
        query, key, value, attention_mask, query_positions, key_positions,
        settings.inv_freq, settings.rotary_dim, settings.interleaved,
        None if plain else settings.group_size, None if plain else settings.neighbor_window,
        scaling, softcap=softcap, dropout=dropout, training=module.training, key_grouped=key_grouped,
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
        return _to_grouped(part, positions, "key", settings.group_size, settings.neighbor_window, settings.inv_freq,
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
