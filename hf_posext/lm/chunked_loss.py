"""A causal-LM cross-entropy that never materialises the [tokens x vocabulary] logits.

At 65,536 tokens a 128k-entry vocabulary gives 16 GiB of bf16 logits (32 GiB once upcast to float32)
before a single activation; the plain ``model(**batch, labels=...).loss`` keeps them, their float32
copy and their gradient alive at once. Here the output projection and the cross-entropy run over
chunks of ``chunk_size`` tokens: each chunk's logits are computed in float32, turned into that chunk's
loss and its gradients with respect to the hidden states and the output weight, and freed before the
next chunk (the fused linear cross-entropy of Liger-Kernel and of Wijmans et al. 2024, "Cut Your
Losses in Large-Vocabulary Language Models", does the same on GPU). Peak extra memory is one chunk of
logits plus one gradient the size of the hidden states (and of the weight, when it is trained).

The loss equals transformers' ``ForCausalLMLoss`` (labels shifted left by one, ``-100`` ignored, mean
over the counted tokens, or their sum divided by ``num_items_in_batch`` under gradient accumulation),
and so do its gradients (tests: 1e-5 relative).

Use it on a model with :func:`chunked_causal_lm_loss`; it runs the model's own forward, so DDP, FSDP
and DeepSpeed see a normal forward pass, and swaps the output head's forward for the duration of that
call only (the parameters are the ones the engine gathered for that forward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["IGNORE_INDEX", "DEFAULT_CHUNK_SIZE", "LOGITS_BUDGET", "chunk_for_vocabulary", "linear_cross_entropy", "chunked_causal_lm_loss", "check_output_head",
           "sequence_mean_weights", "sequence_mean_causal_lm_loss"]

IGNORE_INDEX = -100
#: Tokens per chunk: 4096 x 49152 (SmolLM2's vocabulary) float32 logits are 768 MiB; 1024 is 192 MiB.
DEFAULT_CHUNK_SIZE = 1024
#: Most logits one chunk may hold (elements): 2048 tokens of SmolLM2's 49,152-word vocabulary (384 MiB in float32).
#: Gemma 3's 262,144 words get 384 tokens a chunk, where 2048 would take 2 GiB.
LOGITS_BUDGET = 2048 * 49152


def chunk_for_vocabulary(chunk_size: int, vocabulary: int, rows: int = 1, logits_budget: int | None = LOGITS_BUDGET) -> int:
    """Tokens per chunk: ``chunk_size``, shrunk so that ``rows`` x chunk x ``vocabulary`` logits stay within
    ``logits_budget`` elements (at least one token; None: no budget).

    Example:
        >>> chunk_for_vocabulary(2048, 262144)
        384
    """
    if logits_budget is None:
        return chunk_size
    if logits_budget < 1:
        raise ValueError(f"logits_budget={logits_budget} must be a positive number of logits (e.g. {LOGITS_BUDGET}).")
    return max(1, min(chunk_size, logits_budget // max(1, rows * vocabulary)))


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of cross-entropy(hidden @ weight.T + bias, target), each token's term times its weight
    (1 when ``token_weights`` is None), gradients computed chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk_size: int, token_weights: torch.Tensor | None) -> torch.Tensor:
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = hidden[start : start + chunk_size]
            chunk_targets = targets[start : start + chunk_size]
            counted = (chunk_targets != IGNORE_INDEX).float()
            if token_weights is not None:
                counted = counted * token_weights[start : start + chunk_size]
            if not bool(counted.any()):
                continue
            logits = torch.nn.functional.linear(chunk, weight, bias).float()
            log_normaliser = torch.logsumexp(logits, dim=-1)
            safe_targets = chunk_targets.clamp(min=0)
            picked = logits.gather(-1, safe_targets[:, None]).squeeze(-1)
            total += ((log_normaliser - picked) * counted).sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            # d(loss)/d(logits) = softmax - one_hot(target), zero on ignored tokens; computed in place.
            logits.sub_(log_normaliser[:, None]).exp_()
            logits[torch.arange(logits.shape[0], device=logits.device), safe_targets] -= 1.0
            logits.mul_(counted[:, None])  # the token's weight (0 where ignored)
            if want_hidden:
                grad_hidden[start : start + chunk_size] = (logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_weight:
                grad_weight.addmm_(logits.t(), chunk.float())
            if want_bias:
                grad_bias += logits.sum(0)
            del logits
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None))
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        grads = []
        for present, dtype in zip(ctx.present, ctx.dtypes):
            grads.append((next(saved) * grad_output).to(dtype) if present else None)
        return grads[0], grads[1], grads[2], None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    token_weights: torch.Tensor | None = None,
    logits_budget: int | None = LOGITS_BUDGET,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, without the full logits.

    Formula: loss = Σ_t [logsumexp_v(z_tv) − z_t,y_t] / N over tokens t with y_t ≠ -100, z = h W^T + b,
    where N is the number of counted tokens, or ``num_items_in_batch`` when given (the Trainer passes the
    token count of all accumulated micro-batches so that their losses add up to one mean).
    With ``token_weights`` w the loss is Σ_t w_t [logsumexp_v(z_tv) − z_t,y_t] over the counted tokens,
    not divided by anything (the weights carry the normalisation; see :func:`sequence_mean_weights`).

    Args:
        hidden: [tokens, hidden] (or [batch, tokens, hidden]) final hidden states.
        weight: [vocabulary, hidden] output projection.
        targets: token ids aligned with ``hidden`` (already shifted), ``-100`` where not counted.
        bias: optional [vocabulary] output bias.
        num_items_in_batch: the divisor (default: the number of counted tokens); not allowed with weights.
        chunk_size: tokens per chunk; the only [chunk, vocabulary] tensor alive at once.
        token_weights: optional float weights aligned with ``targets`` (ignored tokens get none).
        logits_budget: at most this many logits a chunk: ``chunk_size`` shrinks with the vocabulary
            (:func:`chunk_for_vocabulary`; None: exactly ``chunk_size``).

    Returns:
        A float32 scalar; its gradients flow to ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: on shapes that do not match or a chunk size below 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive number of tokens (e.g. {DEFAULT_CHUNK_SIZE}).")
    chunk_size = chunk_for_vocabulary(chunk_size, weight.shape[0], logits_budget=logits_budget)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {hidden.shape[0]} hidden states: they must be aligned one to one.")
    if weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"weight has {weight.shape[-1]} input features but the hidden states have {hidden.shape[-1]}.")
    if token_weights is not None:
        if num_items_in_batch is not None:
            raise ValueError("give token_weights or num_items_in_batch, not both: the weights carry the normalisation.")
        token_weights = token_weights.reshape(-1).to(device=hidden.device, dtype=torch.float32)
        if token_weights.shape[0] != targets.shape[0]:
            raise ValueError(f"{token_weights.shape[0]} token weights for {targets.shape[0]} targets: they must be aligned one to one.")
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, int(chunk_size), token_weights)
    total = _LinearCrossEntropy.apply(hidden, weight, bias, targets, int(chunk_size), None)
    divisor = (targets != IGNORE_INDEX).sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(total.device)
    return total / divisor


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the hidden states: position t predicts labels[t + 1]; the last predicts nothing."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def check_output_head(model: nn.Module) -> nn.Module:
    """The model's output projection if the chunked loss reproduces its logits, else a ValueError saying why.

    The loss recomputes ``lm_head(h)`` as ``h @ weight.T + bias``: a head wrapped by an adapter, or a
    model that rescales or soft-caps its logits after the head, would be computed wrongly.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    config = getattr(base, "config", None)
    if type(head) is not nn.Linear:
        raise ValueError(
            f"the chunked loss needs a plain nn.Linear output head, found {type(head).__name__}; "
            "train with `train.loss: plain` (or leave lm_head out of the LoRA target modules)."
        )
    for field in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{type(base).__name__} post-processes its logits ({field}={value}), which the chunked loss "
                "does not reproduce; train with `train.loss: plain`."
            )
    return head


@contextlib.contextmanager
def _head_returns_loss(head: nn.Module, targets: torch.Tensor, num_items_in_batch: Any, chunk_size: int,
                       token_weights: torch.Tensor | None = None) -> Iterator[None]:
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"the model sent {tuple(hidden.shape[:-1])} hidden states to its head for "
                             f"{tuple(targets.shape)} labels; is `logits_to_keep` set?")
        return linear_cross_entropy(hidden, head.weight, targets, bias=head.bias,
                                    num_items_in_batch=num_items_in_batch, chunk_size=chunk_size,
                                    token_weights=token_weights)

    head.forward = forward  # an instance attribute: module hooks (FSDP, DeepSpeed) still run around it
    try:
        yield
    finally:
        del head.forward


def _targets_of(inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """The model inputs without labels, and the targets aligned with the hidden states."""
    inputs = dict(inputs)
    labels = inputs.pop("labels", None)
    targets = inputs.pop("shift_labels", None)
    if targets is None:
        if labels is None:
            raise ValueError("the batch has no `labels` (or `shift_labels`) to compute a loss against.")
        targets = shift_labels(labels)
    return inputs, targets


def _loss_through_head(model: nn.Module, inputs: dict[str, Any], targets: torch.Tensor, num_items_in_batch: Any,
                       chunk_size: int, token_weights: torch.Tensor | None) -> torch.Tensor:
    unwrapped = model
    while hasattr(unwrapped, "module") and isinstance(unwrapped.module, nn.Module):  # DDP / DeepSpeed engine
        unwrapped = unwrapped.module
    head = check_output_head(unwrapped)
    with _head_returns_loss(head, targets, num_items_in_batch, chunk_size, token_weights):
        return model(**inputs).logits


def chunked_causal_lm_loss(
    model: nn.Module,
    inputs: dict[str, Any],
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The causal-LM loss of ``model`` on ``inputs``, equal to ``model(**inputs).loss``, without full logits.

    Runs the model's own forward (through any DDP / FSDP / DeepSpeed wrapper, so gradient
    synchronisation and parameter gathering work as usual) with its output head computing
    :func:`linear_cross_entropy` instead of logits.

    Args:
        model: a causal LM, possibly wrapped by PEFT, DDP, FSDP or DeepSpeed.
        inputs: the batch: ``input_ids`` and ``labels`` (or pre-shifted ``shift_labels``), optionally
            ``attention_mask``, ``position_ids``.
        num_items_in_batch: divisor for gradient accumulation (see :func:`linear_cross_entropy`).
        chunk_size: tokens per chunk.

    Returns:
        The scalar loss.
    """
    inputs, targets = _targets_of(inputs)
    return _loss_through_head(model, inputs, targets, num_items_in_batch, chunk_size, None)


def sequence_mean_weights(targets: torch.Tensor) -> torch.Tensor:
    """Per-token weights that make a weighted token sum the mean over sequences of each sequence's mean loss.

    Formula: w_bt = 1 / (n_b · B') for each counted token t of row b, where n_b is the number of counted
    tokens of row b and B' the number of rows with at least one; 0 elsewhere. A row with 2 answer tokens
    then weighs as much as a row with 2047 text tokens.

    Args:
        targets: [batch, tokens] targets (already shifted), ``-100`` where not counted.

    Returns:
        float32 weights of the same shape.
    """
    counted = (targets != IGNORE_INDEX).float()
    per_row = counted.sum(-1, keepdim=True)
    rows = (per_row > 0).sum().clamp(min=1)
    return counted / (per_row.clamp(min=1) * rows)


def sequence_mean_causal_lm_loss(
    model: nn.Module,
    inputs: dict[str, Any],
    loss: str = "chunked",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The mean over the batch's sequences of each sequence's mean next-token cross-entropy.

    Formula: L = (1/B') Σ_b (1/n_b) Σ_t CE_bt over the counted tokens (see :func:`sequence_mean_weights`).
    Unlike the token mean (:func:`chunked_causal_lm_loss`, transformers' default), a sequence that trains on
    few tokens (a retrieval sample's answers) weighs as much as one that trains on all of them.

    Args:
        model: a causal LM, possibly wrapped by PEFT, DDP, FSDP or DeepSpeed.
        inputs: the batch, as for :func:`chunked_causal_lm_loss`.
        loss: ``"chunked"`` (never the full logits) or ``"plain"`` (the model's logits, then the weighted
            cross-entropy).
        chunk_size: tokens per chunk of the chunked loss.

    Returns:
        The scalar loss (float32).
    """
    inputs, targets = _targets_of(inputs)
    weights = sequence_mean_weights(targets)
    if loss == "chunked":
        return _loss_through_head(model, inputs, targets, None, chunk_size, weights)
    if loss != "plain":
        raise ValueError(f"loss={loss!r}: use 'chunked' or 'plain'.")
    logits = model(**inputs).logits.float()
    targets = targets.to(logits.device)
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).clamp(min=0),
                                                  reduction="none")
    return (per_token * weights.reshape(-1).to(logits.device)).sum()
