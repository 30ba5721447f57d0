"""Drop-in rotary modules that compute cos/sin with a registered scaling method.

:class:`ScaledRotaryEmbedding` replaces a model's rotary module (``model.model.rotary_emb`` and the
like). It accepts the calls transformers makes — ``forward(x, position_ids)`` and, for models with
per-layer-type RoPE such as Gemma 3, ``forward(x, position_ids, layer_type)`` — and returns the same
tensors in the same layout as the module it replaces. Like transformers, it computes the tables once
per forward pass at the model level (never per layer); static methods precompute their frequencies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from hf_posext.core.request import ScalingConfig
from hf_posext.methods.rope import RotaryBase

__all__ = ["RotaryEntry", "ScaledRotaryEmbedding", "LAYOUTS"]

#: Output conventions of rotary modules in transformers:
#: ``cos_sin``: ``(cos, sin)``, each ``cat(freqs, freqs)`` over the rotary dim (Llama and most models);
#: ``sin_cos_half``: ``(sin, cos)``, each over half the rotary dim (GPT-J's table).
LAYOUTS = ("cos_sin", "sin_cos_half")


@dataclass
class RotaryEntry:
    """The rotary embedding of one layer type: unscaled base, and how to scale it."""

    rope: RotaryBase
    scaling: ScalingConfig


class ScaledRotaryEmbedding(nn.Module):
    """Rotary embedding with a scaling method; a drop-in replacement for transformers' modules.

    Args:
        entries: one :class:`RotaryEntry` per layer type; key ``None`` for models with a single RoPE.
        layout: output convention, one of :data:`LAYOUTS`.
        device: where to put the frequency buffers.

    Dynamic methods (``dynamic-ntk``, ``dynamic-yarn``, ``longrope``) choose their frequencies from the
    current length ``l = max(position_ids) + 1``. With a KV cache that would rotate cached keys and new
    queries differently once ``l`` grows past the window (transformers issue 25104), so while
    :meth:`fixed_length` is active (``hf_posext`` activates it around ``generate`` with prompt length +
    ``max_new_tokens``) the length used is ``max(fixed, l)``: one rotation for the whole generation, equal
    to what a full forward over the final sequence uses.
    """

    def __init__(self, entries: dict[str | None, RotaryEntry], layout: str = "cos_sin", device=None) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"Unknown rotary layout {layout!r}; expected one of {LAYOUTS}.")
        self.entries = dict(entries)
        self.layout = layout
        self.fixed_sequence_length: int | None = None
        self.attention_scaling: dict[str | None, float] = {}
        self._dynamic_cache: dict[tuple[str | None, int, str], tuple[torch.Tensor, float]] = {}
        for layer_type, entry in self.entries.items():
            spec = entry.scaling.spec
            inv_freq, attention = spec.compute(
                entry.rope, entry.scaling.original_max_position_embeddings, entry.scaling.factor, None,
                entry.scaling.parsed_params,
            )
            self.register_buffer(self._buffer_name(layer_type), inv_freq.to(device), persistent=False)
            self.attention_scaling[layer_type] = attention

    def _apply(self, fn, recurse: bool = True):
        """Follow device moves but not dtype casts: the frequency tables stay float32.

        ``model.half()`` or ``model.to(torch.bfloat16)`` would otherwise round the inverse frequencies to
        8 (bf16) or 11 (fp16) significant bits, and the angle ``position * inv_freq`` inherits that relative
        error: for base 1e5 and rotary dim 64, position 32768 would be up to 45 radians off in bfloat16
        (3 in float16).
        """
        exact = {name: buffer for name, buffer in self._buffers.items() if buffer is not None}
        super()._apply(fn, recurse)
        for name, before in exact.items():
            after = self._buffers[name]
            if after is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(device=after.device)
        return self

    @staticmethod
    def _buffer_name(layer_type: str | None) -> str:
        # Not "inv_freq"/"original_inv_freq": transformers' weight init re-derives buffers with those
        # names from the config for any module called *RotaryEmbedding, which would undo the scaling.
        return "scaled_inv_freq" if layer_type is None else f"{layer_type}_scaled_inv_freq"

    @property
    def is_dynamic(self) -> bool:
        return any(entry.scaling.spec.dynamic for entry in self.entries.values())

    @contextlib.contextmanager
    def fixed_length(self, length: int | None) -> Iterator[None]:
        """Use ``max(length, current length)`` as the length of dynamic methods inside the block."""
        previous = self.fixed_sequence_length
        self.fixed_sequence_length = length
        try:
            yield
        finally:
            self.fixed_sequence_length = previous

    def frequencies(self, seq_len: int | None, layer_type: str | None = None, device=None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (float32) and attention factor used for a sequence of ``seq_len`` tokens."""
        entry = self.entries[layer_type]
        buffer = getattr(self, self._buffer_name(layer_type))
        device = buffer.device if device is None else device
        if not entry.scaling.spec.dynamic or seq_len is None:
            return buffer.to(device=device, dtype=torch.float), self.attention_scaling[layer_type]
        if self.fixed_sequence_length is not None:
            seq_len = max(seq_len, self.fixed_sequence_length)
        key = (layer_type, int(seq_len), str(device))
        cached = self._dynamic_cache.get(key)
        if cached is None:
            inv_freq, attention = entry.scaling.spec.compute(
                entry.rope, entry.scaling.original_max_position_embeddings, entry.scaling.factor, int(seq_len),
                entry.scaling.parsed_params,
            )
            cached = (inv_freq.to(device), attention)
            # Keep one length per layer type: generation reuses it every step, evaluation sweeps lengths.
            self._dynamic_cache = {k: v for k, v in self._dynamic_cache.items() if k[0] != layer_type}
            self._dynamic_cache[key] = cached
        return cached

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, layer_type: str | None = None, **kwargs):
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None, :]
        if layer_type not in self.entries:
            if None in self.entries and len(self.entries) == 1:
                layer_type = None
            else:
                raise KeyError(f"No rotary settings for layer type {layer_type!r}; known: {sorted(map(str, self.entries))}.")
        seq_len = None
        if self.entries[layer_type].scaling.spec.dynamic:
            seq_len = int(position_ids.max()) + 1
        inv_freq, attention = self.frequencies(seq_len, layer_type, device=x.device)
        freqs = position_ids[..., None].float() * inv_freq
        if self.layout == "cos_sin":
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * attention
            sin = emb.sin() * attention
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
        sin = freqs.sin()
        cos = freqs.cos()
        if attention != 1.0:
            sin, cos = sin * attention, cos * attention
        return sin.to(x.dtype), cos.to(x.dtype)

    def extra_repr(self) -> str:
        parts = []
        for layer_type, entry in self.entries.items():
            name = "" if layer_type is None else f"{layer_type}: "
            parts.append(
                f"{name}{entry.scaling.method} x{entry.scaling.factor:g} (base={entry.rope.theta:g}, dim={entry.rope.dim}, "
                f"original={entry.scaling.original_max_position_embeddings})"
            )
        return "; ".join(parts) + f", layout={self.layout}"
