"""Figures for results: accuracy heatmaps (length x depth) and metric-against-length line plots.

Every figure is built by a pure function from result records (dicts as stored in a results file,
optionally tagged with ``_model``) and returned as a matplotlib ``Figure``; :func:`save_figure` writes
it. Conventions, the same in every figure of a report:

* one colour and one marker per method label (:func:`method_styles`), ``none`` in black;
* one panel per factor (and per model when the records hold several); the unpatched ``none`` is drawn
  in every factor panel of its model as the reference;
* heatmaps: lengths across, depths down, one panel per method side by side on the same axes, one
  shared colour scale; cells a method did not run are left grey;
* line plots: the legend below the axes, the original window as a dotted line, and points of
  different methods at one length offset sideways so that equal values (ties) stay visible; a rate
  (retrieval accuracy) pools the trials of all depths at a length, k/n, with its 95 % Wilson interval
  as an error bar, and the title says how many trials each point holds (a panel whose points pool fewer
  depths than the others says which, e.g. "depth 0 only").

:func:`layout_problems` checks a figure's layout from matplotlib's own geometry (legends against
axes, texts against the figure's edge, tick labels against each other).
"""

from __future__ import annotations

import math
import os
import re
import textwrap
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from hf_posext.evaluation.labels import depths_note, format_length, short_label
from hf_posext.evaluation.proportions import Proportion, pooled_proportion

__all__ = ["wrap_label", "method_styles", "panel_groups", "panel_scale", "trials_note", "line_figure", "heatmap_figure", "layout_problems", "save_figure"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p")
_DODGE_OCTAVES = 0.05  # sideways offset between methods at one length, in octaves of the log2 length axis


def _label(record: dict[str, Any]) -> str:
    return short_label(record.get("label") or record["method"])


def wrap_label(label: str, width: int) -> str:
    """``label`` on lines of about ``width`` characters, broken after ``(`` and ``,`` (never inside a name
    unless a single name is longer than ``width``)."""
    lines: list[str] = []
    for part in re.split(r"(?<=[(,])", label):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.extend(textwrap.wrap(part, width, break_on_hyphens=False) if len(part) > width else [part])
    return "\n".join(line for line in lines if line)


def method_styles(labels: Iterable[str]) -> dict[str, tuple[Any, str, bool]]:
    """``label -> (colour, marker, filled)``: ``none`` black filled circles, the others in sorted order
    from tab10/tab20, every other one with hollow markers (so that two points at one place both show)."""
    import matplotlib

    others = sorted({label for label in labels if label != "none"})
    palette = matplotlib.colormaps["tab10" if len(others) <= 10 else "tab20"]
    styles: dict[str, tuple[Any, str, bool]] = {"none": ("black", "o", True)}
    for i, label in enumerate(others):
        styles[label] = (palette(i % palette.N), _MARKERS[(i + 1) % len(_MARKERS)], i % 2 == 0)
    return styles


def panel_groups(records: Sequence[dict[str, Any]]) -> dict[tuple[str | None, float], list[dict[str, Any]]]:
    """Records by panel, ``(model, factor)`` in order; ``none`` records join every factor panel of their model."""
    factors: dict[str | None, set[float]] = defaultdict(set)
    for record in records:
        if record["method"] != "none":
            factors[record.get("_model")].add(float(record["factor"]))
    groups: dict[tuple[str | None, float], list[dict[str, Any]]] = {}
    for model in sorted({r.get("_model") for r in records}, key=str):
        for factor in sorted(factors[model]) or [1.0]:
            groups[(model, factor)] = [r for r in records if r.get("_model") == model and (
                r["method"] == "none" or float(r["factor"]) == factor)]
    return groups


def panel_scale(factor: float, records: Sequence[dict[str, Any]]) -> str:
    """A panel's scale: ``"unpatched"`` for a factor-1 panel that holds only the unpatched model, else
    ``"x<factor>"``; a method patched at factor 1 (STRING inside its window) is not unpatched."""
    if factor == 1 and all(record["method"] == "none" for record in records):
        return "unpatched"
    return f"x{factor:g}"


def _panel_title(model: str | None, factor: float, records: Sequence[dict[str, Any]], note: str) -> str:
    scale = panel_scale(factor, records)
    title = wrap_label(f"{model}, {scale}" if model else scale, PANEL_TITLE_WIDTH)
    if not note:
        return title
    joined = f"{title} ({note})"
    return joined if len(joined.splitlines()[-1]) <= PANEL_TITLE_WIDTH else f"{title}\n({note})"


def _original_window(records: Sequence[dict[str, Any]]) -> int | None:
    """The model's original window: as recorded (the loaded model's, before any scaling), else the unpatched
    run's, else a static run's supported window / factor (results files written before records carried it)."""
    recorded = [int(record["original_window"]) for record in records if record.get("original_window")]
    if recorded:
        return min(recorded)
    for record in records:
        if record["method"] == "none" and record.get("supported_window"):
            return int(record["supported_window"])
    for record in records:
        if record.get("supported_window") and not record.get("dynamic") and record.get("factor"):
            return round(record["supported_window"] / record["factor"])
    return None


def _mean_by_length(records: Iterable[dict[str, Any]], metric: str) -> dict[int, float]:
    values: dict[int, list[float]] = defaultdict(list)
    for record in records:
        if record.get(metric) is not None:
            values[record["length"]].append(float(record[metric]))
    return {length: sum(v) / len(v) for length, v in values.items()}


def _pooled_by_length(records: Iterable[dict[str, Any]], metric: str) -> dict[int, Proportion]:
    by_length: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get(metric) is not None:
            by_length[record["length"]].append(record)
    pooled = {length: pooled_proportion(members, metric) for length, members in by_length.items()}
    return {length: p for length, p in pooled.items() if p is not None}


def trials_note(records: Sequence[dict[str, Any]], metric: str) -> str:
    """``n = 50 trials per point`` (or ``n = 15-50 ...`` when the points differ), for a rate plot's title."""
    counts = sorted({p.trials for group in panel_groups(records).values() for label in {_label(r) for r in group}
                     for p in _pooled_by_length((r for r in group if _label(r) == label), metric).values()})
    if not counts:
        return ""
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"n = {n} trials per point, bars: 95 % Wilson interval"


def _length_axis(axis, lengths: Sequence[int], window: int | None = None) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    axis.set_xscale("log", base=2)
    axis.xaxis.set_major_locator(FixedLocator(list(lengths)))
    axis.xaxis.set_minor_locator(NullLocator())
    axis.set_xticklabels([format_length(n) for n in lengths], rotation=90 if len(lengths) > 6 else 0)
    low, high = min(list(lengths) + ([window] if window else [])), max(list(lengths) + ([window] if window else []))
    axis.set_xlim(low / 2 ** 0.4, high * 2 ** 0.4)


#: Characters a panel title holds on one line before it wraps (a results folder named as the model is long).
PANEL_TITLE_WIDTH = 44

#: The smallest max/min ratio a logarithmic y axis shows (perplexity), so small differences look small.
MIN_LOG_SPAN = 1.5


def _panel_lines(axis, group: list[dict[str, Any]], metric: str, styles: dict[str, tuple[Any, str, bool]], rate: bool,
                 used: dict[str, Any]) -> list[float]:
    """One panel of :func:`line_figure`: a line per method (rates with their intervals), offset sideways.

    Adds each method's legend handle to ``used``; returns the values plotted.
    """
    from matplotlib.lines import Line2D

    plotted: list[float] = []
    labels = sorted({_label(r) for r in group}, key=lambda m: (m != "none", m))
    for i, label in enumerate(labels):
        members = [r for r in group if _label(r) == label]
        pooled = _pooled_by_length(members, metric) if rate else {}
        points = sorted({n: p.rate for n, p in pooled.items()}.items()) if pooled else sorted(_mean_by_length(members, metric).items())
        if not points:
            continue
        shift = 2 ** ((i - (len(labels) - 1) / 2) * _DODGE_OCTAVES)
        colour, marker, filled = styles[label]
        face = colour if filled else "none"
        plotted += [v for _, v in points]
        axis.plot([n * shift for n, _ in points], [v for _, v in points], color=colour, marker=marker, markersize=6,
                  markerfacecolor=face, linewidth=1.4, alpha=0.9)
        if pooled:
            intervals = [pooled[n].interval for n, _ in points]
            axis.errorbar([n * shift for n, _ in points], [v for _, v in points],
                          yerr=[[v - low for (_, v), (low, _) in zip(points, intervals)],
                                [high - v for (_, v), (_, high) in zip(points, intervals)]],
                          fmt="none", ecolor=colour, elinewidth=1.0, capsize=2.5, alpha=0.8)
        used[label] = Line2D([], [], color=colour, marker=marker, markerfacecolor=face, linewidth=1.4)
    return plotted


def _log_axis(axis) -> None:
    """A logarithmic y axis whose ticks read as plain numbers (perplexity)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.0)))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.yaxis.set_minor_formatter(NullFormatter())


def line_figure(records: Sequence[dict[str, Any]], metric: str, ylabel: str, title: str,
                styles: dict[str, tuple[Any, str, bool]], log_y: bool = False, rate: bool = False):
    """Metric against length: one panel per (model, factor), one line per method, the legend outside.

    Args:
        records: result records (one task), optionally tagged with ``_model``.
        metric: the record field to plot (averaged over depths).
        ylabel: the y axis label.
        title: the figure's title.
        styles: :func:`method_styles` of every label in the report.
        log_y: logarithmic y axis (perplexity).
        rate: the metric is a rate: the y axis spans 0 to 1 in every panel.

    Returns:
        The figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    groups = panel_groups(records)
    lengths = sorted({r["length"] for r in records})
    all_depths = sorted({float(r["depth"]) for r in records if "depth" in r and r.get(metric) is not None})
    columns = min(len(groups), 3)
    rows = math.ceil(len(groups) / columns)
    panel_width = max(3.4, 0.42 * len(lengths) + 1.2)
    labels_shown = len({_label(r) for r in records}) + 1
    width = max(panel_width * columns + 0.8, 7.0)
    legend_columns = max(1, min(labels_shown, int(width // 3.4)))
    legend_height = 0.5 + 0.36 * math.ceil(labels_shown / legend_columns)
    figure, axes = plt.subplots(rows, columns, figsize=(width, 3.0 * rows + 0.7 + legend_height), squeeze=False,
                                sharey=True, layout="constrained")
    used: dict[str, Any] = {}
    window_handle = None
    plotted: list[float] = []
    for axis, ((model, factor), group) in zip(axes.flat, groups.items()):
        plotted += _panel_lines(axis, group, metric, styles, rate, used)
        window = _original_window(group)
        if window:
            axis.axvline(window, color="grey", linestyle=":", linewidth=1.2)
            window_handle = Line2D([], [], color="grey", linestyle=":", linewidth=1.2)
        _length_axis(axis, lengths, window)
        if log_y:
            _log_axis(axis)
        if rate:
            axis.set_ylim(-0.05, 1.05)
        depths = depths_note(group, all_depths, metric) if rate else ""
        axis.set_title(_panel_title(model, factor, group, depths), fontsize=10)
        axis.set_xlabel("length (tokens)")
        axis.grid(alpha=0.3)
    positive = [v for v in plotted if v > 0 and math.isfinite(v)]
    if log_y and positive and max(positive) / min(positive) < MIN_LOG_SPAN:
        # Autoscaling would stretch a 0.1 % difference over the whole height; show at least a 1.5x span.
        centre, half = math.sqrt(min(positive) * max(positive)), math.sqrt(MIN_LOG_SPAN)
        axes.flat[0].set_ylim(centre / half, centre * half)  # the panels share their y axis
    for axis in axes.flat[len(groups):]:
        axis.set_visible(False)
    for row in axes:
        row[0].set_ylabel(ylabel)
    handles = [used[label] for label in sorted(used, key=lambda m: (m != "none", m))]
    names = [wrap_label(label, 46) for label in sorted(used, key=lambda m: (m != "none", m))]
    if window_handle is not None:
        handles.append(window_handle)
        names.append("original window")
    figure.legend(handles, names, loc="outside lower center", ncols=legend_columns, fontsize=8, frameon=False,
                  title="method (points of different methods are offset sideways, so that ties stay visible)", title_fontsize=8)
    note = trials_note(records, metric) if rate else ""
    _suptitle(figure, f"{title} ({note})" if note else title)
    return figure


def _cell_text(value: float, trials: int | None) -> str:
    if trials:
        return f"{round(value * trials)}/{trials}"
    return f"{value:.2f}"


def heatmap_figure(records: Sequence[dict[str, Any]], metric: str, title: str, max_columns: int = 5):
    """Accuracy heatmaps, lengths x depths, one panel per method on the same axes, one colour scale.

    Args:
        records: result records of one (model, factor) group (see :func:`panel_groups`), each with
            ``length``, ``depth`` and ``metric`` (a rate in [0, 1]) and ``trials``.
        metric: the record field to show.
        title: the figure's title.
        max_columns: panels per row before wrapping.

    Returns:
        The figure.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    labels = sorted({_label(r) for r in records}, key=lambda m: (m != "none", m))
    titles = {label: wrap_label(label, 44) for label in labels}
    longest = max(len(line) for title in titles.values() for line in title.splitlines())
    panel_width = max(2.7, 0.62 * len(lengths) + 0.7, 0.075 * longest + 0.3)  # 8-point titles: ~0.075 in per character
    columns = max(1, min(len(labels), max_columns, int(18 // panel_width)))
    rows = math.ceil(len(labels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(panel_width * columns + 1.1, max(3.2, (0.36 * len(depths) + 1.6) * rows + 0.6)),
                                squeeze=False, sharex=True, sharey=True, layout="constrained")
    colour_map = plt.get_cmap("RdYlGn").with_extremes(bad="#e4e4e4")
    image = None
    for axis, label in zip(axes.flat, labels):
        grid = np.full((len(depths), len(lengths)), np.nan)
        trials = np.zeros((len(depths), len(lengths)), dtype=int)
        for record in records:
            if _label(record) == label and record.get(metric) is not None:
                i, j = depths.index(record["depth"]), lengths.index(record["length"])
                grid[i, j] = record[metric]
                trials[i, j] = int(record.get("trials") or 0)
        image = axis.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap=colour_map, aspect="auto", origin="upper")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not math.isnan(grid[i, j]):
                    axis.text(j, i, _cell_text(grid[i, j], trials[i, j]), ha="center", va="center", fontsize=8)
        axis.set_title(titles[label], fontsize=8)
        axis.set_xticks(range(len(lengths)), [format_length(n) for n in lengths], rotation=90 if len(lengths) > 5 else 0)
        axis.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        axis.tick_params(labelsize=8)
    for axis in axes.flat[len(labels):]:
        axis.set_visible(False)
    for index, axis in enumerate(axes.flat[: len(labels)]):
        if index + columns >= len(labels):  # nothing below it: it shows the lengths
            axis.xaxis.set_tick_params(labelbottom=True)
            axis.set_xlabel("length (tokens)", fontsize=8)
    for row in axes:
        row[0].set_ylabel("depth (0 = start)", fontsize=8)
    bar = figure.colorbar(image, ax=axes, shrink=0.9, aspect=25)
    bar.set_label("accuracy (found / trials;\ngrey: not run)", fontsize=8)
    _suptitle(figure, title)
    return figure


def _suptitle(figure, title: str, fontsize: float = 11) -> None:
    """The figure's title, wrapped to the figure's width (about 0.55 em per character)."""
    characters = max(20, int(figure.get_figwidth() * 72 / (fontsize * 0.58)))
    figure.suptitle(textwrap.fill(title, characters), fontsize=fontsize)


def _inside(box, frame, slack: float = 1.0) -> bool:
    return box.x0 >= frame.x0 - slack and box.y0 >= frame.y0 - slack and box.x1 <= frame.x1 + slack and box.y1 <= frame.y1 + slack


def _visible_tick_labels(axis, which: str) -> list:
    ticks = axis.xaxis if which == "x" else axis.yaxis
    low, high = sorted(axis.get_xlim() if which == "x" else axis.get_ylim())
    return [tick.label1 for tick in ticks.get_major_ticks()
            if tick.label1.get_visible() and tick.label1.get_text().strip() and low <= tick.get_loc() <= high]


def layout_problems(figure) -> list[str]:
    """Layout faults of a drawn figure, from matplotlib's geometry (not pixels); empty when it is clean.

    Checks that every legend lies outside every axes and inside the figure; that titles, axis labels,
    legend texts and visible tick labels lie inside the figure (nothing clipped); that no title
    overlaps another panel; and that neighbouring tick labels do not overlap each other.
    """
    from matplotlib.text import Text

    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    frame = figure.bbox
    axes = [axis for axis in figure.axes if axis.get_visible()]
    problems = []
    legends = list(figure.legends) + [axis.get_legend() for axis in axes if axis.get_legend() is not None]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        if not _inside(box, frame):
            problems.append("a legend is clipped by the figure's edge")
        for axis in axes:
            if box.overlaps(axis.get_window_extent(renderer)):
                problems.append(f"a legend overlaps the axes {axis.get_title()!r}")
    texts: list[Text] = [text for text in figure.texts]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for text in texts + [axis.title for axis in axes]:
            if text.get_visible() and text.get_text().strip() and box.overlaps(text.get_window_extent(renderer)):
                problems.append(f"a legend overlaps the title {text.get_text()!r}")
    for axis in axes:
        texts += [axis.title, axis.xaxis.label, axis.yaxis.label]
        texts += _visible_tick_labels(axis, "x") + _visible_tick_labels(axis, "y")
    for legend in legends:
        texts += list(legend.get_texts()) + [legend.get_title()]
    for text in texts:
        if text.get_visible() and text.get_text().strip() and not _inside(text.get_window_extent(renderer), frame):
            problems.append(f"text {text.get_text()!r} is clipped by the figure's edge")
    for axis in axes:
        if axis.get_title():
            title_box = axis.title.get_window_extent(renderer)
            for other in axes:
                if other is not axis and title_box.overlaps(other.get_window_extent(renderer)):
                    problems.append(f"title {axis.get_title()!r} overlaps another panel")
                if other is not axis and other.get_title() and title_box.overlaps(other.title.get_window_extent(renderer)):
                    problems.append(f"title {axis.get_title()!r} overlaps the title {other.get_title()!r}")
        for which in ("x", "y"):
            boxes = sorted((label.get_window_extent(renderer) for label in _visible_tick_labels(axis, which)),
                           key=lambda b: b.x0 if which == "x" else b.y0)
            for left, right in zip(boxes, boxes[1:]):
                if left.overlaps(right):
                    problems.append(f"{which} tick labels of {axis.get_title()!r} overlap")
                    break
    return problems


def save_figure(figure, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``figure`` as PNG, whole or not at all (warning about any :func:`layout_problems`), and close it."""
    import matplotlib.pyplot as plt

    from hf_posext.core.files import atomic_path

    problems = layout_problems(figure)
    if problems:
        warnings.warn(f"{path}: layout problems: {'; '.join(problems)}", stacklevel=2)
    try:
        with atomic_path(path) as staged:
            figure.savefig(staged, dpi=dpi, format="png")
    finally:
        plt.close(figure)
    return Path(path)
