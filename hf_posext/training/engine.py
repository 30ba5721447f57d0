"""The training engine: :class:`PosextTrainer` (a plain ``transformers.Trainer`` subclass), its dataset, losses
and callbacks.

TRL is not a dependency: its ``SFTTrainer`` adds nothing these recipes need. The Trainer reads
:class:`SequenceDataset` with a sequential sampler, so the data order is a function of the sample counter alone
(:mod:`hf_posext.training.packing`) and a resumed run continues where the interrupted one was.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_posext.training.checkpoints import RUN_FILE, CheckpointError, write_checksums, write_json_atomic

__all__ = [
    "SequenceDataset", "training_loss", "sequence_parallel_chunked_loss", "NonFiniteTrainingError", "nonfinite_message",
    "PosextTrainer", "CheckpointIntegrityCallback", "JsonlLogCallback", "StopAtStepCallback",
]


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


def nonfinite_message(step: int, what: str, value: float, output_dir: str) -> str:
    """The one-line error of a step whose ``what`` (loss, gradient norm) is ``value``, not finite, naming the fixes."""
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
            raise NonFiniteTrainingError(nonfinite_message(self.state.global_step + 1, "gradient norm", value, self.args.output_dir))
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
            raise NonFiniteTrainingError(nonfinite_message(state.global_step, "logged " + ("loss" if what == "loss" else "gradient norm"),
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
