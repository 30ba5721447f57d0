"""The suite as a reader sees it: the markdown table, one plot per task and one self-contained HTML page.

The page is :mod:`hf_posext.evaluation.html_report`'s (:func:`~hf_posext.evaluation.html_report.html_page`: its
style, plots embedded as ``data:`` URIs, so it opens offline from any copy). Nothing here reads or writes
``card.json``: :mod:`hf_posext.card.folder` hands the cells, and the paired comparisons computed once, to these
functions.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any, Sequence

from hf_posext.card.spec import BEYOND_BASE_THRESHOLD, ENDING_BUDGET
from hf_posext.card.stats import Cell, Comparison, base_reference, beyond_base, paired_comparisons, sorted_cells, unmarked_note
from hf_posext.evaluation.html_report import html_page
from hf_posext.evaluation.labels import format_length
from hf_posext.evaluation.plots import layout_problems, save_figure

__all__ = ["PAIRED_CAPTION", "ENDING_PAIRED_CAPTION", "ending_caption", "markdown_card", "html_card", "sample_counts_text",
           "card_figure", "write_plots", "PLOTTED_FIELDS"]



#: How the paired table reads (markdown and HTML).
PAIRED_CAPTION = ("Paired samples (RULER), trials (passkey, needle: the same seeded trials) and windows (perplexity: the "
                  "same windows of the same text): the samples on which the first row did better (a higher score; for "
                  "perplexity a lower loss) : those on which the second did, of the samples both ran (ties count in "
                  "neither); exact two-sided sign test.")


def _paired_table(comparisons: Sequence[Comparison]) -> tuple[list[int], list[tuple[str, str, dict[int, str]]]]:
    lengths = sorted({c["length"] for c in comparisons})
    lines: dict[tuple[str, str], dict[int, str]] = {}
    for c in comparisons:
        lines.setdefault((c["task"], f"{c['first']} vs {c['second']}"), {})[c["length"]] = c["text"]
    return lengths, [(task, pair, texts) for (task, pair), texts in lines.items()]


def ending_caption(cells: Sequence[Cell]) -> str:
    """What the chat-ending table shows (its prompts' length is not one of the card's lengths)."""
    longest = max(c["length"] for c in cells)
    return (f"Chat endings: short instructions in each model's own chat template (prompt and answer within {longest} "
            f"tokens, at most {ENDING_BUDGET} generated); the answers that end with the end-of-turn token, of those "
            "where the base model's answer ends how many end here too, and the mean generated tokens an answer (an answer "
            "that ends may still be terse or empty: read the records).")


def _ending_rows(cells: Sequence[Cell]) -> list[tuple[str, str]]:
    """``(row, text)`` of the ending cells, in row order."""
    return [(c["row"], c["text"]) for c in sorted(cells, key=lambda c: c["row_index"])]


#: How the chat endings' pairs read (markdown and HTML).
ENDING_PAIRED_CAPTION = ("Paired on the same instructions: the answers only the first row ended : those only the second "
                         "ended, of the instructions both answered; exact two-sided sign test.")


def _ending_pairs(comparisons: Sequence[Comparison]) -> list[tuple[str, str]]:
    """``(pair, text)`` of the chat endings' paired comparisons."""
    return [(f"{c['first']} vs {c['second']}", c["text"]) for c in comparisons if c["task"] == "ending"]




def _score_table(cells: Sequence[Cell]) -> tuple[list[int], list[tuple[str, str, list[str]]]]:
    """The main table: its lengths, and ``(task, row, texts by length)`` for each (task, row), in card order."""
    lengths = sorted({c["length"] for c in cells})
    by_key = {(c["task"], c["row"], c["length"]): c for c in cells}
    lines: dict[tuple[str, str], list[str]] = {}
    for cell in sorted_cells(cells):
        if (cell["task"], cell["row"]) not in lines:
            lines[(cell["task"], cell["row"])] = [by_key[(cell["task"], cell["row"], n)]["text"]
                                                  if (cell["task"], cell["row"], n) in by_key else "" for n in lengths]
    return lengths, [(task, row, texts) for (task, row), texts in lines.items()]


def markdown_card(cells: Sequence[Cell], skipped: Sequence[dict[str, str]] = (),
                  comparisons: Sequence[Comparison] | None = None) -> str:
    """The card as markdown: one table, task × row × length, then the chat endings and the paired comparisons.

    Args:
        cells: the card's cells.
        skipped: ``{"what", "reason"}`` of each thing the run skipped.
        comparisons: :func:`~hf_posext.card.stats.paired_comparisons` of ``cells`` where the caller has them
            (computed here otherwise).
    """
    marks = beyond_base(cells)
    comparisons = paired_comparisons(cells) if comparisons is None else comparisons
    ending_cells = [c for c in cells if c.get("kind") == "ending"]
    table_cells = [c for c in cells if c.get("kind") != "ending"]
    lengths, table = _score_table(table_cells)
    lines = ["| task | row | " + " | ".join(format_length(n) for n in lengths) + " |", "|---|---|" + "---:|" * len(lengths)] if table else []
    for task, row, texts in table:
        lines.append(f"| {task + (' (beyond the base model)' if marks.get(task) else '')} | {row} | " + " | ".join(texts) + " |")
    if note := unmarked_note(marks):
        lines += ["", note]
    if ending_cells:
        lines += ["", ending_caption(ending_cells), "", "| row | answers that end |", "|---|---:|"]
        lines += [f"| {row} | {text} |" for row, text in _ending_rows(ending_cells)]
        if ending_pairs := _ending_pairs(comparisons):
            lines += ["", ENDING_PAIRED_CAPTION, "", "| pair | paired |", "|---|---:|"]
            lines += [f"| {pair} | {text} |" for pair, text in ending_pairs]
    others = [c for c in comparisons if c["task"] != "ending"]
    if others:
        paired_lengths, paired = _paired_table(others)
        lines += ["", PAIRED_CAPTION, "", "| task | pair | " + " | ".join(format_length(n) for n in paired_lengths) + " |",
                  "|---|---|" + "---:|" * len(paired_lengths)]
        lines += [f"| {task} | {pair} | " + " | ".join(texts.get(n, "") for n in paired_lengths) + " |" for task, pair, texts in paired]
    for item in skipped:
        lines.append(f"\nskipped: {item['what']}: {item['reason']}")
    return "\n".join(lines)


# ------------------------------------------------------------------ HTML


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]], labels: int = 1) -> str:
    """A table of escaped text: the first ``labels`` columns are labels, the others numbers (right-aligned)."""
    header = "".join(f"<th>{html.escape(name)}</th>" for name in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(text)}</td>" if index < labels else f'<td class="num">{html.escape(text)}</td>'
                                    for index, text in enumerate(row)) + "</tr>\n" for row in rows)
    return f"<table><thead><tr>{header}</tr></thead><tbody>\n{body}</tbody></table>"


def _html_scores(cells: Sequence[Cell], marks: dict[str, bool | None]) -> list[str]:
    lengths, table = _score_table(cells)
    if not table:
        return []
    head = "".join(f"<th>{format_length(n)}</th>" for n in lengths)
    rows = []
    for task, row, texts in table:
        mark = " <em>(beyond the base model)</em>" if marks.get(task) else ""
        rows.append(f"<tr><td>{html.escape(task)}{mark}</td><td>{html.escape(row)}</td>"
                    + "".join(f'<td class="num">{html.escape(text)}</td>' for text in texts) + "</tr>")
    return [f"<table><thead><tr><th>task</th><th>row</th>{head}</tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>"]


def _html_comparisons(cells: Sequence[Cell], comparisons: Sequence[Comparison]) -> list[str]:
    body = []
    ending_cells = [c for c in cells if c.get("kind") == "ending"]
    if ending_cells:
        body += ["<h2>Chat endings</h2>", f'<p class="note">{html.escape(ending_caption(ending_cells))}</p>',
                 _html_table(["row", "answers that end"], _ending_rows(ending_cells))]
        if ending_pairs := _ending_pairs(comparisons):
            body += [f'<p class="note">{html.escape(ENDING_PAIRED_CAPTION)}</p>', _html_table(["pair", "paired"], ending_pairs)]
    others = [c for c in comparisons if c["task"] != "ending"]
    if others:
        paired_lengths, paired = _paired_table(others)
        body += ["<h2>Paired samples</h2>", f'<p class="note">{html.escape(PAIRED_CAPTION)}</p>',
                 _html_table(["task", "pair", *(format_length(n) for n in paired_lengths)],
                             [[task, pair, *(texts.get(n, "") for n in paired_lengths)] for task, pair, texts in paired], labels=2)]
    return body


def _html_sources(settings: dict[str, Any], skipped: Sequence[dict[str, str]]) -> list[str]:
    body = []
    if settings.get("sources"):
        items = []
        for source in settings["sources"]:
            part = source.get("settings") or {}
            dtypes = ", ".join(f"{task} {dtype}" for task, dtype in (part.get("dtypes") or {}).items())
            items.append(f"<li>{html.escape(str(source.get('folder')))}: {html.escape(str(part.get('samples')))} samples a cell, "
                         f"lengths {html.escape(', '.join(map(str, part.get('lengths') or [])))}, device "
                         f"{html.escape(str(part.get('device')))}; {html.escape(dtypes)}</li>")
        body.append("<h2>Combined from</h2><ul>" + "".join(items) + "</ul>")
    if skipped:
        body.append("<h2>Skipped</h2><ul>" + "".join(f"<li>{html.escape(s['what'])}: {html.escape(s['reason'])}</li>" for s in skipped) + "</ul>")
    return body


def html_card(cells: Sequence[Cell], skipped: Sequence[dict[str, str]], settings: dict[str, Any],
              comparisons: Sequence[Comparison], plots: Sequence[Path]) -> str:
    """The card as one self-contained page (:func:`~hf_posext.evaluation.html_report.html_page`): the table, the chat
    endings, the paired comparisons, the sources of a combined card, what was skipped, the plots and the settings."""
    marks = beyond_base(cells)
    body = ["<h1>Report card</h1>",
            '<p class="note">k/n [95% Wilson interval] for scores that are 0 or 1 per sample; mean [95% bootstrap interval] '
            "otherwise; perplexity as a number. A task is <em>beyond the base model</em> when the base model's best score "
            f"inside its own window is below {BEYOND_BASE_THRESHOLD:.0%}.</p>"]
    if note := unmarked_note(marks):
        body.append(f'<p class="note">{html.escape(note)}</p>')
    if settings.get("partial"):
        body.append("<p><strong>Partial card:</strong> written while the run goes on; cells it has not reached show an earlier "
                    "run's samples, or are missing.</p>")
    body += _html_scores([c for c in cells if c.get("kind") != "ending"], marks)
    body += _html_comparisons(cells, comparisons)
    body += _html_sources(settings, skipped)
    for plot in plots:
        encoded = base64.b64encode(Path(plot).read_bytes()).decode()
        body.append(f'<figure><img alt="{html.escape(Path(plot).stem)}" src="data:image/png;base64,{encoded}"></figure>')
    body.append("<h2>Settings</h2><pre>" + html.escape(json.dumps(settings, indent=1, default=str)) + "</pre>")
    return html_page("hf-posext report card", body)


# ------------------------------------------------------------------ plots


def sample_counts_text(points: Sequence[Cell]) -> str:
    """A row's samples (or windows) by length for a legend: ``n=20``, or where they differ ``n=20 at 2k-16k, 10 at 32k``
    (``points`` sorted by length): never ``n=10/20``, which reads as a fraction."""
    runs: list[list[Any]] = []  # [n, first length, last length]
    for point in points:
        if runs and runs[-1][0] == point["n"]:
            runs[-1][2] = point["length"]
        else:
            runs.append([point["n"], point["length"], point["length"]])
    if len({n for n, _, _ in runs}) == 1:
        return f"n={runs[0][0]}"
    return "n=" + ", ".join(f"{n} at {format_length(first)}" + ("" if first == last else f"-{format_length(last)}")
                            for n, first, last in runs)


def card_figure(task: str, cells: Sequence[Cell], beyond: bool | None):
    """One task's plot: score (or perplexity) against length, one line per row with its interval (a band along
    the line and a bar at each point, so a single point shows its interval too), n in the legend, and the base
    model's best score inside its own window as a dashed line: the reference the card's targets name. The legend
    takes two columns below the axes, or one where two would run past the figure's edge."""
    figure = _draw_card_figure(task, cells, beyond, columns=2)
    if any("clipped" in problem for problem in layout_problems(figure)):
        import matplotlib.pyplot as plt

        plt.close(figure)
        figure = _draw_card_figure(task, cells, beyond, columns=1)
    return figure


def _draw_card_figure(task: str, cells: Sequence[Cell], beyond: bool | None, columns: int):
    """:func:`card_figure` with its legend in ``columns`` columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys(c["row"] for c in sorted(cells, key=lambda c: c["row_index"])))
    entries = len(rows) + 1  # the rows and the reference, below the axes
    figure, axis = plt.subplots(figsize=(7.2, 4.0 + 0.2 * math.ceil(entries / columns)), layout="constrained")
    metric = "perplexity" if task == "perplexity" else "score"
    markers = ("o", "s", "^", "D", "v", "P", "X")
    for index, row in enumerate(rows):
        points = sorted((c for c in cells if c["row"] == row and c.get("mean") is not None), key=lambda c: c["length"])
        if not points:
            continue
        # rows are offset sideways (a few % of a length on the log axis) so that equal scores stay visible
        shift = 2 ** ((index - (len(rows) - 1) / 2) * 0.04)
        xs, ys = [c["length"] * shift for c in points], [c["mean"] for c in points]
        line, = axis.plot(xs, ys, marker=markers[index % len(markers)], markerfacecolor="none" if index % 2 else None,
                          label=f"{row} ({sample_counts_text(points)})")
        if metric == "score" and all(c.get("low") is not None for c in points):
            lows, highs = [c["low"] for c in points], [c["high"] for c in points]
            axis.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
            axis.errorbar(xs, ys, yerr=[[y - low for y, low in zip(ys, lows)], [high - y for y, high in zip(ys, highs)]],
                          fmt="none", ecolor=line.get_color(), elinewidth=0.8, capsize=2)
    reference = base_reference(cells)
    if reference is not None:
        value, length = reference
        axis.axhline(value, color="grey", linestyle="--", linewidth=0.9,
                     label=f"base, best inside its window ({value:.2f} at {format_length(length)})")
    axis.set_xscale("log", base=2)
    lengths = sorted({c["length"] for c in cells})
    axis.set_xticks(lengths, [format_length(n) for n in lengths])
    axis.set_xlim(lengths[0] / 1.6, lengths[-1] * 1.6)  # the sideways offsets stay small next to the lengths
    axis.minorticks_off()
    axis.set_xlabel("length (tokens; rows offset sideways so that ties stay visible)")
    axis.set_ylabel(metric)
    if metric == "score":
        axis.set_ylim(-0.03, 1.03)
    axis.set_title(task + (" — beyond the base model" if beyond else ""), fontsize=11)
    axis.grid(alpha=0.3)
    handles, names = axis.get_legend_handles_labels()
    figure.legend(handles, names, loc="outside lower center", ncols=columns, fontsize=7, frameon=False)
    return figure



#: The fields of a cell that :func:`card_figure` draws (its row, place, length, score and interval, and what the
#: base model's reference line reads): a plot is drawn again only when one of them changes.
PLOTTED_FIELDS = ("task", "row", "row_index", "length", "mean", "low", "high", "n", "base", "in_window")

#: plot path -> (digest of what it shows, its mtime and size as written): a run writes its card after every sample,
#: and redrawing the plots of the tasks that did not change took three quarters of a card run's time
_DRAWN: dict[Path, tuple[str, int, int]] = {}


def _written(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def write_plots(out: Path, cells: Sequence[Cell], marks: dict[str, bool | None]) -> list[Path]:
    """``card-TASK.png`` in ``out`` for each task of ``cells`` (:func:`card_figure`), in card order.

    A plot this process drew from the same cells and mark, still on disk as it wrote it, is kept as it is."""
    from hf_posext.core.integrity import stable_digest

    plots = []
    for task in dict.fromkeys(c["task"] for c in sorted_cells(cells)):
        shown = [c for c in cells if c["task"] == task]
        drawn = [{key: c.get(key) for key in PLOTTED_FIELDS} for c in shown]  # a cell's text or timing is not drawn
        path, digest = out / f"card-{task}.png", stable_digest([task, drawn, marks.get(task)], length=None)
        if path.is_file() and _DRAWN.get(path.resolve()) == (digest, *_written(path)):
            plots.append(path)
            continue
        plots.append(save_figure(card_figure(task, shown, marks.get(task)), path, dpi=100))
        _DRAWN[path.resolve()] = (digest, *_written(path))
    return plots
