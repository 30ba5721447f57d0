"""Errors every layer may raise."""

from __future__ import annotations

from typing import Any

__all__ = ["UnsupportedModelError", "RecordError", "check_model"]


class UnsupportedModelError(ValueError):
    """The model has no positional encoding hf_posext recognises (the message says what was found)."""


class RecordError(ValueError):
    """A saved ``hf_posext`` record in a config is malformed (the message names the file and the field)."""


def check_model(model: Any) -> None:
    """Raise TypeError unless ``model`` looks like a transformers model (an ``nn.Module`` with a ``.config``)."""
    from torch import nn

    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"Expected a transformers model (an nn.Module with a .config), got {type(model).__name__}. "
            "Load one with AutoModelForCausalLM.from_pretrained(...) or hf_posext.models.load_model(...)."
        )
