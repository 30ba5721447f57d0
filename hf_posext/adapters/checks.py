"""What an adapter folder's checksums cannot prove: that what was written is sane.

``checksums.json`` proves that the files are the ones written, and a forger (or a tool that rewrites it after an
edit) recomputes it. These checks read what the files say and refuse what no training writes:

- a tensor that is not finite, or whose largest magnitude is far outside any trained adapter's (trained LoRA values
  are about 0.01 to 1; the norms and embeddings trained beside them are the base's, of order 1);
- an ``adapter_config.json`` rank (``r``) that the LoRA matrices do not have, or a ``modules_to_save`` entry that the
  weights hold nothing of;
- a record (``posext_adapter.json``) whose factor its own windows contradict, or that the recipe of the run it sits
  in (``RUN/train_config.yaml`` beside ``RUN/adapter``) contradicts;
- weights that do not fit the base model they are certified for (``adapter convert``).

Each check returns one phrase naming the file, the field or tensor and both values (None: nothing wrong); the
callers in :mod:`hf_posext.adapters` raise it with the fix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

__all__ = ["MAX_LORA_MAGNITUDE", "MAX_MODULE_MAGNITUDE", "tensor_problem", "rank_problem", "modules_problem",
           "record_problem", "base_fit_problem"]

#: A LoRA value of larger magnitude is refused: trained ones are about 0.01 to 1 (the tiny recipe's 0.2, SmolLM2's
#: retrieval runs' 0.3), initial ones at most 1/sqrt(fan_in).
MAX_LORA_MAGNITUDE = 1e3
#: A trained norm or embedding value of larger magnitude is refused (trained ones stay near the base's, of order 1).
MAX_MODULE_MAGNITUDE = 1e4


def tensor_problem(path: Path) -> str | None:
    """The first tensor of the safetensors file ``path`` that is not finite or far outside trained magnitudes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if not bool(torch.isfinite(tensor).all()):
                return f"{path}: tensor {name} is not finite (NaN or inf)"
            peak = float(tensor.abs().max())
            limit = MAX_LORA_MAGNITUDE if any(part.startswith("lora_") for part in name.split(".")) else MAX_MODULE_MAGNITUDE
            if peak > limit:
                return (f"{path}: tensor {name} has largest magnitude {peak:.3g}, far outside a trained adapter's "
                        f"(at most {limit:g}; trained LoRA values are about 0.01 to 1)")
    return None


def rank_problem(config_path: Path, weights_path: Path, config: dict[str, Any]) -> str | None:
    """``adapter_config.json``'s rank ``r`` against the LoRA matrices' (a per-module ``rank_pattern`` is not checked)."""
    from safetensors import safe_open

    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or config.get("rank_pattern"):
        return None
    with safe_open(str(weights_path), framework="pt") as handle:
        for name in handle.keys():
            if ".lora_A." in name or ".lora_B." in name:
                shape = handle.get_slice(name).get_shape()
                found = shape[0] if ".lora_A." in name else shape[-1]
                if found != rank:
                    return f"{config_path} has r {rank}, but {weights_path.name}'s {name} has rank {found}"
    return None


def modules_problem(config_path: Path, weights_path: Path, config: dict[str, Any], prefix: str) -> str | None:
    """A ``modules_to_save`` entry of ``adapter_config.json`` that the weights hold nothing of (PEFT would stop on a raw
    ``KeyError`` naming no file)."""
    from safetensors import safe_open

    modules = config.get("modules_to_save") or []
    if not isinstance(modules, list) or not modules:
        return None
    with safe_open(str(weights_path), framework="pt") as handle:
        names = [key[len(prefix):] for key in handle.keys() if key.startswith(prefix)]
    for module in modules:
        if isinstance(module, str) and not any(name.startswith(module + ".") for name in names):
            return (f"{config_path} lists {module!r} in modules_to_save, but {weights_path.name} holds no weights of it")
    return None


def record_problem(record_path: Path) -> str | None:
    """A record whose factor its windows contradict, or that its run's recipe contradicts (an unreadable record is
    left to :func:`hf_posext.adapters.read_adapter_record`, which names it)."""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        method, factor = record["method"], float(record["factor"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    original, current = record.get("original_window"), record.get("current_window")
    if isinstance(original, int) and isinstance(current, int) and original > 0 and math.isfinite(factor) \
            and abs(current / original - factor) > 0.01 * factor:
        return (f"{record_path} has factor {factor:g}, but its windows {original} -> {current} are "
                f"x{current / original:g}")
    recipe = record_path.resolve().parent.parent / "train_config.yaml"
    scaling = _recipe_scaling(recipe)
    if scaling is None:
        return None
    asked_method, asked_factor = scaling
    if asked_method != method or not math.isclose(asked_factor, factor, rel_tol=1e-6):
        return (f"{record_path} has {method} x{factor:g}, but the recipe of its run ({recipe}) says "
                f"{asked_method} x{asked_factor:g}")
    return None


def _recipe_scaling(recipe: Path) -> tuple[str, float] | None:
    """``(scaling.method, scaling.factor)`` of a run's recipe, or None (no recipe, or no factor in it)."""
    if not recipe.is_file():
        return None
    import yaml

    try:
        scaling = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("scaling")
        method, factor = scaling["method"], float(scaling["factor"])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError):
        return None
    return (method, factor) if isinstance(method, str) else None


def base_fit_problem(base: torch.nn.Module, lora: dict[str, torch.Tensor], modules: dict[str, torch.Tensor],
                     prefix: str) -> str | None:
    """The first LoRA matrix or trained module whose shape the base's module does not have.

    Args:
        base: the base model.
        lora: PEFT LoRA weights (``{prefix}X.lora_A.weight``, ...).
        modules: trained parameters by the base's own names (``model.norm.weight``).
        prefix: PEFT's prefix of the base's names (``base_model.model.``).
    """
    layers = dict(base.named_modules())
    parameters = dict(base.named_parameters())
    for key, tensor in lora.items():
        module_name, _, rest = key[len(prefix):].partition(".lora_")
        layer = layers.get(module_name)
        if layer is None or not hasattr(layer, "in_features"):
            return f"LoRA tensor {key} belongs to {module_name!r}, which the base model has no linear layer of"
        wanted = layer.in_features if rest.startswith("A.") else layer.out_features
        found = tensor.shape[1] if rest.startswith("A.") else tensor.shape[0]
        if rest.startswith(("A.", "B.")) and found != wanted:
            return f"LoRA tensor {key} is {tuple(tensor.shape)}, but the base's {module_name} has {wanted} features there"
    for name, tensor in modules.items():
        parameter = parameters.get(name)
        if parameter is None or tuple(parameter.shape) != tuple(tensor.shape):
            have = "none" if parameter is None else tuple(parameter.shape)
            return f"trained module tensor {name} is {tuple(tensor.shape)}, but the base model's is {have}"
    return None
