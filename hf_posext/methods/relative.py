"""Methods for relative position bias (T5, mT5, UMT5, Flan-T5), pure numbers.

T5 adds to each attention score a learned bias chosen by the bucket of the relative distance
d = key position - query position: exact buckets for |d| < num_buckets / 4 (bidirectional) or / 2
(causal), logarithmic buckets up to ``relative_attention_max_distance``, one shared last bucket beyond.

``compute(relative_position: LongTensor, factor: float, params) -> LongTensor`` maps relative
distances to the distances the buckets see. Both methods return the input bit for bit at factor 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_posext.methods.registry import register_method

__all__ = ["scaled_distances", "unchanged_distances"]


@dataclass
class NoParams:
    """This method has no parameters besides ``factor``."""


@register_method(
    "none",
    "Relative bias extrapolates: beyond relative_attention_max_distance every distance shares the last bucket",
    "relative",
    NoParams,
)
def unchanged_distances(relative_position: torch.Tensor, factor: float, params: NoParams | None = None) -> torch.Tensor:
    """The distances as they are (T5's own behaviour at any length)."""
    return relative_position


@register_method(
    "linear",
    "Relative distance interpolation: bucket d / s (rounded toward 0), so the buckets cover an s-times longer range",
    "relative",
    NoParams,
)
def scaled_distances(relative_position: torch.Tensor, factor: float, params: NoParams | None = None) -> torch.Tensor:
    """d -> trunc(d / s), same sign and integer dtype: distance s*k is bucketed as k exactly.

    Args:
        relative_position: integer relative distances (key - query), any shape.
        factor: s >= 1.
        params: none.

    Returns:
        A tensor of the input's dtype and shape; the input itself when ``factor == 1``.
    """
    if factor == 1:
        return relative_position
    scaled = torch.div(relative_position.to(torch.float64), float(factor), rounding_mode="trunc")
    return scaled.to(relative_position.dtype)
