"""Scoring a causal LM from its final hidden states: the decoder stack, the output head, and the summed
next-token NLL computed chunk by chunk (never the full [tokens x vocabulary] logits at once).

Shared by evaluation (perplexity, retrieval) and the factor search.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_posext.backends.attention.sliding_window import banded_sliding_attention
from hf_posext.lm.chunked_loss import LOGITS_BUDGET, chunk_for_vocabulary

__all__ = ["base_model", "head_logits", "chunked_nll"]


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (``model.model`` for Llama, ``model.transformer`` for GPT-2)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, torch.nn.Module):
        return base
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    raise ValueError(f"Cannot find the decoder inside {type(model).__name__}: it has no {prefix!r} attribute or get_decoder().")


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits for final hidden states ``hidden`` (lm_head plus the model's logit transforms)."""
    head = model.get_output_embeddings()
    hidden = hidden.to(head.weight.device)
    logits = head(hidden).float()
    config = model.config
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def chunked_nll(model: torch.nn.Module, input_ids: torch.Tensor, chunk_size: int = 2048, *,
                logits_budget: int | None = LOGITS_BUDGET, banded: bool = True) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL of each row of ``input_ids`` without materialising all logits.

    Runs the decoder stack once, then the output head and cross-entropy over ``chunk_size`` positions
    at a time. On a CPU, sliding-window layers are computed banded (cost ~ tokens x window; same result,
    :mod:`hf_posext.backends.attention.sliding_window`).

    Args:
        model: a causal LM.
        input_ids: ``[batch, tokens]`` token ids (no padding).
        chunk_size: at most this many positions per head + loss chunk (memory ~ batch x chunk x vocabulary x
            4 bytes), shrunk so that a chunk holds at most ``logits_budget`` logits (None: no budget).
        logits_budget: see ``chunk_size`` (:data:`~hf_posext.lm.chunked_loss.LOGITS_BUDGET`).
        banded: compute sliding-window layers banded where that applies (False: transformers' masked path).

    Returns:
        ``(nll_sum, scored)``: float64 ``[batch]`` sums over the ``tokens - 1`` predicted positions, and
        that count per row.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, tokens>=2], got shape {tuple(input_ids.shape)}.")
    decoder = base_model(model)
    device = next(decoder.parameters()).device
    input_ids = input_ids.to(device)
    with banded_sliding_attention(model, enabled=banded):
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    vocabulary = model.get_output_embeddings().weight.shape[0]
    chunk_size = chunk_for_vocabulary(chunk_size, vocabulary, input_ids.shape[0], logits_budget)
    targets = input_ids[:, 1:]
    total = torch.zeros(input_ids.shape[0], dtype=torch.float64)
    positions = input_ids.shape[1] - 1
    for start in range(0, positions, chunk_size):
        end = min(start + chunk_size, positions)
        logits = head_logits(model, hidden[:, start:end])
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets[:, start:end].reshape(-1).to(logits.device), reduction="none"
        )
        total += loss.view(input_ids.shape[0], -1).double().sum(dim=1).cpu()
        del logits, loss
    return total, positions
