"""The MLA rule: attention softmax scales that the model derives from its rope dict follow a patch.

DeepSeek-V2/V3, Mistral 4, GLM-4-MoE-Lite and the other multi-head latent attention families fold YaRN's
``mscale_all_dim`` into the constant that multiplies ``q @ k^T`` (``softmax_scale * mscale(s)^2``, as in the
reference implementation), once, when the attention module is built. Rebuilding the rotary module alone would
leave that constant at the old factor. Which modules do this is found by structure: each attention module (a
float ``scaling`` and an int ``layer_idx``) is rebuilt on the meta device from the config before and after the
patch; where the two scales differ, the module gets the new one (and ``unpatch`` puts the old one back).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.core.errors import UnsupportedModelError

__all__ = ["ScaleChange", "softmax_scale_changes", "folds_rope_scale"]


@dataclass
class ScaleChange:
    """One attention module's softmax scale: before the patch and under it."""

    module: nn.Module
    original: float
    patched: float


def folds_rope_scale(*rope_dicts: dict[str, Any] | None) -> bool:
    """Whether any rope dict asks transformers to fold a YaRN scale into the softmax (``mscale_all_dim``)."""
    return any(isinstance(d, dict) and d.get("rope_type", "default") != "default" and d.get("mscale_all_dim") for d in rope_dicts)


def _rebuilt_scale(cls: type, config: Any, layer_idx: int) -> float:
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            module = cls(config=config, layer_idx=layer_idx)
        except TypeError:
            module = cls(config, layer_idx)
    return float(module.scaling)


def softmax_scale_changes(
    model: nn.Module, original_config: Any, patched_config: Any, originals: dict[int, float] | None = None,
) -> list[ScaleChange]:
    """The attention modules whose softmax scale changes from ``original_config`` to ``patched_config``.

    Args:
        model: the model. original_config / patched_config: its config before the patch and with the rope
            dict transformers would read for it (neither is changed).
        originals: ``id(module) -> scale`` from a previous patch, for modules whose scale it changed.

    Raises:
        UnsupportedModelError: an attention module that cannot be rebuilt from its config to check its scale.
    """
    originals = originals or {}
    changes = []
    for module in model.modules():
        scale, index = getattr(module, "scaling", None), getattr(module, "layer_idx", None)
        if not isinstance(scale, float) or isinstance(index, bool) or not isinstance(index, int):
            continue
        scale = originals.get(id(module), scale)
        try:
            before = _rebuilt_scale(type(module), copy.deepcopy(original_config), index)
            after = _rebuilt_scale(type(module), copy.deepcopy(patched_config), index)
        except Exception as error:
            raise UnsupportedModelError(
                f"{type(module).__name__} (layer {index}) may fold the rope dict's mscale_all_dim into its softmax "
                f"scale, and it could not be rebuilt from its config to check ({type(error).__name__}: {error})."
            ) from error
        if after != before:
            changes.append(ScaleChange(module, scale, after if scale == before else scale * after / before))
    return changes
