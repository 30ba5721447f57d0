"""k/n with 95 % Wilson intervals: the formula against an independent construction, and its use in tables."""

import math

import pytest

from hf_posext.evaluation.proportions import Proportion, correct_count, pooled_proportion, wilson_interval
from hf_posext.evaluation.tables import metric_table


def _wilson_by_quadratic(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    # The interval is the set of p with (k/n - p)^2 <= z^2 p (1 - p) / n: the two roots of the quadratic
    # (1 + z^2/n) p^2 - (2 k/n + z^2/n) p + (k/n)^2 = 0.
    phat, c = k / n, z * z / n
    a, b, cc = 1 + c, -(2 * phat + c), phat * phat
    root = math.sqrt(b * b - 4 * a * cc)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (0, 10), (10, 10), (3, 10), (47, 50), (45, 50), (1, 3), (2, 3), (7, 15), (499, 500)])
def test_wilson_matches_the_quadratic_roots(k, n):
    low, high = wilson_interval(k, n)
    ref_low, ref_high = _wilson_by_quadratic(k, n)
    assert low == pytest.approx(max(0.0, ref_low), abs=1e-12) and high == pytest.approx(min(1.0, ref_high), abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_known_values():
    # Published check values (Newcombe 1998, Table I, method 3): 81/263 -> 0.2553-0.3662; 15/148 -> 0.0624-0.1605.
    assert [round(x, 4) for x in wilson_interval(81, 263)] == [0.2553, 0.3662]
    assert [round(x, 4) for x in wilson_interval(15, 148)] == [0.0624, 0.1605]
    # The normal approximation would give a zero-width interval at 0/n and n/n; Wilson does not.
    assert wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[0] == pytest.approx(0.7225, abs=1e-4)


@pytest.mark.parametrize("k,n", [(-1, 3), (4, 3), (1, 0), (1.5, 3), (True, 3)])
def test_wilson_refuses_impossible_counts(k, n):
    with pytest.raises(ValueError, match="trials|whole numbers"):
        wilson_interval(k, n)


def test_counts_from_records_old_and_new():
    new = {"trials": 10, "greedy_accuracy": 0.7, "greedy_correct": 7}
    old = {"trials": 3, "greedy_accuracy": 2 / 3}  # written before counts were kept: rate x trials
    assert correct_count(new, "greedy_accuracy") == 7 and correct_count(old, "greedy_accuracy") == 2
    assert pooled_proportion([new, old], "greedy_accuracy") == Proportion(9, 13)
    assert pooled_proportion([{"greedy_accuracy": 1.0}], "greedy_accuracy") is None  # no trial count: no k/n
    assert Proportion(47, 50).text() == "47/50 [0.84, 0.98]"


def test_table_pools_trials_over_depths_not_rates():
    # 1/1 at one depth and 0/9 at another: the mean of the rates is 0.5, the pooled rate 1/10.
    records = [{"method": "yarn", "label": "yarn", "factor": 2.0, "length": 128, "depth": d, "trials": n, "greedy_accuracy": k / n,
                "greedy_correct": k, "_file": "f", "_run": 0} for d, k, n in ((0.0, 1, 1), (1.0, 0, 9))]
    table = metric_table(records, "greedy_accuracy", ".2f", "t", counts=True)
    cell = table.rows[0][1][128]
    assert cell.text == "1/10 [0.02, 0.40]" and cell.value == pytest.approx(0.1)
    assert metric_table(records, "greedy_accuracy", ".2f", "t").rows[0][1][128].text == "0.50"


def test_a_cell_pooling_fewer_depths_than_the_table_says_which():
    every = [{"method": "yarn", "label": "yarn", "factor": 4.0, "length": 32768, "depth": d, "trials": 4, "greedy_accuracy": 1.0,
              "greedy_correct": 4, "_file": "f", "_run": 0} for d in (0.0, 0.5, 1.0)]
    one = [{**every[0], "method": "dca", "label": "dca", "greedy_accuracy": 0.75, "greedy_correct": 3}]
    rows = dict(metric_table(every + one, "greedy_accuracy", ".2f", "t", counts=True).rows)
    assert rows["dca x4"][32768].text == "3/4 [0.30, 0.95] (depth 0 only)"
    assert rows["yarn x4"][32768].text == "12/12 [0.76, 1.00]"
