"""Plots: layout checked from matplotlib's geometry (legend vs axes, texts vs the figure's edge), styles, ties."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from hf_posext.evaluation.plots import heatmap_figure, layout_problems, line_figure, method_styles, wrap_label  # noqa: E402

LONG = "longrope(factors=search_smollm2-135m_32768_gpu.json)"


def _records(labels, lengths, depths=(None,), factors=(2.0,), model=None):
    records = []
    for factor in factors:
        for i, label in enumerate(labels):
            method = label.split("(")[0]
            for length in lengths:
                for depth in depths:
                    record = {"method": method, "label": label, "factor": 1.0 if method == "none" else factor, "length": length,
                              "supported_window": 1024 if method == "none" else int(1024 * factor), "dynamic": False,
                              "ppl": 10.0 + i + length / 1e4, "trials": 3, "teacher_forced_accuracy": ((i + length // 1024) % 4) / 3}
                    if depth is not None:
                        record["depth"] = depth
                    if model:
                        record["_model"] = model
                    records.append(record)
    return records


METHODS = ["none", "yarn", "dynamic-ntk", "self-extend", LONG]
LINE_CASES = {
    "one length": _records(METHODS, [2048]),
    "twelve lengths": _records(METHODS, [1024 * k for k in range(1, 13)]),
    "two factors": _records(METHODS, [1024, 2048, 4096, 8192], factors=(2.0, 4.0)),
    "two models": _records(METHODS, [1024, 4096], model="base") + _records(["yarn"], [1024, 4096], model="runs/tuned/merged"),
}
HEATMAP_CASES = {
    "one length": _records(METHODS, [16384], depths=(0.1, 0.5, 0.9)),
    "twelve lengths": _records(METHODS, [1024 * k for k in range(1, 13)], depths=(0, 0.25, 0.5, 0.75, 1)),
    "one method, one length": _records(["yarn"], [16384], depths=(0.5,)),
    "two long labels": _records([LONG, LONG.replace("_gpu", "")], [32768], depths=(0.1, 0.5, 0.9)),
    "eleven methods": _records(METHODS + [f"m{i}" for i in range(6)], [4096, 8192], depths=(0.1, 0.9)),
}


@pytest.mark.parametrize("case", LINE_CASES)
def test_line_plot_layout_is_clean(case):
    records = LINE_CASES[case]
    figure = line_figure(records, "ppl", "perplexity", "Perplexity against length: a model with a long name", method_styles(
        r["label"] for r in records), log_y=True)
    assert layout_problems(figure) == []
    plt.close(figure)


@pytest.mark.parametrize("case", HEATMAP_CASES)
def test_heatmap_layout_is_clean(case):
    figure = heatmap_figure(HEATMAP_CASES[case], "teacher_forced_accuracy", "Passkey accuracy by length and depth: smollm2-135m, x2")
    assert layout_problems(figure) == []
    plt.close(figure)


def test_layout_check_catches_a_legend_over_the_data_and_a_clipped_title():
    records = LINE_CASES["two factors"]
    figure = line_figure(records, "ppl", "perplexity", "title", method_styles(r["label"] for r in records))
    figure.legends[0].remove()
    figure.axes[0].legend(["a", "b", "c"], loc="center")  # deliberately inside the axes
    assert any("legend overlaps the axes" in p for p in layout_problems(figure))
    plt.close(figure)
    figure = heatmap_figure(HEATMAP_CASES["one length"], "teacher_forced_accuracy", "t")
    figure.suptitle("a title far too long for this figure " * 20, fontsize=11)  # deliberately unwrapped
    assert any("clipped by the figure's edge" in p for p in layout_problems(figure))
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(4, 3), layout="constrained")
    axis.plot([1, 2], [1, 2], label="a method")
    figure.legend(loc="outside right upper", title="a legend title")
    figure.suptitle("a figure title long enough to reach the legend")  # the old needle.png fault
    assert any("legend overlaps the title" in p for p in layout_problems(figure))
    plt.close(figure)
    figure, axis = plt.subplots(figsize=(2, 2))
    axis.set_xticks(range(12), [f"label number {i}" for i in range(12)])  # deliberately crowded
    assert any("tick labels" in p and "overlap" in p for p in layout_problems(figure))
    plt.close(figure)


def test_one_style_per_method_in_every_plot():
    records = LINE_CASES["two factors"]
    styles = method_styles(r["label"] for r in records)
    assert len({styles[label] for label in METHODS}) == len(METHODS) and styles["none"][0] == "black"
    for metric in ("ppl", "teacher_forced_accuracy"):
        figure = line_figure(records, metric, metric, "t", styles)
        for axis in figure.axes:
            drawn = [line for line in axis.lines if line.get_linestyle() == "-"]  # the window line is dotted
            assert len(drawn) == len(METHODS)
            for line, label in zip(drawn, sorted(METHODS, key=lambda m: (m != "none", m))):  # the plot's order
                colour, marker, filled = styles[label]
                assert matplotlib.colors.same_color(line.get_color(), colour) and line.get_marker() == marker
                assert (line.get_markerfacecolor() == "none") == (not filled)  # the same fill in every panel
        plt.close(figure)


def test_ties_stay_visible_and_the_window_is_marked():
    records = _records(["none", "yarn", "dynamic-yarn"], [1024, 2048])
    for record in records:
        record["ppl"] = 5.0  # every method ties at every length
    figure = line_figure(records, "ppl", "perplexity", "t", method_styles(r["label"] for r in records))
    axis = figure.axes[0]
    data_lines = [line for line in axis.lines if line.get_linestyle() == "-"]
    x_at_1024 = sorted(float(line.get_xdata()[0]) for line in data_lines)
    assert len(data_lines) == 3 and all(b / a > 1.02 for a, b in zip(x_at_1024, x_at_1024[1:]))  # offset sideways
    assert any(list(line.get_xdata()) == [1024, 1024] for line in axis.lines)  # the original window, dotted
    plt.close(figure)


def test_a_tiny_perplexity_difference_is_not_stretched_over_the_whole_axis():
    """25.12 vs 25.15 is 0.1 %: the log axis spans at least MIN_LOG_SPAN, not the autoscaled 0.03."""
    from hf_posext.evaluation.plots import MIN_LOG_SPAN

    records = _records(["yarn"], [16384, 32768])
    records[0]["ppl"], records[1]["ppl"] = 25.12, 25.15
    figure = line_figure(records, "ppl", "perplexity", "t", method_styles(["yarn"]), log_y=True)
    low, high = figure.axes[0].get_ylim()
    assert high / low >= MIN_LOG_SPAN * 0.999 and low < 25.12 and high > 25.15
    plt.close(figure)
    records[1]["ppl"] = 60.0  # a real difference keeps matplotlib's own limits
    figure = line_figure(records, "ppl", "perplexity", "t", method_styles(["yarn"]), log_y=True)
    low, high = figure.axes[0].get_ylim()
    assert low > 20 and high < 70
    plt.close(figure)


def test_long_labels_wrap_at_their_parts():
    assert wrap_label(LONG, 44) == "longrope(\nfactors=search_smollm2-135m_32768_gpu.json)"
    assert all(len(line) <= 20 for line in wrap_label(LONG, 20).splitlines())
    assert wrap_label("yarn", 20) == "yarn"


def test_rate_plots_count_trials_per_panel_point():
    # One label in two panels (x2 and x4) at one length: each point holds 3 trials, not 6 pooled across panels.
    from hf_posext.evaluation.plots import trials_note

    records = [{"method": "yarn", "label": "yarn", "factor": f, "length": 16384, "depth": 0.5, "trials": 3,
                "greedy_accuracy": 1.0, "greedy_correct": 3} for f in (2.0, 4.0)]
    assert trials_note(records, "greedy_accuracy") == "n = 3 trials per point, bars: 95 % Wilson interval"
    records.append({**records[0], "depth": 0.9, "trials": 5, "greedy_accuracy": 0.2, "greedy_correct": 1})
    assert trials_note(records, "greedy_accuracy").startswith("n = 3-8 trials per point")


def test_a_method_at_factor_1_is_not_titled_unpatched():
    # STRING runs at x1 (inside its window): its panel, and the heatmap named after it, must not read "unpatched".
    from hf_posext.evaluation.plots import panel_scale

    string = [{"method": "string", "label": "string", "factor": 1.0, "length": 32768, "depth": 0.0, "trials": 8,
               "greedy_accuracy": 1.0, "greedy_correct": 8, "_model": "runs/merged-run-retrieval-mixed-yarn4"}]
    none = [{**string[0], "method": "none", "label": "none", "_model": "base", "depth": d} for d in (0.0, 0.5)]
    assert panel_scale(1.0, string) == "x1" and panel_scale(1.0, none) == "unpatched" and panel_scale(4.0, string) == "x4"
    figure = line_figure(string + none, "greedy_accuracy", "accuracy", "Passkey", method_styles(["string", "none"]), rate=True)
    titles = sorted(axis.get_title() for axis in figure.axes if axis.get_visible())
    plt.close(figure)
    # a long title wraps (at a comma or parenthesis) rather than running off the figure
    assert titles == ["base, unpatched", "runs/merged-run-retrieval-mixed-yarn4, x1\n(depth 0 only)"]


def test_a_panel_pooling_fewer_depths_says_which():
    # An adapter evaluated at depth 0 only beside one evaluated at every depth: its panel must not read as "all depths".
    every = [{"method": "yarn", "label": "yarn", "factor": 4.0, "length": 32768, "depth": d, "trials": 4,
              "greedy_accuracy": 1.0, "greedy_correct": 4, "_model": "mixed"} for d in (0.0, 0.5, 1.0)]
    one = [{**every[0], "_model": "far", "greedy_accuracy": 0.75, "greedy_correct": 3}]
    figure = line_figure(every + one, "greedy_accuracy", "accuracy", "Passkey", method_styles(["yarn"]), rate=True)
    titles = sorted(axis.get_title() for axis in figure.axes if axis.get_visible())
    plt.close(figure)
    assert titles == ["far, x4 (depth 0 only)", "mixed, x4"]
    figure = line_figure(every, "greedy_accuracy", "accuracy", "Passkey", method_styles(["yarn"]), rate=True)
    assert [axis.get_title() for axis in figure.axes if axis.get_visible()] == ["mixed, x4"]
    plt.close(figure)
