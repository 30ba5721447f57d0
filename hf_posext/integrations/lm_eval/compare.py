"""One model under several scaling methods on the same harness tasks (``hf-posext lm-eval-compare``).

:func:`compare_methods` builds the tasks once and evaluates every method on them; :func:`format_comparison`
prints the table; :func:`parse_method_spec` turns ``"yarn:factor=2"`` into the model's ``posext`` argument.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

from hf_posext.core.files import write_text_atomic
from hf_posext.core.grammar import format_request, parse_request, split_top_level
from hf_posext.core.locks import lock_file_writer
from hf_posext.integrations.lm_eval.launcher import import_harness
from hf_posext.user_warnings import warn_at_caller

__all__ = ["parse_method_spec", "compare_methods", "format_comparison"]

logger = logging.getLogger(__name__)


def parse_method_spec(spec: str) -> dict[str, Any]:
    """Turn a request (``"yarn:factor=2:beta_fast=32"``, :mod:`hf_posext.core.grammar`) into the model's ``posext``
    argument, validated and sized.

    The older ``yarn:factor=2,beta_fast=32`` (settings separated by commas) still works for one release, with a
    deprecation line naming the new form.

    Returns:
        e.g. ``{"posext": "yarn:factor=2:beta_fast=32"}``.

    Raises:
        ValueError: malformed text, unknown method or parameter, missing factor.
    """
    from hf_posext.integrations.lm_eval.model import POSEXT_ARGUMENT

    method, _, rest = spec.partition(":")
    if "," in rest and len(split_top_level(rest, ",")) > 1:
        new = ":".join([method.strip(), *(item.strip() for item in split_top_level(rest, ",") if item.strip())])
        warn_at_caller(f"lm-eval-compare --methods {spec!r} is deprecated and will be removed: write {new!r} "
                       "(settings separated by ':').", FutureWarning)
        spec = new
    request = parse_request(spec, where="method spec").require_size()
    return {POSEXT_ARGUMENT: format_request(request)}


def _leaf_tasks(task_dict: dict) -> list:
    leaves = []
    for value in task_dict.values():
        leaves.extend(_leaf_tasks(value) if isinstance(value, dict) else [value])
    return leaves


def _score_rows(label: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if value == -1:  # RULER reports -1 for the lengths it did not run
                continue
            rows.append({"method": label, "task": task, "metric": metric, "value": float(value)})
    return rows


def _first_prompt(results: dict[str, Any]) -> str | None:
    """The context of the first request the harness built (its logged samples), or None."""
    for samples in (results.get("samples") or {}).values():
        for sample in samples:
            arguments = sample.get("arguments")
            first = next(iter(arguments.values()), None) if isinstance(arguments, dict) else (arguments[0] if arguments else None)
            if isinstance(first, dict):
                first = next(iter(first.values()), None)
            elif isinstance(first, (list, tuple)):
                first = first[0] if first else None
            return first if isinstance(first, str) else None
    return None


def compare_methods(
    pretrained: str,
    methods: list[str],
    tasks: list[str],
    *,
    max_seq_lengths: list[int] | None = None,
    limit: int | float | None = None,
    max_length: int | None = None,
    model_args: dict[str, Any] | None = None,
    device: str = "cpu",
    batch_size: int | str = 1,
    include_path: str | None = None,
    output_path: str | Path | None = None,
    apply_chat_template: bool | str = False,
    fewshot_as_multiturn: bool | None = None,
    system_instruction: str | None = None,
) -> list[dict[str, Any]]:
    """Evaluate one model under several scaling methods on the same harness tasks.

    The tasks (for RULER: 500 synthetic samples per length, minutes to build at 16k) are built once
    and reused for every method; each method loads the model afresh through ``hf-posext``.

    Args:
        pretrained: hub name, local folder or ``smollm2-135m``.
        methods: specs for :func:`parse_method_spec`, e.g. ``["none", "yarn:factor=2"]``.
        tasks: harness task names, e.g. ``["niah_single_1", "ruler_vt"]``.
        max_seq_lengths: RULER lengths (task metadata ``max_seq_lengths``); None for other tasks.
        limit: samples per task (the harness's ``--limit``).
        max_length: the harness's context limit for every method (give it for a fair comparison:
            without it an unscaled model is truncated to its own window).
        model_args: further ``hf`` model arguments (e.g. ``{"dtype": "float32"}``).
        device: torch device.
        batch_size: harness batch size.
        include_path: folder of extra task YAMLs.
        output_path: JSON file to write ``{"rows": [...], "reports": {...}, "settings": {...}}`` to; each
            report keeps the first prompt the harness built, so the formatting can be checked.
        apply_chat_template: the harness's ``--apply_chat_template`` (True, or a template name).
        fewshot_as_multiturn: the harness's ``--fewshot_as_multiturn`` (None: on with a chat template).
        system_instruction: the harness's ``--system_instruction``.

    Returns:
        One row per (method, task, metric): ``{"method", "task", "metric", "value"}``.
    """
    import_harness()
    from hf_posext.core.loading import check_tokenizer_files
    from hf_posext.integrations.lm_eval.model import PosextHFLM
    from hf_posext.models import resolve_model_path

    specs = {spec: parse_method_spec(spec) for spec in methods}  # every spec checked before any work
    chat = _chat_options(apply_chat_template, fewshot_as_multiturn, system_instruction)
    path = resolve_model_path(pretrained)
    check_tokenizer_files(path, pretrained)  # before the tasks (minutes for RULER) and any model are built
    settings = {"pretrained": pretrained, "tasks": tasks, "max_seq_lengths": max_seq_lengths, "limit": limit,
                "max_length": max_length, "model_args": model_args, "device": device, **chat}
    # one writer of the output file at a time: a second comparison into it is refused before any task or model is built
    writer = lock_file_writer(output_path, "--out", "the comparison") if output_path is not None else None
    try:
        task_manager, task_objects = _build_tasks(path, tasks, max_seq_lengths, include_path)
        rows: list[dict[str, Any]] = []
        reports: dict[str, Any] = {}
        evaluate_kwargs = {"limit": limit, "batch_size": batch_size, "device": device, "task_manager": task_manager,
                           **chat}
        for spec, posext_args in specs.items():
            started = time.perf_counter()
            lm = PosextHFLM(
                pretrained=path, device=device, batch_size=batch_size, max_length=max_length,
                **dict(model_args or {}), **posext_args,
            )
            spec_rows, reports[spec] = _evaluate_method(spec, lm, task_objects, evaluate_kwargs, started)
            rows.extend(spec_rows)
            del lm  # freed before the next method's model loads
            gc.collect()
            if output_path is not None:  # after every method: a long comparison keeps what it finished
                write_text_atomic(output_path, json.dumps({"rows": rows, "reports": reports, "settings": settings}, indent=2,
                                                          default=str))
    finally:
        if writer is not None:
            writer.release()
    return rows


def _chat_options(apply_chat_template: bool | str, fewshot_as_multiturn: bool | None,
                  system_instruction: str | None) -> dict[str, Any]:
    """The harness's chat arguments, ``fewshot_as_multiturn`` defaulting to on with a chat template.

    Raises:
        ValueError: ``fewshot_as_multiturn`` without ``apply_chat_template``.
    """
    if fewshot_as_multiturn is None:
        fewshot_as_multiturn = bool(apply_chat_template)
    elif fewshot_as_multiturn and not apply_chat_template:
        raise ValueError("--fewshot_as_multiturn needs --apply_chat_template (few-shot turns are chat messages).")
    return {"apply_chat_template": apply_chat_template, "fewshot_as_multiturn": fewshot_as_multiturn,
            "system_instruction": system_instruction}


def _build_tasks(path: str, tasks: list[str], max_seq_lengths: list[int] | None,
                 include_path: str | None) -> tuple[Any, list]:
    """The harness's task manager and the leaf tasks of ``tasks``, built once for every method."""
    from lm_eval.tasks import TaskManager, get_task_dict

    metadata: dict[str, Any] = {"pretrained": path, "tokenizer": path}
    if max_seq_lengths:
        metadata["max_seq_lengths"] = list(max_seq_lengths)
    task_manager = None
    if include_path:  # indexing the harness's ~15k built-in tasks takes ~20 s: skip it when not needed
        local = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(task in local.all_tasks for task in tasks):
            task_manager = local
    if task_manager is None:
        task_manager = TaskManager(include_path=include_path, metadata=metadata)
    return task_manager, _leaf_tasks(get_task_dict(tasks, task_manager))


def _evaluate_method(spec: str, lm: Any, task_objects: list, evaluate_kwargs: dict[str, Any],
                     started: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the built tasks on ``lm``, the model under method ``spec``: its score rows and its report (the scaling, the
    seconds since ``started``, taken before the model loaded, and the first prompt the harness built)."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(model=lm, tasks=task_objects, **evaluate_kwargs)
    rows = _score_rows(spec, results)
    logger.info("%s done in %.0f s: %s", spec, time.perf_counter() - started, rows)
    return rows, {"report": lm.posext_report, "seconds": round(time.perf_counter() - started, 1),
                  "first_prompt": _first_prompt(results)}


def format_comparison(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one row per method, one column per task/metric."""
    columns = list(dict.fromkeys(f"{r['task']} {r['metric']}" for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    values = {(r["method"], f"{r['task']} {r['metric']}"): r["value"] for r in rows}
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for method in methods:
        cells = [f"{values[(method, c)]:.3f}" if (method, c) in values else "" for c in columns]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
