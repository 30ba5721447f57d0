"""Methods for absolute position encodings: learned tables (GPT-2 style), sinusoidal encodings, ALiBi.

Notation (the docstrings use it): a learned table T has one row per position p = 0..L-1 (L: the
pre-training window; rows a model keeps before position 0, such as OPT's offset of 2, are not part of
T and are never changed); s is the scale factor and L' = round(L * s) the new window.

Each kind has its own signature, and every method is a pure function of numbers:

- ``"learned"``: ``compute(table: Tensor[L, d], new_length: int, factor: Fraction, params) ->
  Tensor[new_length, d]`` in the table's dtype. The factor is an exact fraction, so that "rows at
  p = k * s" is decided in exact arithmetic, not in floating point.
- ``"sinusoidal"``: ``compute(num_positions: int, factor: Fraction, params) -> Tensor[num_positions]``
  (float64): the real-valued position at which the encoding is evaluated for each integer position p.
- ``"alibi"``: ``compute(factor, params) -> None``. ALiBi biases attention by distance and extrapolates
  by design (Press et al. 2022); the one method lifts the length limit and changes no number.

All methods return the original table (or positions) bit for bit at ``factor == 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

from hf_posext.methods.registry import get_method, register_alias, register_method

__all__ = [
    "exact_factor",
    "interpolation_grid",
    "linear_table",
    "linear_positions",
    "sinusoid_table",
    "scaled_sinusoid_rows",
    "ScaledSinusoidRows",
    "MAX_TABLE_ROWS",
]

#: Largest position table hf_posext builds (2^20 rows): beyond it a request is an error, not an OOM.
MAX_TABLE_ROWS = 2**20


@dataclass
class NoParams:
    """This method has no parameters besides ``factor``."""


def exact_factor(factor: float | Fraction, target_length: int | None = None, original_length: int | None = None) -> Fraction:
    """The scale factor as an exact fraction.

    ``target_length / original_length`` when both are given; otherwise the shortest decimal that
    round-trips ``factor`` (so ``factor=1.1`` means 11/10, not the binary float nearest to 1.1).

    Example:
        >>> exact_factor(1.5)
        Fraction(3, 2)
        >>> exact_factor(None, 1000, 256)
        Fraction(125, 32)
    """
    if target_length is not None and original_length:
        return Fraction(int(target_length), int(original_length))
    if isinstance(factor, Fraction):
        return factor
    return Fraction(repr(float(factor)))


def interpolation_grid(new_length: int, original_length: int, factor: Fraction) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each new position p falls in the original table: x = p / s = floor + weight.

    Computed in integers (p * den // num), so ``weight`` is exactly 0 whenever p / s is a whole number.
    Positions past the last row (x > L - 1, the final ``s - 1`` positions) are clamped to row L - 1.

    Returns:
        (lower row index, upper row index, weight of the upper row in float64), each of length ``new_length``.
    """
    factor = Fraction(factor)
    positions = torch.arange(new_length, dtype=torch.int64)
    scaled = positions * factor.denominator
    lower = torch.div(scaled, factor.numerator, rounding_mode="floor")
    weight = (scaled - lower * factor.numerator).to(torch.float64) / factor.numerator
    past_end = lower >= original_length - 1
    lower = lower.clamp(max=original_length - 1)
    weight = torch.where(past_end, torch.zeros_like(weight), weight)
    upper = (lower + 1).clamp(max=original_length - 1)
    return lower, upper, weight


def sinusoid_table(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Sinusoidal encodings (Vaswani et al. 2017; tensor2tensor / fairseq layout) at real-valued ``positions``.

    Row for position x: ``[sin(x * w_0), ..., sin(x * w_{h-1}), cos(x * w_0), ..., cos(x * w_{h-1})]``
    (a zero column appended when ``dim`` is odd), with h = dim // 2 and w_i = exp(-i * ln(base) / (h - 1)).
    The operations follow transformers' XGLM implementation in the same order and float32, so integer
    positions reproduce its table bit for bit.

    Args:
        positions: 1-D tensor of positions (any float dtype; evaluated in float32 as transformers does).
        dim: embedding width.
        base: the wavelength base (10000 in every model that uses this layout).

    Returns:
        float32 tensor ``[len(positions), dim]``.
    """
    half_dim = dim // 2
    step = math.log(base) / (half_dim - 1)
    frequencies = torch.exp(torch.arange(half_dim, dtype=torch.int64).float() * -step)
    angles = positions.to(torch.float32).unsqueeze(1) * frequencies.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(positions.shape[0], -1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(positions.shape[0], 1)], dim=1)
    return table


def scaled_sinusoid_rows(
    num_rows: int,
    dim: int,
    offset: int,
    padding_rows: tuple[int, ...],
    positions_fn: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """Rows 0..num_rows-1 of a sinusoid table whose position rows are evaluated at ``positions_fn``.

    Row ``offset + p`` is the encoding at x(p) + offset, x = ``positions_fn(num_rows - offset)`` (p / s for
    ``"linear"``); rows before ``offset`` keep their integer positions and ``padding_rows`` are zero, as in
    the fairseq-style modules (XGLM) that keep a padding row.

    Args:
        num_rows: rows of the table.
        dim: embedding width.
        offset: table row of position 0.
        padding_rows: rows set to zero.
        positions_fn: number of positions -> real-valued positions (a sinusoidal method's ``compute``).

    Returns:
        float32 tensor ``[num_rows, dim]``.
    """
    positions = torch.arange(num_rows, dtype=torch.float64)
    if num_rows > offset:
        positions[offset:] = positions_fn(num_rows - offset) + offset
    table = sinusoid_table(positions, dim)
    for row in padding_rows:
        if row < num_rows:
            table[row] = 0
    return table


class ScaledSinusoidRows:
    """Picklable stand-in for a sinusoidal module's ``get_embedding``: rows it regrows stay scaled.

    Args:
        offset: table row of position 0.
        padding_rows: rows kept at zero.
        factor: s as an exact fraction.
        method: the registered ``"sinusoidal"`` method that maps p to the evaluated position.
    """

    def __init__(self, offset: int, padding_rows: tuple[int, ...], factor: Fraction, method: str) -> None:
        self.offset, self.padding_rows, self.factor, self.method = offset, padding_rows, factor, method

    def __call__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None) -> torch.Tensor:
        compute = get_method(self.method, "sinusoidal").compute
        table = scaled_sinusoid_rows(
            num_embeddings, embedding_dim, self.offset, self.padding_rows, lambda n: compute(n, self.factor, None)
        )
        return table.to(torch.get_default_dtype())


@register_method(
    "linear",
    "Position interpolation for learned tables: T'[p] = interpolation of T at p/s (rows at p = k*s are T[k])",
    "learned",
    NoParams,
)
def linear_table(table: torch.Tensor, new_length: int, factor: Fraction, params: NoParams | None = None) -> torch.Tensor:
    """Linear position interpolation of a learned table (the table analogue of Chen et al. 2023).

    T'[p] = (1 - w) * T[i] + w * T[i + 1], with i = floor(p / s) and w = p / s - i, for p < L' = round(L*s).
    Where p / s is a whole number k (p = k * s), w is exactly 0 and T'[p] == T[k] bit for bit. The last
    positions (p / s > L - 1) take the last row T[L - 1]: there is nothing to interpolate towards, and
    a row the model has seen is safer than an extrapolated one. Arithmetic is float64, the result is
    cast back to the table's dtype.

    Args:
        table: the position rows T, shape [L, d] (without any offset rows).
        new_length: L', the number of rows to produce.
        factor: s as an exact fraction (see :func:`exact_factor`).
        params: unused (the method has no parameters).

    Returns:
        The new table, shape [new_length, d], same dtype and device as ``table``.
    """
    original_length = table.shape[0]
    if factor == 1 and new_length == original_length:
        return table.detach().clone()
    lower, upper, weight = interpolation_grid(new_length, original_length, Fraction(factor))
    wide = table.detach().to(torch.float64)
    lower, upper, weight = lower.to(table.device), upper.to(table.device), weight.to(table.device)[:, None]
    resampled = (1.0 - weight) * wide[lower] + weight * wide[upper]
    return resampled.to(table.dtype)


@register_method(
    "none",
    "No change (baseline); a learned table has no rows past its window, so only factor=1 is valid",
    "learned",
    NoParams,
)
def unchanged_table(table: torch.Tensor, new_length: int, factor: Fraction, params: NoParams | None = None) -> torch.Tensor:
    """The identity: T' = T. Only defined for L' = L (a learned table cannot extrapolate).

    Raises:
        ValueError: ``new_length`` differs from the table's length.
    """
    if new_length != table.shape[0]:
        raise ValueError(
            f"Method 'none' cannot extend a learned position table: it has {table.shape[0]} rows and positions "
            f"past them have no embedding. Use method 'linear' to reach {new_length} positions."
        )
    return table.detach().clone()


@register_method(
    "linear",
    "Position interpolation for sinusoidal encodings: evaluate the encoding at p/s (exact, no table resampling)",
    "sinusoidal",
    NoParams,
)
def linear_positions(num_positions: int, factor: Fraction, params: NoParams | None = None) -> torch.Tensor:
    """Positions at which a sinusoidal encoding is evaluated: x(p) = p / s (Chen et al. 2023).

    A sinusoid is defined at every real position, so this is exact: no table is interpolated. x is
    float64 and exact whenever p / s is a whole number.
    """
    factor = Fraction(factor)
    positions = torch.arange(num_positions, dtype=torch.float64)
    if factor == 1:
        return positions
    return positions * factor.denominator / factor.numerator


@register_method(
    "none",
    "Sinusoidal encodings extrapolate: evaluate at p itself and only lift the length limit",
    "sinusoidal",
    NoParams,
)
def identity_positions(num_positions: int, factor: Fraction, params: NoParams | None = None) -> torch.Tensor:
    """x(p) = p: the encoding the model was trained with, continued past its window."""
    return torch.arange(num_positions, dtype=torch.float64)


@register_method(
    "none",
    "ALiBi needs no scaling (it extrapolates by design): only lift the model's length limit, if it has one",
    "alibi",
    NoParams,
)
def alibi_unchanged(factor: Fraction, params: NoParams | None = None) -> None:
    """ALiBi (Press et al. 2022) adds -m_h * (i - j) to attention logits; no number depends on a window,
    so there is nothing to rescale. Returns None."""
    return None


register_alias(
    "linear", "alibi", "none",
    "ALiBi needs no position interpolation: method 'linear' changes no number on an ALiBi model; "
    "hf_posext only lifts the length limit (recorded as method 'none').",
)
