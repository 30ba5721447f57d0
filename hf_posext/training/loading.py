"""The recipe's base model, loaded (``model`` section) and patched (``scaling`` section).

Shared by the training run and by the merge of a saved adapter (:func:`hf_posext.training.outputs.merge_adapter`),
so both build the same patched base model.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_posext.api import patch
from hf_posext.training.config import TrainConfig

__all__ = ["load_base_model", "load_patched_model"]


def load_base_model(config: TrainConfig, dtype: torch.dtype) -> Any:
    """The recipe's model as ``model`` describes it (attention implementation, remote code, config overrides).

    Args:
        config: a validated recipe.
        dtype: the weights' dtype.

    Returns:
        The unpatched model.
    """
    from hf_posext.models import load_model

    kwargs: dict[str, Any] = {"attn_implementation": config.model.attn_implementation}
    if config.model.trust_remote_code:
        kwargs["trust_remote_code"] = True
    kwargs.update(config.model.config_overrides)
    return load_model(config.model.name, dtype=dtype, **kwargs)


def load_patched_model(config: TrainConfig, dtype: torch.dtype) -> Any:
    """:func:`load_base_model`, then patched with the recipe's ``scaling``."""
    model = load_base_model(config, dtype)
    patch(model, **config.scaling.to_request().patch_kwargs())
    return model
