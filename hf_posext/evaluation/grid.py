"""The grid loop every evaluation shares: methods x lengths x cells, on one model, resumable.

One run evaluates one model under several scaling methods side by side: the model is loaded once and
patched with each method in turn (``"none"`` is the unpatched baseline), so every method sees exactly the
same weights, text, passkeys and seeds.

Work is a grid of *cells* (method x length x ...); each cell is made of *units* (perplexity segments,
passkey trials). Under ``accelerate launch --num_processes N`` (or ``torchrun``) the pending units of a
(method, length) step are split round-robin across processes, evaluated, and gathered to every process,
so the numbers do not depend on N (with ``batch_size=1``). After each step the main process writes the
cell records to one JSON file per run (plus a CSV), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from hf_posext.api import describe, patch, unpatch
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest
from hf_posext.evaluation.fingerprints import (
    attention_function,
    function_fingerprint,
    rope_frequencies,
    is_full_weights_fingerprint,
    same_attention_function,
    same_frequencies,
    sampled_weights_fingerprint,
    weights_fingerprint,
)
from hf_posext.evaluation.store import ResultStore
from hf_posext.lm.distributed import Distributed

__all__ = ["Unit", "Cell", "cell_id", "stored_units", "resolve_factor_for", "apply_method", "check_length", "cell_groups", "run_grid",
           "cell_text", "record_summary"]


def resolve_factor_for(method: ScalingRequest, factor: float | None, lengths: Sequence[int], original_window: int) -> float:
    """The factor a method runs with: 1 for ``none``, else ``factor``, else longest length / window (>= 1)."""
    if method.method == "none":
        return 1.0
    if method.factor is not None:
        return float(method.factor)
    if factor is not None:
        return float(factor)
    return max(1.0, max(lengths) / original_window)


@contextlib.contextmanager
def apply_method(model: torch.nn.Module, method: ScalingRequest, factor: float) -> Iterator[ScalingReport]:
    """Patch ``model`` with ``method`` for the block, then restore it exactly; yields the scaling report."""
    patch(model, method.method, factor, **method.params_dict)
    try:
        yield describe(model)
    finally:
        unpatch(model)


def check_length(report: ScalingReport, length: int, method_label: str) -> str | None:
    """Warn (never fail) when ``length`` exceeds what the method and factor claim to support."""
    if report.dynamic or length <= report.current_window:
        return None
    message = (
        f"{method_label} x{report.factor:g} supports {report.current_window} tokens; evaluating {length} "
        "anyway (that is the experiment: expect degraded numbers)."
    )
    warnings.warn(message, stacklevel=2)
    return message


@dataclass
class Unit:
    """One piece of work: ``key`` identifies its input (for reuse), ``payload`` is what the evaluator needs."""

    key: Any
    payload: Any


@dataclass
class Cell:
    """A grid cell at one length: its extra coordinates (e.g. depth) and its units."""

    coords: dict[str, Any]
    units: list[Unit]
    info: dict[str, Any] = field(default_factory=dict)


def cell_id(method: ScalingRequest, factor: float, length: int, coords: dict[str, Any]) -> str:
    parts = [method.label, f"factor={factor:g}", f"length={length}"] + [f"{k}={v}" for k, v in sorted(coords.items())]
    return "|".join(parts)


def run_grid(
    *,
    model: torch.nn.Module,
    methods: Sequence[ScalingRequest],
    lengths: Sequence[int],
    factor: float | None,
    plan: Callable[[int], list[Cell]],
    evaluate: Callable[[list[Any]], list[dict[str, Any]]],
    aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    store: ResultStore,
    dist: Distributed | None = None,
    batch_size: int = 1,
    reuse_identical: bool = True,
    progress: bool = True,
    description: str = "",
    unit_name: str = "unit",
) -> ResultStore:
    """Evaluate every (method, length, cell) not yet in ``store``, side by side on one model.

    Args:
        model: the loaded model (patched here with each method in turn, restored afterwards).
        methods: methods to compare.
        lengths: sequence lengths in tokens.
        factor: the scale factor (None: longest length / the model's original window).
        plan: ``length -> cells`` (same on every process: deterministic).
        evaluate: evaluates a batch of unit payloads -> one result dict per payload (each with a
            ``"seconds"`` entry added here).
        aggregate: unit results of one cell -> the cell's metrics.
        store: where records go (and which cells are done); build it with ``write=dist.is_main``.
        dist: process group (None: one process).
        batch_size: units per forward pass.
        reuse_identical: reuse a unit result when another method computes the same function at this
            length (see :func:`~hf_posext.evaluation.fingerprints.rope_fingerprint`).
        progress: show a progress bar (main process only).
        description: progress bar label.
        unit_name: what a unit is (``"trial"``, ``"window"``), for log lines.
    """
    try:
        return _run_grid(model, methods, lengths, factor, plan, store, _Job(
            evaluate, aggregate, store, dist or Distributed(), batch_size, reuse_identical, progress, description, unit_name))
    finally:
        store.close()  # the file's writer lock: another run may write it now


def _run_grid(model, methods, lengths, factor, plan, store: ResultStore, job: "_Job") -> ResultStore:
    original_window = describe(model).original_window
    weights = weights_fingerprint(model)  # before any method patches a learned position table
    # cells written before every element was hashed are checked against the sampled hash they carry
    older = any("model_weights" in r and not is_full_weights_fingerprint(r["model_weights"]) for r in store.cells.values())
    sampled_weights = sampled_weights_fingerprint(model) if older else None
    memo: dict[tuple[str, Any], tuple[dict[str, Any], str]] = {}
    plans = {length: plan(length) for length in lengths}
    for method in methods:
        method_factor = resolve_factor_for(method, factor, lengths, original_window)
        ids = {length: [cell_id(method, method_factor, length, c.coords) for c in plans[length]] for length in lengths}
        if _all_stored_without_frequencies(store, ids, plans):
            continue  # all done, nothing to re-check
        with apply_method(model, method, method_factor) as report:
            for length in lengths:
                step = _Step(method, method_factor, length, report, rope_frequencies(model, length),
                             attention_function(model), weights, sampled_weights, original_window)
                _run_step(job, step, plans[length], ids[length], memo)
    store.save(world_size=job.dist.world_size)
    return store


@dataclass(frozen=True)
class _Job:
    """What a task gives :func:`run_grid`: how to evaluate and aggregate units, where records go, how to run."""

    evaluate: Callable[[list[Any]], list[dict[str, Any]]]
    aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    store: ResultStore
    dist: Distributed
    batch_size: int
    reuse_identical: bool
    progress: bool
    description: str
    unit_name: str = "unit"


@dataclass(frozen=True)
class _Step:
    """One (method, length) of the grid, with the model patched: its report and rotary frequencies."""

    method: ScalingRequest
    factor: float
    length: int
    report: ScalingReport
    frequencies: list[dict[str, Any]] | None  # None: not a RoPE model
    attention: dict[str, Any] | None = None  # an attention-level method's settings and kernel hash
    weights: str | None = None  # weights_fingerprint of the unpatched model
    sampled_weights: str | None = None  # its sampled_weights_fingerprint, when a stored cell carries one
    original_window: int | None = None  # the unpatched model's original window (describe), for the plots

    @functools.cached_property
    def fingerprint(self) -> str | None:
        return function_fingerprint(self.frequencies, self.attention)

    @property
    def label(self) -> str:
        return f"{self.method.label} x{self.factor:g}"


def _all_stored_without_frequencies(store: ResultStore, ids: dict[int, list[str]], plans: dict[int, list[Cell]]) -> bool:
    """Every cell of a method is stored with all its units, and none carries frequencies, an attention function
    or weights to re-check."""
    pairs = [(i, cell) for length, length_ids in ids.items() for i, cell in zip(length_ids, plans[length])]
    if not all(store.has(i) and len(stored_units(store.get(i), cell)) == len(cell.units) for i, cell in pairs):
        return False
    return not any("rope_frequencies" in r or "attention_function" in r or "model_weights" in r
                   for r in (store.get(i) for i, _ in pairs))


def _unit_key_text(key: Any) -> str:
    return json.dumps(key, default=str)


def stored_units(record: dict[str, Any], cell: Cell) -> dict[int, dict[str, Any]]:
    """The results ``record`` already holds for ``cell``'s units, by their index in ``cell.units``.

    A record keeps its units' keys (``unit_keys``), so a cell asked for with more trials than were stored
    computes only the new trials and keeps the stored ones (same seeds, same prompts); one asked for with
    fewer is complete. A record from before keys were kept counts as complete when it holds at least as
    many units as the cell, else as empty (its units cannot be matched to the cell's).
    """
    units = record.get("units") or []
    keys = record.get("unit_keys")
    if keys is None or len(keys) != len(units):
        return dict(enumerate(units[: len(cell.units)])) if len(units) >= len(cell.units) else {}
    by_key = {_unit_key_text(key): result for key, result in zip(keys, units)}
    found = {}
    for index, unit in enumerate(cell.units):
        text = _unit_key_text(unit.key)
        if text in by_key:
            found[index] = by_key[text]
    return found


def _stale_cells(store: ResultStore, ids: list[str], step: _Step) -> list[str]:
    """Stored cells computed with other rotary frequencies, or another attention function, than the model has now.

    A stored cell counts only if the method still computes the same rotary function: a factors file
    rewritten by a new search, or a changed formula, makes it stale. The check compares frequencies, so
    cells computed on another machine (a GPU) are not stale. Records without frequencies (written
    before they were kept) are trusted by label. An attention-level method (Self-Extend, DCA) is also
    checked by its settings and kernel code (:func:`~hf_posext.evaluation.fingerprints.attention_function`).
    A cell that records the weights it was computed on is stale on other weights (a model retrained into
    the same folder); records from before weights were kept are trusted, and records from before every
    element was hashed are checked by the sampled hash they carry.
    """
    return [i for i in ids if store.has(i) and _computed_otherwise(store.get(i), step)]


def _run_step(job: _Job, step: _Step, cells: list[Cell], ids: list[str], memo: dict) -> None:
    """Compute the cells of one (method, length) that are missing or stale, reusing ``memo`` where allowed.

    Cells are evaluated and stored group by group (see :func:`cell_groups`), so an evaluation stopped part way
    keeps every cell it finished: the next run computes only the rest. Within a group, the units finished so far
    are kept after every batch (:meth:`ResultStore.put_partial`), so a run stopped inside a cell (eight
    perplexity segments of 32768 tokens take hours on a CPU) resumes at its next unit.
    """
    stale = _stale_cells(job.store, ids, step)
    if stale:
        warnings.warn(f"{step.label} @ {step.length}: {len(stale)} stored cell(s) were computed with another rotary "
                      "embedding, attention kernel or model weights (changed parameters, factors file, code or "
                      "a retrained model); recomputing them.",
                      stacklevel=3)
    kept: dict[int, dict[str, Any]] = {}  # id(unit) -> its stored result, for cells stored with fewer units
    pending = []
    resumed = 0  # units a stopped run finished in cells it did not finish
    for cell, i in zip(cells, ids):
        stored = stored_units(job.store.get(i), cell) if job.store.has(i) and i not in stale else {}
        partial = job.store.partial(i)
        if partial is not None and not _computed_otherwise(partial, step):
            unfinished = stored_units(partial, cell)
            resumed += len(unfinished.keys() - stored.keys())
            stored = {**unfinished, **stored}
        if len(stored) < len(cell.units):
            pending.append(cell)
            kept.update({id(cell.units[index]): result for index, result in stored.items()})
    if not pending:
        return
    if resumed and job.dist.is_main:
        print(f"{job.description}{step.label} @ {step.length}: resuming after {resumed} {job.unit_name}(s) a stopped run finished",
              file=sys.stderr)
    warning = check_length(step.report, step.length, step.method.label)
    fingerprint = step.fingerprint if job.reuse_identical else None
    needed = {id(u) for cell in pending for u in cell.units
              if id(u) not in kept and (fingerprint is None or (fingerprint, u.key) not in memo)}
    groups = cell_groups(pending, needed, job.dist.world_size * job.batch_size)
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(len(job.dist.shard(units)) for _, units in groups), leave=False,
               desc=f"{job.description}{step.method.label} @ {step.length}",
               disable=not (job.progress and job.dist.is_main))
    computed = dict(kept)
    chunk = job.dist.world_size * job.batch_size
    for group, units in groups:
        for start in range(0, max(len(units), 1), chunk):  # the same number of steps on every process
            part = units[start : start + chunk]
            began = time.time()
            gathered = _evaluate_units(job, part, bar)
            for index, unit in enumerate(part):
                computed[id(unit)] = gathered[index]
                if fingerprint is not None:
                    memo[(fingerprint, unit.key)] = (gathered[index], step.label)
            if start + chunk < len(units):  # more of this group to come: keep what its cells have so far
                _keep_partial(job.store, step, group, computed)
                if not job.progress and job.dist.is_main:  # a long cell in the background: one line a kept part
                    where = cell_text(group[0].coords) if len(group) == 1 else f" ({len(group)} cells)"
                    print(f"{job.description}{step.label} @ {step.length}{where}: {start + len(part)} of {len(units)} "
                          f"{job.unit_name}s done and kept, {time.time() - began:.0f} s",
                          file=sys.stderr, flush=True)
        for cell in group:
            unit_results, reused_from = _unit_results(cell, computed, memo, fingerprint)
            record = _cell_record(step, cell, job.aggregate(unit_results), unit_results, reused_from, warning is not None)
            job.store.put(cell_id(step.method, step.factor, step.length, cell.coords), record)
            if not job.progress and job.dist.is_main:  # no bar (a run in the background): one line a finished cell
                print(f"{job.description}{step.label} @ {step.length}{cell_text(cell.coords)}: {record_summary(record)}",
                      file=sys.stderr, flush=True)
    bar.close()
    job.dist.barrier()


def cell_text(coords: dict[str, Any]) -> str:
    """``", depth 0.5"``: a cell's coordinates beside its method and length in a log line."""
    return "".join(f", {name} {value:g}" if isinstance(value, float) else f", {name} {value}" for name, value in coords.items())


def record_summary(record: dict[str, Any]) -> str:
    """One finished cell in a few words for a log line: ``2/2 found (greedy), 1120 s`` or ``perplexity 24.36, 310 s``."""
    if record.get("greedy_correct") is not None:
        text = f"{record['greedy_correct']}/{record.get('trials')} found (greedy)"
    elif record.get("teacher_forced_correct") is not None:
        text = f"{record['teacher_forced_correct']}/{record.get('trials')} found (teacher-forced)"
    elif record.get("ppl") is not None:
        text = f"perplexity {record['ppl']:.2f}"
    else:
        text = "done"
    return text + (f", {record['seconds']:.0f} s" if isinstance(record.get("seconds"), (int, float)) else "")


def _check_fields(step: _Step) -> dict[str, Any]:
    """What a record keeps of the function that computed it (checked by :func:`_stale_cells`)."""
    fields: dict[str, Any] = {}
    if step.frequencies is not None:
        fields["rope_frequencies"] = step.frequencies
    if step.attention is not None:
        fields["attention_function"] = step.attention
    if step.weights is not None:
        fields["model_weights"] = step.weights
    return fields


def _computed_otherwise(record: dict[str, Any], step: _Step) -> bool:
    """A stored cell (or an unfinished cell's units) was computed with other rotary frequencies, attention or model
    weights than ``step`` has now (see :func:`_stale_cells`)."""
    other_rope = (step.frequencies is not None and record.get("rope_frequencies") is not None
                  and not same_frequencies(record["rope_frequencies"], step.frequencies))
    other_attention = ("attention_function" in record
                       and not same_attention_function(record["attention_function"], step.attention))
    recorded = record.get("model_weights")
    current = step.weights if recorded is None or is_full_weights_fingerprint(recorded) else step.sampled_weights
    other_weights = recorded is not None and current is not None and recorded != current
    return other_rope or other_attention or other_weights


def _keep_partial(store: ResultStore, step: _Step, group: list[Cell], computed: dict[int, dict[str, Any]]) -> None:
    """Keep the finished units of ``group``'s unfinished cells (:meth:`ResultStore.put_partial`)."""
    for cell in group:
        done = [unit for unit in cell.units if id(unit) in computed]
        if done and len(done) < len(cell.units):
            store.put_partial(cell_id(step.method, step.factor, step.length, cell.coords), {
                **_check_fields(step), "unit_keys": [json.loads(_unit_key_text(unit.key)) for unit in done],
                "units": [computed[id(unit)] for unit in done]})


def cell_groups(cells: list[Cell], needed: set[int], group_units: int) -> list[tuple[list[Cell], list[Unit]]]:
    """Consecutive ``cells`` grouped so that each group (but the last) needs at least ``group_units`` units.

    ``needed`` holds ``id(unit)`` of the units to compute (the others are stored or reused). A group is
    evaluated, then its cells are stored; ``group_units`` = processes x batch size keeps every process busy
    with full batches, and one cell per group when a cell alone fills them.
    """
    groups: list[tuple[list[Cell], list[Unit]]] = []
    group: list[Cell] = []
    units: list[Unit] = []
    for cell in cells:
        group.append(cell)
        units.extend(u for u in cell.units if id(u) in needed)
        if len(units) >= group_units:
            groups.append((group, units))
            group, units = [], []
    if group:
        groups.append((group, units))
    return groups


def _evaluate_units(job: _Job, needed: list[Unit], bar: Any) -> dict[int, dict[str, Any]]:
    """This process's share of ``needed``, evaluated in batches; every unit's result (index in ``needed``), from all processes."""
    local = job.dist.shard(needed)
    index_of = {id(u): i for i, u in enumerate(needed)}
    results: list[tuple[int, dict[str, Any]]] = []
    for start in range(0, len(local), job.batch_size):
        batch = local[start : start + job.batch_size]
        began = time.time()
        outputs = job.evaluate([u.payload for u in batch])
        seconds = (time.time() - began) / len(batch)
        results.extend((index_of[id(unit)], {**output, "seconds": seconds}) for unit, output in zip(batch, outputs))
        bar.update(len(batch))
    return dict(job.dist.gather(results))


def _unit_results(cell: Cell, computed: dict[int, dict[str, Any]], memo: dict, fingerprint: str | None
                  ) -> tuple[list[dict[str, Any]], set[str]]:
    """A cell's unit results in order (computed now, or reused from another method), and where reused ones came from."""
    results, reused_from = [], set()
    for unit in cell.units:
        if id(unit) in computed:
            results.append(computed[id(unit)])
        else:
            result, origin = memo[(fingerprint, unit.key)]
            results.append({**result, "seconds": 0.0})
            reused_from.add(origin)
    return results, reused_from


def _cell_record(step: _Step, cell: Cell, metrics: dict[str, Any], unit_results: list[dict[str, Any]],
                 reused_from: set[str], beyond_window: bool) -> dict[str, Any]:
    """What the results file keeps for one cell: where it sits, its metrics, and what computed it."""
    record = {
        "method": step.method.method,
        "label": step.method.label,
        "params": step.method.params_dict,
        "factor": step.factor,
        "length": step.length,
        **cell.coords,
        **metrics,
        **cell.info,
        "supported_window": step.report.current_window,
        "dynamic": step.report.dynamic,
        "beyond_window": beyond_window,
        "seconds": round(sum(r["seconds"] for r in unit_results), 3),
        "units": unit_results,
        "unit_keys": [json.loads(_unit_key_text(unit.key)) for unit in cell.units],
    }
    if step.original_window is not None:
        # The loaded model's window before any scaling: a model saved with yarn x4 in its config and evaluated
        # at x1 (STRING on it) has supported_window 4x this, which is not the window it was trained at.
        record["original_window"] = step.original_window
    if reused_from:
        record["reused_from"] = sorted(reused_from)
    if step.fingerprint is not None:
        record["rope_fingerprint"] = step.fingerprint
    record.update(_check_fields(step))
    return record
