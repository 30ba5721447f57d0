"""The grid runner stores cells as it finishes them: a stopped evaluation keeps its finished cells."""

import json
import re

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


def test_a_run_stopped_inside_a_cell_resumes_at_its_next_unit(tmp_path, monkeypatch, capsys):
    # Eight perplexity segments of 32768 tokens are one cell and hours on a CPU: a run stopped inside it keeps the
    # segments it finished (apart from the cells, which no report reads unfinished) and the next run scores only
    # the rest, to the same perplexity as a run never stopped.
    from hf_posext.evaluation import perplexity

    real = perplexity.chunked_nll
    scored: list[list[int]] = []

    def stops_at_the_third_segment(model, ids, chunk_size):
        if len(scored) == 2:
            raise KeyboardInterrupt
        scored.append(ids[0].tolist())
        return real(model, ids, chunk_size)

    tiny = tiny_model("llama", seed=0, max_position_embeddings=256)
    text = " ".join(f"line {i} of the text, with words to count" for i in range(400))
    common = dict(data=[text], methods=parse_methods("none"), lengths=[128], max_segments=4, progress=False)
    monkeypatch.setattr(perplexity, "chunked_nll", stops_at_the_third_segment)
    with pytest.raises(KeyboardInterrupt):
        perplexity.evaluate_perplexity(tiny, TOKENIZER, out_dir=tmp_path / "stopped", **common)
    [path] = (tmp_path / "stopped").glob("perplexity-*.json")
    saved = json.loads(path.read_text())
    assert saved["cells"] == {} and [len(e["units"]) for e in saved["partial"].values()] == [2]

    rescored: list[list[int]] = []

    def counting(model, ids, chunk_size):
        rescored.append(ids[0].tolist())
        return real(model, ids, chunk_size)

    monkeypatch.setattr(perplexity, "chunked_nll", counting)
    resumed = perplexity.evaluate_perplexity(tiny, TOKENIZER, out_dir=tmp_path / "stopped", **common)
    assert len(rescored) == 2 and not any(ids in scored for ids in rescored)  # only the two it had not scored
    assert "perplexity none x1 @ 128: resuming after 2 window(s) a stopped run finished" in capsys.readouterr().err
    assert "partial" not in json.loads(path.read_text())
    whole = perplexity.evaluate_perplexity(tiny, TOKENIZER, out_dir=tmp_path / "whole", **common)
    [(done)], [(reference)] = resumed.cells.values(), whole.cells.values()
    assert done["windows"] == reference["windows"] == 4
    assert done["nll"] == pytest.approx(reference["nll"], rel=1e-6)

    # unfinished units computed on other weights (a model retrained into the same folder) are not reused
    stopped_again = tmp_path / "other"
    monkeypatch.setattr(perplexity, "chunked_nll", stops_at_the_third_segment)
    scored.clear()
    with pytest.raises(KeyboardInterrupt):
        perplexity.evaluate_perplexity(tiny, TOKENIZER, out_dir=stopped_again, **common)
    rescored.clear()
    monkeypatch.setattr(perplexity, "chunked_nll", counting)
    retrained = tiny_model("llama", seed=1, max_position_embeddings=256)
    capsys.readouterr()
    perplexity.evaluate_perplexity(retrained, TOKENIZER, out_dir=stopped_again, **common)
    assert len(rescored) == 4 and "resuming" not in capsys.readouterr().err


def test_records_carry_the_loaded_models_window_before_scaling(tmp_path):
    # A model saved with yarn x2 in its config (window 256 -> 512) and evaluated at x1 with STRING: its records
    # say supported_window 512, and the plot's "original window" line must sit at 256, the window the model had
    # before yarn. Read from supported_window / factor it sat at 512, on top of the points it is there to frame.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_posext.evaluation.plots import line_figure, method_styles

    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    scaled = tiny_model("llama", seed=0, max_position_embeddings=512, rope_parameters=rope)
    passkey.evaluate_passkey(scaled, TOKENIZER, methods=parse_methods("string"), lengths=[480], factor=1.0, depths=(0.0,),
                             trials=1, out_dir=tmp_path, progress=False, generate=False)
    [path] = tmp_path.glob("passkey-*.json")
    [record] = json.loads(path.read_text())["cells"].values()
    assert (record["supported_window"], record["original_window"]) == (512, 256)
    figure = line_figure([record], "teacher_forced_accuracy", "accuracy", "Passkey", method_styles(["string"]), rate=True)
    dotted = [list(line.get_xdata()) for line in figure.axes[0].lines if line.get_linestyle() == ":"]
    plt.close(figure)
    assert dotted == [[256, 256]]


def test_without_a_progress_bar_each_finished_cell_is_one_line_on_stderr(tmp_path, capsys):
    # A run in the background (--no-progress) writes its log line by line: one per cell, with its count and time.
    from hf_posext.evaluation.grid import record_summary

    tiny = tiny_model("llama", seed=0, max_position_embeddings=256)
    common = dict(methods=parse_methods("none"), lengths=[400], depths=(0.0, 1.0), trials=2, out_dir=tmp_path)
    store = passkey.evaluate_passkey(tiny, TOKENIZER, progress=False, **common)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("passkey ")]
    records = sorted(store.cells.values(), key=lambda r: r["depth"])
    # each cell's first trial is kept (a resume skips it) and says so, then the finished cell gives its count
    kept = [re.sub(r", \d+ s$", ", N s", line) for line in lines[0::2]]
    assert kept == [f"passkey none x1 @ 400, depth {r['depth']:g}: 1 of 2 trials done and kept, N s" for r in records]
    assert lines[1::2] == [f"passkey none x1 @ 400, depth {r['depth']:g}: {r['greedy_correct']}/2 found (greedy), "
                           f"{r['seconds']:.0f} s" for r in records]
    assert record_summary({"teacher_forced_correct": 1, "trials": 2}) == "1/2 found (teacher-forced)"
    assert record_summary({"ppl": 24.356, "seconds": 310.4}) == "perplexity 24.36, 310 s"
    # with a bar (an interactive run), no such lines; a finished run prints nothing again
    passkey.evaluate_passkey(tiny, TOKENIZER, progress=True, out_dir=tmp_path / "bar", **{k: v for k, v in common.items() if k != "out_dir"})
    passkey.evaluate_passkey(tiny, TOKENIZER, progress=False, **common)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("passkey none x1 @ 400, depth")]
