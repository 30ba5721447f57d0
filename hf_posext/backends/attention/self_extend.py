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

How it hooks into transformers: through the public attention-function registry
(``transformers.AttentionInterface`` and, for the mask, ``transformers.masking_utils.AttentionMaskInterface``),
never by replacing attention classes. Attention modules of transformers 5.x rotate q and k and then
call the function registered under ``config._attn_implementation``; we register ours under
``hf_posext_self_extend_sdpa`` / ``hf_posext_self_extend_eager`` (matching the mask convention of the
implementation the model used before) and select it with ``model.set_attn_implementation``. q and k
arrive rotated to their true positions; RoPE rotations compose, so rotating them again by
``R(p' - p)`` moves them to the grouped position p'. Each attention module gets the frequencies of the
rotary module that feeds it (found and verified by :func:`hf_posext.backends.rope.sites.find_rotary_sites`), and a
probe at patch time checks that the q and k reaching the registry really are rotated that way.

Cost (say it plainly): inside the window nothing changes (the SDPA path even calls transformers' SDPA
function). Past the window, on the SDPA path (the default), each query block runs up to three fused
attention calls (neighbour band, grouped band, grouped bulk) and merges them by their log-sum-exp
(:func:`split_grouped_attention`): the extra work is the re-rotation of q and k, a second pass over a
band of about W + 512 keys, and the masks of the two bands. On the eager path, or with a logit cap,
training dropout or per-row positions (a left-padded batch), the scores are materialised block by block
instead (:func:`grouped_attention`), about what eager attention costs. During generation each layer
keeps its keys rotated to grouped positions (one more copy of the key cache) so a decode step rotates
only the new key. ``bench/self_extend_cost.py`` measures it (docs/beyond_rescaling.md).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext.core.loading import config_kwargs, model_class_for
from hf_posext.core.record import CONFIG_KEY, make_record, restore_config, snapshot_config

from hf_posext.methods.attention import check_neighbor_window, default_neighbor_window, max_extended_length, size_for_target
from hf_posext.methods.registry import get_method

__all__ = [
    "METHOD_NAMES",
    "SelfExtendSettings",
    "max_extended_length",
    "size_for_target",
    "grouped_attention",
    "split_grouped_attention",
    "self_extend_attention",
    "is_patched",
    "patch_self_extend",
    "unpatch_self_extend",
    "describe_self_extend",
    "load_self_extend",
    "rotate_with",
    "attention_with_lse",
    "AttentionLayer",
    "find_attention_layers",
]

#: Method names :func:`hf_posext.patch` routes here.
METHOD_NAMES = {"self-extend"}

#: Registry names of our attention functions, keyed by the mask convention they expect.
IMPLEMENTATIONS = {"sdpa": "hf_posext_self_extend_sdpa", "eager": "hf_posext_self_extend_eager"}
_PROBE_IMPLEMENTATION = "hf_posext_self_extend_probe"
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
class _LayerSettings:
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


def rotate(states: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """Rotate already-rotated RoPE vectors by ``delta`` more positions.

    Args:
        states: ``[batch, heads, tokens, head_dim]``; the first ``rotary_dim`` channels are rotary.
        delta: ``[batch, tokens]`` position offsets (integers; may be negative).
        inv_freq: the rotary module's inverse frequencies (``rotary_dim / 2`` values).
        rotary_dim: channels that carry RoPE (partial rotary models rotate only these).
        interleaved: GPT-J layout (pairs of neighbouring channels) instead of rotate_half halves.

    Returns:
        The rotated tensor, same shape and dtype. Angles are computed in float64 so the extra rotation
        adds no error of its own at long positions.
    """
    angles = delta.to(device=states.device, dtype=torch.float64)[:, None, :, None] * inv_freq.to(device=states.device, dtype=torch.float64)
    return _rotate_with(states, angles.cos(), angles.sin(), rotary_dim, interleaved)


# (role, G, W, frequencies, device) -> (cos, sin) float32 tables [N, rotary_dim / 2] of the rotation that
# moves a vector from position p to its grouped position: every layer of a forward pass and every decode
# step reuses them instead of computing trigonometry over the whole KV cache again.
_GROUPED_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _grouped_table(role: str, length: int, group_size: int, window: int, inv_freq: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    # Keyed by values, not identity: a freed tensor's memory may come back holding other frequencies.
    key = (role, group_size, window, inv_freq.numel(), float(inv_freq[-1]), float(inv_freq[min(1, inv_freq.numel() - 1)]), str(device))
    table = _GROUPED_TABLES.get(key)
    if table is None or table[0].shape[0] < length:
        size = 1 << max(10, int(length - 1).bit_length())
        positions = torch.arange(size, dtype=torch.float64)
        grouped = torch.div(positions, group_size, rounding_mode="floor")
        if role == "query":
            grouped = grouped + (window - window // group_size)
        angles = (grouped - positions)[:, None] * inv_freq.double().cpu()
        table = (angles.cos().float().to(device), angles.sin().float().to(device))
        if len(_GROUPED_TABLES) > 16:
            _GROUPED_TABLES.clear()
        _GROUPED_TABLES[key] = table
    return table


def _to_grouped(states, positions, role, group_size, window, inv_freq, rotary_dim, interleaved) -> torch.Tensor:
    """Rotate q (``role="query"``) or k to their grouped positions, via a cached table when possible."""
    low, high = int(positions.min()), int(positions.max())
    if low < 0 and role == "query":
        delta = torch.div(positions, group_size, rounding_mode="floor") + (window - window // group_size) - positions
        return rotate(states, delta, inv_freq, rotary_dim, interleaved)
    # Negative key positions only occur for left padding (masked keys): any rotation will do for them.
    cos, sin = _grouped_table(role, high + 1, group_size, window, inv_freq, states.device)
    index = positions.clamp(min=0)
    return _rotate_with(states, cos[index][:, None], sin[index][:, None], rotary_dim, interleaved)


def rotate_with(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """Rotate RoPE vectors by the angles whose cosines and sines are given (``rotary_dim / 2`` each,
    broadcastable to ``states[..., :rotary_dim / 2]``); channels past ``rotary_dim`` pass through."""
    work = torch.float32 if states.dtype in (torch.float16, torch.bfloat16) else states.dtype
    cos, sin = cos.to(work), sin.to(work)
    rot = states[..., :rotary_dim].to(work)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rotary_dim == states.shape[-1]:
        return rotated.to(states.dtype)
    return torch.cat((rotated.to(states.dtype), states[..., rotary_dim:]), dim=-1)


_rotate_with = rotate_with


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
    window: int | None,
    scaling: float,
    softcap: float | None = None,
    dropout: float = 0.0,
    training: bool = False,
    block_elements: int = SCORE_BLOCK_ELEMENTS,
    key_grouped: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-Extend attention over rotated q/k: neighbour scores inside ``window``, grouped beyond it.

    Args:
        query: ``[batch, heads, q_len, head_dim]``, rotated to ``query_positions``.
        key, value: ``[batch, kv_heads, kv_len, head_dim]``; keys rotated to ``key_positions``.
        attention_mask: ``None`` (causal, aligned to the last key), a bool mask (True = attend) or an
            additive float mask, broadcastable to ``[batch, heads, q_len, kv_len]``.
        query_positions, key_positions: ``[batch, q_len]`` and ``[batch, kv_len]`` integer positions.
        inv_freq, rotary_dim, interleaved: the rotary embedding (see :func:`rotate`).
        group_size, window: G and W; ``None`` computes plain attention.
        scaling: score multiplier (usually head_dim ** -0.5). softcap: Gemma 2 style logit cap.
        dropout, training: attention dropout, applied when training.
        block_elements: score elements materialised at once (sets the query block size).
        key_grouped: the keys already rotated to their grouped positions, if the caller has them.

    Returns:
        ``[batch, q_len, heads, head_dim]`` (the layout transformers' attention functions return).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly.")
    groups = heads // kv_heads  # grouped-query attention: query heads kv*groups .. kv*groups+groups-1 share kv head kv
    query_positions = query_positions.to(key.device).expand(batch, q_len).contiguous()
    key_positions = key_positions.to(key.device).expand(batch, kv_len).contiguous()
    grouped = group_size is not None and window is not None and group_size > 1
    if grouped and int((query_positions.max(dim=1).values - key_positions.min(dim=1).values).max()) < window:
        grouped = False  # every pair is inside the window: plain attention
    if grouped:
        query = query * scaling  # scale once here instead of every score block
        query_grouped = _to_grouped(query, query_positions, "query", group_size, window, inv_freq, rotary_dim, interleaved)
        if key_grouped is None:
            key_grouped = _to_grouped(key, key_positions, "key", group_size, window, inv_freq, rotary_dim, interleaved)
    monotone = bool((key_positions[:, 1:] >= key_positions[:, :-1]).all()) if kv_len > 1 else True
    block = max(1, min(q_len, block_elements // max(1, batch * heads * kv_len)))
    if grouped:
        block = min(block, max(64, window))  # the band of both kinds per block is (block + W) keys wide
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
            low = _min_count_at_most(key_positions, q_pos.min(dim=1).values - window)
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
            scores[..., low:high] = torch.where(distance < window, near, scores[..., low:high])
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


def attention_with_lse(query, key, value, mask, scaling, is_causal=False):
    """Attention output and log-sum-exp of its scores: ``([B, H, q, D], [B, H, q])``.

    ``mask`` is None or a bool tensor broadcastable to ``[B, H, q, k]`` (True = attend); ``is_causal``
    (with no mask) lets query r see keys 0..r (top-left aligned). On CPU it calls
    PyTorch's fused flash-attention kernel, the one ``scaled_dot_product_attention`` itself dispatches to,
    which also returns the log-sum-exp; elsewhere it computes the same two tensors explicitly. Rows with
    no key to attend give output 0 and log-sum-exp -inf.
    """
    if query.device.type == "cuda" and mask is None:
        fused = _cuda_attention_with_lse(query, key, value, scaling, is_causal)
        if fused is not None:
            return fused
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None and query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16):
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
        output, lse = flash(query, key, value, 0.0, is_causal and mask is None, attn_mask=bias, scale=scaling)[:2]
        lse = lse.to(torch.float32)
        if mask is not None:  # the kernel leaves rows without any key undefined: make them empty
            empty = ~mask.any(dim=-1)
            output = output.masked_fill(empty[..., None], 0.0)
            lse = lse.masked_fill(empty, float("-inf"))
        return output, lse
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    if is_causal and mask is None:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril_()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0).to(value.dtype)
    return torch.matmul(probs, value), lse


def _cuda_attention_with_lse(query, key, value, scaling, is_causal):
    """PyTorch's memory-efficient CUDA attention kernel (one of those ``scaled_dot_product_attention``
    dispatches to), which also returns the log-sum-exp, for every dtype: one kernel, so that the float32
    device check (bench/gpu_checks.py) covers the half-precision runs too. None when it does not take
    these inputs (the caller then computes the scores explicitly)."""
    q_len = query.shape[2]
    try:
        result = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0, is_causal, scale=scaling)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    output, lse = result[0], result[1]
    if output.shape != query.shape[:3] + value.shape[-1:] or lse.shape[:2] != query.shape[:2] or lse.shape[-1] < q_len:
        return None
    return output, lse[..., :q_len].float()


_attention_with_lse = attention_with_lse


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
    window: int,
    scaling: float,
    block: int = SPLIT_QUERY_BLOCK,
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

    Args: as :func:`grouped_attention`; ``key_grouped`` are the keys rotated to their grouped positions,
    ``attention_mask`` None or bool broadcastable to ``[batch, heads, q_len, kv_len]``.

    Returns:
        ``[batch, q_len, heads, head_dim]``.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q_pos = query_positions.to(key.device).reshape(-1, q_len)[0]
    k_pos = key_positions.to(key.device).reshape(-1, key.shape[2])[0].contiguous()
    query_grouped = _to_grouped(query, q_pos[None], "query", group_size, window, inv_freq, rotary_dim, interleaved)

    outputs = []
    for start in range(0, q_len, block):
        end = min(start + block, q_len)
        rows = q_pos[start:end]
        low_limit, high_limit = rows.min(), rows.max()
        # keys [0, bulk): grouped for every query; [bulk, grouped_end): grouped for some; [bulk, high): neighbours
        bulk, grouped_end, high = (int(i) for i in torch.searchsorted(
            k_pos, torch.stack((low_limit - window, high_limit - window, high_limit)), right=True))

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
            output, lse = _attention_with_lse(q, k[:, :, first:last], value[:, :, first:last], mask, scaling)
            return output.reshape(batch, heads, end - start, head_dim), lse.reshape(batch, heads, end - start)

        parts = [part(query, key, bulk, high, lambda d: (d >= 0) & (d < window))]
        if grouped_end > bulk:
            parts.append(part(query_grouped, key_grouped, bulk, grouped_end, lambda d: d >= window))
        if bulk > 0:
            parts.append(part(query_grouped, key_grouped, 0, bulk, None))
        lse = torch.stack([p[1] for p in parts]).logsumexp(dim=0)
        merged = sum(o.float() * torch.nan_to_num(torch.exp(l - lse), nan=0.0)[..., None] for o, l in parts)
        outputs.append(merged.to(value.dtype))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _positions(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key positions: ``position_ids`` for the queries; keys contiguous up to the last query."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if position_ids is None:
        query_positions = torch.arange(kv_len - q_len, kv_len, device=query.device)[None, :]
    else:
        query_positions = position_ids.to(query.device).long()
        if query_positions.dim() == 1:
            query_positions = query_positions[None, :]
        if query_positions.shape[-1] != q_len:  # e.g. packed multimodal position ids: not ours to guess
            raise ValueError(
                f"Self-Extend got position_ids of shape {tuple(position_ids.shape)} for {q_len} queries; it needs "
                "one position per query token."
            )
    if kv_len == q_len:
        return query_positions, query_positions
    # With a KV cache the keys are the earlier tokens followed by the new ones, consecutive positions.
    last = query_positions[:, -1:]
    key_positions = last - torch.arange(kv_len - 1, -1, -1, device=query.device)[None, :]
    return query_positions, key_positions


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
    (transformers' own SDPA function on the SDPA path). Attention weights are not returned.
    """
    settings: _LayerSettings | None = getattr(module, _LAYER_ATTRIBUTE, None)
    if settings is None:
        raise RuntimeError(
            f"{type(module).__name__} is set to Self-Extend attention but carries no Self-Extend settings "
            "(was the model copied or its config edited by hand?). Call hf_posext.patch(model, 'self-extend', ...) again."
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError("Self-Extend does not support attention sinks (s_aux); unpatch this model.")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    query_positions, key_positions = _positions(query, key, kwargs.get("position_ids"))
    plain = settings.group_size is None or settings.group_size == 1 or int(
        (query_positions.max() - key_positions.min())
    ) < settings.neighbor_window
    if plain and settings.mask_kind == "sdpa" and softcap is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
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


def _grouped_keys(settings: _LayerSettings, key: torch.Tensor, key_positions: torch.Tensor, q_len: int) -> torch.Tensor:
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


_REGISTERED = False


def _register() -> None:
    """Register our attention functions and their mask builders (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(IMPLEMENTATIONS["sdpa"], self_extend_attention)
    AttentionInterface.register(IMPLEMENTATIONS["eager"], self_extend_attention)
    AttentionMaskInterface.register(IMPLEMENTATIONS["sdpa"], sdpa_mask)
    AttentionMaskInterface.register(IMPLEMENTATIONS["eager"], eager_mask)
    AttentionInterface.register(_PROBE_IMPLEMENTATION, _probe_attention)
    AttentionMaskInterface.register(_PROBE_IMPLEMENTATION, sdpa_mask)
    _REGISTERED = True


# --------------------------------------------------------------------------------------------------
# Probe: does attention go through the registry, with q/k rotated as the rotary module says?
# --------------------------------------------------------------------------------------------------

_PROBE_RECORD: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] | None = None


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _PROBE_RECORD is not None:
        _PROBE_RECORD.append((module, query.detach().float().clone(), key.detach().float().clone()))
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _record_attention(model: nn.Module, positions: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    global _PROBE_RECORD
    device = next(model.parameters()).device
    ids = (torch.arange(positions.shape[1]) % max(2, int(getattr(model.config, "vocab_size", 2) or 2))).to(device)[None]
    _PROBE_RECORD = []
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions.to(device), use_cache=False)
        return _PROBE_RECORD
    finally:
        _PROBE_RECORD = None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    scale = max(float(b.abs().max()), 1e-6)
    return float((a - b).abs().max()) <= tol * scale


def _probe(model: nn.Module, layer_settings: dict[str, _LayerSettings], names: dict[int, str], label: str = "Self-Extend") -> list[nn.Module]:
    """Check, with two tiny forwards, that every attention call goes through the registry with q/k
    rotated by the frequencies we found; returns the attention modules. Restores the model."""
    original = model.config._attn_implementation
    was_training = model.training
    model.eval()
    length, shift = 6, 5
    try:
        model.set_attn_implementation(_PROBE_IMPLEMENTATION)
        if model.config._attn_implementation != _PROBE_IMPLEMENTATION:
            raise ValueError("set_attn_implementation had no effect")
        first = _record_attention(model, torch.arange(length)[None])
        second = _record_attention(model, torch.arange(length)[None] + shift)
    except Exception as error:
        raise _unsupported(model, label=label, reason=f"its attention could not be routed through transformers' AttentionInterface ({error})") from error
    finally:
        model.set_attn_implementation(original)
        model.train(was_training)
    if not first or len(first) != len(second):
        raise _unsupported(model, label=label, reason="its attention modules do not call the AttentionInterface registry")
    modules = []
    dtype = next(model.parameters()).dtype
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    checked_types = set()
    for (module, q1, k1), (module2, q2, k2) in zip(first, second):
        if module is not module2:
            raise _unsupported(model, label=label, reason="its attention modules are called in a different order on each forward")
        if id(module) not in names:
            raise _unsupported(model, label=label, reason=f"an attention call came from {type(module).__name__}, which is not a submodule")
        if module not in modules:
            modules.append(module)
        settings = layer_settings.get(names[id(module)])
        if settings is None or settings.group_size is None:
            continue
        kind = (float(settings.inv_freq[0]), settings.rotary_dim)
        if kind in checked_types:
            continue  # one layer per rotary embedding: later layers see only float drift
        checked_types.add(kind)
        delta = torch.full((1, length), shift)
        for name, before, after in (("queries", q1, q2), ("keys", k1, k2)):
            moved = rotate(before, delta, settings.inv_freq, settings.rotary_dim, settings.interleaved)
            if not _close(moved, after, tol):
                raise _unsupported(
                    model, label=label, reason=                    f"the {name} reaching attention in {names[id(module)]} are not rotated the way its rotary "
                    f"module describes (rotary dim {settings.rotary_dim}, "
                    f"{'interleaved' if settings.interleaved else 'rotate_half'} layout)",
                )
    return modules


def _unsupported(model: nn.Module, reason: str, label: str = "Self-Extend") -> ValueError:
    from hf_posext.core.errors import UnsupportedModelError

    return UnsupportedModelError(
        f"{label} cannot be applied to {type(model).__name__}: {reason}. It needs a RoPE model whose "
        "attention modules call transformers' attention-function registry with rotated q and k (Llama, "
        "Mistral, Qwen, Gemma, Phi, GPT-NeoX, GPT-J... in transformers 5.x); use a frequency method such "
        "as 'yarn' for this model."
    )


# --------------------------------------------------------------------------------------------------
# patch / unpatch / describe / load
# --------------------------------------------------------------------------------------------------


@dataclass
class _State:
    settings: SelfExtendSettings
    base_implementation: str
    modules: list[tuple[str, nn.Module]]
    config_snapshot: dict[str, Any]
    swapped_sites: list[Any]


def is_patched(model: nn.Module) -> bool:
    """True when ``model`` runs Self-Extend attention installed by :func:`patch_self_extend`."""
    return isinstance(model, nn.Module) and _STATE_ATTRIBUTE in model.__dict__


def current_settings(model: nn.Module) -> SelfExtendSettings:
    """G, W and L of a model patched with Self-Extend."""
    return model.__dict__[_STATE_ATTRIBUTE].settings


def _layer_type(model: nn.Module, module: nn.Module) -> str | None:
    layer_types = getattr(model.config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types and isinstance(index, int) and 0 <= index < len(layer_types):
        return layer_types[index]
    return None


def _parse_params(params: dict[str, Any]) -> dict[str, Any]:
    method = get_method("self-extend", "attention")
    method.parse_params(params)  # names and types, with "did you mean"
    return method.canonical_params(params)


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


def _layer_settings(model: nn.Module, settings: SelfExtendSettings, mask_kind: str, label: str = "Self-Extend") -> tuple[dict[str, _LayerSettings], dict[int, str], list]:
    """Settings per attention-module path, from the verified rotary sites."""
    from hf_posext.backends.rope.sites import find_rotary_sites
    from hf_posext.methods.rope import RotaryBase

    sites = find_rotary_sites(model)
    main = next(site for site in sites if site.scaled_layer_types)
    frequencies = {}
    for layer_type, dim in main.dims.items():
        current = main.current[layer_type]
        if current.spec.dynamic:
            raise ValueError(
                f"The model's own rotary embedding is dynamic ({current.method}): its frequencies change with the "
                f"sequence length, so {label} cannot re-rotate cached keys consistently. Load the model with a "
                "static rope_type (or unscaled) before applying Self-Extend."
            )
        inv_freq, _ = current.spec.compute(
            RotaryBase(main.bases[layer_type], dim), current.original_max_position_embeddings, current.factor, None,
            current.parsed_params,
        )
        frequencies[layer_type] = (inv_freq.double().cpu(), dim, layer_type in main.scaled_layer_types)
    interleaved = main.layout == "sin_cos_half"
    per_module = {}
    names = {}
    for path, module in model.named_modules():
        names[id(module)] = path
        if not hasattr(module, "layer_idx"):
            continue
        layer_type = _layer_type(model, module) if len(frequencies) > 1 else next(iter(frequencies))
        if layer_type not in frequencies:
            continue
        inv_freq, dim, scaled = frequencies[layer_type]
        per_module[path] = _LayerSettings(
            inv_freq, dim, interleaved, settings.group_size if scaled else None, settings.neighbor_window if scaled else None,
            mask_kind, scaled,
        )
    # A fixed sin/cos table (GPT-J's embed_positions) stops at the original window; Self-Extend keeps
    # true positions, so those modules are swapped for our identical, length-free rotary module.
    tables = [site for site in sites if site.layout == "sin_cos_half"]
    return per_module, names, tables


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module an attention-level method drives, with the rotary embedding that feeds it.

    Attributes:
        path: the module's name in the model. module: the attention module.
        inv_freq: its rotary inverse frequencies (float64, CPU). rotary_dim: channels carrying RoPE.
        interleaved: GPT-J pair layout instead of rotate_half halves.
        scaled: False for a layer type the method leaves alone (Gemma 3 sliding-window layers).
    """

    path: str
    module: nn.Module
    inv_freq: torch.Tensor
    rotary_dim: int
    interleaved: bool
    scaled: bool


def find_attention_layers(model: nn.Module, label: str) -> tuple[list[AttentionLayer], list[tuple[Any, nn.Module]]]:
    """The attention modules of a RoPE model, verified by a probe, for an attention-level method (read-only).

    Args:
        model: the model. label: the method's name for error messages (e.g. ``"Dual Chunk Attention"``).

    Returns:
        The layers, and ``(rotary site, replacement module)`` pairs for fixed sin/cos tables (GPT-J) that
        stop at the original window and must be swapped for a length-free rotary module.

    Raises:
        UnsupportedModelError: attention bypasses transformers' registry, or q/k are not rotated the
            way the model's rotary module says. ValueError: a dynamic rotary embedding.
    """
    from hf_posext.backends.rope.sites import build_rotary_module, find_rotary_sites
    from hf_posext.core.request import ScalingConfig

    sites = find_rotary_sites(model)
    main = next(site for site in sites if site.scaled_layer_types)
    original = main.current[main.scaled_layer_types[0]].original_max_position_embeddings
    _register()  # the probe's attention function
    layer_settings, names, tables = _layer_settings(model, SelfExtendSettings(2, 1, max(2, original)), "sdpa", label)
    modules = _probe(model, layer_settings, names, label)
    missing = [names[id(m)] for m in modules if names[id(m)] not in layer_settings]
    if missing:
        raise _unsupported(model, f"no rotary settings for attention module(s) {', '.join(missing[:3])}", label)
    layers = []
    for module in modules:
        path = names[id(module)]
        settings = layer_settings[path]
        layers.append(AttentionLayer(path, module, settings.inv_freq, settings.rotary_dim, settings.interleaved, settings.scaled))
    swaps = []
    for site in tables:
        window = site.current[site.scaled_layer_types[0]].original_max_position_embeddings
        swaps.append((site, build_rotary_module(site, ScalingConfig("none", 1.0, window))))
    return layers, swaps


def patch_self_extend(
    model: nn.Module,
    method: str,
    factor: float | None = None,
    *,
    target_length: int | None = None,
    original_max_position_embeddings: int | None = None,
    **params: Any,
) -> nn.Module:
    """Install Self-Extend attention (use :func:`hf_posext.patch`, which routes here).

    Args:
        model: a RoPE causal LM whose attention uses transformers' attention registry (5.x models).
        method: ``"self-extend"``.
        factor: extension factor s; G is then chosen so that ``L * s`` tokens fit (neighbor window default L/4).
        target_length: the length to reach instead of ``factor``.
        original_max_position_embeddings: override the pre-training window L read from the config.
        **params: ``group_size`` (G) and ``neighbor_window`` (W; ``window`` is its old name). With neither ``factor`` nor ``target_length``,
            ``group_size`` is required.

    Returns:
        The same model. Patching again replaces the previous settings (never compounds).

    Raises:
        ValueError: unknown parameter, bad G / W / factor, a G too small for the requested length, a
            model whose attention bypasses the registry or whose rotary embedding is dynamic. The model
            is unchanged in every case.

    Example:
        >>> hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=2048)
        >>> hf_posext.patch(model, "self-extend", target_length=32768)  # G, W by the paper's rule
    """
    from hf_posext.backends.rope.sites import find_rotary_sites

    if not isinstance(method, str) or method.strip().lower().replace("_", "-") not in METHOD_NAMES:
        raise ValueError(f"patch_self_extend handles {sorted(METHOD_NAMES)}, got {method!r}.")
    if "_hf_posext_state" in model.__dict__:
        raise ValueError("The model carries a frequency scaling; call hf_posext.unpatch(model) first (hf_posext.patch does).")
    params = _parse_params(dict(params))
    previous: _State | None = model.__dict__.get(_STATE_ATTRIBUTE)
    if original_max_position_embeddings is not None:
        original_length = _check_int("original_max_position_embeddings", original_max_position_embeddings, 2)
    elif previous is not None:
        original_length = previous.settings.original_max_position_embeddings
    else:
        sites = find_rotary_sites(model)
        main = next(site for site in sites if site.scaled_layer_types)
        original_length = main.current[main.scaled_layer_types[0]].original_max_position_embeddings
    settings = _resolve_settings(factor, target_length, original_length, params.get("group_size"), params.get("neighbor_window"))

    if previous is not None:
        # Same model, new G / W: update the settings in place (never compound, nothing to re-verify).
        for _, module in previous.modules:
            layer = getattr(module, _LAYER_ATTRIBUTE)
            if layer.scaled:
                setattr(module, _LAYER_ATTRIBUTE, dataclasses.replace(
                    layer, group_size=settings.group_size, neighbor_window=settings.neighbor_window, grouped_keys=None))
        previous.settings = settings
        setattr(model.config, CONFIG_KEY, _record(settings, previous.base_implementation))
        return model

    base = model.config._attn_implementation or "eager"
    mask_kind = "eager" if base == "eager" else "sdpa"
    _register()
    # Everything below only reads the model (the probe restores the attention implementation it sets).
    layer_settings, names, tables = _layer_settings(model, settings, mask_kind)
    modules = _probe(model, layer_settings, names)
    missing = [names[id(m)] for m in modules if names[id(m)] not in layer_settings]
    if missing:
        raise _unsupported(model, f"no rotary settings for attention module(s) {', '.join(missing[:3])}")
    swaps = []
    for site in tables:
        from hf_posext.core.request import ScalingConfig
        from hf_posext.backends.rope.sites import build_rotary_module

        window = site.current[site.scaled_layer_types[0]].original_max_position_embeddings
        swaps.append((site, build_rotary_module(site, ScalingConfig("none", 1.0, window))))

    config = model.config
    snapshot = snapshot_config(config, ("_attn_implementation_internal", CONFIG_KEY))
    model.set_attn_implementation(IMPLEMENTATIONS[mask_kind])
    installed = [(names[id(m)], m) for m in modules]
    for path, module in installed:
        setattr(module, _LAYER_ATTRIBUTE, layer_settings[path])
    for site, replacement in swaps:
        setattr(site.parent, site.attribute, replacement)
    setattr(config, CONFIG_KEY, _record(settings, base))
    model.__dict__[_STATE_ATTRIBUTE] = _State(settings, base, installed, snapshot, [site for site, _ in swaps])
    return model


def _record(settings: SelfExtendSettings, base: str) -> dict[str, Any]:
    """What ``config.hf_posext`` holds for a Self-Extend model (``save_pretrained`` writes it)."""
    return make_record(
        "attention", "self-extend", settings.factor, settings.original_max_position_embeddings,
        {"group_size": settings.group_size, "neighbor_window": settings.neighbor_window}, attn_implementation=base,
    )


def unpatch_self_extend(model: nn.Module) -> nn.Module:
    """Remove Self-Extend: the original attention implementation and config fields, exactly.

    Raises:
        ValueError: the model is not patched with Self-Extend.
    """
    state: _State | None = model.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        raise ValueError("This model is not patched with Self-Extend (nothing to unpatch).")
    model.set_attn_implementation(state.base_implementation)
    for _, module in state.modules:
        module.__dict__.pop(_LAYER_ATTRIBUTE, None)
    for site in state.swapped_sites:
        setattr(site.parent, site.attribute, site.module)
    restore_config(model.config, state.config_snapshot)
    del model.__dict__[_STATE_ATTRIBUTE]
    return model


def _site_pattern(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", path) for path in paths))


def describe_self_extend(model: nn.Module):
    """A :class:`~hf_posext.backends.rope.surgery.ScalingReport` of kind ``"attention"`` for a Self-Extend model."""
    from hf_posext.core.record import ScalingReport

    state: _State = model.__dict__[_STATE_ATTRIBUTE]
    settings = state.settings
    grouped = [path for path, module in state.modules if getattr(module, _LAYER_ATTRIBUTE).group_size]
    notes = [
        f"relative distances < {settings.neighbor_window} exact; beyond, positions // {settings.group_size} shifted by "
        f"{settings.neighbor_window - settings.neighbor_window // settings.group_size}",
        "cost: past the window, scores are computed explicitly in blocks (no fused SDPA kernel) plus a band of "
        "neighbour scores and a re-rotation of q and k (see bench/self_extend_cost.py)",
    ]
    if state.swapped_sites:
        notes.append("fixed sin/cos table replaced by an identical rotary module without a length limit")
    if len(grouped) != len(state.modules):
        notes.append(f"grouped in {len(grouped)} of {len(state.modules)} attention layers (others: sliding window)")
    return ScalingReport(
        family=getattr(model.config, "model_type", type(model).__name__),
        kind="attention",
        method="self-extend",
        factor=settings.factor,
        original_window=settings.original_max_position_embeddings,
        current_window=settings.max_length,
        dynamic=False,
        sites=_site_pattern([path for path, _ in state.modules]),
        params={"group_size": settings.group_size, "neighbor_window": settings.neighbor_window, "attn_implementation": state.base_implementation},
        stock_loadable=False,
        notes=notes,
    )


def load_self_extend(path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved with Self-Extend (``config.hf_posext`` of kind ``"attention"``) and re-apply it."""
    from transformers import AutoConfig

    params = dict(record.get("params", {}))
    if record.get("method") != "self-extend" or "group_size" not in params:
        raise ValueError(f"{path}: unrecognised attention-level record {record!r}; expected method 'self-extend' with group_size.")
    config = AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs))
    target = config.get_text_config() if hasattr(config, "get_text_config") else config
    target.__dict__.pop(CONFIG_KEY, None)
    from_pretrained_kwargs.setdefault("attn_implementation", record.get("attn_implementation") or "sdpa")
    model = model_class_for(config).from_pretrained(path, config=config, **from_pretrained_kwargs)
    return patch_self_extend(
        model, "self-extend", None,
        original_max_position_embeddings=int(record["original_max_position_embeddings"]),
        group_size=int(params["group_size"]),
        neighbor_window=int(params.get("neighbor_window", params.get("window"))),  # "window": saved before the rename
    )
