"""Checks made before anything is loaded from an adapter folder: its files (the manifest, readable JSON and
safetensors, sane contents) and that it is asked for on the base model and scaling it was trained with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hf_posext.adapters import checks
from hf_posext.adapters.base_weights import same_base_model
from hf_posext.adapters.record import (
    ADAPTER_CONFIG, ADAPTER_RECORD, ADAPTER_WEIGHTS, MANIFEST_FILE, PEFT_KEY_PREFIX, AdapterFileError,
    AdapterMismatchError, AdapterRecord, peft_config, read_adapter_record, require_adapter_folder,
)
from hf_posext.core.integrity import verify_manifest
from hf_posext.methods import split_composition
from hf_posext.user_warnings import warn_at_caller

__all__ = ["verify_adapter_files", "check_adapter"]

#: What every refusal of a damaged adapter folder tells the user to do.
_RESTORE = "restore the adapter folder from the training run"


def _a_folder_now_gone(name: str) -> bool:
    """Whether ``name`` is a local path (absolute, ``~`` or ``./``), not a hub id, with nothing there now."""
    path = os.path.expanduser(name)
    return (os.path.isabs(path) or name.startswith(("./", "../"))) and not os.path.exists(path)


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # SafetensorError, OSError: both mean the file cannot be used
        detail = " ".join(str(error).split())
        raise AdapterFileError(f"{path} is truncated or corrupt ({detail}); {_RESTORE}.") from None


def verify_adapter_files(folder: str | os.PathLike) -> bool:
    """Refuse an adapter folder whose files are damaged or altered, before anything is loaded from it.

    With a manifest (:data:`MANIFEST_FILE`), every listed file must exist with its sha256 and every file of the
    folder must be listed (:func:`hf_posext.core.integrity.verify_manifest`). Without one (an adapter written before it), the folder loads after a one-line
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
    require_adapter_folder(folder)
    has_manifest = (folder / MANIFEST_FILE).is_file()
    if has_manifest:
        verify_manifest(folder, name=f"The adapter {folder}", fix=_RESTORE, error=AdapterFileError)
    config = peft_config(folder)
    for path in sorted(folder.glob("*.safetensors")):
        _check_safetensors(path)
    if not has_manifest:
        warn_at_caller(f"the adapter {folder} has no {MANIFEST_FILE} (written before hf-posext added one), so nothing proves "
                       f"its files are the ones its run wrote; `hf-posext adapter convert {folder}` checks its weights "
                       "(finite, of trained magnitudes, shaped for its base) before it adds one")
    _check_contents(folder, config)
    return has_manifest


def _check_contents(folder: Path, config: dict[str, Any]) -> None:
    """Refuse what checksums cannot: weights no training writes, a rank or record that contradicts the weights, itself
    or its run's recipe (:mod:`hf_posext.adapters.checks`)."""
    found = [lambda path=path: checks.tensor_problem(path) for path in sorted(folder.glob("*.safetensors"))]
    if (folder / ADAPTER_WEIGHTS).is_file():
        found.append(lambda: checks.rank_problem(folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS, config))
        found.append(lambda: checks.modules_problem(folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS, config, PEFT_KEY_PREFIX))
    found.append(lambda: checks.record_problem(folder / ADAPTER_RECORD))
    for check in found:
        problem = check()
        if problem:
            raise AdapterFileError(f"{problem}: damaged or edited (checksums prove only that files are unchanged since "
                                   f"they were listed); {_RESTORE}.")


def _differs(recorded: Any, asked: Any) -> bool:
    if isinstance(recorded, (int, float)) and isinstance(asked, (int, float)) and not isinstance(asked, bool):
        return float(recorded) != float(asked)
    return recorded != asked


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
    if not same_base_model(str(base_model), record.base_model) and not (
            record.base_weights and os.path.isdir(os.path.expanduser(str(base_model)))):
        # a local folder other than the recorded one (a copy, a moved base) is judged by its weights once it loads
        fix = (f"set model.name: {record.base_model} in the recipe (or drop finetune.init_adapter to train a new adapter)"
               if recipe else f"pass --model {record.base_model}")
        if _a_folder_now_gone(record.base_model) and record.base_weights:  # the fix above names a folder not there
            fix = (f"{record.base_model} no longer exists: give a local folder holding the base's weights (it is judged "
                   "by its weights fingerprint, not its path)")
        elif _a_folder_now_gone(record.base_model):
            fix = (f"{record.base_model} no longer exists, and the adapter records no weights fingerprint to judge "
                   f"another folder by: put the base back there (a link to it will do), then `hf-posext adapter convert "
                   f"{folder}` records its fingerprint, after which a copy at any path is judged by its weights")
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
               f"evaluate it without --methods (it runs the scaling it was trained with) or with --methods "
               f"{record.method}:factor={record.factor:g} (an attention-level method may be stacked on it: "
               f"{record.method}+string:factor={record.factor:g}), or train an adapter for that scaling")
        raise AdapterMismatchError(f"The adapter {folder} was trained with {trained} ({ADAPTER_RECORD}), not {asked}: {fix}.")
    return record
