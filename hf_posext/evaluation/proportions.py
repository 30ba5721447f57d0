"""Success rates over trials with their uncertainty: ``k/n`` and a 95 % Wilson score interval.

A retrieval cell that found the answer in ``k`` of ``n`` trials is shown as ``k/n`` with the Wilson
interval (Wilson 1927, "Probable inference, the law of succession, and statistical inference", JASA 22):

    centre = (p + z²/(2n)) / (1 + z²/n),   half = z · sqrt(p(1-p)/n + z²/(4n²)) / (1 + z²/n),   p = k/n

with z = 1.96 for 95 %. Unlike the normal approximation p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and is
not zero-width at k = 0 or k = n (3/3 gives [0.44, 1.00], 50/50 gives [0.93, 1.00]): two methods whose
intervals overlap widely are not told apart by the trials run.

Two methods run on the *same* trials are compared more sharply by their discordant trials, those that one
found and the other missed (:func:`sign_test_p_value`, the exact McNemar test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["Z_95", "wilson_interval", "sign_test_p_value", "Proportion", "correct_count", "pooled_proportion"]

#: The two-sided 95 % quantile of the standard normal distribution.
Z_95 = 1.959963984540054


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``trials`` (95 % by default).

    Args:
        successes: k, 0 <= k <= n.
        trials: n >= 1.
        z: the normal quantile of the confidence level.

    Returns:
        ``(low, high)``, both in [0, 1].

    Raises:
        ValueError: n < 1, or k outside [0, n].

    Example:
        >>> [round(x, 3) for x in wilson_interval(47, 50)]
        [0.838, 0.979]
    """
    if isinstance(successes, bool) or isinstance(trials, bool) or int(successes) != successes or int(trials) != trials:
        raise ValueError(f"successes and trials must be whole numbers, got {successes!r} and {trials!r}.")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}.")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must lie in [0, trials={trials}], got {successes}.")
    n, p = float(trials), successes / trials
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # The exact endpoints at k = 0 and k = n are 0 and 1; keep them exact despite rounding.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def sign_test_p_value(only_first: int, only_second: int) -> float:
    """The exact two-sided sign test on paired trials (McNemar's exact test; McNemar 1947, Psychometrika 12).

    Of ``n = b + c`` discordant trials (``b`` found only by the first method, ``c`` only by the second),
    under "the two methods are equally good" each is the first's with probability 1/2, so

        p = min(1, 2 · sum_{i <= min(b, c)} C(n, i) / 2^n)

    Trials both found or both missed say nothing about which is better and do not enter. With no discordant
    trial, p = 1.

    Args:
        only_first: b >= 0.
        only_second: c >= 0.

    Returns:
        The p-value in (0, 1].

    Raises:
        ValueError: a count that is negative or not a whole number.

    Example:
        >>> sign_test_p_value(4, 0)   # 4 discordant trials, all one way
        0.125
    """
    for name, count in (("only_first", only_first), ("only_second", only_second)):
        if isinstance(count, bool) or int(count) != count or count < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {count!r}.")
    n, fewer = int(only_first) + int(only_second), min(int(only_first), int(only_second))
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(fewer + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Proportion:
    """``successes`` of ``trials``, with its rate and 95 % Wilson interval."""

    successes: int
    trials: int

    @property
    def rate(self) -> float:
        return self.successes / self.trials

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.trials)

    def text(self) -> str:
        """``k/n [low, high]``, e.g. ``47/50 [0.84, 0.98]``."""
        low, high = self.interval
        return f"{self.successes}/{self.trials} [{low:.2f}, {high:.2f}]"


#: Accuracy metric of a retrieval record -> the record field that holds its count of correct trials.
_COUNT_FIELDS = {"greedy_accuracy": "greedy_correct", "teacher_forced_accuracy": "teacher_forced_correct"}


def correct_count(record: dict[str, Any], metric: str) -> int | None:
    """How many of ``record["trials"]`` trials were right by ``metric`` (None: the record has no trial count).

    Records store the count (``greedy_correct``, ``teacher_forced_correct``); records written before
    counts were kept give it as rate x trials, which is exact because the rate was k/n.
    """
    trials = record.get("trials")
    if not trials or record.get(metric) is None:
        return None
    stored = record.get(_COUNT_FIELDS.get(metric, ""))
    if stored is not None:
        return int(stored)
    return int(round(float(record[metric]) * int(trials)))


def pooled_proportion(records: Iterable[dict[str, Any]], metric: str) -> Proportion | None:
    """All trials of ``records`` pooled (e.g. the depths of one length): sum of k over sum of n.

    Returns None when a record lacks a trial count.
    """
    successes = trials = 0
    for record in records:
        count = correct_count(record, metric)
        if count is None:
            return None
        successes += count
        trials += int(record["trials"])
    return Proportion(successes, trials) if trials else None
