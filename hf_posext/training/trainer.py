"""The training engine: transformers' ``Trainer`` driven by a recipe (:class:`~hf_posext.training.config.TrainConfig`).

One function, :func:`train`, loads and patches the model, chooses the trainable weights (PEFT LoRA or
full), and runs :class:`PosextTrainer` (a plain ``transformers.Trainer`` subclass; TRL is not a
dependency and its ``SFTTrainer`` adds nothing this recipe needs) on whatever ``accelerate launch``
provides (one CPU process, several gloo processes, DDP, FSDP, DeepSpeed).

Output folder layout::

    OUT/train_config.yaml        the resolved config of the run (written once everything loaded)
    OUT/log.jsonl                one JSON line per logged step: step, loss, lr, grad_norm, tokens/s, ...
    OUT/checkpoint-<step>/       the Trainer's checkpoint (adapter or model weights, optimizer.pt,
                                 scheduler.pt, rng_state*.pth, trainer_state.json) plus
                                 trainable_extras.safetensors (LoRA with trained embeddings/norms),
                                 posext_run.json (config, processes) and checksums.json (sha256, last)
    OUT/adapter/                 PEFT adapter (LongLoRA norms/embeddings as PEFT modules_to_save), model card,
                                 posext_adapter.json (base, scaling, base weights) and checksums.json (last)
    OUT/merged/                  merged model + tokenizer (hf_posext.load / from_pretrained)
    OUT/scaling.json             the scaling (hf_posext.describe of the trained model)
    OUT/train_result.json        steps, final loss, tokens/s, wall time

Data order depends only on the sample counter (see :mod:`hf_posext.training.packing`) and the Trainer reads
it with a sequential sampler, so a run resumed from ``checkpoint-N`` (weights, optimizer, scheduler and
RNG states restored by the Trainer) continues exactly where the interrupted run was. Before resuming,
the checkpoint's checksums, step and config are checked (:mod:`hf_posext.training.checkpoints`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_posext.adapters import (
    AdapterMismatchError, apply_adapter, base_weights_fingerprints, check_base_weights, finish_adapter_folder,
    trained_module_names, write_adapter_record, write_trained_modules,
)
from hf_posext.core.errors import DamagedFileError
from hf_posext.core.locks import LOCK_NAME, hold_folder_on_main
from hf_posext.core.paths import check_output_folder
from hf_posext.text_sources import HELD_APART, check_exclusions, check_text_source, held_apart_books_read
from hf_posext.api import describe, patch
from hf_posext.core.version import VERSION
from hf_posext.training.checkpoints import (
    CHECKSUMS_FILE, RUN_FILE, CheckpointError, checkpoint_step, find_latest_checkpoint, read_run_info,
    verify_for_resume, write_checksums, write_json_atomic,
)
from hf_posext.training.config import ConfigError, TrainConfig, config_differences, config_from_dict
from hf_posext.training.model_card import adapter_model_card
from hf_posext.training.packing import collate_sequences, load_packed_sequences

__all__ = [
    "train", "TrainResult", "find_latest_checkpoint", "training_arguments", "training_loss", "PosextTrainer",
    "SequenceDataset", "collate_sequences", "load_run_config", "merge_adapter", "check_parallelism", "parallelism_arguments",
    "sequence_parallel_chunked_loss", "NonFiniteTrainingError",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "train_config.yaml"
LOG_FILE = "log.jsonl"
RESULT_FILE = "train_result.json"


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        output_dir: the run's folder.
        step: optimizer steps completed.
        finished: False when stopped early by ``stop_at_step``.
        final_loss: the last logged training loss.
        tokens_per_second: mean training throughput (all processes) over this invocation.
        seconds_per_step: mean wall time per optimizer step over this invocation.
        resumed_from: the checkpoint resumed from, if any.
        held_apart_read: the held-apart evaluation books (``hf_posext.text_sources.HELD_APART_BOOKS``) the training
            text includes; empty when it leaves them out.
    """

    output_dir: str
    step: int
    finished: bool
    final_loss: float | None
    tokens_per_second: float | None
    seconds_per_step: float | None
    resumed_from: str | None = None
    held_apart_read: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Recipe -> TrainingArguments, data, loss
# --------------------------------------------------------------------------------------------------


def _has_accelerator() -> bool:
    if hasattr(torch, "accelerator"):
        return bool(torch.accelerator.is_available())
    return torch.cuda.is_available()


def _precision(config: TrainConfig) -> str:
    """'bf16' or 'no' (fp32) for ``model.precision``; raises ConfigError for bf16 without a GPU."""
    if config.model.precision == "fp32":
        return "no"
    supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if config.model.precision == "bf16":
        if not torch.cuda.is_available():
            raise ConfigError("model.precision=bf16 needs a GPU with bfloat16 support; on CPU use model.precision=fp32 or auto.")
        return "bf16"
    return "bf16" if supported else "no"


def _scheduler(config: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The Trainer's ``lr_scheduler_type`` and ``lr_scheduler_kwargs`` for ``train.lr_schedule``/``min_lr_ratio``."""
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


def _checkpointing_arguments(enabled: bool) -> dict[str, Any]:
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
        # instead (see train()).
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
    mixed = _precision(config)
    schedule, schedule_kwargs = _scheduler(config)
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
        **_checkpointing_arguments(config.model.gradient_checkpointing),
        logging_strategy="steps",
        logging_steps=o.log_every,
        save_strategy="steps" if o.checkpoint_every else "no",
        save_steps=o.checkpoint_every or 1,
        save_total_limit=o.keep_last,
        report_to=list(o.report_to) or "none",
        # Also under DeepSpeed on CPU: with use_cpu off there, accelerate starts DeepSpeed without a process-group
        # backend and every process counts itself as process 0 of 1 (each would train on the same samples).
        use_cpu=not _has_accelerator(),
        remove_unused_columns=False,  # position_ids / attention_mask must reach the model
        label_names=["labels"],
        dataloader_num_workers=0,
        disable_tqdm=not progress,
        **parallelism_arguments(config),
    )


class SequenceDataset(torch.utils.data.Dataset):
    """Map-style view of :class:`~hf_posext.training.packing.PackedSequences`: item ``i`` is the ``i``-th sample
    of its infinite shuffled stream (with PoSE position ids), for as many samples as the run consumes.

    Read with a sequential sampler, the Trainer's per-process batching (process ``r`` takes the ``r``-th
    slice of each global micro-batch) gives exactly ``PackedSequences.batch``'s batches.

    ``first_sample`` shifts the stream (item ``i`` is sample ``first_sample + i``): a resumed sequence-parallel
    run starts there instead of having the Trainer skip batches.
    """

    def __init__(self, sequences: Any, num_samples: int, first_sample: int = 0) -> None:
        self.sequences = sequences
        self.num_samples = num_samples
        self.first_sample = first_sample

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.sequences.sample(self.first_sample + int(index))


def training_loss(model: Any, inputs: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor | int | None,
                  loss: str = "plain", chunk_size: int | None = None) -> torch.Tensor:
    """The training loss of one micro-batch: next-token cross-entropy summed over its tokens and divided by
    ``num_items_in_batch`` (the predicted tokens of the whole accumulated batch, all processes), or the
    micro-batch mean when that is None. ``loss="chunked"`` never builds the full logits
    (:mod:`hf_posext.lm.chunked_loss`); ``"plain"`` is the model's own loss over the full logits.
    """
    if loss == "chunked":
        from hf_posext.lm.chunked_loss import chunked_causal_lm_loss

        mean = chunked_causal_lm_loss(model, inputs, chunk_size=chunk_size)
        if num_items_in_batch is None:
            return mean
        shifted = inputs.get("shift_labels")  # given pre-shifted (context parallelism shards them)
        predicted = (shifted if shifted is not None else inputs["labels"][..., 1:]).ne(-100).sum()
        return mean * predicted / num_items_in_batch
    if num_items_in_batch is None:
        return model(**inputs, use_cache=False).loss
    return model(**inputs, use_cache=False, num_items_in_batch=num_items_in_batch).loss


def sequence_parallel_chunked_loss(accelerator: Any, model: Any, inputs: dict[str, torch.Tensor], parallelism: Any,
                                   chunk_size: int | None = None) -> torch.Tensor:
    """The chunked loss of one micro-batch under DeepSpeed Ulysses, never building a shard's full logits.

    Under Ulysses each of the ``sp_size`` ranks holds one shard of every sequence, with ``shift_labels``
    already shifted over the whole sequence (DeepSpeed's dataloader adapter). Each rank computes the mean
    chunked cross-entropy of its shard from its shard-local hidden states
    (:func:`~hf_posext.lm.chunked_loss.chunked_causal_lm_loss`); transformers' ``deepspeed_sp_compute_loss``
    then combines the ranks' losses exactly as for the Trainer's own sequence-parallel loss: a
    differentiable all-gather and the mean weighted by each shard's counted tokens. It is handed a forward
    that returns the chunked loss in place of the model's output, so the weighting is transformers' own.
    The gradients are those of the 1-process loss under ZeRO-3 (the only stage the recipes accept).

    Args:
        accelerator: the Trainer's accelerator.
        model: the (DeepSpeed-wrapped) model.
        inputs: one rank's shard: input_ids, position_ids, shift_labels (and labels, attention_mask).
        parallelism: accelerate's ``ParallelismConfig`` (sp_backend deepspeed, sp_size > 1).
        chunk_size: tokens per chunk of the loss.

    Returns:
        The loss of the whole micro-batch (the same value on every rank of the SP group).
    """
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    from hf_posext.lm.chunked_loss import DEFAULT_CHUNK_SIZE, chunked_causal_lm_loss

    def shard_loss(**shard: Any) -> SimpleNamespace:
        return SimpleNamespace(loss=chunked_causal_lm_loss(model, shard, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE))

    return deepspeed_sp_compute_loss(accelerator, shard_loss, dict(inputs), False, parallelism)


class NonFiniteTrainingError(RuntimeError):
    """The loss or the gradient norm of a step is not finite (NaN or infinite): training stopped at that step."""


def _nonfinite_message(step: int, what: str, value: float, output_dir: str) -> str:
    return (f"training stopped at step {step}: the {what} is {value} (not finite), so the step was not applied and no "
            f"adapter or model was saved. Check finetune.init_adapter and the data, lower train.learning_rate, or resume "
            f"from an earlier checkpoint in {output_dir} (hf-posext train --resume {output_dir}/checkpoint-N).")


class PosextTrainer(Trainer):
    """``transformers.Trainer`` with the recipe's data order, loss and LoRA extras.

    * The sampler is sequential: the order is already a seeded function of the sample counter, so the
      Trainer must not reshuffle (and a resumed run skips exactly the consumed samples).
    * :meth:`compute_loss` calls :func:`training_loss`, normalised over the tokens of the whole
      accumulated batch on all processes.
    * Checkpoints also hold the embeddings/norms trained in place beside a LoRA adapter
      (``trainable_extras.safetensors``), which PEFT's adapter save would drop; resuming reloads them.
    * A step whose gradient norm is not finite raises :class:`NonFiniteTrainingError` naming it, before the
      optimizer applies it (the norm is global, so every process stops at the same step).
    """

    def __init__(self, *args: Any, extra_parameter_names: list[str] | None = None, train_section: Any = None,
                 rng_state_from: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_section = train_section
        # A resumed sequence-parallel run does not skip batches (its dataset starts at the first unseen
        # sample), so the Trainer restores the RNG states before creating the dataloader iterator, which
        # draws a seed; reloading them at the first step puts them where the uninterrupted run had them.
        self.rng_state_from = rng_state_from
        self.extra_parameter_names = list(extra_parameter_names or [])
        # training_loss normalises by num_items_in_batch itself: have the Trainer count it and not divide again.
        self.model_accepts_loss_kwargs = True

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self.rng_state_from is not None:
            self._load_rng_state(self.rng_state_from)
            self.rng_state_from = None
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        value = float(grad_norm) if grad_norm is not None else 0.0
        if not torch.isfinite(torch.tensor(value)):
            raise NonFiniteTrainingError(_nonfinite_message(self.state.global_step + 1, "gradient norm", value, self.args.output_dir))
        return grad_norm

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        if return_outputs:
            raise NotImplementedError("PosextTrainer.compute_loss returns the loss only (no evaluation loop).")
        t = self.train_section
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and parallelism.sp_backend == "deepspeed" and parallelism.sp_enabled and model.training:
            if getattr(t, "loss", "plain") == "plain":  # transformers' deepspeed_sp_compute_loss, full shard logits
                return super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            return sequence_parallel_chunked_loss(self.accelerator, model, inputs, parallelism,
                                                  chunk_size=getattr(t, "loss_chunk_size", None))
        if getattr(t, "loss_average", "tokens") == "sequences":
            return self.sequence_mean_loss(model, inputs, divide=num_items_in_batch is not None)
        loss = training_loss(model, inputs, num_items_in_batch, loss=getattr(t, "loss", "plain"),
                             chunk_size=getattr(t, "loss_chunk_size", None))
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # gradients are averaged over processes afterwards
        return loss

    def sequence_mean_loss(self, model: Any, inputs: dict[str, Any], divide: bool = True) -> torch.Tensor:
        """``train.loss_average=sequences``: this micro-batch's share of the mean over the optimizer step's
        sequences of each sequence's mean loss.

        The micro-batch's sequence mean is divided by the micro-batches of the step, so the accumulated
        gradient is that of the step's sequence mean on this process; DDP's gradient average over processes
        (equal micro-batch sizes) completes it over all processes. ``divide=False`` leaves the division to
        the Trainer (it divides a loss by the micro-batches itself when it counted no ``num_items_in_batch``).
        """
        from hf_posext.lm.chunked_loss import DEFAULT_CHUNK_SIZE, sequence_mean_causal_lm_loss

        t = self.train_section
        mean = sequence_mean_causal_lm_loss(model, {**inputs, "use_cache": False}, loss=getattr(t, "loss", "plain"),
                                            chunk_size=getattr(t, "loss_chunk_size", None) or DEFAULT_CHUNK_SIZE)
        if not divide:
            return mean
        steps = getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps
        return mean / steps

    def _extras_base(self) -> Any:
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        from safetensors.torch import save_file

        from hf_posext.adapters import EXTRAS_FILE

        super()._save(output_dir, state_dict=state_dict)
        if self.extra_parameter_names and self.args.should_save:
            parameters = dict(self._extras_base().named_parameters())
            gathered = state_dict or {}  # under ZeRO-3 the parameters are partitioned: read the gathered copy
            extras = {n: gathered.get(f"base_model.model.{n}", parameters[n]).detach().cpu().clone().contiguous()
                      for n in self.extra_parameter_names}
            save_file(extras, os.path.join(output_dir or self.args.output_dir, EXTRAS_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        from hf_posext.adapters import EXTRAS_FILE, load_trainable_extras

        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        if self.extra_parameter_names and not load_trainable_extras(self._extras_base(), resume_from_checkpoint):
            raise CheckpointError(f"Checkpoint {resume_from_checkpoint} lacks {EXTRAS_FILE} (the trained embeddings/norms).")

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # A checkpoint of an abandoned continuation (the run was resumed from an earlier one) is kept
        # under another name rather than overwritten.
        final = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        if self.args.should_save and final.exists():
            number = 1
            while final.with_name(f"{final.name}.superseded-{number}").exists():
                number += 1
            final.rename(final.with_name(f"{final.name}.superseded-{number}"))
        self.accelerator.wait_for_everyone()
        super()._save_checkpoint(model, trial)


class CheckpointIntegrityCallback(TrainerCallback):
    """After every checkpoint save: record the run (``posext_run.json``), then write ``checksums.json`` last."""

    def __init__(self, run_info: dict[str, Any]) -> None:
        self.run_info = run_info

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # every process has written its RNG state
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_json_atomic(folder / RUN_FILE, {**self.run_info, "step": state.global_step})
            write_checksums(folder)
        PartialState().wait_for_everyone()


class JsonlLogCallback(TrainerCallback):
    """Append one JSON line per logged step to ``log.jsonl`` (main process): step, loss, lr, grad_norm, tokens/s."""

    def __init__(self, path: Path, tokens_per_step: int) -> None:
        self.path = path
        self.tokens_per_step = tokens_per_step
        self.step_began = time.perf_counter()
        self.cpu_began = time.process_time()
        self.last_step_seconds = float("nan")
        self.last_cpu_seconds = float("nan")
        self.last_loss: float | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_began, self.cpu_began = time.perf_counter(), time.process_time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_step_seconds = time.perf_counter() - self.step_began
        self.last_cpu_seconds = time.process_time() - self.cpu_began

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        self.last_loss = float(logs["loss"])
        nonfinite = [(k, float(logs[k])) for k in ("loss", "grad_norm") if k in logs and not torch.isfinite(torch.tensor(float(logs[k])))]
        if state.is_world_process_zero:
            self.write_row(state, logs)
        if nonfinite:  # the logged values are gathered over processes: every process stops here
            what, value = nonfinite[0]
            raise NonFiniteTrainingError(_nonfinite_message(state.global_step, "logged " + ("loss" if what == "loss" else "gradient norm"),
                                                            value, args.output_dir))

    def write_row(self, state: Any, logs: dict[str, Any]) -> None:
        """Append the step's JSON line to ``log.jsonl``."""
        record = {
            "step": state.global_step, "loss": float(logs["loss"]), "lr": float(logs.get("learning_rate", float("nan"))),
            "grad_norm": float(logs.get("grad_norm", float("nan"))),
            "tokens_per_second": self.tokens_per_step / self.last_step_seconds, "seconds_per_step": self.last_step_seconds,
            # CPU time of this process (all its threads): on a shared machine it shows the cost of a step
            # independently of how much of the CPU other jobs took.
            "process_cpu_seconds": self.last_cpu_seconds,
            "tokens_seen": state.global_step * self.tokens_per_step, "time": time.time(),
        }
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


class StopAtStepCallback(TrainerCallback):
    """Stop after optimizer step ``stop_at_step`` (checkpoints due at or before it are still written)."""

    def __init__(self, stop_at_step: int) -> None:
        self.stop_at_step = stop_at_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.stop_at_step:
            control.should_training_stop = True
        return control


# --------------------------------------------------------------------------------------------------
# Output folder, resume
# --------------------------------------------------------------------------------------------------


def _resolve_resume(resume: str | os.PathLike | bool, output_dir: Path) -> Path:
    folder = output_dir if resume is True else Path(resume)
    if checkpoint_step(folder) is not None and folder.is_dir():
        return folder  # named explicitly: verified as it is, never replaced by another
    latest = find_latest_checkpoint(folder, complete=True)
    unfinished = find_latest_checkpoint(folder)
    if unfinished is not None and unfinished != latest:
        logger.warning("%s has no %s (its save did not finish, e.g. the run was killed while saving): resuming from %s "
                       "instead.", unfinished, CHECKSUMS_FILE, latest or "nothing")
    if latest is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint found in {folder} (looked for {folder}/checkpoint-*). "
            "Point --resume at a run folder or one of its checkpoints, or start without --resume."
        )
    return latest


def _prepare_output_dir(output_dir: Path, overwrite: bool, resuming: bool) -> None:
    """Check (every process) that the run may use ``output_dir``; raise before anything is written."""
    if output_dir.is_file():
        raise FileExistsError(f"output.dir {output_dir} is a file; choose a folder path.")
    try:
        check_output_folder(output_dir, "output.dir", "the run")
    except ValueError as error:
        raise FileExistsError(str(error)) from None
    if resuming or not output_dir.exists():
        return
    if not any(entry.name != LOCK_NAME for entry in output_dir.iterdir()):  # empty, or held by a run (refused next)
        return
    if not overwrite:
        raise FileExistsError(
            f"The output folder {output_dir} already exists and is not empty. Pass --overwrite to delete it and "
            "start over, --resume to continue the run in it, or choose another output.dir."
        )
    if not (output_dir / CONFIG_FILE).is_file():
        raise FileExistsError(
            f"--overwrite refuses to delete {output_dir}: it holds no {CONFIG_FILE}, so it is not a training "
            "run folder. Choose another output.dir."
        )


def _all_refusals(refusal: str) -> list[str]:
    """Every process's refusal (one process: this one's)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [refusal]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, refusal)
    return gathered


def _check_resumable(resume_from: Path, config: TrainConfig, world: int) -> None:
    """Refuse a corrupt checkpoint (naming an older intact one), one made by a different config, or with another
    number of processes."""
    verify_for_resume(resume_from)
    saved = read_run_info(resume_from)
    differences = config_differences(saved["config"], config.to_dict())
    if differences:
        raise ConfigError(
            f"Cannot resume from {resume_from}: it was made by a different config ("
            + "; ".join(differences)
            + "). Resume with the original config, or start a new run in another output.dir."
        )
    if saved.get("num_processes", world) != world:
        raise ConfigError(
            f"{resume_from} was written by a run with {saved['num_processes']} processes; resume it with the "
            f"same number (now {world}) so every process sees the same data as before."
        )


def _check_trackers(report_to: list[str]) -> None:
    import importlib.util

    modules = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for tracker in report_to:
        if importlib.util.find_spec(modules[tracker]) is None:
            raise ImportError(f"output.report_to lists {tracker!r} but it is not installed: pip install {modules[tracker]} (or drop it from output.report_to).")


def _load_base(config: TrainConfig, dtype: torch.dtype):
    from hf_posext.models import load_model

    kwargs: dict[str, Any] = {"attn_implementation": config.model.attn_implementation}
    if config.model.trust_remote_code:
        kwargs["trust_remote_code"] = True
    kwargs.update(config.model.config_overrides)
    return load_model(config.model.name, dtype=dtype, **kwargs)


def _load_and_patch(config: TrainConfig, dtype: torch.dtype):
    model = _load_base(config, dtype)
    patch(model, **config.scaling.to_request().patch_kwargs())
    return model


def _pose_target(config: TrainConfig, scaled_window: int) -> int | None:
    d = config.data
    if not d.pose:
        if d.sequence_length > scaled_window:
            raise ConfigError(
                f"data.sequence_length ({d.sequence_length}) is longer than the scaled window ({scaled_window} "
                "tokens). Lower data.sequence_length or raise the scaling factor."
            )
        return None
    target = d.pose_target_length or scaled_window
    if target > scaled_window:
        raise ConfigError(
            f"data.pose_target_length ({target}) exceeds the scaled window ({scaled_window}); positions past the "
            "window are outside what the scaling was set up for. Raise scaling.factor or lower the PoSE target."
        )
    if d.sequence_length > target:
        raise ConfigError(
            f"data.sequence_length ({d.sequence_length}) is longer than the PoSE target ({target}): a training "
            "sequence must be shorter than the context it simulates. Lower data.sequence_length."
        )
    return target


def _truncate_log(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def _save_final(config: TrainConfig, accelerator: Any, model: Any, tokenizer: Any, output_dir: Path, dtype: torch.dtype,
                base_weights: dict[str, str] | None = None) -> None:
    """Write adapter/, merged/ and scaling.json (each through a temporary folder and a rename).

    The adapter is PEFT's own save of the LoRA weights, then the norms/embeddings trained in place added as PEFT
    ``modules_to_save`` (:func:`hf_posext.adapters.write_trained_modules`), the record, the model card and last
    the manifest; the merged model holds the tokenizer.
    """
    from hf_posext.models import hub_id
    from hf_posext.training.lora import extra_parameter_names

    state_dict = accelerator.get_state_dict(model)  # collective under FSDP/DeepSpeed
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    unwrapped = accelerator.unwrap_model(model)

    def publish(name: str, write) -> Path:
        final = output_dir / name
        temporary = output_dir / f".tmp-{name}"
        if temporary.exists():
            shutil.rmtree(temporary)
        temporary.mkdir(parents=True)
        write(temporary)
        if final.exists():
            shutil.rmtree(final)  # a previous final save of this same run (re-run after --resume)
        os.rename(temporary, final)
        return final

    if config.finetune.mode == "lora":
        base_names = extra_parameter_names(unwrapped.get_base_model(), config.finetune.train_embeddings, config.finetune.train_norms)

        def write_adapter(folder: Path) -> None:
            unwrapped.save_pretrained(str(folder), state_dict=state_dict)
            prefix = "base_model.model."
            extras = {n: state_dict[prefix + n].detach().cpu().contiguous() for n in base_names if prefix + n in state_dict}
            modules, tied = trained_module_names(unwrapped.get_base_model(), sorted(extras)) if extras else ([], None)
            write_trained_modules(folder, extras, modules, tied, hub_id(config.model.name))
            # what the adapter was trained on, checked whenever it is applied again (hf_posext.adapters)
            record = write_adapter_record(folder, config.model.name, describe(unwrapped.get_base_model()), base_weights)
            (folder / "README.md").write_text(adapter_model_card(config, json.loads(record.read_text()), output_dir / "log.jsonl"))
            finish_adapter_folder(folder)

        adapter_dir = publish("adapter", write_adapter)
        if config.output.save_merged:
            publish("merged", lambda folder: merge_adapter(config, adapter_dir, folder, dtype, tokenizer))
    else:
        def write_full(folder: Path) -> None:
            unwrapped.save_pretrained(str(folder), state_dict=state_dict)
            save_tokenizer_for(unwrapped, tokenizer, folder)

        publish("merged", write_full)
    report = describe(unwrapped.get_base_model() if config.finetune.mode == "lora" else unwrapped)
    write_json_atomic(output_dir / "scaling.json", report.to_dict())
    accelerator.wait_for_everyone()


def merge_adapter(config: TrainConfig, adapter_dir: Path, out_dir: Path, dtype: torch.dtype, tokenizer: Any | None = None) -> None:
    """Rebuild the patched base model, apply a saved adapter (+ extras), merge it, and save to ``out_dir``
    with ``tokenizer`` (``model_max_length`` = the scaled window).

    Working from the saved adapter (not the live training model) makes the merged model the same on
    one process, DDP, FSDP or DeepSpeed, and checks that the adapter files are complete.
    """
    base = _load_and_patch(config, dtype)
    merged = apply_adapter(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    if tokenizer is not None:
        save_tokenizer_for(merged, tokenizer, out_dir)


def save_tokenizer_for(model: Any, tokenizer: Any, folder: str | Path) -> None:
    """Save ``tokenizer`` next to ``model`` with ``model_max_length`` = the model's extended window
    (serving runtimes cap their length there; docs/serving.md)."""

    tokenizer.model_max_length = describe(model).current_window
    tokenizer.save_pretrained(str(folder))


def train(
    config: TrainConfig,
    *,
    resume: str | os.PathLike | bool | None = None,
    overwrite: bool = False,
    stop_at_step: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Run a training recipe with :class:`PosextTrainer` under the current accelerate environment.

    Everything that can fail on bad input (config, checkpoint integrity, model, LoRA targets, data) is
    checked before the output folder is created or touched.

    Args:
        config: a validated :class:`~hf_posext.training.config.TrainConfig`.
        resume: ``True`` to continue from the latest checkpoint in ``output.dir``; a path to continue
            from that checkpoint (or that run folder's latest); None/False to start fresh.
        overwrite: allow deleting an existing run folder at ``output.dir`` (fresh start only).
        stop_at_step: stop after this optimizer step, without the final save, as an interruption would
            (checkpoints due at or before it are written). For tests and time-boxed runs.
        progress: show progress bars (main process only).

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: invalid config, training sequence longer than the target, resuming with a different config.
        CheckpointError: the checkpoint to resume from is incomplete, altered or corrupt.
        FileExistsError: the output folder exists and neither ``overwrite`` nor ``resume`` was given.
        FileNotFoundError: missing data or checkpoint.
        LoraTargetError: a LoRA target module the model does not have.
    """
    from hf_posext.models import load_tokenizer
    from hf_posext.training.lora import check_init_adapter, extra_parameter_names, setup_trainable
    from hf_posext.training.retrieval_data import retrieval_records_for

    config.validate()
    check_parallelism(config)
    if config.finetune.init_adapter is not None:  # checked before anything loads
        try:
            s = config.scaling
            check_init_adapter(config.finetune, config.model.name, s.method, s.factor, s.target_length,
                               s.original_max_position_embeddings, s.params)
        except DamagedFileError as error:  # a damaged file stays a runtime error (exit 1), named
            raise type(error)(f"finetune.init_adapter: {error}") from None
        except ValueError as error:  # AdapterMismatchError, RecordError, another LoRA shape
            raise ConfigError(f"finetune.init_adapter: {error}") from None
    try:  # an exclusion that leaves out nothing (a typo) or everything, before anything loads
        check_exclusions(config.data.source, config.data.exclude)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:  # a missing path or a file that is not text is refused before the model loads
        check_text_source(config.data.source, exclude=config.data.exclude)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"data.source: {error}") from None
    except ValueError as error:
        raise ConfigError(f"data.source: {error}") from None
    held_apart_read = held_apart_books_read(config.data.source, config.data.exclude)
    if held_apart_read:  # evaluations would score text the model has seen: said once, recorded with the run
        warnings.warn(f"data: the training text includes the held-apart evaluation book{'s' if len(held_apart_read) > 1 else ''} "
                      f"{', '.join(held_apart_read)}, which the perplexity and needle evaluations score; add "
                      f"{HELD_APART} to data.exclude to leave {'them' if len(held_apart_read) > 1 else 'it'} out.",
                      UserWarning, stacklevel=2)
    output_dir = Path(config.output.dir)
    args = training_arguments(config, output_dir, progress=progress)
    world = args.world_size
    main = args.process_index == 0
    resume_from = _resolve_resume(resume, output_dir) if resume else None
    if resume_from is not None:
        _check_resumable(resume_from, config, world)
    tokenizer = load_tokenizer(config.model.name)
    try:  # before the output folder is touched and the model loads
        retrieval = retrieval_records_for(config.data, tokenizer)
    except ValueError as error:  # a tokenizer without the chat template that data.retrieval_chat needs
        raise ConfigError(f"data.retrieval_chat: {error}") from None
    if retrieval is not None:
        try:
            retrieval.check_fits(config.data.sequence_length)
        except ValueError as error:
            raise ConfigError(f"data.retrieval_records: {error}") from None
    _prepare_output_dir(output_dir, overwrite, resuming=resume_from is not None)
    _check_trackers(config.output.report_to)
    # one run writes a run folder at a time: a second (a job started again while the first still runs) would mix
    # its checkpoints into the first's, or delete them with --overwrite
    with contextlib.ExitStack() as held:
        hold_folder_on_main(held, output_dir, "output.dir", "the run", main=main, share=_all_refusals)

        t, p = config.train, config.parallelism
        dtype = torch.bfloat16 if (args.bf16 and config.finetune.mode == "lora") else torch.float32
        model = _load_base(config, dtype)
        # the base weights an adapter is trained on, recorded with it and checked wherever it is applied
        base_weights = base_weights_fingerprints(model) if config.finetune.mode == "lora" else None
        if config.finetune.init_adapter is not None:
            try:
                check_base_weights(config.finetune.init_adapter, model, config.model.name)
            except AdapterMismatchError as error:
                raise ConfigError(f"finetune.init_adapter: {error}") from None
        patch(model, **config.scaling.to_request().patch_kwargs())
        if p.sequence_parallel:
            from hf_posext.training.parallel import validate_sp_heads

            try:
                validate_sp_heads(p.sp_size, model.config.num_attention_heads,
                                  getattr(model.config, "num_key_value_heads", None))
            except ValueError as error:
                raise ConfigError(str(error)) from None
        pose_target = _pose_target(config, describe(model).current_window)
        model.config.use_cache = False
        extras = extra_parameter_names(model, config.finetune.train_embeddings, config.finetune.train_norms) if config.finetune.mode == "lora" else []
        model = setup_trainable(model, config.finetune, seed=t.seed)
        if t.loss == "chunked":
            from hf_posext.lm.chunked_loss import check_output_head

            try:
                check_output_head(model)
            except ValueError as error:
                raise ConfigError(f"train.loss=chunked: {error}") from None
        data = load_packed_sequences(config.data, tokenizer, t.seed, pose_target, progress=progress and main)

        # Everything loaded: only now create (or clear) the run folder and record the config.
        if resume_from is None and main:
            # --overwrite on a run folder (allowed by _prepare_output_dir): clear it, all but the lock this run holds
            for entry in list(output_dir.iterdir()) if output_dir.exists() else []:
                if entry.name == LOCK_NAME:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / CONFIG_FILE).write_text(
                f"# written by hf_posext.training at the start of the run; resume with --config {CONFIG_FILE}\n" + config.to_yaml()
            )
        if resume_from is not None and main:
            _truncate_log(output_dir / LOG_FILE, checkpoint_step(resume_from))

        # The processes of one sequence- or context-parallel group share each sample: the data-parallel ranks are
        # world / (sp_size x cp_size), as the Trainer counts them.
        samples_per_step = t.batch_size * t.gradient_accumulation_steps * world // (p.sp_size * p.cp_size)
        tokens_per_step = samples_per_step * data.sequence_length
        run_info = {
            "num_processes": world, "fingerprint": config.fingerprint(), "config": config.to_dict(),
            "hf_posext_version": VERSION, "samples_per_step": samples_per_step, "held_apart_read": held_apart_read,
        }
        log_callback = JsonlLogCallback(output_dir / LOG_FILE, tokens_per_step)
        callbacks: list[TrainerCallback] = [log_callback, CheckpointIntegrityCallback(run_info)]
        if stop_at_step is not None:
            callbacks.append(StopAtStepCallback(stop_at_step))
        start_step = checkpoint_step(resume_from) if resume_from is not None else 0
        skip_in_dataset = p.sequence_parallel and resume_from is not None  # see parallelism_arguments
        if p.sequence_parallel:
            from hf_posext.training.parallel import init_deepspeed_distributed

            init_deepspeed_distributed()
        trainer = PosextTrainer(
            model=model, args=args,
            train_dataset=SequenceDataset(data, t.max_steps * samples_per_step,
                                        first_sample=start_step * samples_per_step if skip_in_dataset else 0),
            data_collator=collate_sequences, callbacks=callbacks, extra_parameter_names=extras, train_section=t,
            rng_state_from=str(resume_from) if skip_in_dataset else None,
        )
        began = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
        elapsed = time.perf_counter() - began
        step = trainer.state.global_step
        finished = step >= t.max_steps
        done = step - start_step
        result = TrainResult(
            output_dir=str(output_dir), step=step, finished=finished, final_loss=log_callback.last_loss,
            tokens_per_second=(done * tokens_per_step / elapsed) if done else None,
            seconds_per_step=(elapsed / done) if done else None,
            resumed_from=str(resume_from) if resume_from else None, held_apart_read=held_apart_read,
        )
        if finished:
            _save_final(config, trainer.accelerator, trainer.model_wrapped, tokenizer, output_dir, dtype, base_weights)
            if main:
                write_json_atomic(output_dir / RESULT_FILE, result.__dict__)
        trainer.accelerator.wait_for_everyone()
        return result


def load_run_config(folder: str | os.PathLike) -> TrainConfig:
    """The config a run folder (or one of its checkpoints) was made with."""
    folder = Path(folder)
    checkpoint = folder if checkpoint_step(folder) is not None else find_latest_checkpoint(folder)
    if checkpoint is not None and (checkpoint / RUN_FILE).is_file():
        return config_from_dict(read_run_info(checkpoint)["config"]).validate()
    from hf_posext.training.config import load_config

    if (folder / CONFIG_FILE).is_file():
        return load_config(folder / CONFIG_FILE)
    raise FileNotFoundError(f"{folder} holds no checkpoint and no {CONFIG_FILE}: not a training run folder.")
