"""The training loop: patch, choose trainable weights, train with accelerate, checkpoint, resume, save.

One function, :func:`train`, runs a :class:`~hf_posext.training.config.TrainConfig` on whatever
``accelerate launch`` provides (one CPU process, several gloo processes, DDP, FSDP, DeepSpeed).

Output folder layout::

    OUT/train_config.yaml        the resolved config of the run (written when it starts)
    OUT/log.jsonl                one JSON line per logged step: step, loss, lr, grad_norm, tokens/s, ...
    OUT/checkpoints/step-00000050/   trainable.safetensors, optimizer.pt, scheduler.pt,
                                     rng-rank<r>.pt, state.json (step, data position, config)
    OUT/adapter/                 PEFT adapter (+ trainable_extras.safetensors for LongLoRA extras)
    OUT/merged/                  merged model + tokenizer (hf_posext.load / from_pretrained)
    OUT/scaling.json             the scaling (hf_posext.describe of the trained model)
    OUT/train_result.json        steps, final loss, tokens/s, wall time

Checkpoints are written to a hidden temporary folder and renamed into place, so a run killed while
saving leaves the previous checkpoints intact; an existing checkpoint is never overwritten (a same-named
one from an abandoned branch of the run is renamed ``*.superseded-N`` first). Data order depends only on
the step (see :mod:`hf_posext.training.data`), so resuming restores weights, optimizer, scheduler and RNG
states and then continues exactly where the interrupted run was.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_posext.training.config import ConfigError, TrainConfig, config_differences, config_from_dict

__all__ = ["train", "TrainResult", "find_latest_checkpoint", "lr_multiplier", "clip_gradients"]

logger = logging.getLogger(__name__)

CONFIG_FILE = "train_config.yaml"
LOG_FILE = "log.jsonl"
CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.json"
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
    """

    output_dir: str
    step: int
    finished: bool
    final_loss: float | None
    tokens_per_second: float | None
    seconds_per_step: float | None
    resumed_from: str | None = None


# --------------------------------------------------------------------------------------------------
# Schedule and clipping (small pure pieces, tested on their own)
# --------------------------------------------------------------------------------------------------


def lr_multiplier(step: int, max_steps: int, warmup_steps: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based): linear warmup, then the schedule.

    Warmup rises as (step + 1) / warmup_steps so the first step already trains; after it, ``cosine``
    and ``linear`` decay from 1 to ``min_ratio`` at ``max_steps``; ``constant`` stays at 1.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"Unknown lr schedule {schedule!r}; expected cosine, linear or constant.")
    return min_ratio + (1.0 - min_ratio) * decay


def clip_gradients(accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the global gradient norm of ``parameters`` to ``max_norm`` in place; return the norm before.

    Goes through ``accelerator.clip_grad_norm_`` so the norm is the global one under DDP/FSDP/DeepSpeed
    (and gradients are unscaled first under fp16).
    """
    if max_norm is None:
        norms = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else 0.0
    norm = accelerator.clip_grad_norm_(parameters, max_norm)
    return float(norm) if norm is not None else float("nan")


# --------------------------------------------------------------------------------------------------
# Output folder, checkpoints
# --------------------------------------------------------------------------------------------------


def _checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``output_dir/checkpoints`` (None if none)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return None
    candidates = [p for p in root.iterdir() if p.is_dir() and _checkpoint_step(p) is not None and (p / STATE_FILE).is_file()]
    return max(candidates, key=_checkpoint_step) if candidates else None


def _resolve_resume(resume: str | os.PathLike | bool, output_dir: Path) -> Path:
    if resume is True:
        folder = output_dir
    else:
        folder = Path(resume)
    if (folder / STATE_FILE).is_file():
        return folder
    latest = find_latest_checkpoint(folder)
    if latest is None:
        raise FileNotFoundError(
            f"--resume: no checkpoint found in {folder} (looked for {folder / CHECKPOINT_DIR}/step-*/{STATE_FILE}). "
            "Point --resume at a run folder or one of its checkpoints, or start without --resume."
        )
    return latest


def _prepare_output_dir(config: TrainConfig, output_dir: Path, overwrite: bool, resuming: bool) -> None:
    """Check (every process) that the run may use ``output_dir``; raise before anything is written."""
    if resuming or not output_dir.exists():
        return
    if output_dir.is_file():
        raise FileExistsError(f"output.dir {output_dir} is a file; choose a folder path.")
    if not any(output_dir.iterdir()):
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


def _write_json_atomic(path: Path, data: Any) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    os.replace(temporary, path)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sharded(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


class _Checkpointer:
    """Writes and reads checkpoints; every process calls every method (they synchronise inside)."""

    def __init__(self, accelerator: Any, output_dir: Path) -> None:
        self.accelerator = accelerator
        self.root = output_dir / CHECKPOINT_DIR

    def save(self, step: int, model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any], keep_last: int | None) -> Path:
        from safetensors.torch import save_file

        from hf_posext.training.lora import trainable_state_dict

        accelerator = self.accelerator
        final = self.root / f"step-{step:08d}"
        temporary = self.root / f".tmp-step-{step:08d}"
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            if temporary.exists():  # left by a run killed while saving: incomplete, never a checkpoint
                shutil.rmtree(temporary)
            temporary.mkdir()
        accelerator.wait_for_everyone()
        if _sharded(accelerator):
            accelerator.save_state(str(temporary))
        elif accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            tensors = {k: v.detach().cpu().contiguous() for k, v in trainable_state_dict(unwrapped).items()}
            save_file(tensors, str(temporary / "trainable.safetensors"))
            torch.save(optimizer.state_dict(), temporary / "optimizer.pt")
        if accelerator.is_main_process:
            torch.save(scheduler.state_dict(), temporary / "scheduler.pt")
        torch.save(_rng_state(), temporary / f"rng-rank{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _write_json_atomic(temporary / STATE_FILE, state)
            if final.exists():
                # A checkpoint of an abandoned continuation (the run was resumed from an earlier one):
                # keep it under another name rather than overwrite it.
                number = 1
                while final.with_name(f"{final.name}.superseded-{number}").exists():
                    number += 1
                final.rename(final.with_name(f"{final.name}.superseded-{number}"))
            os.rename(temporary, final)
            if keep_last is not None:
                complete = sorted(
                    (p for p in self.root.iterdir() if _checkpoint_step(p) is not None and (p / STATE_FILE).is_file()),
                    key=_checkpoint_step,
                )
                for old in complete[:-keep_last]:
                    shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return final

    def load(self, folder: Path, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        from safetensors.torch import load_file

        accelerator = self.accelerator
        state = json.loads((folder / STATE_FILE).read_text())
        if _sharded(accelerator):
            accelerator.load_state(str(folder))
        else:
            unwrapped = accelerator.unwrap_model(model)
            tensors = load_file(str(folder / "trainable.safetensors"))
            parameters = dict(unwrapped.named_parameters())
            missing = [name for name in tensors if name not in parameters]
            if missing:
                raise ValueError(f"Checkpoint {folder} holds weights this model does not have: {missing[:5]}.")
            with torch.no_grad():
                for name, value in tensors.items():
                    parameters[name].copy_(value.to(parameters[name].device, parameters[name].dtype))
            optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False))
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=False))
        rng_file = folder / f"rng-rank{accelerator.process_index}.pt"
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        return state


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def _precision(config: TrainConfig) -> str:
    if config.model.precision == "fp32":
        return "no"
    supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if config.model.precision == "bf16":
        if not supported and not torch.cuda.is_available():
            raise ConfigError("model.precision=bf16 needs a GPU with bfloat16 support; on CPU use model.precision=fp32 or auto.")
        return "bf16"
    return "bf16" if supported else "no"


def _has_accelerator() -> bool:
    if hasattr(torch, "accelerator"):
        return bool(torch.accelerator.is_available())
    return torch.cuda.is_available()


def _check_trackers(report_to: list[str]) -> None:
    import importlib.util

    modules = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for tracker in report_to:
        if importlib.util.find_spec(modules[tracker]) is None:
            raise ImportError(f"output.report_to lists {tracker!r} but it is not installed: pip install {modules[tracker]} (or drop it from output.report_to).")


def _load_and_patch(config: TrainConfig, dtype: torch.dtype):
    import hf_posext
    from hf_posext.models import load_model

    kwargs: dict[str, Any] = {"attn_implementation": config.model.attn_implementation}
    if config.model.trust_remote_code:
        kwargs["trust_remote_code"] = True
    kwargs.update(config.model.config_overrides)
    model = load_model(config.model.name, dtype=dtype, **kwargs)
    hf_posext.patch(model, **config.scaling.to_request().patch_kwargs())
    return model


def _pose_target(config: TrainConfig, scaled_window: int) -> int | None:
    d = config.data
    if not d.pose:
        if d.window > scaled_window:
            raise ConfigError(
                f"data.window ({d.window}) is longer than the scaled window ({scaled_window} tokens). "
                "Lower data.window or raise the scaling factor."
            )
        return None
    target = d.pose_target_length or scaled_window
    if target > scaled_window:
        raise ConfigError(
            f"data.pose_target_length ({target}) exceeds the scaled window ({scaled_window}); positions past the "
            "window are outside what the scaling was set up for. Raise scaling.factor or lower the PoSE target."
        )
    if d.window > target:
        raise ConfigError(
            f"data.window ({d.window}) is longer than the PoSE target ({target}): the window must be shorter "
            "than the context it simulates. Lower data.window."
        )
    return target


def training_loss(model: Any, batch: dict[str, torch.Tensor], train_section: Any) -> torch.Tensor:
    """The loss of one micro-batch: chunked (no full logits, :mod:`hf_posext.lm.chunked_loss`) or plain."""
    if train_section.loss == "chunked":
        from hf_posext.lm.chunked_loss import chunked_causal_lm_loss

        return chunked_causal_lm_loss(model, batch, chunk_size=train_section.loss_chunk_size)
    return model(**batch, use_cache=False).loss


def _truncate_log(path: Path, last_step: int) -> None:
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


def _save_final(config: TrainConfig, accelerator: Any, model: Any, tokenizer: Any, output_dir: Path, dtype: torch.dtype) -> None:
    """Write adapter/, merged/ and scaling.json (each through a temporary folder and a rename)."""
    import hf_posext
    from safetensors.torch import save_file

    from hf_posext.training.lora import EXTRAS_FILE, extra_parameter_names

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
            if base_names:
                prefix = "base_model.model."
                extras = {n: state_dict[prefix + n].detach().cpu().contiguous() for n in base_names if prefix + n in state_dict}
                save_file(extras, str(folder / EXTRAS_FILE))

        adapter_dir = publish("adapter", write_adapter)
        if config.output.save_merged:
            publish("merged", lambda folder: merge_adapter(config, adapter_dir, folder, dtype, tokenizer))
    else:
        def write_full(folder: Path) -> None:
            unwrapped.save_pretrained(str(folder), state_dict=state_dict)
            tokenizer.save_pretrained(str(folder))

        publish("merged", write_full)
    report = hf_posext.describe(unwrapped.get_base_model() if config.finetune.mode == "lora" else unwrapped)
    _write_json_atomic(output_dir / "scaling.json", report.to_dict())
    accelerator.wait_for_everyone()


def merge_adapter(config: TrainConfig, adapter_dir: Path, out_dir: Path, dtype: torch.dtype, tokenizer: Any | None = None) -> None:
    """Rebuild the patched base model, apply a saved adapter (+ extras), merge it, and save to ``out_dir``.

    Working from the saved adapter (not the live training model) makes the merged model the same on
    one process, DDP, FSDP or DeepSpeed, and checks that the adapter files are complete.
    """
    from peft import PeftModel
    from safetensors.torch import load_file

    from hf_posext.training.lora import EXTRAS_FILE

    base = _load_and_patch(config, dtype)
    extras_file = Path(adapter_dir) / EXTRAS_FILE
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    if extras_file.is_file():
        parameters = dict(peft_model.get_base_model().named_parameters())
        with torch.no_grad():
            for name, value in load_file(str(extras_file)).items():
                parameters[name].copy_(value.to(parameters[name].dtype))
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def train(
    config: TrainConfig,
    *,
    resume: str | os.PathLike | bool | None = None,
    overwrite: bool = False,
    stop_at_step: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Run a training recipe under the current accelerate environment.

    Args:
        config: a validated :class:`~hf_posext.training.config.TrainConfig`.
        resume: ``True`` to continue from the latest checkpoint in ``output.dir``; a path to continue
            from that checkpoint (or that run folder's latest); None/False to start fresh.
        overwrite: allow deleting an existing run folder at ``output.dir`` (fresh start only).
        stop_at_step: stop after this optimizer step, without the final save, as an interruption would
            (checkpoints due at or before it are written). For tests and time-boxed runs.
        progress: show tqdm bars (main process only).

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: invalid config, window longer than the target, resuming with a different config.
        FileExistsError: the output folder exists and neither ``overwrite`` nor ``resume`` was given.
        FileNotFoundError: missing data or checkpoint.
        LoraTargetError: a LoRA target module the model does not have.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from hf_posext.models import load_tokenizer
    from hf_posext.training.data import load_packed_windows
    from hf_posext.training.lora import setup_trainable

    config.validate()
    output_dir = Path(config.output.dir)
    resume_from = _resolve_resume(resume, output_dir) if resume else None
    saved_state = json.loads((resume_from / STATE_FILE).read_text()) if resume_from else None
    if saved_state is not None:
        differences = config_differences(saved_state["config"], config.to_dict())
        if differences:
            raise ConfigError(
                f"Cannot resume from {resume_from}: it was made by a different config ("
                + "; ".join(differences)
                + "). Resume with the original config, or start a new run in another output.dir."
            )
    _prepare_output_dir(config, output_dir, overwrite, resuming=resume_from is not None)
    _check_trackers(config.output.report_to)

    mixed_precision = _precision(config)
    accelerator = Accelerator(
        # Without an accelerator, say cpu=True: accelerate then joins the processes that
        # `accelerate launch`/torchrun started into one gloo group (MULTI_CPU) instead of
        # running each as an independent single-process job.
        cpu=not _has_accelerator(),
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=config.train.gradient_accumulation_steps,
        log_with=list(config.output.report_to) or None,
        project_dir=str(output_dir / "trackers"),
    )
    main = accelerator.is_main_process
    world = accelerator.num_processes
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and not _sharded(accelerator):
        logger.warning(
            "An FSDP launch config was given, but accelerate %s enables FSDP only on GPUs: running plain data "
            "parallel (%s) instead.", __import__("accelerate").__version__, accelerator.distributed_type,
        )
    if saved_state is not None and saved_state.get("num_processes", world) != world:
        raise ConfigError(
            f"{resume_from} was written by a run with {saved_state['num_processes']} processes; resume it with the "
            f"same number (now {world}) so every process sees the same data as before."
        )

    # Fresh start: (maybe) clear the folder, record the config. All checks above ran on every process.
    if resume_from is None and main:
        if output_dir.exists() and any(output_dir.iterdir()):
            shutil.rmtree(output_dir)  # allowed by _prepare_output_dir: --overwrite on a run folder
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / CONFIG_FILE).write_text(
            f"# written by hf_posext.training at the start of the run; resume with --config {CONFIG_FILE}\n" + config.to_yaml()
        )
    accelerator.wait_for_everyone()

    t = config.train
    set_seed(t.seed)
    dtype = torch.bfloat16 if (mixed_precision == "bf16" and config.finetune.mode == "lora") else torch.float32
    tokenizer = load_tokenizer(config.model.name)
    model = _load_and_patch(config, dtype)
    import hf_posext

    scaled_window = hf_posext.describe(model).current_window
    pose_target = _pose_target(config, scaled_window)
    model.config.use_cache = False
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = setup_trainable(model, config.finetune, seed=t.seed)
    if t.loss == "chunked":
        from hf_posext.lm.chunked_loss import check_output_head

        try:
            check_output_head(model)
        except ValueError as error:
            raise ConfigError(f"train.loss=chunked: {error}") from None
    model.train()
    data = load_packed_windows(config.data, tokenizer, t.seed, pose_target, progress=progress and main)

    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, t.max_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio)
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    checkpointer = _Checkpointer(accelerator, output_dir)

    start_step, tokens_seen = 0, 0
    if resume_from is not None:
        state = checkpointer.load(resume_from, model, optimizer, scheduler)
        start_step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        if main:
            _truncate_log(output_dir / LOG_FILE, start_step)
            logger.info("resumed from %s at step %d", resume_from, start_step)
    else:
        set_seed(t.seed + accelerator.process_index)  # distinct dropout masks per process

    if config.output.report_to:
        accelerator.init_trackers("hf_posext", config={f"{s}.{k}": str(v) for s, body in config.to_dict().items() for k, v in body.items()})

    accumulation = t.gradient_accumulation_steps
    tokens_per_step = t.batch_size * accumulation * world * data.window
    bar = tqdm(total=t.max_steps, initial=start_step, desc="training", unit="step", disable=not (progress and main))
    log_path = output_dir / LOG_FILE
    step = start_step
    last_loss: float | None = None
    began = time.perf_counter()
    finished = True
    while step < t.max_steps:
        step_began, step_cpu_began = time.perf_counter(), time.process_time()
        loss_sum = torch.zeros((), device=accelerator.device)
        lr = scheduler.get_last_lr()[0]
        grad_norm = float("nan")
        for micro in range(accumulation):
            batch = data.batch(step * accumulation + micro, accelerator.process_index, world, t.batch_size)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            # accumulate(): skips the gradient all-reduce (DDP) and the optimizer step until the last
            # micro-batch, divides the loss by the accumulation steps, and drives DeepSpeed's own counter.
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss = training_loss(model, batch, t)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = clip_gradients(accelerator, trainable, t.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
        if not accelerator.sync_gradients:
            raise RuntimeError("gradient accumulation fell out of step with the optimizer; please report this.")
        scheduler.step()
        step += 1
        tokens_seen += tokens_per_step
        step_seconds = time.perf_counter() - step_began
        mean_loss = float(accelerator.reduce(loss_sum / accumulation, reduction="mean"))
        last_loss = mean_loss
        if main:
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / step_seconds:.0f}")
        if step % config.output.log_every == 0 or step == t.max_steps:
            record = {
                "step": step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_second": tokens_per_step / step_seconds, "seconds_per_step": step_seconds,
                # CPU time of this process (all its threads): on a shared machine it shows the cost of a
                # step independently of how much of the CPU other jobs took.
                "process_cpu_seconds": time.process_time() - step_cpu_began,
                "tokens_seen": tokens_seen, "time": time.time(),
            }
            if main:
                with log_path.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
            if config.output.report_to:
                accelerator.log({k: v for k, v in record.items() if k not in ("step", "time")}, step=step)
        every = config.output.checkpoint_every
        if every and (step % every == 0 or step == t.max_steps):
            state = {
                "step": step, "micro_batches": step * accumulation, "samples_seen": step * accumulation * world * t.batch_size,
                "tokens_seen": tokens_seen, "num_processes": world, "fingerprint": config.fingerprint(),
                "config": config.to_dict(), "hf_posext_version": hf_posext.__version__,
            }
            checkpointer.save(step, model, optimizer, scheduler, state, config.output.keep_last)
        if stop_at_step is not None and step >= stop_at_step and step < t.max_steps:
            finished = False
            break
    bar.close()
    elapsed = time.perf_counter() - began
    done = step - start_step
    result = TrainResult(
        output_dir=str(output_dir), step=step, finished=finished, final_loss=last_loss,
        tokens_per_second=(done * tokens_per_step / elapsed) if done else None,
        seconds_per_step=(elapsed / done) if done else None,
        resumed_from=str(resume_from) if resume_from else None,
    )
    if finished:
        _save_final(config, accelerator, model, tokenizer, output_dir, dtype)
        if main:
            _write_json_atomic(output_dir / RESULT_FILE, result.__dict__)
    if config.output.report_to:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return result


def load_run_config(folder: str | os.PathLike) -> TrainConfig:
    """The config a run folder (or one of its checkpoints) was made with."""
    folder = Path(folder)
    state_file = folder / STATE_FILE if (folder / STATE_FILE).is_file() else None
    if state_file is None:
        latest = find_latest_checkpoint(folder)
        state_file = latest / STATE_FILE if latest else None
    if state_file is not None:
        return config_from_dict(json.loads(state_file.read_text())["config"]).validate()
    from hf_posext.training.config import load_config

    if (folder / CONFIG_FILE).is_file():
        return load_config(folder / CONFIG_FILE)
    raise FileNotFoundError(f"{folder} holds no checkpoint and no {CONFIG_FILE}: not a training run folder.")
