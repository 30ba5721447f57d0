"""What defines the function an attention-level method computes, for a stored cell to be checked against.

A RoPE method is pinned down by its rotary frequencies (:func:`hf_posext.evaluation.runner.rope_frequencies`).
An attention-level method (Self-Extend) also changes how positions enter the attention scores: its
settings (group size, window, ...) and the code of its attention kernel. :func:`attention_function` records
both, so a cell computed with other settings or another version of the kernel is recomputed, not reused.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch

from hf_posext.api import describe

__all__ = ["attention_function", "KERNEL_INDEPENDENT_PARAMS"]

#: Parameters that choose how the scores are computed, not what they are (eager and SDPA agree).
KERNEL_INDEPENDENT_PARAMS = ("attn_implementation",)


def _kernel_source_hash(model: torch.nn.Module) -> str | None:
    """sha256 of the source file of the attention function the model's config names (None: not found)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(model.config, "_attn_implementation", None)
    function = ALL_ATTENTION_FUNCTIONS.get(name) if name else None
    if function is None:
        return None
    try:
        source = inspect.getsource(inspect.getmodule(function))
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()


def attention_function(model: torch.nn.Module) -> dict[str, Any] | None:
    """The method, settings and kernel-code hash of an attention-level patch (None: no such patch).

    Two cells with different results here computed different functions. The kernel hash is of the whole
    module that defines the registered attention function: any edit to it, even a comment, recomputes
    the cells (the safe direction: a cell is never trusted across a change of its code).
    """
    try:
        report = describe(model)
    except Exception:
        return None
    if report.kind != "attention":
        return None
    params = {key: value for key, value in sorted(report.params.items()) if key not in KERNEL_INDEPENDENT_PARAMS}
    return {"method": report.method, "params": params, "kernel_sha256": _kernel_source_hash(model)}
