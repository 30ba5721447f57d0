"""Result tables (method x length) built from result records, and their markdown form.

A table keeps, for every cell, where its numbers came from (results file and run), so that the HTML
report can show which versions and which device computed each cell.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from hf_posext.evaluation.labels import depths_note, model_name, series_name
from hf_posext.evaluation.proportions import pooled_proportion

__all__ = ["TableCell", "Table", "task_records", "models", "metric_table", "report_tables", "markdown_table", "markdown_tables"]


@dataclass(frozen=True)
class TableCell:
    """One shown number: the mean of ``values`` and the (file, run index) pairs that computed them."""

    value: float
    text: str
    sources: tuple[tuple[str, int | None], ...]
    reused_from: tuple[str, ...] = ()


@dataclass
class Table:
    """A method x length table; ``rows`` is ``[(series name, {length: cell})]`` in display order."""

    title: str
    lengths: list[int]
    rows: list[tuple[str, dict[int, TableCell]]] = field(default_factory=list)


def models(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The distinct models of ``runs`` (their ``config["model"]``), sorted."""
    return sorted({str(run["config"].get("model", "model")) for run in runs})


def _model_tags(runs: Sequence[dict[str, Any]]) -> list[str | None]:
    """Per run, the ``_model`` tag that keeps apart what must not be pooled: the model's name when ``runs``
    hold several models, and its ``dtype`` too when one model was run in several (the same trial in
    bfloat16 and in float32 is one prompt twice, not two trials)."""
    several = len(models(runs)) > 1
    dtypes: dict[str, set] = defaultdict(set)
    for run in runs:
        dtypes[str(run["config"].get("model", "model"))].add(run["config"].get("dtype"))
    tags = []
    for run in runs:
        model = str(run["config"].get("model", "model"))
        tag = model_name(model) if several else None
        if len(dtypes[model]) > 1:
            tag = f"{tag or model_name(model)} ({run['config'].get('dtype') or 'dtype not recorded'})"
        tags.append(tag)
    return tags


def task_records(runs: Sequence[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    """The cells of ``task``, each tagged with ``_file`` and ``_run``, and with ``_model`` when ``runs`` hold
    several models or one model in several dtypes (:func:`_model_tags`), so that tables and plots keep
    them apart instead of pooling them."""
    records = []
    for run, model in zip(runs, _model_tags(runs)):
        if run["task"] != task:
            continue
        for record in run["cells"].values():
            tagged = {**record, "_file": run.get("_file", ""), "_run": record.get("run")}
            if model:
                tagged["_model"] = model
            records.append(tagged)
    return records


def _order(name: str) -> tuple:
    model, _, method = name.rpartition(": ")
    return (model, method != "none", method)


def metric_table(records: Iterable[dict[str, Any]], metric: str, fmt: str, title: str, counts: bool = False) -> Table:
    """Mean of ``metric`` per (series, length) over the matching records (depths, windows).

    With ``counts`` (a success rate over trials), a cell pools the trials of its records instead:
    ``k/n [low, high]`` with the 95 % Wilson interval (:mod:`hf_posext.evaluation.proportions`), its value
    the pooled rate k/n; a cell whose records hold fewer depths than the table's adds e.g. ``(depth 0 only)``.
    """
    grouped: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        if record.get(metric) is not None:
            grouped[series_name(record)][record["length"]].append(record)
    lengths = sorted({length for by_length in grouped.values() for length in by_length})
    all_depths = sorted({float(r["depth"]) for by_length in grouped.values() for members in by_length.values()
                         for r in members if "depth" in r})
    table = Table(title, lengths)
    for name in sorted(grouped, key=_order):
        cells = {}
        for length, members in grouped[name].items():
            value = sum(float(r[metric]) for r in members) / len(members)
            text = format(value, fmt)
            pooled = pooled_proportion(members, metric) if counts else None
            if pooled is not None:
                value, text = pooled.rate, pooled.text()
                fewer = depths_note(members, all_depths, metric)  # a cell pooling fewer depths than the others says so
                text += f" ({fewer})" if fewer else ""
            sources = tuple(sorted({(r["_file"], r["_run"]) for r in members}, key=lambda s: (s[0], -1 if s[1] is None else s[1])))
            reused = tuple(sorted({origin for r in members for origin in (r.get("reused_from") or [])}))
            cells[length] = TableCell(value, text, sources, reused)
        table.rows.append((name, cells))
    return table


def _token_note(records: Sequence[dict[str, Any]]) -> str:
    per_length: dict[int, set[int]] = defaultdict(set)
    for record in records:
        if record.get("tokens") is not None:
            per_length[record["length"]].add(int(record["tokens"]))
    return ", ".join(f"{n}: {'/'.join(map(str, sorted(v)))}" for n, v in sorted(per_length.items()))


def report_tables(runs: Sequence[dict[str, Any]]) -> list[Table]:
    """The report's tables: perplexity, then passkey and needle accuracy (greedy and teacher-forced)."""
    tables = []
    perplexity = task_records(runs, "perplexity")
    if perplexity:
        tables.append(metric_table(perplexity, "ppl", ".2f",
                                   f"Perplexity (lower is better; scored tokens per length {_token_note(perplexity)})"))
    for task, name in (("passkey", "Passkey"), ("needle", "Needle")):
        records = task_records(runs, task)
        if not records:
            continue
        pooled = "found/trials over all depths [95 % Wilson interval]"
        if any(r.get("greedy_accuracy") is not None for r in records):
            tables.append(metric_table(records, "greedy_accuracy", ".2f", f"{name} accuracy, greedy generation ({pooled})", counts=True))
        tables.append(metric_table(records, "teacher_forced_accuracy", ".2f", f"{name} accuracy, teacher-forced ({pooled})", counts=True))
    return tables


def markdown_table(table: Table) -> str:
    """``table`` as a markdown section: its title, a blank line, the table (blank: not run)."""
    lines = [f"| method | " + " | ".join(str(n) for n in table.lengths) + " |", "|---|" + "---:|" * len(table.lengths)]
    for name, cells in table.rows:
        lines.append(f"| {name} | " + " | ".join(cells[n].text if n in cells else "" for n in table.lengths) + " |")
    return table.title + "\n\n" + "\n".join(lines)


def markdown_tables(runs: Sequence[dict[str, Any]]) -> str:
    """Every :func:`report_tables` table in markdown, separated by blank lines."""
    return "\n\n".join(markdown_table(table) for table in report_tables(runs))
