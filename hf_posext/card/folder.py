"""A suite's folder: ``card.json`` read once and written once per write, earlier and running cells, combined cards.

A run, ``hf-posext report`` and a combination each read a folder's ``card.json`` once (:meth:`CardFolder.read`)
and hand what it holds on; :func:`write_card` writes ``card.json``, ``card.md``, ``card.html`` and the plots from
cells, computing the paired comparisons once. A RULER cell's numbers are always read again from its sample file,
so a card written by an older release, or while a run is still appending samples, shows every finished sample.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hf_posext.card.checks import card_cell_problem, cell_name
from hf_posext.card.render import html_card, markdown_card, write_plots
from hf_posext.card.samples import SampleResultsError, read_sample_records
from hf_posext.card.spec import row_identity
from hf_posext.card.stats import Cell, beyond_base, paired_comparisons, perplexity_cell_fields, ruler_cell_fields, sorted_cells
from hf_posext.core.errors import DamagedFileError
from hf_posext.core.files import write_text_atomic

__all__ = ["CARD_FILE", "CardFileError", "read_card_file", "CardFolder", "write_card", "rewrite_card", "combine_cards",
           "earlier_card", "merged_row_order", "in_row_order", "combined_row_order"]

#: The card's data, in its folder; ``card.md``, ``card.html`` and ``card-TASK.png`` are written beside it.
CARD_FILE = "card.json"

Cards = tuple[list[Cell], list[dict[str, str]], dict[str, Any]]


class CardFileError(DamagedFileError):
    """A ``card.json`` that cannot be read; the message names the file."""


def _not_a_card(path: Path, error: Exception) -> CardFileError:
    return CardFileError(f"{path} is not a card written by hf-posext eval suite ({type(error).__name__}: {error}); "
                         "restore card.json from version control, or delete it and run the suite again.")


def read_card_file(folder: Path) -> dict[str, Any] | None:
    """``folder``'s ``card.json`` parsed (the one place that parses it), or None where the folder holds none.

    Raises:
        CardFileError: ``card.json`` is not a card (named, with the fix).
    """
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data["settings"], dict) or not isinstance(data["cells"], list):
            raise TypeError("no settings and cells")
        return data
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise _not_a_card(path, error) from None


@dataclass
class CardFolder:
    """A suite's folder as read: ``card.json`` parsed once (``data`` None: no card there yet)."""

    folder: Path
    data: dict[str, Any] | None

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "CardFolder":
        return cls(Path(folder), read_card_file(Path(folder)))

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.data["settings"]) if self.data else {}

    def require(self) -> "CardFolder":
        """This folder, which must hold a card.

        Raises:
            FileNotFoundError: no ``card.json``.
        """
        if self.data is None:
            raise FileNotFoundError(f"{self.folder} holds no card.json; pass the --out folder of hf-posext eval suite.")
        return self

    def combined_from(self) -> list[Path] | None:
        """The folders a combined card was made from, or None for a card of one run (or no card)."""
        names = self.settings.get("combined_from")
        if names is None:
            return None
        return [Path(os.path.normpath(self.folder / name)) for name in names]

    def row_labels(self) -> list[str]:
        """The card's row labels, in its order; none where there is no card yet."""
        rows = self.settings.get("rows") or []
        return [str(row["label"]) for row in rows if isinstance(row, dict) and "label" in row]

    def seed_problem(self, seed: int) -> str | None:
        """Why a run of ``seed`` may not write into this folder (one line), or None.

        A card's RULER samples, passkeys and needle trials are drawn from its seed, and its rows are compared sample
        by sample: cells of two seeds on one card would be paired as if they were the same samples. A combined card
        has no seed of its own (the run's own checks refuse it).
        """
        earlier = self.settings.get("seed")
        if earlier is None or earlier == seed:
            return None
        path = self.folder / CARD_FILE
        return (f"--out {self.folder} holds a card of --seed {earlier} ({path}), and this run's --seed {seed} would put cells "
                f"of two seeds on it (other samples and trials, compared as if the same); pass --seed {earlier}, or give "
                "another --out.")

    @functools.cached_property
    def _cells(self) -> Cards:
        return _card_cells(self.require())

    def cells(self) -> Cards:
        """``(cells, skipped, settings)`` of the card, each RULER cell read again from its sample file (once), and the
        sample files ``card.json`` does not list yet (a cell a run is computing) as unfinished cells.

        Raises:
            FileNotFoundError: no ``card.json``, or a cell's sample file is missing.
            CardFileError: ``card.json`` is not a card, or holds numbers no run writes.
            SampleResultsError: a damaged sample file.
        """
        cells, skipped, settings = self._cells
        return [dict(cell) for cell in cells], list(skipped), dict(settings)


def _differs_from_samples(cell: Cell, fresh: Cell) -> bool:
    """Whether a RULER cell of ``card.json`` contradicts its sample file: a sample it lists with another score, or a
    k that is not the sum of its own 0/1 scores. Samples the file holds beyond the cell's (a run that went on) are
    not a contradiction; a card of an older release kept no per-sample scores and is not compared."""
    if "scores" not in cell:
        return False
    try:
        scores = {str(k): float(v) for k, v in dict(cell["scores"]).items()}
        if any(fresh["scores"].get(i, v) != v for i, v in scores.items()):
            return True
        whole = all(v in (0, 1) for v in scores.values()) and cell.get("n") == len(scores)
        return whole and "k" in cell and cell["k"] != sum(scores.values())
    except (TypeError, ValueError, AttributeError):
        return True


def _card_cells(card: CardFolder) -> Cards:
    """:meth:`CardFolder.cells`, computed."""
    folder, path, data = card.folder, card.folder / CARD_FILE, card.data
    try:
        # a cell shown as running when the card was last written is looked for again, like any unlisted file;
        # its dtype and sample count stay known (a later run into the folder may not name its task)
        cells = [dict(cell) for cell in data["cells"] if not cell.get("running")]
        listed = {Path(str(cell.get("source", ""))).name: cell for cell in data["cells"] if cell.get("running")}
        settings, skipped = dict(data["settings"]), list(data.get("skipped") or [])
        samples = int(settings["samples"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise _not_a_card(path, error) from None
    used: set[Path] = set()
    for cell in cells:
        if cell.get("kind") != "ruler":
            continue
        source = Path(str(cell.get("source", "")))
        candidates = [folder / "ruler" / source.name, source]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path}: the samples of {cell.get('row')}, {cell.get('task')} at {cell.get('length')} are not in "
                                    f"{candidates[0]} nor {source}; restore the file, or run the suite again.")
        fresh = ruler_cell_fields(read_sample_records(found), int(cell.get("samples") or samples))
        if _differs_from_samples(cell, fresh):  # the card shows what the samples say; an edit is named, not hidden
            warnings.warn(f"{path}: {cell_name(cell)}: its scores in {CARD_FILE} differ from its sample file "
                          f"{found.name} ({CARD_FILE} edited?); the card shows the sample file's", stacklevel=2)
        cell.update(fresh)
        used.add(found.resolve())
    for cell in cells:
        if cell.get("kind") == "perplexity" and not cell.get("scores"):
            cell.update(_stored_window_losses(folder, cell))
        problem = card_cell_problem(cell)  # numbers no run writes (a hand edit, a damaged file): named, never shown
        if problem:
            where = f"{cell['source']}, " if cell.get("kind") == "ruler" else ""
            raise CardFileError(f"{path}: cell {cell_name(cell)} has {problem}; restore {where}card.json from version "
                                "control, or delete it and run the suite again.")
    cells.extend(_running_cells(folder, cells, settings, used, listed))
    return cells, skipped, settings


def _stored_window_losses(folder: Path, cell: Cell) -> dict[str, Any]:
    """A perplexity cell's per-window losses from its results file, for a card written before cells carried them
    (:func:`~hf_posext.card.stats.perplexity_cell_fields`); ``{}`` where the file is gone (the cell is shown, but not
    paired). A damaged file is named (``ResultsFileError``), never read past."""
    from hf_posext.evaluation.results_files import read_results_file

    source = Path(str(cell.get("source", "")))
    found = next((c for c in (folder / "tasks" / source.name, source) if c.is_file()), None)
    if found is None:
        return {}
    return perplexity_cell_fields(read_results_file(found), cell["length"], cell.get("cell_id"), cell.get("mean"))


def _labels_by_identity(rows: dict[str, tuple[int, dict[str, Any]]]) -> dict[str, str]:
    """``{row identity: label}`` for the identities only one row has (a sample file's header keeps the identity)."""
    identities = [(row_identity(row.get("model"), row.get("report")), label) for label, (_, row) in rows.items()]
    counts = Counter(identity for identity, _ in identities)
    return {identity: label for identity, label in identities if identity is not None and counts[identity] == 1}


def _sample_header(path: Path, folder: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        first = handle.readline()
    try:
        header = json.loads(first.decode("utf-8"))
        header["row"], header["task"], header["length"] = header["row"], header["task"], int(header["length"])
        return header
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise SampleResultsError(f"{path} line 1 is not a sample file's header; move the file out of {folder / 'ruler'}.") from None


def _running_cells(folder: Path, cells: list[Cell], settings: dict[str, Any], used: set[Path],
                   listed: dict[str, Cell] | None = None) -> list[Cell]:
    """Cells of the card's rows whose sample files are not in ``card.json`` yet (the cell a run is computing,
    or one a stopped run left unfinished): shown with the samples they have, marked as unfinished.

    ``listed``: the cells ``card.json`` showed as unfinished, by their sample file's name. Such a cell keeps its
    own dtype and sample count where the card's settings (a later run's, with other tasks) do not name its task.
    """
    listed = listed or {}
    rows = {row.get("label"): (index, row) for index, row in enumerate(settings.get("rows") or [])}
    # a file written under a row's older label is found by what it measured: the model and its scaling as evaluated
    labels_by_identity = _labels_by_identity(rows)
    have = {(c["task"], c["row"], c["length"]) for c in cells}
    samples, dtypes = int(settings["samples"]), settings.get("dtypes") or {}
    running = []
    for path in sorted((folder / "ruler").glob("*.jsonl")):
        if path.resolve() in used:
            continue
        header = _sample_header(path, folder)
        label, task, length = header["row"], header["task"], header["length"]
        if label not in rows:
            label = labels_by_identity.get(row_identity(header.get("model"), header.get("report")), label)
        # another run's rows, or another dtype's samples of this card's cell, are not this card's
        earlier = listed.get(path.name) or {}
        # cards before each RULER task was keyed by name keyed them all as "ruler"
        dtype = dtypes.get(task, dtypes.get("ruler", earlier.get("dtype")))
        if label not in rows or (task, label, length) in have or header.get("dtype") != dtype:
            continue
        records = read_sample_records(path)
        if records:
            running.append(_running_cell(path, header, label, rows[label], cells, settings, records, earlier, samples))
            have.add((task, label, length))
    return running


def _running_cell(path: Path, header: dict[str, Any], label: str, placed: tuple[int, dict[str, Any]], cells: list[Cell],
                  settings: dict[str, Any], records: dict[int, dict[str, Any]], earlier: Cell, samples: int) -> Cell:
    """One unfinished cell of :func:`_running_cells`, from its sample file's header and records."""
    index, row = placed
    task, length = header["task"], header["length"]
    report = row.get("report") or {}
    base = row.get("base", next((c["base"] for c in cells if c["row"] == label),  # cards before "base" was kept
                                (report.get("method") or "none") == "none" and row.get("model") == (settings.get("models") or [None])[0]))
    wanted = int(earlier.get("samples") or samples)
    cell: Cell = {"task": task, "kind": "ruler", "row": label, "row_index": index, "length": length, "base": bool(base),
                  "in_window": length <= int(report.get("current_window") or length), "sample_key": header.get("sample_key"),
                  "source": str(path), **ruler_cell_fields(records, wanted)}
    if earlier.get("samples"):
        cell["samples"] = wanted
    if earlier.get("dtype"):
        cell["dtype"] = earlier["dtype"]
    if cell["n"] < wanted:
        cell.update(running=True, text=f"{cell['text']}, {cell['n']} of {wanted} so far")
    return cell


# ------------------------------------------------------------------ writing


def write_card(out: str | os.PathLike, cells: Sequence[Cell], skipped: Sequence[dict[str, str]],
               settings: dict[str, Any]) -> dict[str, Path]:
    """Write ``card.json``, ``card.md``, one ``card-TASK.png`` per task and ``card.html`` (self-contained), each whole
    or not at all; the paired comparisons are computed once, for all of them.

    Returns:
        ``{"json", "markdown", "html"}`` paths.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marks = beyond_base(cells)
    comparisons = paired_comparisons(cells)
    plots = write_plots(out, cells, marks)
    data = {"settings": settings, "cells": list(sorted_cells(cells)), "beyond_base_model": marks, "paired": comparisons,
            "skipped": list(skipped)}
    write_text_atomic(out / CARD_FILE, json.dumps(data, indent=1, default=str))
    write_text_atomic(out / "card.md", markdown_card(cells, skipped, comparisons) + "\n")
    write_text_atomic(out / "card.html", html_card(cells, skipped, settings, comparisons, plots))
    return {"json": out / CARD_FILE, "markdown": out / "card.md", "html": out / "card.html"}


def rewrite_card(folder: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write a card again from its folder: ``card.json``'s cells, each RULER cell read again from its sample file.

    Used by ``hf-posext report CARD_FOLDER``: a card written by an older release gains what this one shows
    (the paired comparisons), a cell shows every finished sample its file holds, and a cell still running (or
    left unfinished by a stopped run) is shown with the samples it has, marked "k of n so far". Sample files are
    only read, so this is safe beside a run that is still writing them; nothing is computed again. A combined
    card (:func:`combine_cards`) is combined again from the folders it names.

    Args:
        folder: the ``--out`` folder of ``hf-posext eval suite``.
        out: where to write (default: ``folder``).

    Returns:
        ``{"json", "markdown", "html"}`` paths.

    Raises:
        FileNotFoundError: no ``card.json`` in ``folder``, or a cell's sample file is missing.
        CardFileError: ``card.json`` is not a card.
        SampleResultsError: a damaged sample file.
    """
    card = CardFolder.read(folder).require()
    sources = card.combined_from()
    if sources is not None:
        return combine_cards(sources, out or folder)
    return write_card(out or folder, *card.cells())


# ------------------------------------------------------------------ earlier cards and row order


def merged_row_order(earlier: Sequence[str], now: Sequence[str]) -> dict[str, int]:
    """Row positions for a card that a run writes over an earlier one: the earlier card's order kept, each of the
    run's other labels right after the label before it in the run (at the top where it has none).

    A run of a subset of the rows (e.g. the extended rows at one more length) then leaves the card's rows, and
    which row of a pair comes first, where they were; a first run gets its own order.
    """
    order = list(dict.fromkeys(earlier))
    previous = None
    for label in now:
        if label not in order:
            order.insert(order.index(previous) + 1 if previous is not None else 0, label)
        previous = label
    return {label: index for index, label in enumerate(order)}


def in_row_order(cells: Sequence[Cell], settings: dict[str, Any], position: dict[str, int]) -> tuple[list[Cell], dict[str, Any]]:
    """``cells`` and ``settings["rows"]`` with rows placed by ``position`` (:func:`merged_row_order`); a label it
    lacks keeps its place after them."""
    def where(label: str, index: int) -> int:
        return position.get(label, len(position) + index)

    placed = [{**cell, "row_index": where(cell["row"], int(cell.get("row_index", 0)))} for cell in cells]
    rows = list(settings.get("rows") or [])
    rows = [row for _, row in sorted(enumerate(rows), key=lambda item: where(str(item[1].get("label")), item[0]))]
    return placed, {**settings, "rows": rows}


def earlier_card(card: CardFolder, labels: Sequence[str],
                 covered: set[tuple[str, str, int | None]]) -> tuple[list[Cell], list[dict[str, str]], list[dict[str, Any]]]:
    """What the card already in a folder shows that a new run into the same folder does not cover.

    A run writes its card over the folder's ``card.json``; without this, the cells of an earlier run with other
    tasks, rows or lengths would drop off the card while their sample files stay. They are kept instead: read
    again from their sample files, each with the ``samples`` and ``dtype`` of the run that made it.

    Args:
        card: the new run's ``--out``, as read.
        labels: the new run's row labels, in order (an earlier row of the same label takes its place; other
            earlier rows come after them).
        covered: ``(task, row label, length)`` of every cell the new run computes or skips; ``length`` None
            for every length of that task and row (the ending row's length is its prompts').

    Returns:
        ``(cells, skipped, rows)``: the earlier cells not covered, the earlier skipped entries not about a covered
        cell, and the earlier rows' settings for labels the new run does not have.

    Raises:
        ValueError: the folder holds a combined card (:func:`combine_cards`).
        CardFileError, FileNotFoundError, SampleResultsError: as :func:`rewrite_card`.
    """
    if card.data is None:
        return [], [], []
    if card.combined_from() is not None:
        raise ValueError(f"{card.folder} holds a combined card (hf-posext report A B --out {card.folder}); write the run to a "
                         "folder of its own, then combine again.")
    cells, skipped, settings = card.cells()
    samples, dtypes = int(settings["samples"]), settings.get("dtypes") or {}
    order = {label: index for index, label in enumerate(labels)}
    earlier_rows = [row for row in settings.get("rows") or [] if row.get("label") not in order]
    for row in earlier_rows:
        order[row["label"]] = len(order)
    kept = []
    for cell in cells:
        # an unfinished cell is kept too: its samples are in its file, and a run that covers it shows it until it gets there
        if (cell["task"], cell["row"], cell["length"]) in covered or (cell["task"], cell["row"], None) in covered:
            continue
        index = order.setdefault(cell["row"], len(order))
        kept.append({**cell, "row_index": index, "samples": int(cell.get("samples") or samples),
                     "dtype": cell.get("dtype") or dtypes.get(cell["task"], settings.get("dtype"))})
    about = {f"{row}: {task} at {length}" for task, row, length in covered if length is not None}
    return kept, [item for item in skipped if item.get("what") not in about], earlier_rows



def combined_row_order(parts: Sequence[tuple[Sequence[Cell], dict[str, Any]]]) -> dict[str, int]:
    """Row positions for a card combined from parts (``(cells, settings)`` each, in the order given): the base
    model's unscaled row first, then the base model's other rows (its training-free methods), then every other
    model's rows; within each, in the order the parts list them (each part's own row order, then its cells' for a
    label its ``settings["rows"]`` lacks).

    The position follows what a row is, never which tasks a part happens to hold: a part that adds a row's first
    cell on an earlier task does not move that row up the table.
    """
    seen: dict[str, int] = {}
    base_models: set[str] = set()
    base_labels: set[str] = set()
    models: dict[str, str] = {}
    for part_cells, settings in parts:
        rows = [row for row in settings.get("rows") or [] if isinstance(row, dict) and "label" in row]
        for row in rows:
            seen.setdefault(str(row["label"]), len(seen))
            if row.get("model") is not None:  # a row that names no model shares it with none
                models.setdefault(str(row["label"]), str(row["model"]))
            if row.get("base"):
                base_labels.add(str(row["label"]))
                if row.get("model") is not None:
                    base_models.add(str(row["model"]))
        for cell in sorted(part_cells, key=lambda cell: int(cell.get("row_index") or 0)):
            seen.setdefault(cell["row"], len(seen))
            if cell.get("base"):
                base_labels.add(cell["row"])

    def group(label: str) -> int:
        return 0 if label in base_labels else 1 if models.get(label) in base_models else 2

    ordered = sorted(seen, key=lambda label: (group(label), seen[label]))
    return {label: index for index, label in enumerate(ordered)}


def combine_cards(folders: Sequence[str | os.PathLike], out: str | os.PathLike) -> dict[str, Path]:
    """One card from the cards of several runs: every cell of each, read again from its sample files.

    For a card measured in parts (one run per length range, dtype or machine): rows are matched by their
    label, lengths and tasks are the union, and two rows compare on the same samples wherever one folder
    ran both. Each cell keeps the dtype its run used (``dtype`` in ``card.json``); the page lists the source
    folders with their settings. ``card.json`` names the folders relative to ``out``, so ``hf-posext report
    OUT`` combines them again (after a run in one of them has gone on). Sample files are only read.

    Args:
        folders: two or more ``--out`` folders of ``hf-posext eval suite`` (not combined cards themselves).
        out: where to write; not one of ``folders``.

    Returns:
        ``{"json", "markdown", "html"}`` paths.

    Raises:
        ValueError: fewer than two folders, ``out`` among them, a combined card among them, or one cell
            (task, row, length) in two of them.
        FileNotFoundError, CardFileError, SampleResultsError: as :func:`rewrite_card`, naming the folder.
    """
    paths = [Path(f) for f in folders]
    out = Path(out)
    if len(paths) < 2:
        raise ValueError(f"combining cards needs two or more card folders, got {len(paths)}; pass one folder to write its card again.")
    if len({p.resolve() for p in paths}) < len(paths):
        raise ValueError("a card folder is named twice; name each folder once.")
    if out.resolve() in {p.resolve() for p in paths}:
        raise ValueError(f"--out {out} is one of the folders combined; write the combined card to a folder of its own.")
    parts = []
    for folder in paths:
        card = CardFolder.read(folder).require()
        if card.combined_from() is not None:
            raise ValueError(f"{folder} is a combined card; combine the folders it names instead.")
        parts.append((folder, *card.cells()))
    labels = combined_row_order([(part_cells, settings) for _, part_cells, _, settings in parts])
    where: dict[tuple[str, str, int], Path] = {}
    cells: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    sources = []
    for folder, part_cells, part_skipped, settings in parts:
        dtypes = settings.get("dtypes") or {}
        for cell in part_cells:
            key = (cell["task"], cell["row"], cell["length"])
            if key in where:
                raise ValueError(f"{cell['row']}: {cell['task']} at {cell['length']} is in both {where[key]} and {folder}; "
                                 "combine folders that hold different cells (move one run's card out of the list).")
            where[key] = folder
            cells.append({**cell, "row_index": labels[cell["row"]], "dtype": dtypes.get(cell["task"], settings.get("dtype")),
                          "card": str(folder)})
        # one entry per thing skipped: the first folder's word on it (a later run may give a task another reason)
        skipped += [item for item in part_skipped if item.get("what") not in {earlier.get("what") for earlier in skipped}]
        sources.append({"folder": str(folder), "settings": settings})
    settings = {"combined_from": [os.path.relpath(folder.resolve(), out.resolve()) for folder in paths],
                "partial": any(bool(s["settings"].get("partial")) or any(c.get("running") for c in part[1])
                               for s, part in zip(sources, parts)),
                "sources": sources}
    return write_card(out, cells, skipped, settings)
