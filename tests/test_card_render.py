"""The suite's plots: one a task, with the base model's best in-window score and every point's interval."""

from __future__ import annotations


from hf_posext.card.render import card_figure, sample_counts_text
from hf_posext.card.stats import base_reference
from tests.card_helpers import ruler_cell


def test_a_task_plot_draws_the_base_models_best_in_window_score_and_every_points_interval():
    """The dashed reference is the base row's best score inside its window (a score past the window, or another
    row's, never sets it; for perplexity the lowest); a row with a single point still shows its interval."""
    from hf_posext.evaluation.plots import layout_problems

    def cell(row, index, length, scores, base=False, in_window=True):
        return {**ruler_cell(row, index, dict(enumerate(scores))), "length": length, "base": base, "in_window": in_window}

    cells = [cell("base", 0, 2048, [1, 0, 1, 0], base=True), cell("base", 0, 4096, [1, 1, 1, 0], base=True),
             cell("base", 0, 16384, [1, 1, 1, 1], base=True, in_window=False), cell("yarn", 1, 16384, [1, 1, 1, 1]),
             cell("tuned", 2, 32768, [1, 1, 0, 1])]
    assert base_reference(cells) == (0.75, 4096)
    assert base_reference(cells[3:]) is None
    figure = card_figure("niah_single_1", cells, beyond=False)
    axis = figure.axes[0]
    (reference,) = [line for line in axis.get_lines() if line.get_label().startswith("base, best inside its window")]
    assert list(reference.get_ydata()) == [0.75, 0.75] and "(0.75 at 4k)" in reference.get_label()
    bars = [c for c in axis.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 3  # one per row, the single-point rows included
    tuned_low, tuned_high = cells[4]["low"], cells[4]["high"]
    segment = bars[2].lines[2][0].get_segments()[0]
    assert [round(y, 6) for _, y in segment] == [round(tuned_low, 6), round(tuned_high, 6)]
    assert layout_problems(figure) == []
    # n in the legend, by length where it differs (never "n=4/8", which reads as 4 of 8)
    assert [line.get_label() for line in axis.get_lines() if "(n=" in line.get_label()] == ["base (n=4)", "yarn (n=4)", "tuned (n=4)"]
    points = [{"n": 20, "length": 2048}, {"n": 20, "length": 16384}, {"n": 10, "length": 32768}]
    assert sample_counts_text(points) == "n=20 at 2k-16k, 10 at 32k"
    assert sample_counts_text(points[1:]) == "n=20 at 16k, 10 at 32k" and sample_counts_text(points[:2]) == "n=20"
    # labels too long for two legend columns (the combined SmolLM2 card's): one column, nothing clipped
    long = [{**c, "row": f"fine-tuned with a long practice name, yarn ×4 + string {c['row']}"} for c in cells]
    wide = card_figure("niah_single_1", long, beyond=False)
    def columns(drawn):  # legend columns: distinct left edges of its texts
        renderer = drawn.canvas.get_renderer()
        return len({round(t.get_window_extent(renderer).x0) for t in drawn.legends[0].get_texts()})

    assert layout_problems(wide) == [] and columns(wide) == 1
    assert columns(figure) == 2  # short labels keep two
    ppl = [{**c, "task": "perplexity", "low": None, "high": None, "mean": m} for c, m in zip(cells[:3], (30.0, 25.8, 20.0))]
    assert base_reference(ppl) == (25.8, 4096)


def test_a_plot_is_drawn_again_only_when_its_tasks_cells_change_or_its_file_did(tmp_path, monkeypatch):
    """A run writes its card after every sample: the plots of the tasks that did not change are kept as drawn, and a
    plot whose file was replaced or removed since is drawn again."""
    import hf_posext.card.render as render

    drawn: list[str] = []
    real = render.card_figure
    monkeypatch.setattr(render, "card_figure", lambda task, *a, **k: drawn.append(task) or real(task, *a, **k))
    first = [ruler_cell("base", 0, {0: 1, 1: 0}), ruler_cell("base", 0, {0: 1, 1: 1}, task="ruler_fwe")]
    render.write_plots(tmp_path, first, {})
    assert sorted(drawn) == ["niah_single_1", "ruler_fwe"]
    render.write_plots(tmp_path, first, {})  # nothing changed: nothing drawn
    assert len(drawn) == 2
    second = [first[0], ruler_cell("base", 0, {0: 1, 1: 1, 2: 0}, task="ruler_fwe")]
    render.write_plots(tmp_path, second, {})  # one task's cells changed: that plot only
    assert drawn[2:] == ["ruler_fwe"]
    (tmp_path / "card-niah_single_1.png").unlink()
    paths = render.write_plots(tmp_path, second, {})  # a removed file is drawn again
    assert drawn[3:] == ["niah_single_1"] and all(path.is_file() for path in paths)
