"""Errors every layer may raise."""

from __future__ import annotations

__all__ = ["UnsupportedModelError", "RecordError"]


class UnsupportedModelError(ValueError):
    """The model has no positional encoding hf_posext recognises (the message says what was found)."""


class RecordError(ValueError):
    """A saved ``hf_posext`` record in a config is malformed (the message names the file and the field)."""
