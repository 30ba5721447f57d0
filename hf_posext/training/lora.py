"""Which weights train: PEFT LoRA adapters (with optional LongLoRA-style embeddings and norms) or all.

LongLoRA (Chen et al. 2023, "LongLoRA: Efficient Fine-tuning of Long-Context Large Language Models",
arXiv:2309.12307) found LoRA alone weak for context extension and fixed it by also training the input
embeddings and the normalisation layers; ``train_embeddings`` / ``train_norms`` switch that on. Those
extra weights are trained in place (``requires_grad``); the saved adapter holds them as PEFT
``modules_to_save`` (:mod:`hf_posext.adapters`), so stock PEFT loads them, and they end up in the merged model.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from torch import nn

from hf_posext.adapters import apply_adapter, saved_extra_names

__all__ = ["LoraTargetError", "linear_module_names", "setup_trainable", "trainable_state_dict", "extra_parameter_names",
           "check_init_adapter", "extra_kinds"]

class LoraTargetError(ValueError):
    """A LoRA target module name that matches no linear layer of the model."""


def _is_linear(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a linear layer with transposed weights; PEFT adapts both.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_module_names(model: nn.Module) -> list[str]:
    """Distinct last name components of the linear layers of ``model`` (e.g. ``q_proj``), output head excluded."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if _is_linear(module) and module is not output}
    return sorted(names)


def check_lora_targets(model: nn.Module, target_modules: list[str]) -> None:
    """Raise :class:`LoraTargetError` naming every target that matches no linear layer, with suggestions."""
    if list(target_modules) == ["all-linear"]:
        return
    available = linear_module_names(model)
    full_names = {name for name, module in model.named_modules() if _is_linear(module)}
    missing = [t for t in target_modules if t not in available and t not in full_names]
    if missing:
        hints = []
        for target in missing:
            close = difflib.get_close_matches(target, available, n=1)
            hints.append(f"{target!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise LoraTargetError(
            f"LoRA target module(s) {', '.join(hints)} not found in {type(model).__name__}. Its linear layers are: "
            f"{', '.join(available)}. Set finetune.target_modules to some of these (or ['all-linear'])."
        )


def extra_parameter_names(model: nn.Module, train_embeddings: bool, train_norms: bool) -> list[str]:
    """Names of the embedding and/or normalisation parameters to train (LongLoRA)."""
    names = []
    embedding = model.get_input_embeddings() if train_embeddings else None
    for module_name, module in model.named_modules():
        is_norm = train_norms and ("norm" in type(module).__name__.lower() or isinstance(module, nn.LayerNorm))
        if module is embedding or is_norm:
            for param_name, _ in module.named_parameters(recurse=False):
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def extra_kinds(names: list[str]) -> set[str] | None:
    """``{"norms", "embeddings"}`` or a part of it: the kinds of the trained parameters ``names`` (an adapter's
    ``modules_to_save``), told by their module names; None when one of them is neither clearly (the check is
    then left to the load, which compares the exact names)."""
    kinds = set()
    for name in names:
        module = name.rsplit(".", 1)[0].lower()
        last = module.rsplit(".", 1)[-1]
        if "norm" in last or last.startswith("ln"):
            kinds.add("norms")
        elif "embed" in last or last in ("wte", "word_embeddings"):
            kinds.add("embeddings")
        else:
            return None
    return kinds


def check_init_adapter(finetune: Any, base_model: str, method: str, factor: float | None,
                       target_length: int | None = None, original_window: int | None = None,
                       params: dict[str, Any] | None = None) -> None:
    """Check that ``finetune.init_adapter`` can be continued by this recipe, before any weights load.

    Its files must match its manifest; its record (:mod:`hf_posext.adapters`) must name ``base_model`` and the
    scaling (a ``scaling.target_length`` is resolved against the recorded original window); its
    ``adapter_config.json`` the recipe's LoRA rank, alpha and target modules; and the trained norms/embeddings it
    holds must be the ones the recipe trains.

    Args:
        finetune: the recipe's ``finetune`` section.
        base_model: ``model.name``.
        method: ``scaling.method``.
        factor: ``scaling.factor`` (None when the recipe gives ``target_length``).
        target_length: ``scaling.target_length``.
        original_window: ``scaling.original_max_position_embeddings``.
        params: ``scaling.params``.

    Raises:
        AdapterMismatchError: another base model or scaling.
        AdapterFileError: a damaged or altered adapter file.
        FileNotFoundError, RecordError: a missing folder or record.
        ValueError: another rank, alpha, target modules or trained extras; the message names both.
    """
    from hf_posext.adapters import ADAPTER_CONFIG, check_adapter

    folder = Path(finetune.init_adapter)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"finetune.init_adapter: {folder / ADAPTER_CONFIG} is missing; point it at a folder saved by "
                                "hf-posext train (runs/NAME/adapter).")
    check_adapter(folder, base_model, method, factor, params, target_length=target_length, original_window=original_window,
                  suggest="recipe")
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())  # readable: checked by check_adapter
    targets = saved.get("target_modules")
    saved_targets = sorted(targets) if isinstance(targets, list) else targets
    asked_targets = "all-linear" if list(finetune.target_modules) == ["all-linear"] else sorted(finetune.target_modules)
    differences = [f"{key}: adapter {a!r}, recipe {b!r}" for key, a, b in (
        ("finetune.rank", saved.get("r"), finetune.rank), ("finetune.alpha", float(saved.get("lora_alpha", 0)), float(finetune.alpha)),
        ("finetune.target_modules", saved_targets, asked_targets)) if a != b]
    saved_extras = saved_extra_names(folder)
    has_extras = bool(saved_extras)
    kinds = extra_kinds(saved_extras)
    if has_extras != bool(finetune.train_norms or finetune.train_embeddings):
        differences.append(f"trained norms/embeddings: the adapter {'holds' if has_extras else 'has no'} "
                           f"them, the recipe {'does not train them' if has_extras else 'trains them'} "
                           "(finetune.train_norms, finetune.train_embeddings)")
    elif kinds is not None:  # both sides have some: each kind on its own (the adapter's modules_to_save shows them)
        for kind in ("norms", "embeddings"):
            trains = bool(getattr(finetune, f"train_{kind}"))
            if trains != (kind in kinds):
                differences.append(
                    f"finetune.train_{kind}: the adapter {'holds' if not trains else 'has no'} trained {kind} "
                    f"(modules_to_save in {ADAPTER_CONFIG}), the recipe {'does not train them' if not trains else 'trains them'}")
    if differences:
        raise ValueError(f"finetune.init_adapter={str(folder)!r} cannot be continued by this recipe: "
                         + "; ".join(differences) + ". Set the recipe's values to the adapter's.")


def setup_trainable(model: nn.Module, finetune: Any, seed: int = 0) -> nn.Module:
    """Make the weights named by ``finetune`` trainable; wrap in PEFT LoRA in ``lora`` mode.

    Args:
        model: a (patched) causal LM.
        finetune: a :class:`~hf_posext.training.config.FinetuneSection`.
        seed: seeds the LoRA initialisation.

    Returns:
        ``model`` itself (full mode, every parameter trainable) or a ``peft.PeftModel`` around it.

    Raises:
        LoraTargetError: a target module that the model does not have.
        ImportError: ``peft`` is not installed (LoRA mode).
    """
    import torch

    if finetune.mode == "full":
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ImportError("finetune.mode=lora needs peft: pip install 'hf-posext[train]' (or pip install peft).") from error
    check_lora_targets(model, list(finetune.target_modules))
    targets = "all-linear" if list(finetune.target_modules) == ["all-linear"] else list(finetune.target_modules)
    lora_config = LoraConfig(
        r=finetune.rank, lora_alpha=finetune.alpha, lora_dropout=finetune.dropout,
        target_modules=targets, bias="none", task_type="CAUSAL_LM",
    )
    extras = extra_parameter_names(model, finetune.train_embeddings, finetune.train_norms)
    torch.manual_seed(seed)
    if getattr(finetune, "init_adapter", None):
        # Continue a saved adapter (checked by check_init_adapter): its LoRA weights, trainable, and its extras
        # copied into the base model's own parameters, which train in place as in a fresh run (same numbers).
        peft_model = apply_adapter(model, finetune.init_adapter, is_trainable=True, extras_in_place=True,
                                   expected_extras=extras)
    else:
        peft_model = get_peft_model(model, lora_config)
    base = peft_model.get_base_model()
    parameters = dict(base.named_parameters())
    for name in extras:
        parameters[name].requires_grad_(True)
    return peft_model


def trainable_state_dict(model: nn.Module) -> dict[str, Any]:
    """Detached copies of every trainable parameter, by name (what a checkpoint must hold)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
