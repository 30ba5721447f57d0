"""RoPE scaling methods: inverse frequencies and attention factor for a sequence length.

Notation (the docstrings use it): rotary dimension d, base b, original (pre-training) window L, scale
factor s, inverse frequencies theta_i = b^(-2i/d) for i < d/2, wavelengths lambda_i = 2*pi/theta_i.

Every method is a pure function

    compute(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params)
        -> (inv_freq: float32 tensor of d/2 values, attention_factor: float)

``attention_factor`` multiplies cos and sin (so attention logits scale by its square), as in
transformers. ``seq_len`` is the current sequence length; static methods ignore it. Where transformers
has the same rule, the arithmetic follows the same operation order so the numbers agree to float32
precision (a test compares them with ``ROPE_INIT_FUNCTIONS``). At ``factor == 1`` every method returns
the unscaled frequencies bit for bit.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hf_posext.methods.registry import register_method

__all__ = ["RotaryBase", "scaled_frequencies", "yarn_attention_factor"]


@dataclass(frozen=True)
class RotaryBase:
    """The unscaled rotary embedding of a model: base ``theta`` and rotary dimension ``dim``.

    ``rotated_pairs`` (proportional RoPE, Gemma 4 and LFM3 global layers): only the first ``rotated_pairs``
    of the d/2 frequencies rotate; the others are 0 (those channels carry no position). The exponent's
    denominator stays d, so theta_i = b^(-2i/d) for i < rotated_pairs. None: every pair rotates.
    """

    theta: float
    dim: int
    rotated_pairs: int | None = None

    def inv_freq(self, base: float | None = None) -> torch.Tensor:
        """theta_i = base^(-2i/d) in float32, computed exactly as transformers' default RoPE."""
        base = self.theta if base is None else base
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).to(dtype=torch.float) / self.dim
        return self.keep_rotated(1.0 / (base**exponents))

    def keep_rotated(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` with the pairs past ``rotated_pairs`` set to 0 (unchanged when every pair rotates)."""
        if self.rotated_pairs is None or self.rotated_pairs >= inv_freq.shape[-1]:
            return inv_freq
        kept = inv_freq.clone()
        kept[..., self.rotated_pairs:] = 0.0
        return kept


def scaled_frequencies(spec, rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params):
    """``spec.compute`` for ``rope``, with the non-rotating pairs of a proportional RoPE kept at 0.

    Every per-frequency rule (linear, YaRN's ramp, Llama 3's split, LongRoPE's factors) is computed on the
    full grid theta_i = b^(-2i/d); the pairs that do not rotate stay at 0 whatever the method.

    Returns:
        ``(inv_freq, attention_factor)`` as the method's ``compute`` does.
    """
    inv_freq, attention = spec.compute(rope, original_length, factor, seq_len, params)
    return rope.keep_rotated(inv_freq), attention


def _check_positive(name: str, value: float | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}.")


# --------------------------------------------------------------------------------------------------
# Parameter dataclasses
# --------------------------------------------------------------------------------------------------


@dataclass
class NoParams:
    """This method has no parameters besides ``factor``."""


@dataclass
class ThetaParams:
    base: float | None = field(
        default=None, metadata={"help": "New RoPE base b' (e.g. 1e6, as Code Llama). Required."}
    )

    def __post_init__(self) -> None:
        if self.base is None:
            raise ValueError("Method 'theta' needs the new base, e.g. patch(model, 'theta', factor=4, base=1e6).")
        _check_positive("base", self.base)


@dataclass
class YarnParams:
    beta_fast: float = field(default=32.0, metadata={"help": "Rotations within L above which a dimension is kept."})
    beta_slow: float = field(default=1.0, metadata={"help": "Rotations within L below which a dimension is interpolated."})
    attention_factor: float | None = field(
        default=None, metadata={"help": "cos/sin multiplier; default 0.1*ln(s)+1 (YaRN's sqrt(1/t))."}
    )
    mscale: float | None = field(default=None, metadata={"help": "DeepSeek-style mscale (with mscale_all_dim)."})
    mscale_all_dim: float | None = field(default=None, metadata={"help": "DeepSeek-style mscale_all_dim."})
    truncate: bool = field(default=True, metadata={"help": "Round the ramp bounds to whole dimensions."})

    def __post_init__(self) -> None:
        _check_positive("beta_fast", self.beta_fast, allow_none=False)
        _check_positive("beta_slow", self.beta_slow, allow_none=False)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"beta_fast ({self.beta_fast}) must be larger than beta_slow ({self.beta_slow}).")
        _check_positive("attention_factor", self.attention_factor)


@dataclass
class Llama3Params:
    low_freq_factor: float = field(default=1.0, metadata={"help": "Wavelengths above L/low_freq_factor are divided by s."})
    high_freq_factor: float = field(default=4.0, metadata={"help": "Wavelengths below L/high_freq_factor are kept."})

    def __post_init__(self) -> None:
        _check_positive("low_freq_factor", self.low_freq_factor, allow_none=False)
        _check_positive("high_freq_factor", self.high_freq_factor, allow_none=False)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})."
            )


def _read_factor_file(path: str) -> dict:
    if not os.path.exists(path):
        raise ValueError(f"LongRoPE factor file {path!r} does not exist.")
    with open(path) as handle:
        data = json.load(handle)
    if isinstance(data, list):
        return {"long_factor": data}
    if not isinstance(data, dict) or "long_factor" not in data:
        raise ValueError(f"{path!r} must hold a JSON list of factors or an object with 'long_factor'.")
    return data


@dataclass
class LongRopeParams:
    long_factor: Sequence[float] | str | None = field(
        default=None,
        metadata={"help": "d/2 per-dimension rescale factors used past L (or a JSON file path). Required."},
    )
    short_factor: Sequence[float] | None = field(
        default=None, metadata={"help": "d/2 factors used inside L; default all ones."}
    )
    attention_factor: float | None = field(
        default=None, metadata={"help": "cos/sin multiplier; default sqrt(1 + ln s / ln L)."}
    )
    factors: Sequence[float] | str | None = field(
        default=None, metadata={"help": "Alias of long_factor (list or JSON file from search_factors)."}
    )

    def __post_init__(self) -> None:
        if self.factors is not None:
            if self.long_factor is not None:
                raise ValueError("Give either factors= or long_factor=, not both.")
            self.long_factor, self.factors = self.factors, None
        if isinstance(self.long_factor, (str, os.PathLike)):
            data = _read_factor_file(os.fspath(self.long_factor))
            self.long_factor = data["long_factor"]
            if self.short_factor is None and data.get("short_factor") is not None:
                self.short_factor = data["short_factor"]
        if self.long_factor is None:
            raise ValueError(
                "Method 'longrope' needs per-dimension factors: patch(model, 'longrope', factor=s, "
                "long_factor=[...d/2 values...]) or factors='search_result.json'."
            )
        self.long_factor = [float(v) for v in self.long_factor]
        if self.short_factor is not None:
            self.short_factor = [float(v) for v in self.short_factor]
        for name in ("long_factor", "short_factor"):
            values = getattr(self, name)
            if values is not None and any(not math.isfinite(v) or v <= 0 for v in values):
                raise ValueError(f"All {name} values must be positive, got {values}.")
        _check_positive("attention_factor", self.attention_factor)

    def check_dim(self, dim: int) -> None:
        for name in ("long_factor", "short_factor"):
            values = getattr(self, name)
            if values is not None and len(values) != dim // 2:
                raise ValueError(f"{name} needs {dim // 2} values (rotary dim {dim} / 2), got {len(values)}.")


# --------------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------------


@register_method("none", "No scaling: the model's own frequencies (a baseline for evaluations)", "rope", NoParams, identity_at_one=True)
def no_scaling(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: NoParams):
    """theta'_i = theta_i. Useful as the unpatched baseline in side-by-side comparisons."""
    return rope.inv_freq(), 1.0


@register_method(
    "linear",
    "Position interpolation: divide every frequency by s (Chen et al. 2023)",
    "rope",
    NoParams,
    identity_at_one=True,
)
def linear(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: NoParams):
    """Position interpolation: theta'_i = theta_i / s.

    Chen et al. 2023, "Extending Context Window of Large Language Models via Positional
    Interpolation" (arXiv:2306.15595). Equivalent to feeding positions p/s.
    """
    inv_freq = rope.inv_freq()
    if factor == 1:
        return inv_freq, 1.0
    return inv_freq / factor, 1.0


def _check_ntk_dim(rope: RotaryBase) -> None:
    if rope.dim <= 2:
        raise ValueError(
            f"NTK-aware scaling raises the base to b*s^(d/(d-2)), undefined for rotary dim d={rope.dim}: "
            "use linear or yarn for this model."
        )


@register_method(
    "ntk",
    "NTK-aware: raise the base to b*s^(d/(d-2)), high frequencies kept (bloc97 2023)",
    "rope",
    NoParams,
    identity_at_one=True,
)
def ntk(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: NoParams):
    """NTK-aware scaling: b' = b * s^(d/(d-2)), then theta'_i = b'^(-2i/d).

    bloc97 2023, "NTK-Aware Scaled RoPE" (r/LocalLLaMA). The lowest frequency is divided by exactly s,
    the highest is unchanged, the ones between are spread geometrically. Static: same at every length.
    """
    _check_ntk_dim(rope)
    if factor == 1:
        return rope.inv_freq(), 1.0
    base = rope.theta * factor ** (rope.dim / (rope.dim - 2))
    return rope.inv_freq(base), 1.0


@register_method(
    "dynamic-ntk",
    "Dynamic NTK: NTK base chosen from the current length, identity inside L (emozilla 2023)",
    "rope",
    NoParams,
    dynamic=True,
)
def dynamic_ntk(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: NoParams):
    """Dynamic NTK: for current length l > L, b' = b * ((a*l/L) - (a-1))^(d/(d-2)), a = factor.

    emozilla 2023, "Dynamically Scaled RoPE" (r/LocalLLaMA); transformers' ``dynamic`` rope type, whose
    ``factor`` is this alpha. Inside the original window (l <= L) the frequencies are the original ones.
    """
    _check_ntk_dim(rope)
    if seq_len is None or seq_len <= original_length:
        return rope.inv_freq(), 1.0
    # transformers computes this base from max(position_ids) + 1, a 0-d int64 tensor, so in float32.
    # A float64 base differs from it by a few float32 ulps, which position p multiplies into the angle
    # (2e-3 rad at p = 65536 on a SmolLM2-shaped model): compute it the same way so that a saved model
    # reloaded by stock transformers rotates exactly as the patched one.
    length = torch.tensor(int(seq_len), dtype=torch.int64)
    base = rope.theta * ((factor * length / original_length) - (factor - 1)) ** (rope.dim / (rope.dim - 2))
    return rope.inv_freq(base), 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin multiplier sqrt(1/t) = 0.1*ln(s) + 1 (1 for s <= 1); DeepSeek's ratio form if given."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)


def _yarn(rope: RotaryBase, original_length: int, factor: float, params: YarnParams):
    attention_factor = params.attention_factor
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, params.mscale, params.mscale_all_dim)
    if factor == 1:
        return rope.inv_freq(), attention_factor
    dim = rope.dim

    def correction_dim(rotations: float) -> float:
        # The dimension index whose wavelength fits `rotations` times into the original window:
        # L / lambda_i = rotations  <=>  i = d * ln(L / (2*pi*rotations)) / (2 ln b).
        return (dim * math.log(original_length / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(params.beta_fast), correction_dim(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep theta_i), 0: interpolate (theta_i / s)

    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, attention_factor


@register_method(
    "yarn",
    "YaRN: interpolate low frequencies, keep high ones, ramp between, scale attention (Peng et al. 2023)",
    "rope",
    YarnParams,
    identity_at_one=True,
)
def yarn(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: YarnParams):
    """YaRN ("NTK-by-parts" + attention temperature).

    r_i = L / lambda_i (rotations of dimension i inside the original window);
    gamma_i = clamp((r_i - beta_slow) / (beta_fast - beta_slow), 0, 1) — implemented, as in the
    reference code and transformers, as a linear ramp over the dimension index between the dimensions
    where r_i = beta_fast and r_i = beta_slow (rounded outward when ``truncate``);
    theta'_i = (1 - gamma_i) * theta_i / s + gamma_i * theta_i; cos and sin are multiplied by
    0.1 * ln(s) + 1.

    Peng, Quesnelle, Fan, Shippole 2023, "YaRN: Efficient Context Window Extension of Large Language
    Models" (arXiv:2309.00071); defaults beta_fast=32, beta_slow=1 are the paper's for LLaMA.
    """
    return _yarn(rope, original_length, factor, params)


@register_method(
    "dynamic-yarn",
    "Dynamic YaRN: YaRN with s = max(1, l/L) for the current length l, identity inside L (Peng et al. 2023)",
    "rope",
    YarnParams,
    dynamic=True,
)
def dynamic_yarn(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: YarnParams):
    """Dynamic YaRN: YaRN (see :func:`yarn`) with s = max(1, l / L) for the current length l.

    Peng et al. 2023, section 3.3 ("Dynamic Scaling"). ``factor`` does not enter the frequencies: it
    only sets the window the patched model advertises (L * factor); lengths past it keep scaling.
    Inside the original window the model is exactly the original one (attention factor 1).
    """
    if seq_len is None or seq_len <= original_length:
        return rope.inv_freq(), 1.0
    return _yarn(rope, original_length, seq_len / original_length, params)


@register_method(
    "theta",
    "Adjusted base frequency: replace b by a given base (Roziere et al. 2023, Code Llama)",
    "rope",
    ThetaParams,
)
def theta(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: ThetaParams):
    """Adjusted base frequency: theta'_i = base'^(-2i/d) with the given ``base`` (e.g. 1e6).

    Roziere et al. 2023, "Code Llama: Open Foundation Models for Code" (arXiv:2308.12950), section
    2.4. ``factor`` only sets the advertised window L * factor; the base alone sets the frequencies.
    """
    if params.base == rope.theta:
        return rope.inv_freq(), 1.0
    return rope.inv_freq(params.base), 1.0


@register_method(
    "llama3",
    "Llama 3.1: divide long wavelengths by s, keep short ones, blend between (Meta 2024)",
    "rope",
    Llama3Params,
    identity_at_one=True,
)
def llama3(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: Llama3Params):
    """Llama 3.1 scaling, a wavelength split with a smooth blend.

    lambda_i > L/low_freq_factor: theta_i / s;  lambda_i < L/high_freq_factor: theta_i;
    between: (1 - a) * theta_i / s + a * theta_i, a = (L/lambda_i - low) / (high - low).

    Meta 2024, Llama 3.1 release (``apply_scaling`` in meta-llama/llama-models; "The Llama 3 Herd of
    Models", arXiv:2407.21783). Defaults low_freq_factor=1, high_freq_factor=4 (Llama 3.1 uses s=8).
    """
    inv_freq = rope.inv_freq()
    if factor == 1:
        return inv_freq, 1.0
    low_freq_wavelen = original_length / params.low_freq_factor
    high_freq_wavelen = original_length / params.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_length / wavelen - params.low_freq_factor) / (params.high_freq_factor - params.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


@register_method(
    "longrope",
    "LongRoPE: given per-dimension factors (e.g. searched), switched on past L (Ding et al. 2024)",
    "rope",
    LongRopeParams,
    dynamic=True,
)
def longrope(rope: RotaryBase, original_length: int, factor: float, seq_len: int | None, params: LongRopeParams):
    """LongRoPE: theta'_i = theta_i / f_i with per-dimension factors f.

    f = ``long_factor`` when the current length exceeds L, else ``short_factor`` (default all ones);
    cos/sin are multiplied by sqrt(1 + ln s / ln L) (1 when s <= 1) at every length, as in Phi-3 and
    transformers. Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens"
    (arXiv:2402.13753). Factors come from a search (``hf_posext.search_factors``) or a model card.
    """
    params.check_dim(rope.dim)
    attention_factor = params.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_length))
    if seq_len is not None and seq_len > original_length:
        factors = params.long_factor
    elif params.short_factor is not None:
        factors = params.short_factor
    else:
        return rope.inv_freq(), attention_factor
    ext = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, rope.dim, 2, dtype=torch.int64).float() / rope.dim
    return 1.0 / (ext * rope.theta**exponents), attention_factor
