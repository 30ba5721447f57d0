"""Renamed public names: the old spelling keeps working for a while, with a ``FutureWarning``."""

from __future__ import annotations

from typing import Any

from hf_posext.user_warnings import warn_at_caller

__all__ = ["renamed_keyword"]


def renamed_keyword(old_name: str, old_value: Any, new_name: str, new_value: Any, default: Any) -> Any:
    """The value of a keyword argument that was renamed from ``old_name`` to ``new_name``.

    Args:
        old_name, old_value: the former name and what the caller passed under it (None: not passed).
        new_name, new_value: the current name and its value (``default`` when not passed).
        default: the current name's default.

    The warning points at the user's line (:func:`hf_posext.user_warnings.warn_at_caller`).

    Returns:
        ``old_value`` when only the old name was given (with a ``FutureWarning``), else ``new_value``.

    Raises:
        ValueError: both names were given.
    """
    if old_value is None:
        return new_value
    if new_value != default:
        raise ValueError(f"Give {new_name}= only ({old_name}= is its old name), not both.")
    warn_at_caller(f"{old_name}= is now called {new_name}=; the old name will be removed.", FutureWarning)
    return old_value
