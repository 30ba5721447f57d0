"""How a rotary module hands its angles to attention: the output conventions found in transformers.

Every rotary module computes angles ``freqs = position * inv_freq`` (one per rotated pair) and returns
them in one of a few shapes. Which one a model uses is found by probing its module (the first layout that
reproduces the output wins), never by its class name. Each layout is a small named rule:

========================  ======================================================  =======================
layout                    output for angles f (a: attention factor)               families
========================  ======================================================  =======================
``cos_sin``               ``(cos(cat(f, f))·a, sin(cat(f, f))·a)``                Llama and most models
``cos_sin_interleaved``   ``(cos(repeat_interleave(f, 2))·a, sin(...)·a)``        Cohere 1/2 (pairs adjacent)
``cos_sin_half``          ``(cos(f)·a, sin(f)·a)``: one value per pair             gpt-oss, DeepSeek-V4
``sin_cos_half``          ``(sin(f)·a, cos(f)·a)``                                 GPT-J's table
``complex``               ``polar(1, f)·a``: one complex tensor                    Llama 4, DeepSeek-V2
========================  ======================================================  =======================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Layout", "LAYOUTS", "get_layout", "PROBE_ORDER"]


@dataclass(frozen=True)
class Layout:
    """One output convention of rotary modules.

    Attributes:
        name: the layout's name (stored on sites and modules).
        render: ``(angles, attention_factor, dtype) -> output`` as the model expects it.
        sines: ``output -> sin(angles)·a``, one value per rotated pair (to find which position row feeds a pair).
    """

    name: str
    render: Callable[[torch.Tensor, float, torch.dtype], object]
    sines: Callable[[object], torch.Tensor]


def _scaled(values: torch.Tensor, attention: float) -> torch.Tensor:
    # The multiplication by 1.0 is kept out so that unscaled outputs are bit-identical to the stock modules'.
    return values if attention == 1.0 else values * attention


def _cos_sin(expand: Callable[[torch.Tensor], torch.Tensor]):
    def render(angles: torch.Tensor, attention: float, dtype: torch.dtype):
        emb = expand(angles)
        return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)

    return render


def _sin_cos_half(angles: torch.Tensor, attention: float, dtype: torch.dtype):
    return _scaled(angles.sin(), attention).to(dtype), _scaled(angles.cos(), attention).to(dtype)


def _complex(angles: torch.Tensor, attention: float, dtype: torch.dtype):
    return torch.polar(torch.ones_like(angles), angles) * attention


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("cos_sin", _cos_sin(lambda f: torch.cat((f, f), dim=-1)), lambda out: out[1][..., : out[1].shape[-1] // 2]),
        Layout(
            "cos_sin_interleaved", _cos_sin(lambda f: torch.repeat_interleave(f, 2, dim=-1)),
            lambda out: out[1][..., ::2],
        ),
        Layout("cos_sin_half", _cos_sin(lambda f: f), lambda out: out[1]),
        Layout("sin_cos_half", _sin_cos_half, lambda out: out[0]),
        Layout("complex", _complex, lambda out: out.imag),
    )
}

#: The order in which a probe tries layouts: the common one first.
PROBE_ORDER = ("cos_sin", "cos_sin_interleaved", "cos_sin_half", "complex", "sin_cos_half")


def get_layout(name: str) -> Layout:
    """The layout called ``name``.

    Raises:
        ValueError: an unknown name (the known ones are listed).
    """
    if name not in LAYOUTS:
        raise ValueError(f"Unknown rotary layout {name!r}; expected one of {', '.join(LAYOUTS)}.")
    return LAYOUTS[name]
