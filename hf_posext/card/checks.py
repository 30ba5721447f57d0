"""The numbers of a card's cells checked as the other results files' are (:mod:`hf_posext.evaluation.results_files`):
a ``card.json`` edited by hand or damaged (a trial scored 7.0, a perplexity of -5, ``n: 50`` beside 5 scores) is
refused, naming the cell and the field, never printed as if it had been measured.

What a run writes: a proportion cell (passkey, needle, RULER, chat endings) holds ``n`` scores in [0, 1] (one a
trial or sample; 0/1 except RULER's partial credit), ``k`` their sum when all are 0 or 1, ``mean`` = sum / n; a
perplexity cell holds ``mean`` >= 1 (exp of a mean negative log-likelihood) over ``n`` windows, each window's loss
(``scores``) >= 0.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["card_cell_problem", "cell_name"]

_TOLERANCE = 1e-9


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def cell_name(cell: dict[str, Any]) -> str:
    """``ROW, TASK at LENGTH``: how a message names a cell."""
    return f"{cell.get('row')}, {cell.get('task')} at {cell.get('length')}"


def card_cell_problem(cell: Any) -> str | None:
    """What no card run writes in ``cell`` (one phrase naming the field and its value), or None."""
    if not isinstance(cell, dict):
        return f"{type(cell).__name__} {cell!r:.60}, not a cell"
    n, mean = cell.get("n"), cell.get("mean")
    if not _count(n):
        return f"n {n!r}, not a whole number of samples"
    if mean is not None and not _number(mean):
        return f"mean {mean!r}, not a number"
    scores = cell.get("scores") or {}
    if not isinstance(scores, dict):
        return f"scores {scores!r:.60}, not a mapping of sample to score"
    bad = next(((key, value) for key, value in scores.items() if not _number(value)), None)
    if bad is not None:
        return f"score {bad[1]!r} for {bad[0]!r}, not a number"
    if cell.get("kind") == "perplexity":
        return _perplexity_problem(n, mean, scores)
    return _proportion_problem(cell, n, mean, scores)


def _perplexity_problem(n: int, mean: Any, scores: dict[str, float]) -> str | None:
    if mean is not None and mean < 1:
        return f"mean {mean!r}, but a perplexity is never below 1 (exp of a mean negative log-likelihood)"
    if n < 1 and mean is not None:
        return f"n {n!r}, but a perplexity is measured over at least one window"
    low = next(((key, value) for key, value in scores.items() if value < 0), None)
    if low is not None:
        return f"loss {low[1]!r} for window {low[0]!r}, but a negative log-likelihood is never below 0"
    return None


def _proportion_problem(cell: dict[str, Any], n: int, mean: Any, scores: dict[str, float]) -> str | None:
    outside = next(((key, value) for key, value in scores.items() if not 0 <= value <= 1), None)
    if outside is not None:
        return f"score {outside[1]!r} for {outside[0]!r}, outside [0, 1]"
    if mean is not None and not 0 <= mean <= 1:
        return f"mean {mean!r}, outside [0, 1]"
    if scores and n != len(scores):
        return f"n {n}, but it holds {len(scores)} scores"
    k = cell.get("k")
    if k is not None:
        if not _count(k) or k > n:
            return f"k {k!r}, not a whole number of its {n} samples"
        if scores and all(value in (0, 1) for value in scores.values()) and k != sum(scores.values()):
            return f"k {k} of {n}, but its scores add up to {sum(scores.values()):g}"
        if mean is not None and n and abs(mean - k / n) > _TOLERANCE:
            return f"mean {mean!r}, but k/n is {k}/{n}"
    elif scores and mean is not None and abs(mean - sum(scores.values()) / len(scores)) > _TOLERANCE:
        return f"mean {mean!r}, but its scores' mean is {sum(scores.values()) / len(scores):g}"
    for bound in ("low", "high"):
        value = cell.get(bound)
        if value is not None and (not _number(value) or not 0 <= value <= 1):
            return f"{bound} {value!r}, outside [0, 1]"
    return None
