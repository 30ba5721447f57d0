"""The suite's numbers: scores and intervals, beyond the base model, and rows paired sample by sample, trial by trial
and window by window."""

from __future__ import annotations

import pytest

from hf_posext.card.render import markdown_card
from hf_posext.card.stats import beyond_base, paired_comparisons, perplexity_cell_fields, score_summary, unmarked_note
from tests.card_helpers import KEY, perplexity_results, ruler_cell


def test_scores_intervals_and_beyond_the_base_model():
    assert score_summary([1, 0, 1])["text"].startswith("2/3 [")
    mixed = score_summary([0.5, 1.0, 0.0, 0.5])
    assert mixed["mean"] == 0.5 and mixed["low"] < 0.5 < mixed["high"]
    cells = [{"task": "a", "kind": "ruler", "base": True, "in_window": True, "mean": 0.1},
             {"task": "a", "kind": "ruler", "base": True, "in_window": False, "mean": 0.9},
             {"task": "b", "kind": "ruler", "base": True, "in_window": True, "mean": 0.25},
             {"task": "a", "kind": "ruler", "base": False, "in_window": True, "mean": 1.0}]
    assert beyond_base(cells) == {"a": True, "b": False}
    # a task no base row ran inside its window is neither: the card says so in one line, never silently
    unknown = cells + [{"task": "c", "kind": "ruler", "base": False, "in_window": True, "mean": 0.9}]
    assert beyond_base(unknown) == {"a": True, "b": False, "c": None}
    assert unmarked_note(beyond_base(cells)) == ""
    assert unmarked_note(beyond_base(unknown)).startswith("Not marked as counting or beyond the base model: c (no base row")
    table = [{**cell, "row": f"r{index}", "row_index": index, "length": 2048, "text": "0.5"} for index, cell in enumerate(unknown)]
    assert unmarked_note(beyond_base(unknown)) in markdown_card(table)


def test_paired_comparisons_count_the_samples_each_row_won():
    """Only samples both rows scored count; the row with the higher total is written first; ties enter
    neither side of the sign test; another sample key is never paired."""
    yarn = ruler_cell("yarn", 0, {0: 1, 1: 1, 2: 0, 3: 0, 4: 0, 5: 1, 6: 0, 7: 0, 8: 0})
    tuned = ruler_cell("tuned", 1, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 9: 0})  # doc 8 / 9: one row only
    other = ruler_cell("other samples", 2, {i: 0 for i in range(9)}, key={**KEY, "seed": 1})
    (pair,) = paired_comparisons([yarn, tuned, other])
    assert (pair["first"], pair["second"]) == ("tuned", "yarn")
    assert (pair["higher"], pair["lower"], pair["equal"], pair["n"]) == (5, 0, 3, 8)
    assert pair["p"] == 2 / 2**5 and pair["text"] == "5:0 of 8 (p = 0.062)"
    # fractional scores (ruler_fwe: the share of 3 words found) compare as numbers
    a = ruler_cell("a", 0, {0: 2 / 3, 1: 1 / 3, 2: 1.0}, task="ruler_fwe")
    b = ruler_cell("b", 1, {0: 1 / 3, 1: 1 / 3, 2: 0.0}, task="ruler_fwe")
    (fwe,) = paired_comparisons([a, b])
    assert (fwe["first"], fwe["higher"], fwe["lower"], fwe["equal"]) == ("a", 2, 0, 1)
    # cells without per-sample scores (a card.json from before they were kept) are not compared
    assert paired_comparisons([{k: v for k, v in yarn.items() if k != "scores"}, tuned]) == []


def test_passkey_and_needle_rows_are_paired_trial_by_trial():
    """Passkey and needle cells carry each trial's outcome ("DEPTH/TRIAL"), and pair like RULER samples; trials of
    another seed never pair."""
    from hf_posext.card.stats import trial_scores

    units = [{"greedy": True}, {"greedy": False}, {"greedy": None}]
    keys = [["needle", 4096, 0.5, 0], ["needle", 4096, 0.5, 1], ["needle", 4096, 0.5, 2]]
    assert trial_scores([{"unit_keys": keys, "units": units}, {"trials": 4}]) == {"0.5/0": 1.0, "0.5/1": 0.0}
    key = {"task": "needle", "length": 16384, "seed": 0, "depths": [0.0, 1.0], "trials": 2}
    tuned = {**ruler_cell("tuned", 1, {}), "kind": "needle", "task": "needle", "sample_key": key,
             "scores": {"0/0": 1.0, "0/1": 1.0, "1/0": 1.0, "1/1": 1.0}}
    yarn = {**tuned, "row": "yarn", "row_index": 0, "scores": {"0/0": 0.0, "0/1": 1.0, "1/0": 0.0, "1/1": 0.0}}
    other = {**yarn, "row": "other seed", "row_index": 2, "sample_key": {**key, "seed": 1}}
    (pair,) = paired_comparisons([yarn, tuned, other])
    assert (pair["task"], pair["first"], pair["second"], pair["higher"], pair["lower"], pair["n"]) == ("needle", "tuned", "yarn", 3, 0, 4)


def test_perplexity_rows_are_paired_window_by_window_the_lower_loss_counting_as_better():
    """Each window's mean loss is kept; on the same windows of the same text the row with the lower loss wins
    that window (a sign flip would write the worse row first and count its windows); another text never pairs."""
    results = perplexity_results("books/emma.txt", {"yarn": [(3.1 * 100, 100), (3.0 * 100, 100), (2.9 * 100, 100)],
                                                   "tuned": [(2.8 * 100, 100), (2.7 * 100, 100), (2.9 * 100, 100)]})
    yarn = perplexity_cell_fields(results, 4096, "yarn|factor=4|length=4096")
    assert yarn["scores"] == pytest.approx({"0/0": 3.1, "0/4096": 3.0, "0/8192": 2.9})
    assert yarn["sample_key"] == {"task": "perplexity", "length": 4096, "data": "books/emma.txt", "dtype": "float32", "max_windows": 8}
    tuned_ppl = results["cells"]["tuned|factor=4|length=4096"]["ppl"]
    # a card written before cells kept their id finds its cell by the perplexity it shows
    assert perplexity_cell_fields(results, 4096, ppl=tuned_ppl)["scores"] == pytest.approx({"0/0": 2.8, "0/4096": 2.7, "0/8192": 2.9})
    assert perplexity_cell_fields(results, 4096, ppl=99.0) == {} and perplexity_cell_fields(results, 2048, "yarn|factor=4|length=4096") == {}
    cell = lambda row, index, fields: {"task": "perplexity", "kind": "perplexity", "row": row, "row_index": index, "length": 4096, **fields}  # noqa: E731
    tuned = perplexity_cell_fields(results, 4096, "tuned|factor=4|length=4096")
    other = {**tuned, "sample_key": {**tuned["sample_key"], "data": "books/other.txt"}}
    (pair,) = paired_comparisons([cell("yarn", 0, yarn), cell("tuned", 1, tuned), cell("other text", 2, other)])
    assert (pair["task"], pair["first"], pair["second"]) == ("perplexity", "tuned", "yarn")
    assert (pair["higher"], pair["lower"], pair["equal"], pair["text"]) == (2, 0, 1, "2:0 of 3 (p = 0.5)")
    assert "for perplexity a lower loss" in markdown_card([{**cell("yarn", 0, yarn), "n": 3, "mean": 20.0, "low": None, "high": None,
                                                           "text": "20.00"}, {**cell("tuned", 1, tuned), "n": 3, "mean": 16.0,
                                                           "low": None, "high": None, "text": "16.00"}])
