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
from typing import Any, Iterator

import torch
from torch import nn

from hf_posext.backends.rope.layouts import LAYOUTS, get_layout
from hf_posext.core.request import ScalingConfig
from hf_posext.methods.rope import RotaryBase, scaled_frequencies

__all__ = ["RotaryEntry", "ScaledRotaryEmbedding", "LAYOUTS", "select_position_rows", "MIRRORED_ATTRIBUTES"]

#: Plain attributes of transformers' rotary modules that models read from outside the module.
MIRRORED_ATTRIBUTES = ("config", "rope_type", "layer_types", "mrope_section")


@dataclass
class RotaryEntry:
    """The rotary embedding of one layer type: unscaled base, and how to scale it."""

    rope: RotaryBase
    scaling: ScalingConfig


class ScaledRotaryEmbedding(nn.Module):
    """Rotary embedding with a scaling method; a drop-in replacement for transformers' modules.

    Args:
        entries: one :class:`RotaryEntry` per layer type; key ``None`` for models with a single RoPE.
        layout: output convention, a name in :data:`~hf_posext.backends.rope.layouts.LAYOUTS`.
        device: where to put the frequency buffers.
        position_rows: multimodal RoPE (Qwen3.5, Qwen-VL): for each rotated pair, the row of 3-D
            ``position_ids`` (temporal, height, width) whose positions it rotates by; None for plain RoPE.
        mirrored: attributes of the replaced module that models read from outside, kept as they are
            (:data:`MIRRORED_ATTRIBUTES`: Granite SWA keys its tables by ``rotary_emb.config.rope_parameters
            ["rope_theta"]``, Ergo and LFM3 loop over ``rotary_emb.rope_type`` / ``layer_types``).

    Dynamic methods (``dynamic-ntk``, ``dynamic-yarn``, ``longrope``) choose their frequencies from the
    current length ``l = max(position_ids) + 1``. With a KV cache that would rotate cached keys and new
    queries differently once ``l`` grows past the window (transformers issue 25104), so while
    :meth:`fixed_length` is active (``hf_posext`` activates it around ``generate`` with prompt length +
    ``max_new_tokens``) the length used is ``max(fixed, l)``: one rotation for the whole generation, equal
    to what a full forward over the final sequence uses.
    """

    def __init__(
        self, entries: dict[str | None, RotaryEntry], layout: str = "cos_sin", device=None,
        position_rows: torch.Tensor | None = None, mirrored: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._render = get_layout(layout).render
        self.entries = dict(entries)
        self.layout = layout
        self.position_rows = position_rows
        for name, value in (mirrored or {}).items():
            if name not in MIRRORED_ATTRIBUTES:
                raise ValueError(f"Cannot mirror attribute {name!r}; known: {', '.join(MIRRORED_ATTRIBUTES)}.")
            setattr(self, name, value)
        self.fixed_sequence_length: int | None = None
        self.attention_scaling: dict[str | None, float] = {}
        self._dynamic_cache: dict[tuple[str | None, int, str], tuple[torch.Tensor, float]] = {}
        for layer_type, entry in self.entries.items():
            spec = entry.scaling.spec
            inv_freq, attention = scaled_frequencies(
                spec, entry.rope, entry.scaling.original_max_position_embeddings, entry.scaling.factor, None,
                entry.scaling.parsed_params,
            )
            self.register_buffer(self.buffer_name(layer_type), inv_freq.to(device), persistent=False)
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
    def buffer_name(layer_type: str | None) -> str:
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
        buffer = getattr(self, self.buffer_name(layer_type))
        device = buffer.device if device is None else device
        if not entry.scaling.spec.dynamic or seq_len is None:
            return buffer.to(device=device, dtype=torch.float), self.attention_scaling[layer_type]
        if self.fixed_sequence_length is not None:
            seq_len = max(seq_len, self.fixed_sequence_length)
        key = (layer_type, int(seq_len), str(device))
        cached = self._dynamic_cache.get(key)
        if cached is None:
            inv_freq, attention = scaled_frequencies(
                entry.scaling.spec, entry.rope, entry.scaling.original_max_position_embeddings, entry.scaling.factor, int(seq_len),
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
        if self.position_rows is not None:
            freqs = select_position_rows(freqs, self.position_rows)
        return self._render(freqs, attention, x.dtype)

    def extra_repr(self) -> str:
        parts = []
        for layer_type, entry in self.entries.items():
            name = "" if layer_type is None else f"{layer_type}: "
            parts.append(
                f"{name}{entry.scaling.method} x{entry.scaling.factor:g} (base={entry.rope.theta:g}, dim={entry.rope.dim}, "
                f"original={entry.scaling.original_max_position_embeddings})"
            )
        return "; ".join(parts) + f", layout={self.layout}"


def select_position_rows(freqs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Angles of multimodal RoPE: pair i takes its angle from row ``rows[i]`` of 3-D position ids.

    Args:
        freqs: ``[R, B, S, d/2]`` angles of every row (3-D ``position_ids``), or ``[B, S, d/2]`` (2-D ids:
            every row holds the same text positions, so nothing is selected).
        rows: ``[d/2]`` int64 row index per pair.

    Returns:
        ``[B, S, d/2]`` angles.
    """
    if freqs.dim() < 4:
        return freqs
    index = rows.to(freqs.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
    return freqs.gather(0, index.clamp(max=freqs.shape[0] - 1)).squeeze(0)
