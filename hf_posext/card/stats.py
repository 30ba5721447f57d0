"""The suite's numbers: a cell's fields, its score and interval, and the paired comparisons between rows.

Scores: a RULER sample scores in [0, 1] (the share of its answers found, lm-eval's ``string_match_all``);
a task whose samples all score 0 or 1 is shown as ``k/n`` with its Wilson interval, any other as the mean
with a percentile-bootstrap interval (2000 resamples, seeded: the same file gives the same interval).

Paired comparisons: two rows that ran a RULER task at one length on the same samples (the same sample key)
are compared sample by sample: on how many samples each scored higher than the other, and the exact
two-sided sign test on those (ties leave it; for 0/1 scores this is McNemar's exact test). That is sharper
than two overlapping intervals: 20/20 against 15/20 overlap as intervals, yet 5 samples one way and none the
other give p = 0.0625, and 6 give p = 0.031. Passkey and needle rows pair trial by trial (the same seeded trials),
perplexity rows window by window (the same windows of the same text, the lower loss counting as better).
"""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from typing import Any, Sequence, TypedDict

from hf_posext.card.spec import BEYOND_BASE_THRESHOLD, RULER_OFFLINE_TASKS
from hf_posext.evaluation.paired import kept_trials, window_losses
from hf_posext.evaluation.proportions import Proportion, sign_test_p_value

__all__ = [
    "Cell", "Comparison", "score_summary", "beyond_base", "unmarked_note", "sorted_cells", "PAIRED_KINDS", "LOWER_IS_BETTER_KINDS",
    "perplexity_cell_fields", "ruler_cell_fields", "trial_scores", "paired_comparisons", "base_reference",
]


class Cell(TypedDict, total=False):
    """One cell of the suite: a row's score on a task at a length, as ``card.json`` keeps it.

    A cell stays a JSON object (it is written to and read back from ``card.json`` as is, and a card written by an
    earlier release reads as one); this names its fields and their types.
    """

    task: str  # perplexity, passkey, needle, ending, or a RULER task
    kind: str  # perplexity, passkey, needle, ending or ruler
    row: str  # the row's label
    row_index: int  # the row's place on the card
    length: int  # tokens (the ending cell: its prompts' length, rounded up to a power of two)
    base: bool  # the base model inside its own window (spec.is_base_row)
    in_window: bool  # length within the row's window after scaling
    source: str  # the file its samples are in
    sample_key: dict[str, Any]  # what makes two rows' cells comparable sample by sample
    scores: dict[str, float]  # sample -> score (perplexity: window -> loss)
    n: int
    k: int  # scores that are 1, where every score is 0 or 1
    mean: float | None
    low: float | None
    high: float | None
    text: str  # as the table shows it
    mean_timing: dict[str, float]  # RULER: seconds a sample
    escalated: int  # RULER: samples generated again with the full budget
    cell_id: str  # perplexity: the cell's id in its results file
    samples: int  # the samples its run asked for (an earlier run's cell)
    dtype: str
    running: bool  # unfinished: shown with the samples it has
    card: str  # a combined card: the folder it came from
    mean_generated_tokens: float  # ending


class Comparison(TypedDict):
    """Two rows compared sample by sample on one task at one length (:func:`paired_comparisons`)."""

    task: str
    first: str
    second: str
    length: int
    higher: int
    lower: int
    equal: int
    n: int
    p: float
    text: str


def _bootstrap(scores: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(scores)
    means = sorted(sum(scores[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def score_summary(scores: Sequence[float]) -> dict[str, Any]:
    """``{"n", "mean", "low", "high", "text"}``: ``k/n [low, high]`` (Wilson) for 0/1 scores, else the mean
    with a bootstrap interval."""
    n = len(scores)
    if not n:
        return {"n": 0, "mean": None, "low": None, "high": None, "text": "–"}
    mean = sum(scores) / n
    if all(s in (0, 1) for s in scores):
        proportion = Proportion(int(sum(scores)), n)
        low, high = proportion.interval
        return {"n": n, "k": int(sum(scores)), "mean": mean, "low": low, "high": high, "text": proportion.text()}
    low, high = _bootstrap(list(scores))
    return {"n": n, "mean": mean, "low": low, "high": high, "text": f"{mean:.2f} [{low:.2f}, {high:.2f}] (n={n})"}


def beyond_base(cells: Sequence[Cell], threshold: float = BEYOND_BASE_THRESHOLD) -> dict[str, bool | None]:
    """task -> whether the base model cannot do it inside its window (its best in-window score < ``threshold``);
    None when no base row ran the task inside its window."""
    best: dict[str, float] = {}
    for cell in cells:
        if cell.get("base") and cell.get("in_window") and cell.get("mean") is not None and cell.get("kind") == "ruler":
            best[cell["task"]] = max(best.get(cell["task"], 0.0), cell["mean"])
    tasks = {cell["task"] for cell in cells if cell.get("kind") == "ruler"}
    return {task: (best[task] < threshold if task in best else None) for task in sorted(tasks)}


def unmarked_note(marks: dict[str, bool | None]) -> str:
    """One line naming the RULER tasks the card can neither count nor mark "beyond the base model" (no base row
    ran them inside its window: see :func:`is_base_row`), or "" when every task has its reference."""
    unmarked = [task for task, beyond in marks.items() if beyond is None]
    if not unmarked:
        return ""
    return (f"Not marked as counting or beyond the base model: {', '.join(unmarked)} (no base row ran it inside its window; "
            "the base row is the first model as published, unscaled).")



def sorted_cells(cells: Sequence[Cell]) -> list[Cell]:
    """Cells sorted for the table: by task order, then row, then length."""
    order = {task: i for i, task in enumerate(["perplexity", "passkey", "needle", *RULER_OFFLINE_TASKS])}
    return sorted(cells, key=lambda c: (order.get(c["task"], 99), c["task"], c["row_index"], c["length"]))


#: The kinds of cell compared sample by sample (trial by trial, window by window) in the card's paired table.
PAIRED_KINDS = ("ruler", "passkey", "needle", "perplexity", "ending")
#: Kinds whose per-sample scores are losses: the lower one counts as better in the paired table.
LOWER_IS_BETTER_KINDS = ("perplexity",)


def perplexity_cell_fields(results: dict[str, Any], length: int, cell_id: str | None = None,
                           ppl: float | None = None) -> dict[str, Any]:
    """``sample_key`` and ``scores`` of one perplexity cell of the card, from its results file (read, never written).

    ``scores`` maps each window (``"DOCUMENT/OFFSET"``) to its mean negative log-likelihood per token
    (:func:`~hf_posext.evaluation.paired.window_losses`; lower is better). ``sample_key`` is the text and how it
    was read (the results file's config without the model: data, windows, BOS, concatenation, dtype) at
    ``length``, so two rows pair only on the same windows of the same text.

    Args:
        results: a perplexity results file's data (``config`` and ``cells``).
        length: the cell's length.
        cell_id: the cell's id in the file. A card written before cells kept it gives ``ppl`` instead: the one
            cell at ``length`` with exactly that perplexity.

    Returns:
        The two fields, or ``{}`` where no such cell is found or it kept no windows.
    """
    cells = results.get("cells") or {}
    if cell_id is not None:
        record = cells.get(cell_id)
        record = record if isinstance(record, dict) and record.get("length") == length else None
    else:
        found = [r for r in cells.values() if r.get("length") == length and ppl is not None and r.get("ppl") == ppl]
        record = found[0] if len(found) == 1 else None
    losses = window_losses(record) if isinstance(record, dict) else {}
    if not losses:
        return {}
    config = dict(results.get("config") or {})
    if isinstance(config.get("data"), str):
        config["data"] = os.path.normpath(config["data"])
    key = {"task": "perplexity", "length": int(length), **{k: v for k, v in sorted(config.items()) if k not in ("task", "model")}}
    return {"sample_key": key, "scores": losses}


def paired_comparisons(cells: Sequence[Cell]) -> list[Comparison]:
    """Every two rows that ran a RULER task, passkey, needle or perplexity at a length on the same samples (the
    same seeded trials, the same windows of the same text), compared sample by sample.

    Cells must carry ``scores`` (``{doc_id: score}``, as ``card.json`` keeps them). Two cells pair when
    they have the same task, length and sample key; only the samples both scored count. A perplexity window
    counts for the row with the lower loss on it (:data:`LOWER_IS_BETTER_KINDS`). Within a task a
    pair is written the same way round at every length: the row with the higher total over the pair's
    samples first (the earlier row on a tie), so a reader sees "A vs B: higher on 6, lower on 0".

    Returns:
        One dict per (task, pair, length), in card order: ``task``, ``first``, ``second``, ``length``,
        ``higher`` (samples the first scored higher on), ``lower``, ``equal``, ``n``, ``p`` (exact two-sided
        sign test on ``higher`` against ``lower``) and ``text`` (``"6:0 of 10 (p = 0.031)"``).
    """
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for cell in sorted_cells(cells):
        if cell.get("kind") in PAIRED_KINDS and cell.get("scores"):
            if cell["kind"] in LOWER_IS_BETTER_KINDS:  # compared as scores: the lower loss is the higher score
                cell = {**cell, "scores": {k: -float(v) for k, v in cell["scores"].items()}}
            groups[(cell["task"], cell["length"], json.dumps(cell.get("sample_key"), sort_keys=True))].append(cell)
    found: dict[tuple[str, int, int], dict[int, tuple[list[float], list[float]]]] = defaultdict(dict)
    rows: dict[int, str] = {}
    for (task, length, _key), group in groups.items():
        for index, a in enumerate(group):
            for b in group[index + 1:]:
                if a["row_index"] == b["row_index"]:
                    continue
                first, second = sorted((a, b), key=lambda c: c["row_index"])
                common = sorted(set(first["scores"]) & set(second["scores"]))
                if common:
                    rows.update({first["row_index"]: first["row"], second["row_index"]: second["row"]})
                    found[(task, first["row_index"], second["row_index"])][length] = (
                        [float(first["scores"][i]) for i in common], [float(second["scores"][i]) for i in common])
    comparisons = []
    for (task, i, j), by_length in found.items():
        total = sum(sum(x) - sum(y) for x, y in by_length.values())
        swap = total < 0
        for length, (x, y) in sorted(by_length.items()):
            if swap:
                x, y = y, x
            higher = sum(a > b for a, b in zip(x, y))
            lower = sum(a < b for a, b in zip(x, y))
            p = sign_test_p_value(higher, lower)
            comparisons.append({"task": task, "first": rows[j if swap else i], "second": rows[i if swap else j], "length": length,
                                "higher": higher, "lower": lower, "equal": len(x) - higher - lower, "n": len(x), "p": p,
                                "text": f"{higher}:{lower} of {len(x)} (p = {p:.2g})"})
    return comparisons



def trial_scores(records: list[dict[str, Any]]) -> dict[str, float]:
    """``{"DEPTH/TRIAL": 1.0 or 0.0}``: each passkey or needle trial's greedy outcome, from its cell records' kept
    units (records written before trials were kept give none), so that the card pairs rows trial by trial."""
    return {f"{depth:g}/{trial}": 1.0 if unit["greedy"] else 0.0
            for record in records for _length, depth, trial, unit in kept_trials(record)}




def ruler_cell_fields(records: dict[int, dict[str, Any]], samples: int) -> dict[str, Any]:
    """What a RULER cell of the card holds from its first ``samples`` records: ``scores`` (doc id -> score, for
    the paired comparisons), ``mean_timing`` (seconds a sample, with any full-budget rerun), ``escalated`` (how
    many were generated again with the full budget) and :func:`score_summary`'s fields."""
    chosen = [records[i] for i in range(samples) if i in records]
    timing = {name: round(sum(r["timing"][name] + r.get("timing_full", {}).get(name, 0.0) for r in chosen) / len(chosen), 3)
              for name in ("prefill_s", "generate_s", "harness_s", "total_s")} if chosen and all("timing" in r for r in chosen) else {}
    return {"scores": {str(r["doc_id"]): float(r["score"]) for r in chosen}, "mean_timing": timing,
            "escalated": sum(bool(r.get("escalated")) for r in chosen), **score_summary([float(r["score"]) for r in chosen])}




def base_reference(cells: Sequence[Cell]) -> tuple[float, int] | None:
    """``(score, length)``: the base model's best score inside its own window on these cells (one task's), the
    reference an extension is measured against (for perplexity the lowest); None when no base row ran inside it."""
    inside = [c for c in cells if c.get("base") and c.get("in_window") and c.get("mean") is not None]
    if not inside:
        return None
    pick = min if any(c["task"] == "perplexity" for c in inside) else max
    best = pick(inside, key=lambda c: (c["mean"], -c["length"]))
    return float(best["mean"]), int(best["length"])

