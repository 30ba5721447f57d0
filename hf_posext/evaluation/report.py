"""Reports from results folders: markdown tables, CSV files, PNG plots and one self-contained HTML page.

Reads every ``*.json`` results file written by the evaluations (any mix of tasks, runs and models;
a file that cannot be used stops the report with its name, see
:mod:`hf_posext.evaluation.results_files`) and writes:

* ``perplexity.png``, ``passkey.png``, ``needle.png``: the metric against length, one panel per factor
  (and per model when the folder holds several), one colour and marker per method;
* ``passkey-heatmap[-MODEL]-xF.png``, ``needle-heatmap[-MODEL]-xF.png``: accuracy heatmaps, lengths x
  depths, one panel per method side by side, one colour scale (``-none`` for an unpatched-only group);
* ``report.md``: the tables in markdown; ``report.html``: tables, plots and per-cell provenance in one
  file that opens offline. Pairs of series given as ``comparisons`` add a table per retrieval task of the
  trials only one of them found, with the exact sign test (:mod:`hf_posext.evaluation.paired`).
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from hf_posext.core.files import check_output_folder, write_text_atomic
from hf_posext.evaluation.html_report import write_html
from hf_posext.evaluation.labels import model_name, short_label
from hf_posext.evaluation.paired import comparison_tables
from hf_posext.evaluation.plots import heatmap_figure, line_figure, method_styles, panel_groups, panel_scale, save_figure
from hf_posext.evaluation.results_files import load_results
from hf_posext.evaluation.tables import markdown_table, markdown_tables, models, report_tables, task_records

__all__ = ["load_results", "write_csv", "markdown_tables", "write_plots", "write_report"]

_CSV_COLUMNS = ("task", "method", "label", "factor", "length", "depth", "ppl", "nll", "tokens", "windows", "skipped_documents",
                "trials", "greedy_correct", "greedy_accuracy", "teacher_forced_correct", "teacher_forced_accuracy", "answer_token_accuracy", "beyond_window", "seconds", "reused_from")
_TASK_TITLES = {"perplexity": "Perplexity", "passkey": "Passkey", "needle": "Needle"}


def _rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for record in run["cells"].values():
        row = {key: record.get(key) for key in _CSV_COLUMNS}
        row["task"] = run["task"]
        if isinstance(row["reused_from"], list):
            row["reused_from"] = ";".join(row["reused_from"])
        rows.append(row)
    return sorted(rows, key=lambda r: (str(r["label"]), r["length"] or 0, r["depth"] if r["depth"] is not None else -1))


def write_csv(run: dict[str, Any], path: str | os.PathLike) -> None:
    """One CSV row per cell of ``run`` (a results JSON as a dict), written atomically."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=_CSV_COLUMNS)
    writer.writeheader()
    for row in _rows(run):
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    write_text_atomic(path, buffer.getvalue(), newline="")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def _subject(records: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]) -> str:
    """The model the records show, or ``N models`` (counted in the records, not the folder)."""
    shown = sorted({r.get("_model") for r in records if r.get("_model")})
    if len(shown) > 1:
        return f"{len(shown)} models"
    if shown:
        return shown[0]
    names = models(runs)
    return model_name(names[0]) if len(names) == 1 else "model"


def _accuracy_metric(records: Sequence[dict[str, Any]]) -> str:
    return "greedy_accuracy" if all(r.get("greedy_accuracy") is not None for r in records) else "teacher_forced_accuracy"


def write_plots(runs: Sequence[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """Write the PNG plots for ``runs`` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_task = {task: task_records(runs, task) for task in _TASK_TITLES}
    styles = method_styles(short_label(r.get("label") or r["method"]) for records in by_task.values() for r in records)
    written: list[Path] = []
    if by_task["perplexity"]:
        records = by_task["perplexity"]
        figure = line_figure(records, "ppl", "perplexity (log scale)", f"Perplexity against length: {_subject(records, runs)}",
                             styles, log_y=True)
        written.append(save_figure(figure, out / "perplexity.png"))
    for task in ("passkey", "needle"):
        records = by_task[task]
        if not records:
            continue
        metric = _accuracy_metric(records)
        scoring = "greedy generation" if metric == "greedy_accuracy" else "teacher-forced"
        figure = line_figure(records, metric, "accuracy (found/trials, all depths)",
                             f"{_TASK_TITLES[task]} accuracy against length ({scoring}): {_subject(records, runs)}", styles,
                             rate=True)
        written.append(save_figure(figure, out / f"{task}.png"))
        if len({r["depth"] for r in records}) < 2 and task != "needle":
            continue
        several = len({r.get("_model") for r in records}) > 1
        for (model, factor), group in panel_groups(records).items():
            scale = "none" if panel_scale(factor, group) == "unpatched" else f"x{factor:g}"
            name = f"{task}-heatmap{'-' + _slug(model) if several and model else ''}-{scale}.png"
            subject = model or _subject(group, runs)
            title = f"{_TASK_TITLES[task]} accuracy ({scoring}) by length and depth: {subject}, {scale}"
            written.append(save_figure(heatmap_figure(group, metric, title), out / name))
    return written


def write_report(folder: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 comparisons: Iterable[tuple[str, str]] = ()) -> tuple[str, list[Path]]:
    """Tables (returned, and in ``report.md``), plots and ``report.html`` for the results in ``folder``.

    Every results file is read and checked, and every comparison resolved, before anything is written.

    Args:
        folder: a results folder.
        out_dir: where to write (default: ``folder``).
        comparisons: pairs of series names, as the tables show them, to compare on the trials both ran.

    Returns:
        ``(markdown, plot paths)``.
    """
    runs = load_results(folder)
    tables = report_tables(runs) + comparison_tables(runs, list(comparisons))
    out = Path(out_dir) if out_dir else Path(folder)
    check_output_folder(out, "--out", "the report")
    markdown = "\n\n".join(markdown_table(table) for table in tables)
    plots = write_plots(runs, out)
    write_text_atomic(out / "report.md", markdown + "\n")
    title = f"hf-posext results: {Path(folder).resolve().name} ({', '.join(model_name(m) for m in models(runs))})"
    write_html(out / "report.html", title, runs, tables, plots)
    return markdown, plots
