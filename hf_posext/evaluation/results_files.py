"""Reading evaluation results files back, strictly: a file that cannot be used is named, never skipped.

A results file is the JSON a :class:`hf_posext.evaluation.store.ResultStore` writes:
``{"task", "config", "cells": {cell id: record}, "runs": [...]}``. Each record must carry its
coordinates and the numbers of its task; a record that lacks them (a truncated or hand-edited file)
would otherwise show as a blank table cell or be taken for a finished cell and reused.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from pathlib import Path
from typing import Any

from hf_posext.core.errors import DamagedFileError

__all__ = ["ResultsFileError", "TASK_METRICS", "check_cell", "check_results", "read_results_file", "load_results"]

#: The numbers every record of a task must carry (perplexity: the loss; retrieval: the accuracy).
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "perplexity": ("ppl", "nll", "tokens"),
    "passkey": ("teacher_forced_accuracy", "trials", "depth"),
    "needle": ("teacher_forced_accuracy", "trials", "depth"),
}
#: Counts of correct trials and the rate each must agree with (k/n).
_COUNTS = (("greedy_correct", "greedy_accuracy"), ("teacher_forced_correct", "teacher_forced_accuracy"))
_OPTIONAL_NUMBERS = ("greedy_accuracy", "answer_token_accuracy", "seconds", "supported_window", "original_window", "windows")
_ACCURACIES = ("teacher_forced_accuracy", "greedy_accuracy", "answer_token_accuracy")
#: The evaluation stores ppl = exp(min(nll, PPL_NLL_CAP)); a stored ppl further than this (relative) from it is refused.
PPL_NLL_CAP = 700.0
PPL_REL_TOLERANCE = 1e-6


class ResultsFileError(DamagedFileError):
    """A results file that cannot be used; the message names the file, the cell and the field."""


def _is_number(value: Any) -> bool:
    """An int or float that is not NaN (a perplexity may overflow to inf; that is still a number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def check_cell(task: str, cell_id: str, record: Any) -> str | None:
    """What is wrong with one record of a ``task`` results file (None: nothing).

    Args:
        task: the file's task (``perplexity``, ``passkey``, ``needle``, or another: only the
            coordinates are checked then).
        cell_id: the record's key, for the message.
        record: the record as read from JSON.
    """
    if not isinstance(record, dict):
        return f"cell {cell_id!r} holds {reprlib.repr(record)} ({type(record).__name__}), not a record"
    if not isinstance(record.get("method"), str):
        return f"cell {cell_id!r} has no method name"
    if not isinstance(record.get("length"), int) or isinstance(record.get("length"), bool) or record["length"] < 1:
        return f"cell {cell_id!r} has length {record.get('length')!r}, not a token count"
    if not _is_number(record.get("factor")):
        return f"cell {cell_id!r} has factor {record.get('factor')!r}, not a number"
    for name in TASK_METRICS.get(task, ()):
        if name not in record or record[name] is None:
            return f"cell {cell_id!r} lacks its {name!r}"
        if not _is_number(record[name]):
            return f"cell {cell_id!r} has {name} {record[name]!r}, not a number"
    for name in _OPTIONAL_NUMBERS:
        if record.get(name) is not None and not _is_number(record[name]):
            return f"cell {cell_id!r} has {name} {record[name]!r}, not a number"
    for count, rate in _COUNTS:
        if record.get(count) is None:
            continue
        value, trials = record[count], record.get("trials")
        if not isinstance(value, int) or isinstance(value, bool) or not isinstance(trials, int) or not 0 <= value <= trials:
            return f"cell {cell_id!r} has {count} {value!r}, not a whole number of its {trials!r} trials"
        if record.get(rate) is not None and abs(record[rate] - value / trials) > 1e-9:
            return f"cell {cell_id!r} has {count} {value} of {trials} trials but {rate} {record[rate]!r}"
    return _impossible_value(cell_id, record)


def _impossible_value(cell_id: str, record: dict[str, Any]) -> str | None:
    """A number no evaluation can produce (a hand-edited or corrupted cell), named; None when all are possible."""
    if record.get("nll") is not None and record["nll"] < 0:
        return f"cell {cell_id!r} has nll {record['nll']!r}, but a negative log-likelihood is never below 0"
    if record.get("ppl") is not None and record["ppl"] < 1:
        return f"cell {cell_id!r} has ppl {record['ppl']!r}, but a perplexity (exp of the nll) is never below 1"
    for name in ("tokens", "trials"):
        if record.get(name) is not None and record[name] < 1:
            return f"cell {cell_id!r} has {name} {record[name]!r}, but a cell scores at least 1"
    for name in _ACCURACIES:
        if record.get(name) is not None and not 0 <= record[name] <= 1:
            return f"cell {cell_id!r} has {name} {record[name]!r}, outside [0, 1]"
    if _is_number(record.get("depth")) and not 0 <= record["depth"] <= 1:
        return f"cell {cell_id!r} has depth {record['depth']!r}, outside [0, 1] (0 puts the needle at the start, 1 at the end)"
    return _disagreement(cell_id, record)


def _disagreement(cell_id: str, record: dict[str, Any]) -> str | None:
    """Numbers of one record that contradict each other (a perplexity that is not exp of its nll, per-trial outcomes
    that do not add up to the stored counts), named; None when they agree."""
    if _is_number(record.get("nll")) and _is_number(record.get("ppl")):
        expected = math.exp(min(record["nll"], PPL_NLL_CAP))  # the evaluation caps the exponent, so it never overflows
        if not math.isclose(record["ppl"], expected, rel_tol=PPL_REL_TOLERANCE):
            return (f"cell {cell_id!r} has ppl {record['ppl']!r}, but its nll {record['nll']!r} gives exp(nll) = {expected:.6g}; "
                    "the perplexity is exp of the nll")
    units, keys = record.get("units"), record.get("unit_keys")
    if units is None:
        return None  # written before per-trial outcomes were kept
    if not isinstance(units, list) or not all(isinstance(unit, dict) for unit in units):
        return f"cell {cell_id!r} has units {reprlib.repr(units)}, not a list of per-trial results"
    if keys is not None and (not isinstance(keys, list) or len(keys) != len(units)):
        return f"cell {cell_id!r} has {len(units)} units but unit_keys {reprlib.repr(keys)}, not one key per unit"
    trials = record.get("trials")
    for (count, rate), field in zip(_COUNTS, ("greedy", "teacher_forced")):
        outcomes = [unit[field] for unit in units if unit.get(field) is not None]
        if not outcomes:
            continue
        if len(outcomes) != len(units) or len(units) != trials:
            return f"cell {cell_id!r} has {trials!r} trials but {len(outcomes)} per-trial {field} outcomes in its units"
        found = sum(bool(outcome) for outcome in outcomes)
        name = count if record.get(count) is not None else rate  # records written before counts were kept: the rate
        if record.get(name) is None:
            continue
        stored = record[name] if name == count else round(record[rate] * trials)
        if found != stored:
            return (f"cell {cell_id!r} has {name} {record[name]!r} of {trials} trials, but its per-trial outcomes (units) "
                    f"found {found}")
    return None


def check_results(data: Any) -> str | None:
    """What is wrong with a whole results file's content (None: nothing)."""
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an evaluation results object"
    missing = [key for key in ("task", "config", "cells") if key not in data]
    if missing:
        return f"lacks {', '.join(repr(k) for k in missing)}: not an evaluation results file"
    if not isinstance(data["task"], str):
        return f"has task {data['task']!r}, not a task name"
    if not isinstance(data["config"], dict):
        return "has a config that is not an object"
    if not isinstance(data["cells"], dict):
        return f"has cells of type {type(data['cells']).__name__}, not an object of records"
    runs = data.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(run, dict) for run in runs):
        return "has a 'runs' entry that is not a list of objects"
    partial = data.get("partial", {})
    if not isinstance(partial, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("units"), list) and isinstance(entry.get("unit_keys"), list)
            and len(entry["units"]) == len(entry["unit_keys"]) for entry in partial.values()):
        return "has a 'partial' entry (the finished units of unfinished cells) that is not an object of unit lists"
    for cell_id, record in data["cells"].items():
        problem = check_cell(data["task"], cell_id, record)
        if problem:
            return problem
        run = record.get("run")
        if run is not None and (not isinstance(run, int) or not 0 <= run < len(runs)):
            return f"cell {cell_id!r} names run {run!r}, which the file's 'runs' list does not hold"
    return None


def read_results_file(path: str | os.PathLike) -> dict[str, Any]:
    """One results file, checked.

    Raises:
        ResultsFileError: it is a folder, or not UTF-8 JSON, or not a results object, or a record lacks its
            numbers, holds something else where a number belongs or a number no evaluation gives (a negative
            nll, a perplexity below 1, an accuracy outside [0, 1]); the message names the file and the cell.
    """
    path = Path(path)
    if path.is_dir():
        raise ResultsFileError(f"{path} is a folder, not a results file; rename it or move it out of {path.parent} "
                               "(every *.json there is read as results).")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResultsFileError(f"{path} is not a readable results file ({type(error).__name__}: {str(error).splitlines()[0]}); "
                               "restore it from version control, or delete it to recompute its cells.") from None
    problem = check_results(data)
    if problem:
        fix = ("move it out of the results folder" if problem.startswith(("holds a JSON", "lacks")) else
               "restore it from version control, or delete it to recompute its cells")
        raise ResultsFileError(f"{path} {problem}; {fix}.")
    return data


def load_results(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """Every results file (``*.json``) directly in ``folder``, sorted by name, each with ``_file`` set.

    Every ``*.json`` in the folder must be a results file: one that is not is named in the error, never
    skipped, so that a damaged file cannot silently drop its cells from a report.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ResultsFileError: a file cannot be used (see :func:`read_results_file`).
        ValueError: the folder holds no results file.
    """
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"Results folder {path} does not exist; pass the --out folder of an evaluation run.")
    runs = []
    for file in sorted(path.glob("*.json")):
        data = read_results_file(file)
        data["_file"] = str(file)
        runs.append(data)
    if not runs:
        raise ValueError(f"{path} holds no evaluation results (*.json written by hf-posext eval).")
    return runs
