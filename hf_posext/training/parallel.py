"""Sequence and context parallelism from existing engines (DeepSpeed Ulysses/ALST, torch context parallel).

This module only checks a parallelism request and builds accelerate's `ParallelismConfig` for the Trainer;
the all-to-all and ring attention are DeepSpeed's and torch's. Every check runs before a model is loaded
or an output folder is created, and raises a one-line `ValueError` naming the problem and the fix.

Known trap (see the project notes): with DeepSpeed ZeRO stage 0, 1 or 2, the Trainer's sequence-parallel
loss gives gradients `sp_size` times too large (its differentiable all-gather sums over SP ranks); with
ZeRO-3 they equal the 1-process gradients. Sequence parallelism is therefore only accepted with ZeRO-3.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

SP_BACKENDS = ("deepspeed", "none")
CP_BACKENDS = ("torch", "none")
# DeepSpeed's UlyssesSPAttentionHF refuses these (register_with_transformers).
UNSHARDABLE_ATTENTION = ("eager", "paged|eager")
SP_ZERO_STAGE = 3


@dataclass(frozen=True)
class ParallelismRequest:
    """What the recipe asks for.

    Attributes:
        sp_size: DeepSpeed Ulysses sequence-parallel degree (1 = off).
        sp_backend: "deepspeed" or "none".
        cp_size: torch context-parallel degree (1 = off).
        cp_backend: "torch" or "none".
    """

    sp_size: int = 1
    sp_backend: str = "none"
    cp_size: int = 1
    cp_backend: str = "none"


def validate_parallelism(
    request: ParallelismRequest,
    *,
    num_processes: int,
    sequence_length: int,
    attn_implementation: str | None,
    zero_stage: int | None,
    cuda_available: bool,
) -> None:
    """Refuse a parallelism request that cannot train correctly here.

    Args:
        request: the recipe's parallelism section.
        num_processes: processes of the launch (accelerate's world size).
        sequence_length: tokens per training sequence.
        attn_implementation: the model's attention implementation ("sdpa", "flash_attention_2", ...).
        zero_stage: DeepSpeed ZeRO stage of the launch, None without DeepSpeed.
        cuda_available: whether CUDA GPUs are present.

    Raises:
        ValueError: one line naming the problem and the fix.
    """
    if request.sp_backend not in SP_BACKENDS:
        raise ValueError(f"parallelism.sp_backend={request.sp_backend!r} is unknown; use one of {SP_BACKENDS}")
    if request.cp_backend not in CP_BACKENDS:
        raise ValueError(f"parallelism.cp_backend={request.cp_backend!r} is unknown; use one of {CP_BACKENDS}")
    for name, size in (("sp_size", request.sp_size), ("cp_size", request.cp_size)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"parallelism.{name} must be a positive integer, got {size!r}")
    if request.cp_size > 1:
        if request.cp_backend != "torch":
            raise ValueError("parallelism.cp_size > 1 needs parallelism.cp_backend=torch")
        if not cuda_available:
            raise ValueError("parallelism.cp_size > 1 (torch context parallel) runs only on CUDA GPUs; on CPU use "
                             "parallelism.sp_backend=deepspeed with sp_size instead")
        _check_divides("cp_size", request.cp_size, num_processes, sequence_length, factor=2)
    if request.sp_size > 1:
        if request.sp_backend != "deepspeed":
            raise ValueError("parallelism.sp_size > 1 needs parallelism.sp_backend=deepspeed")
        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError("parallelism.sp_size > 1 needs DeepSpeed: pip install 'hf-posext[deepspeed]'")
        if attn_implementation in UNSHARDABLE_ATTENTION:
            raise ValueError(f"sequence parallelism cannot shard attn_implementation={attn_implementation!r}; "
                             "set model.attn_implementation=sdpa (or flash_attention_2 on GPU)")
        if zero_stage != SP_ZERO_STAGE:
            raise ValueError(f"sequence parallelism needs DeepSpeed ZeRO stage {SP_ZERO_STAGE} (got {zero_stage}): at "
                             "stages 0-2 the Trainer's SP loss scales gradients by sp_size; use "
                             "recipes/accelerate/deepspeed_ulysses_*.yaml")
        _check_divides("sp_size", request.sp_size, num_processes, sequence_length, factor=1)


def _check_divides(name: str, size: int, num_processes: int, sequence_length: int, factor: int) -> None:
    if num_processes % size:
        raise ValueError(f"parallelism.{name}={size} does not divide the {num_processes} launched processes; "
                         f"launch a multiple of {size} processes or change {name}")
    if sequence_length % (size * factor):
        raise ValueError(f"parallelism.{name}={size} does not divide the sequence length {sequence_length}; "
                         f"use a sequence length divisible by {size * factor}")


def accelerate_parallelism_config(request: ParallelismRequest):
    """accelerate's `ParallelismConfig` for `TrainingArguments(parallelism_config=...)`, or None when off.

    Args:
        request: a request already checked by `validate_parallelism`.

    Returns:
        `accelerate.ParallelismConfig` or None.
    """
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    if request.sp_size > 1:
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        return ParallelismConfig(sp_size=request.sp_size, sp_backend="deepspeed", sp_handler=handler)
    if request.cp_size > 1:
        return ParallelismConfig(cp_size=request.cp_size, cp_backend="torch")
    return None
