"""Results on disk: one JSON file per run (plus a CSV), resumable, with the versions that produced it."""

from __future__ import annotations

import contextlib
import datetime as _datetime
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import torch

from hf_posext.core.files import write_text_atomic
from hf_posext.core.integrity import stable_digest
from hf_posext.core.version import VERSION

__all__ = ["ResultStore", "equivalent_run_configs", "results_part", "versions"]


def versions() -> dict[str, str]:
    """Versions of the software that produced a result."""
    import accelerate
    import transformers

    return {
        "hf_posext": VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
    }


def results_part(task: str, model: str) -> str:
    """The part of a results folder that the runs of ``task`` on ``model`` (``MODEL[+ADAPTER]``) write, and lock
    (:func:`hf_posext.core.locks.hold_folder`): ``eval TASK`` and the card name it alike, so that the two refuse each
    other in one folder."""
    return f"{task} {model}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip("/").split("/")[-1]).strip("-") or "model"


def equivalent_run_configs(run_config: dict[str, Any]) -> list[dict[str, Any]]:
    """``run_config`` with each value that names an existing local file or folder written in its other forms.

    A path given relative to the working directory and the same path given absolute name the same text,
    so they are the same run: the store looks for a results file under each form before starting a new one.
    Forms: as given, absolute, relative to the working directory (when the path is below it or a few levels up).
    """
    alternatives: list[dict[str, Any]] = []
    for field, value in run_config.items():
        if field == "model" or not isinstance(value, str) or ":" in value.split("/")[0] or not os.path.exists(value):
            continue
        absolute = os.path.abspath(value)
        forms = {absolute}
        try:
            forms.add(os.path.relpath(absolute))
        except ValueError:  # another drive (Windows)
            pass
        alternatives.extend({**run_config, field: form} for form in sorted(forms) if form != value)
    return alternatives


class ResultStore:
    """One JSON file per run (config, versions, per-cell records, timing) and a CSV next to it.

    ``versions`` is the latest run's; ``runs[i]["versions"]`` is run i's, and each cell's ``run`` says
    which run computed it.

    The file name is ``{task}-{model}-{hash of the run config}.json``: the same command finds its own
    file again and skips the cells already in it; a different model, text or seed writes a new file.
    Methods and lengths are cells, not config, so adding a method to a finished run only computes it.

    One writer per file: a store that writes holds the file's writer lock (:func:`hf_posext.core.locks.lock_file_writer`)
    from before it reads the file until :meth:`close` (``run_grid`` closes it when it ends; a later save takes the lock
    again), so that a second writer of the same file, in this process or another, is refused before it starts instead
    of dropping the first one's cells.
    """

    def __init__(self, out_dir: str | os.PathLike, task: str, run_config: dict[str, Any], *, overwrite: bool = False, write: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.task = task
        self.write = write
        self.path = self._path_for(task, run_config)
        if not self.path.exists():
            # The same file named another way (../data/x.txt here, /abs/data/x.txt before) is the same run.
            for other in equivalent_run_configs(run_config):
                if self._path_for(task, other).exists():
                    self.path, run_config = self._path_for(task, other), other
                    break
        self._lock = None
        created = not self.out_dir.exists()
        if write:
            self._take_lock()
        self.data: dict[str, Any] = {"task": task, "config": run_config, "versions": versions(), "cells": {}, "runs": []}
        if self.path.exists() and not overwrite:
            from hf_posext.evaluation.results_files import read_results_file

            try:
                previous = read_results_file(self.path)  # a damaged file is named, never reused or silently replaced
            except BaseException:
                self.close()
                if created:
                    with contextlib.suppress(OSError):
                        self.out_dir.rmdir()
                raise
            self.data["cells"] = previous["cells"]
            self.data["runs"] = previous.get("runs", [])
            if previous.get("partial"):
                self.data["partial"] = previous["partial"]
        self._started = time.time()
        # Cells of one file can come from several runs on different machines (a CPU and a GPU, say): each
        # run keeps its own versions, and each cell the index of the run that computed it.
        self.data["runs"].append({"started": _datetime.datetime.now().isoformat(timespec="seconds"), "seconds": None,
                                  "versions": self.data["versions"]})

    def _take_lock(self) -> None:
        from hf_posext.core.locks import lock_file_writer

        created = not self.out_dir.exists()
        try:
            self._lock = lock_file_writer(self.path)
        except BaseException:
            if created:  # a refused writer leaves no folder behind
                with contextlib.suppress(OSError):
                    self.out_dir.rmdir()
            raise

    def close(self) -> None:
        """Give up the file's writer lock (the store stays readable; a later save takes the lock again)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _path_for(self, task: str, run_config: dict[str, Any]) -> Path:
        key = stable_digest(run_config, length=8, algorithm="sha1")
        return self.out_dir / f"{task}-{_slug(str(run_config.get('model', 'model')))}-{key}.json"

    def has(self, cell_id: str) -> bool:
        return cell_id in self.data["cells"]

    def get(self, cell_id: str) -> dict[str, Any]:
        return self.data["cells"][cell_id]

    @property
    def cells(self) -> dict[str, dict[str, Any]]:
        return self.data["cells"]

    def put(self, cell_id: str, record: dict[str, Any]) -> None:
        self.data["cells"][cell_id] = {**record, "run": len(self.data["runs"]) - 1}
        self.drop_partial(cell_id)
        self.save()

    def partial(self, cell_id: str) -> dict[str, Any] | None:
        """The units a stopped run finished of a cell it did not finish (``unit_keys``, ``units`` and what computed
        them), or None. Kept apart from :attr:`cells`, so that no report reads an unfinished cell."""
        return self.data.get("partial", {}).get(cell_id)

    def put_partial(self, cell_id: str, entry: dict[str, Any]) -> None:
        """Keep (and save) the finished units of an unfinished cell, so that a run stopped in it resumes there."""
        self.data.setdefault("partial", {})[cell_id] = entry
        self.save()

    def drop_partial(self, cell_id: str) -> None:
        """Forget a cell's unfinished units (called once the cell is stored whole; saved with it)."""
        partial = self.data.get("partial", {})
        partial.pop(cell_id, None)
        if not partial:
            self.data.pop("partial", None)

    def save(self, **run_info: Any) -> None:
        self.data["runs"][-1]["seconds"] = round(time.time() - self._started, 2)
        self.data["runs"][-1].update(run_info)
        if not self.write:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self._lock is None:  # closed before: one writer at a time still
            self._take_lock()
        write_text_atomic(self.path, json.dumps(self.data, indent=1, default=str))
        from hf_posext.evaluation.report import write_csv

        write_csv(self.data, self.path.with_suffix(".csv"))
