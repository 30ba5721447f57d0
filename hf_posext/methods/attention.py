"""Attention-level methods: Self-Extend's sizing (Jin et al. 2024), pure numbers.

Self-Extend keeps exact positions for relative distances below a *neighbor window* W and floor-divides
positions by a group size G beyond it (see :mod:`hf_posext.backends.attention.self_extend` for the attention
kernels). The numbers here decide how long a sequence fits in the model's original context window L.
(W was called ``window`` before; ``window=`` is still accepted, with a FutureWarning.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_posext.methods.registry import register_method

__all__ = ["SelfExtendParams", "max_extended_length", "default_neighbor_window", "size_for_target", "check_neighbor_window"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


@dataclass
class SelfExtendParams:
    """Self-Extend's parameters; either may be left out (chosen from the factor by the paper's rule).

    Attributes:
        group_size: G, the floor divisor of positions beyond the neighbor window (1 = unchanged model).
        neighbor_window: W, the distances below which positions stay exact (must be below the original
            context window L).
    """

    group_size: int | None = None
    neighbor_window: int | None = None

    def __post_init__(self) -> None:
        if self.group_size is not None:
            _check_int("group_size", self.group_size, 1)
        if self.neighbor_window is not None:
            _check_int("neighbor_window", self.neighbor_window, 1)


def max_extended_length(original_length: int, group_size: int, neighbor_window: int) -> int:
    """Longest sequence whose grouped relative distances all stay below the original context window.

    The largest grouped distance, query at T - 1 and key at 0, is ``(T - 1) // G + W - W // G``; it must
    be at most ``L - 1``, which gives ``T <= (L - W + W // G) * G`` (the paper's ``(L - W) * G + W`` up
    to integer rounding).
    """
    return (original_length - neighbor_window + neighbor_window // group_size) * group_size


def default_neighbor_window(original_length: int) -> int:
    """The neighbor window used when none is given: a quarter of the original context window.

    The paper reports results for W between 512 and 2048 on 4k-window models and finds them robust to
    W; L / 4 (1024 for a 4k window, 2048 for SmolLM2's 8192) sits in that range and leaves 3/4 of the
    original positions to the grouped part.
    """
    return max(1, original_length // 4)


def check_neighbor_window(neighbor_window: int, original_length: int) -> None:
    """Raise ValueError unless ``1 <= neighbor_window < original_length``."""
    _check_int("neighbor_window", neighbor_window, 1)
    if neighbor_window >= original_length:
        raise ValueError(
            f"neighbor_window={neighbor_window} must be smaller than the model's original window ({original_length} "
            f"tokens): the neighbor part keeps exact positions, so it must fit in the pre-training window. The "
            f"paper uses W between L/8 and L/2 (default here: {default_neighbor_window(original_length)})."
        )


def size_for_target(original_length: int, target_length: int, neighbor_window: int | None = None) -> tuple[int, int]:
    """(group_size, neighbor_window) reaching ``target_length`` by the paper's sizing rule.

    The neighbor window defaults to :func:`default_neighbor_window`; the group size is the smallest G with
    ``max_extended_length(L, G, W) >= target_length``.

    Raises:
        ValueError: ``neighbor_window`` is not below the original window.
    """
    neighbor_window = default_neighbor_window(original_length) if neighbor_window is None else neighbor_window
    check_neighbor_window(neighbor_window, original_length)
    group_size = 1
    while max_extended_length(original_length, group_size, neighbor_window) < target_length:
        group_size += 1
    return group_size, neighbor_window


register_method(
    "self-extend",
    "Self-Extend: exact positions inside a neighbor window W, positions // G beyond it (Jin et al. 2024)",
    "attention",
    SelfExtendParams,
    size_params=("group_size",),
    renamed_params=(("window", "neighbor_window"),),
)(max_extended_length)
