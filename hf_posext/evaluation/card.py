"""The report card (``hf-posext eval card``): the parts that need no harness.

A card evaluates rows (model x scaling method) at several lengths on perplexity, passkey, needle and the
six RULER tasks that lm-evaluation-harness builds offline. This module holds what is independent of the
harness: the row specs and their reader-facing labels, the RULER sample cache and its key, the
per-sample results files, the length-budget check, the short generation budget and when it must be
escalated, and the card itself (table, paired comparisons, one plot per task, one HTML page, and writing it
again from its folder). The harness side (building
RULER samples, running them through the ``hf-posext`` model) is
:mod:`hf_posext.integrations.lm_eval.card`.

Scores: a RULER sample scores in [0, 1] (the share of its answers found, lm-eval's ``string_match_all``);
a task whose samples all score 0 or 1 is shown as ``k/n`` with its Wilson interval, any other as the mean
with a percentile-bootstrap interval (2000 resamples, seeded: the same file gives the same interval).

Paired comparisons: two rows that ran a RULER task at one length on the same samples (the same sample key)
are compared sample by sample: on how many samples each scored higher than the other, and the exact
two-sided sign test on those (ties leave it; for 0/1 scores this is McNemar's exact test). That is sharper
than two overlapping intervals: 20/20 against 15/20 overlap as intervals, yet 5 samples one way and none the
other give p = 0.0625, and 6 give p = 0.031. Passkey and needle rows pair trial by trial (the same seeded trials),
perplexity rows window by window (the same windows of the same text, the lower loss counting as better).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import random
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from hf_posext.core.errors import DamagedFileError
from hf_posext.core.files import write_text_atomic
from hf_posext.core.integrity import json_digest
from hf_posext.core.grammar import looks_like_request_text, parse_request, split_top_level
from hf_posext.evaluation.card_checks import card_cell_problem, cell_name
from hf_posext.evaluation.labels import format_length
from hf_posext.evaluation.paired import window_losses
from hf_posext.evaluation.plots import layout_problems, save_figure
from hf_posext.evaluation.proportions import Proportion, sign_test_p_value
from hf_posext.user_warnings import warn_at_caller

__all__ = [
    "RULER_OFFLINE_TASKS", "RULER_DOWNLOAD_TASKS", "CARD_TASKS", "ENDING_BUDGET", "SHORT_BUDGETS", "BEYOND_BASE_THRESHOLD",
    "ModelSpec", "parse_model_specs", "is_base_row", "method_text", "row_label", "tokenizer_hash", "sample_cache_key",
    "SampleCache", "SampleResultsError", "SampleResults", "check_length_budget", "needs_full_budget", "first_budget",
    "score_summary", "beyond_base", "unmarked_note", "base_reference", "sample_counts_text", "card_figure", "card_rows", "PAIRED_KINDS", "LOWER_IS_BETTER_KINDS", "perplexity_cell_fields", "paired_comparisons", "markdown_card", "write_card",
    "read_sample_records", "ruler_cell_fields", "CardFileError", "rewrite_card", "earlier_card", "merged_row_order",
    "card_row_labels", "in_row_order", "header_differences", "combined_row_order", "combine_cards", "row_identity", "relabelled_rows", "add_card_arguments",
]

#: The RULER tasks of lm-eval that generate their samples locally (no download).
RULER_OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
#: RULER tasks that need a download, and what they fetch; run where it can be fetched, else listed as skipped.
RULER_DOWNLOAD_TASKS = {
    "niah_single_2": "essay haystack: downloads baber/paul_graham_essays",
    "niah_single_3": "essay haystack: downloads baber/paul_graham_essays",
    "niah_multikey_1": "essay haystack: downloads baber/paul_graham_essays",
    "niah_multiquery": "essay haystack: downloads baber/paul_graham_essays",
    "niah_multivalue": "essay haystack: downloads baber/paul_graham_essays",
    "ruler_qa_squad": "SQuAD: downloads its dev set from rajpurkar.github.io",
    "ruler_qa_hotpot": "HotpotQA: downloads its dev set from the hub with requests",
}
CARD_TASKS = ("perplexity", "passkey", "needle", "ruler", "ending")
#: Tokens an answer of the ``ending`` row may take before it counts as not ended (hf_posext.evaluation.ending).
ENDING_BUDGET = 128
#: Tokens generated per RULER sample before the answer is checked (lm-eval's own budgets: niah 128, vt 30,
#: cwe 120, fwe 50). A sample that uses the whole short budget without scoring 1 is generated again with the
#: task's full budget (:func:`needs_full_budget`), so the score is always the one the full budget gives.
SHORT_BUDGETS = {"niah_single_1": 24, "niah_multikey_2": 24, "niah_multikey_3": 64, "ruler_vt": 30,
                 "ruler_cwe": 120, "ruler_fwe": 50}
#: A task counts only where the base model's best in-window score reaches this.
BEYOND_BASE_THRESHOLD = 0.2
#: Bump when the per-sample record changes meaning.
SAMPLE_RECORD_VERSION = 1


# ------------------------------------------------------------------ rows and their labels


@dataclass(frozen=True)
class ModelSpec:
    """One ``--models`` entry: ``[LABEL=]MODEL[+ADAPTER][@METHOD[:FACTOR];...]`` (methods after ``@`` replace
    ``--methods`` for this model, e.g. ``fine-tuned=runs/m@as-saved;string:1``)."""

    model: str
    adapter: str | None = None
    label: str | None = None
    methods: tuple[tuple[str, float | None], ...] = ()

    @property
    def name(self) -> str:
        """The reader-facing model name: the label, else ``fine-tuned`` for an adapter, else the model as given."""
        if self.label:
            return self.label
        if self.adapter:
            return "fine-tuned"
        return self.model.rstrip("/").split("/")[-1]

    @property
    def key(self) -> str:
        return f"{self.model}+{self.adapter}" if self.adapter else self.model


def parse_model_specs(text: str) -> list[ModelSpec]:
    """``"smollm2-135m,fine-tuned=runs/r/merged,base+runs/r/adapter"`` -> model specs.

    Raises:
        ValueError: an empty list, an empty part, or a label given twice.
    """
    specs = []
    for item in (part.strip() for part in split_top_level(text, ",")):
        if not item:
            raise ValueError(f"--models {text!r} has an empty entry; write e.g. smollm2-135m,fine-tuned=runs/r/merged.")
        label, equals, rest = item.partition("@")[0].partition("=")  # a label is NAME= before the model
        rest = item[len(label) + 1:] if equals else item
        label = label if equals else ""
        rest, at, method_text_ = rest.partition("@")
        methods = []
        for part in filter(None, (m.strip() for m in method_text_.split(";"))) if at else ():
            if looks_like_request_text(part) and not re.fullmatch(r"[^:=]+:\s*[-+0-9.eE]+", part):
                # the request grammar (yarn:factor=4:beta_fast=16); "yarn:4" is the older spelling, below
                parse_request(part, where=f"--models entry {item!r}:")
                methods.append((part, None))
                continue
            name, colon, factor = part.partition(":")
            try:
                methods.append((name.strip(), float(factor) if colon else None))
            except ValueError:
                raise ValueError(f"--models entry {item!r}: {part!r} is not a request such as yarn:factor=4.") from None
            if colon:
                warn_at_caller(f"--models {part!r} is deprecated and will be removed: write {name.strip()}:factor={factor.strip()}.",
                               FutureWarning)
        model, adapter = rest, None
        if "+" in rest and not os.path.exists(rest):
            model, _, adapter = rest.partition("+")
        if not model.strip():
            raise ValueError(f"--models entry {item!r} names no model.")
        specs.append(ModelSpec(model.strip(), adapter.strip() if adapter else None, label.strip() or None, tuple(methods)))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--models gives two rows the name {sorted(n for n in names if names.count(n) > 1)[0]!r}; "
                         "label them: NAME=MODEL.")
    if not specs:
        raise ValueError("--models is empty; pass e.g. --models smollm2-135m.")
    return specs


def is_base_row(spec_index: int, spec: ModelSpec, method: str | None, saved: dict[str, Any]) -> bool:
    """Whether a row is the base model inside its own window: the reference of "beyond the base model" and of
    the plots' dashed line.

    The base model is the first ``--models`` entry when it is a pretrained model as published: no adapter, and no
    scaling saved in its config (``saved``: its :func:`hf_posext.describe` report before any patch). Its base row
    is the one evaluated unscaled (``method`` ``"none"``, or None for as saved). A fine-tuned model whose config holds
    its scaling (a merged ``yarn`` ×4) is never the base, also as saved or listed first: its window is the scaled
    one, and its in-window scores would pass for the original model's.
    """
    if spec_index != 0 or spec.adapter is not None or (method is not None and method != "none"):
        return False
    return (saved.get("method") or "none") == "none"


def method_text(report: dict[str, Any]) -> str:
    """A scaling as a reader says it: ``unscaled``, ``yarn ×4``, ``yarn ×4 + string``, ``dynamic-yarn ×2``.

    ``report`` is ``describe(model).to_dict()`` of the model as evaluated, so a model whose scaling lives in
    its config is named by that scaling, not by the ``none ×1`` it was asked for.
    """
    method = report.get("method") or "none"
    if method == "none":
        return "unscaled"
    parts = method.split("+")
    return " + ".join([f"{parts[0]} ×{float(report.get('factor') or 1):g}", *parts[1:]])


def row_label(spec_name: str, report: dict[str, Any], params: dict[str, Any] | None = None) -> str:
    """``"fine-tuned, yarn ×4 + string"``; with the parameters a run asked for (``--param``), after it in
    brackets: ``"fine-tuned, yarn ×4 + string (shifted_offset 16384)"``, so that two rows of one method differ."""
    asked = ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                      for name, value in sorted((params or {}).items()))
    return f"{spec_name}, {method_text(report)}" + (f" ({asked})" if asked else "")


# ------------------------------------------------------------------ the RULER sample cache


def tokenizer_hash(tokenizer: Any) -> str:
    """A hash of what a tokenizer does (not of its files): its class, backend model and special tokens.

    Two folders holding the same tokenizer with a different ``model_max_length`` (``hf-posext patch`` sets it)
    hash the same, so a base model and its fine-tune share their RULER samples.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = json.loads(backend.to_str())
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        body = sorted(vocab.items())
    description = {
        "class": type(tokenizer).__name__.removesuffix("Fast"),
        "backend": body,
        "special": {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        "added": sorted(str(token) for token in getattr(tokenizer, "all_special_tokens", [])),
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sample_cache_key(task: str, task_version: Any, tokenizer_key: str, length: int, seed: int, generator_version: str) -> dict[str, Any]:
    """The key under which a task's samples are generated once and shared by every row with that tokenizer."""
    return {"task": task, "task_version": str(task_version), "tokenizer": tokenizer_key, "length": int(length),
            "seed": int(seed), "lm_eval": generator_version}


def _key_name(key: dict[str, Any]) -> str:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return f"{key['task']}-{key['length']}-seed{key['seed']}-{key['tokenizer'][:8]}-{digest}.json"


class SampleCache:
    """RULER samples on disk, one JSON file per key (:func:`sample_cache_key`): ``{"key", "docs"}``.

    ``get`` returns the first ``n`` docs when the file holds at least ``n``; ``put`` writes atomically, with a digest
    of the docs. A file whose key does not match its name, whose docs do not match their digest, or that is not
    JSON, is named in the error, never reused.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    def path(self, key: dict[str, Any]) -> Path:
        return self.folder / _key_name(key)

    def get(self, key: dict[str, Any], n: int) -> list[dict[str, Any]] | None:
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DamagedFileError(f"RULER sample cache {path} is not readable JSON ({type(error).__name__}); "
                                   "delete it to generate the samples again.") from None
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("docs"), list):
            raise DamagedFileError(f"RULER sample cache {path} does not hold the samples of {key}; delete it to generate them again.")
        docs = data["docs"]
        if data.get("digest") is not None and data["digest"] != json_digest(docs):  # a cache before digests has none
            raise DamagedFileError(f"RULER sample cache {path}: its docs do not match their digest (edited after they were "
                                   "generated); delete it to generate the samples again.")
        return docs[:n] if len(docs) >= n else None

    def stored(self, key: dict[str, Any]) -> list[dict[str, Any]]:
        """Every doc stored under ``key`` ([] when none)."""
        if self.get(key, 0) is None:
            return []
        return json.loads(self.path(key).read_text(encoding="utf-8"))["docs"]

    def put(self, key: dict[str, Any], docs: list[dict[str, Any]]) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": key, "digest": json_digest(docs), "docs": docs}, default=str))
        return path


# ------------------------------------------------------------------ per-sample results


class SampleResultsError(DamagedFileError):
    """A per-sample results file that cannot be used; the message names the file and the line."""


_SAMPLE_FIELDS = {"doc_id": int, "score": (int, float), "response": str}


class SampleResults:
    """One JSON-lines file per (row, task, length): a header line (the row, the sample-cache key), then one
    line per finished sample. A killed run loses at most the sample it was computing; a line that is not a
    complete record (other than a cut-off last line, which a kill leaves) is named and the file refused.

    Args:
        path: the ``.jsonl`` file.
        header: what identifies the cell (model, method request, task, length, sample key, dtype) and its row's
            label; an existing file with another header is refused (it holds another cell's samples), one that
            differs only in the label is read.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.header = {"record_version": SAMPLE_RECORD_VERSION, **header}
        self.records: dict[int, dict[str, Any]] = {}
        if self.path.exists():
            self._read()

    def _read(self) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline, else a line a kill cut off
        for number, line in enumerate(lines, start=1):
            self._take(number, line)
        if tail.strip():
            try:
                self._take(len(lines) + 1, tail)
                lines.append(tail)
            except SampleResultsError:
                pass  # the sample being written when the run was killed: computed again
            self.path.write_bytes(b"".join(line + b"\n" for line in lines))

    def _take(self, number: int, line: bytes) -> None:
        if number == 1:
            value = _json_line(self.path, number, line)
            if _identity(value) != _identity(self.header):
                differences = header_differences(_identity(value), _identity(self.header))
                raise SampleResultsError(f"{self.path} holds another cell's samples ({'; '.join(differences)}); move the "
                                         "file away to compute this cell anew, or run with the settings it was made with.")
            return
        value = _sample_line(self.path, number, line)
        self.records[int(value["doc_id"])] = value

    def has(self, doc_id: int) -> bool:
        return doc_id in self.records

    def add(self, record: dict[str, Any]) -> None:
        problem = _sample_problem(record)
        if problem:
            raise ValueError(f"sample record {problem}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a", encoding="utf-8") as handle:
            if new:
                handle.write(json.dumps(self.header, default=str) + "\n")
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records[int(record["doc_id"])] = record

    def scores(self, doc_ids: Iterable[int]) -> list[float]:
        return [float(self.records[i]["score"]) for i in doc_ids if i in self.records]


#: Header fields that only present a cell (its row's label): a file whose header differs in them alone holds
#: the same cell's samples (a label written by an older release reads as the same row).
_PRESENTATION_FIELDS = ("row",)


def header_differences(there: Any, here: Any, field: str = "", most: int = 3) -> list[str]:
    """Where two sample-file headers differ, as ``"FIELD is A in the file, B in this run"`` (nested fields dotted:
    ``sample_key.tokenizer``), at most ``most`` of them, so that a refusal names what changed in one line."""
    if not (isinstance(there, dict) and isinstance(here, dict)):
        return [] if there == here else [f"{field or 'the header'} is {there!r} in the file, {here!r} in this run"]
    found: list[str] = []
    for key in sorted(set(there) | set(here), key=str):
        name = f"{field}.{key}" if field else str(key)
        if key not in there or key not in here:
            found.append(f"{name} is {'in this run only' if key not in there else 'in the file only'}")
        else:
            found += header_differences(there[key], here[key], name, most)
        if len(found) >= most:
            break
    return found[:most]


def _identity(header: Any) -> Any:
    return {k: v for k, v in header.items() if k not in _PRESENTATION_FIELDS} if isinstance(header, dict) else header


def _json_line(path: Path, number: int, line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SampleResultsError(f"{path} line {number} is not a JSON record; delete the file to redo this cell's "
                                 "samples, or remove that line.") from None


def _sample_line(path: Path, number: int, line: bytes) -> dict[str, Any]:
    """Line ``number`` of a per-sample results file as a sample record, or SampleResultsError naming it."""
    value = _json_line(path, number, line)
    problem = _sample_problem(value)
    if problem:
        raise SampleResultsError(f"{path} line {number} {problem}; delete the file to redo this cell's samples.")
    return value


def _sample_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "is not an object"
    for name, kind in _SAMPLE_FIELDS.items():
        if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
            return f"lacks its {name!r}"
    if not 0 <= value["score"] <= 1:
        return f"has score {value['score']!r}, outside [0, 1]"
    return None


def read_sample_records(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """A per-sample results file's records by doc id, read without changing the file (a run may be appending
    to it: a last line without its newline is the sample being written, and is left out).

    Raises:
        FileNotFoundError: no such file.
        SampleResultsError: a line that is not a complete sample record (the message names the file and line).
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    lines.pop()  # b"" after the last newline, or the line being written
    records: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines[1:], start=2):
        value = _sample_line(path, number, line)
        records[int(value["doc_id"])] = value
    return records


def ruler_cell_fields(records: dict[int, dict[str, Any]], samples: int) -> dict[str, Any]:
    """What a RULER cell of the card holds from its first ``samples`` records: ``scores`` (doc id -> score, for
    the paired comparisons), ``mean_timing`` (seconds a sample, with any full-budget rerun), ``escalated`` (how
    many were generated again with the full budget) and :func:`score_summary`'s fields."""
    chosen = [records[i] for i in range(samples) if i in records]
    timing = {name: round(sum(r["timing"][name] + r.get("timing_full", {}).get(name, 0.0) for r in chosen) / len(chosen), 3)
              for name in ("prefill_s", "generate_s", "harness_s", "total_s")} if chosen and all("timing" in r for r in chosen) else {}
    return {"scores": {str(r["doc_id"]): float(r["score"]) for r in chosen}, "mean_timing": timing,
            "escalated": sum(bool(r.get("escalated")) for r in chosen), **score_summary([float(r["score"]) for r in chosen])}


# ------------------------------------------------------------------ budgets


def check_length_budget(row: str, task: str, length: int, prompt_tokens: int, max_gen_toks: int, window: int | None,
                        max_length: int) -> str | None:
    """Why a RULER cell cannot run as asked (one line), or None.

    lm-eval truncates the left of a context longer than ``max_length - max_gen_toks`` without a word; a
    model asked past its window (after scaling) reads positions it was never given.
    """
    need = prompt_tokens + max_gen_toks
    if need > max_length:
        return (f"{row}: {task} at {length}: prompt {prompt_tokens} + {max_gen_toks} generated tokens = {need} > the harness's "
                f"max_length {max_length}; lm-eval would cut the prompt's start. Raise --max-length or drop length {length}.")
    if window is not None and need > window:
        return (f"{row}: {task} at {length}: prompt {prompt_tokens} + {max_gen_toks} generated tokens = {need} > the model's "
                f"window {window}; scale it (e.g. --methods yarn --factor {math.ceil(need / window * 2) / 2:g}), "
                f"drop length {length}, or pass --skip-over-window.")
    return None


def needs_full_budget(score: float, generated_tokens: int, budget: int, full_budget: int) -> bool:
    """Whether a sample generated with ``budget`` tokens must be generated again with ``full_budget``.

    Greedy decoding makes the short output a prefix of the full one, and lm-eval's score (every answer
    contained in the output) can only rise as the output grows. So the short output's score is final when
    it already scores 1, or when generation stopped before the budget (an end of sequence or stop string:
    the full budget would stop at the same place).
    """
    return budget < full_budget and score < 1 and generated_tokens >= budget


def first_budget(records: Sequence[dict[str, Any]], short: int, full: int) -> int:
    """The budget to generate a cell's next sample with under ``--budget short``: ``short``, or ``full`` once the
    cell's finished samples show that starting short costs more than it saves.

    Starting short saves ``(full - short)`` decode steps on every sample, and costs a second prefill and ``full``
    decode steps on each sample that must be generated again (:func:`needs_full_budget`). With ``r`` the share
    of the cell's samples generated again so far (Laplace's rule: ``(again + 1) / (n + 2)``), ``p`` the prefill's
    seconds and ``d`` a decode step's (medians over the finished samples), the next sample starts at ``full`` when
    ``r * (p + full * d) > (full - short) * d``. A long prompt's prefill dwarfs the decode steps: on 2 CPU cores
    a 32768-token sample's prefill took about 560 s and 128 decode steps 19 s, so a single sample generated again
    cost more than the short budget saves on 36. The score is the full budget's either way; only time changes.
    Before any sample has finished, ``short``.
    """
    if short >= full:
        return full
    timed = [r for r in records if r.get("timing") and r.get("generated_tokens")]
    if not timed:
        return short
    again = sum(bool(r.get("escalated")) for r in records)
    share = (again + 1) / (len(records) + 2)
    prefill = statistics.median(float(r["timing"]["prefill_s"]) for r in timed)
    step = statistics.median(float(r["timing"]["generate_s"]) / max(1, int(r["generated_tokens"]) - 1) for r in timed)
    return full if share * (prefill + full * step) > (full - short) * step else short


# ------------------------------------------------------------------ the card


def _bootstrap(scores: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(scores)
    means = sorted(sum(scores[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def score_summary(scores: Sequence[float]) -> dict[str, Any]:
    """``{"n", "mean", "low", "high", "text"}``: ``k/n [low, high]`` (Wilson) for 0/1 scores, else the mean
    with a bootstrap interval."""
    n = len(scores)
    if not n:
        return {"n": 0, "mean": None, "low": None, "high": None, "text": "–"}
    mean = sum(scores) / n
    if all(s in (0, 1) for s in scores):
        proportion = Proportion(int(sum(scores)), n)
        low, high = proportion.interval
        return {"n": n, "k": int(sum(scores)), "mean": mean, "low": low, "high": high, "text": proportion.text()}
    low, high = _bootstrap(list(scores))
    return {"n": n, "mean": mean, "low": low, "high": high, "text": f"{mean:.2f} [{low:.2f}, {high:.2f}] (n={n})"}


def beyond_base(cells: Sequence[dict[str, Any]], threshold: float = BEYOND_BASE_THRESHOLD) -> dict[str, bool | None]:
    """task -> whether the base model cannot do it inside its window (its best in-window score < ``threshold``);
    None when no base row ran the task inside its window."""
    best: dict[str, float] = {}
    for cell in cells:
        if cell.get("base") and cell.get("in_window") and cell.get("mean") is not None and cell.get("kind") == "ruler":
            best[cell["task"]] = max(best.get(cell["task"], 0.0), cell["mean"])
    tasks = {cell["task"] for cell in cells if cell.get("kind") == "ruler"}
    return {task: (best[task] < threshold if task in best else None) for task in sorted(tasks)}


def unmarked_note(marks: dict[str, bool | None]) -> str:
    """One line naming the RULER tasks the card can neither count nor mark "beyond the base model" (no base row
    ran them inside its window: see :func:`is_base_row`), or "" when every task has its reference."""
    unmarked = [task for task, beyond in marks.items() if beyond is None]
    if not unmarked:
        return ""
    return (f"Not marked as counting or beyond the base model: {', '.join(unmarked)} (no base row ran it inside its window; "
            "the base row is the first model as published, unscaled).")


def card_rows(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cells sorted for the table: by task order, then row, then length."""
    order = {task: i for i, task in enumerate(["perplexity", "passkey", "needle", *RULER_OFFLINE_TASKS])}
    return sorted(cells, key=lambda c: (order.get(c["task"], 99), c["task"], c["row_index"], c["length"]))


#: The kinds of cell compared sample by sample (trial by trial, window by window) in the card's paired table.
PAIRED_KINDS = ("ruler", "passkey", "needle", "perplexity", "ending")
#: Kinds whose per-sample scores are losses: the lower one counts as better in the paired table.
LOWER_IS_BETTER_KINDS = ("perplexity",)


def perplexity_cell_fields(results: dict[str, Any], length: int, cell_id: str | None = None,
                           ppl: float | None = None) -> dict[str, Any]:
    """``sample_key`` and ``scores`` of one perplexity cell of the card, from its results file (read, never written).

    ``scores`` maps each window (``"DOCUMENT/OFFSET"``) to its mean negative log-likelihood per token
    (:func:`~hf_posext.evaluation.paired.window_losses`; lower is better). ``sample_key`` is the text and how it
    was read (the results file's config without the model: data, windows, BOS, concatenation, dtype) at
    ``length``, so two rows pair only on the same windows of the same text.

    Args:
        results: a perplexity results file's data (``config`` and ``cells``).
        length: the cell's length.
        cell_id: the cell's id in the file. A card written before cells kept it gives ``ppl`` instead: the one
            cell at ``length`` with exactly that perplexity.

    Returns:
        The two fields, or ``{}`` where no such cell is found or it kept no windows.
    """
    cells = results.get("cells") or {}
    if cell_id is not None:
        record = cells.get(cell_id)
        record = record if isinstance(record, dict) and record.get("length") == length else None
    else:
        found = [r for r in cells.values() if r.get("length") == length and ppl is not None and r.get("ppl") == ppl]
        record = found[0] if len(found) == 1 else None
    losses = window_losses(record) if isinstance(record, dict) else {}
    if not losses:
        return {}
    config = dict(results.get("config") or {})
    if isinstance(config.get("data"), str):
        config["data"] = os.path.normpath(config["data"])
    key = {"task": "perplexity", "length": int(length), **{k: v for k, v in sorted(config.items()) if k not in ("task", "model")}}
    return {"sample_key": key, "scores": losses}


def paired_comparisons(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every two rows that ran a RULER task, passkey, needle or perplexity at a length on the same samples (the
    same seeded trials, the same windows of the same text), compared sample by sample.

    Cells must carry ``scores`` (``{doc_id: score}``, as :func:`write_card` keeps them). Two cells pair when
    they have the same task, length and sample key; only the samples both scored count. A perplexity window
    counts for the row with the lower loss on it (:data:`LOWER_IS_BETTER_KINDS`). Within a task a
    pair is written the same way round at every length: the row with the higher total over the pair's
    samples first (the earlier row on a tie), so a reader sees "A vs B: higher on 6, lower on 0".

    Returns:
        One dict per (task, pair, length), in card order: ``task``, ``first``, ``second``, ``length``,
        ``higher`` (samples the first scored higher on), ``lower``, ``equal``, ``n``, ``p`` (exact two-sided
        sign test on ``higher`` against ``lower``) and ``text`` (``"6:0 of 10 (p = 0.031)"``).
    """
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for cell in card_rows(cells):
        if cell.get("kind") in PAIRED_KINDS and cell.get("scores"):
            if cell["kind"] in LOWER_IS_BETTER_KINDS:  # compared as scores: the lower loss is the higher score
                cell = {**cell, "scores": {k: -float(v) for k, v in cell["scores"].items()}}
            groups[(cell["task"], cell["length"], json.dumps(cell.get("sample_key"), sort_keys=True))].append(cell)
    found: dict[tuple[str, int, int], dict[int, tuple[list[float], list[float]]]] = defaultdict(dict)
    rows: dict[int, str] = {}
    for (task, length, _key), group in groups.items():
        for index, a in enumerate(group):
            for b in group[index + 1:]:
                if a["row_index"] == b["row_index"]:
                    continue
                first, second = sorted((a, b), key=lambda c: c["row_index"])
                common = sorted(set(first["scores"]) & set(second["scores"]))
                if common:
                    rows.update({first["row_index"]: first["row"], second["row_index"]: second["row"]})
                    found[(task, first["row_index"], second["row_index"])][length] = (
                        [float(first["scores"][i]) for i in common], [float(second["scores"][i]) for i in common])
    comparisons = []
    for (task, i, j), by_length in found.items():
        total = sum(sum(x) - sum(y) for x, y in by_length.values())
        swap = total < 0
        for length, (x, y) in sorted(by_length.items()):
            if swap:
                x, y = y, x
            higher = sum(a > b for a, b in zip(x, y))
            lower = sum(a < b for a, b in zip(x, y))
            p = sign_test_p_value(higher, lower)
            comparisons.append({"task": task, "first": rows[j if swap else i], "second": rows[i if swap else j], "length": length,
                                "higher": higher, "lower": lower, "equal": len(x) - higher - lower, "n": len(x), "p": p,
                                "text": f"{higher}:{lower} of {len(x)} (p = {p:.2g})"})
    return comparisons


#: How the paired table reads (markdown and HTML).
PAIRED_CAPTION = ("Paired samples (RULER), trials (passkey, needle: the same seeded trials) and windows (perplexity: the "
                  "same windows of the same text): the samples on which the first row did better (a higher score; for "
                  "perplexity a lower loss) : those on which the second did, of the samples both ran (ties count in "
                  "neither); exact two-sided sign test.")


def _paired_table(comparisons: Sequence[dict[str, Any]]) -> tuple[list[int], list[tuple[str, str, dict[int, str]]]]:
    lengths = sorted({c["length"] for c in comparisons})
    lines: dict[tuple[str, str], dict[int, str]] = {}
    for c in comparisons:
        lines.setdefault((c["task"], f"{c['first']} vs {c['second']}"), {})[c["length"]] = c["text"]
    return lengths, [(task, pair, texts) for (task, pair), texts in lines.items()]


def ending_caption(cells: Sequence[dict[str, Any]]) -> str:
    """What the chat-ending table shows (its prompts' length is not one of the card's lengths)."""
    longest = max(c["length"] for c in cells)
    return (f"Chat endings: short instructions in each model's own chat template (prompt and answer within {longest} "
            f"tokens, at most {ENDING_BUDGET} generated); the answers that end with the end-of-turn token, of those "
            "where the base model's answer ends how many end here too, and the mean generated tokens an answer (an answer "
            "that ends may still be terse or empty: read the records).")


def _ending_rows(cells: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(row, text)`` of the ending cells, in row order."""
    return [(c["row"], c["text"]) for c in sorted(cells, key=lambda c: c["row_index"])]


#: How the chat endings' pairs read (markdown and HTML).
ENDING_PAIRED_CAPTION = ("Paired on the same instructions: the answers only the first row ended : those only the second "
                         "ended, of the instructions both answered; exact two-sided sign test.")


def _ending_pairs(comparisons: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(pair, text)`` of the chat endings' paired comparisons."""
    return [(f"{c['first']} vs {c['second']}", c["text"]) for c in comparisons if c["task"] == "ending"]


def markdown_card(cells: Sequence[dict[str, Any]], skipped: Sequence[dict[str, str]] = ()) -> str:
    """The card as markdown: one table, task × row × length, then the chat endings and the paired comparisons."""
    marks = beyond_base(cells)
    ending_cells = [c for c in cells if c.get("kind") == "ending"]
    cells = [c for c in cells if c.get("kind") != "ending"]
    lengths = sorted({c["length"] for c in cells})
    lines = ["| task | row | " + " | ".join(format_length(n) for n in lengths) + " |", "|---|---|" + "---:|" * len(lengths)] if cells else []
    by_key = {(c["task"], c["row"], c["length"]): c for c in cells}
    seen = []
    for cell in card_rows(cells):
        if (cell["task"], cell["row"]) in seen:
            continue
        seen.append((cell["task"], cell["row"]))
        task = cell["task"] + (" (beyond the base model)" if marks.get(cell["task"]) else "")
        texts = [by_key[(cell["task"], cell["row"], n)]["text"] if (cell["task"], cell["row"], n) in by_key else "" for n in lengths]
        lines.append(f"| {task} | {cell['row']} | " + " | ".join(texts) + " |")
    if note := unmarked_note(marks):
        lines += ["", note]
    if ending_cells:
        lines += ["", ending_caption(ending_cells), "", "| row | answers that end |", "|---|---:|"]
        lines += [f"| {row} | {text} |" for row, text in _ending_rows(ending_cells)]
        if ending_pairs := _ending_pairs(paired_comparisons(ending_cells)):
            lines += ["", ENDING_PAIRED_CAPTION, "", "| pair | paired |", "|---|---:|"]
            lines += [f"| {pair} | {text} |" for pair, text in ending_pairs]
    comparisons = paired_comparisons(cells)
    if comparisons:
        paired_lengths, paired = _paired_table(comparisons)
        lines += ["", PAIRED_CAPTION, "", "| task | pair | " + " | ".join(format_length(n) for n in paired_lengths) + " |",
                  "|---|---|" + "---:|" * len(paired_lengths)]
        lines += [f"| {task} | {pair} | " + " | ".join(texts.get(n, "") for n in paired_lengths) + " |" for task, pair, texts in paired]
    for item in skipped:
        lines.append(f"\nskipped: {item['what']}: {item['reason']}")
    return "\n".join(lines)


def base_reference(cells: Sequence[dict[str, Any]]) -> tuple[float, int] | None:
    """``(score, length)``: the base model's best score inside its own window on these cells (one task's), the
    reference an extension is measured against (for perplexity the lowest); None when no base row ran inside it."""
    inside = [c for c in cells if c.get("base") and c.get("in_window") and c.get("mean") is not None]
    if not inside:
        return None
    pick = min if any(c["task"] == "perplexity" for c in inside) else max
    best = pick(inside, key=lambda c: (c["mean"], -c["length"]))
    return float(best["mean"]), int(best["length"])


def sample_counts_text(points: Sequence[dict[str, Any]]) -> str:
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


def card_figure(task: str, cells: Sequence[dict[str, Any]], beyond: bool | None):
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


def _draw_card_figure(task: str, cells: Sequence[dict[str, Any]], beyond: bool | None, columns: int):
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


def _plot(task: str, cells: Sequence[dict[str, Any]], path: Path, beyond: bool | None) -> Path:
    return save_figure(card_figure(task, cells, beyond), path, dpi=100)


def _write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a card)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def write_card(out: str | os.PathLike, cells: Sequence[dict[str, Any]], skipped: Sequence[dict[str, str]],
               settings: dict[str, Any]) -> dict[str, Path]:
    """Write ``card.json``, ``card.md``, one ``card-TASK.png`` per task and ``card.html`` (self-contained).

    Returns:
        ``{"json", "markdown", "html"}`` paths.
    """
    import html

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    marks = beyond_base(cells)
    plots = []
    for task in dict.fromkeys(c["task"] for c in card_rows(cells)):
        plots.append(_plot(task, [c for c in cells if c["task"] == task], out / f"card-{task}.png", marks.get(task)))
    markdown = markdown_card(cells, skipped)
    comparisons = paired_comparisons(cells)
    data = {"settings": settings, "cells": list(card_rows(cells)), "beyond_base_model": marks, "paired": comparisons,
            "skipped": list(skipped)}
    _write_text(out / "card.json", json.dumps(data, indent=1, default=str))
    _write_text(out / "card.md", markdown + "\n")
    ending_cells = [c for c in cells if c.get("kind") == "ending"]
    table_cells = [c for c in cells if c.get("kind") != "ending"]
    lengths = sorted({c["length"] for c in table_cells})
    by_key = {(c["task"], c["row"], c["length"]): c for c in table_cells}
    body = ["<table><tr><th>task</th><th>row</th>" + "".join(f"<th>{format_length(n)}</th>" for n in lengths) + "</tr>"] if table_cells else []
    seen: list[tuple[str, str]] = []
    for cell in card_rows(table_cells):
        if (cell["task"], cell["row"]) in seen:
            continue
        seen.append((cell["task"], cell["row"]))
        mark = " <em>(beyond the base model)</em>" if marks.get(cell["task"]) else ""
        texts = "".join(f"<td>{html.escape(by_key[(cell['task'], cell['row'], n)]['text']) if (cell['task'], cell['row'], n) in by_key else ''}</td>"
                        for n in lengths)
        body.append(f"<tr><td>{html.escape(cell['task'])}{mark}</td><td>{html.escape(cell['row'])}</td>{texts}</tr>")
    if table_cells:
        body.append("</table>")
    if ending_cells:
        body.append(f"<h2>Chat endings</h2><p>{html.escape(ending_caption(ending_cells))}</p>"
                    "<table><tr><th>row</th><th>answers that end</th></tr>"
                    + "".join(f"<tr><td>{html.escape(row)}</td><td>{html.escape(text)}</td></tr>" for row, text in _ending_rows(ending_cells))
                    + "</table>")
        if ending_pairs := _ending_pairs(comparisons):
            body.append(f"<p>{html.escape(ENDING_PAIRED_CAPTION)}</p><table><tr><th>pair</th><th>paired</th></tr>"
                        + "".join(f"<tr><td>{html.escape(pair)}</td><td>{html.escape(text)}</td></tr>" for pair, text in ending_pairs)
                        + "</table>")
    comparisons = [c for c in comparisons if c["task"] != "ending"]
    if comparisons:
        paired_lengths, paired = _paired_table(comparisons)
        body.append(f"<h2>Paired samples</h2><p>{html.escape(PAIRED_CAPTION)}</p><table><tr><th>task</th><th>pair</th>"
                    + "".join(f"<th>{format_length(n)}</th>" for n in paired_lengths) + "</tr>")
        body += [f"<tr><td>{html.escape(task)}</td><td>{html.escape(pair)}</td>"
                 + "".join(f"<td>{html.escape(texts.get(n, ''))}</td>" for n in paired_lengths) + "</tr>" for task, pair, texts in paired]
        body.append("</table>")
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
    for plot in plots:
        encoded = base64.b64encode(plot.read_bytes()).decode()
        body.append(f'<figure><img alt="{html.escape(plot.stem)}" src="data:image/png;base64,{encoded}"></figure>')
    body.append("<h2>Settings</h2><pre>" + html.escape(json.dumps(settings, indent=1, default=str)) + "</pre>")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>hf-posext report card</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
            "font-size:13px}td{text-align:right}td:nth-child(-n+2){text-align:left}</style></head><body>"
            "<h1>Report card</h1><p>k/n [95% Wilson interval] for scores that are 0 or 1 per sample; mean [95% bootstrap "
            f"interval] otherwise; perplexity as a number. A task is <em>beyond the base model</em> when the base model's best "
            f"score inside its own window is below {BEYOND_BASE_THRESHOLD:.0%}.</p>"
            + (f"<p>{html.escape(note)}</p>" if (note := unmarked_note(marks)) else "")
            + ("<p><strong>Partial card:</strong> written while the run goes on; cells it has not reached show an earlier run's samples, or are missing.</p>"
               if settings.get("partial") else "") + "\n".join(body) + "</body></html>")
    _write_text(out / "card.html", page)
    return {"json": out / "card.json", "markdown": out / "card.md", "html": out / "card.html"}


class CardFileError(DamagedFileError):
    """A ``card.json`` that cannot be read; the message names the file."""


def rewrite_card(folder: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write a card again from its folder: ``card.json``'s cells, each RULER cell read again from its sample file.

    Used by ``hf-posext report CARD_FOLDER``: a card written by an older release gains what this one shows
    (the paired comparisons), a cell shows every finished sample its file holds, and a cell still running (or
    left unfinished by a stopped run) is shown with the samples it has, marked "k of n so far". Sample files are
    only read, so this is safe beside a run that is still writing them; nothing is computed again. A combined
    card (:func:`combine_cards`) is combined again from the folders it names.

    Args:
        folder: the ``--out`` folder of ``hf-posext eval card``.
        out: where to write (default: ``folder``).

    Returns:
        ``{"json", "markdown", "html"}`` paths.

    Raises:
        FileNotFoundError: no ``card.json`` in ``folder``, or a cell's sample file is missing.
        CardFileError: ``card.json`` is not a card.
        SampleResultsError: a damaged sample file.
    """
    folder = Path(folder)
    sources = _combined_sources(folder)
    if sources is not None:
        return combine_cards(sources, out or folder)
    cells, skipped, settings = _card_cells(folder)
    return write_card(out or folder, cells, skipped, settings)


def _read_card(folder: Path) -> dict[str, Any]:
    path = folder / "card.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no card.json; pass the --out folder of hf-posext eval card.")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data["settings"], dict) or not isinstance(data["cells"], list):
            raise TypeError("no settings and cells")
        return data
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CardFileError(f"{path} is not a card written by hf-posext eval card ({type(error).__name__}: {error}); "
                            "restore card.json from version control, or delete it and run the card again.") from None


def _combined_sources(folder: Path) -> list[Path] | None:
    """The folders a combined card was made from (relative to ``folder``), or None for a card of one run."""
    names = _read_card(folder)["settings"].get("combined_from")
    if names is None:
        return None
    return [Path(os.path.normpath(folder / name)) for name in names]


def _card_cells(folder: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]], dict[str, Any]]:
    """``(cells, skipped, settings)`` of the card in ``folder``, its RULER cells read again from their sample files."""
    path = folder / "card.json"
    data = _read_card(folder)
    try:
        # a cell shown as running when the card was last written is looked for again, like any unlisted file;
        # its dtype and sample count stay known (a later run into the folder may not name its task)
        cells = [cell for cell in data["cells"] if not cell.get("running")]
        listed = {Path(str(cell.get("source", ""))).name: cell for cell in data["cells"] if cell.get("running")}
        settings, skipped = dict(data["settings"]), list(data.get("skipped") or [])
        samples = int(settings["samples"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CardFileError(f"{path} is not a card written by hf-posext eval card ({type(error).__name__}: {error}); "
                            "restore card.json from version control, or delete it and run the card again.") from None
    used: set[Path] = set()
    for cell in cells:
        if cell.get("kind") != "ruler":
            continue
        source = Path(str(cell.get("source", "")))
        candidates = [folder / "ruler" / source.name, source]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path}: the samples of {cell.get('row')}, {cell.get('task')} at {cell.get('length')} are not in "
                                    f"{candidates[0]} nor {source}; restore the file, or run the card again.")
        cell.update(ruler_cell_fields(read_sample_records(found), int(cell.get("samples") or samples)))
        used.add(found.resolve())
    for cell in cells:
        if cell.get("kind") == "perplexity" and not cell.get("scores"):
            cell.update(_stored_window_losses(folder, cell))
        problem = card_cell_problem(cell)  # numbers no run writes (a hand edit, a damaged file): named, never shown
        if problem:
            where = f"{cell['source']}, " if cell.get("kind") == "ruler" else ""
            raise CardFileError(f"{path}: cell {cell_name(cell)} has {problem}; restore {where}card.json from version "
                                "control, or delete it and run the card again.")
    cells.extend(_running_cells(folder, cells, settings, used, listed))
    return cells, skipped, settings


def _stored_window_losses(folder: Path, cell: dict[str, Any]) -> dict[str, Any]:
    """A perplexity cell's per-window losses from its results file, for a card written before cells carried them
    (:func:`perplexity_cell_fields`); ``{}`` where the file is gone (the cell is shown, but not paired). A damaged
    file is named (``ResultsFileError``), never read past."""
    from hf_posext.evaluation.results_files import read_results_file

    source = Path(str(cell.get("source", "")))
    found = next((c for c in (folder / "tasks" / source.name, source) if c.is_file()), None)
    if found is None:
        return {}
    return perplexity_cell_fields(read_results_file(found), cell["length"], cell.get("cell_id"), cell.get("mean"))


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


def card_row_labels(folder: str | os.PathLike) -> list[str]:
    """The row labels of the card in ``folder``, in its order; none where there is no card yet.

    Raises:
        CardFileError: ``card.json`` is damaged (named, with the fix).
    """
    folder = Path(folder)
    if not (folder / "card.json").is_file():
        return []
    rows = _read_card(folder)["settings"].get("rows") or []
    return [str(row["label"]) for row in rows if isinstance(row, dict) and "label" in row]


def in_row_order(cells: Sequence[dict[str, Any]], settings: dict[str, Any],
                 position: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``cells`` and ``settings["rows"]`` with rows placed by ``position`` (:func:`merged_row_order`); a label it
    lacks keeps its place after them."""
    def where(label: str, index: int) -> int:
        return position.get(label, len(position) + index)

    placed = [{**cell, "row_index": where(cell["row"], int(cell.get("row_index", 0)))} for cell in cells]
    rows = list(settings.get("rows") or [])
    rows = [row for _, row in sorted(enumerate(rows), key=lambda item: where(str(item[1].get("label")), item[0]))]
    return placed, {**settings, "rows": rows}


def earlier_card(folder: str | os.PathLike, labels: Sequence[str],
                 covered: set[tuple[str, str, int | None]]) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[dict[str, Any]]]:
    """What the card already in ``folder`` shows that a new run into the same folder does not cover.

    A run writes its card over the folder's ``card.json``; without this, the cells of an earlier run with other
    tasks, rows or lengths would drop off the card while their sample files stay. They are kept instead: read
    again from their sample files, each with the ``samples`` and ``dtype`` of the run that made it.

    Args:
        folder: the new run's ``--out``.
        labels: the new run's row labels, in order (an earlier row of the same label takes its place; other
            earlier rows come after them).
        covered: ``(task, row label, length)`` of every cell the new run computes or skips; ``length`` None
            for every length of that task and row (the ending row's length is its prompts').

    Returns:
        ``(cells, skipped, rows)``: the earlier cells not covered, the earlier skipped entries not about a covered
        cell, and the earlier rows' settings for labels the new run does not have.

    Raises:
        ValueError: ``folder`` holds a combined card (:func:`combine_cards`).
        CardFileError, FileNotFoundError, SampleResultsError: as :func:`rewrite_card`.
    """
    folder = Path(folder)
    if not (folder / "card.json").is_file():
        return [], [], []
    if _combined_sources(folder) is not None:
        raise ValueError(f"{folder} holds a combined card (hf-posext report A B --out {folder}); write the run to a folder of "
                         "its own, then combine again.")
    cells, skipped, settings = _card_cells(folder)
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


def combined_row_order(parts: Sequence[tuple[Sequence[dict[str, Any]], dict[str, Any]]]) -> dict[str, int]:
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
        folders: two or more ``--out`` folders of ``hf-posext eval card`` (not combined cards themselves).
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
        if _combined_sources(folder) is not None:
            raise ValueError(f"{folder} is a combined card; combine the folders it names instead.")
        parts.append((folder, *_card_cells(folder)))
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


#: The fields of a row's ``describe`` report that a sample file's header keeps: with the model, what a row measured.
_IDENTITY_REPORT_FIELDS = ("method", "factor", "current_window", "original_window")


def row_identity(model: Any, report: Any, with_params: bool = False) -> str | None:
    """What a row measures, the model and its scaling as evaluated, as one comparable string (a row's label can
    change between runs; this does not); None where either is missing.

    ``with_params``: the method's parameters count too (``report["params"]``, which a card's rows keep and a sample
    file's header does not): STRING at another ``shifted_offset`` on the same model is another row."""
    if not model or not isinstance(report, dict):
        return None
    fields = (*_IDENTITY_REPORT_FIELDS, "params") if with_params else _IDENTITY_REPORT_FIELDS
    return json.dumps([model, {k: report.get(k) for k in fields}], sort_keys=True, default=str)


def relabelled_rows(earlier_rows: Sequence[dict[str, Any]], rows_now: Sequence[dict[str, Any]]) -> dict[str, str]:
    """``{earlier label: label now}`` for the earlier card's rows that a run measures again under another label:
    the same model, scaling and method parameters (``{"label", "model", "report"}`` each, as a card's settings
    keep its rows). A row that differs in a parameter only (another STRING offset) is a row of its own."""
    now = {row_identity(row.get("model"), row.get("report"), with_params=True): row["label"] for row in rows_now}
    now.pop(None, None)
    return {old["label"]: now[identity] for old in earlier_rows
            if (identity := row_identity(old.get("model"), old.get("report"), with_params=True)) in now
            and now[identity] != old["label"]}


def _running_cells(folder: Path, cells: list[dict[str, Any]], settings: dict[str, Any], used: set[Path],
                   listed: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Cells of the card's rows whose sample files are not in ``card.json`` yet (the cell a run is computing,
    or one a stopped run left unfinished): shown with the samples they have, marked as unfinished.

    ``listed``: the cells ``card.json`` showed as unfinished, by their sample file's name. Such a cell keeps its
    own dtype and sample count where the card's settings (a later run's, with other tasks) do not name its task.
    """
    listed = listed or {}
    rows = {row.get("label"): (index, row) for index, row in enumerate(settings.get("rows") or [])}
    # a file written under a row's older label is found by what it measured: the model and its scaling as evaluated
    identities = [(row_identity(row.get("model"), row.get("report")), label) for label, (_, row) in rows.items()]
    counts = Counter(identity for identity, _ in identities)
    labels_by_identity = {identity: label for identity, label in identities if identity is not None and counts[identity] == 1}
    have = {(c["task"], c["row"], c["length"]) for c in cells}
    samples = int(settings["samples"])
    running = []
    for path in sorted((folder / "ruler").glob("*.jsonl")):
        if path.resolve() in used:
            continue
        with path.open("rb") as handle:
            first = handle.readline()
        try:
            header = json.loads(first.decode("utf-8"))
            label, task, length = header["row"], header["task"], int(header["length"])
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise SampleResultsError(f"{path} line 1 is not a sample file's header; move the file out of {folder / 'ruler'}.") from None
        if label not in rows:
            label = labels_by_identity.get(row_identity(header.get("model"), header.get("report")), label)
        # another run's rows, or another dtype's samples of this card's cell, are not this card's
        dtypes = settings.get("dtypes") or {}
        earlier = listed.get(path.name) or {}
        # cards before each RULER task was keyed by name keyed them all as "ruler"
        dtype = dtypes.get(task, dtypes.get("ruler", earlier.get("dtype")))
        if label not in rows or (task, label, length) in have or header.get("dtype") != dtype:
            continue
        records = read_sample_records(path)
        if not records:
            continue
        index, row = rows[label]
        report = row.get("report") or {}
        base = row.get("base", next((c["base"] for c in cells if c["row"] == label),  # cards before "base" was kept
                                    (report.get("method") or "none") == "none" and row.get("model") == (settings.get("models") or [None])[0]))
        cell = {"task": task, "kind": "ruler", "row": label, "row_index": index, "length": length, "base": bool(base),
                "in_window": length <= int(report.get("current_window") or length), "sample_key": header.get("sample_key"),
                "source": str(path), **ruler_cell_fields(records, wanted := int(earlier.get("samples") or samples))}
        if earlier.get("samples"):
            cell["samples"] = wanted
        if earlier.get("dtype"):
            cell["dtype"] = earlier["dtype"]
        if cell["n"] < wanted:
            cell.update(running=True, text=f"{cell['text']}, {cell['n']} of {wanted} so far")
        running.append(cell)
        have.add((task, label, length))
    return running


# ------------------------------------------------------------------ arguments


def add_card_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-posext eval card``."""
    parser.add_argument("--models", required=True,
                        help="comma-separated [LABEL=]MODEL[+ADAPTER][@REQUEST;...] (REQUEST: docs/request-grammar.md, e.g. yarn:factor=4): hub name, folder, smollm2-135m; the first, "
                             "when it has no adapter and no scaling saved in its config, is the base model, and its unscaled row "
                             "the reference of 'beyond the base model' (e.g. smollm2-135m,fine-tuned=runs/r/merged@as-saved;string:factor=1)")
    parser.add_argument("--methods", default="none",
                        help="comma-separated requests applied to every model (e.g. none,yarn:factor=4); none = unscaled, as-saved = the model's own saved "
                             "scaling (default: %(default)s)")
    parser.add_argument("--factor", type=float, help="factor for every method but none/as-saved (default: longest length / window)")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE", help="deprecated: write the parameter in the request, yarn:beta_fast=16")
    parser.add_argument("--lengths", required=True, help="comma-separated lengths in tokens, e.g. 2048,4096 or 4k,16k")
    parser.add_argument("--tasks", default="perplexity,passkey,needle,ruler,ending",
                        help="perplexity, passkey, needle, ruler (RULER's six offline tasks, and its seven that need a download where "
                             "their data can be fetched; the others are listed as skipped), RULER task names, or ending (short "
                             "chat-formatted instructions: does each answer end with the end-of-turn token?) (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=20, help="samples per task and length (passkey/needle: trials over the depths; "
                        "perplexity: segments, at most 8) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RULER samples and the passkeys (default: %(default)s)")
    parser.add_argument("--out", default="results/card", help="results folder (default: %(default)s)")
    parser.add_argument("--sample-cache", help="folder of cached RULER samples (default: OUT/ruler-samples)")
    parser.add_argument("--budget", choices=("short", "full"), default="short",
                        help="short: generate each RULER sample with a short budget first and again with the task's full budget "
                             "only when that could change its score (same scores, less time); full: lm-eval's budgets (default: %(default)s)")
    parser.add_argument("--max-length", type=int, help="the harness's max_length (default: each row's scaled window)")
    parser.add_argument("--skip-over-window", action="store_true",
                        help="list (row, length) cells whose prompt does not fit the row's window as skipped instead of refusing the run")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16 or auto: perplexity in float32, passkey, needle and RULER in bfloat16 on a "
                             "CPU with native bfloat16, else float32 (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda (default: %(default)s)")
    parser.add_argument("--ppl-data", default="builtin:python-docs", help="perplexity text (default: %(default)s)")
    parser.add_argument("--haystack", default="builtin:python-docs", help="needle haystack text (default: %(default)s)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
