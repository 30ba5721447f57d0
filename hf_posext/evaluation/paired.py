"""Two series of a report compared on the same trials: the trials only one of them found, and the exact
sign test.

Retrieval cells keep one outcome per trial (``units``), keyed by ``unit_keys`` = ``[task, length, depth,
trial]``. Every method draws trial ``t`` at depth ``d`` from the same seed, so two series that both hold a key
were given the same prompt, provided their runs agree on the settings that build the prompts
(:data:`TRIAL_SETTINGS`; checked, a difference is refused). On paired trials the question "is A better than
B?" rests on the discordant trials alone, those one series found and the other missed, which is sharper than
comparing two Wilson intervals: 24/24 against 20/24 overlap as intervals, yet 4 discordant trials all one way
give p = 0.125, and 10 all one way give p = 0.002.

Used by ``hf-posext report FOLDER --compare A B`` (a table per task, one row per pair, one cell per length).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from hf_posext.evaluation.labels import series_name
from hf_posext.evaluation.proportions import sign_test_p_value
from hf_posext.evaluation.tables import Table, TableCell, task_records

__all__ = ["TRIAL_SETTINGS", "PairedCount", "kept_trials", "window_losses", "paired_counts", "comparison_tables"]

#: Run settings that make a trial's prompt or its scoring: two series are paired only where these agree.
TRIAL_SETTINGS = ("seed", "format", "haystack", "haystack_start", "needle", "max_new_tokens")

#: Accuracy metric -> the field of one unit (trial) that holds its outcome.
_UNIT_FIELDS = {"greedy_accuracy": "greedy", "teacher_forced_accuracy": "teacher_forced"}


@dataclass(frozen=True)
class PairedCount:
    """Outcomes of two series on the trials both ran."""

    both: int
    only_first: int
    only_second: int
    neither: int

    @property
    def trials(self) -> int:
        return self.both + self.only_first + self.only_second + self.neither

    @property
    def p_value(self) -> float:
        """The exact two-sided sign test on the discordant trials (:func:`sign_test_p_value`)."""
        return sign_test_p_value(self.only_first, self.only_second)

    def text(self) -> str:
        """e.g. ``4:0 of 24 (both 20, neither 0; p = 0.125)``: found only by the first : only by the second."""
        return (f"{self.only_first}:{self.only_second} of {self.trials} "
                f"(both {self.both}, neither {self.neither}; p = {self.p_value:.3g})")


def _series(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        grouped[series_name(record)].append(record)
    return grouped


def kept_trials(record: dict[str, Any], metric: str = "greedy_accuracy") -> Iterator[tuple[int, float, int, dict[str, Any]]]:
    """``(length, depth, trial, unit)`` for each trial of one retrieval cell record that kept its outcome for
    ``metric`` (``unit[field]`` is its truth value; records written before trials were kept yield nothing).

    Args:
        record: one cell of a passkey or needle results file (``unit_keys`` = ``[task, length, depth, trial]``
            beside ``units``).
        metric: ``greedy_accuracy`` or ``teacher_forced_accuracy``.
    """
    field = _UNIT_FIELDS[metric]
    for key, unit in zip(record.get("unit_keys") or [], record.get("units") or []):
        if isinstance(unit, dict) and unit.get(field) is not None:
            _task, length, depth, trial = key
            yield int(length), float(depth), int(trial), unit


def window_losses(record: dict[str, Any]) -> dict[str, float]:
    """``{"DOCUMENT/OFFSET": mean NLL}``: the mean negative log-likelihood per token of each window one perplexity
    cell record kept (``unit_keys`` = ``["ppl", length, document, offset]`` beside ``units`` holding ``nll_sum``
    and ``tokens``); records written before windows were kept give none.

    Two rows evaluated on the same text at the same length hold the same windows, so they pair window by window.
    """
    losses = {}
    for key, unit in zip(record.get("unit_keys") or [], record.get("units") or []):
        if isinstance(unit, dict) and unit.get("tokens") and unit.get("nll_sum") is not None:
            _task, _length, document, offset = key
            losses[f"{document}/{offset}"] = float(unit["nll_sum"]) / int(unit["tokens"])
    return losses


def _outcomes(records: Sequence[dict[str, Any]], metric: str, settings: dict[str, dict[str, Any]]) -> dict[tuple, tuple]:
    """``(length, depth, trial)`` -> ``(found, value, settings, file)`` for every trial of one series that kept
    its outcome (:func:`kept_trials`)."""
    field = _UNIT_FIELDS[metric]
    outcomes: dict[tuple, tuple] = {}
    for record in records:
        for length, depth, trial, unit in kept_trials(record, metric):
            entry = (bool(unit[field]), unit.get("value"), settings.get(record["_file"], {}), record["_file"])
            seen = outcomes.setdefault((length, depth, trial), entry)
            differs = [s for s in TRIAL_SETTINGS if seen[2].get(s) != entry[2].get(s)]
            if differs:
                raise ValueError(f"{series_name(record)!r} holds trial {trial + 1} at length {length}, depth {depth:g} "
                                 f"twice, with different {differs[0]} ({seen[3]} and {entry[3]}); report them from separate "
                                 "folders to compare them.")
    return outcomes


def _check_same_trial(key: tuple, first: tuple, second: tuple, names: tuple[str, str]) -> None:
    where = f"length {key[0]}, depth {key[1]:g}, trial {key[2] + 1}"
    for setting in TRIAL_SETTINGS:
        a, b = first[2].get(setting), second[2].get(setting)
        if a != b:
            raise ValueError(f"{names[0]!r} and {names[1]!r} ran different trials at {where}: {setting} is {a!r} in {first[3]} "
                             f"and {b!r} in {second[3]}; compare series run with the same {setting}.")
    if first[1] is not None and second[1] is not None and first[1] != second[1]:
        raise ValueError(f"{names[0]!r} and {names[1]!r} ran different trials at {where}: the hidden value is {first[1]!r} in "
                         f"{first[3]} and {second[1]!r} in {second[3]}; compare series run with the same seed.")


def paired_counts(runs: Sequence[dict[str, Any]], task: str, first: str, second: str,
                  metric: str = "greedy_accuracy") -> dict[int, PairedCount]:
    """``{length: PairedCount}`` of two series of ``task`` on the trials both ran (lengths with none left out).

    Args:
        runs: results files as :func:`hf_posext.evaluation.results_files.load_results` returns them.
        task: ``passkey`` or ``needle``.
        first, second: series names as the report's tables show them (``yarn x4``, ``model: string``).
        metric: ``greedy_accuracy`` or ``teacher_forced_accuracy``.

    Raises:
        ValueError: an unknown metric or series (the message lists the series there are), or a trial both
            ran with different prompt settings or hidden values.
    """
    if metric not in _UNIT_FIELDS:
        raise ValueError(f"metric must be one of {sorted(_UNIT_FIELDS)}, got {metric!r}.")
    if first == second:
        raise ValueError(f"--compare: {first!r} is compared with itself; name two different series.")
    grouped = _series(task_records(runs, task))
    for name in (first, second):
        if name not in grouped:
            there = f"the series are: {', '.join(sorted(grouped))}" if grouped else "they hold no series"
            raise ValueError(f"no series {name!r} in the {task} results; {there}.")
    settings = {run.get("_file", ""): run.get("config", {}) for run in runs}
    a, b = (_outcomes(grouped[name], metric, settings) for name in (first, second))
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for key in sorted(a.keys() & b.keys()):
        _check_same_trial(key, a[key], b[key], (first, second))
        found_a, found_b = a[key][0], b[key][0]
        counts[key[0]][0 if found_a and found_b else 1 if found_a else 2 if found_b else 3] += 1
    return {length: PairedCount(*c) for length, c in sorted(counts.items())}


def _sources(records: Sequence[dict[str, Any]], length: int) -> tuple[tuple[str, int | None], ...]:
    """The (file, run) pairs that computed ``records``' cells at ``length``, as table cells keep them."""
    pairs = {(r["_file"], r["_run"]) for r in records if r["length"] == length}
    return tuple(sorted(pairs, key=lambda s: (s[0], -1 if s[1] is None else s[1])))


def comparison_tables(runs: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]]) -> list[Table]:
    """One table per retrieval task that both series of some pair ran: a row per pair, a cell per length.

    Greedy outcomes when every trial of the pair has one, else teacher-forced (the title says which).

    Raises:
        ValueError: a series that is in no retrieval task (listing those there are), a pair that shares no
            trial, or what :func:`paired_counts` refuses (a series compared with itself, a mismatched trial).
    """
    tables = []
    used: set[tuple[str, str]] = set()
    for task, title in (("passkey", "Passkey"), ("needle", "Needle")):
        grouped = _series(task_records(runs, task))
        rows = []
        for first, second in pairs:
            if first not in grouped or second not in grouped:
                continue
            members = grouped[first] + grouped[second]
            greedy = all(r.get("greedy_accuracy") is not None for r in members)
            metric = "greedy_accuracy" if greedy else "teacher_forced_accuracy"
            counts = paired_counts(runs, task, first, second, metric)
            if not counts:
                continue
            used.add((first, second))
            scoring = "greedy" if greedy else "teacher-forced"
            rows.append((f"{first} vs {second} ({scoring})",
                         {length: TableCell(count.p_value, count.text(), _sources(members, length)) for length, count in counts.items()}))
        if rows:
            lengths = sorted({length for _name, cells in rows for length in cells})
            tables.append(Table(f"{title}, the same trials: found by the first only : by the second only, of the trials both ran "
                                "(exact two-sided sign test)", lengths, rows))
    for first, second in pairs:
        if (first, second) in used:
            continue
        known = sorted({series_name(r) for task in ("passkey", "needle") for r in task_records(runs, task)})
        if not known:
            tasks = ", ".join(sorted({str(run.get("task")) for run in runs}))
            held = f"the results hold only {tasks}" if tasks else "there are no results"
            raise ValueError(f"--compare: no passkey or needle results to compare {first!r} and {second!r} on ({held}); "
                             "compare in a folder with passkey or needle results, or leave out --compare.")
        for name in (first, second):
            if name not in known:
                raise ValueError(f"--compare: no passkey or needle series {name!r}; the series are: {', '.join(known)}.")
        raise ValueError(f"--compare: {first!r} and {second!r} share no trial with a kept outcome; run both on the same "
                         "lengths, depths and trials (cells written before per-trial outcomes were kept cannot be paired).")
    return tables
