"""Causal-LM cross-entropy that never holds the full [tokens x vocabulary] logits.

The loss is computed from the final hidden states and the lm_head weight over chunks of tokens. The
forward pass computes, per chunk, the logits (float32), the summed token losses and the gradients with
respect to the chunk's hidden states and to the weight; only one chunk of logits is alive at a time.
The backward pass then only scales the stored gradients by the incoming gradient. This is the same
arithmetic as `F.cross_entropy(hidden @ weight.T + bias, labels, reduction="sum") / num_items` (the
loss transformers' `ForCausalLMLoss` computes) without its memory.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction: position t is scored on token t+1, the last on nothing.

    Args:
        labels: [batch, tokens] token ids, IGNORE_INDEX where no loss is wanted.

    Returns:
        [batch, tokens] shifted labels, IGNORE_INDEX in the last column.
    """
    padding = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], padding], dim=-1)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T + bias` against `targets`, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, softcap):  # noqa: D102
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_targets = targets.reshape(-1)
        grad_hidden = torch.zeros_like(flat_hidden, dtype=torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, flat_hidden.shape[0], chunk_size):
            part = flat_hidden[start:start + chunk_size]
            part_targets = flat_targets[start:start + chunk_size]
            scored = part_targets != IGNORE_INDEX
            if not bool(scored.any()):
                continue
            logits = _chunk_logits(part, weight, bias, softcap)
            log_norm = torch.logsumexp(logits, dim=-1)
            safe_targets = part_targets.clamp_min(0)
            target_logits = logits.gather(-1, safe_targets[:, None]).squeeze(-1)
            total += ((log_norm - target_logits) * scored).sum()
            # d(sum loss)/d(logits) = softmax - onehot on scored rows, 0 elsewhere.
            grad_logits = torch.softmax(logits, dim=-1)
            grad_logits[torch.arange(len(part)), safe_targets] -= 1.0
            grad_logits *= scored[:, None]
            if softcap is not None:
                grad_logits *= 1.0 - (logits / softcap) ** 2
            grad_hidden[start:start + chunk_size] = grad_logits @ weight.float()
            grad_weight += grad_logits.t() @ part.float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias if grad_bias is not None else torch.empty(0))
        ctx.has_bias = bias is not None
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: D102
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_shape, hidden_dtype, weight_dtype = ctx.shapes
        out_hidden = (grad_hidden * grad_total).reshape(hidden_shape).to(hidden_dtype)
        out_weight = (grad_weight * grad_total).to(weight_dtype)
        out_bias = (grad_bias * grad_total).to(weight_dtype) if ctx.has_bias else None
        return out_hidden, out_weight, out_bias, None, None, None


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    shift_labels_: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int = 2048,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy from final hidden states, as transformers' ForCausalLMLoss computes it.

    Args:
        hidden: [batch, tokens, hidden] final hidden states (after the last norm).
        weight: [vocabulary, hidden] lm_head weight.
        labels: [batch, tokens] unshifted labels (IGNORE_INDEX = -100 is not scored); shifted here.
        bias: optional [vocabulary] lm_head bias.
        shift_labels_: already-shifted labels (e.g. a sequence-parallel shard); used instead of `labels`.
        num_items_in_batch: divisor for gradient accumulation (scored tokens of the whole global batch);
            by default the scored tokens of this call.
        chunk_size: tokens per chunk; memory holds one [chunk_size x vocabulary] float32 block.
        softcap: final logit soft-capping (Gemma-2 style `final_logit_softcapping`), or None.

    Returns:
        Scalar float32 loss, differentiable with respect to `hidden`, `weight` and `bias`.

    Raises:
        ValueError: neither or both of `labels` and `shift_labels_` given, or a non-positive chunk size.
    """
    if (labels is None) == (shift_labels_ is None):
        raise ValueError("chunked_causal_lm_loss: pass exactly one of labels= (unshifted) or shift_labels_= (shifted)")
    if chunk_size < 1:
        raise ValueError(f"chunked_causal_lm_loss: chunk_size must be >= 1, got {chunk_size}")
    targets = shift_labels(labels) if labels is not None else shift_labels_
    total = ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets.to(hidden.device), int(chunk_size), softcap)
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def check_liger_available() -> None:
    """Refuse the GPU fused loss (transformers' `use_liger_kernel`) when liger-kernel is not installed.

    Raises:
        ValueError: one line naming the fix.
    """
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("the fused Liger loss (use_liger_kernel) needs liger-kernel on a CUDA machine: "
                         "pip install liger-kernel, or use the chunked loss (works on CPU and GPU)")
