"""What a suite's rows are: the models and scalings asked for, their reader-facing labels and their identity.

A row is one model (``--models`` entry) under one scaling request, with the ``describe`` report of the model as
evaluated. Its label is what the card shows (``"fine-tuned, yarn ×4 + string"``); its identity (the model and its
scaling as evaluated) is what compares rows across runs, whose labels may change. The task names the suite knows
live here too: every other module of the package reads them from here.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hf_posext.core.grammar import MODEL_ARGUMENT, format_request, looks_like_request_text, parse_request, split_top_level
from hf_posext.core.request import ScalingRequest
from hf_posext.user_warnings import warn_at_caller

__all__ = [
    "RULER_OFFLINE_TASKS", "RULER_DOWNLOAD_TASKS", "CARD_TASKS", "ENDING_BUDGET", "BEYOND_BASE_THRESHOLD", "AS_SAVED",
    "ModelSpec", "parse_model_specs", "is_base_row", "method_text", "row_label", "row_identity", "relabelled_rows",
    "Row", "parse_tasks", "ruler_tasks",
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
#: A task counts only where the base model's best in-window score reaches this.
BEYOND_BASE_THRESHOLD = 0.2
#: The method name that evaluates a model with the scaling saved in it (none would remove it).
AS_SAVED = "as-saved"


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




@dataclass
class Row:
    """One card row: a model spec under one method, with the report of the model as evaluated."""

    index: int
    spec: ModelSpec
    request: ScalingRequest | None  # None: as saved
    report: dict[str, Any]
    base: bool
    saved: dict[str, Any] | None = None  # the model's own scaling, before the row's method was patched

    @property
    def label(self) -> str:
        """``"fine-tuned, yarn ×4 + string"``: an attention method patched on a model whose frequency scaling
        lives in its config is named with that scaling, which it runs on; parameters the run asked for follow
        (``"fine-tuned, yarn ×4 + string (shifted_offset 16384)"``)."""
        report, saved = self.report, self.saved or {}
        if report.get("kind") == "attention" and saved.get("kind") == "rope" and (saved.get("method") or "none") != "none":
            report = {**report, "method": f"{saved['method']}+{report['method']}", "factor": saved.get("factor")}
        return row_label(self.spec.name, report, dict(self.request.params) if self.request else None)

    @property
    def window(self) -> int:
        return int(self.report["current_window"])

    def results_name(self, dtype: str, device: str) -> str:
        """The name of this row's sample files: readable, and the same whichever other rows a run has (so a
        run with more or fewer rows resumes this row's samples), different for another dtype or device."""
        readable = re.sub(r"[^A-Za-z0-9.]+", "-", f"{self.spec.name}-{self._method_name()}").strip("-")[:60]
        return f"{readable}-{dtype}-{self._results_hash(dtype, device)}"

    def sample_path(self, folder: Path, task: str, length: int, dtype: str, device: str) -> Path:
        """This row's sample file for ``task`` at ``length`` in ``folder``. Where it does not exist but one file
        differs from its name only in the label part (the same model, method, dtype and device, saved when the
        row had another label), that file is the row's: its samples are resumed, not computed again."""
        path = folder / f"{task}-{length}-{self.results_name(dtype, device)}.jsonl"
        if path.exists():
            return path
        earlier = sorted(folder.glob(f"{glob.escape(task)}-{length}-*-{dtype}-{self._results_hash(dtype, device)}.jsonl"))
        return earlier[0] if len(earlier) == 1 else path

    def _method_name(self) -> str:
        return f"{self.request.label}-x{self.request.factor:g}" if self.request else AS_SAVED

    def _results_hash(self, dtype: str, device: str) -> str:
        text = f"{self.spec.key}|{self._method_name()}|{dtype}|{device}"
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    def posext_args(self) -> dict[str, Any]:
        if self.request is None:
            return {}
        return {MODEL_ARGUMENT: format_request(self.request)}


# ------------------------------------------------------------------ tasks


def ruler_tasks(tasks: Sequence[str]) -> list[str]:
    """The offline RULER tasks among ``tasks`` (``ruler`` names all six), each once, in order."""
    chosen = []
    for task in tasks:
        if task == "ruler":
            chosen.extend(RULER_OFFLINE_TASKS)
        elif task in RULER_OFFLINE_TASKS:
            chosen.append(task)
    return list(dict.fromkeys(chosen))


def parse_tasks(text: str) -> list[str]:
    """``"perplexity,ruler"`` -> task names, each checked against the suite's tasks.

    Raises:
        ValueError: an unknown task, or none.
    """
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    known = set(CARD_TASKS) | set(RULER_OFFLINE_TASKS) | set(RULER_DOWNLOAD_TASKS)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ValueError(f"--tasks: unknown task {unknown[0]!r}; use perplexity, passkey, needle, ruler or a RULER task "
                         f"({', '.join(RULER_OFFLINE_TASKS)}).")
    if not tasks:
        raise ValueError("--tasks is empty; pass e.g. --tasks perplexity,passkey,needle,ruler.")
    return tasks

