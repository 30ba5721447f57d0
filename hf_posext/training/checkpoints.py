"""Checkpoint folders of a run: finding the latest, recording the run, and integrity checks before resuming.

The transformers ``Trainer`` writes ``OUT/checkpoint-<step>/`` (weights, optimizer, scheduler, RNG states,
``trainer_state.json``). After it has finished, the main process adds

* ``posext_run.json``: the run's config, fingerprint, number of processes and package version;
* ``checksums.json``: the sha256 of every other file in the folder, written last and atomically.

A checkpoint is usable only when ``checksums.json`` is present, every file matches it, and the folder's
step equals ``trainer_state.json``'s ``global_step``; :func:`verify_checkpoint` refuses anything else with
a one-line error naming the bad file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from hf_posext.core.errors import DamagedFileError
from hf_posext.core.files import write_json_atomic
from hf_posext.core.integrity import MANIFEST_FILE as CHECKSUMS_FILE
from hf_posext.core.integrity import file_sha256, verify_manifest
from hf_posext.core.integrity import write_manifest as write_checksums

__all__ = [
    "CHECKPOINT_PREFIX", "CHECKSUMS_FILE", "RUN_FILE", "CheckpointError", "checkpoint_step", "find_latest_checkpoint",
    "write_json_atomic", "file_sha256", "write_checksums", "verify_checkpoint", "verify_for_resume",
    "older_intact_checkpoint", "read_run_info",
]

CHECKPOINT_PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR
RUN_FILE = "posext_run.json"
TRAINER_STATE_FILE = "trainer_state.json"

_STEP_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(DamagedFileError):
    """A checkpoint folder that is incomplete, altered or corrupt (the message names the bad file)."""


def checkpoint_step(path: Path) -> int | None:
    """The step in a ``checkpoint-<step>`` folder name (None for any other name)."""
    match = _STEP_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def find_latest_checkpoint(output_dir: str | os.PathLike, complete: bool = False) -> Path | None:
    """The ``checkpoint-<step>`` folder with the highest step directly under ``output_dir`` (None if none).

    Args:
        output_dir: a run folder.
        complete: consider only checkpoints whose save finished (they hold ``checksums.json``).
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    candidates = [
        p for p in root.iterdir()
        if p.is_dir() and checkpoint_step(p) is not None and (not complete or (p / CHECKSUMS_FILE).is_file())
    ]
    return max(candidates, key=checkpoint_step) if candidates else None


def verify_checkpoint(folder: str | os.PathLike) -> None:
    """Refuse a checkpoint that is incomplete or altered.

    Raises:
        CheckpointError: no ``checksums.json`` (a save that did not finish), a listed file missing or with
            another hash, an unlisted file, or a folder step that differs from ``trainer_state.json``.
    """
    folder = Path(folder)
    sums_path = folder / CHECKSUMS_FILE
    if not sums_path.is_file():
        raise CheckpointError(
            f"Checkpoint {folder} has no {CHECKSUMS_FILE}: its save did not finish. Delete it and resume from an "
            "earlier checkpoint (--resume DIR/checkpoint-N)."
        )
    verify_manifest(folder, name=f"Checkpoint {folder}", fix="resume from another checkpoint", error=CheckpointError)
    step = checkpoint_step(folder)
    state_path = folder / TRAINER_STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"Checkpoint {folder} has no {TRAINER_STATE_FILE}; resume from another checkpoint.")
    global_step = json.loads(state_path.read_text()).get("global_step")
    if step is None or global_step != step:
        raise CheckpointError(
            f"Checkpoint {folder}: {state_path} says global_step={global_step}, but the folder name says step {step}; "
            "resume from another checkpoint."
        )


def older_intact_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest checkpoint beside ``folder`` with a lower step that passes :func:`verify_checkpoint` (None: none)."""
    folder = Path(folder)
    step = checkpoint_step(folder)
    if step is None or not folder.parent.is_dir():
        return None
    steps = {p: checkpoint_step(p) for p in folder.parent.iterdir() if p.is_dir()}
    older = sorted((p for p, other in steps.items() if other is not None and other < step), key=steps.get, reverse=True)
    for candidate in older:
        try:
            verify_checkpoint(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


def verify_for_resume(folder: str | os.PathLike) -> None:
    """:func:`verify_checkpoint`, and on a refusal the way on: the newest older intact checkpoint and its command.

    Raises:
        CheckpointError: as :func:`verify_checkpoint`, ending with ``... checkpoint-N is intact: resume from it
            with hf-posext train --resume OUT/checkpoint-N`` (or saying that no older checkpoint is intact).
    """
    try:
        verify_checkpoint(folder)
    except CheckpointError as error:
        older = older_intact_checkpoint(folder)
        if older is None:
            way_on = f"No older checkpoint in {Path(folder).parent} is intact either."
        else:
            way_on = f"The older {older.name} is intact: resume from it with `hf-posext train --resume {older}`."
        raise CheckpointError(f"{str(error).rstrip('.')}. {way_on}") from None


def read_run_info(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``posext_run.json`` of a checkpoint (config, fingerprint, num_processes, version)."""
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {folder} has no {RUN_FILE}: it was not written by hf_posext.training.")
    return json.loads(path.read_text())
