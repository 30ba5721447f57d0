"""Math shared by the attention-level methods: extra RoPE rotations, attention with its log-sum-exp,
and the query/key positions an attention call sees.

Each method (:mod:`~hf_posext.backends.attention.self_extend`, :mod:`~hf_posext.backends.attention.dual_chunk`)
keeps its own index rule; these are the pieces both build on.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = [
    "rotate", "rotate_with", "rotation_factors", "partners", "rotate_by_factors", "attention_with_lse", "fused_attention_with_lse", "cuda_attention_with_lse",
    "call_positions", "StepTables", "finish_decode", "finish_block", "fused_start", "probabilities",
]


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
    return rotate_with(states, angles.cos(), angles.sin(), rotary_dim, interleaved)


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


def rotation_factors(
    cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, head_dim: int, interleaved: bool, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors that rotate by given angles in three kernels: ``x * c + partners(x) * s`` (see :func:`rotate_by_factors`).

    Args:
        cos, sin: ``[..., rotary_dim / 2]`` cosines and sines of the angles.
        rotary_dim, head_dim: channels carrying RoPE, and all channels (the rest pass through).
        interleaved: GPT-J pair layout instead of rotate_half halves.
        scale: multiplies the result (a score scaling folded into the rotation).

    Returns:
        ``(c, s)``, ``[..., head_dim]`` each; on pass-through channels ``c`` is 1 and ``s`` is 0 (times ``scale``).
    """
    if interleaved:  # pairs (x0, x1): out0 = x0 cos - x1 sin, out1 = x1 cos + x0 sin
        c, s = cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
    else:  # halves (a, b): out_a = a cos - b sin, out_b = b cos + a sin
        c, s = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    if rotary_dim < head_dim:
        rest = head_dim - rotary_dim
        c = torch.cat((c, c.new_ones(*c.shape[:-1], rest)), dim=-1)
        s = torch.cat((s, s.new_zeros(*s.shape[:-1], rest)), dim=-1)
    if scale != 1.0:
        c, s = c * scale, s * scale
    return c, s


def partners(states: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """Each rotary channel's partner in the rotation (``(b, a)`` for halves ``(a, b)``, ``(x1, x0)`` for
    pairs), pass-through channels as they are: one copy kernel (two for a partial interleaved rotary)."""
    half = rotary_dim // 2
    rest = (states[..., rotary_dim:],) if rotary_dim < states.shape[-1] else ()
    if not interleaved:
        return torch.cat((states[..., half:rotary_dim], states[..., :half]) + rest, dim=-1)
    swapped = states[..., :rotary_dim].unflatten(-1, (half, 2)).flip(-1).flatten(-2)
    return torch.cat((swapped,) + rest, dim=-1) if rest else swapped


def rotate_by_factors(states: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """``states * c + partners(states) * s`` (factors from :func:`rotation_factors`, broadcast against
    ``states``), computed in float32 for half-precision states and returned in their dtype."""
    work = torch.float32 if states.dtype in (torch.float16, torch.bfloat16) else states.dtype
    x = states.to(work)
    return torch.addcmul(x * c.to(work), partners(x, rotary_dim, interleaved), s.to(work)).to(states.dtype)


def fused_attention_with_lse(query: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention_with_lse` runs a fused kernel for these queries (no ``[q, k]`` scores written
    out): PyTorch's CPU flash kernel for float32 and bfloat16, its CUDA memory-efficient kernel without a mask."""
    if query.device.type == "cuda":
        return mask is None and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return (query.device.type == "cpu" and mask is None and query.dtype in (torch.float32, torch.bfloat16)
            and getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None) is not None)


def attention_with_lse(query, key, value, mask, scaling, is_causal=False):
    """Attention output and log-sum-exp of its scores: ``([B, H, q, D], [B, H, q])``.

    ``mask`` is None or a bool tensor broadcastable to ``[B, H, q, k]`` (True = attend); ``is_causal``
    (with no mask) lets query r see keys 0..r (top-left aligned). On CPU it calls
    PyTorch's fused flash-attention kernel, the one ``scaled_dot_product_attention`` itself dispatches to,
    which also returns the log-sum-exp; elsewhere it computes the same two tensors explicitly. Rows with
    no key to attend give output 0 and log-sum-exp -inf.
    """
    if query.device.type == "cuda" and mask is None:
        fused = cuda_attention_with_lse(query, key, value, scaling, is_causal)
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


def cuda_attention_with_lse(query, key, value, scaling, is_causal):
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



def head_groups(query: torch.Tensor, key: torch.Tensor) -> int:
    """Query heads per key/value head (grouped-query attention); raises if they do not divide evenly."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly.")
    return heads // kv_heads


def call_positions(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key positions of one attention call: ``position_ids`` for the queries (default: the last
    ``q_len`` of ``kv_len``); with a KV cache the keys are the earlier tokens followed by the new ones,
    consecutive up to the last query.

    Args:
        query: ``[batch, heads, q_len, head_dim]``. key: ``[batch, kv_heads, kv_len, head_dim]``.
        position_ids: the model's positions for the queries, or None.
        label: the method's name for the error message.

    Returns:
        ``([batch | 1, q_len], [batch | 1, kv_len])`` integer positions.

    Raises:
        ValueError: ``position_ids`` without one position per query token (e.g. packed multimodal ids).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if position_ids is None:
        query_positions = torch.arange(kv_len - q_len, kv_len, device=query.device)[None, :]
    else:
        query_positions = position_ids.to(query.device).long()
        if query_positions.dim() == 1:
            query_positions = query_positions[None, :]
        if query_positions.shape[-1] != q_len:
            raise ValueError(
                f"{label} got position_ids of shape {tuple(position_ids.shape)} for {q_len} queries; it needs "
                "one position per query token."
            )
    if kv_len == q_len:
        return query_positions, query_positions
    last = query_positions[:, -1:]
    return query_positions, last - torch.arange(kv_len - 1, -1, -1, device=query.device)[None, :]


class StepTables:
    """Tables that every layer of one decode step shares (rotation factors, per-key indices), built by the
    first layer and reused by the others: the model passes each layer of a step the same ``position_ids``
    tensor, which is held with the tables (so its identity cannot be reused) and checked with its version.
    """

    def __init__(self, size: int = 8) -> None:
        self._held: dict[tuple, tuple[torch.Tensor, int, Any, torch.Tensor]] = {}
        self._size = size

    def get(self, key: tuple, position_ids: torch.Tensor | None, frequencies: torch.Tensor, build: Callable[[], Any]) -> Any:
        """The tables under ``key`` for this ``position_ids`` tensor and ``frequencies`` object, else ``build()``."""
        if position_ids is None:
            return build()
        held = self._held.get(key)
        if held is not None and held[0] is position_ids and held[1] == position_ids._version and held[3] is frequencies:
            return held[2]
        tables = build()
        if len(self._held) >= self._size:
            self._held.clear()
        self._held[key] = (position_ids, position_ids._version, tables, frequencies)
        return tables

    def for_call(self, query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None, scaling: float,
                 frequencies: torch.Tensor, settings_key: tuple, label: str,
                 build: Callable[[torch.Tensor, int], Any]) -> Any:
        """The tables of one decode-step attention call: ``build(query_positions, kv_len)``, run by the step's
        first layer and reused by the others (keyed by ``settings_key``, the shapes, device and ``scaling``).

        Args:
            query: ``[B, heads, q_len, D]``; key: ``[B, kv_heads, kv_len, D]``.
            position_ids: the model's ``position_ids`` (None: the last q_len positions, nothing reused).
            frequencies: the layer's ``inv_freq`` tensor (a re-patch gives a new one, which is not reused).
            settings_key: what else the tables depend on (the method's sizes, rotary layout).
            label: the method's name for :func:`call_positions`' one-line error.
        """
        q_len, kv_len = query.shape[2], key.shape[2]
        if position_ids is not None and position_ids.shape[-1] != q_len:
            call_positions(query, key, position_ids, label)  # raises the one-line error
        table_key = (*settings_key, str(query.device), kv_len, q_len, query.shape[-1], float(scaling))
        return self.get(table_key, position_ids, frequencies,
                        lambda: build(call_positions(query, key, position_ids, label)[0], kv_len))

    def clear(self) -> None:
        """Forget every held table (benchmarks: time a step's first layer)."""
        self._held.clear()


def probabilities(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax over the keys (the last dimension), in float32.

    With learned attention sinks (gpt-oss, Granite SWA, DeepSeek-V4: one logit ``s_h`` per query head), each
    row's denominator also holds ``exp(s_h)``, a key that carries no value:
    ``p_j = exp(x_j) / (exp(s_h) + sum_k exp(x_k))`` (Xiao et al. 2023, "Efficient Streaming Language Models
    with Attention Sinks"; the learned form of OpenAI's gpt-oss).

    Args:
        scores: ``[batch, kv_heads, groups, rows, keys]``, query head ``h = kv * groups + g`` at ``[:, kv, g]``
            (transformers' ``repeat_kv`` order).
        sinks: ``[heads]`` logits, or None (a plain softmax).
    """
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    batch, kv_heads, groups, rows, _ = scores.shape
    column = sinks.to(device=scores.device, dtype=torch.float32).reshape(1, kv_heads, groups, 1, 1)
    combined = torch.cat([scores.float(), column.expand(batch, kv_heads, groups, rows, 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def finish_decode(
    scores: torch.Tensor, attention_mask: torch.Tensor | None, future: torch.Tensor | None, value: torch.Tensor,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logit cap, mask, softmax and values for decode-step scores ``[B, kv_heads, groups, q_len, kv_len]``.

    Args:
        scores: scaled scores, the query heads sharing a kv head grouped under it.
        attention_mask: None, bool (True = attend) or additive float, broadcastable to ``[B, heads, q_len, kv_len]``.
        future: with no ``attention_mask``, ``[q_len, kv_len]`` True for keys after a query (None: none).
        value: ``[B, kv_heads, kv_len, head_dim]``. softcap: Gemma 2 logit cap.
        sinks: learned attention sinks, one logit per query head (see :func:`probabilities`), or None.

    Returns:
        ``[B, q_len, heads, head_dim]``.
    """
    batch, kv_heads, groups, q_len, kv_len = scores.shape
    heads, head_dim = kv_heads * groups, value.shape[-1]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        if future is not None:
            scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    else:
        mask = attention_mask[..., :q_len, :kv_len] if attention_mask.shape[-2] > 1 else attention_mask[..., :kv_len]
        if mask.shape[1] == heads and heads != kv_heads:
            mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-2], kv_len)
        else:
            mask = mask.unsqueeze(2)
        if mask.dtype == torch.bool:
            scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = probabilities(scores, sinks).to(value.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, groups * q_len, kv_len), value)
    return out.view(batch, kv_heads, groups, q_len, head_dim).reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()


def finish_block(
    scores: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    start: int,
    offset: int,
    scaling: float,
    softcap: float | None,
    dropout: float,
    training: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tail every written-out (explicit) attention path shares, for one block of query rows.

    Scales and soft-caps the scores, masks them (causally, the queries being the last keys, when there is
    no mask; else by a bool or additive mask broadcastable to ``[batch, heads, q_len, kv_len]``), takes the
    softmax in float32 and weights the values.

    Args:
        scores: ``[batch, kv_heads, groups, rows, kv_len]``, the raw q.k of query rows ``[start, start + rows)``.
        value: ``[batch, kv_heads, kv_len, head_dim]``.
        attention_mask: None, bool (True = attend) or additive float.
        start: the block's first query row. offset: ``kv_len - q_len`` (keys before the first query).
        scaling: score multiplier. softcap: Gemma 2 logit cap (None: none).
        dropout, training: attention dropout, applied when training.
        sinks: learned attention sinks, one logit per query head (see :func:`probabilities`), or None.

    Returns:
        ``[batch, heads, rows, head_dim]``.
    """
    batch, kv_heads, groups, rows, kv_len = scores.shape
    heads, head_dim = kv_heads * groups, value.shape[-1]
    scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        if start + offset + 1 < kv_len:  # some key lies after a query of this block (never when decoding)
            future = torch.ones(rows, kv_len, dtype=torch.bool, device=scores.device).triu_(start + offset + 1)
            scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    else:
        end = start + rows
        mask = attention_mask[..., start:end, :kv_len] if attention_mask.shape[-2] > 1 else attention_mask[..., :kv_len]
        if mask.shape[1] == heads and heads != kv_heads:
            mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-2], kv_len)
        else:
            mask = mask.unsqueeze(2)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = probabilities(scores, sinks).to(value.dtype)
    if dropout and training:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs.view(batch, kv_heads, groups * rows, kv_len), value)
    return out.view(batch, kv_heads, groups, rows, head_dim).reshape(batch, heads, rows, head_dim)


def fused_start(mask_kind: str, attention_mask: torch.Tensor | None, query_positions: torch.Tensor, softcap: float | None,
                dropout: float, training: bool, tensors: tuple[torch.Tensor, ...]) -> int | None:
    """The first query position when a fused (log-sum-exp merged) path applies, else None.

    It applies under the SDPA mask convention, without a logit cap, training dropout or gradient (the fused
    CPU kernel does not differentiate its log-sum-exp), with a bool 4-d mask shared by the heads (or none),
    and with one set of consecutive positions for the whole batch.
    """
    if mask_kind != "sdpa" or softcap is not None or (dropout and training):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1):
        return None
    first = query_positions[:1, :1]
    expected = first + torch.arange(query_positions.shape[-1], device=query_positions.device)[None]
    if not bool((query_positions == expected).all()):
        return None
    return int(first)

