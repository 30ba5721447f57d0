"""Trained norms and embeddings as PEFT ``modules_to_save``: written so that stock PEFT restores them, and read
back from either format (the PEFT one, or :data:`EXTRAS_FILE` of adapters written before it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hf_posext.adapters.record import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXTRAS_FILE, PEFT_KEY_PREFIX, peft_config
from hf_posext.core.errors import RecordError
from hf_posext.core.files import atomic_path, write_json_atomic

__all__ = ["trained_module_names", "write_trained_modules", "saved_extra_names", "is_old_format",
           "load_trainable_extras", "copy_into_base", "is_lora_key", "save_lora_only"]


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
    config = peft_config(folder)
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
    with atomic_path(folder / ADAPTER_WEIGHTS) as staged:
        save_file(weights, str(staged), metadata={"format": "pt"})
    write_json_atomic(folder / ADAPTER_CONFIG, config, sort_keys=True)


def saved_extra_names(folder: str | os.PathLike) -> list[str]:
    """The base parameters saved beside the LoRA matrices of the adapter in ``folder`` (either format), tied
    duplicates left out: what a recipe continuing it must train (``finetune.train_norms``/``train_embeddings``)."""
    from safetensors import safe_open

    folder = Path(folder)
    if (folder / EXTRAS_FILE).is_file():
        with safe_open(str(folder / EXTRAS_FILE), framework="pt") as handle:
            return sorted(handle.keys())
    modules = peft_config(folder).get("modules_to_save") or []
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
    copy_into_base(model, load_file(str(path)), path, expected)
    return True


def copy_into_base(model: Any, saved: dict[str, torch.Tensor], path: Path, expected: list[str] | None) -> None:
    """Copy ``saved`` (base parameter name -> value, read from ``path``) into the base model of ``model``."""
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


def is_lora_key(key: str) -> bool:
    """A key of PEFT's LoRA layers (``...q_proj.lora_A.weight``, ``lora_magnitude_vector``), not of a saved module."""
    return any(part.startswith("lora_") for part in key.split("."))


def save_lora_only(folder: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
