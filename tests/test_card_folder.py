"""A suite's folder: a card written again from it, cards combined, an earlier card's cells kept by a later run, cells
still running, and a damaged card or sample file named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_posext.card.folder import CardFileError, CardFolder, combine_cards, combined_row_order, earlier_card, rewrite_card, write_card
from hf_posext.card.samples import SampleResultsError, read_sample_records
from hf_posext.card.stats import ruler_cell_fields
from tests.card_helpers import perplexity_results, ruler_cell


def test_a_card_written_before_perplexity_windows_were_kept_gains_their_paired_row(tmp_path):
    """``hf-posext report CARD`` reads a perplexity cell's windows from its results file (only read); a damaged
    results file is named."""
    from hf_posext.evaluation.results_files import ResultsFileError

    folder = tmp_path / "card"
    results = perplexity_results("books/emma.txt", {"yarn": [(300.0, 100), (310.0, 100)], "tuned": [(280.0, 100), (290.0, 100)]})
    source = folder / "tasks" / "perplexity-m-0.json"
    source.parent.mkdir(parents=True)
    source.write_text(json.dumps(results))
    cells = [{"task": "perplexity", "kind": "perplexity", "row": method, "row_index": index, "length": 4096, "n": 2,
              "mean": results["cells"][f"{method}|factor=4|length=4096"]["ppl"], "low": None, "high": None, "text": "x",
              "source": f"elsewhere/{source.name}"} for index, method in enumerate(("yarn", "tuned"))]
    write_card(folder, cells, [], {"samples": 4, "partial": False})
    before = source.read_bytes()
    source.write_text('{"cells": ')
    with pytest.raises(ResultsFileError, match=re.escape(str(source))):
        rewrite_card(folder)
    source.write_bytes(before)
    card = json.loads(rewrite_card(folder)["json"].read_text())
    (pair,) = card["paired"]
    assert (pair["task"], pair["first"], pair["higher"], pair["lower"]) == ("perplexity", "tuned", 2, 0)
    assert source.read_bytes() == before and card["cells"][0]["scores"] == pytest.approx({"0/0": 3.0, "0/4096": 3.1})


def _sample_file(path: Path, scores: list[float], cut_tail: bool = False, **header) -> None:
    lines = [json.dumps({"record_version": 1, "row": "r", "task": "niah_single_1", "length": 4096, **header})]
    lines += [json.dumps({"doc_id": i, "score": v, "response": " 1", "timing": {"prefill_s": 1.0, "generate_s": 0.5,
                                                                                 "harness_s": 0.0, "total_s": 1.5}})
              for i, v in enumerate(scores)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + ("\n" + '{"doc_id": 9, "sco' if cut_tail else "\n"))


def test_a_card_is_written_again_from_its_folder_without_touching_its_samples(tmp_path):
    """``hf-posext report CARD``: every RULER cell is read again from its sample file (a card.json written
    before per-sample scores were kept gains the paired table; a cell shows the samples its file holds), and a
    file a run is still appending to (a cut-off last line) is read, never rewritten."""
    from hf_posext.cli import main

    folder = tmp_path / "card"
    first, second = folder / "ruler" / "first.jsonl", folder / "ruler" / "second.jsonl"
    _sample_file(first, [1, 1, 1, 1])
    _sample_file(second, [0, 1, 0, 1], cut_tail=True)
    cells = []
    for index, path in enumerate((first, second)):
        cell = {**ruler_cell(f"row {index}", index, {0: 1.0}), "source": f"somewhere/else/{path.name}"}  # moved since
        del cell["scores"]
        cells.append(cell)
    write_card(folder, cells, [], {"samples": 4, "partial": False})
    assert json.loads((folder / "card.json").read_text())["paired"] == []
    before = {p: p.read_bytes() for p in (first, second)}

    assert main(["report", str(folder)]) == 0
    card = json.loads((folder / "card.json").read_text())
    assert [c["n"] for c in card["cells"]] == [4, 4] and card["cells"][1]["text"].startswith("2/4")
    (pair,) = card["paired"]
    assert (pair["first"], pair["higher"], pair["lower"]) == ("row 0", 2, 0)
    assert "Paired samples" in (folder / "card.html").read_text() and "2:0 of 4" in (folder / "card.md").read_text()
    assert {p: p.read_bytes() for p in before} == before
    assert read_sample_records(second).keys() == {0, 1, 2, 3}
    assert ruler_cell_fields(read_sample_records(first), 2)["n"] == 2  # only the card's first --samples


def _one_run_card(folder: Path, rows: list[tuple[str, int, list[float]]], dtype: str) -> None:
    """A card folder as one run writes it: per (row, length) a sample file and its cell."""
    cells = []
    for index, (row, length, scores) in enumerate(rows):
        path = folder / "ruler" / f"{row}-{length}.jsonl"
        _sample_file(path, scores, row=row, length=length, dtype=dtype)
        cells.append({**ruler_cell(row, index, dict(enumerate(scores))), "length": length, "source": str(path)})
    labels = list(dict.fromkeys(row for row, _, _ in rows))
    settings = {"samples": 4, "dtypes": {"niah_single_1": dtype}, "lengths": sorted({n for _, n, _ in rows}),
                "rows": [{"label": label, "model": "m", "report": {"current_window": 65536}} for label in labels],
                "device": "cpu", "partial": False}
    write_card(folder, cells, [], settings)


def test_a_combined_card_lists_the_base_row_then_its_training_free_rows_then_the_fine_tunes(tmp_path):
    """Row order in a combined card follows what a row is (the base model unscaled, its training-free methods, other
    models), never which part first holds a cell of it: a part that lists a fine-tune first, with a cell on the
    first task, does not move it above the base model's rows."""
    rows = {"tuned": {"model": "runs/tuned", "base": False}, "base": {"model": "orig", "base": True},
            "yarn": {"model": "orig", "base": False}, "other": {"model": "runs/other", "base": False}}

    def part(folder: Path, listed: list[str], cells: list[tuple[str, int]]) -> None:
        written = []
        for row, length in cells:
            path = folder / "ruler" / f"{row}-{length}.jsonl"
            _sample_file(path, [1, 0, 1, 1], row=row, length=length, dtype="float32")
            written.append({**ruler_cell(row, listed.index(row), {0: 1, 1: 0, 2: 1, 3: 1}), "length": length,
                            "base": rows[row]["base"], "source": str(path)})
        settings = {"samples": 4, "dtypes": {"niah_single_1": "float32"}, "lengths": sorted({n for _, n in cells}),
                    "rows": [{"label": row, **rows[row], "report": {"current_window": 65536}} for row in listed],
                    "device": "cpu", "partial": False}
        write_card(folder, written, [], settings)

    first, second = tmp_path / "first", tmp_path / "second"
    part(first, ["tuned", "base", "yarn"], [("tuned", 16384), ("base", 2048)])
    part(second, ["other", "yarn"], [("other", 16384), ("yarn", 16384)])
    combined = json.loads(combine_cards([first, second], tmp_path / "combined")["json"].read_text())
    assert sorted({(c["row_index"], c["row"]) for c in combined["cells"]}) == [
        (0, "base"), (1, "yarn"), (2, "tuned"), (3, "other")]
    assert combined_row_order([([], {"rows": [{"label": "b", "model": "m"}, {"label": "a", "model": "m", "base": True}]}),
                               ([{"row": "c", "row_index": 0}], {})]) == {"a": 0, "b": 1, "c": 2}
    # a base row and another row that both name no model are not one model: the other is not the base's method
    assert combined_row_order([([], {"rows": [{"label": "m", "model": "m"}, {"label": "x"}, {"label": "a", "base": True}]})]) == {
        "a": 0, "m": 1, "x": 2}


def test_cards_of_several_runs_combine_into_one_and_again_after_a_run_goes_on(tmp_path):
    """``hf-posext report A B --out C``: one table over both runs' lengths, rows matched by label (their order
    by what a row is, then first appearance: combined_row_order), each cell with its run's dtype, pairs where one run ran both rows; C's card.json
    names A and B relative to C, so ``hf-posext report C`` combines them again once A has more samples."""
    from hf_posext.cli import main

    short, long = tmp_path / "runs" / "short", tmp_path / "runs" / "long"
    _one_run_card(short, [("base", 2048, [1, 1, 1, 1]), ("tuned", 2048, [1, 1, 1, 0])], "bfloat16")
    _one_run_card(long, [("tuned", 32768, [1, 1, 0]), ("yarn", 32768, [0, 0, 0, 1])], "float32")
    out = tmp_path / "combined"
    assert main(["report", str(short), str(long), "--out", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    got = {(c["row"], c["length"]): (c["row_index"], c["dtype"], c["n"]) for c in card["cells"]}
    assert got == {("base", 2048): (0, "bfloat16", 4), ("tuned", 2048): (1, "bfloat16", 4),
                   ("tuned", 32768): (1, "float32", 3), ("yarn", 32768): (2, "float32", 4)}
    assert card["settings"]["combined_from"] == [str(Path("..") / "runs" / "short"), str(Path("..") / "runs" / "long")]
    assert [(p["first"], p["second"], p["length"], p["higher"], p["lower"]) for p in card["paired"]] == [
        ("base", "tuned", 2048, 1, 0), ("tuned", "yarn", 32768, 2, 0)]
    page = (out / "card.html").read_text()
    assert "Combined from" in page and "niah_single_1 float32" in page and "card-niah_single_1.png" not in page
    assert "32k" in (out / "card.md").read_text() and (out / "card-niah_single_1.png").is_file()
    assert json.loads((short / "card.json").read_text())["settings"].get("combined_from") is None  # sources untouched

    _sample_file(long / "ruler" / "tuned-32768.jsonl", [1, 1, 0, 0], row="tuned", length=32768, dtype="float32")
    assert main(["report", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    assert {(c["row"], c["length"]): c["n"] for c in card["cells"]}[("tuned", 32768)] == 4
    assert [(p["higher"], p["lower"]) for p in card["paired"] if p["length"] == 32768] == [(2, 1)]


def test_combining_cards_refuses_overlapping_or_ambiguous_input_before_writing(tmp_path, capsys):
    """The same cell in two folders, --out among the folders or missing, a combined card as a source, a folder
    that is not a card: one line naming the problem, and nothing written."""
    from hf_posext.cli import main

    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    _one_run_card(first, [("tuned", 2048, [1, 1, 1, 1])], "float32")
    _one_run_card(second, [("tuned", 2048, [0, 0, 0, 0])], "float32")
    _one_run_card(third, [("tuned", 8192, [1, 0, 1, 0])], "float32")
    out = tmp_path / "combined"
    with pytest.raises(ValueError, match=r"tuned: niah_single_1 at 2048 is in both .*first and .*second"):
        combine_cards([first, second], out)
    assert not out.exists()
    with pytest.raises(ValueError, match="one of the folders combined"):
        combine_cards([first, third], third)
    with pytest.raises(ValueError, match="two or more"):
        combine_cards([first], out)
    combine_cards([first, third], out)
    with pytest.raises(ValueError, match="is a combined card"):
        combine_cards([out, second], tmp_path / "again")
    assert not (tmp_path / "again").exists()
    before = (out / "card.json").read_bytes()
    for argv, message in ((["report", str(first), str(third)], "pass --out FOLDER"),
                          (["report", str(first), str(tmp_path), "--out", str(out)], "holds no card.json")):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert (out / "card.json").read_bytes() == before


def test_rows_keep_the_earlier_cards_order_and_new_rows_follow_their_neighbour():
    from hf_posext.card.folder import in_row_order, merged_row_order

    assert merged_row_order([], ["b", "a"]) == {"b": 0, "a": 1}  # a first run: its own order
    assert merged_row_order(["base", "yarn", "ntk", "tuned"], ["yarn", "tuned"]) == {"base": 0, "yarn": 1, "ntk": 2, "tuned": 3}
    assert merged_row_order(["base", "yarn"], ["yarn", "new", "base"]) == {"base": 0, "yarn": 1, "new": 2}
    assert merged_row_order(["base", "yarn"], ["new"]) == {"new": 0, "base": 1, "yarn": 2}
    cells = [{"row": "yarn", "row_index": 0}, {"row": "base", "row_index": 1}, {"row": "other", "row_index": 2}]
    placed, settings = in_row_order(cells, {"rows": [{"label": "yarn"}, {"label": "base"}], "x": 1}, {"base": 0, "yarn": 1})
    assert [(c["row"], c["row_index"]) for c in placed] == [("yarn", 1), ("base", 0), ("other", 4)]
    assert [r["label"] for r in settings["rows"]] == ["base", "yarn"] and settings["x"] == 1


def test_a_run_into_a_card_folder_keeps_the_earlier_cells_it_does_not_cover(tmp_path):
    """A second run into the same --out with other tasks, rows or lengths keeps the first run's cells on the card
    (each with its own samples and dtype, its row after the new run's rows), drops those it covers; a damaged
    card.json or a combined card in the folder is refused by name."""
    folder = tmp_path / "card"
    _one_run_card(folder, [("base", 2048, [1, 1, 1, 1]), ("yarn", 2048, [0, 1, 0, 1]), ("yarn", 8192, [1, 0, 0, 0])], "bfloat16")
    settings = json.loads((folder / "card.json").read_text())["settings"]
    write_card(folder, json.loads((folder / "card.json").read_text())["cells"],
               [{"what": "base: niah_single_1 at 8192", "reason": "over its window"}, {"what": "niah_single_2", "reason": "download"}],
               settings)
    cells, skipped, rows = earlier_card(CardFolder.read(folder), ["tuned", "yarn"], {("niah_single_1", "yarn", 8192), ("niah_single_1", "base", 8192)})
    assert [(c["row"], c["length"], c["row_index"], c["samples"], c["dtype"], c["n"]) for c in cells] == [
        ("base", 2048, 2, 4, "bfloat16", 4), ("yarn", 2048, 1, 4, "bfloat16", 4)]
    assert skipped == [{"what": "niah_single_2", "reason": "download"}] and [r["label"] for r in rows] == ["base"]
    # the ending row is covered at any length
    assert earlier_card(CardFolder.read(folder), ["yarn"], {("niah_single_1", "yarn", None)})[0][0]["row"] == "base"
    assert earlier_card(CardFolder.read(tmp_path / "empty"), ["yarn"], set()) == ([], [], [])

    # a carried cell keeps its own sample count when written again, under a run that asked for fewer
    write_card(folder, cells, [], {**settings, "samples": 2})
    again = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert {(c["row"], c["length"]): c["n"] for c in again} == {
        ("base", 2048): 4, ("yarn", 2048): 4, ("yarn", 8192): 2}  # the last: found as this run's cell, its first 2

    (folder / "card.json").write_text('{"settings": ')
    with pytest.raises(CardFileError, match="card.json is not a card"):
        earlier_card(CardFolder.read(folder), ["yarn"], set())
    other = tmp_path / "other"
    _one_run_card(other, [("tuned", 4096, [1, 0, 1, 1])], "float32")
    _one_run_card(folder, [("base", 2048, [1, 1, 1, 1])], "float32")
    combine_cards([folder, other], tmp_path / "combined")
    with pytest.raises(ValueError, match="holds a combined card"):
        earlier_card(CardFolder.read(tmp_path / "combined"), ["yarn"], set())


def test_an_earlier_runs_unfinished_cell_is_kept_like_a_finished_one(tmp_path):
    """A run stopped part-way through a cell leaves a sample file that card.json shows as unfinished; a later run
    into the folder keeps that cell (with the samples it has) whether or not it covers it, so that its partial
    cards never show fewer cells than the folder holds."""
    folder = tmp_path / "card"
    _one_run_card(folder, [("base", 2048, [1, 1, 1, 1]), ("yarn", 2048, [0, 1, 0, 1])], "float32")
    _sample_file(folder / "ruler" / "yarn-32768.jsonl", [1, 0], row="yarn", length=32768, dtype="float32")
    rewrite_card(folder)
    cells = earlier_card(CardFolder.read(folder), ["yarn"], set())[0]
    assert sorted((c["row"], c["length"], c["n"], bool(c.get("running")), c["row_index"]) for c in cells) == [
        ("base", 2048, 4, False, 1), ("yarn", 2048, 4, False, 0), ("yarn", 32768, 2, True, 0)]
    assert sorted((c["row"], c["length"]) for c in earlier_card(CardFolder.read(folder), ["yarn"], {("niah_single_1", "yarn", 32768)})[0]) == [
        ("base", 2048), ("yarn", 2048)]


def test_an_unfinished_cell_of_a_task_the_last_run_did_not_name_stays_on_the_card_written_again(tmp_path):
    """A run with other tasks into a folder (its settings name only its own tasks' dtypes) keeps an earlier run's
    unfinished cell on its card; written again (``hf-posext report``, a combined card), that cell keeps its dtype
    and its own sample count instead of dropping off."""
    folder = tmp_path / "card"
    ruler = folder / "ruler"
    _sample_file(ruler / "mine.jsonl", [1, 0, 1, 1], task="niah_multikey_2", row="yarn", length=8192, dtype="float32")
    _sample_file(ruler / "earlier.jsonl", [1, 1], row="yarn", length=8192, dtype="float32")
    rows = [{"label": "yarn", "model": "m", "report": {"method": "yarn", "current_window": 16384}}]
    settings = {"samples": 4, "rows": rows, "dtypes": {"niah_multikey_2": "float32"}, "models": ["m"]}
    mine = {**ruler_cell("yarn", 0, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}, task="niah_multikey_2"), "length": 8192,
            "source": str(ruler / "mine.jsonl"), "dtype": "float32"}
    earlier = {**ruler_cell("yarn", 0, {0: 1.0, 1: 1.0}), "length": 8192, "source": str(ruler / "earlier.jsonl"),
               "dtype": "float32", "samples": 20, "running": True, "text": "2/2 [0.34, 1.00], 2 of 20 so far"}
    write_card(folder, [mine, earlier], [], settings)
    for _ in range(2):  # written again, then again from what that wrote
        cells = {c["task"]: c for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]}
        assert sorted(cells) == ["niah_multikey_2", "niah_single_1"]
        kept = cells["niah_single_1"]
        assert (kept["n"], kept["samples"], kept["dtype"], kept["running"]) == (2, 20, "float32", True)
        assert kept["text"].endswith("2 of 20 so far")
    # another dtype's file of that cell is still not this card's
    _sample_file(ruler / "earlier.jsonl", [1, 1], row="yarn", length=8192, dtype="bfloat16")
    assert [c["task"] for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]] == ["niah_multikey_2"]


def test_a_cell_still_running_is_shown_with_the_samples_it_has(tmp_path):
    """A sample file that card.json does not list yet (the cell a run is computing) shows on the card written
    again, marked unfinished, when it is one of the card's rows in the card's dtype; others are left out."""
    folder = tmp_path / "card"
    ruler = folder / "ruler"
    _sample_file(ruler / "done.jsonl", [1, 1, 0, 1])
    _sample_file(ruler / "running.jsonl", [1, 0], cut_tail=True, row="yarn", length=8192, dtype="float32")
    _sample_file(ruler / "other-dtype.jsonl", [0, 0], row="yarn", length=8192, dtype="bfloat16")
    _sample_file(ruler / "other-row.jsonl", [0, 0], row="not on this card", length=8192, dtype="float32")
    rows = [{"label": "base", "model": "m", "report": {"method": "none", "current_window": 4096}},
            {"label": "yarn", "model": "m", "report": {"method": "yarn", "current_window": 16384}}]
    settings = {"samples": 4, "rows": rows, "dtypes": {"niah_single_1": "float32"}, "models": ["m"]}
    write_card(folder, [{**ruler_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], settings)
    cells = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert [(c["row"], c["length"], c["n"]) for c in cells] == [("base", 4096, 4), ("yarn", 8192, 2)]
    running = cells[1]
    assert running["running"] and running["text"].endswith("2 of 4 so far") and running["row_index"] == 1 and running["k"] == 1
    assert running["in_window"] and not running["base"]
    assert "2 of 4 so far" in (folder / "card.md").read_text()
    # a card of a run asked for "--tasks ruler" named its dtype once, as "ruler" (cards before each task was named)
    write_card(folder, [{**ruler_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [],
               {**settings, "dtypes": {"ruler": "float32"}})
    assert [(c["row"], c["n"]) for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]] == [("base", 4), ("yarn", 2)]
    # a file written under the row's older label is found by its model and scaling (not by the label), and shown
    # under the row's label today; a header that matches two rows, or none, is not this card's
    old_report = {"method": "yarn", "factor": 4.0, "current_window": 16384, "original_window": 4096}
    _sample_file(ruler / "old-label.jsonl", [1, 1, 1], row="tuned, x1", length=16384, dtype="float32", model="m", report=old_report)
    _sample_file(ruler / "unknown.jsonl", [1, 1], row="gone", length=16384, dtype="float32", model="m",
                 report={**old_report, "factor": 2.0})
    renamed = [rows[0], {"label": "yarn", "model": "m", "report": {**old_report, "extra": "not in a header"}}]
    write_card(folder, [{**ruler_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], {**settings, "rows": renamed})
    cells = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert [(c["row"], c["length"], c["n"]) for c in cells] == [("base", 4096, 4), ("yarn", 8192, 2), ("yarn", 16384, 3)]
    twice = [*renamed, {"label": "yarn again", "model": "m", "report": old_report}]
    write_card(folder, [{**ruler_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], {**settings, "rows": twice})
    assert [(c["row"], c["length"]) for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]] == [
        ("base", 4096), ("yarn", 8192)]
    for path in (ruler / "old-label.jsonl", ruler / "unknown.jsonl"):
        path.unlink()
    write_card(folder, [{**ruler_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], settings)
    # written again once the cell has all its samples: no longer marked
    _sample_file(ruler / "running.jsonl", [1, 0, 1, 1], row="yarn", length=8192, dtype="float32")
    cells = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert [(c["row"], c["n"], c.get("running")) for c in cells] == [("base", 4, None), ("yarn", 4, None)]
    assert "so far" not in (folder / "card.md").read_text()


def test_a_damaged_card_or_a_missing_sample_file_is_named(tmp_path, capsys):
    from hf_posext.cli import main

    folder = tmp_path / "card"
    folder.mkdir()
    (folder / "card.json").write_text('{"cells": [')
    with pytest.raises(CardFileError, match="card.json is not a card"):
        rewrite_card(folder)
    write_card(folder, [{**ruler_cell("r", 0, {0: 1.0}), "source": "gone.jsonl"}], [], {"samples": 1})
    with pytest.raises(FileNotFoundError, match="gone.jsonl"):
        rewrite_card(folder)
    _sample_file(folder / "ruler" / "gone.jsonl", [1])
    (folder / "ruler" / "gone.jsonl").write_text((folder / "ruler" / "gone.jsonl").read_text() + '{"doc_id": 1}\n')
    with pytest.raises(SampleResultsError, match="line 3 lacks its 'score'"):
        rewrite_card(folder)
    assert main(["report", str(folder), "--compare", "a", "b"]) == 2
    assert "compares its rows on the same RULER samples itself" in capsys.readouterr().err


def test_a_write_computes_the_paired_comparisons_once(tmp_path, monkeypatch):
    """card.json, card.md and card.html show the same comparisons: computed once a write, handed to each."""
    from hf_posext.card import folder, render, stats

    calls = []

    def counted(cells):
        calls.append(len(cells))
        return stats.paired_comparisons(cells)

    monkeypatch.setattr(folder, "paired_comparisons", counted)
    monkeypatch.setattr(render, "paired_comparisons", counted)
    cells = [ruler_cell("base", 0, {0: 1, 1: 0}), ruler_cell("yarn", 1, {0: 0, 1: 0}),
             {**ruler_cell("base", 0, {0: 1}), "task": "ending", "kind": "ending"}]
    paths = write_card(tmp_path / "card", cells, [], {"samples": 2})
    assert calls == [3]
    assert "1:0 of 2" in paths["markdown"].read_text() and "1:0 of 2" in paths["html"].read_text()


def test_a_ruler_cell_edited_in_card_json_is_named_and_shown_as_its_samples_say(tmp_path):
    """``report``: a RULER cell whose scores or k in card.json differ from its sample file is named in one warning
    line, and the card shows the sample file's numbers (an untouched card gives no warning)."""
    import warnings

    from hf_posext.card.folder import rewrite_card

    folder = tmp_path / "card"
    _sample_file(folder / "ruler" / "first.jsonl", [1, 0, 1, 1])
    cell = {**ruler_cell("row 0", 0, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}), "source": "first.jsonl"}
    write_card(folder, [cell], [], {"samples": 4, "partial": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewrite_card(folder)  # untouched: no warning
    data = json.loads((folder / "card.json").read_text())
    data["cells"][0].update(k=4, scores={"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0})
    (folder / "card.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"row 0, niah_single_1 at 4096: its scores in card.json differ from its sample "
                                         r"file first.jsonl \(card.json edited\?\); the card shows the sample file's$"):
        rewrite_card(folder)
    assert json.loads((folder / "card.json").read_text())["cells"][0]["k"] == 3
    data = json.loads((folder / "card.json").read_text())
    data["cells"][0]["k"] = 4  # k alone edited: no longer the sum of the cell's own scores
    (folder / "card.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"row 0, niah_single_1 at 4096: its scores in card.json differ"):
        rewrite_card(folder)
