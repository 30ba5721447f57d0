"""How do a card's RULER answers fail? Sorts every sample's response by its shape, per row and length.

    python bench/ruler_responses.py                              # ruler_fwe over bench/results/card
    python bench/ruler_responses.py --task niah_multikey_2 --out -

A score says how often a row is right; this says what it writes when it is wrong. Each response of the card's sample
files (``FOLDER/*/ruler/TASK-*.jsonl``, the files ``hf-posext eval suite`` writes, one per row, task, length and
dtype) is put in one class. For the word tasks (``ruler_fwe``, ``ruler_cwe``, ``ruler_vt``):

* ``counting``: it begins with a numbered list with nothing in it (`` 1. 2. 3. 4. ...``: its first line that is not
  blank is nothing but three or more numbers, each with its dot), the model counting instead of answering, whatever
  follows on later lines (often the question again, or another made-up one: a list with nothing in it, the whole
  response, was the class's bound until 2026-12-05, and it missed those);
* ``empty``: no word at all;
* ``prompt repeated``: nothing but lines of the prompt said again (`` The three most frequently appeared words are:``,
  once or over and over): a line repeats the prompt when its first five words (three at least; a word cut off by the
  budget counts) stand in the sample's question or answer prefix, read from the card's RULER sample cache (a file
  whose samples the cache lacks never gets this class);
* ``one word``: one distinct word (of 3 or more letters), however often repeated, beside any repeated prompt lines;
* ``several words``: more than one.

For the needle tasks (``niah_*``), from the first value in the response shaped like the answer (a 7-digit number, a
UUID), read against the sample's own text (the card's RULER sample cache, ``--samples``):

* ``right``: it scored;
* ``another key's value``: a value the text gives for another key (a distractor: ``niah_multikey_*`` hide hundreds);
* ``not in the text``: a value of the answer's shape that the text never gives;
* ``no value``: nothing shaped like the answer;
* ``unread``: a wrong answer whose sample text is not in the cache (it holds fewer samples than the file).

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

CLASSES = ("counting", "empty", "prompt repeated", "one word", "several words")
NEEDLE_CLASSES = ("right", "another key's value", "not in the text", "no value")
_VALUE_SHAPES = (re.compile(r"\d{7}"), re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"))
_NUMBERED_ONLY = re.compile(r"\s*(\d+\s*\.\s*){3,}\d*\s*\.?\s*")
_WORD = re.compile(r"[A-Za-z]{3,}")


def _plain(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


def repeats_prompt(line: str, prompt: str) -> bool:
    """Whether ``line`` says the prompt again: its first five words (at least three) are a phrase of ``prompt``
    (letters only, any case; the last word may be cut off, as a generation budget leaves it)."""
    words = _plain(line).split()
    return len(words) >= 3 and f" {' '.join(words[:5])}" in f" {_plain(prompt)}"


def response_class(response: str, prompt: str | None = None) -> str:
    """The class of one response (:data:`CLASSES`); ``prompt``: its sample's question and answer prefix, without
    which ``prompt repeated`` is never given."""
    lines = response.splitlines()
    if _NUMBERED_ONLY.fullmatch(next((line for line in lines if line.strip()), "")):
        return "counting"
    kept = [line for line in lines if not (prompt and repeats_prompt(line, prompt))]
    words = {word.lower() for line in kept for word in _WORD.findall(line)}
    if not words:
        return "prompt repeated" if len(kept) < len(lines) else "empty"
    return "one word" if len(words) == 1 else "several words"


def needle_class(response: str, score: float, doc: dict[str, Any]) -> str:
    """The class of one needle-task response (:data:`NEEDLE_CLASSES`), read against its sample ``doc``."""
    if score >= 1:
        return "right"
    shape = next((pattern for pattern in _VALUE_SHAPES if all(pattern.fullmatch(str(o)) for o in doc["outputs"])), None)
    found = shape.search(response) if shape is not None else None
    if found is None:
        return "no value"
    return "another key's value" if found.group(0) in doc["input"] else "not in the text"


def _prompt(doc: dict[str, Any]) -> str:
    """A sample's question and answer prefix: the end of its input (the haystack before it is the task's text) and
    its ``gen_prefix``."""
    return str(doc.get("input", ""))[-2000:] + "\n" + str(doc.get("gen_prefix") or "")


def sample_docs(cache: Path, key: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The RULER samples the card cached under ``key`` (its sample files' ``sample_key``), or None."""
    if not key:
        return None
    pattern = f"{key['task']}-{key['length']}-seed{key['seed']}-{str(key['tokenizer'])[:8]}-*.json"
    for path in sorted(cache.glob(pattern)):
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") == key:
            return data["docs"]
    return None


def card_labels(card_folder: Path) -> dict[str, str]:
    """Sample file name -> its row's label on the card in ``card_folder`` (a file keeps the label of the run that
    started it; the card relabels rows, e.g. "fine-tuned, string ×1" became "fine-tuned, yarn ×4 + string")."""
    try:
        card = json.loads((card_folder / "card.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return {Path(cell["source"]).name: cell["row"] for cell in card.get("cells", []) if cell.get("source") and cell.get("row")}


def summarize_file(path: Path, cache: Path | None = None) -> dict[str, Any] | None:
    """One sample file's row, length, dtype, samples and classes (None: no scored sample yet). A needle task's
    responses are read against their samples in ``cache`` (without it, or without its samples: the word classes)."""
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
    # the card's cache, then the file's own card folder's; a cache may hold fewer samples than the file (a GPU
    # card's 50 beside the CPU's committed 20): a needle answer whose sample text is not found is "unread"
    caches = [folder for folder in (cache, path.parent.parent / "ruler-samples") if folder is not None]
    docs = next((found for folder in caches if (found := sample_docs(folder, header.get("sample_key") or {}))), [])
    if str(header.get("task", "")).startswith("niah"):
        names = NEEDLE_CLASSES + ("unread",)
        classes = [needle_class(str(record.get("response", "")), record["score"], docs[record["doc_id"]])
                   if record["doc_id"] < len(docs) else "right" if record["score"] >= 1 else "unread" for record in samples]
    else:
        names = CLASSES
        prompts = [_prompt(docs[record["doc_id"]]) if record.get("doc_id", len(docs)) < len(docs) else None for record in samples]
        classes = [response_class(str(record.get("response", "")), prompt) for record, prompt in zip(samples, prompts)]
    answering = [record["score"] for record, kind in zip(samples, classes) if kind != "counting"]
    return {
        "file": str(path), "row": card_labels(path.parent.parent).get(path.name) or header.get("row"), "task": header.get("task"), "length": header.get("length"),
        "dtype": header.get("dtype"), "device": header.get("device"), "samples": len(samples),
        "mean": round(sum(record["score"] for record in samples) / len(samples), 4),
        "classes": {kind: classes.count(kind) for kind in names},
        "mean_without_counting": round(sum(answering) / len(answering), 4) if answering else None,
        "counting_docs": [record.get("doc_id") for record, kind in zip(samples, classes) if kind == "counting"],
        "sample_key": header.get("sample_key"),
        "doc_classes": {str(record.get("doc_id")): kind for record, kind in zip(samples, classes)},
    }


def paired_counting(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every two files on the same samples (task, length, dtype and RULER sample key): on how many samples the
    first counts ("1. 2. 3.") and the second does not, the reverse, and the exact sign test's p of the two. Pairs where
    neither counts are left out."""
    from hf_posext.evaluation.proportions import sign_test_p_value  # here: --help must not import torch

    pairs = []
    for i, first in enumerate(items):
        for second in items[i + 1:]:
            same = ("task", "length", "dtype", "sample_key")
            if any(first.get(name) != second.get(name) for name in same) or not first.get("sample_key"):
                continue
            docs = sorted(set(first["doc_classes"]) & set(second["doc_classes"]), key=int)
            counts = [(first["doc_classes"][d] == "counting", second["doc_classes"][d] == "counting") for d in docs]
            only_first = sum(a and not b for a, b in counts)
            only_second = sum(b and not a for a, b in counts)
            both = sum(a and b for a, b in counts)
            if only_first + only_second + both == 0:
                continue
            pairs.append({"first": first["row"], "second": second["row"], "task": first["task"], "length": first["length"],
                          "dtype": first["dtype"], "samples": len(docs), "only_first": only_first, "only_second": only_second,
                          "both": both, "p": sign_test_p_value(only_first, only_second)})
    return pairs


def summarize(folder: Path, task: str, cache: Path | None = None) -> list[dict[str, Any]]:
    """Every sample file of ``task`` under ``folder``, sorted by row, length and file (``cache``: the RULER sample
    cache, for the needle tasks' classes)."""
    found = [summarize_file(path, cache) for path in sorted(folder.glob(f"*/ruler/{task}-*.jsonl"))]
    return sorted((item for item in found if item), key=lambda item: (str(item["row"]), int(item["length"]), item["file"]))


def markdown(items: list[dict[str, Any]], folder: Path, task: str) -> str:
    needle = any("right" in item["classes"] for item in items)
    names = NEEDLE_CLASSES if needle else CLASSES
    if any(item["classes"].get("unread") for item in items):
        names += ("unread",)
    explained = ("right, another key's value (a value the sample's text gives for another key), not in the text (a "
                 "value of the answer's shape the text never gives), no value, unread (a wrong answer whose sample text "
                 "the cache does not hold)" if needle else
                 "counting (a numbered list with nothing in it), empty (no word), prompt repeated (nothing but lines of "
                 "the question or answer prefix said again), one word (one distinct word, however often), several words. \"without counting\": the mean score of the samples that are not counting")
    lines = [f"# How `{task}` answers fail: the responses of every sample file under `{folder}`", "",
             f"`python bench/ruler_responses.py --folder {folder} --task {task}`. Classes: {explained}.", "",
             "| row | length | dtype | n | mean | " + " | ".join(names) + ("" if needle else " | mean without counting") + " | file |",
             "|---|---:|---|---:|---:|" + "---:|" * (len(names) + (0 if needle else 1)) + "---|"]
    for item in items:
        classes = item["classes"]
        counts = " | ".join(str(classes.get(name, 0)) for name in names)
        without = "" if needle else " | " + ("" if item["mean_without_counting"] is None else f"{item['mean_without_counting']:.2f}")
        relative = Path(item["file"]).relative_to(folder) if Path(item["file"]).is_relative_to(folder) else item["file"]
        lines.append(f"| {item['row']} | {item['length']} | {item['dtype']} | {item['samples']} | {item['mean']:.2f} | "
                     f"{counts}{without} | `{relative}` |")
    pairs = [] if needle else paired_counting(items)
    if pairs:
        lines += ["", "## Paired: who counts where the other does not", "",
                  "Two rows on the same samples (same length, dtype and RULER samples): the samples only the first row "
                  "answers with a numbered list and nothing in it, only the second, both; p: exact sign test.", "",
                  "| first row | second row | length | dtype | n | only first counts | only second counts | both | p |",
                  "|---|---|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {pair['first']} | {pair['second']} | {pair['length']} | {pair['dtype']} | {pair['samples']} | "
                  f"{pair['only_first']} | {pair['only_second']} | {pair['both']} | {pair['p']:.2g} |" for pair in pairs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folder", default="bench/results/card", help="a card's results folder, or a folder of them "
                        "(default: %(default)s)")
    parser.add_argument("--task", default="ruler_fwe", help="a RULER task (default: %(default)s)")
    parser.add_argument("--samples", help="the card's RULER sample cache, for the needle tasks' classes (default: "
                        "FOLDER/ruler-samples)")
    parser.add_argument("--out", default="bench/results/ruler_responses",
                        help="folder for TASK.json and TASK.md, or - to print the table (default: %(default)s)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"--folder {folder} is not a folder; give a card's results folder (hf-posext eval suite --out).", file=sys.stderr)
        return 2
    items = summarize(folder, args.task, Path(args.samples) if args.samples else folder / "ruler-samples")
    if not items:
        print(f"no {args.task} sample files under {folder}/*/ruler/; run a card with --tasks {args.task} first.", file=sys.stderr)
        return 1
    table = markdown(items, folder, args.task)
    if args.out == "-":
        print(table, end="")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"{args.task}.json", json.dumps({"folder": str(folder), "task": args.task, "files": items,
                                                     "pairs": paired_counting(items)}, indent=1)),
                       (f"{args.task}.md", table)):
        temporary = out / (name + ".tmp")
        temporary.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
        temporary.replace(out / name)
    print(f"wrote {out / (args.task + '.md')} ({len(items)} sample files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
