"""Sequence and context parallelism from existing engines (DeepSpeed Ulysses/ALST, torch context parallel).

This module only checks a parallelism request and builds accelerate's `ParallelismConfig` for the Trainer;
the all-to-all and ring attention are DeepSpeed's and torch's. Every check runs before a model is loaded
or an output folder is created, and raises a one-line `ValueError` naming the problem and the fix.

Data parallel x sequence parallel (more processes than ``sp_size``): accelerate is given the data-parallel size
(:func:`accelerate_parallelism_config`), so DeepSpeed's batch arithmetic holds; on CPU such a launch is refused,
because torch's gloo backward of the differentiable all-gather (``torch.distributed.nn.functional``) addresses
its scatter by group rank as if it were a global rank and fails in every group but the first.

Known trap (see the project notes): up to transformers 5.24, with DeepSpeed ZeRO stage 0, 1 or 2, the Trainer's
sequence-parallel loss gives gradients `sp_size` times too large (its differentiable all-gather sums over SP ranks);
with ZeRO-3 they equal the 1-process gradients (transformers 5.25 rescales the loss, and stage 2 is right there
too). Sequence parallelism is therefore only accepted with ZeRO-3, right on every release supported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Mapping

SP_BACKENDS = ("deepspeed", "none")
CP_BACKENDS = ("torch", "none")
#: The attention implementations accelerate's DeepSpeedSequenceParallelConfig lets Ulysses wrap.
SHARDABLE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
SP_ZERO_STAGE = 3


def validate_parallelism(
    request: Any,
    *,
    num_processes: int,
    sequence_length: int,
    attn_implementation: str | None,
    zero_stage: int | None,
    cuda_available: bool,
) -> None:
    """Refuse a parallelism request that cannot train correctly here.

    Args:
        request: the recipe's parallelism section (:class:`~hf_posext.training.config.ParallelismSection`:
            sp_backend, sp_size, cp_backend, cp_size).
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
        if attn_implementation not in SHARDABLE_ATTENTION:
            raise ValueError(f"sequence parallelism cannot shard attn_implementation={attn_implementation!r}; "
                             f"set model.attn_implementation to one of {', '.join(SHARDABLE_ATTENTION)} (sdpa on CPU)")
        if zero_stage != SP_ZERO_STAGE:
            raise ValueError(f"sequence parallelism needs DeepSpeed ZeRO stage {SP_ZERO_STAGE} (got {zero_stage}): at "
                             "stages 0-2 the Trainer's SP loss scales gradients by sp_size; use "
                             "recipes/accelerate/deepspeed_ulysses_*.yaml")
        _check_divides("sp_size", request.sp_size, num_processes, sequence_length, factor=1)
        if num_processes > request.sp_size and not cuda_available:
            raise ValueError(
                f"parallelism.sp_size={request.sp_size} on {num_processes} processes makes "
                f"{num_processes // request.sp_size} sequence-parallel groups, which train only on GPUs: on CPU (gloo) "
                "the backward of torch's all-gather fails in every group but the first; launch exactly "
                f"{request.sp_size} processes (--num_processes {request.sp_size}) or set parallelism.sp_size={num_processes}"
            )


def _check_divides(name: str, size: int, num_processes: int, sequence_length: int, factor: int) -> None:
    if num_processes % size:
        raise ValueError(f"parallelism.{name}={size} does not divide the {num_processes} launched processes; "
                         f"launch a multiple of {size} processes or change {name}")
    if sequence_length % (size * factor):
        raise ValueError(f"parallelism.{name}={size} does not divide the sequence length {sequence_length}; "
                         f"use a sequence length divisible by {size * factor}")


def accelerate_parallelism_config(request: Any, attn_implementation: str = "sdpa", num_processes: int | None = None):
    """accelerate's `ParallelismConfig` for `TrainingArguments(parallelism_config=...)`, or None when off.

    The processes beyond one sequence-parallel (or context-parallel) group are data parallel: a launch of
    ``num_processes`` processes has ``num_processes / sp_size`` groups, each on its own samples. accelerate
    must be told so (``dp_shard_size``): it sets DeepSpeed's ``train_batch_size`` to micro-batch x accumulation
    x ``data_parallel_size``, which DeepSpeed checks against its own count of data-parallel ranks (without it,
    4 processes at sp_size=2 stop with ``train_batch_size ... 1 != 1 * 1 * 2.0``). Under ZeRO-3 those ranks
    shard the weights and optimizer, hence ``dp_shard`` rather than ``dp_replicate``; for context parallelism
    FSDP2 shards over the joint ``dp_shard x cp`` mesh, whose size accelerate checks against the processes.

    Args:
        request: a request already checked by `validate_parallelism`.
        attn_implementation: the model's attention, which Ulysses wraps (one of `SHARDABLE_ATTENTION`).
        num_processes: processes of the launch (default: ``WORLD_SIZE``, else 1 group of sp_size/cp_size).

    Returns:
        `accelerate.ParallelismConfig` or None.
    """
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    if num_processes is None:
        num_processes = int(os.environ.get("WORLD_SIZE", "0") or 0) or max(request.sp_size, request.cp_size)
    if request.sp_size > 1:
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=attn_implementation)
        return ParallelismConfig(sp_size=request.sp_size, sp_backend="deepspeed", sp_handler=handler,
                                 dp_shard_size=data_parallel_size(request, num_processes))
    if request.cp_size > 1:
        return ParallelismConfig(cp_size=request.cp_size, cp_backend="torch",
                                 dp_shard_size=data_parallel_size(request, num_processes))
    return None


def data_parallel_size(request: Any, num_processes: int) -> int:
    """The data-parallel groups of a launch: ``num_processes / (sp_size x cp_size)`` (checked to divide).

    Raises:
        ValueError: the sizes do not divide the processes (`validate_parallelism` refuses that first).
    """
    group = request.sp_size * request.cp_size
    if num_processes < group or num_processes % group:
        raise ValueError(f"parallelism: {num_processes} processes are not a multiple of sp_size x cp_size = {group}; "
                         f"launch a multiple of {group} processes")
    return num_processes // group


# accelerate config keys that accelerate refuses beside a DeepSpeed config given by the script (it raises
# "When using `deepspeed_config_file`, the following accelerate config variables will be ignored").
_DEEPSPEED_FIELDS_OWNED_BY_RECIPE = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model", "mixed_precision",
    "deepspeed_config_file",
)


def check_launch_environment(request: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuse an ``accelerate launch`` config that contradicts the recipe's parallelism section.

    The recipe's ``parallelism`` section is what the engine validates and builds the DeepSpeed config and
    accelerate's ``ParallelismConfig`` from; an accelerate config file only says how many processes run.
    An accelerate config that asks for another sp/cp size (its ``parallelism_config``) would otherwise
    shard sequences the recipe did not validate, and one that sets DeepSpeed fields of its own
    (``zero_stage``, ``mixed_precision``, ...) is refused by accelerate beside the recipe's DeepSpeed config.
    The same options given on the command line (``accelerate launch --use_deepspeed --zero_stage 2``) reach
    the processes as ``ACCELERATE_*`` variables that the recipe's config would silently override: refused too.

    Args:
        request: the recipe's parallelism section.
        environ: the launch environment (default: ``os.environ``).

    Raises:
        ValueError: one line naming the contradiction and the fix.
    """
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        for name in ("sp_size", "cp_size"):
            launched = int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1") or 1)
            wanted = getattr(request, name)
            if launched != wanted:
                raise ValueError(
                    f"the accelerate config sets parallelism_config {name}={launched} but the recipe has "
                    f"parallelism.{name}={wanted}; set parallelism.{name}={launched} in the recipe (the engine shards "
                    "from the recipe) or launch with another accelerate config"
                )
    if request.sp_size > 1:
        fields = [f for f in environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if f]
        owned = [f for f in fields if f in _DEEPSPEED_FIELDS_OWNED_BY_RECIPE]
        if owned:
            raise ValueError(
                f"parallelism.sp_size={request.sp_size} builds its own DeepSpeed ZeRO-3 config, but the accelerate "
                f"config sets {', '.join(owned)} in deepspeed_config (or mixed_precision); remove them, e.g. launch "
                "with recipes/accelerate/deepspeed_ulysses_cpu_2proc.yaml or deepspeed_ulysses_8gpu.yaml"
            )
        _check_deepspeed_command_line(request, environ)


# ``accelerate launch --use_deepspeed`` options that reach the processes as environment variables and that the
# recipe's own DeepSpeed config silently overrides (accelerate's DeepSpeedPlugin ignores them beside a config given
# by the script): the option, its variable, and the value that agrees with the recipe (None: any value conflicts).
_DEEPSPEED_COMMAND_LINE = (
    ("--zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", str(SP_ZERO_STAGE)),
    ("--offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
    ("--offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
    ("--gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", None),
    ("--gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", None),
    ("--deepspeed_config_file", "ACCELERATE_DEEPSPEED_CONFIG_FILE", None),
)


def _check_deepspeed_command_line(request: Any, environ: Mapping[str, str]) -> None:
    """Refuse ``accelerate launch --use_deepspeed --zero_stage 2 ...`` (and the like) under sequence parallelism:
    the recipe's ZeRO-3 config would win without a word, so the run would not be the one launched."""
    for option, variable, agreeing in _DEEPSPEED_COMMAND_LINE:
        value = environ.get(variable)
        if value is None or value == "" or (agreeing is not None and value.lower() == agreeing):
            continue
        if option == "--zero_stage":
            raise ValueError(
                f"accelerate launch sets DeepSpeed ZeRO stage {value} ({option}) but "
                f"parallelism.sp_size={request.sp_size} trains with ZeRO stage {SP_ZERO_STAGE} only (at stages 0-2 the "
                f"Trainer's SP loss scales gradients by sp_size); drop {option} (or pass {SP_ZERO_STAGE})"
            )
        raise ValueError(
            f"accelerate launch sets {option}={value}, which the recipe's DeepSpeed config under "
            f"parallelism.sp_size={request.sp_size} would silently override; drop {option} and set it in the recipe "
            "(train.gradient_accumulation_steps, train.max_grad_norm) if it has a key for it"
        )


def deepspeed_config(request: Any) -> dict[str, Any] | None:
    """The DeepSpeed config for ``TrainingArguments(deepspeed=...)`` under sequence parallelism, else None.

    ZeRO stage 3 (the stage whose gradients equal the 1-process gradients under the Trainer's
    sequence-parallel loss). Micro-batch, accumulation, clipping and precision are ``"auto"``, filled by
    the Trainer from the recipe. ``train_batch_size`` is left out: the Trainer would fill it as
    micro-batch x accumulation x all processes, while DeepSpeed counts only the data-parallel ones
    (processes / sp_size) and refuses the mismatch. The Trainer's own AdamW is used (hence
    ``zero_allow_untested_optimizer``), so the optimizer is the one of a run without DeepSpeed.
    """
    if request.sp_size <= 1:
        return None
    return {
        "zero_optimization": {"stage": SP_ZERO_STAGE, "stage3_gather_16bit_weights_on_model_save": True},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,
    }


def init_deepspeed_distributed() -> None:
    """Initialise DeepSpeed's process group (gloo without CUDA) before the Trainer prepares the model.

    accelerate registers Ulysses with transformers during ``prepare`` and DeepSpeed asserts there that
    ``deepspeed.comm`` is initialised; on CPU neither ``torchrun`` nor ``accelerate launch`` has done it
    by then (only a ZeRO-3 ``zero.Init`` model build would). Idempotent.
    """
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def validate_sp_heads(sp_size: int, num_attention_heads: int | None, num_key_value_heads: int | None) -> None:
    """Ulysses gives each rank ``1/sp_size`` of the attention heads: the query heads must divide by
    ``sp_size``, and the key-value heads must divide by it or divide it (they are then replicated).

    Raises:
        ValueError: one line naming the model's head counts and the fix.
    """
    if num_attention_heads is not None and num_attention_heads % sp_size:
        raise ValueError(f"parallelism.sp_size={sp_size} does not divide the model's {num_attention_heads} attention "
                         "heads (Ulysses splits heads over the ranks); use an sp_size that divides them")
    kv = num_key_value_heads
    if kv is not None and kv % sp_size and sp_size % kv:
        raise ValueError(f"parallelism.sp_size={sp_size} and the model's {kv} key-value heads do not divide one "
                         "another; use an sp_size that divides them or is a multiple of them")
