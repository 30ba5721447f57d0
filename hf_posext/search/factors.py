"""The search space of LongRoPE factors: projection, starting points, carrying factors to a new scale, and
the calibration segments the fitness is measured on."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from hf_posext.search.result import SearchResult, read_result_json

__all__ = ["make_monotone", "initial_factors", "rescale_factors", "calibration_segments", "calibration_windows"]


def make_monotone(factors: torch.Tensor, max_factor: float) -> torch.Tensor:
    """Project factors onto the search space: clamp to ``[1, max_factor]``, then a running maximum."""
    clamped = factors.double().clamp(1.0, max_factor)
    return torch.cummax(clamped, dim=-1).values


def initial_factors(theta: float, dim: int, original_length: int, factor: float) -> dict[str, torch.Tensor]:
    """The starting points: per-dimension factors theta_i / theta'_i of PI, YaRN and NTK-aware scaling."""
    from hf_posext.methods import get_method
    from hf_posext.methods.rope import RotaryBase

    rope = RotaryBase(theta, dim)
    original = rope.inv_freq().double()
    starts = {}
    for name, method in (("pi", "linear"), ("yarn", "yarn"), ("ntk", "ntk")):
        spec = get_method(method)
        inv_freq, _ = spec.compute(rope, original_length, factor, None, spec.parse_params({}))
        starts[name] = original / inv_freq.double()
    return starts


def rescale_factors(factors: Any, to_scale: float, *, dim: int | None = None, original_length: int | None = None) -> torch.Tensor:
    """Carry factors searched at scale s to scale s' = ``to_scale``: ``lambda_i ** (ln s' / ln s)``.

    A dimension left unscaled (1) stays 1, one interpolated by PI's s becomes s', and the order of the
    factors is kept, so the result is a valid starting point of a search at the new scale.

    Args:
        factors: a :class:`SearchResult`, the path of the JSON it wrote, or a mapping with ``long_factor``
            and ``factor`` (the scale s the factors were searched at).
        to_scale: the new scale s' (> 1).
        dim: when given, the rotary dimension the factors must fit (``dim // 2`` values).
        original_length: when given, the pre-training window the factors must have been searched for.

    Raises:
        ValueError: a missing or unreadable file, no ``long_factor``/``factor``, a scale <= 1, factors
            for another rotary dimension or window.
    """
    if isinstance(factors, SearchResult):
        data: dict[str, Any] = factors.to_dict()
        source = "the given SearchResult"
    elif isinstance(factors, (str, os.PathLike)):
        data = read_result_json(factors, "start_from")
        source = repr(str(factors))
    elif isinstance(factors, dict):
        data, source = factors, "the given mapping"
    else:
        raise ValueError(f"start_from takes search results (JSON paths, SearchResult or dicts), got {type(factors).__name__}.")
    if not isinstance(data, dict) or "long_factor" not in data or "factor" not in data:
        raise ValueError(f"start_from: {source} needs 'long_factor' and 'factor' (the JSON search_factors writes).")
    old_scale = float(data["factor"])
    if old_scale <= 1.0 or to_scale <= 1.0:
        raise ValueError(f"start_from: both scales must exceed 1 (searched at {old_scale:g}, now {to_scale:g}).")
    values = torch.tensor([float(v) for v in data["long_factor"]], dtype=torch.float64)
    if dim is not None and values.numel() != dim // 2:
        raise ValueError(
            f"start_from: {source} holds {values.numel()} factors, this model's rotary dimension {dim} needs {dim // 2}."
        )
    searched_window = data.get("original_max_position_embeddings")
    if original_length is not None and searched_window is not None and int(searched_window) != original_length:
        raise ValueError(
            f"start_from: {source} was searched for a {searched_window}-token window, this model's is {original_length}."
        )
    return values.clamp_min(1.0) ** (math.log(to_scale) / math.log(old_scale))


def calibration_segments(
    data: Any, target_length: int, segments: int, tokenizer: Any = None, *, bos: str = "auto", text_field: str | None = None
) -> torch.Tensor:
    """``[segments, target_length]`` token ids to measure the fitness on.

    Args:
        data: token ids (a tensor or list of lists, each at least ``target_length`` long), or text: a
            source understood by :func:`hf_posext.text_sources.load_documents` (file, folder, dataset name,
            ``builtin:python-docs``) or a list of document strings (needs ``tokenizer``).
        target_length: tokens per segment.
        segments: how many segments (the first ones, documents joined).
        tokenizer: the model's tokenizer, for text.
        bos: start segments with BOS: ``"auto"`` (when the tokenizer adds one), ``"yes"``, ``"no"``.
        text_field: JSON field / column holding the text of .jsonl / .parquet sources.

    Raises:
        ValueError: too little data for one segment, text without a tokenizer.
    """
    if isinstance(data, torch.Tensor) or (isinstance(data, (list, tuple)) and data and not isinstance(data[0], str)):
        rows = [list(map(int, row)) for row in (data.tolist() if isinstance(data, torch.Tensor) else data)]
        rows = [row[:target_length] for row in rows if len(row) >= target_length][:segments]
        if not rows:
            raise ValueError(f"No row of the given token ids has the {target_length} tokens one calibration segment needs.")
        return torch.tensor(rows, dtype=torch.long)
    if tokenizer is None:
        raise ValueError("Calibration text needs the model's tokenizer: search_factors(..., tokenizer=tokenizer).")
    from hf_posext.text_sources import load_documents
    from hf_posext.evaluation.perplexity import make_segments, tokenize_documents, uses_bos

    documents = [str(d) for d in data] if isinstance(data, (list, tuple)) else load_documents(data, text_field=text_field)
    token_docs = tokenize_documents(tokenizer, documents, concatenate=True)
    found, _ = make_segments(token_docs, target_length, segments, uses_bos(tokenizer, bos))
    return torch.tensor([ids for _, _, ids in found], dtype=torch.long)


calibration_windows = calibration_segments  # its name before evaluation segments were called segments
