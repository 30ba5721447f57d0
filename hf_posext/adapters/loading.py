"""Applying an adapter: wrapping a patched base in it (:func:`apply_adapter`), loading base, scaling and adapter in
one call (:func:`load_adapted_model`) and writing the merged model (:func:`save_merged`)."""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from hf_posext.adapters.base_weights import check_base_weights
from hf_posext.adapters.peft_format import copy_into_base, is_old_format, load_trainable_extras
from hf_posext.adapters.record import ADAPTER_WEIGHTS, PEFT_KEY_PREFIX
from hf_posext.adapters.verify import check_adapter
from hf_posext.core.files import check_output_folder, refuse_non_empty_folder, staged_folder
from hf_posext.core.saved_config import save_tokenizer_with_max_length

__all__ = ["apply_adapter", "load_adapted_model", "save_merged"]


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
    copy_into_base(adapted, saved, folder / ADAPTER_WEIGHTS, expected_extras)
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
    from hf_posext.models import load_tokenizer

    out = Path(out)
    refuse_non_empty_folder(out, overwrite=overwrite, fix="pass overwrite=True (--overwrite)")
    check_output_folder(out, "out", "the merged model")
    check_adapter(folder, base_model)
    tokenizer = load_tokenizer(base_model)  # a damaged tokenizer must not cost a model load
    model = load_adapted_model(base_model, folder, dtype=dtype)
    with staged_folder(out) as staged:
        model.save_pretrained(str(staged))
        save_tokenizer_with_max_length(tokenizer, staged, describe(model).current_window)
    return out
