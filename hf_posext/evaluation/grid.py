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
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from hf_posext.api import describe, patch, unpatch
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest
from hf_posext.evaluation.fingerprints import hash_frequencies, rope_frequencies, same_frequencies
from hf_posext.evaluation.store import ResultStore
from hf_posext.lm.distributed import Distributed

__all__ = ["Unit", "Cell", "cell_id", "resolve_factor_for", "apply_method", "check_length", "run_grid"]


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
            length (see :func:`rope_fingerprint`).
        progress: show a progress bar (main process only).
        description: progress bar label.
    """
    from tqdm.auto import tqdm

    dist = dist or Distributed()
    original_window = describe(model).original_window
    memo: dict[tuple[str, Any], tuple[dict[str, Any], str]] = {}
    plans = {length: plan(length) for length in lengths}
    for method in methods:
        method_factor = resolve_factor_for(method, factor, lengths, original_window)
        ids = {length: [cell_id(method, method_factor, length, c.coords) for c in plans[length]] for length in lengths}
        stored = [store.get(i) for length in lengths for i in ids[length] if store.has(i)]
        if len(stored) == sum(map(len, ids.values())) and not any("rope_frequencies" in r for r in stored):
            continue  # all done, nothing to re-check
        with apply_method(model, method, method_factor) as report:
            for length in lengths:
                # A stored cell counts only if the method still computes the same rotary function: a
                # factors file rewritten by a new search, or a changed formula, makes it stale. The check
                # compares frequencies, so cells computed on another machine (a GPU) are not stale.
                # Records without frequencies (written before they were kept) are trusted by label.
                frequencies = rope_frequencies(model, length)
                current = hash_frequencies(frequencies)
                stale = [i for i in ids[length] if store.has(i) and frequencies is not None
                         and store.get(i).get("rope_frequencies") is not None
                         and not same_frequencies(store.get(i)["rope_frequencies"], frequencies)]
                if stale:
                    warnings.warn(f"{method.label} x{method_factor:g} @ {length}: {len(stale)} stored cell(s) were computed "
                                  "with another rotary embedding (changed parameters or factors file); recomputing them.",
                                  stacklevel=2)
                cells = [c for c, i in zip(plans[length], ids[length]) if not store.has(i) or i in stale]
                if not cells:
                    continue
                warning = check_length(report, length, method.label)
                fingerprint = current if reuse_identical else None
                units = [unit for cell in cells for unit in cell.units]
                needed = [u for u in units if fingerprint is None or (fingerprint, u.key) not in memo]
                local = dist.shard(needed)
                results: list[tuple[int, dict[str, Any]]] = []
                bar = tqdm(total=len(local), desc=f"{description}{method.label} @ {length}", disable=not (progress and dist.is_main), leave=False)
                index_of = {id(u): i for i, u in enumerate(needed)}
                for start in range(0, len(local), batch_size):
                    batch = local[start : start + batch_size]
                    began = time.time()
                    outputs = evaluate([u.payload for u in batch])
                    seconds = (time.time() - began) / len(batch)
                    for unit, output in zip(batch, outputs):
                        results.append((index_of[id(unit)], {**output, "seconds": seconds}))
                    bar.update(len(batch))
                bar.close()
                gathered = dict(dist.gather(results))
                label = f"{method.label} x{method_factor:g}"
                computed = {}
                for i, unit in enumerate(needed):
                    computed[id(unit)] = gathered[i]
                    if fingerprint is not None:
                        memo[(fingerprint, unit.key)] = (gathered[i], label)
                for cell in cells:
                    unit_results, reused_from = [], set()
                    for unit in cell.units:
                        if id(unit) in computed:
                            unit_results.append(computed[id(unit)])
                        else:
                            result, origin = memo[(fingerprint, unit.key)]
                            unit_results.append({**result, "seconds": 0.0})
                            reused_from.add(origin)
                    record = {
                        "method": method.method,
                        "label": method.label,
                        "params": method.params_dict,
                        "factor": method_factor,
                        "length": length,
                        **cell.coords,
                        **aggregate(unit_results),
                        **cell.info,
                        "supported_window": report.current_window,
                        "dynamic": report.dynamic,
                        "beyond_window": warning is not None,
                        "seconds": round(sum(r["seconds"] for r in unit_results), 3),
                        "units": unit_results,
                    }
                    if reused_from:
                        record["reused_from"] = sorted(reused_from)
                    if current is not None:
                        record["rope_fingerprint"] = current
                    if frequencies is not None:
                        record["rope_frequencies"] = frequencies
                    store.put(cell_id(method, method_factor, length, cell.coords), record)
                dist.barrier()
    store.save(world_size=dist.world_size)
    return store
