"""Paired comparisons: the exact sign test, per-trial pairing of two series, and ``report --compare``."""

import itertools
import json
from pathlib import Path

import pytest

from hf_posext.cli import main
from hf_posext.evaluation.paired import PairedCount, comparison_tables, paired_counts
from hf_posext.evaluation.proportions import sign_test_p_value
from hf_posext.evaluation.report import load_results, write_report


def _enumerated_p_value(only_first, only_second):
    """Independent construction: every one of the 2^n ways n discordant trials can fall, each equally likely
    under the null; p = the share at least as lopsided as the one seen (two-sided)."""
    n = only_first + only_second
    seen = abs(only_first - only_second)
    extreme = sum(1 for signs in itertools.product((0, 1), repeat=n) if abs(2 * sum(signs) - n) >= seen)
    return extreme / 2**n


@pytest.mark.parametrize("only_first,only_second", [(0, 0), (1, 0), (4, 0), (0, 4), (3, 1), (5, 5), (8, 0), (7, 2), (2, 9)])
def test_sign_test_matches_enumeration(only_first, only_second):
    assert sign_test_p_value(only_first, only_second) == pytest.approx(_enumerated_p_value(only_first, only_second), abs=1e-12)


def test_sign_test_known_values():
    assert sign_test_p_value(4, 0) == 0.125          # the README's STRING passkey comparison
    assert sign_test_p_value(8, 0) == pytest.approx(2 / 256)
    assert sign_test_p_value(0, 0) == 1.0
    assert sign_test_p_value(3, 4) == sign_test_p_value(4, 3) == 1.0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_sign_test_refuses_bad_counts(bad):
    with pytest.raises((ValueError, TypeError)):
        sign_test_p_value(bad, 0)


def _cell(method, length, depth, outcomes, *, factor=4.0, values=None, greedy=True):
    units = []
    for trial, found in enumerate(outcomes):
        unit = {"teacher_forced": found, "answer_token_accuracy": 1.0 if found else 0.5}
        if greedy:
            unit["greedy"] = found
        if values is not None:
            unit["value"] = values[trial]
        units.append(unit)
    cell = {"method": method, "label": method, "factor": factor, "length": length, "depth": depth, "supported_window": 64,
            "trials": len(outcomes), "teacher_forced_correct": sum(outcomes), "teacher_forced_accuracy": sum(outcomes) / len(outcomes),
            "units": units, "unit_keys": [["needle", length, depth, t] for t in range(len(outcomes))]}
    if greedy:
        cell.update(greedy_correct=sum(outcomes), greedy_accuracy=sum(outcomes) / len(outcomes))
    return cell


def _write(folder, name, cells, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"needle-{name}.json").write_text(json.dumps({"task": "needle", "config": {"model": "m", "seed": 0, **config},
                                                           "cells": {str(i): c for i, c in enumerate(cells)}}))


def test_paired_counts_pair_trial_by_trial(tmp_path):
    # yarn: depth 0 found 1,1,0,0; depth 1 found 1,0.  ntk: depth 0 found 1,0,1,0 and one more trial yarn lacks.
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1, 1, 0, 0]), _cell("yarn", 128, 1.0, [1, 0]), _cell("yarn", 256, 0.0, [1])])
    _write(tmp_path, "b", [_cell("ntk", 128, 0.0, [1, 0, 1, 0, 1]), _cell("ntk", 128, 1.0, [0, 0])])
    _write(tmp_path, "c", [_cell("ntk", 256, 0.0, [0])])
    counts = paired_counts(load_results(tmp_path), "needle", "yarn x4", "ntk x4")
    (_name, cells), = comparison_tables(load_results(tmp_path), [("yarn x4", "ntk x4")])[0].rows
    assert {n: [Path(s).name for s, _ in cell.sources] for n, cell in cells.items()} == {128: ["needle-a.json", "needle-b.json"],
                                                                            256: ["needle-a.json", "needle-c.json"]}
    # 128: trial by trial (both, only yarn, only ntk, neither): d0 (1,1) (1,0) (0,1) (0,0); d1 (1,0) (0,0); ntk's 5th unpaired
    assert counts == {128: PairedCount(both=1, only_first=2, only_second=1, neither=2), 256: PairedCount(0, 1, 0, 0)}
    assert counts[128].trials == 6 and counts[128].text() == "2:1 of 6 (both 1, neither 2; p = 1)"
    # the same totals (3/6 against 2/6 at 128) cannot tell this apart from a perfectly one-sided pairing
    reverse = paired_counts(load_results(tmp_path), "needle", "ntk x4", "yarn x4")
    assert reverse[128] == PairedCount(both=1, only_first=1, only_second=2, neither=2)


def test_paired_counts_teacher_forced_and_cells_without_trials(tmp_path):
    old = _cell("ntk", 128, 0.0, [0, 0])
    del old["units"], old["unit_keys"]  # written before per-trial outcomes were kept: not paired
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1, 0], greedy=False), _cell("yarn", 128, 1.0, [1])])
    _write(tmp_path, "b", [old, _cell("ntk", 128, 1.0, [0])])
    counts = paired_counts(load_results(tmp_path), "needle", "yarn x4", "ntk x4", metric="teacher_forced_accuracy")
    assert counts == {128: PairedCount(0, 1, 0, 0)}
    with pytest.raises(ValueError, match="metric must be one of"):
        paired_counts(load_results(tmp_path), "needle", "yarn x4", "ntk x4", metric="ppl")


def test_paired_counts_refuse_different_trials(tmp_path):
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1, 0])], haystack="a.txt")
    _write(tmp_path, "b", [_cell("ntk", 128, 0.0, [1, 0])], haystack="b.txt")
    with pytest.raises(ValueError, match=r"ran different trials at length 128, depth 0, trial 1: haystack is 'a.txt' in .*needle-a.json"):
        paired_counts(load_results(tmp_path), "needle", "yarn x4", "ntk x4")
    other = tmp_path / "values"
    _write(other, "a", [_cell("yarn", 128, 0.0, [1, 0], values=["11", "12"])])
    _write(other, "b", [_cell("ntk", 128, 0.0, [1, 0], values=["11", "99"])])
    with pytest.raises(ValueError, match="trial 2: the hidden value is '12'"):
        paired_counts(load_results(other), "needle", "yarn x4", "ntk x4")


def test_paired_counts_refuse_a_series_with_one_trial_twice(tmp_path):
    # Two seeds of one method in one folder share trial keys but not prompts: pairing them would be a guess.
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1])], seed=0)
    _write(tmp_path, "a2", [_cell("yarn", 128, 0.0, [0])], seed=1)
    _write(tmp_path, "b", [_cell("ntk", 128, 0.0, [1])], seed=0)
    with pytest.raises(ValueError, match=r"'yarn x4' holds trial 1 at length 128, depth 0 twice, with different seed"):
        paired_counts(load_results(tmp_path), "needle", "yarn x4", "ntk x4")


def test_paired_counts_name_the_series_there_are(tmp_path):
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1])])
    with pytest.raises(ValueError, match=r"no series 'yarn' in the needle results; the series are: yarn x4\."):
        paired_counts(load_results(tmp_path), "needle", "yarn", "yarn x4")


def test_comparison_tables_and_report(tmp_path):
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1] * 8)])
    _write(tmp_path, "b", [_cell("ntk", 128, 0.0, [0] * 8)])
    tables = comparison_tables(load_results(tmp_path), [("yarn x4", "ntk x4")])
    assert len(tables) == 1 and tables[0].lengths == [128]
    (name, cells), = tables[0].rows
    assert name == "yarn x4 vs ntk x4 (greedy)" and cells[128].value == pytest.approx(2 / 256)
    assert [Path(source).name for source, _run in cells[128].sources] == ["needle-a.json", "needle-b.json"]
    markdown, _plots = write_report(tmp_path, comparisons=[("yarn x4", "ntk x4")])
    line = "| yarn x4 vs ntk x4 (greedy) | 8:0 of 8 (both 0, neither 0; p = 0.00781) |"
    assert line in markdown and line in (tmp_path / "report.md").read_text()
    assert "8:0 of 8 (both 0, neither 0; p = 0.00781)" in (tmp_path / "report.html").read_text()


def test_report_compare_refuses_before_writing(tmp_path, capsys):
    _write(tmp_path, "a", [_cell("yarn", 128, 0.0, [1])])
    _write(tmp_path, "b", [_cell("ntk", 256, 0.0, [1])])
    assert main(["report", str(tmp_path), "--compare", "yarn x4", "dca x4"]) != 0
    assert "no passkey or needle series 'dca x4'; the series are: ntk x4, yarn x4." in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--compare", "yarn x4", "ntk x4"]) != 0
    assert "share no trial" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--compare", "yarn x4", "yarn x4"]) != 0
    assert "'yarn x4' is compared with itself" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "report.html").exists()
    assert main(["report", str(tmp_path)]) == 0 and (tmp_path / "report.md").exists()


def test_report_refuses_per_trial_outcomes_that_contradict_the_counts(tmp_path, capsys):
    # Was: a cell whose counts say 0 of 4 while its per-trial outcomes found 2 was printed both ways
    # (0/4 in the accuracy table, 2:0 in the comparison); the file is refused, named, before anything is written
    contradicted = _cell("yarn", 128, 0.0, [1, 1, 0, 0])
    contradicted.update(greedy_correct=0, greedy_accuracy=0.0, teacher_forced_correct=0, teacher_forced_accuracy=0.0)
    _write(tmp_path, "a", [contradicted])
    _write(tmp_path, "b", [_cell("ntk", 128, 0.0, [0, 0, 0, 0])])
    with pytest.raises(ValueError, match=r"needle-a\.json cell '0' has greedy_correct 0 of 4 trials, but its per-trial "
                                         r"outcomes \(units\) found 2"):
        load_results(tmp_path)
    assert main(["report", str(tmp_path), "--compare", "yarn x4", "ntk x4"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needle-a.json" in err and "found 2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["needle-a.json", "needle-b.json"]
    fewer = _cell("yarn", 128, 0.0, [1, 0, 0, 0])
    fewer["units"] = fewer["units"][:2]  # fewer outcomes than trials
    fewer["unit_keys"] = fewer["unit_keys"][:2]
    _write(tmp_path, "a", [fewer])
    with pytest.raises(ValueError, match=r"needle-a\.json cell '0' has 4 trials but 2 per-trial greedy outcomes in its units"):
        load_results(tmp_path)


def test_report_compare_on_a_perplexity_only_folder_says_there_is_no_retrieval_result(tmp_path, capsys):
    # Was: "the series are: none" read as the method `none`
    tmp_path.mkdir(exist_ok=True)
    cell = {"method": "none", "label": "none", "factor": 1.0, "length": 64, "ppl": 10.0, "nll": 2.302585093, "tokens": 63}
    (tmp_path / "perplexity-m.json").write_text(json.dumps({"task": "perplexity", "config": {"model": "m"}, "cells": {"a": cell}}))
    assert main(["report", str(tmp_path), "--compare", "yarn x4", "ntk x4"]) == 2
    err = capsys.readouterr().err
    assert "no passkey or needle results to compare 'yarn x4' and 'ntk x4' on (the results hold only perplexity)" in err
    assert "series are" not in err and "none" not in err
    with pytest.raises(ValueError, match=r"no series 'yarn x4' in the needle results; they hold no series\.$"):
        paired_counts(load_results(tmp_path), "needle", "yarn x4", "ntk x4")
