"""The base model an adapter was trained on: its name (:func:`same_base_model`) and a fingerprint of its weights,
recorded at training (:func:`base_weights_fingerprints`) and checked when the adapter is applied again
(:func:`check_base_weights`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hf_posext.adapters.record import ADAPTER_RECORD, AdapterMismatchError, AdapterRecord, read_adapter_record
from hf_posext.core.integrity import weights_fingerprint
from hf_posext.user_warnings import warn_at_caller

__all__ = ["same_base_model", "base_weights_fingerprints", "check_base_weights"]

#: The lower-precision dtype whose weights fingerprint is also recorded for a base trained in float32, so that
#: an evaluation loading the base in it is checked too (one more hash: 0.4 s for a 135M-parameter model).
_CAST_DTYPES = (torch.bfloat16,)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _loaded_dtype(model: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def same_base_model(given: str, recorded: str) -> bool:
    """Whether the model names ``given`` and ``recorded`` are one model (the same name, or one local or embedded folder)."""
    if given == recorded:
        return True
    from hf_posext.models import embedded_folder

    def where(name: str) -> Path | None:
        folder = embedded_folder(name)  # an embedded name or its alias: one cached folder
        if folder is not None:
            return folder.resolve()
        return Path(name).expanduser().resolve() if os.path.exists(os.path.expanduser(name)) else None

    given_path, recorded_path = where(given), where(recorded)
    return given_path is not None and given_path == recorded_path


def base_weights_fingerprints(model: torch.nn.Module) -> dict[str, str]:
    """Fingerprints of a base model's weights, by dtype name: the dtype it is loaded in and, for float32, also
    bfloat16 (what loading the same files in bfloat16 gives), so an evaluation in either is checked.

    Uses :func:`hf_posext.core.integrity.weights_fingerprint` (the hash evaluation cells record). Call it
    on the base as loaded, before it is patched or trained.
    """
    dtype = _loaded_dtype(model)
    if dtype is None:
        return {}
    fingerprints = {_dtype_name(dtype): weights_fingerprint(model)}
    if dtype == torch.float32:
        for other in _CAST_DTYPES:
            fingerprints[_dtype_name(other)] = weights_fingerprint(model, other)
    return fingerprints


def check_base_weights(folder: str | os.PathLike, model: torch.nn.Module, base_model: str,
                       record: AdapterRecord | None = None) -> bool:
    """Refuse a loaded base model whose weights are not those the adapter in ``folder`` was trained on.

    Args:
        folder: the adapter folder.
        model: the base model as loaded, before it is patched or adapted.
        base_model: its name (for the message).
        record: the adapter's record (None: read it).

    Returns:
        Whether the weights were checked (False, after a one-line warning, for an adapter that records no
        fingerprint, or a model whose dtype or offloaded weights the record cannot be compared with).

    Raises:
        AdapterMismatchError: other weights; the message names both fingerprints.
    """
    record = record or read_adapter_record(folder)
    recorded = record.base_weights or {}
    if not recorded:
        warn_at_caller(f"the adapter {folder} records no fingerprint of its base model's weights (written before hf-posext "
                       f"recorded one), so {base_model}'s weights are not checked; add it with `hf-posext adapter convert {folder}`")
        return False
    dtype = _loaded_dtype(model)
    if any(p.device.type == "meta" for p in model.parameters()):
        warn_at_caller(f"{base_model} has offloaded (meta) weights, so they are not checked against the adapter {folder}'s record")
        return False
    name = _dtype_name(dtype) if dtype is not None else None
    if name in recorded:
        dtype_name, got = name, weights_fingerprint(model)
    else:
        castable = [other for other in _CAST_DTYPES if _dtype_name(other) in recorded] if dtype in (torch.float32, torch.float64) else []
        if not castable:
            warn_at_caller(f"the adapter {folder} records its base weights in {', '.join(sorted(recorded))}, not {name}: "
                           f"{base_model}'s weights are not checked; load it in {sorted(recorded)[0]} to check them")
            return False
        dtype_name, got = _dtype_name(castable[0]), weights_fingerprint(model, castable[0])
    if got != recorded[dtype_name]:
        found = (f"its {dtype_name} weights are {got[:27]}..., the adapter's {ADAPTER_RECORD} records "
                 f"{recorded[dtype_name][:27]}...")
        if same_base_model(str(base_model), record.base_model):  # the very folder it was trained from, changed since
            raise AdapterMismatchError(
                f"The base model {base_model} now holds other weights than the adapter {folder} was trained on ({found}); "
                "restore that folder's weights, or pass a copy of the original base as the model, or train the adapter "
                "again on these weights.")
        raise AdapterMismatchError(
            f"The base model {base_model!r} does not have the weights the adapter {folder} was trained on: {found}; load "
            f"the base model it was trained on ({record.base_model}).")
    return True
