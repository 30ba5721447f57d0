"""Layer 4, the public API: patch / unpatch / describe / load.

Each call parses the request (:class:`~hf_posext.core.request.ScalingRequest`), picks a backend from
:data:`hf_posext.backends.BACKENDS` and delegates. Nothing here knows a method or a model family by name.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

from torch import nn

from hf_posext.backends import BACKENDS, Backend, backend_for_record, primary_backend
from hf_posext.core.errors import RecordError, UnsupportedModelError, check_model
from hf_posext.core.loading import check_known_model_type, check_weight_files, config_kwargs, model_class_for
from hf_posext.core.record import CONFIG_KEY, DIGEST_FIELD, FREQUENCY_FIELD, ScalingReport, seal_record, text_config, validate_record
from hf_posext.core.record_checks import check_record_digest, check_record_matches_config
from hf_posext.core.request import ScalingRequest
from hf_posext.core.saved_config import check_installed_transformers_reads
from hf_posext.methods import get_method, kinds_of
from hf_posext.user_warnings import warn_at_caller
from hf_posext.backends.rope.surgery import fixed_length

__all__ = [
    "patch", "unpatch", "describe", "load", "fixed_length", "patched_backend", "patched_backends", "select_backend", "read_record",
    "check_record_fits_model",
]


def patched_backend(model: nn.Module) -> Backend | None:
    """The backend whose patch ``model`` carries, if any (of a composition: the attention part's, the outer one)."""
    backends = patched_backends(model)
    return backends[-1] if backends else None


def patched_backends(model: nn.Module) -> list[Backend]:
    """Every backend whose patch ``model`` carries, in the order they were applied: one, or a composition's two
    (the frequency scaling's, then the attention-level method's stacked on it)."""
    patched = [backend for backend in BACKENDS if backend.is_patched(model)]
    return sorted(patched, key=lambda backend: bool(backend.applies_over))


def _current_patch(model: nn.Module) -> list[tuple[Backend, ScalingRequest]]:
    """``(backend, request)`` pairs that re-create the model's current patch, in the order to apply them."""
    return [(backend, backend.current_request(model)) for backend in patched_backends(model)]


def _unpatch_all(model: nn.Module) -> None:
    for backend in reversed(patched_backends(model)):
        backend.unpatch(model)


def _replace_patch(model: nn.Module, apply: Any) -> nn.Module:
    """Undo the model's current patch (all of a composition), run ``apply()``; on failure put the old one back."""
    restore = _current_patch(model)
    _unpatch_all(model)
    try:
        return apply()
    except Exception:
        _unpatch_all(model)
        for backend, request in restore:
            backend.patch(model, request)
        _sealed(model)  # the record as it was
        raise


def _patch_composed(model: nn.Module, request: ScalingRequest, extras: dict[str, Any]) -> nn.Module:
    """A frequency scaling with an attention-level method stacked on it (``yarn+string``), as one patch."""
    frequency, attention = request.sized_parts()
    primary = primary_backend(model)
    if "rope" not in primary.method_kinds:
        raise ValueError(
            f"{request.method}: {attention.method} is an attention-level method for rotary (RoPE) positions, and this "
            f"{type(model).__name__} has {primary.name} positions; patch {frequency.method!r} alone."
        )
    overlay = next(backend for backend in BACKENDS if primary.name in backend.applies_over
                   and "attention" in backend.method_kinds)

    def apply() -> nn.Module:
        primary.patch(model, frequency, **extras)
        return overlay.patch(model, attention)

    return _replace_patch(model, apply)


def select_backend(model: nn.Module, method: str) -> Backend:
    """The backend that applies ``method`` to ``model`` (read-only).

    The backend owning the model's positions (:func:`~hf_posext.backends.primary_backend`) when it has a
    kind with ``method``; else a backend that works on top of it and has ``method`` (Self-Extend on a
    RoPE model); else the owner, whose ``patch`` then says which methods apply.

    Raises:
        UnsupportedModelError: no backend recognises the model's positions.
    """
    kinds = set(kinds_of(method))
    primary = primary_backend(model)
    if kinds & set(primary.method_kinds):
        return primary
    for backend in BACKENDS:
        if primary.name in backend.applies_over and kinds & set(backend.method_kinds):
            return backend
    return primary


def patch(
    model: nn.Module,
    method: str,
    factor: float | None = None,
    *,
    target_length: int | None = None,
    original_max_position_embeddings: int | None = None,
    tokenizer: Any = None,
    **method_params: Any,
) -> nn.Module:
    """Extend a model's context window in place with a scaling method.

    Args:
        model: a loaded transformers model (rotary, learned/sinusoidal/ALiBi or T5-style relative positions).
        method: a name from :func:`hf_posext.available_methods` (e.g. ``"yarn"``, ``"self-extend"``).
        factor: scale s >= 1; the new window is L * s. Give this or ``target_length``.
        target_length: the window you need (factor = target_length / L).
        original_max_position_embeddings: override the pre-training window L read from the config.
        tokenizer: a tokenizer whose ``model_max_length`` follows the new window (restored by ``unpatch``),
            for RoPE and learned/sinusoidal/ALiBi models; saved with the model, it tells serving runtimes
            the extended length (docs/serving.md, docs/absolute.md).
        **method_params: the method's parameters (e.g. ``beta_fast=32``, ``group_size=4``).

    Returns:
        The same model, patched. Patching again replaces the previous scaling (it never compounds).

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: unknown method or parameter, factor < 1 or not finite, factor and target_length
            both, a method of another kind of positions, weights on the meta device, ... In every case the model is left as it was
            (a previous patch included).
        UnsupportedModelError: no supported positional module.

    Example:
        >>> hf_posext.patch(model, "yarn", factor=4)
        >>> hf_posext.patch(model, "linear", target_length=32768)
    """
    check_model(model)
    request = ScalingRequest.from_kwargs(
        method, factor, target_length=target_length,
        original_max_position_embeddings=original_max_position_embeddings, **method_params,
    ).require_size()  # "none" needs no factor; any other method needs a size
    extras = {} if tokenizer is None else {"tokenizer": tokenizer}
    config = text_config(model.config)
    record_before = getattr(config, CONFIG_KEY, None)
    try:
        return _dispatch_patch(model, request, extras)
    except Exception:
        _keep_seal(config, record_before)
        raise


def _keep_seal(config: Any, record_before: Any) -> None:
    """After a failed patch: the previous record back with its seal (a backend that restored it wrote it unsealed)."""
    record = getattr(config, CONFIG_KEY, None)
    if isinstance(record, dict) and isinstance(record_before, dict):
        unsealed = {key: value for key, value in record.items() if key != DIGEST_FIELD}
        if unsealed == {key: value for key, value in record_before.items() if key != DIGEST_FIELD}:
            setattr(config, CONFIG_KEY, record_before)


def _dispatch_patch(model: nn.Module, request: ScalingRequest, extras: dict[str, Any]) -> nn.Module:
    """:func:`patch` once the request is checked: the backend that takes it, replacing any previous patch."""
    if request.is_composed:
        return _sealed(_patch_composed(model, request, extras))
    backend = select_backend(model, request.method)
    if len(patched_backends(model)) > 1:  # a composition is replaced as a whole
        return _sealed(_replace_patch(model, lambda: backend.patch(model, request, **extras)))
    previous = patched_backend(model)
    if previous is None or previous is backend:
        return _sealed(backend.patch(model, request, **extras))
    # Another backend's patch is replaced: undo it, and put it back if the new one fails.
    restore = previous.current_request(model)
    previous.unpatch(model)
    try:
        patched = backend.patch(model, request, **extras)
    except Exception:
        _sealed(previous.patch(model, restore))  # the record as it was
        raise
    if "rope" in previous.method_kinds and "attention" in backend.method_kinds and restore.method != "none":
        warn_at_caller(
            f"{request.method} replaced the {restore.method} x{restore.factor:g} frequency scaling: it runs on the model's "
            f"original rotary frequencies, not {restore.method}'s (one patch at a time). For {request.method} on "
            f"{restore.method}'s frequencies, e.g. on a model fine-tuned with {restore.method}, patch both in one call: "
            f"hf_posext.patch(model, \"{restore.method}+{request.method}\", factor={restore.factor:g})."
        )
    return _sealed(patched)


def _sealed(model: nn.Module) -> nn.Module:
    """``model`` with its record (if any) sealed by its digest (:func:`~hf_posext.core.record.seal_record`), so that a
    saved record edited by hand is refused on load."""
    config = text_config(model.config)
    record = getattr(config, CONFIG_KEY, None)
    if isinstance(record, dict):
        setattr(config, CONFIG_KEY, seal_record(record))
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: restore the original modules, tables and config fields exactly.

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: the model is not patched.
    """
    check_model(model)
    if not patched_backends(model):
        raise ValueError("This model is not patched by hf_posext (nothing to unpatch).")
    _unpatch_all(model)
    return model


def describe(model: nn.Module) -> ScalingReport:
    """Family, position kind, method, factor, original and current window of ``model``.

    Works on unpatched models too (reporting the scaling transformers applies, if any).

    Raises:
        UnsupportedModelError: no backend recognises the model's positions.
    """
    check_model(model)
    backends = patched_backends(model)
    if len(backends) > 1:
        return _composed_report(model, backends)
    backend = backends[0] if backends else primary_backend(model)
    return backend.describe(model)


def _parameter_names(report: ScalingReport) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(get_method(report.method, report.kind).params_cls)}


def _composed_report(model: nn.Module, backends: list[Backend]) -> ScalingReport:
    """One report of a composition: its window is the attention part's, its factor the frequency part's,
    its parameters qualified by their part (``string.shifted_offset``), both parts' reports in ``parts``."""
    frequency, attention = (backend.describe(model) for backend in backends)
    return ScalingReport(
        family=frequency.family, kind=f"{frequency.kind}+{attention.kind}",
        method=f"{frequency.method}+{attention.method}", factor=frequency.factor,
        original_window=frequency.original_window, current_window=max(frequency.current_window, attention.current_window),
        dynamic=frequency.dynamic, sites=[*frequency.sites, *attention.sites],
        params={f"{part.method}.{key}": value for part in (frequency, attention) for key, value in part.params.items()
                if key in _parameter_names(part)},  # the methods' parameters: what re-creates the patch
        stock_loadable=False,
        notes=[f"{attention.method} on {frequency.method}'s frequencies, sized on its {frequency.current_window}-token window"]
        + [f"{part.method}: {note}" for part in (frequency, attention) for note in part.notes],
        parts=[frequency, attention],
    )


def read_record(path: str, config: Any) -> dict[str, Any] | None:
    """The validated ``hf_posext`` record of a loaded config (None when there is none).

    Raises:
        RecordError: a malformed record, or a kind no backend loads (naming ``path``/config.json).
    """
    source = os.path.join(path, "config.json") if os.path.isdir(path) else f"{path} (config.json)"
    record = validate_record(getattr(text_config(config), CONFIG_KEY, None), source)
    if record is None:  # no record of ours: a backend may read another tool's field (Qwen2.5-1M's DCA)
        readers = (getattr(backend, "record_from_config", None) for backend in BACKENDS)
        record = next((r for read in readers if read is not None and (r := read(text_config(config), source))), None)
    if record is not None and backend_for_record(record["kind"]) is None:
        raise RecordError(
            f"{source}: field {CONFIG_KEY!r}.kind is {record['kind']!r}, which this hf_posext cannot load; upgrade hf_posext."
        )
    if record is not None:
        _check_record_params(record, source)
        record = _check_frequency_part(record, source)
        check_record_matches_config(record, config, source)  # the field and both values named
    return record



def _check_frequency_part(record: dict[str, Any], source: str) -> dict[str, Any]:
    """A composition's record with its frequency part validated as a record of its own (named as its field)."""
    frequency = record.get(FREQUENCY_FIELD)
    if frequency is None:
        return record
    where = f"{source} (field {CONFIG_KEY!r}.{FREQUENCY_FIELD})"
    if record.get("kind") != "attention":
        raise RecordError(f"{where}: only an attention-level method is stacked on a frequency scaling, but the record is "
                          f"of kind {record.get('kind')!r}; re-save the model with hf_posext, or remove {CONFIG_KEY!r} to load it unscaled.")
    frequency = validate_record(frequency, where)
    if frequency["kind"] != "rope" or not isinstance(frequency.get("original_config"), dict):
        raise RecordError(f"{where}: a frequency scaling is a 'rope' record with its original_config, got kind "
                          f"{frequency['kind']!r}; re-save the model with hf_posext, or remove {CONFIG_KEY!r} to load it unscaled.")
    _check_record_params(frequency, where)
    return {**record, FREQUENCY_FIELD: frequency}


def _check_record_params(record: dict[str, Any], source: str) -> None:
    """Refuse a record whose method parameters the request parser refuses (named as the record's field)."""
    params = {key: value for key, value in (record.get("params") or {}).items() if value is not None}
    try:
        with warnings.catch_warnings():  # a parameter saved under its former name is read, not reported here
            warnings.simplefilter("ignore")
            ScalingRequest.from_kwargs(record["method"], **params)
    except (TypeError, ValueError) as error:
        raise RecordError(
            f"{source}: field {CONFIG_KEY!r}.params: {error} Re-save the model with hf_posext, or remove "
            f"{CONFIG_KEY!r} to load it unscaled."
        ) from None


def check_record_fits_model(config: Any, record: dict[str, Any], source: str) -> None:
    """Refuse a record whose ``kind`` the model's positions cannot take, before any weight is loaded.

    The model is built on the meta device (no memory, no weights) and its positions detected as
    :func:`patch` detects them. A model that cannot be built that way is not checked here (loading it
    reports its own error).

    Raises:
        RecordError: e.g. a ``rope`` record in a GPT-2 config, or a ``relative`` record in a Llama config.
    """
    import torch

    wanted = backend_for_record(record["kind"])
    if wanted is None:
        return
    # an overlay (Self-Extend, DCA) needs the positions of the backend it works over
    owner = next((b for b in BACKENDS if b.name == wanted.applies_over[0]), wanted) if wanted.applies_over else wanted
    skeleton_config = copy.deepcopy(config)
    text_config(skeleton_config).__dict__.pop(CONFIG_KEY, None)
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            cls = model_class_for(skeleton_config)
            skeleton = cls.from_config(skeleton_config) if cls.__name__.startswith("Auto") else cls(skeleton_config)
    except Exception:  # noqa: BLE001 - a model that cannot be built empty is checked when it loads
        return
    if _detected_kind(owner, skeleton) is not False:
        return
    found = [kind for backend in BACKENDS if backend is not owner and not backend.applies_over
             if isinstance(kind := _detected_kind(backend, skeleton), str)]
    has = f" (it has {found[0]} positions)" if found else ""
    raise RecordError(
        f"{source}: field {CONFIG_KEY!r}.kind is {record['kind']!r}, but this {type(skeleton).__name__} has no "
        f"{'/'.join(owner.method_kinds)} positions{has}: the record does not belong to this model. Re-save the model "
        f"with hf_posext, or remove {CONFIG_KEY!r} to load it unscaled."
    )


def _detected_kind(backend: Backend, skeleton: nn.Module) -> str | bool | None:
    """What ``backend`` finds in a meta-device model: a kind, False (definitely none), None (cannot tell)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return backend.detect(skeleton) or False
    except UnsupportedModelError as error:
        # a probe that had to call a module and failed (a dynamic rotary's .item(), 4.57's "unsupported
        # scalarType") cannot tell on the meta device: only a refusal of its own is a definite "none"
        return None if error.__cause__ is not None else False
    except Exception:  # noqa: BLE001 - a probe that needs real weights cannot tell on the meta device
        return None


def load(name_or_path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a (possibly hf_posext-patched) model and re-apply its scaling exactly.

    Args:
        name_or_path: a folder written by ``save_pretrained``, a hub name, or ``"smollm2-135m"``.
        **from_pretrained_kwargs: passed to ``from_pretrained`` (e.g. ``dtype``).

    Returns:
        The model, patched as it was when saved (or plain, if it was saved unpatched).

    Raises:
        RecordError: the saved record is malformed (the message names the file and the field: a mistyped
            or impossible value, a version that is not a positive integer, a kind its method does not
            have, a kind the model's positions cannot take, a factor or window its config contradicts); raised
            before any weight is loaded. A record edited in any other way (its digest no longer matches) is
            refused once the weights have loaded, before the model is returned.
        DamagedFileError: a weights file of the folder is truncated or corrupt (named).
    """
    from transformers import AutoConfig

    from hf_posext.models import resolve_model_path

    path = resolve_model_path(str(name_or_path))
    check_known_model_type(path, from_pretrained_kwargs)
    check_installed_transformers_reads(path, from_pretrained_kwargs)
    config = AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs))
    record = read_record(path, config)
    if record is not None:
        source = os.path.join(path, "config.json") if os.path.isdir(path) else f"{path} (config.json)"
        check_record_fits_model(config, record, source)
    check_weight_files(path)
    if record is None:
        return model_class_for(config).from_pretrained(path, **from_pretrained_kwargs)
    model = backend_for_record(record["kind"]).load(path, record, **from_pretrained_kwargs)
    # any other hand edit of the record (after the backend's own checks, whose messages name the field)
    check_record_digest(getattr(text_config(config), CONFIG_KEY, None) or {}, source)
    return _sealed(model)
