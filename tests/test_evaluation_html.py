"""The HTML report: one self-contained page (no external resource), tables with per-cell provenance, plots inline."""

import base64
import json
from html.parser import HTMLParser
from math import log

from hf_posext.evaluation.report import write_report


class _Page(HTMLParser):
    """Collects tags with their attributes, the text of headings, and table rows as lists of cell texts."""

    def __init__(self):
        super().__init__()
        self.tags, self.headings, self.rows = [], [], []
        self._heading = None
        self._row = None
        self._cell = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("h1", "h2", "h3"):
            self._heading = ""
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("h1", "h2", "h3") and self._heading is not None:
            self.headings.append(self._heading.strip())
            self._heading = None
        elif tag in ("td", "th") and self._row is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr":
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data
        if self._cell is not None:
            self._cell += data


def _record(method, factor, length, run, **metrics):
    return {"method": method, "label": method, "factor": factor, "length": length, "supported_window": 64, "run": run, **metrics}


def _versions(device, torch):
    return {"hf_posext": "0.1.0", "torch": torch, "transformers": "5.24.0", "python": "3.11.7", "platform": "Linux", "device": device}


def _folder(tmp_path):
    runs = [{"started": "2026-11-26T05:54:17", "seconds": 12.5, "versions": _versions("cpu", "2.13.0+cpu")},
            {"started": "2026-11-26T09:00:00", "seconds": 3.0, "versions": _versions("NVIDIA H200", "2.13.0+cu128")}]
    (tmp_path / "perplexity-m-1.json").write_text(json.dumps({"task": "perplexity", "config": {"model": "m"}, "runs": runs, "cells": {
        "a": _record("none", 1.0, 64, 0, ppl=10.0, nll=log(10.0), tokens=63),
        "b": _record("yarn", 2.0, 128, 1, ppl=12.5, nll=log(12.5), tokens=127),
        "c": {**_record("dynamic-yarn", 2.0, 128, 1, ppl=12.5, nll=log(12.5), tokens=127), "reused_from": ["yarn x2"]}}}))
    (tmp_path / "passkey-m-2.json").write_text(json.dumps({"task": "passkey", "config": {"model": "m"}, "runs": runs[:1], "cells": {
        f"{d}": {**_record("none", 1.0, 128, None, depth=d, trials=1, teacher_forced_accuracy=1.0, greedy_accuracy=1.0)}
        for d in (0.1, 0.9)}}))
    return tmp_path


def test_html_report_is_self_contained_with_tables_plots_and_provenance(tmp_path):
    folder = _folder(tmp_path)
    data = json.loads((folder / "perplexity-m-1.json").read_text())
    data["cells"]["d"] = _record("ntk", 2.0, 128, None, ppl=13.0, nll=log(13.0), tokens=127)  # written before runs were tagged
    (folder / "perplexity-m-1.json").write_text(json.dumps(data))
    _, plots = write_report(folder)
    page = _Page()
    page.feed((tmp_path / "report.html").read_text(encoding="utf-8"))
    # self-contained: no script, stylesheet link, frame or remote URL; every image is an embedded PNG
    assert not [tag for tag, attrs in page.tags if tag in ("script", "link", "iframe", "object", "embed")]
    assert not [attrs for _, attrs in page.tags for key in ("src", "href") if key in attrs and not attrs[key].startswith("data:")]
    images = [attrs["src"] for tag, attrs in page.tags if tag == "img"]
    assert len(images) == len(plots) == 3  # perplexity, passkey, passkey heatmap
    for src, plot in zip(images, plots):
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == plot.read_bytes()
    assert ("style", {}) in page.tags
    # the tables, each number tagged by the file (F1 passkey, F2 perplexity: sorted by name) and run that computed it
    assert "Tables" in page.headings and "Provenance" in page.headings
    assert any(h.startswith("Perplexity") for h in page.headings) and any(h.startswith("Passkey accuracy, greedy") for h in page.headings)
    assert ["method", "64", "128"] in page.rows
    assert ["none", "10.00F2.r0", ""] in page.rows
    assert ["yarn x2", "", "12.50F2.r1"] in page.rows
    assert ["dynamic-yarn x2", "", "12.50F2.r1= yarn x2"] in page.rows  # a reused cell says where from
    # k/n with its 95 % Wilson interval (2 depths x 1 trial), from cells written before runs were recorded per cell
    assert ["none", "2/2 [0.34, 1.00]F1.r?"] in page.rows
    # provenance: each run's device and versions
    header = ["run", "started", "seconds", "device", "hf_posext", "torch", "transformers", "accelerate", "python", "platform"]
    assert header in page.rows
    assert ["r0", "2026-11-26T05:54:17", "12.5", "cpu", "0.1.0", "2.13.0+cpu", "5.24.0", "", "3.11.7", "Linux"] in page.rows
    assert ["r1", "2026-11-26T09:00:00", "3.0", "NVIDIA H200", "0.1.0", "2.13.0+cu128", "5.24.0", "", "3.11.7", "Linux"] in page.rows
    assert any(h.startswith("F2: perplexity-m-1.json") for h in page.headings)
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    # untagged cells: from the runs before the first tagged one; with none before it (here r0 is tagged), any run
    assert "2 cell(s) tagged r? were written before each cell recorded its run: they come from the runs above (devices: cpu)" in text
    assert "1 cell(s) tagged r? were written before each cell recorded its run: they come from the runs above (devices: NVIDIA H200, cpu)" in text
    assert any(h.startswith("F1: passkey-m-2.json") for h in page.headings)
