"""Each row of a suite built on its model: the scaling requests it asks for, sized, and the ``describe`` report of
the model as evaluated (the report names the row and sets its window)."""

from __future__ import annotations

import gc
from typing import Any, Sequence

from hf_posext.api import describe, patch, unpatch
from hf_posext.card.spec import AS_SAVED, ModelSpec, Row, is_base_row
from hf_posext.core.request import ScalingRequest

__all__ = ["check_requests", "check_adapter_rows", "as_request", "card_model_rows", "tokenizer_path"]


def _requests(methods: str, params: dict[str, Any], factor: float | None, lengths: Sequence[int], original_window: int) -> list[ScalingRequest | None]:
    from hf_posext.evaluation.arguments import parse_methods
    from hf_posext.evaluation.grid import resolve_factor_for

    names = [m.strip() for m in methods.split(",") if m.strip()]
    others = [m for m in names if m != AS_SAVED]
    parsed = iter(parse_methods(others, params) if others else [])
    requests: list[ScalingRequest | None] = []
    for name in names:
        if name == AS_SAVED:
            requests.append(None)
            continue
        request = next(parsed)
        requests.append(ScalingRequest(request.method, resolve_factor_for(request, factor, lengths, original_window), params=request.params))
    return requests


def check_requests(specs: Sequence[ModelSpec], methods: str, factor: float | None, params: dict[str, Any]) -> None:
    """Every row's method names, parameters and given factors, checked as :func:`card_model_rows` will use them (a factor
    sized from a model's window is checked there, once the window is known).

    Raises:
        ValueError: an unknown method or parameter, or a factor below 1.
    """
    from hf_posext.evaluation.arguments import parse_methods

    for spec in specs:
        for asked, given in (spec.methods or ((methods, None),)):
            sized = given if given is not None else factor
            names = [m.strip() for m in asked.split(",") if m.strip() and m.strip() != AS_SAVED]
            for request in parse_methods(names, params) if names else []:
                if sized is not None:
                    ScalingRequest(request.method, sized, params=request.params)


#: Where the fix of an adapter mismatch starts in :func:`hf_posext.adapters.check_adapter`'s message (it names
#: ``hf-posext eval`` flags, which the suite does not take for one row).
_EVAL_FIX = ": evaluate it "
#: The same for another base model (``pass --model BASE``).
_EVAL_BASE_FIX = ": pass --model "


def _entry(spec: ModelSpec, request: str | None = None) -> str:
    """``[LABEL=]MODEL+ADAPTER[@REQUEST]``: a ``--models`` entry as the user writes it."""
    label = f"{spec.label}=" if spec.label else ""
    return f"{label}{spec.model}+{spec.adapter}" + (f"@{request}" if request else "")


def _with_suite_fix(message: str, spec: ModelSpec, record: Any, methods: str | None = None) -> str:
    """An adapter-mismatch ``message`` with its fix in the suite's spelling (``MODEL+ADAPTER@yarn:factor=4``);
    ``methods``: the ``--methods`` the row took its requests from (it has no ``@`` of its own)."""
    where = f"--models entry {_entry(spec)!r}" + (f" (its requests from --methods {methods})" if methods else "")
    if _EVAL_BASE_FIX in message:
        head = message.split(_EVAL_BASE_FIX, 1)[0]
        entry = _entry(ModelSpec(record.base_model, spec.adapter, spec.label))
        return f"{where}: {head}: write the entry {entry}."
    head = message.split(_EVAL_FIX, 1)[0] if _EVAL_FIX in message else message.rstrip(".")
    trained = f"{record.method}:factor={record.factor:g}"
    return (f"{where}: {head}: write {_entry(spec, trained)} (or {_entry(spec, AS_SAVED)} to take "
            f"the adapter's own scaling; an attention-level method may be stacked on it: "
            f"@{record.method}+string:factor={record.factor:g}), or train an adapter for that scaling.")


def check_adapter_rows(specs: Sequence[ModelSpec], methods: str, factor: float | None, params: dict[str, Any],
                       lengths: Sequence[int]) -> None:
    """Every adapter row's request checked against what its adapter was trained with (files, base model, method,
    factor and parameters: :func:`hf_posext.adapters.check_adapter`), sized as :func:`card_model_rows` will size it,
    before any model loads. A row ``@as-saved`` takes the adapter's own scaling; ``none`` or another scaling would
    evaluate the adapter on a model it was not trained for.

    Raises:
        AdapterMismatchError: another base model or scaling; the fix is in the ``--models`` spelling.
        AdapterFileError: a damaged or altered adapter file.
    """
    from hf_posext.adapters import AdapterMismatchError, check_adapter, read_adapter_record

    for spec in specs:
        if not spec.adapter:
            continue
        try:
            record = check_adapter(spec.adapter, spec.model)  # its files and its base, before any scaling is compared
        except AdapterMismatchError as error:
            raise AdapterMismatchError(_with_suite_fix(str(error), spec, read_adapter_record(spec.adapter))) from None
        for name, given in (spec.methods or ((methods, None),)):
            sized = given if given is not None else factor
            # sized as the row will be: from the adapter's original window (an old record without one: its factor)
            window = int(record.original_window or 0) or (max(lengths) / record.factor)
            for request in _requests(name, params, sized, lengths, window):
                if request is None:
                    continue  # as-saved: the adapter's own scaling
                try:
                    check_adapter(spec.adapter, spec.model, request.method, request.factor, request.params_dict, verify=False)
                except AdapterMismatchError as error:
                    raise AdapterMismatchError(_with_suite_fix(str(error), spec, record, None if spec.methods else methods)) from None


def as_request(report: dict[str, Any]) -> ScalingRequest:
    """The request that reproduces a saved scaling (for the evaluation tasks, which patch every method)."""
    params = dict(report.get("params") or {})
    for part in report.get("parts") or []:
        params.update(part.get("params") or {})
    return ScalingRequest(report["method"], float(report.get("factor") or 1), params=tuple(sorted(params.items())))


def card_model_rows(specs: Sequence[ModelSpec], lengths: Sequence[int], methods: str = "none", factor: float | None = None,
                    params: dict[str, Any] | None = None) -> list[Row]:
    """Every row with its report, computed on each model (loaded once, patched and restored per method).

    Args:
        specs: the models; one whose entry names its own methods (``MODEL@REQUEST;...``) takes those.
        lengths: the suite's lengths (a factor left out is sized to the longest).
        methods, factor, params: the requests of every model without its own (``--methods``, ``--factor``,
            ``--param``).
    """
    from hf_posext.evaluation.loading import load_model_and_tokenizer

    rows: list[Row] = []
    for spec_index, spec in enumerate(specs):
        model, _ = load_model_and_tokenizer(spec.model, dtype="float32", device="cpu", adapter=spec.adapter)
        saved = describe(model).to_dict()
        if spec.methods:
            requests = [r for name, given in spec.methods
                        for r in _requests(name, params or {}, given if given is not None else factor, lengths, saved["original_window"])]
        else:
            requests = _requests(methods, params or {}, factor, lengths, saved["original_window"])
        for request in requests:
            if request is None:
                report = saved
            else:
                patch(model, request.method, request.factor, **request.params_dict)
                report = describe(model).to_dict()
                unpatch(model)
            rows.append(Row(len(rows), spec, request, report, base=is_base_row(spec_index, spec, request.method if request else None, saved),
                            saved=saved))
        del model
        gc.collect()
    return rows


def tokenizer_path(spec: ModelSpec) -> str:
    """The folder or hub name lm-eval reads the row's tokenizer from (RULER samples are drawn with it)."""
    from hf_posext.core.loading import check_tokenizer_files
    from hf_posext.evaluation.loading import is_tiny_model_name
    from hf_posext.models import resolve_model_path

    if is_tiny_model_name(spec.model):
        raise ValueError(f"{spec.model}: the RULER tasks need a model whose tokenizer is saved (lm-eval draws the samples "
                         "with it) and the tiny test models have none; save one to a folder (tiny_model(...).save_pretrained(DIR) "
                         "and a tokenizer beside it) and pass DIR, or run the suite's other tasks on it.")
    path = resolve_model_path(spec.model)
    check_tokenizer_files(path, spec.model)
    return path
