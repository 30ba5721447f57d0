"""The run folder (``output.dir``): may this run use it, which checkpoint it resumes from, and how it starts.

Everything here that can refuse does so before the folder is created or touched; :func:`start_run_folder`
is the first write, once everything has loaded. The checkpoints' own checks (checksums, step, config) are
:mod:`hf_posext.training.checkpoints`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hf_posext.core.files import check_output_folder, write_text_atomic
from hf_posext.core.locks import LOCK_NAME
from hf_posext.training.checkpoints import (
    CHECKSUMS_FILE, RUN_FILE, checkpoint_step, find_latest_checkpoint, read_run_info, verify_for_resume,
)
from hf_posext.training.config import ConfigError, TrainConfig, config_differences, config_from_dict

__all__ = [
    "CONFIG_FILE", "LOG_FILE", "RESULT_FILE", "resolve_resume", "check_resumable", "prepare_output_dir", "all_refusals",
    "start_run_folder", "truncate_log", "load_run_config",
]

logger = logging.getLogger(__name__)

#: The resolved config of the run, written once everything loaded.
CONFIG_FILE = "train_config.yaml"
#: One JSON line per logged step.
LOG_FILE = "log.jsonl"
#: Steps, final loss, tokens/s and wall time of a finished run.
RESULT_FILE = "train_result.json"


def resolve_resume(resume: str | os.PathLike | bool, output_dir: Path) -> Path:
    """The checkpoint to resume from: ``resume`` itself when it names a checkpoint, else the latest complete one.

    Args:
        resume: ``True`` for ``output_dir``, or a run folder or one of its checkpoints.
        output_dir: the run's folder.

    Returns:
        The checkpoint folder (a named one is verified as it is, never replaced by another).

    Raises:
        FileNotFoundError: the folder holds no checkpoint.
    """
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


def prepare_output_dir(output_dir: Path, overwrite: bool, resuming: bool) -> None:
    """Check (every process) that the run may use ``output_dir``; raise before anything is written.

    Raises:
        FileExistsError: ``output_dir`` is a file, a non-empty folder without ``overwrite`` or ``resuming``, or a
            folder ``overwrite`` may not delete (not a run folder).
    """
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


def all_refusals(refusal: str) -> list[str]:
    """Every process's refusal (one process: this one's)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [refusal]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, refusal)
    return gathered


def check_resumable(resume_from: Path, config: TrainConfig, world: int) -> None:
    """Refuse a corrupt checkpoint (naming an older intact one), one made by a different config, or with another
    number of processes.

    Raises:
        CheckpointError: the checkpoint is incomplete, altered or corrupt.
        ConfigError: another config or another number of processes made it.
    """
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


def start_run_folder(output_dir: Path, config: TrainConfig, resume_from: Path | None) -> None:
    """Start the run in ``output_dir`` (main process): a fresh run clears it and records the config; a resumed run
    drops the log lines past its checkpoint.

    A fresh run into an existing run folder (``--overwrite``, allowed by :func:`prepare_output_dir`) deletes all
    but the lock this run holds.
    """
    if resume_from is not None:
        truncate_log(output_dir / LOG_FILE, checkpoint_step(resume_from))
        return
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


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the lines of ``log.jsonl`` up to ``last_step`` (those of a resumed checkpoint), atomically."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def load_run_config(folder: str | os.PathLike) -> TrainConfig:
    """The config a run folder (or one of its checkpoints) was made with.

    Raises:
        FileNotFoundError: ``folder`` holds no checkpoint and no ``train_config.yaml``.
    """
    folder = Path(folder)
    checkpoint = folder if checkpoint_step(folder) is not None else find_latest_checkpoint(folder)
    if checkpoint is not None and (checkpoint / RUN_FILE).is_file():
        return config_from_dict(read_run_info(checkpoint)["config"]).validate()
    from hf_posext.training.config import load_config

    if (folder / CONFIG_FILE).is_file():
        return load_config(folder / CONFIG_FILE)
    raise FileNotFoundError(f"{folder} holds no checkpoint and no {CONFIG_FILE}: not a training run folder.")
