"""What an adapter folder says about itself: its file names, its record (:data:`ADAPTER_RECORD`: base model, scaling,
base weights) and its PEFT config, read with one-line errors naming the file."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_posext.core.errors import DamagedFileError, RecordError
from hf_posext.core.files import write_json_atomic
from hf_posext.core.integrity import MANIFEST_FILE

__all__ = [
    "ADAPTER_RECORD", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "EXTRAS_FILE", "MANIFEST_FILE", "PEFT_KEY_PREFIX",
    "RECORD_VERSION", "AdapterRecord", "AdapterMismatchError", "AdapterFileError", "write_adapter_record",
    "read_adapter_record", "require_adapter_folder", "read_json_file", "peft_config",
]

#: The file in an adapter folder that says what it was trained on.
ADAPTER_RECORD = "posext_adapter.json"
#: PEFT's adapter config and weights files.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Where adapters written before the PEFT ``modules_to_save`` format kept their trained norms and embeddings
#: (checkpoints still hold it: resuming reloads it).
EXTRAS_FILE = "trainable_extras.safetensors"
#: Prefix of the keys PEFT gives the base model's own parameters in ``adapter_model.safetensors``.
PEFT_KEY_PREFIX = "base_model.model."
#: The version of :data:`ADAPTER_RECORD` written now.
RECORD_VERSION = 2


class AdapterMismatchError(ValueError):
    """An adapter asked for on another base model (name or weights) or another scaling than it was trained with."""


class AdapterFileError(DamagedFileError):
    """An adapter folder whose files are truncated, corrupt, altered or unlisted (the message names the file)."""


@dataclass(frozen=True)
class AdapterRecord:
    """What an adapter was trained on: its base model, the scaling patched into it and its base weights."""

    base_model: str
    method: str
    factor: float
    params: dict[str, Any] = field(default_factory=dict)
    original_window: int | None = None
    current_window: int | None = None
    #: dtype name -> :func:`hf_posext.core.integrity.weights_fingerprint` of the base (None: not recorded).
    base_weights: dict[str, str] | None = None

    @property
    def scaling(self) -> str:
        """``yarn x4`` (with parameters, if any)."""
        params = "".join(f" {k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.method} x{self.factor:g}{params}"


def write_adapter_record(folder: str | os.PathLike, base_model: str, report: Any,
                         base_weights: dict[str, str] | None = None) -> Path:
    """Write :data:`ADAPTER_RECORD` into ``folder`` (atomically) from the trained model's scaling report.

    Args:
        folder: the adapter folder.
        base_model: the base model's name as the recipe gives it (``model.name``).
        report: :func:`hf_posext.describe` of the patched base model (a ``ScalingReport``).
        base_weights: :func:`hf_posext.adapters.base_weights_fingerprints` of the base model as loaded, before training.

    Returns:
        The path of the record.
    """
    path = Path(folder) / ADAPTER_RECORD
    record = {"version": RECORD_VERSION, "base_model": str(base_model), "method": report.method, "factor": float(report.factor),
              "params": dict(report.params), "original_window": report.original_window, "current_window": report.current_window}
    if base_weights:
        record["base_weights"] = dict(base_weights)
    write_json_atomic(path, record, indent=1, final_newline=True)
    return path


def require_adapter_folder(folder: Path) -> None:
    if not (folder / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{folder} is not a LoRA adapter folder (no {ADAPTER_CONFIG}); give the adapter/ folder of a "
                                "training run (runs/NAME/adapter).")


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterFileError(f"{path} is not readable JSON ({str(error).splitlines()[0]}): the {what} is truncated or "
                               "corrupt; restore the adapter folder from the training run.") from None
    if not isinstance(data, dict):
        raise AdapterFileError(f"{path} holds a JSON {type(data).__name__}, not the {what}; restore the adapter folder "
                               "from the training run.")
    return data


def peft_config(folder: Path) -> dict[str, Any]:
    return read_json_file(folder / ADAPTER_CONFIG, "PEFT adapter config")


def read_adapter_record(folder: str | os.PathLike) -> AdapterRecord:
    """The record of the adapter in ``folder`` (no file other than the record and the config is read).

    Raises:
        FileNotFoundError: ``folder`` is not a PEFT adapter folder, or has no record (an adapter trained
            elsewhere: apply it with PEFT yourself, on the base and scaling it was trained with).
        RecordError: the record is not JSON or lacks a field (the message names the file and the field).
        AdapterFileError: ``adapter_config.json`` is not readable JSON.
    """
    folder = Path(folder)
    require_adapter_folder(folder)
    peft_config(folder)
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
    base_weights = data.get("base_weights")
    if base_weights is not None and not (isinstance(base_weights, dict)
                                         and all(isinstance(v, str) for v in base_weights.values())):
        raise RecordError(f"{path} has base_weights {base_weights!r}, not an object of fingerprints; restore it from the training run.")
    return AdapterRecord(data["base_model"], data["method"], float(data["factor"]), params,
                         data.get("original_window"), data.get("current_window"), base_weights or None)
