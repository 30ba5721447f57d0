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

The package, lowest first: :mod:`~hf_posext.adapters.record` (file names, the record, the PEFT config),
:mod:`~hf_posext.adapters.checks` (what checksums cannot prove), :mod:`~hf_posext.adapters.base_weights` (the base's
name and weights fingerprint), :mod:`~hf_posext.adapters.verify` (files, then base and scaling, before anything
loads), :mod:`~hf_posext.adapters.peft_format` (trained modules as PEFT ``modules_to_save``),
:mod:`~hf_posext.adapters.loading` (apply, load, merge) and :mod:`~hf_posext.adapters.convert`. The command line is
:mod:`hf_posext.cli.adapter_command`.
"""

from hf_posext.adapters.base_weights import base_weights_fingerprints, check_base_weights, same_base_model
from hf_posext.adapters.convert import check_convert_destination, convert_adapter, finish_adapter_folder
from hf_posext.adapters.loading import apply_adapter, load_adapted_model, save_merged
from hf_posext.adapters.peft_format import (
    is_old_format, load_trainable_extras, saved_extra_names, trained_module_names, write_trained_modules,
)
from hf_posext.adapters.record import (
    ADAPTER_CONFIG, ADAPTER_RECORD, ADAPTER_WEIGHTS, EXTRAS_FILE, MANIFEST_FILE, PEFT_KEY_PREFIX, AdapterFileError,
    AdapterMismatchError, AdapterRecord, read_adapter_record, write_adapter_record,
)
from hf_posext.adapters.verify import check_adapter, verify_adapter_files

__all__ = [
    "ADAPTER_RECORD", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "EXTRAS_FILE", "MANIFEST_FILE", "PEFT_KEY_PREFIX",
    "AdapterRecord", "AdapterMismatchError", "AdapterFileError", "write_adapter_record", "read_adapter_record",
    "verify_adapter_files", "check_adapter", "same_base_model", "base_weights_fingerprints", "check_base_weights",
    "trained_module_names", "write_trained_modules", "saved_extra_names", "is_old_format", "apply_adapter",
    "load_trainable_extras", "load_adapted_model", "finish_adapter_folder", "convert_adapter",
    "check_convert_destination", "save_merged",
]
