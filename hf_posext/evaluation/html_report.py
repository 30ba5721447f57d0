"""One self-contained HTML page for a results folder: tables, plots and provenance, no server needed.

The page has inline CSS and every plot embedded as a base64 ``data:`` URI, so it opens offline from
any copy of the file. Each table cell carries a tag such as ``F2.r3``: file F2, run 3 of that file; the
provenance section lists, for each file and run, when it ran, for how long, on which device and with
which versions. A cell written before runs were recorded per cell is tagged ``r?``.
"""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any, Sequence

from hf_posext.core.files import write_text_atomic
from hf_posext.evaluation.tables import Table

__all__ = ["file_ids", "html_page", "render_html", "write_html"]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px auto; max-width: 1200px;
       color: #1b1b1b; line-height: 1.45; padding: 0 16px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.0em; margin: 1.2em 0 0.4em; }
table { border-collapse: collapse; margin: 0.4em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #d0d0d0; padding: 3px 8px; white-space: nowrap; } th { background: #f2f2f2; }
td.wrap { white-space: normal; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.method { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 0.92em; }
.src { color: #777; font-size: 0.75em; margin-left: 4px; }
.reused { color: #a05a00; font-size: 0.75em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.85em; }
.note { color: #555; font-size: 0.9em; }
code { background: #f4f4f4; padding: 0 3px; }
"""


def file_ids(runs: Sequence[dict[str, Any]]) -> dict[str, str]:
    """``results file path -> F1, F2, ...`` in the order of ``runs``."""
    return {run.get("_file", ""): f"F{i + 1}" for i, run in enumerate(runs)}


def _source_tag(sources: Sequence[tuple[str, int | None]], ids: dict[str, str]) -> str:
    by_file: dict[str, list[str]] = {}
    for file, run in sources:
        by_file.setdefault(ids.get(file, "F?"), []).append("r?" if run is None else f"r{run}")
    return "; ".join(f"{file}.{','.join(dict.fromkeys(tags))}" for file, tags in by_file.items())


def _table_html(table: Table, ids: dict[str, str]) -> str:
    head = "".join(f"<th>{n}</th>" for n in table.lengths)
    rows = []
    for name, cells in table.rows:
        parts = [f'<td class="method">{html.escape(name)}</td>']
        for length in table.lengths:
            cell = cells.get(length)
            if cell is None:
                parts.append('<td class="num"></td>')
                continue
            reused = (f'<br><span class="reused">= {html.escape(", ".join(cell.reused_from))}</span>' if cell.reused_from else "")
            parts.append(f'<td class="num">{html.escape(cell.text)}<span class="src">{html.escape(_source_tag(cell.sources, ids))}</span>'
                         f"{reused}</td>")
        rows.append("<tr>" + "".join(parts) + "</tr>")
    return (f"<h3>{html.escape(table.title)}</h3>\n<table><thead><tr><th>method</th>{head}</tr></thead><tbody>\n"
            + "\n".join(rows) + "\n</tbody></table>")


def _version_cell(key: str, value: Any) -> str:
    css = ' class="wrap"' if key == "platform" else ""
    return f"<td{css}>{html.escape(str(value))}</td>"


def _provenance_html(runs: Sequence[dict[str, Any]], ids: dict[str, str]) -> str:
    keys = ("device", "hf_posext", "torch", "transformers", "accelerate", "python", "platform")
    parts = []
    for run in runs:
        file = run.get("_file", "")
        config = ", ".join(f"{k}={v}" for k, v in sorted(run["config"].items()) if k not in ("task",))
        rows = []
        for index, info in enumerate(run.get("runs") or []):
            versions = info.get("versions") or {}
            rows.append("<tr>" + f"<td>r{index}</td><td>{html.escape(str(info.get('started', '')))}</td>"
                        f"<td class=\"num\">{html.escape(str(info.get('seconds', '')))}</td>"
                        + "".join(_version_cell(k, versions.get(k, "")) for k in keys) + "</tr>")
        unrecorded = sum(1 for record in run["cells"].values() if record.get("run") is None)
        tagged = [record["run"] for record in run["cells"].values() if record.get("run") is not None]
        first_tagged = min(tagged) if tagged else 0
        earlier = (run.get("runs") or [])[:first_tagged] or (run.get("runs") or [])  # none before it: any run
        devices = sorted({str((info.get("versions") or {}).get("device", "?")) for info in earlier})
        scope = f"r0-r{first_tagged - 1}, the runs before the first whose cells name their run" if first_tagged else "the runs above"
        note = (f'<p class="note">{unrecorded} cell(s) tagged r? were written before each cell recorded its run: they come '
                f"from {scope} (devices: {html.escape(', '.join(devices) or 'not recorded')}); which one is not recorded.</p>"
                if unrecorded else "")
        parts.append(
            f"<h3>{ids.get(file, 'F?')}: <code>{html.escape(Path(file).name)}</code> ({html.escape(run['task'])}, "
            f"{len(run['cells'])} cells)</h3>\n<p class=\"note\">config: {html.escape(config)}</p>\n"
            "<table><thead><tr><th>run</th><th>started</th><th>seconds</th>" + "".join(f"<th>{k}</th>" for k in keys)
            + "</tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>" + note)
    return "\n".join(parts)


def _image_html(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(path.name)}</figcaption></figure>")


def render_html(title: str, runs: Sequence[dict[str, Any]], tables: Sequence[Table], plots: Sequence[Path]) -> str:
    """The page as a string: title, tables with source tags, plots inline, provenance per file and run."""
    ids = file_ids(runs)
    body = [f"<h1>{html.escape(title)}</h1>",
            '<p class="note">Each number is tagged with the results file and run that computed it (F2.r3: file F2, run 3; '
            "see Provenance); “= X” marks a cell reused from method X because both compute the same function at that "
            "length. Blank: not run.</p>",
            "<h2>Tables</h2>"]
    body += [_table_html(table, ids) for table in tables]
    if plots:
        body.append("<h2>Plots</h2>")
        body += [_image_html(Path(path)) for path in plots]
    body += ["<h2>Provenance</h2>", _provenance_html(runs, ids)]
    return html_page(title, body)


def html_page(title: str, body: Sequence[str]) -> str:
    """One self-contained page: ``title`` in its head, the ``body`` parts (HTML, one a line) in this module's style.

    The results report and the suite's card (:mod:`hf_posext.card.render`) share it.
    """
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_html(path: str | os.PathLike, title: str, runs: Sequence[dict[str, Any]], tables: Sequence[Table],
               plots: Sequence[Path]) -> Path:
    """Write :func:`render_html` to ``path`` atomically (a temporary file of its own, then a rename: two writers
    never share one temporary name)."""
    path = Path(path)
    write_text_atomic(path, render_html(title, runs, tables, plots))
    return path
