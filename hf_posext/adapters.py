"""LoRA adapters trained by the recipes: saved in PEFT's own format, checked before they are applied.

A LoRA adapter only means something on the base model and the position scaling it was trained with: the
same adapter on another base, or on the right base under another scaling (yarn x8 instead of x4, or
dynamic-ntk instead of yarn), loads without complaint in PEFT and computes something nobody trained.

An adapter folder written by the recipes (or by :func:`convert_adapter`) holds

* ``adapter_config.json`` and ``adapter_model.safetensors``, as PEFT writes them: the norms and embeddings
  trained beside the LoRA matrices (LongLoRA) are PEFT ``modules_to_save``, so stock
  ``PeftModel.from_pretrained`` restores them, and ``base_model_name_or_path`` is the hub id of the base
  (``HuggingFaceTB/SmolLM2-135M-Instruct`` for the embedded ``smollm2-135m``), never a cache path;
* :data:`ADAPTER_RECORD`, what it was trained on::

    {"version": 2, "base_model": "smollm2-135m", "method": "yarn", "factor": 4.0, "params": {},
     "original_window": 8192, "current_window": 32768,
     "base_weights": {"float32": "sha256-all:...", "bfloat16": "sha256-all:..."}}

* :data:`MANIFEST_FILE`, the sha256 of every other file (written last, as checkpoints have it).

:func:`check_adapter` refuses, before any weights are read, a damaged or altered folder and a base model or
scaling other than the recorded ones, each in one line naming both; :func:`load_adapted_model` then loads
the base, refuses it when its weights are not the recorded ones, patches it with the recorded scaling,
applies the adapter and merges it. Adapters written before this format (their trained norms in
:data:`EXTRAS_FILE`, no manifest, no weights fingerprint) still load, with a one-line warning;
``hf-posext adapter convert OLD [NEW]`` rewrites them in this format.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from hf_posext.core.errors import DamagedFileError, RecordError
from hf_posext.core.paths import replace_folder
from hf_posext.methods import split_composition
from hf_posext.training.checkpoints import CHECKSUMS_FILE, file_sha256, write_checksums
from hf_posext.user_warnings import warn_at_caller

__all__ = [
    "ADAPTER_RECORD", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "EXTRAS_FILE", "MANIFEST_FILE", "AdapterRecord",
    "AdapterMismatchError", "AdapterFileError", "write_adapter_record", "read_adapter_record", "verify_adapter_files",
    "check_adapter", "base_weights_fingerprints", "check_base_weights", "trained_module_names", "write_trained_modules",
    "saved_extra_names", "is_old_format", "apply_adapter", "load_trainable_extras", "load_adapted_model",
    "finish_adapter_folder", "convert_adapter", "save_merged", "add_adapter_arguments", "run_adapter",
]

#: The file in an adapter folder that says what it was trained on.
ADAPTER_RECORD = "posext_adapter.json"
#: PEFT's adapter config and weights files.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Where adapters written before the PEFT ``modules_to_save`` format kept their trained norms and embeddings
#: (checkpoints still hold it: resuming reloads it).
EXTRAS_FILE = "trainable_extras.safetensors"
#: The sha256 of every other file of an adapter folder (the same file and format as a checkpoint's).
MANIFEST_FILE = CHECKSUMS_FILE
#: Prefix of the keys PEFT gives the base model's own parameters in ``adapter_model.safetensors``.
PEFT_KEY_PREFIX = "base_model.model."
_VERSION = 2
#: The lower-precision dtype whose weights fingerprint is also recorded for a base trained in float32, so that
#: an evaluation loading the base in it is checked too (one more hash: 0.4 s for a 135M-parameter model).
_CAST_DTYPES = (torch.bfloat16,)


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
    #: dtype name -> :func:`hf_posext.evaluation.fingerprints.weights_fingerprint` of the base (None: not recorded).
    base_weights: dict[str, str] | None = None

    @property
    def scaling(self) -> str:
        """``yarn x4`` (with parameters, if any)."""
        params = "".join(f" {k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.method} x{self.factor:g}{params}"


def _write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_adapter_record(folder: str | os.PathLike, base_model: str, report: Any,
                         base_weights: dict[str, str] | None = None) -> Path:
    """Write :data:`ADAPTER_RECORD` into ``folder`` (atomically) from the trained model's scaling report.

    Args:
        folder: the adapter folder.
        base_model: the base model's name as the recipe gives it (``model.name``).
        report: :func:`hf_posext.describe` of the patched base model (a ``ScalingReport``).
        base_weights: :func:`base_weights_fingerprints` of the base model as loaded, before training.

    Returns:
        The path of the record.
    """
    path = Path(folder) / ADAPTER_RECORD
    record = {"version": _VERSION, "base_model": str(base_model), "method": report.method, "factor": float(report.factor),
              "params": dict(report.params), "original_window": report.original_window, "current_window": report.current_window}
    if base_weights:
        record["base_weights"] = dict(base_weights)
    _write_text_atomic(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def _require_adapter_folder(folder: Path) -> None:
    if not (folder / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{folder} is not a LoRA adapter folder (no {ADAPTER_CONFIG}); give the adapter/ folder of a "
                                "training run (runs/NAME/adapter).")


def _read_json_file(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterFileError(f"{path} is not readable JSON ({str(error).splitlines()[0]}): the {what} is truncated or "
                               "corrupt; restore the adapter folder from the training run.") from None
    if not isinstance(data, dict):
        raise AdapterFileError(f"{path} holds a JSON {type(data).__name__}, not the {what}; restore the adapter folder "
                               "from the training run.")
    return data


def _peft_config(folder: Path) -> dict[str, Any]:
    return _read_json_file(folder / ADAPTER_CONFIG, "PEFT adapter config")


def read_adapter_record(folder: str | os.PathLike) -> AdapterRecord:
    """The record of the adapter in ``folder`` (no file other than the record and the config is read).

    Raises:
        FileNotFoundError: ``folder`` is not a PEFT adapter folder, or has no record (an adapter trained
            elsewhere: apply it with PEFT yourself, on the base and scaling it was trained with).
        RecordError: the record is not JSON or lacks a field (the message names the file and the field).
        AdapterFileError: ``adapter_config.json`` is not readable JSON.
    """
    folder = Path(folder)
    _require_adapter_folder(folder)
    _peft_config(folder)
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


# --------------------------------------------------------------------------------------------------
# Integrity: the manifest, and files that a loader would otherwise read half-way
# --------------------------------------------------------------------------------------------------


def _listed_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest (and its temporary), by relative path."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST_FILE and not p.name.startswith(f".{MANIFEST_FILE}"))


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # SafetensorError, OSError: both mean the file cannot be used
        detail = " ".join(str(error).split())
        raise AdapterFileError(f"{path} is truncated or corrupt ({detail}); restore the adapter folder from the training run.") from None


def verify_adapter_files(folder: str | os.PathLike) -> bool:
    """Refuse an adapter folder whose files are damaged or altered, before anything is loaded from it.

    With a manifest (:data:`MANIFEST_FILE`), every listed file must exist with its sha256 and every file of the
    folder must be listed. Without one (an adapter written before it), the folder loads after a one-line
    warning. Either way ``adapter_config.json`` must be JSON and every ``*.safetensors`` file readable.

    Args:
        folder: the adapter folder.

    Returns:
        Whether the folder has a manifest (and matched it).

    Raises:
        FileNotFoundError: ``folder`` is not an adapter folder.
        AdapterFileError: a truncated, corrupt, edited, missing or unlisted file (named).
    """
    folder = Path(folder)
    _require_adapter_folder(folder)
    manifest = folder / MANIFEST_FILE
    listed: dict[str, str] | None = None
    if manifest.is_file():
        data = _read_json_file(manifest, "adapter's manifest")
        listed = data.get("files")
        if not isinstance(listed, dict):
            raise AdapterFileError(f"{manifest} has no files object; restore the adapter folder from the training run.")
        for name in sorted(listed):
            path = folder / name
            if not path.is_file():
                raise AdapterFileError(f"The adapter {folder} is missing {name} (listed in {MANIFEST_FILE}); restore the "
                                       "adapter folder from the training run.")
            if file_sha256(path) != listed[name]:
                raise AdapterFileError(f"{path} does not match its sha256 in {MANIFEST_FILE} (corrupt, truncated or edited); "
                                       "restore the adapter folder from the training run.")
        unlisted = sorted(set(_listed_files(folder)) - set(listed))
        if unlisted:
            raise AdapterFileError(f"The adapter {folder} holds {unlisted[0]}, which {MANIFEST_FILE} does not list: remove it, "
                                   "or restore the adapter folder from the training run.")
    config = _peft_config(folder)
    for path in sorted(folder.glob("*.safetensors")):
        _check_safetensors(path)
    if listed is None:
        warn_at_caller(f"the adapter {folder} has no {MANIFEST_FILE} (written before hf-posext added one), so nothing proves "
                       f"its files are the ones its run wrote; `hf-posext adapter convert {folder}` checks its weights "
                       "(finite, of trained magnitudes, shaped for its base) before it adds one")
    _check_contents(folder, config)
    return listed is not None


def _check_contents(folder: Path, config: dict[str, Any]) -> None:
    """Refuse what checksums cannot: weights no training writes, a rank or record that contradicts the weights, itself
    or its run's recipe (:mod:`hf_posext.adapter_checks`)."""
    from hf_posext.adapter_checks import modules_problem, rank_problem, record_problem, tensor_problem

    checks = [lambda path=path: tensor_problem(path) for path in sorted(folder.glob("*.safetensors"))]
    if (folder / ADAPTER_WEIGHTS).is_file():
        checks.append(lambda: rank_problem(folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS, config))
        checks.append(lambda: modules_problem(folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS, config, PEFT_KEY_PREFIX))
    checks.append(lambda: record_problem(folder / ADAPTER_RECORD))
    for check in checks:
        problem = check()
        if problem:
            raise AdapterFileError(f"{problem}: damaged or edited (checksums prove only that files are unchanged since "
                                   "they were listed); restore the adapter folder from the training run.")


def _differs(recorded: Any, asked: Any) -> bool:
    if isinstance(recorded, (int, float)) and isinstance(asked, (int, float)) and not isinstance(asked, bool):
        return float(recorded) != float(asked)
    return recorded != asked


def _same_model(given: str, recorded: str) -> bool:
    if given == recorded:
        return True
    from hf_posext.models import EMBEDDED_MODELS, cache_dir

    def where(name: str) -> Path | None:
        if name.strip().lower() in EMBEDDED_MODELS:
            return (cache_dir() / name.strip().lower()).resolve()
        return Path(name).expanduser().resolve() if os.path.exists(os.path.expanduser(name)) else None

    given_path, recorded_path = where(given), where(recorded)
    return given_path is not None and given_path == recorded_path


def check_adapter(folder: str | os.PathLike, base_model: str, method: str | None = None, factor: float | None = None,
                  params: dict[str, Any] | None = None, *, target_length: int | None = None,
                  original_window: int | None = None, verify: bool = True, suggest: str = "eval") -> AdapterRecord:
    """The adapter's record, after checking its files and that ``base_model`` (and a scaling, when given) is what
    it was trained on; nothing but the folder's files is read.

    Args:
        folder: the adapter folder.
        base_model: the base model the adapter is to be applied to.
        method: the scaling method asked for (None: take the adapter's).
        factor: the factor asked for (None: take the adapter's, or ``target_length`` / the original window).
        params: method parameters asked for (None: take the adapter's).
        target_length: the window asked for instead of a factor, resolved against ``original_window``.
        original_window: the original window asked for (None: the adapter's recorded one).
        verify: check the folder's files first (:func:`verify_adapter_files`).
        suggest: what the fix in a mismatch message names: ``"eval"`` (command-line flags) or ``"recipe"``
            (recipe keys).

    A composition asked for (``yarn+string``) on an adapter trained with its frequency part alone (``yarn``) is
    that frequency scaling with an attention-level method stacked on it at evaluation: only the frequency part,
    its factor and its parameters are checked against the record.

    Returns:
        The adapter's :class:`AdapterRecord`.

    Raises:
        AdapterMismatchError: another base model, method, factor, window or parameters; the message names both.
        AdapterFileError: a damaged or altered file (see :func:`verify_adapter_files`).
        FileNotFoundError, RecordError: see :func:`read_adapter_record`.
    """
    if verify:
        verify_adapter_files(folder)
    record = read_adapter_record(folder)
    recipe = suggest == "recipe"
    if not _same_model(str(base_model), record.base_model) and not (
            record.base_weights and os.path.isdir(os.path.expanduser(str(base_model)))):
        # a local folder other than the recorded one (a copy, a moved base) is judged by its weights once it loads
        fix = (f"set model.name: {record.base_model} in the recipe (or drop finetune.init_adapter to train a new adapter)"
               if recipe else f"pass --model {record.base_model}")
        raise AdapterMismatchError(f"The adapter {folder} was trained on base model {record.base_model!r} "
                                   f"({ADAPTER_RECORD}), not {base_model!r}: {fix}.")
    composition = split_composition(method) if isinstance(method, str) else None
    if composition is not None and split_composition(record.method) is None:
        frequency = composition[0]  # the attention part is stacked at evaluation: nothing of it was trained
        method = frequency
        params = {key[len(frequency) + 1:]: value for key, value in (params or {}).items() if key.startswith(frequency + ".")}
    if original_window is not None and record.original_window is not None and int(original_window) != int(record.original_window):
        raise AdapterMismatchError(f"The adapter {folder} was trained from an original window of {record.original_window} tokens "
                                   f"({ADAPTER_RECORD}), not {original_window}: leave the original window at the model's.")
    asked_method = record.method if method is None else method
    if factor is None and target_length is not None:
        window = original_window or record.original_window
        if not window:
            raise AdapterMismatchError(f"The adapter {folder} records no original window ({ADAPTER_RECORD}), so "
                                       f"target_length={target_length} cannot be checked against it: give the factor "
                                       f"instead (x{record.factor:g}).")
        factor = int(target_length) / int(window)
    asked_factor = record.factor if factor is None else float(factor)
    # parameters given explicitly must equal the recorded ones (the record also holds the defaults it resolved)
    other_params = {k: v for k, v in (params or {}).items() if k not in record.params or _differs(record.params[k], v)}
    if asked_method != record.method or asked_factor != record.factor or other_params:
        trained = f"{record.method} x{record.factor:g}" + "".join(f" {k}={record.params.get(k)}" for k in sorted(other_params))
        asked = f"{asked_method} x{asked_factor:g}" + "".join(f" {k}={v}" for k, v in sorted(other_params.items()))
        if target_length is not None and factor is not None:
            asked += f" (target_length {target_length})"
        fix = (f"set scaling.method: {record.method} and scaling.factor: {record.factor:g} in the recipe, or drop "
               "finetune.init_adapter" if recipe else
               f"evaluate it with --methods {record.method} --factor {record.factor:g} (an attention-level method may be "
               f"stacked on it: --methods {record.method}+string), or train an adapter for that scaling")
        raise AdapterMismatchError(f"The adapter {folder} was trained with {trained} ({ADAPTER_RECORD}), not {asked}: {fix}.")
    return record


# --------------------------------------------------------------------------------------------------
# The base model's weights
# --------------------------------------------------------------------------------------------------


class _CastParameters:
    """Stands in for a model in :func:`weights_fingerprint`: its parameters cast to ``dtype``, one at a time."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach().to(self.dtype) if parameter.is_floating_point() else parameter


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _loaded_dtype(model: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def base_weights_fingerprints(model: torch.nn.Module) -> dict[str, str]:
    """Fingerprints of a base model's weights, by dtype name: the dtype it is loaded in and, for float32, also
    bfloat16 (what loading the same files in bfloat16 gives), so an evaluation in either is checked.

    Uses :func:`hf_posext.evaluation.fingerprints.weights_fingerprint` (the hash evaluation cells record). Call it
    on the base as loaded, before it is patched or trained.
    """
    from hf_posext.evaluation.fingerprints import weights_fingerprint

    dtype = _loaded_dtype(model)
    if dtype is None:
        return {}
    fingerprints = {_dtype_name(dtype): weights_fingerprint(model)}
    if dtype == torch.float32:
        for other in _CAST_DTYPES:
            fingerprints[_dtype_name(other)] = weights_fingerprint(_CastParameters(model, other))
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
    from hf_posext.evaluation.fingerprints import weights_fingerprint

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
        dtype_name, got = _dtype_name(castable[0]), weights_fingerprint(_CastParameters(model, castable[0]))
    if got != recorded[dtype_name]:
        found = (f"its {dtype_name} weights are {got[:27]}..., the adapter's {ADAPTER_RECORD} records "
                 f"{recorded[dtype_name][:27]}...")
        if _same_model(str(base_model), record.base_model):  # the very folder it was trained from, changed since
            raise AdapterMismatchError(
                f"The base model {base_model} now holds other weights than the adapter {folder} was trained on ({found}); "
                "restore that folder's weights, or pass a copy of the original base as the model, or train the adapter "
                "again on these weights.")
        raise AdapterMismatchError(
            f"The base model {base_model!r} does not have the weights the adapter {folder} was trained on: {found}; load "
            f"the base model it was trained on ({record.base_model}).")
    return True


# --------------------------------------------------------------------------------------------------
# Trained norms and embeddings as PEFT modules_to_save
# --------------------------------------------------------------------------------------------------


def trained_module_names(model: torch.nn.Module, parameter_names: list[str]) -> tuple[list[str], tuple[str, str] | None]:
    """The PEFT ``modules_to_save`` entries for the base parameters ``parameter_names`` trained beside LoRA.

    PEFT wraps every module whose name ends with an entry (a plain string suffix: ``norm`` would also match
    ``input_layernorm``), so the entries are full module names, and the modules they match are checked to be
    exactly the trained ones.

    Args:
        model: the base model (a plain model, not a ``PeftModel``; weights may be on the meta device).
        parameter_names: the trained parameters (e.g. ``model.layers.0.input_layernorm.weight``).

    Returns:
        ``(module names, tied)``: the entries, and for an output head tied to a trained input embedding the
        pair (head weight, embedding weight), e.g. ``("lm_head.weight", "model.embed_tokens.weight")`` (PEFT saves
        the head too and ties it when ``ensure_weight_tying`` is set), or None.

    Raises:
        ValueError: a name that is no parameter of ``model``, a module trained in part, or entries that would
            make PEFT wrap other modules too.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    names = sorted({name.rsplit(".", 1)[0] for name in parameter_names})
    trained = set(parameter_names)
    for module_name in names:
        module = modules.get(module_name)
        if module is None:
            raise ValueError(f"{module_name} is no module of {type(model).__name__}: the trained parameters belong to another model.")
        own = {f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False)}
        if not own <= trained or list(module.children()):
            raise ValueError(f"{module_name} is trained only in part ({sorted(own - trained)[:2]} untrained) or has submodules: "
                             "PEFT modules_to_save saves whole modules.")
    tied = None
    input_embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = next((n for n in names if modules[n] is input_embeddings), None) if input_embeddings is not None else None
    if (embedding is not None and output_embeddings is not None
            and getattr(output_embeddings, "weight", None) is getattr(input_embeddings, "weight", 0)):
        head = next(n for n, m in modules.items() if m is output_embeddings)
        tied = (f"{head}.weight", f"{embedding}.weight")
    wrapped = {key for key in modules if key and any((PEFT_KEY_PREFIX + key).endswith(entry) for entry in names)}
    if wrapped != set(names):
        raise ValueError(f"PEFT's modules_to_save {names[:3]}... would also wrap {sorted(wrapped - set(names))[:3]}, which "
                         "are not trained: rename the modules or train them too.")
    return names, tied


def write_trained_modules(folder: str | os.PathLike, extras: dict[str, torch.Tensor], module_names: list[str],
                          tied: tuple[str, str] | None, base_model_name_or_path: str) -> None:
    """Put trained base parameters into a PEFT adapter folder as PEFT itself saves ``modules_to_save``.

    ``adapter_config.json`` gets ``modules_to_save`` (and ``ensure_weight_tying`` for a tied head) and
    ``base_model_name_or_path``; ``adapter_model.safetensors`` gets each tensor under
    ``base_model.model.<parameter name>`` (the tied head too, as ``base_model.model.<head>.weight``). Both files
    are replaced atomically.

    Args:
        folder: a folder written by ``PeftModel.save_pretrained`` (LoRA weights only).
        extras: base parameter name -> trained value.
        module_names: the modules they belong to (:func:`trained_module_names`).
        tied: (head weight, embedding weight) of an output head tied to a trained input embedding, or None.
        base_model_name_or_path: what stock tools should load as the base (a hub id or the path the user gave).
    """
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    config = _peft_config(folder)
    config["modules_to_save"] = list(module_names) or None
    if tied is not None:
        config["ensure_weight_tying"] = True
    config["base_model_name_or_path"] = base_model_name_or_path
    weights = load_file(str(folder / ADAPTER_WEIGHTS))
    for name, value in extras.items():
        weights[PEFT_KEY_PREFIX + name] = value.detach().cpu().contiguous()
    if tied is not None:  # the head shares the trained input embedding's weight: PEFT saves it under both names
        head, embedding = tied
        weights[PEFT_KEY_PREFIX + head] = weights[PEFT_KEY_PREFIX + embedding].clone()
    temporary = folder / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(weights, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, folder / ADAPTER_WEIGHTS)
    _write_text_atomic(folder / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True))


def saved_extra_names(folder: str | os.PathLike) -> list[str]:
    """The base parameters saved beside the LoRA matrices of the adapter in ``folder`` (either format), tied
    duplicates left out: what a recipe continuing it must train (``finetune.train_norms``/``train_embeddings``)."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / EXTRAS_FILE).is_file():
        with safe_open(str(folder / EXTRAS_FILE), framework="pt") as handle:
            return sorted(handle.keys())
    modules = _peft_config(folder).get("modules_to_save") or []
    with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as handle:
        keys = [k[len(PEFT_KEY_PREFIX):] for k in handle.keys() if k.startswith(PEFT_KEY_PREFIX)]
    return sorted(k for k in keys if k.rsplit(".", 1)[0] in modules)


def is_old_format(folder: str | os.PathLike) -> bool:
    """Whether the adapter in ``folder`` keeps its trained norms/embeddings in :data:`EXTRAS_FILE` (read by hf-posext only)."""
    return (Path(folder) / EXTRAS_FILE).is_file()


def load_trainable_extras(model: Any, folder: str | os.PathLike, expected: list[str] | None = None) -> bool:
    """Copy the norms or embeddings trained beside a LoRA adapter (:data:`EXTRAS_FILE` in ``folder``, a
    checkpoint or an adapter of the older format) into ``model``, a ``PeftModel`` or a plain model.

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
    _copy_into_base(model, load_file(str(path)), path, expected)
    return True


def _copy_into_base(model: Any, saved: dict[str, torch.Tensor], path: Path, expected: list[str] | None) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = dict(base.named_parameters())
    unknown = sorted(set(saved) - set(parameters))
    if unknown:
        raise RecordError(f"{path} holds {unknown[0]!r}, which {type(base).__name__} does not have: the adapter belongs to another model.")
    if expected is not None and set(saved) != set(expected):
        raise ValueError(f"{path} holds {sorted(set(saved) ^ set(expected))[:3]}... that the recipe does not train "
                         "(or misses what it does): set finetune.train_norms/train_embeddings as for that adapter.")
    with torch.no_grad():
        for name, value in saved.items():
            parameters[name].copy_(value.to(parameters[name].device, parameters[name].dtype))


@contextmanager
def _without_peft_deprecation_noise() -> Iterator[None]:
    """PEFT 0.21 reads ``model.is_gradient_checkpointing``, which transformers 5 deprecates with a FutureWarning on
    every adapter load: a warning about two libraries' internals that a user can do nothing about. Only that
    message is silenced; every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_adapter(model: torch.nn.Module, folder: str | os.PathLike, *, is_trainable: bool = False,
                  extras_in_place: bool = False, expected_extras: list[str] | None = None) -> Any:
    """Wrap ``model`` (the patched base) in the PEFT adapter of ``folder``, trained norms/embeddings included.

    An adapter in the PEFT ``modules_to_save`` format loads as stock PEFT loads it; one of the older format gets
    its :data:`EXTRAS_FILE` copied into the base model.

    Args:
        model: the base model, patched with the adapter's scaling.
        folder: a checked adapter folder (:func:`check_adapter`).
        is_trainable: load the LoRA weights trainable (continuing the adapter).
        extras_in_place: copy the trained norms/embeddings into the base model's own parameters instead of
            PEFT's ``modules_to_save`` wrappers, so that the model is built exactly as a fresh recipe builds it
            (the recipes train them in place: continuing an adapter must not change the training's numbers).
        expected_extras: with ``extras_in_place``, the names the caller trains (checked, see
            :func:`load_trainable_extras`).

    Returns:
        The ``peft.PeftModel``.
    """
    from peft import PeftConfig, PeftModel
    from safetensors.torch import load_file

    folder = Path(folder)
    if is_old_format(folder) or not extras_in_place:
        with _without_peft_deprecation_noise():
            adapted = PeftModel.from_pretrained(model, str(folder), is_trainable=is_trainable)
        load_trainable_extras(adapted, folder, expected=expected_extras if extras_in_place else None)
        return adapted
    config = PeftConfig.from_pretrained(str(folder))
    modules = list(config.modules_to_save or [])
    config.modules_to_save = None
    if hasattr(config, "ensure_weight_tying"):
        config.ensure_weight_tying = False
    with _without_peft_deprecation_noise():
        adapted = PeftModel.from_pretrained(model, str(folder), config=config, is_trainable=is_trainable)
    saved = {k[len(PEFT_KEY_PREFIX):]: v for k, v in load_file(str(folder / ADAPTER_WEIGHTS)).items()
             if k.startswith(PEFT_KEY_PREFIX) and k[len(PEFT_KEY_PREFIX):].rsplit(".", 1)[0] in modules}
    _copy_into_base(adapted, saved, folder / ADAPTER_WEIGHTS, expected_extras)
    return adapted


def load_adapted_model(base_model: str, folder: str | os.PathLike, *, method: str | None = None,
                       dtype: torch.dtype = torch.float32, device: str | None = None, **load_kwargs: Any) -> torch.nn.Module:
    """Load ``base_model``, patch it with the adapter's recorded scaling, apply the adapter and merge it.

    ``method`` stacks an attention-level method on the recorded frequency scaling in the same call (the README's
    headline: ``load_adapted_model("smollm2-135m", adapter, method="yarn+string")`` is the adapter's yarn x4 with
    STRING sized on its 32768-token window); its frequency part must be the recorded one. None: the recorded
    scaling alone.

    The returned model is a plain transformers model carrying the scaling (``hf_posext.describe`` reports
    it); ``save_pretrained`` writes a merged model that ``hf_posext.load`` reads back (:func:`save_merged`
    writes it with its tokenizer).

    Args:
        base_model: the base the adapter was trained on (hub id, folder or embedded name).
        folder: the adapter folder.
        dtype: weights dtype.
        device: where to put the model.
        **load_kwargs: passed to ``from_pretrained``.

    Raises:
        AdapterMismatchError, AdapterFileError, FileNotFoundError, RecordError: see :func:`check_adapter`
            (before any weights load) and :func:`check_base_weights` (after the base loads).
    """
    from hf_posext.api import patch
    from hf_posext.models import load_model

    stacked = None
    if method is not None:
        from hf_posext.core.request import ScalingRequest

        stacked = ScalingRequest.from_kwargs(method)  # validated before anything loads
    record = check_adapter(folder, base_model, None if stacked is None else stacked.method)
    model = load_model(base_model, dtype=dtype, device=device, **load_kwargs)
    check_base_weights(folder, model, base_model, record)
    patch(model, record.method, record.factor, **record.params)
    merged = apply_adapter(model, folder).merge_and_unload().eval()
    if stacked is not None and stacked.is_composed:
        frequency_params = {f"{record.method}.{key}": value for key, value in record.params.items()}
        patch(merged, stacked.method, record.factor, **frequency_params, **stacked.params_dict)
    return merged


def save_merged(base_model: str, folder: str | os.PathLike, out: str | os.PathLike, *,
                dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write ``out``: the adapter merged into its base, with the scaling in ``config.json`` and the base's tokenizer
    (``model_max_length`` = the scaled window), ready for ``hf_posext.load``, stock ``from_pretrained`` (for the
    methods transformers knows), ``hf-posext lm-eval --model_args pretrained=OUT`` and ``hf-posext export``.

    Args:
        base_model: the base the adapter was trained on.
        folder: the adapter folder.
        out: the new folder (must not exist or be empty unless ``overwrite``).
        dtype: weights dtype.
        overwrite: replace a non-empty ``out``.

    Returns:
        The path of the written folder.

    Raises:
        FileExistsError: ``out`` is not empty and ``overwrite`` is not set (before anything loads).
        AdapterMismatchError, AdapterFileError, FileNotFoundError, RecordError: see :func:`load_adapted_model`.
    """
    from hf_posext.api import describe
    from hf_posext.core.paths import check_output_folder
    from hf_posext.models import load_tokenizer

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose a new folder or pass overwrite=True (--overwrite).")
    check_output_folder(out, "out", "the merged model")
    check_adapter(folder, base_model)
    tokenizer = load_tokenizer(base_model)  # a damaged tokenizer must not cost a model load
    model = load_adapted_model(base_model, folder, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        model.save_pretrained(str(staged))
        tokenizer.model_max_length = describe(model).current_window
        tokenizer.save_pretrained(str(staged))
        _replace_folder(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out


def _replace_folder(staged: Path, out: Path) -> None:
    """Move the finished folder ``staged`` to ``out`` (replacing it atomically), readable as a folder made by hand."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o777 & ~umask)
    for path in staged.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    replace_folder(staged, out)


# --------------------------------------------------------------------------------------------------
# Writing and converting adapter folders
# --------------------------------------------------------------------------------------------------


def finish_adapter_folder(folder: str | os.PathLike) -> Path:
    """Write the adapter's manifest (:data:`MANIFEST_FILE`, the sha256 of every other file): the last file written."""
    return write_checksums(Path(folder))


def convert_adapter(source: str | os.PathLike, out: str | os.PathLike | None = None, *, base_model: str | None = None,
                    model_card: str | None = None, overwrite: bool = False) -> Path:
    """Rewrite an adapter folder in the current format: trained norms/embeddings as PEFT ``modules_to_save``,
    ``base_model_name_or_path`` the hub id, a fingerprint of the base weights, and the manifest.

    The base model is loaded once (for its structure and weights fingerprint). Converting an adapter that is
    already in the current format only refreshes these fields; the LoRA and trained weights are copied exactly.

    Args:
        source: the adapter folder.
        out: the new folder (None or ``source``: convert in place, atomically).
        base_model: the base to fingerprint (None: the record's ``base_model``; it must be that model).
        model_card: the text of a new ``README.md`` (None: keep the folder's).
        overwrite: replace a non-empty ``out``.

    Returns:
        The converted folder.

    Raises:
        AdapterFileError: ``source`` is damaged (its manifest, if any, is checked first: nothing corrupt is
            re-signed).
        AdapterMismatchError: ``base_model`` is not the recorded base.
        FileExistsError: ``out`` is not empty and ``overwrite`` is not set.
    """
    from safetensors.torch import load_file

    from hf_posext.adapter_checks import base_fit_problem
    from hf_posext.models import hub_id, load_model

    source = Path(source)
    out = Path(out) if out is not None else source
    _check_convert_destination(source, out)
    record = check_adapter(source, base_model or read_adapter_record(source).base_model)
    in_place = out.resolve() == source.resolve()
    if not in_place and out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose a new folder or pass --overwrite.")
    base = load_model(base_model or record.base_model)
    fingerprints = base_weights_fingerprints(base)
    if record.base_weights:
        check_base_weights(source, base, base_model or record.base_model, record)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        for path in source.iterdir():
            if path.is_file() and path.name not in (EXTRAS_FILE, MANIFEST_FILE):
                shutil.copy2(path, staged / path.name)
        weights = load_file(str(source / ADAPTER_WEIGHTS))
        if is_old_format(source):
            extras = load_file(str(source / EXTRAS_FILE))
        else:
            names = set(saved_extra_names(source))
            extras = {k[len(PEFT_KEY_PREFIX):]: v for k, v in weights.items() if k[len(PEFT_KEY_PREFIX):] in names}
        # the LoRA matrices alone; the trained modules (and a tied head) are written again below
        _save_lora_only(staged, {k: v for k, v in weights.items() if _is_lora_key(k)})
        problem = base_fit_problem(base, {k: v for k, v in weights.items() if _is_lora_key(k)}, extras, PEFT_KEY_PREFIX)
        if problem:  # never certified: the manifest written below would vouch for it
            raise AdapterFileError(f"{source}: {problem}; restore the adapter folder from the training run, or give the "
                                   "base it was trained on (--model).")
        module_names, tied = trained_module_names(base, sorted(extras))
        write_trained_modules(staged, extras, module_names, tied, hub_id(record.base_model))
        data = json.loads((source / ADAPTER_RECORD).read_text())
        data["version"] = _VERSION
        data["base_weights"] = fingerprints
        _write_text_atomic(staged / ADAPTER_RECORD, json.dumps(data, indent=1, default=str) + "\n")
        if model_card is not None:
            _write_text_atomic(staged / "README.md", model_card)
        finish_adapter_folder(staged)
        _replace_folder(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out


def _check_convert_destination(source: Path, out: Path) -> None:
    """Refuse a destination inside the adapter folder (its files would join the source's, which then fails its own
    manifest) or one holding it (replacing it would delete the source); the same folder converts in place."""
    source_path, out_path = source.resolve(), out.resolve()
    if out_path == source_path:
        return
    if source_path in out_path.parents:
        raise ValueError(f"{out} cannot be written inside the adapter folder it converts ({source}); give a folder outside "
                         "it, or leave OUT out to convert in place.")
    if out_path in source_path.parents:
        raise ValueError(f"{out} holds the adapter folder it converts ({source}), which writing it would replace; give "
                         "a new folder, or leave OUT out to convert in place.")


def _is_lora_key(key: str) -> bool:
    """A key of PEFT's LoRA layers (``...q_proj.lora_A.weight``, ``lora_magnitude_vector``), not of a saved module."""
    return any(part.startswith("lora_") for part in key.split("."))


def _save_lora_only(folder: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------------
# Command line: hf-posext adapter {convert,verify}
# --------------------------------------------------------------------------------------------------


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hf-posext adapter`` arguments to ``parser``."""
    sub = parser.add_subparsers(dest="adapter_command", required=True)
    convert = sub.add_parser("convert", help="rewrite an adapter folder in the current format (PEFT modules_to_save, "
                                             "hub id, base weights fingerprint, manifest)")
    convert.add_argument("source", help="the adapter folder (runs/NAME/adapter)")
    convert.add_argument("out", nargs="?", help="the new folder (default: convert SOURCE in place)")
    convert.add_argument("--model", help="the base model (default: the one the adapter records)")
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    verify = sub.add_parser("verify", help="check an adapter folder's files against its manifest")
    verify.add_argument("source", help="the adapter folder")


def _run_model_card(folder: Path) -> str | None:
    """A regenerated model card for an adapter inside a run folder (``RUN/adapter`` beside ``RUN/train_config.yaml``),
    keeping the measurements written under the old card's "## Measured"; None outside a run folder."""
    from hf_posext.training.model_card import adapter_model_card, measured_section

    run = folder.resolve().parent
    if not (run / "train_config.yaml").is_file():
        return None
    from hf_posext.training.config import load_config

    try:
        config = load_config(run / "train_config.yaml")
    except (ValueError, FileNotFoundError) as error:  # a recipe of an older schema: keep the folder's card
        warn_at_caller(f"{run / 'train_config.yaml'} cannot be read ({' '.join(str(error).split())[:120]}), so the model "
                       f"card of {folder} is kept as it is")
        return None
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    old = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    return adapter_model_card(config, record, run / "log.jsonl", measured=measured_section(old))


def run_adapter(args: argparse.Namespace) -> int:
    """Run ``hf-posext adapter convert|verify``: 0 on success (errors are reported by the CLI, exit 2 or 1)."""
    source = Path(args.source)
    if args.adapter_command == "verify":
        has_manifest = verify_adapter_files(source)
        read_adapter_record(source)
        print(f"{source}: every file matches {MANIFEST_FILE}" if has_manifest else f"{source}: readable (no {MANIFEST_FILE})")
        return 0
    _check_convert_destination(source, Path(args.out) if args.out else source)
    check_adapter(source, args.model or read_adapter_record(source).base_model)  # before the base model loads
    card = _run_model_card(source)
    out = convert_adapter(source, args.out, base_model=args.model, model_card=card, overwrite=args.overwrite)
    print(f"wrote {out} (PEFT modules_to_save, {MANIFEST_FILE}; load it with hf_posext.adapters.load_adapted_model "
          "or stock PeftModel.from_pretrained on the patched base)")
    return 0
