"""What a rotary module computes, found by probing its output: base, layout, rotated pairs, position rows.

A rotary module is called on probe positions and compared with our own module built from candidate
settings (each base the config names, each output layout of :mod:`hf_posext.backends.rope.layouts`). The
first candidate that reproduces the output is the module's description; none reproducing it is an error,
never a guess. Two structural rules are read here from the module itself:

- **proportional partial rotary** (Gemma 4, LFM3 global layers): the frequency buffer ends in zeros; only
  the leading non-zero pairs rotate, with exponent denominator the full width
  (:class:`~hf_posext.methods.rope.RotaryBase` ``rotated_pairs``);
- **multimodal position rows** (Qwen3.5, Qwen-VL): the module accepts 3-D ``position_ids`` (temporal,
  height, width) and each pair rotates by one row's positions; which row is found by moving one row at a time.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from hf_posext.backends.rope.layouts import LAYOUTS, PROBE_ORDER
from hf_posext.backends.rope.module import RotaryEntry, ScaledRotaryEmbedding
from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.request import ScalingConfig
from hf_posext.methods.rope import RotaryBase

__all__ = ["probe", "outputs_match", "rotated_pairs", "identify_rotary", "probe_positions", "POSITION_ROWS"]

#: Rows of multimodal position ids (temporal, height, width) that a probe moves one at a time.
POSITION_ROWS = 3


def probe_positions(limit: int) -> torch.Tensor:
    """``[1, n]`` probe positions below ``limit``: the first few, some powers, the middle and the last."""
    points = sorted({0, 1, 2, 3, 7, 31, 100, 1000, limit // 2, limit - 1})
    return torch.tensor([[p for p in points if 0 <= p < limit]], dtype=torch.long)


def probe(module: nn.Module, positions: torch.Tensor, layer_type: str | None = None) -> tuple[torch.Tensor, ...]:
    """Run a rotary module on ``positions`` (2-D, or 3-D multimodal rows) with a float32 input.

    Returns:
        Its output as a tuple of tensors: float32, or complex as returned (a single tensor becomes a 1-tuple).
    """
    length = positions.shape[-1]
    x = torch.zeros(1, length, 1, dtype=torch.float32, device=positions.device)
    with torch.no_grad():
        if layer_type is None:
            out = module(x, position_ids=positions)
        else:
            out = module(x, position_ids=positions, layer_type=layer_type)
    out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    return tuple(t if t.is_complex() else t.float() for t in out)


def outputs_match(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], tol: float = 1e-4) -> bool:
    """Same number of tensors, same shapes and kinds, values equal within ``tol`` (absolute and relative)."""
    if len(a) != len(b) or any(x.shape != y.shape or x.is_complex() != y.is_complex() for x, y in zip(a, b)):
        return False
    return all(torch.allclose(x.cpu(), y.cpu(), atol=tol, rtol=tol) for x, y in zip(a, b))


def rotated_pairs(inv_freq: torch.Tensor) -> int | None:
    """The number of leading non-zero frequencies when the rest are zeros (proportional RoPE), else None."""
    zero = inv_freq == 0
    count = int((~zero).sum())
    if count == 0 or count == inv_freq.numel() or bool(zero[:count].any()):
        return None
    return count


def _candidate_thetas(config, params: dict[str, Any] | None) -> list[float]:
    values = []
    if params and params.get("rope_theta"):
        values.append(float(params["rope_theta"]))
    for name in ("rope_theta", "rotary_emb_base", "rope_local_base_freq"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and value > 0:
            values.append(float(value))
    values.append(10000.0)  # transformers' default_theta (GPT-J hard-codes it)
    return list(dict.fromkeys(values))


def _ours(rope: RotaryBase, current: ScalingConfig, layout: str, device, rows=None) -> ScaledRotaryEmbedding:
    return ScaledRotaryEmbedding({None: RotaryEntry(rope, current)}, layout=layout, device=device, position_rows=rows)


def _find_rows(module: nn.Module, layout: str, positions: torch.Tensor, layer_type, pairs: int, plain) -> torch.Tensor | None:
    """For each rotated pair, the row of 3-D position ids it rotates by; None when the module is plain RoPE."""
    shifted = positions + 1  # no zero position, so every rotating pair moves
    rows = torch.full((pairs,), -1, dtype=torch.long)
    for row in range(POSITION_ROWS):
        ids = torch.zeros(POSITION_ROWS, *positions.shape, dtype=torch.long, device=positions.device)
        ids[row] = shifted
        try:
            out = probe(module, ids, layer_type)
        except Exception:  # the module takes 2-D position ids only
            return None
        if len(out) != len(plain) or any(a.shape != b.shape for a, b in zip(out, plain)):
            return None
        moved = LAYOUTS[layout].sines(out).abs().reshape(-1, pairs).amax(dim=0).cpu() > 0
        if bool((rows[moved] >= 0).any()):
            return None  # a pair moved by two rows: not a per-pair selection
        rows[moved] = row
    rows[rows < 0] = 0  # pairs that never rotate (proportional zeros)
    return None if bool((rows == 0).all()) else rows


def _rows_reproduced(module, ours, positions, layer_type) -> bool:
    ids = torch.stack([positions + 1, 2 * positions + 3, 3 * positions + 5])
    return outputs_match(probe(ours, ids), probe(module, ids, layer_type))


def identify_rotary(
    module: nn.Module, hint: str, dim: int, pairs: int | None, config, params: dict, current: ScalingConfig, path: str,
    layer_type: str | None,
) -> tuple[float, str, torch.Tensor | None]:
    """(base, layout, position rows) with which our module reproduces ``module`` for ``layer_type``.

    Args:
        module: the rotary module. hint: the layout its buffers suggest (tried first). dim: rotary dim.
        pairs: rotating pairs (proportional RoPE), None for all. config / params: its config and flat rope
            dict. current: the scaling that dict describes. path: for messages.

    Raises:
        UnsupportedModelError: the module cannot be called, or no candidate reproduces it.
    """
    device = next(iter(module.buffers())).device
    positions = probe_positions(current.original_max_position_embeddings).to(device)
    try:
        actual = probe(module, positions, layer_type)
    except Exception as error:  # the module's own forward failed on a plain call
        raise UnsupportedModelError(
            f"The rotary module at {path!r} ({type(module).__name__}) could not be called as "
            f"forward(x, position_ids{', layer_type' if layer_type else ''}): {error}"
        ) from error
    # A model cast with .half() / .to(torch.bfloat16) carries rounded inverse frequencies: compare against
    # ours rounded the same way (the patched module keeps them float32, as loading with dtype= does).
    rounded = [d for d in {b.dtype for n, b in module.named_buffers() if "inv_freq" in n and b.is_floating_point()} if d != torch.float32]
    thetas = _candidate_thetas(config, params)
    for layout in dict.fromkeys((hint, *PROBE_ORDER)):
        for theta in thetas:
            ours = _ours(RotaryBase(theta, dim, pairs), current, layout, device)
            if not outputs_match(probe(ours, positions), actual):
                if len(rounded) != 1 or not _matches_rounded(ours, positions, actual, rounded[0], path):
                    continue
            rows = _find_rows(module, layout, positions, layer_type, dim // 2, actual)
            if rows is not None and not _rows_reproduced(module, _ours(RotaryBase(theta, dim, pairs), current, layout, device, rows), positions, layer_type):
                break  # multimodal rows we cannot reproduce: try no other base with this layout
            return theta, layout, rows
    raise UnsupportedModelError(
        f"The rotary module at {path!r} ({type(module).__name__}, layer type {layer_type!r}) does not produce "
        f"what its config describes (rope_type={params.get('rope_type')!r}, tried bases "
        f"{', '.join(f'{t:g}' for t in thetas)}, rotary dim {dim}, layouts {', '.join(dict.fromkeys((hint, *PROBE_ORDER)))}): "
        "please report it with your transformers version."
    )


def _matches_rounded(ours: ScaledRotaryEmbedding, positions, actual, dtype: torch.dtype, path: str) -> bool:
    name = ours.buffer_name(None)
    setattr(ours, name, getattr(ours, name).to(dtype).float())
    if not outputs_match(probe(ours, positions), actual):
        return False
    warnings.warn(
        f"The rotary frequencies at {path!r} are stored in {dtype} (the model was cast with "
        ".half() or .to(dtype)), which rounds them and shifts every position's angle. The patched "
        "model computes them in float32, as from_pretrained(..., dtype=...) does; unpatch restores "
        "the rounded ones. Load with dtype= instead of casting to keep the original model exact.",
        stacklevel=5,
    )
    return True
