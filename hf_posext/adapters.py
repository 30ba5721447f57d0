"""LoRA adapters trained by the recipes: what they were trained on, checked before they are applied.

A LoRA adapter only means something on the base model and the position scaling it was trained with: the
same adapter on another base, or on the right base under another scaling (yarn x8 instead of x4, or
dynamic-ntk instead of yarn), loads without complaint in PEFT and computes something nobody trained. The
recipes therefore write :data:`ADAPTER_RECORD` into every adapter folder::

    {"version": 1, "base_model": "smollm2-135m", "method": "yarn", "factor": 4.0, "params": {},
     "original_window": 8192, "current_window": 32768}

and :func:`check_adapter` refuses a base model or scaling other than those, in one line naming both,
before any weights are read. :func:`load_adapted_model` loads the base, patches it with the recorded
scaling, applies the adapter (and the norms or embeddings trained beside it) and merges it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_posext.core.errors import RecordError

__all__ = ["ADAPTER_RECORD", "EXTRAS_FILE", "AdapterRecord", "AdapterMismatchError", "write_adapter_record",
           "read_adapter_record", "check_adapter", "load_trainable_extras", "load_adapted_model"]

#: The file in an adapter folder that says what it was trained on.
ADAPTER_RECORD = "posext_adapter.json"
#: Parameters of the base model trained beside the LoRA matrices (norms, embeddings), saved by the recipes.
EXTRAS_FILE = "trainable_extras.safetensors"
_VERSION = 1


class AdapterMismatchError(ValueError):
    """An adapter asked for on another base model or another scaling than it was trained with."""


@dataclass(frozen=True)
class AdapterRecord:
    """What an adapter was trained on: its base model and the scaling patched into it."""

    base_model: str
    method: str
    factor: float
    params: dict[str, Any] = field(default_factory=dict)
    original_window: int | None = None
    current_window: int | None = None

    @property
    def scaling(self) -> str:
        """``yarn x4`` (with parameters, if any)."""
        params = "".join(f" {k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.method} x{self.factor:g}{params}"


def write_adapter_record(folder: str | os.PathLike, base_model: str, report: Any) -> Path:
    """Write :data:`ADAPTER_RECORD` into ``folder`` (atomically) from the trained model's scaling report.

    Args:
        folder: the adapter folder.
        base_model: the base model's name as the recipe gives it (``model.name``).
        report: :func:`hf_posext.describe` of the patched base model (a ``ScalingReport``).
    """
    path = Path(folder) / ADAPTER_RECORD
    record = {"version": _VERSION, "base_model": str(base_model), "method": report.method, "factor": float(report.factor),
              "params": dict(report.params), "original_window": report.original_window, "current_window": report.current_window}
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=1, default=str) + "\n")
    temporary.replace(path)
    return path


def read_adapter_record(folder: str | os.PathLike) -> AdapterRecord:
    """The record of the adapter in ``folder``.

    Raises:
        FileNotFoundError: ``folder`` is not a PEFT adapter folder, or has no record (an adapter trained
            elsewhere: apply it with PEFT yourself, on the base and scaling it was trained with).
        RecordError: the record is not JSON or lacks a field (the message names the file and the field).
    """
    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a LoRA adapter folder (no adapter_config.json); give the adapter/ folder of a "
                                "training run (runs/NAME/adapter).")
    path = folder / ADAPTER_RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {ADAPTER_RECORD}, so its base model and scaling are unknown; it was not "
                                "written by hf-posext's recipes: apply it with PEFT on the base and scaling it was trained with.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordError(f"{path} is not readable JSON ({str(error).splitlines()[0]}); restore it from the training run.") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path} holds a JSON {type(data).__name__}, not an adapter record; restore it from the training run.")
    for name, kind in (("base_model", str), ("method", str), ("factor", (int, float))):
        if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
            raise RecordError(f"{path} has {name} {data.get(name)!r}, not a {'number' if name == 'factor' else 'name'}; "
                              "restore it from the training run.")
    if not (math.isfinite(data["factor"]) and data["factor"] >= 1):
        raise RecordError(f"{path} has factor {data['factor']!r}, not a number >= 1; restore it from the training run.")
    params = data.get("params") or {}
    if not isinstance(params, dict):
        raise RecordError(f"{path} has params {params!r}, not an object; restore it from the training run.")
    return AdapterRecord(data["base_model"], data["method"], float(data["factor"]), params,
                         data.get("original_window"), data.get("current_window"))


def _same_model(given: str, recorded: str) -> bool:
    if given == recorded:
        return True
    if os.path.exists(given) and os.path.exists(recorded):
        return Path(given).resolve() == Path(recorded).resolve()
    return False


def _differs(recorded: Any, asked: Any) -> bool:
    if isinstance(recorded, (int, float)) and isinstance(asked, (int, float)) and not isinstance(asked, bool):
        return float(recorded) != float(asked)
    return recorded != asked


def check_adapter(folder: str | os.PathLike, base_model: str, method: str | None = None, factor: float | None = None,
                  params: dict[str, Any] | None = None) -> AdapterRecord:
    """The adapter's record, after checking that ``base_model`` (and a scaling, when given) is what it was trained on.

    Args:
        folder: the adapter folder.
        base_model: the base model the adapter is to be applied to.
        method: the scaling method asked for (None: take the adapter's).
        factor: the factor asked for (None: take the adapter's).
        params: method parameters asked for (None: take the adapter's).

    Raises:
        AdapterMismatchError: another base model, method, factor or parameters; the message names both.
        FileNotFoundError, RecordError: see :func:`read_adapter_record`.
    """
    record = read_adapter_record(folder)
    if not _same_model(str(base_model), record.base_model):
        raise AdapterMismatchError(f"The adapter {folder} was trained on base model {record.base_model!r} "
                                   f"({ADAPTER_RECORD}), not {base_model!r}: pass --model {record.base_model}.")
    asked_method = record.method if method is None else method
    asked_factor = record.factor if factor is None else float(factor)
    # parameters given explicitly must equal the recorded ones (the record also holds the defaults it resolved)
    other_params = {k: v for k, v in (params or {}).items() if k not in record.params or _differs(record.params[k], v)}
    if asked_method != record.method or asked_factor != record.factor or other_params:
        trained = f"{record.method} x{record.factor:g}" + "".join(f" {k}={record.params.get(k)}" for k in sorted(other_params))
        asked = f"{asked_method} x{asked_factor:g}" + "".join(f" {k}={v}" for k, v in sorted(other_params.items()))
        raise AdapterMismatchError(f"The adapter {folder} was trained with {trained} ({ADAPTER_RECORD}), not {asked}: evaluate "
                                   f"it with --methods {record.method} --factor {record.factor:g}, or train an adapter for that scaling.")
    return record


def load_trainable_extras(model: Any, folder: str | os.PathLike, expected: list[str] | None = None) -> bool:
    """Copy the norms or embeddings trained beside a LoRA adapter (:data:`EXTRAS_FILE` in ``folder``, a saved
    adapter or a checkpoint) into ``model``, a ``PeftModel`` or a plain model.

    Args:
        model: the model to load them into (its base model's parameters, if it is a ``PeftModel``).
        folder: the adapter or checkpoint folder.
        expected: the names the caller trains; the file must hold exactly these (None: any names the model has).

    Returns:
        Whether ``folder`` held the file (nothing is loaded when it does not).

    Raises:
        RecordError: the file names a parameter the model does not have (the adapter belongs to another model).
        ValueError: the file's names differ from ``expected``.
    """
    from safetensors.torch import load_file

    path = Path(folder) / EXTRAS_FILE
    if not path.is_file():
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = dict(base.named_parameters())
    saved = load_file(str(path))
    unknown = sorted(set(saved) - set(parameters))
    if unknown:
        raise RecordError(f"{path} holds {unknown[0]!r}, which {type(base).__name__} does not have: the adapter belongs to another model.")
    if expected is not None and set(saved) != set(expected):
        raise ValueError(f"{path} holds {sorted(set(saved) ^ set(expected))[:3]}... that the recipe does not train "
                         "(or misses what it does): set finetune.train_norms/train_embeddings as for that adapter.")
    with torch.no_grad():
        for name, value in saved.items():
            parameters[name].copy_(value.to(parameters[name].device, parameters[name].dtype))
    return True


def load_adapted_model(base_model: str, folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                       device: str | None = None, **load_kwargs: Any) -> torch.nn.Module:
    """Load ``base_model``, patch it with the adapter's recorded scaling, apply the adapter and merge it.

    The returned model is a plain transformers model carrying the scaling (``hf_posext.describe`` reports
    it); ``save_pretrained`` writes a merged model that ``hf_posext.load`` reads back.

    Raises:
        AdapterMismatchError, FileNotFoundError, RecordError: see :func:`check_adapter` (before any weights load).
    """
    from peft import PeftModel

    from hf_posext.api import patch
    from hf_posext.models import load_model

    record = check_adapter(folder, base_model)
    model = load_model(base_model, dtype=dtype, device=device, **load_kwargs)
    patch(model, record.method, record.factor, **record.params)
    adapted = PeftModel.from_pretrained(model, str(folder))
    load_trainable_extras(adapted, folder)
    return adapted.merge_and_unload().eval()
