"""The grid runner stores cells as it finishes them: a stopped evaluation keeps its finished cells."""

import json

import pytest

from hf_posext.evaluation import passkey
from hf_posext.evaluation.arguments import parse_methods
from hf_posext.evaluation.grid import Cell, Unit, cell_groups
from hf_posext.evaluation.loading import AsciiTokenizer
from hf_posext.models import tiny_model

TOKENIZER = AsciiTokenizer()


def _cells(units_per_cell: list[int]) -> list[Cell]:
    return [Cell({"depth": d}, [Unit((d, t), None) for t in range(n)]) for d, n in enumerate(units_per_cell)]


def test_cell_groups_fill_every_process_batch_then_store():
    cells = _cells([2, 2, 2, 2, 1])
    needed = {id(u) for c in cells for u in c.units}
    groups = cell_groups(cells, needed, group_units=4)  # 2 processes x batch 2
    assert [[c.coords["depth"] for c in group] for group, _ in groups] == [[0, 1], [2, 3], [4]]
    assert [len(units) for _, units in groups] == [4, 4, 1]
    # one process, batch 1: a group per cell, so each cell is stored as soon as it is done
    assert len(cell_groups(cells, needed, group_units=1)) == 5


def test_cell_groups_count_only_the_units_still_needed():
    cells = _cells([3, 3, 3])
    needed = {id(u) for u in cells[0].units[2:] + cells[1].units + cells[2].units}  # cell 0 stored with 2 of 3
    groups = cell_groups(cells, needed, group_units=2)
    assert [[c.coords["depth"] for c in group] for group, _ in groups] == [[0, 1], [2]]
    assert [u.key for u in groups[0][1]] == [(0, 2), (1, 0), (1, 1), (1, 2)]


def test_a_stopped_evaluation_keeps_its_finished_cells(tmp_path, monkeypatch):
    # Stopped while scoring the second depth's first trial: the first depth is on disk, and the next run
    # scores only the two depths that were not finished (before, a stop lost every trial of that length).
    scored = []
    real = passkey.score_retrieval_grouped

    def stops_at_the_third_prompt(model, tokenizer, batch, **kwargs):
        if len(scored) == 2:
            raise KeyboardInterrupt
        scored.extend(b[2] for b in batch)
        return real(model, tokenizer, batch, **kwargs)

    monkeypatch.setattr(passkey, "score_retrieval_grouped", stops_at_the_third_prompt)
    tiny = tiny_model("llama", seed=0, max_position_embeddings=256)
    common = dict(methods=parse_methods("none"), lengths=[400], depths=(0.0, 0.5, 1.0), trials=2, out_dir=tmp_path,
                  progress=False, generate=False)
    with pytest.raises(KeyboardInterrupt):
        passkey.evaluate_passkey(tiny, TOKENIZER, **common)
    [path] = tmp_path.glob("passkey-*.json")
    stored = json.loads(path.read_text())["cells"]
    assert [(r["depth"], r["trials"]) for r in stored.values()] == [(0.0, 2)]

    monkeypatch.setattr(passkey, "score_retrieval_grouped", real)
    rescored = []

    def counting(model, tokenizer, batch, **kwargs):
        rescored.extend(b[2] for b in batch)
        return real(model, tokenizer, batch, **kwargs)

    monkeypatch.setattr(passkey, "score_retrieval_grouped", counting)
    again = passkey.evaluate_passkey(tiny, TOKENIZER, **common)
    assert sorted(rescored) == sorted(passkey.draw_passkey(0, 400, d, t) for d in (0.5, 1.0) for t in (0, 1))
    assert sorted(r["depth"] for r in again.cells.values()) == [0.0, 0.5, 1.0]
    assert next(iter(again.cells.values()))["units"] == next(iter(stored.values()))["units"]
