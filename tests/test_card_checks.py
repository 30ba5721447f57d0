"""A card.json with numbers no card run writes (a hand edit, a damaged file) is refused by ``report`` in one line
naming the file, the cell and the field, as the other results files are: never printed as if measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_posext.card.checks import card_cell_problem
from hf_posext.card.folder import CardFileError, rewrite_card, write_card
from hf_posext.card.stats import score_summary

REPO = Path(__file__).resolve().parent.parent


def passkey_cell(outcomes: list[float], **changes) -> dict:
    """A passkey cell of the card as ``eval suite`` writes it (one score a trial, keyed DEPTH/TRIAL)."""
    scores = {f"0.5/{i}": v for i, v in enumerate(outcomes)}
    return {"task": "passkey", "kind": "passkey", "row": "base", "row_index": 0, "length": 2048, "base": True,
            "in_window": True, "source": "tasks/passkey-m-0.json", "scores": scores,
            "sample_key": {"task": "passkey", "length": 2048, "seed": 0}, **score_summary(outcomes), **changes}


def perplexity_cell(**changes) -> dict:
    return {"task": "perplexity", "kind": "perplexity", "row": "base", "row_index": 0, "length": 2048, "base": True,
            "in_window": True, "source": "tasks/perplexity-m-0.json", "n": 2, "mean": 27.5, "low": None, "high": None,
            "text": "27.50", **changes}


@pytest.mark.parametrize("cell, problem", [
    (passkey_cell([1.0, 0.0, 7.0, 0.0, 0.0]), "score 7.0 for '0.5/2', outside [0, 1]"),
    (perplexity_cell(mean=-5.0, text="-5.00"), "mean -5.0, but a perplexity is never below 1"),
    (passkey_cell([0.0] * 5, n=50), "n 50, but it holds 5 scores"),
    (passkey_cell([1.0, 0.0, 0.0, 0.0, 0.0], k=4), "k 4 of 5, but its scores add up to 1"),
    (passkey_cell([1.0, 0.0, 0.0, 0.0, 0.0], mean=0.9), "mean 0.9, but k/n is 1/5"),
    (passkey_cell([1.0, 1.0], n="2"), "n '2', not a whole number of samples"),
], ids=["score-7", "negative-perplexity", "n-50-of-5", "k-over-scores", "mean-over-k", "n-text"])
def test_a_card_cell_no_run_writes_is_refused_naming_the_cell_and_field(tmp_path, cell, problem):
    assert problem in card_cell_problem(cell)
    folder = tmp_path / "card"
    write_card(folder, [passkey_cell([1.0, 0.0, 1.0, 0.0, 0.0])], [], {"samples": 5, "partial": False})
    card = json.loads((folder / "card.json").read_text())
    card["cells"] = [cell]  # edited by hand
    (folder / "card.json").write_text(json.dumps(card))
    with pytest.raises(CardFileError) as refused:
        rewrite_card(folder)
    message = str(refused.value)
    assert message.startswith(f"{folder / 'card.json'}: cell base, {cell['task']} at 2048 has {problem}"), message
    assert "restore card.json from version control, or delete it and run the suite again" in message
    assert "\n" not in message


def test_cells_as_runs_write_them_pass(tmp_path):
    for cell in (passkey_cell([1.0, 0.0, 1.0, 1.0, 0.0]), perplexity_cell(), passkey_cell([]) | {"n": 0}):
        assert card_cell_problem(cell) is None, cell
    ruler = passkey_cell([0.5, 1.0, 0.0]) | {"kind": "ruler", "task": "niah_multivalue"}  # partial credit
    assert card_cell_problem(ruler) is None


def test_every_committed_card_passes():
    cards = sorted(REPO.glob("bench/results/**/card.json"))
    assert cards
    for path in cards:
        for cell in json.loads(path.read_text())["cells"]:
            assert card_cell_problem(cell) is None, (path, cell.get("row"), cell.get("task"), cell.get("length"))


def test_a_truncated_card_names_a_fix_that_works(tmp_path):
    """A run into the folder reads its card first (to keep the cells it does not compute), so "run the suite again"
    alone fails with the same error: the fix says to delete the damaged file first."""
    folder = tmp_path / "card"
    write_card(folder, [passkey_cell([1.0, 0.0])], [], {"samples": 2, "partial": False})
    text = (folder / "card.json").read_text()
    (folder / "card.json").write_text(text[: len(text) // 2])
    with pytest.raises(CardFileError) as refused:
        rewrite_card(folder)
    message = str(refused.value)
    assert message.startswith(f"{folder / 'card.json'} is not a card") and "\n" not in message
    assert message.endswith("restore card.json from version control, or delete it and run the suite again.")


def test_a_run_of_another_seed_into_a_card_folder_is_refused_before_anything_changes(tmp_path, capsys, monkeypatch):
    from hf_posext.cli import main
    import hf_posext.evaluation.loading as loading

    monkeypatch.setattr(loading, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("a model loaded"))
    folder = tmp_path / "card"
    write_card(folder, [passkey_cell([1.0, 0.0])], [], {"samples": 2, "seed": 0, "partial": False})
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    code = main(["eval", "suite", "--models", "tiny", "--methods", "none", "--tasks", "passkey", "--lengths", "400",
                 "--trials", "2", "--seed", "1", "--out", str(folder), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and f"holds a card of --seed 0" in error and "pass --seed 0, or give another --out" in error, error
    assert len(error.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
