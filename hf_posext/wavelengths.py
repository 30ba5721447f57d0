"""Per-dimension RoPE wavelengths before and after a scaling method: the picture behind every method.

RoPE dimension pair i (i < d/2) turns at inverse frequency theta_i = b^(-2i/d); its wavelength
lambda_i = 2*pi / theta_i is the number of positions of one full turn. A method replaces theta_i by
theta'_i; the *stretch* theta_i / theta'_i = lambda'_i / lambda_i says what it did to that dimension:

* ``extrapolated``: stretch 1 — the dimension is left alone and simply runs on past the original
  window L (harmless when it turned many times within L, so every angle was seen in pre-training);
* ``interpolated``: stretch >= s — positions are squeezed back into angles seen in pre-training
  (Position Interpolation does this to every dimension);
* ``blended``: in between (YaRN's ramp, Llama 3's smooth band, NTK-aware's geometric spread).

Dimensions with lambda_i > L never completed a turn during pre-training: angles past L are new to
them unless they are interpolated. :func:`wavelength_table` computes the table from a registered
method, :func:`model_wavelength_table` reads base, rotary dimension and window from a model, and
:func:`plot_wavelengths` draws it. ``hf-posext inspect`` prints and plots it from the command line.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DimensionWavelength",
    "WavelengthTable",
    "wavelength_table",
    "model_wavelength_table",
    "format_table",
    "plot_wavelengths",
    "REGIMES",
]

#: Regimes in the order of increasing stretch.
REGIMES = ("extrapolated", "blended", "interpolated")
_TOLERANCE = 1e-4


@dataclass
class DimensionWavelength:
    """One RoPE dimension pair.

    Attributes:
        index: i, from 0 (highest frequency) to d/2 - 1.
        original_wavelength: lambda_i = 2*pi / theta_i, in positions.
        scaled_wavelength: lambda'_i = 2*pi / theta'_i after the method.
        stretch: lambda'_i / lambda_i (= theta_i / theta'_i).
        rotations_in_window: L / lambda_i, full turns within the original window.
        regime: ``"extrapolated"``, ``"blended"`` or ``"interpolated"``.
        beyond_window: lambda_i > L (no full turn seen in pre-training).
    """

    index: int
    original_wavelength: float
    scaled_wavelength: float
    stretch: float
    rotations_in_window: float
    regime: str
    beyond_window: bool


@dataclass
class WavelengthTable:
    """Wavelengths of every dimension of one rotary embedding under one method."""

    method: str
    factor: float
    base: float
    rotary_dim: int
    original_window: int
    target_window: int
    attention_factor: float
    dimensions: list[DimensionWavelength] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    note: str | None = None

    def counts(self) -> dict[str, int]:
        """How many dimensions fall in each regime."""
        return {regime: sum(1 for d in self.dimensions if d.regime == regime) for regime in REGIMES}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["counts"] = self.counts()
        return data


def _regime(stretch: float, factor: float) -> str:
    if abs(stretch - 1.0) <= _TOLERANCE:
        return "extrapolated"
    if stretch >= factor * (1 - _TOLERANCE):
        return "interpolated"
    return "blended"


def wavelength_table(
    theta: float,
    rotary_dim: int,
    original_length: int,
    method: str,
    factor: float | None = None,
    *,
    target_length: int | None = None,
    model: str | None = None,
    **params: Any,
) -> WavelengthTable:
    """The per-dimension wavelength table of a registered RoPE method.

    Args:
        theta: the RoPE base b.
        rotary_dim: d, the rotary dimension (head dim times the partial-rotary fraction).
        original_length: L, the pre-training window.
        method: a RoPE method from :func:`hf_posext.available_methods` (``"yarn"``, ``"longrope"``...).
        factor: the scale s (or give ``target_length``).
        target_length: the window to reach (s = target_length / L).
        model: a name to print with the table.
        **params: the method's parameters (e.g. ``beta_fast=32``; ``factors=PATH`` for ``longrope``).

    Returns:
        The table. Dynamic methods are shown at the target length L * s, the length they scale for.

    Raises:
        ValueError: unknown method or parameter, bad factor, ``self-extend`` (it regroups positions and
            leaves the frequencies alone: there is no frequency table to show).
    """
    from hf_posext.core.request import ScalingConfig, resolve_factor
    from hf_posext.methods import check_method_name, kinds_of
    from hf_posext.methods.rope import RotaryBase

    name = check_method_name(method)
    if "rope" not in kinds_of(name):
        raise ValueError(
            f"{name} does not change RoPE frequencies (it is a {'/'.join(kinds_of(name))} method), so it has no "
            "wavelength table; inspect a frequency method such as yarn, or see docs/beyond_rescaling.md."
        )
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even integer >= 2, got {rotary_dim!r}.")
    scale = resolve_factor(factor, target_length, original_length)
    scaling = ScalingConfig(method, scale, original_length, params)
    rope = RotaryBase(float(theta), rotary_dim)
    target = scaling.target_length
    seq_len = target if scaling.spec.dynamic else None
    inv_freq, attention = scaling.spec.compute(rope, original_length, scaling.factor, seq_len, scaling.parsed_params)
    original = rope.inv_freq().double()
    scaled = inv_freq.double()
    rows = []
    for index in range(rotary_dim // 2):
        wavelength = 2 * math.pi / float(original[index])
        new_wavelength = 2 * math.pi / float(scaled[index])
        stretch = new_wavelength / wavelength
        rows.append(DimensionWavelength(
            index=index, original_wavelength=wavelength, scaled_wavelength=new_wavelength, stretch=stretch,
            rotations_in_window=original_length / wavelength, regime=_regime(stretch, scaling.factor),
            beyond_window=wavelength > original_length,
        ))
    note = f"dynamic method: shown at {seq_len} tokens" if seq_len else None
    return WavelengthTable(
        method=scaling.method, factor=scaling.factor, base=float(theta), rotary_dim=rotary_dim,
        original_window=original_length, target_window=target, attention_factor=float(attention), dimensions=rows,
        params={k: v for k, v in scaling.params.items() if v is not None and k != "factors"}, model=model, note=note,
    )


def model_wavelength_table(
    model: Any, method: str, factor: float | None = None, *, target_length: int | None = None,
    original_max_position_embeddings: int | None = None, name: str | None = None, **params: Any,
) -> WavelengthTable:
    """:func:`wavelength_table` with base, rotary dimension and window read from ``model``.

    Uses the rotary module that :func:`hf_posext.patch` would scale (Gemma 3: the full-attention one).
    The model must be unpatched (its own rotary module is what is read).
    """
    from hf_posext.backends.rope.sites import find_rotary_sites

    sites = find_rotary_sites(model)
    site = next(s for s in sites if s.scaled_layer_types)
    layer_type = site.scaled_layer_types[0]
    current = site.current[layer_type]
    window = original_max_position_embeddings or current.original_max_position_embeddings
    table = wavelength_table(
        site.bases[layer_type], site.dims[layer_type], window, method, factor, target_length=target_length,
        model=name or getattr(getattr(model, "config", None), "_name_or_path", None), **params,
    )
    kept = [f"{kind} (base {s.bases[kind]:g})" for s in sites for kind in s.bases
            if kind is not None and kind not in s.scaled_layer_types]
    if kept:
        table.note = ((table.note + "; ") if table.note else "") + (
            f"shown for the {layer_type} layers, the ones scaled; {', '.join(kept)} keep their positions")
    if current.method != "none":
        table.note = ((table.note + "; ") if table.note else "") + (
            f"the model's config already applies {current.method} x{current.factor:g}; shown from its unscaled base"
        )
    return table


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def format_table(table: WavelengthTable) -> str:
    """The table as text: one row per dimension pair, then a summary of the regimes."""
    title = f"{table.model + ': ' if table.model else ''}{table.method} x{table.factor:g}"
    lines = [
        title,
        f"RoPE base {table.base:g}, rotary dim {table.rotary_dim}, original window L = {table.original_window}, "
        f"target {table.target_window}, attention factor {table.attention_factor:.4f}",
    ]
    if table.params:
        lines.append(f"parameters: {', '.join(f'{k}={v}' for k, v in table.params.items() if not isinstance(v, list))}")
    if table.note:
        lines.append(f"note: {table.note}")
    header = f"{'dim':>4} {'wavelength':>12} {'turns in L':>11} {'scaled':>12} {'stretch':>8}  regime"
    lines += ["", header, "-" * len(header)]
    for row in table.dimensions:
        flag = "  (wavelength > L)" if row.beyond_window else ""
        lines.append(
            f"{row.index:>4} {_number(row.original_wavelength):>12} {row.rotations_in_window:>11.2f} "
            f"{_number(row.scaled_wavelength):>12} {row.stretch:>8.3f}  {row.regime}{flag}"
        )
    counts = table.counts()
    beyond = sum(1 for row in table.dimensions if row.beyond_window)
    lines += [
        "",
        f"{counts['extrapolated']} extrapolated (stretch 1), {counts['blended']} blended, "
        f"{counts['interpolated']} interpolated (stretch >= {table.factor:g}); {beyond} of {len(table.dimensions)} "
        f"dimensions have wavelengths longer than L = {table.original_window}.",
    ]
    return "\n".join(lines)


_COLOURS = {"extrapolated": "tab:blue", "blended": "tab:orange", "interpolated": "tab:green"}


def plot_wavelengths(table: WavelengthTable, path: str | os.PathLike) -> Path:
    """Draw original and scaled wavelength per dimension (log scale) against L and the target; save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    index = [row.index for row in table.dimensions]
    figure, axis = plt.subplots(figsize=(9, 5))
    axis.plot(index, [row.original_wavelength for row in table.dimensions], color="black", lw=1.5, label="original wavelength")
    axis.plot(index, [row.scaled_wavelength for row in table.dimensions], color="tab:red", lw=1.5, ls="--",
              label=f"{table.method} x{table.factor:g}")
    for regime in REGIMES:
        points = [row for row in table.dimensions if row.regime == regime]
        if points:
            axis.scatter([row.index for row in points], [row.scaled_wavelength for row in points], s=18,
                         color=_COLOURS[regime], zorder=3, label=f"{regime} ({len(points)})")
    axis.axhline(table.original_window, color="grey", ls=":", lw=1)
    axis.text(index[0], table.original_window * 1.12, f"original window L = {table.original_window}", color="grey", fontsize=8)
    axis.axhline(table.target_window, color="tab:purple", ls=":", lw=1)
    axis.text(index[0], table.target_window * 1.12, f"target {table.target_window}", color="tab:purple", fontsize=8)
    axis.set_yscale("log")
    axis.set_xlabel("RoPE dimension pair i (high frequency -> low frequency)")
    axis.set_ylabel("wavelength (positions per full turn)")
    axis.set_title(f"{table.model + ': ' if table.model else ''}{table.method} x{table.factor:g}, base {table.base:g}, d = {table.rotary_dim}")
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(True, which="both", alpha=0.2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
