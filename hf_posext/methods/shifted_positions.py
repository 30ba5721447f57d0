"""STRING's position matrix (An et al. 2025), pure numbers.

An, Zhang, Zhong, Li, Gong, Luo, Xu, Kong 2025, "Why Does the Effective Context Length of LLMs Fall
Short?" (arXiv:2410.18745, ICLR 2025), ShifTed Rotray position embeddING. Pre-training leaves the largest
relative distances rarely trained, so a model uses less context than its window. STRING drops them: for a
query at position i and a key at j (distance ``d = i - j``)

* ``d < S``: the true distance ``d`` (a sliding window of S keys keeps exact positions);
* ``d >= S``: ``d - S + w``, i.e. the query is seen from ``i - S + w`` (``position_ids - S + w`` in the
  reference code), so the S largest distances are never used and the shifted ones start at ``w``
  (``local_value``, 128) rather than 0, which keeps the nearest shifted keys apart from the diagonal.

With the paper's defaults S = ``int(0.33 * L)`` (``shifted_offset``) and w = 128 for a window of L tokens.
Inside the window (its home) the largest distance is ``L - 1 - S + w``; past it every distance stays
below L up to ``L + S - w`` tokens (:func:`max_covered_length`). The reference code (HKUNLP/STRING,
``replace_with_string``) also multiplies the rotary cos and sin by ``0.1 ln 2 + 1``; here that is the
``attention_factor`` parameter, 1 (off) by default. The kernels are in
:mod:`hf_posext.backends.attention.shifted_positions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hf_posext.methods.registry import register_method

__all__ = [
    "StringParams",
    "default_shifted_offset",
    "default_local_value",
    "check_string_sizes",
    "relative_distance",
    "max_covered_length",
    "REFERENCE_ATTENTION_FACTOR",
]

#: The constant the reference code multiplies the rotary cos and sin by (YaRN's factor at s = 2).
REFERENCE_ATTENTION_FACTOR = 0.1 * math.log(2) + 1


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


@dataclass
class StringParams:
    """STRING's parameters; each may be left out (the paper's defaults, from the model's window L).

    Attributes:
        shifted_offset: S, the distances below which positions stay exact; the S largest distances are
            dropped. Default ``int(0.33 * L)``; the reference suggests 0.25 L to 0.4 L.
        local_value: w, the distance the shifted keys start from; below S. Default 128 (the reference
            suggests 128, 256 or 512), at most S / 2 for small windows.
        attention_factor: multiplies q and k (scores by its square), as the reference code's cos/sin factor
            ``0.1 ln 2 + 1``; default 1 (the paper's position matrix alone).
    """

    shifted_offset: int | None = None
    local_value: int | None = None
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.shifted_offset is not None:
            _check_int("shifted_offset", self.shifted_offset, 1)
        if self.local_value is not None:
            _check_int("local_value", self.local_value, 0)
        if self.shifted_offset is not None and self.local_value is not None and self.local_value >= self.shifted_offset:
            # checkable without a model: refused where the request is parsed (a CLI flag, lm-eval's model args)
            check_string_sizes(self.shifted_offset, self.local_value, self.shifted_offset + 1)
        factor = self.attention_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"attention_factor must be a positive number (1 = off, the reference code uses "
                             f"{REFERENCE_ATTENTION_FACTOR:.4f}), got {factor!r}.")


def default_shifted_offset(original_length: int) -> int:
    """The paper's S: ``int(0.33 * L)`` (2703 for an 8192-token window)."""
    return int(0.33 * original_length)


def default_local_value(shifted_offset: int) -> int:
    """The paper's w, 128, kept at most ``S // 2`` so that tiny windows get a valid one."""
    return min(128, shifted_offset // 2)


def check_string_sizes(shifted_offset: int, local_value: int, original_length: int) -> None:
    """Raise ValueError unless ``0 <= local_value < shifted_offset < original_length``, naming the fix."""
    _check_int("shifted_offset", shifted_offset, 1)
    _check_int("local_value", local_value, 0)
    if shifted_offset >= original_length:
        raise ValueError(
            f"shifted_offset={shifted_offset} must be smaller than the model's original window ({original_length} "
            f"tokens): STRING drops the S largest distances of the window. The paper uses S = 0.33 * L "
            f"(default {default_shifted_offset(original_length)})."
        )
    if local_value >= shifted_offset:
        raise ValueError(
            f"local_value={local_value} must be smaller than shifted_offset={shifted_offset}: shifted keys are seen at "
            f"distance d - S + w, which must stay below the distances S they replace. Use e.g. "
            f"local_value={default_local_value(shifted_offset)}."
        )


def relative_distance(query_position: int, key_position: int, shifted_offset: int, local_value: int) -> int:
    """The distance STRING gives a query at ``query_position`` and a key at ``key_position`` (``<=`` it).

    ``d`` when ``d < S``, else ``d - S + w`` (``d = query_position - key_position``).
    """
    distance = query_position - key_position
    return distance if distance < shifted_offset else distance - shifted_offset + local_value


def max_covered_length(original_length: int, shifted_offset: int, local_value: int) -> int:
    """Longest sequence whose STRING distances all stay below the original window: ``L + S - w``."""
    return original_length + shifted_offset - local_value


register_method(
    "string",
    "STRING: exact distances below S, older keys seen from position i - S + w, the S largest distances "
    "never used (An et al. 2025, ICLR)",
    "attention",
    StringParams,
    default_factor=1.0,
)(relative_distance)
