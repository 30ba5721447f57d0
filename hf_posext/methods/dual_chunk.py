"""Dual Chunk Attention's position indices (An et al. 2024), pure numbers.

An, Huang, Zhang, Gong, Qiu, Zhou, Kong 2024, "Training-Free Long-Context Scaling of Large Language
Models" (arXiv:2402.17463, ICML 2024; ChunkLlama). The sequence is cut into chunks of ``s`` tokens and
every query/key pair gets a relative distance that stays inside the pre-training window L:

* keys sit at their position inside their chunk, ``j mod s``;
* intra-chunk (query and key in the same chunk): the query sits at ``i mod s`` — the true distance;
* successive-chunk (key in the chunk just before): the query sits at ``min(i mod s + s, c)`` — the true
  distance for the first ``c - s`` queries of a chunk (the *local window*), clamped at ``c`` after;
* inter-chunk (key two or more chunks before): every query sits at ``min(2s - 1, c)``.

``c`` (``chunk_size``) is the largest query position index, so no distance exceeds ``c``; with the
local window ``w`` (``local_window``) the chunk length is ``s = c - w``. These are the names and the
convention of ChunkLlama's code and of vLLM's ``dual_chunk_attention_config`` (``chunk_size``,
``local_size``), which Qwen2.5-1M checkpoints carry. ChunkLlama's defaults: ``c = 3L/4``, ``w = L/16``.
The kernels are in :mod:`hf_posext.backends.attention.dual_chunk`.

Length scale (optional, ``attention_scale=True``; not in ChunkLlama): Qwen2.5-1M as vLLM and SGLang
serve it multiplies every attention score by ``f(T)^2`` with YaRN's ``f(T) = max(1, 0.1 ln(T / L) + 1)``
and ``T`` the sequence length (:func:`length_scale`; docs/serving.md gives where the runtimes apply it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hf_posext.methods.registry import register_method

__all__ = [
    "DualChunkParams",
    "default_chunk_size",
    "default_local_window",
    "check_chunk_sizes",
    "chunk_length",
    "relative_distance",
    "length_scale",
]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


@dataclass
class DualChunkParams:
    """Dual Chunk Attention's parameters; either may be left out (the paper's defaults).

    Attributes:
        chunk_size: c, the largest position index a query takes (vLLM's ``chunk_size``); at most the
            original window. Default 3/4 of the original window.
        local_window: w, how many queries at the start of a chunk keep their true distance to the
            previous chunk (vLLM's ``local_size``); below ``chunk_size``. Default 1/16 of the original window.
        attention_scale: multiply every score by ``length_scale(T, L) ** 2`` (T: the sequence length), as
            SGLang does for a ``dual_chunk_attention_config`` holding ``original_max_position_embeddings``
            (Qwen2.5-1M). Default False: ChunkLlama has no such scale.
    """

    chunk_size: int | None = None
    local_window: int | None = None
    attention_scale: bool = False

    def __post_init__(self) -> None:
        if self.chunk_size is not None:
            _check_int("chunk_size", self.chunk_size, 2)
        if self.local_window is not None:
            _check_int("local_window", self.local_window, 0)
        if self.chunk_size is not None and self.local_window is not None and self.local_window >= self.chunk_size:
            # checkable without a model: refused where the request is parsed (patch, CLI, lm-eval model args)
            raise ValueError(
                f"local_window={self.local_window} must be smaller than chunk_size={self.chunk_size}: the chunk "
                f"length is chunk_size - local_window. Use e.g. local_window={self.chunk_size // 4}."
            )
        if not isinstance(self.attention_scale, bool):
            raise ValueError(f"attention_scale must be true or false, got {self.attention_scale!r}.")


def default_chunk_size(original_length: int) -> int:
    """ChunkLlama's chunk size: 3/4 of the pre-training window (3072 for 4096, 6144 for 8192)."""
    return original_length * 3 // 4


def default_local_window(original_length: int) -> int:
    """ChunkLlama's local window: 1/16 of the pre-training window (256 for 4096, 512 for 8192)."""
    return original_length // 16


def check_chunk_sizes(chunk_size: int, local_window: int, original_length: int) -> None:
    """Raise ValueError unless ``0 <= local_window < chunk_size <= original_length``."""
    _check_int("chunk_size", chunk_size, 2)
    _check_int("local_window", local_window, 0)
    if chunk_size > original_length:
        raise ValueError(
            f"chunk_size={chunk_size} is larger than the model's original window ({original_length} tokens): "
            f"Dual Chunk Attention keeps every distance <= chunk_size, so it must fit in the pre-training "
            f"window. Use chunk_size <= {original_length} (default {default_chunk_size(original_length)})."
        )
    if local_window >= chunk_size:
        raise ValueError(
            f"local_window={local_window} must be smaller than chunk_size={chunk_size}: the chunk length is "
            f"chunk_size - local_window. Use e.g. local_window={max(0, min(default_local_window(original_length), chunk_size // 4))}."
        )


def chunk_length(chunk_size: int, local_window: int) -> int:
    """s = c - w, the number of tokens per chunk."""
    return chunk_size - local_window


def relative_distance(query_position: int, key_position: int, chunk_size: int, local_window: int) -> int:
    """The distance Dual Chunk Attention gives a query at ``query_position`` and a key at ``key_position``.

    Args:
        query_position, key_position: true positions, ``key_position <= query_position``.
        chunk_size, local_window: c and w (see the module docstring).

    Returns:
        ``P_q - (j mod s)`` with ``P_q`` the intra-, successive- or inter-chunk query index; always in
        ``[0, chunk_size]``.
    """
    s = chunk_length(chunk_size, local_window)
    query_chunk, key_chunk = query_position // s, key_position // s
    if query_chunk == key_chunk:
        query_index = query_position % s
    elif query_chunk == key_chunk + 1:
        query_index = min(query_position % s + s, chunk_size)
    else:
        query_index = min(2 * s - 1, chunk_size)
    return query_index - key_position % s


def length_scale(sequence_length: int, original_length: int) -> float:
    """YaRN's attention factor for a sequence of ``T`` tokens, clipped at 1: ``max(1, 0.1 ln(T / L) + 1)``.

    Qwen2.5-1M's DCA (vLLM's and SGLang's backends) multiplies q and k each by it, so scores scale by its
    square; 1 for ``T <= L``.
    """
    if sequence_length <= original_length:
        return 1.0
    return 0.1 * math.log(sequence_length / original_length) + 1.0


register_method(
    "dca",
    "Dual Chunk Attention: intra-, successive- and inter-chunk position indices, every distance <= chunk_size "
    "(An et al. 2024, ChunkLlama)",
    "attention",
    DualChunkParams,
)(relative_distance)
