"""How do a card's RULER answers fail? Sorts every sample's response by its shape, per row and length.

    python bench/ruler_responses.py                              # ruler_fwe over bench/results/card
    python bench/ruler_responses.py --task niah_multikey_2 --out -

A score says how often a row is right; this says what it writes when it is wrong. Each response of the card's sample
files (``FOLDER/*/ruler/TASK-*.jsonl``, the files ``hf-posext eval card`` writes, one per row, task, length and
dtype) is put in one class:

* ``counting``: a numbered list with nothing in it (`` 1. 2. 3. 4. ...``), the model counting instead of answering;
* ``empty``: no word at all;
* ``one word``: one distinct word (of 3 or more letters), however often repeated;
* ``several words``: more than one.

For each file: the samples, the mean score, the samples in each class, and the mean score of the samples that are
not ``counting``, which says what the row scores where it answers at all. Reads the committed sample files only; no
model is loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

CLASSES = ("counting", "empty", "one word", "several words")
_NUMBERED_ONLY = re.compile(r"\s*(\d+\s*\.\s*){3,}\d*\s*\.?\s*")
_WORD = re.compile(r"[A-Za-z]{3,}")


def response_class(response: str) -> str:
    """The class of one response (:data:`CLASSES`)."""
    if _NUMBERED_ONLY.fullmatch(response):
        return "counting"
    words = {word.lower() for word in _WORD.findall(response)}
    if not words:
        return "empty"
    return "one word" if len(words) == 1 else "several words"


def summarize_file(path: Path) -> dict[str, Any] | None:
    """One sample file's row, length, dtype, samples and classes (None: no scored sample yet)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    samples = []
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a killed run (the card redoes it)
            continue
        if "score" in record:
            samples.append(record)
    if not samples:
        return None
    classes = [response_class(str(record.get("response", ""))) for record in samples]
    answering = [record["score"] for record, kind in zip(samples, classes) if kind != "counting"]
    return {
        "file": str(path), "row": header.get("row"), "task": header.get("task"), "length": header.get("length"),
        "dtype": header.get("dtype"), "device": header.get("device"), "samples": len(samples),
        "mean": round(sum(record["score"] for record in samples) / len(samples), 4),
        "classes": {kind: classes.count(kind) for kind in CLASSES},
        "mean_without_counting": round(sum(answering) / len(answering), 4) if answering else None,
        "counting_docs": [record.get("doc_id") for record, kind in zip(samples, classes) if kind == "counting"],
    }


def summarize(folder: Path, task: str) -> list[dict[str, Any]]:
    """Every sample file of ``task`` under ``folder``, sorted by row, length and file."""
    found = [summarize_file(path) for path in sorted(folder.glob(f"*/ruler/{task}-*.jsonl"))]
    return sorted((item for item in found if item), key=lambda item: (str(item["row"]), int(item["length"]), item["file"]))


def markdown(items: list[dict[str, Any]], folder: Path, task: str) -> str:
    lines = [f"# How `{task}` answers fail: the responses of every sample file under `{folder}`", "",
             f"`python bench/ruler_responses.py --folder {folder} --task {task}`. Classes: "
             "counting (a numbered list with nothing in it), empty (no word), one word (one distinct word, however "
             "often), several words. \"without counting\": the mean score of the samples that are not counting.", "",
             "| row | length | dtype | n | mean | counting | empty | one word | several words | mean without counting | file |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for item in items:
        classes = item["classes"]
        without = "" if item["mean_without_counting"] is None else f"{item['mean_without_counting']:.2f}"
        relative = Path(item["file"]).relative_to(folder) if Path(item["file"]).is_relative_to(folder) else item["file"]
        lines.append(f"| {item['row']} | {item['length']} | {item['dtype']} | {item['samples']} | {item['mean']:.2f} | "
                     f"{classes['counting']} | {classes['empty']} | {classes['one word']} | {classes['several words']} | "
                     f"{without} | `{relative}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default="bench/results/card", help="a card's results folder, or a folder of them "
                        "(default: %(default)s)")
    parser.add_argument("--task", default="ruler_fwe", help="a RULER task (default: %(default)s)")
    parser.add_argument("--out", default="bench/results/ruler_responses",
                        help="folder for TASK.json and TASK.md, or - to print the table (default: %(default)s)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"--folder {folder} is not a folder; give a card's results folder (hf-posext eval card --out).", file=sys.stderr)
        return 2
    items = summarize(folder, args.task)
    if not items:
        print(f"no {args.task} sample files under {folder}/*/ruler/; run a card with --tasks {args.task} first.", file=sys.stderr)
        return 1
    table = markdown(items, folder, args.task)
    if args.out == "-":
        print(table, end="")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"{args.task}.json", json.dumps({"folder": str(folder), "task": args.task, "files": items}, indent=1)),
                       (f"{args.task}.md", table)):
        temporary = out / (name + ".tmp")
        temporary.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
        temporary.replace(out / name)
    print(f"wrote {out / (args.task + '.md')} ({len(items)} sample files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
