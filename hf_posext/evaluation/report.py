"""Reports from results folders: markdown tables, CSV files and PNG plots.

Reads every ``*.json`` results file written by the evaluations (any mix of tasks and runs) and writes:

* ``perplexity.png``: perplexity vs length, one line per method (log scale);
* ``passkey.png``: passkey accuracy vs length, one line per method;
* ``needle-<method>.png`` (and ``passkey-heatmap-<method>.png``): accuracy heatmaps, length x depth;
* ``report.md``: the same numbers as markdown tables.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

__all__ = ["load_results", "write_csv", "markdown_tables", "write_plots", "write_report"]

_CSV_COLUMNS = ("task", "method", "label", "factor", "length", "depth", "ppl", "nll", "tokens", "windows", "skipped_documents",
                "trials", "greedy_accuracy", "teacher_forced_accuracy", "answer_token_accuracy", "beyond_window", "seconds", "reused_from")


def load_results(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """Every results file (``{"task", "config", "cells"}`` JSON) directly in ``folder``, sorted by name.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: it holds no results file.
    """
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"Results folder {path} does not exist; pass the --out folder of an evaluation run.")
    runs = []
    for file in sorted(path.glob("*.json")):
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "task" in data and "cells" in data:
            data["_file"] = str(file)
            runs.append(data)
    if not runs:
        raise ValueError(f"{path} holds no evaluation results (*.json written by hf-posext eval).")
    return runs


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
    """One CSV row per cell of ``run`` (a results JSON as a dict)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=_CSV_COLUMNS)
        writer.writeheader()
        for row in _rows(run):
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def _method_key(record: dict[str, Any]) -> str:
    label = record.get("label") or record["method"]
    key = label if record["method"] == "none" else f"{label} x{record['factor']:g}"
    model = record.get("_model")
    return f"{model}: {key}" if model else key


def _model_name(model: Any) -> str:
    """A short, still distinct name for a model: the last two parts of a path, else the name as given."""
    parts = [part for part in str(model).replace("\\", "/").split("/") if part not in ("", ".")]
    return "/".join(parts[-2:]) if len(parts) > 2 else str(model)


def _models(runs: list[dict[str, Any]]) -> list[str]:
    return sorted({str(run["config"].get("model", "model")) for run in runs})


def _by_method_length(records: Iterable[dict[str, Any]], metric: str) -> dict[str, dict[int, list[float]]]:
    table: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        value = record.get(metric)
        if value is not None:
            table[_method_key(record)][record["length"]].append(float(value))
    return table


def _task_records(runs: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """The cells of ``task``; when ``runs`` hold more than one model, each is tagged with its model so
    that the tables and plots keep the models apart instead of averaging them."""
    several = len(_models(runs)) > 1
    records = []
    for run in runs:
        if run["task"] != task:
            continue
        model = _model_name(run["config"].get("model", "model")) if several else None
        records.extend({**record, "_model": model} if model else record for record in run["cells"].values())
    return records


def _is_unpatched(key: str) -> bool:
    return key == "none" or key.endswith(": none")


def _format_table(table: dict[str, dict[int, list[float]]], fmt: str, title: str) -> str:
    lengths = sorted({length for row in table.values() for length in row})
    lines = [f"| {title} | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for method in sorted(table, key=lambda m: (m.rsplit(": ", 1)[0] if ": " in m else "", not _is_unpatched(m), m)):
        cells = []
        for length in lengths:
            values = table[method].get(length)
            cells.append(format(sum(values) / len(values), fmt) if values else "")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_tables(runs: list[dict[str, Any]]) -> str:
    """Markdown tables: perplexity (method x length), passkey and needle accuracy (mean over depths)."""
    sections = []
    perplexity = _task_records(runs, "perplexity")
    if perplexity:
        tokens = _by_method_length(perplexity, "tokens")
        per_length: dict[int, set[int]] = {}
        for by_length in tokens.values():
            for length, values in by_length.items():
                per_length.setdefault(length, set()).update(int(v) for v in values)
        note = ", ".join(f"{n}: {'/'.join(map(str, sorted(v)))}" for n, v in sorted(per_length.items()))
        sections.append("Perplexity (lower is better; scored tokens per length " + note + ")\n\n" + _format_table(_by_method_length(perplexity, "ppl"), ".2f", "method"))
    for task, name in (("passkey", "Passkey"), ("needle", "Needle")):
        records = _task_records(runs, task)
        if not records:
            continue
        if any(r.get("greedy_accuracy") is not None for r in records):
            sections.append(f"{name} accuracy, greedy generation (mean over depths and trials)\n\n" + _format_table(_by_method_length(records, "greedy_accuracy"), ".2f", "method"))
        sections.append(f"{name} accuracy, teacher-forced (mean over depths and trials)\n\n" + _format_table(_by_method_length(records, "teacher_forced_accuracy"), ".2f", "method"))
    return "\n\n".join(sections)


def _heatmap(records: list[dict[str, Any]], metric: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    grid = [[math.nan] * len(lengths) for _ in depths]
    for r in records:
        if r.get(metric) is not None:
            grid[depths.index(r["depth"])][lengths.index(r["length"])] = r[metric]
    figure, axis = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    image = axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    axis.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    axis.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    axis.set_xlabel("length (tokens)")
    axis.set_ylabel("depth")
    axis.set_title(title, fontsize=9)
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not math.isnan(grid[i][j]):
                axis.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=7)
    figure.colorbar(image, ax=axis)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _line_plot(table: dict[str, dict[int, list[float]]], ylabel: str, title: str, path: Path, log: bool, windows: set[int]) -> None:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for method in sorted(table, key=lambda m: (m.rsplit(": ", 1)[0] if ": " in m else "", not _is_unpatched(m), m)):
        points = sorted((n, sum(v) / len(v)) for n, v in table[method].items() if v)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    for window in sorted(windows):
        axis.axvline(window, color="grey", linestyle=":", linewidth=1)
    axis.set_xscale("log", base=2)
    if log:
        axis.set_yscale("log")
    axis.set_xlabel("length (tokens); dotted: original window")
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _windows(runs: list[dict[str, Any]], task: str) -> set[int]:
    return {r["supported_window"] for r in _task_records(runs, task) if r["method"] == "none" and r.get("supported_window")}


def write_plots(runs: list[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """Write the PNG plots for ``runs`` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    models = _models(runs)
    model = models[0] if len(models) == 1 else f"{len(models)} models"
    perplexity = _task_records(runs, "perplexity")
    if perplexity:
        path = out / "perplexity.png"
        _line_plot(_by_method_length(perplexity, "ppl"), "perplexity", f"Perplexity vs length ({model})", path, True, _windows(runs, "perplexity"))
        written.append(path)
    for task in ("passkey", "needle"):
        records = _task_records(runs, task)
        if not records:
            continue
        metric = "greedy_accuracy" if all(r.get("greedy_accuracy") is not None for r in records) else "teacher_forced_accuracy"
        path = out / f"{task}.png"
        _line_plot(_by_method_length(records, metric), metric.replace("_", " "), f"{task} ({model})", path, False, _windows(runs, task))
        written.append(path)
        by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in records:
            by_method[_method_key(record)].append(record)
        if len({r["depth"] for r in records}) > 1 or task == "needle":
            for method, method_records in sorted(by_method.items()):
                name = re.sub(r"[^A-Za-z0-9._-]+", "-", method.replace(" ", "").replace(":", "-"))
                path = out / (f"needle-{name}.png" if task == "needle" else f"passkey-heatmap-{name}.png")
                _heatmap(method_records, metric, f"{task} {metric.replace('_', ' ')}: {method}", path)
                written.append(path)
    return written


def write_report(folder: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> tuple[str, list[Path]]:
    """Tables (printed and in ``report.md``) and plots for the results in ``folder``.

    Returns:
        ``(markdown, plot paths)``.
    """
    runs = load_results(folder)
    out = Path(out_dir) if out_dir else Path(folder)
    markdown = markdown_tables(runs)
    plots = write_plots(runs, out)
    (out / "report.md").write_text(markdown + "\n")
    return markdown, plots
