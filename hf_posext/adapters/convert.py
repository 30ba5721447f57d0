"""Writing an adapter folder's manifest, and rewriting an adapter folder in the current format
(``hf-posext adapter convert``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from hf_posext.adapters import checks
from hf_posext.adapters.base_weights import base_weights_fingerprints, check_base_weights
from hf_posext.adapters.peft_format import (
    is_lora_key, is_old_format, save_lora_only, saved_extra_names, trained_module_names, write_trained_modules,
)
from hf_posext.adapters.record import (
    ADAPTER_RECORD, ADAPTER_WEIGHTS, EXTRAS_FILE, MANIFEST_FILE, PEFT_KEY_PREFIX, RECORD_VERSION, AdapterFileError,
    AdapterRecord, read_adapter_record,
)
from hf_posext.adapters.verify import check_adapter
from hf_posext.core.files import refuse_non_empty_folder, staged_folder, write_json_atomic, write_text_atomic
from hf_posext.core.integrity import write_manifest

__all__ = ["finish_adapter_folder", "convert_adapter", "check_convert_destination"]


def finish_adapter_folder(folder: str | os.PathLike) -> Path:
    """Write the adapter's manifest (:data:`MANIFEST_FILE`, the sha256 of every other file): the last file written."""
    return write_manifest(folder)


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
    from hf_posext.models import load_model

    source = Path(source)
    out = Path(out) if out is not None else source
    check_convert_destination(source, out)
    record = check_adapter(source, base_model or read_adapter_record(source).base_model)
    if out.resolve() != source.resolve():
        refuse_non_empty_folder(out, overwrite=overwrite)
    base = load_model(base_model or record.base_model)
    fingerprints = base_weights_fingerprints(base)
    if record.base_weights:
        check_base_weights(source, base, base_model or record.base_model, record)
    with staged_folder(out) as staged:
        _write_converted(source, staged, base, record)
        data = json.loads((source / ADAPTER_RECORD).read_text())
        data["version"] = RECORD_VERSION
        data["base_weights"] = fingerprints
        write_json_atomic(staged / ADAPTER_RECORD, data, indent=1, final_newline=True)
        if model_card is not None:
            write_text_atomic(staged / "README.md", model_card)
        finish_adapter_folder(staged)
    return out


def _write_converted(source: Path, staged: Path, base: Any, record: AdapterRecord) -> None:
    """Copy ``source``'s files into ``staged`` with the LoRA matrices alone in PEFT's weights file and the trained
    modules written again as PEFT ``modules_to_save`` (refusing weights that do not fit ``base``)."""
    from safetensors.torch import load_file

    from hf_posext.models import hub_id

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
    lora = {k: v for k, v in weights.items() if is_lora_key(k)}
    save_lora_only(staged, lora)
    problem = checks.base_fit_problem(base, lora, extras, PEFT_KEY_PREFIX)
    if problem:  # never certified: the manifest written after this would vouch for it
        raise AdapterFileError(f"{source}: {problem}; restore the adapter folder from the training run, or give the "
                               "base it was trained on (--model).")
    module_names, tied = trained_module_names(base, sorted(extras))
    write_trained_modules(staged, extras, module_names, tied, hub_id(record.base_model))


def check_convert_destination(source: Path, out: Path) -> None:
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
