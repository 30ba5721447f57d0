"""Recipe -> ``transformers.TrainingArguments``: the one place that maps a :class:`~hf_posext.training.config.TrainConfig`
onto the Trainer's arguments (precision, schedule, checkpointing, parallelism, trackers), and the checks of what
this launch can run, made before anything loads.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainingArguments

from hf_posext.training.config import ConfigError, TrainConfig

__all__ = [
    "has_accelerator", "mixed_precision", "training_dtype", "lr_schedule_arguments", "checkpointing_arguments", "check_parallelism",
    "parallelism_arguments", "training_arguments", "check_trackers",
]


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (CUDA, MPS, XPU, ...); the Trainer then runs on it, else on CPU."""
    if hasattr(torch, "accelerator"):
        return bool(torch.accelerator.is_available())
    return torch.cuda.is_available()


def mixed_precision(config: TrainConfig) -> str:
    """The Trainer's mixed precision for ``model.precision``: ``'bf16'`` or ``'no'`` (fp32).

    Raises:
        ConfigError: ``model.precision=bf16`` without a GPU that supports bfloat16.
    """
    if config.model.precision == "fp32":
        return "no"
    supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if config.model.precision == "bf16":
        if not torch.cuda.is_available():
            raise ConfigError("model.precision=bf16 needs a GPU with bfloat16 support; on CPU use model.precision=fp32 or auto.")
        return "bf16"
    return "bf16" if supported else "no"


def training_dtype(config: TrainConfig) -> tuple[str, str]:
    """The dtype a run of ``config`` trains in, and why, in words (``hf-posext train`` prints it first).

    Follows :func:`mixed_precision` and the trainer's loading: under bf16 mixed precision a LoRA run loads its frozen
    base weights in bfloat16; a full fine-tune keeps float32 weights and computes in bfloat16.

    Raises:
        ConfigError: ``model.precision=bf16`` without a GPU that supports bfloat16 (as :func:`mixed_precision`).
    """
    precision = config.model.precision
    if mixed_precision(config) == "no":
        if precision == "fp32":
            return "float32", "model.precision: fp32"
        return "float32", ("model.precision: auto, and no GPU with bfloat16 here (bfloat16 training needs one); "
                           "model.precision=fp32 says so in the recipe")
    given = "model.precision: bf16" if precision == "bf16" else "model.precision: auto, and this GPU supports bfloat16"
    if config.finetune.mode == "lora":
        return "bfloat16", f"{given}: bf16 mixed precision, the frozen base weights loaded in bfloat16"
    return "float32 weights, bfloat16 compute", f"{given}: bf16 mixed precision"


def lr_schedule_arguments(config: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The Trainer's ``lr_scheduler_type`` and ``lr_scheduler_kwargs`` for ``train.lr_schedule``/``min_lr_ratio``.

    Raises:
        ConfigError: a linear schedule with a floor (``min_lr_ratio > 0``), which the Trainer cannot express.
    """
    t = config.train
    if t.lr_schedule == "constant":
        return "constant_with_warmup", {}
    if t.lr_schedule == "cosine":
        if t.min_lr_ratio > 0:
            return "cosine_with_min_lr", {"min_lr_rate": t.min_lr_ratio}
        return "cosine", {}
    if t.min_lr_ratio > 0:
        raise ConfigError(
            f"train.lr_schedule=linear with train.min_lr_ratio={t.min_lr_ratio}: the Trainer's linear schedule decays to 0. "
            "Use lr_schedule=cosine for a floor, or set min_lr_ratio=0."
        )
    return "linear", {}


def checkpointing_arguments(enabled: bool) -> dict[str, Any]:
    """Activation (gradient) checkpointing arguments, under the name this transformers version uses."""
    name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"
    return {name: enabled, f"{name}_kwargs": {"use_reentrant": False} if enabled else None}


def check_parallelism(config: TrainConfig, environ: dict[str, str] | None = None) -> None:
    """Refuse the recipe's ``parallelism`` section where this launch cannot run it (before anything loads).

    Checks the number of launched processes (``WORLD_SIZE``), the sequence length, the attention
    implementation, DeepSpeed being installed, CUDA for context parallelism, and that the accelerate
    config of the launch does not contradict the recipe (:mod:`hf_posext.training.parallel`).

    Raises:
        ConfigError: one line naming the problem and the fix.
    """
    from hf_posext.training.parallel import check_launch_environment, validate_parallelism

    environ = dict(os.environ) if environ is None else environ
    p = config.parallelism
    try:
        validate_parallelism(
            p, num_processes=int(environ.get("WORLD_SIZE", "1")), sequence_length=config.data.sequence_length,
            attn_implementation=config.model.attn_implementation, zero_stage=p.zero_stage,
            cuda_available=torch.cuda.is_available(),
        )
        check_launch_environment(p, environ)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def parallelism_arguments(config: TrainConfig, num_processes: int | None = None) -> dict[str, Any]:
    """``parallelism_config`` (accelerate) and ``deepspeed`` (ZeRO-3 under Ulysses) for ``TrainingArguments``.

    ``num_processes`` (default: ``WORLD_SIZE``) beyond one sp/cp group are data parallel: 4 processes at
    sp_size=2 train 2 groups on different samples (see :func:`~hf_posext.training.parallel.accelerate_parallelism_config`).
    """
    from hf_posext.training.parallel import accelerate_parallelism_config, deepspeed_config

    p = config.parallelism
    if not (p.sequence_parallel or p.context_parallel):
        return {}
    arguments: dict[str, Any] = {
        "parallelism_config": accelerate_parallelism_config(p, config.model.attn_implementation, num_processes)}
    if p.sequence_parallel:
        arguments["deepspeed"] = deepspeed_config(p)
        # The Trainer skips the batches of a resumed run with accelerate's skip_first_batches, which cannot
        # see through DeepSpeed's Ulysses dataloader adapter; the dataset starts at the first unseen sample
        # instead (see hf_posext.training.trainer.build_trainer).
        arguments["ignore_data_skip"] = True
    return arguments


def training_arguments(config: TrainConfig, output_dir: str | os.PathLike, *, progress: bool = True) -> TrainingArguments:
    """Map a recipe onto ``transformers.TrainingArguments`` (the one place that does, parallelism included).

    Under ``parallelism.sp_size > 1`` the arguments carry accelerate's ``ParallelismConfig`` (DeepSpeed
    Ulysses) and a DeepSpeed ZeRO-3 config; under ``cp_size > 1`` the ``ParallelismConfig`` of torch
    context parallelism (FSDP2 comes from the accelerate config of the launch).

    Args:
        config: a validated recipe.
        output_dir: the run folder (checkpoints go to ``output_dir/checkpoint-<step>``).
        progress: show the Trainer's tqdm bar.

    Raises:
        ConfigError: a combination the Trainer cannot express (linear decay to a floor, bf16 on CPU). Whether
            this launch can run the recipe's parallelism is :func:`check_parallelism`'s question.
    """
    t, o = config.train, config.output
    mixed = mixed_precision(config)
    schedule, schedule_kwargs = lr_schedule_arguments(config)
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=schedule,
        lr_scheduler_kwargs=schedule_kwargs,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        optim="adamw_torch",
        max_grad_norm=t.max_grad_norm if t.max_grad_norm is not None else 0.0,  # 0: no clipping
        seed=t.seed,
        data_seed=t.seed,
        bf16=mixed == "bf16",
        **checkpointing_arguments(config.model.gradient_checkpointing),
        logging_strategy="steps",
        logging_steps=o.log_every,
        save_strategy="steps" if o.checkpoint_every else "no",
        save_steps=o.checkpoint_every or 1,
        save_total_limit=o.keep_last,
        report_to=list(o.report_to) or "none",
        # Also under DeepSpeed on CPU: with use_cpu off there, accelerate starts DeepSpeed without a process-group
        # backend and every process counts itself as process 0 of 1 (each would train on the same samples).
        use_cpu=not has_accelerator(),
        remove_unused_columns=False,  # position_ids / attention_mask must reach the model
        label_names=["labels"],
        dataloader_num_workers=0,
        disable_tqdm=not progress,
        **parallelism_arguments(config),
    )


def check_trackers(report_to: list[str]) -> None:
    """Refuse an ``output.report_to`` tracker that is not installed (before the run folder is touched).

    Raises:
        ImportError: naming the tracker and the ``pip install`` that provides it.
    """
    import importlib.util

    modules = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for tracker in report_to:
        if importlib.util.find_spec(modules[tracker]) is None:
            raise ImportError(f"output.report_to lists {tracker!r} but it is not installed: pip install {modules[tracker]} (or drop it from output.report_to).")
