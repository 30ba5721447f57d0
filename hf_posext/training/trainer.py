"""Training a recipe (:class:`~hf_posext.training.config.TrainConfig`) on transformers' ``Trainer``.

:func:`train` loads and patches the model, chooses the trainable weights (PEFT LoRA or full), and runs
:class:`~hf_posext.training.engine.PosextTrainer` on whatever ``accelerate launch`` provides (one CPU process,
several gloo processes, DDP, FSDP, DeepSpeed). It reads as its phases; each lives where its concern does:

* :mod:`hf_posext.training.arguments`: recipe -> ``TrainingArguments``, and what this launch can run;
* :mod:`hf_posext.training.run_folder`: the output folder, the checkpoint to resume from, the run's start;
* :mod:`hf_posext.training.loading`: the base model, loaded and patched;
* :mod:`hf_posext.training.engine`: the Trainer subclass, its dataset, losses and callbacks;
* :mod:`hf_posext.training.outputs`: adapter, merged model, tokenizer and scaling at the end.

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
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import TrainerCallback, TrainingArguments

from hf_posext.adapters import AdapterMismatchError, base_weights_fingerprints, check_base_weights
from hf_posext.api import describe, patch
from hf_posext.core.errors import DamagedFileError
from hf_posext.core.locks import hold_folder_on_main
from hf_posext.core.version import VERSION
from hf_posext.text_sources import HELD_APART, check_exclusions, check_text_source, held_apart_books_read
from hf_posext.training.arguments import (
    check_parallelism, check_trackers, parallelism_arguments, training_arguments,
)
from hf_posext.training.checkpoints import checkpoint_step, find_latest_checkpoint, write_json_atomic
from hf_posext.training.config import ConfigError, TrainConfig
from hf_posext.training.engine import (
    CheckpointIntegrityCallback, JsonlLogCallback, NonFiniteTrainingError, PosextTrainer, SequenceDataset,
    StopAtStepCallback, sequence_parallel_chunked_loss, training_loss,
)
from hf_posext.training.loading import load_base_model
from hf_posext.training.outputs import merge_adapter, save_outputs, save_tokenizer_for  # noqa: F401 (re-exported)
from hf_posext.training.packing import collate_sequences, load_packed_sequences
from hf_posext.training.run_folder import (  # noqa: F401 (CONFIG_FILE, load_run_config: re-exported)
    CONFIG_FILE, LOG_FILE, RESULT_FILE, all_refusals, check_resumable, load_run_config, prepare_output_dir,
    resolve_resume, start_run_folder,
)

__all__ = [
    "train", "TrainResult", "find_latest_checkpoint", "training_arguments", "training_loss", "PosextTrainer",
    "SequenceDataset", "collate_sequences", "load_run_config", "merge_adapter", "check_parallelism", "parallelism_arguments",
    "sequence_parallel_chunked_loss", "NonFiniteTrainingError",
]


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


@dataclass
class TrainableModel:
    """The patched model, set up for training (LoRA or full), and what the run needs to know about it.

    Attributes:
        model: the model handed to the Trainer (a PEFT model under LoRA).
        dtype: the dtype its weights were loaded in (the merged model is rebuilt in it).
        base_weights: fingerprints of the base weights (LoRA), recorded with the adapter.
        extra_parameter_names: embeddings/norms trained in place beside a LoRA adapter.
        pose_target: the context length PoSE position ids span, or None without PoSE.
    """

    model: Any
    dtype: torch.dtype
    base_weights: dict[str, str] | None
    extra_parameter_names: list[str]
    pose_target: int | None


@dataclass
class PreparedTrainer:
    """A :class:`PosextTrainer` ready to run, with the numbers its result is computed from.

    Attributes:
        trainer: the Trainer.
        log: the callback that writes ``log.jsonl`` and keeps the last loss.
        start_step: the step the run starts at (the resumed checkpoint's, else 0).
        tokens_per_step: tokens per optimizer step over all processes.
    """

    trainer: PosextTrainer
    log: JsonlLogCallback
    start_step: int
    tokens_per_step: int


def train(
    config: TrainConfig,
    *,
    resume: str | os.PathLike | bool | None = None,
    overwrite: bool = False,
    stop_at_step: int | None = None,
    progress: bool = True,
    announce: Callable[[], None] | None = None,
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
        announce: called once every check has passed, just before the model loads (the CLI prints the dtype
            there, so that a refusal stays one line).

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: invalid config, training sequence longer than the target, resuming with a different config.
        CheckpointError: the checkpoint to resume from is incomplete, altered or corrupt.
        FileExistsError: the output folder exists and neither ``overwrite`` nor ``resume`` was given.
        FileNotFoundError: missing data or checkpoint.
        LoraTargetError: a LoRA target module the model does not have.
    """
    check_recipe(config)
    held_apart_read = check_training_text(config)
    output_dir = Path(config.output.dir)
    args = training_arguments(config, output_dir, progress=progress)
    main = args.process_index == 0
    resume_from = checked_resume_point(resume, config, output_dir, args.world_size)
    tokenizer = load_checked_tokenizer(config)
    prepare_output_dir(output_dir, overwrite, resuming=resume_from is not None)
    check_trackers(config.output.report_to)
    # one run writes a run folder at a time: a second (a job started again while the first still runs) would mix
    # its checkpoints into the first's, or delete them with --overwrite
    with contextlib.ExitStack() as held:
        hold_folder_on_main(held, output_dir, "output.dir", "the run", main=main, share=all_refusals)
        if announce is not None:
            announce()
        trainable = load_trainable_model(config, args)
        data = load_packed_sequences(config.data, tokenizer, config.train.seed, trainable.pose_target,
                                     progress=progress and main)
        if main:  # everything loaded: only now create (or clear) the run folder and record the config
            start_run_folder(output_dir, config, resume_from)
        prepared = build_trainer(config, args, trainable, data, resume_from, stop_at_step, held_apart_read)
        result = run_trainer(prepared, config, resume_from, held_apart_read)
        if result.finished:
            finish_run(config, prepared.trainer, tokenizer, trainable, result, main)
        prepared.trainer.accelerator.wait_for_everyone()
        return result


def check_recipe(config: TrainConfig) -> None:
    """Validate the recipe, its parallelism for this launch, and its initial adapter, before anything loads.

    Raises:
        ConfigError: an invalid recipe, parallelism this launch cannot run, or an initial adapter of another
            base, scaling or LoRA shape.
        DamagedFileError: the initial adapter's files are damaged (named).
    """
    from hf_posext.training.lora import check_init_adapter

    config.validate()
    check_parallelism(config)
    if config.finetune.init_adapter is None:
        return
    try:
        s = config.scaling
        check_init_adapter(config.finetune, config.model.name, s.method, s.factor, s.target_length,
                           s.original_max_position_embeddings, s.params)
    except DamagedFileError as error:  # a damaged file stays a runtime error (exit 1), named
        raise type(error)(f"finetune.init_adapter: {error}") from None
    except ValueError as error:  # AdapterMismatchError, RecordError, another LoRA shape
        raise ConfigError(f"finetune.init_adapter: {error}") from None


def check_training_text(config: TrainConfig) -> list[str]:
    """Check ``data.source`` and ``data.exclude`` before anything loads; warn (once) when the text holds held-apart
    evaluation books.

    Returns:
        The held-apart books the training text includes (recorded with the run).

    Raises:
        ConfigError: an exclusion that leaves out nothing (a typo) or everything, or a source that is not text.
        FileNotFoundError: a missing source path.
    """
    try:
        check_exclusions(config.data.source, config.data.exclude)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        check_text_source(config.data.source, exclude=config.data.exclude)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"data.source: {error}") from None
    except ValueError as error:
        raise ConfigError(f"data.source: {error}") from None
    held_apart_read = held_apart_books_read(config.data.source, config.data.exclude)
    if held_apart_read:  # evaluations would score text the model has seen: said once, recorded with the run
        several = len(held_apart_read) > 1
        warnings.warn(f"data: the training text includes the held-apart evaluation book{'s' if several else ''} "
                      f"{', '.join(held_apart_read)}, which the perplexity and needle evaluations score; add "
                      f"{HELD_APART} to data.exclude to leave {'them' if several else 'it'} out.",
                      UserWarning, stacklevel=3)  # names the caller of train()
    return held_apart_read


def checked_resume_point(resume: str | os.PathLike | bool | None, config: TrainConfig, output_dir: Path,
                         world: int) -> Path | None:
    """The checkpoint to resume from (None for a fresh start), checked against the recipe and this launch.

    Raises:
        FileNotFoundError: no checkpoint where ``resume`` points.
        CheckpointError: the checkpoint is incomplete, altered or corrupt.
        ConfigError: another config or another number of processes made it.
    """
    if not resume:
        return None
    resume_from = resolve_resume(resume, output_dir)
    check_resumable(resume_from, config, world)
    return resume_from


def load_checked_tokenizer(config: TrainConfig) -> Any:
    """The model's tokenizer, with the retrieval records it must format checked to fit (before the model loads).

    Raises:
        ConfigError: a tokenizer without the chat template ``data.retrieval_chat`` needs, or retrieval records
            longer than ``data.sequence_length``.
    """
    from hf_posext.models import load_tokenizer
    from hf_posext.training.retrieval_data import retrieval_records_for

    tokenizer = load_tokenizer(config.model.name)
    try:
        retrieval = retrieval_records_for(config.data, tokenizer)
    except ValueError as error:  # a tokenizer without the chat template that data.retrieval_chat needs
        raise ConfigError(f"data.retrieval_chat: {error}") from None
    if retrieval is not None:
        try:
            retrieval.check_fits(config.data.sequence_length)
        except ValueError as error:
            raise ConfigError(f"data.retrieval_records: {error}") from None
    return tokenizer


def load_trainable_model(config: TrainConfig, args: TrainingArguments) -> TrainableModel:
    """Load the base model, check it against the initial adapter, patch it, and set up its trainable weights.

    Raises:
        ConfigError: an initial adapter trained on other base weights, attention heads that ``sp_size`` does not
            divide, a training sequence longer than the scaled window, or an output head the chunked loss cannot read.
        LoraTargetError: a LoRA target module the model does not have.
    """
    from hf_posext.training.lora import extra_parameter_names, setup_trainable

    lora = config.finetune.mode == "lora"
    dtype = torch.bfloat16 if (args.bf16 and lora) else torch.float32
    model = load_base_model(config, dtype)
    # the base weights an adapter is trained on, recorded with it and checked wherever it is applied
    base_weights = base_weights_fingerprints(model) if lora else None
    if config.finetune.init_adapter is not None:
        try:
            check_base_weights(config.finetune.init_adapter, model, config.model.name)
        except AdapterMismatchError as error:
            raise ConfigError(f"finetune.init_adapter: {error}") from None
    patch(model, **config.scaling.to_request().patch_kwargs())
    check_sequence_parallel_heads(config, model)
    target = pose_target(config, describe(model).current_window)
    model.config.use_cache = False
    extras = extra_parameter_names(model, config.finetune.train_embeddings, config.finetune.train_norms) if lora else []
    model = setup_trainable(model, config.finetune, seed=config.train.seed)
    check_chunked_loss_head(config, model)
    return TrainableModel(model, dtype, base_weights, extras, target)


def check_sequence_parallel_heads(config: TrainConfig, model: Any) -> None:
    """Refuse ``parallelism.sp_size`` that does not divide the model's attention heads (Ulysses splits them)."""
    if not config.parallelism.sequence_parallel:
        return
    from hf_posext.training.parallel import validate_sp_heads

    try:
        validate_sp_heads(config.parallelism.sp_size, model.config.num_attention_heads,
                          getattr(model.config, "num_key_value_heads", None))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_chunked_loss_head(config: TrainConfig, model: Any) -> None:
    """Refuse ``train.loss=chunked`` on a model whose output head the chunked loss cannot read."""
    if config.train.loss != "chunked":
        return
    from hf_posext.lm.chunked_loss import check_output_head

    try:
        check_output_head(model)
    except ValueError as error:
        raise ConfigError(f"train.loss=chunked: {error}") from None


def pose_target(config: TrainConfig, scaled_window: int) -> int | None:
    """The context length PoSE's position ids span (None without PoSE), checked against the scaled window.

    Raises:
        ConfigError: a PoSE target past the scaled window, or a training sequence longer than the window (or target).
    """
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


def samples_per_step(config: TrainConfig, world: int) -> int:
    """Samples per optimizer step over all processes.

    The processes of one sequence- or context-parallel group share each sample: the data-parallel ranks are
    world / (sp_size x cp_size), as the Trainer counts them.
    """
    t, p = config.train, config.parallelism
    return t.batch_size * t.gradient_accumulation_steps * world // (p.sp_size * p.cp_size)


def build_trainer(config: TrainConfig, args: TrainingArguments, trainable: TrainableModel, data: Any,
                  resume_from: Path | None, stop_at_step: int | None, held_apart_read: list[str]) -> PreparedTrainer:
    """The :class:`PosextTrainer` of the run: its dataset (from the first unseen sample when a resumed
    sequence-parallel run cannot skip batches), its callbacks, and the run record each checkpoint carries."""
    t, p = config.train, config.parallelism
    world = args.world_size
    per_step = samples_per_step(config, world)
    tokens_per_step = per_step * data.sequence_length
    run_info = {
        "num_processes": world, "fingerprint": config.fingerprint(), "config": config.to_dict(),
        "hf_posext_version": VERSION, "samples_per_step": per_step, "held_apart_read": held_apart_read,
    }
    log_callback = JsonlLogCallback(Path(config.output.dir) / LOG_FILE, tokens_per_step)
    callbacks: list[TrainerCallback] = [log_callback, CheckpointIntegrityCallback(run_info)]
    if stop_at_step is not None:
        callbacks.append(StopAtStepCallback(stop_at_step))
    start_step = checkpoint_step(resume_from) if resume_from is not None else 0
    skip_in_dataset = p.sequence_parallel and resume_from is not None  # see parallelism_arguments
    if p.sequence_parallel:
        from hf_posext.training.parallel import init_deepspeed_distributed

        init_deepspeed_distributed()
    trainer = PosextTrainer(
        model=trainable.model, args=args,
        train_dataset=SequenceDataset(data, t.max_steps * per_step,
                                      first_sample=start_step * per_step if skip_in_dataset else 0),
        data_collator=collate_sequences, callbacks=callbacks, extra_parameter_names=trainable.extra_parameter_names,
        train_section=t, rng_state_from=str(resume_from) if skip_in_dataset else None,
    )
    return PreparedTrainer(trainer, log_callback, start_step, tokens_per_step)


def run_trainer(prepared: PreparedTrainer, config: TrainConfig, resume_from: Path | None,
                held_apart_read: list[str]) -> TrainResult:
    """Train (from ``resume_from`` when given) and time it; the result counts only this invocation's steps."""
    trainer = prepared.trainer
    began = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    elapsed = time.perf_counter() - began
    step = trainer.state.global_step
    done = step - prepared.start_step
    return TrainResult(
        output_dir=str(Path(config.output.dir)), step=step, finished=step >= config.train.max_steps,
        final_loss=prepared.log.last_loss,
        tokens_per_second=(done * prepared.tokens_per_step / elapsed) if done else None,
        seconds_per_step=(elapsed / done) if done else None,
        resumed_from=str(resume_from) if resume_from else None, held_apart_read=held_apart_read,
    )


def finish_run(config: TrainConfig, trainer: PosextTrainer, tokenizer: Any, trainable: TrainableModel,
               result: TrainResult, main: bool) -> None:
    """Save the finished run's adapter, merged model and scaling (every process), then its result (main process)."""
    output_dir = Path(config.output.dir)
    save_outputs(config, trainer.accelerator, trainer.model_wrapped, tokenizer, output_dir, trainable.dtype,
                 trainable.base_weights)
    if main:
        write_json_atomic(output_dir / RESULT_FILE, result.__dict__)
