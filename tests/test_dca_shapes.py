"""Dual Chunk Attention at (chunk_size, local_window) shapes where each cap of the position indices binds.

With s = chunk_size - local_window, the successive-chunk query index is min(r + s, chunk_size) and the
inter-chunk one min(2s - 1, chunk_size). The shape tests/test_dca.py uses (24, 4) takes chunk_size for
the inter-chunk index, so a rule that always took chunk_size would pass there. Here every kernel
(explicit, fused, decode step) is compared with the paper's construction at shapes where the
inter-chunk index is 2s - 1, and where the successive one is capped for some queries and not for
others, against a broken construction that drops that cap (the effect the comparison guards).
"""

from __future__ import annotations

import pytest
import torch

from hf_posext.backends.attention import dual_chunk
from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_decode, dual_chunk_explicit, dual_chunk_fused
from hf_posext.methods.dual_chunk import relative_distance
from tests.conftest import assert_close_guarding, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

LENGTH = 61


def _rope64(states: torch.Tensor, positions: list[int], inv_freq: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE of raw ``states`` [B, H, T, D] at ``positions``, in float64."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = states.shape[-1] // 2
    x = states.double()
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _index_sets(length: int, chunk_size: int, local_window: int, broken: str | None = None):
    """Key, intra-, successive- and inter-chunk index lists (the paper's), or with one cap dropped."""
    s = chunk_size - local_window
    keys = [p % s for p in range(length)]
    successive_cap = 2 * chunk_size if broken == "successive" else chunk_size
    successive = [min(p % s + s, successive_cap) for p in range(length)]
    inter_index = chunk_size if broken == "inter" else min(2 * s - 1, chunk_size)
    return keys, keys, successive, [inter_index] * length


def _reference(q, k, v, inv_freq, chunk_size, local_window, broken=None):
    """The paper's construction on raw q, k, v ``[B, H, T, D]`` (float64), ``[B, T, H, D]`` out."""
    length = q.shape[2]
    s = chunk_size - local_window
    keys, intra, succ, inter = _index_sets(length, chunk_size, local_window, broken)
    k_rot = _rope64(k, keys, inv_freq)
    scores = {name: _rope64(q, index, inv_freq) @ k_rot.transpose(2, 3) for name, index in
              (("intra", intra), ("succ", succ), ("inter", inter))}
    gap = torch.arange(length)[:, None] // s - torch.arange(length)[None, :] // s
    out = torch.where(gap <= 0, scores["intra"], torch.where(gap == 1, scores["succ"], scores["inter"]))
    causal = torch.arange(length)[:, None] >= torch.arange(length)[None, :]
    out = (out * q.shape[-1] ** -0.5).masked_fill(~causal, float("-inf"))
    return (torch.softmax(out, -1) @ v.double()).transpose(1, 2)


# (chunk_size, local_window, the cap this shape makes bind, and the broken rule that drops it)
SHAPES = [
    (24, 12, "inter"),  # s = 12: inter-chunk index 2s - 1 = 23 < chunk_size
    (16, 9, "inter"),  # s = 7: 13 < 16
    (16, 6, "successive"),  # s = 10: r + s > 16 for r >= 7, not below
    (20, 9, "successive"),  # s = 11: capped only for r = 10
]


@pytest.mark.parametrize("chunk_size, local_window, cap", SHAPES)
def test_relative_distance_caps_at_each_shape(chunk_size, local_window, cap):
    s = chunk_size - local_window
    for i in range(0, 4 * s + 3):
        for j in range(0, i + 1):
            gap = i // s - j // s
            expected = i - j if gap == 0 else min(i % s + s, chunk_size) - j % s if gap == 1 else min(2 * s - 1, chunk_size) - j % s
            assert relative_distance(i, j, chunk_size, local_window) == expected


@pytest.mark.parametrize("chunk_size, local_window, cap", SHAPES)
def test_every_kernel_matches_the_paper_where_the_cap_binds(chunk_size, local_window, cap):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, LENGTH, 8), torch.randn(1, 2, LENGTH, 8), torch.randn(1, 2, LENGTH, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    k2, v2 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = _reference(q, k2, v2, inv_freq, chunk_size, local_window)
    broken = _reference(q, k2, v2, inv_freq, chunk_size, local_window, broken=cap)
    true = list(range(LENGTH))
    rq, rk = _rope64(q, true, inv_freq).float(), _rope64(k, true, inv_freq).float()
    pos = torch.arange(LENGTH)[None]
    layer = DualChunkLayerSettings(inv_freq, 8, False, chunk_size, local_window, "sdpa")
    scaling = 8 ** -0.5
    explicit = dual_chunk_explicit(rq, rk, v, None, pos, pos, layer, scaling)
    fused = dual_chunk_fused(rq, rk, v, None, 0, layer, scaling, block=7)
    # float32 kernels against the float64 construction: measured differences <= 1.2e-6.
    assert_close_guarding(explicit.double(), expected, broken, atol=1e-5, rtol=1e-5)
    assert_close_guarding(fused.double(), expected, broken, atol=1e-5, rtol=1e-5)
    # The decode step (few queries against the cache, one rotation per chunk distance) for the last
    # chunk length of queries: every remainder r, so capped and uncapped successive indices alike.
    dual_chunk.clear_decode_tables()
    rows = chunk_size - local_window
    step = dual_chunk_decode(rq[:, :, -rows:], rk, v, None, pos[:, -rows:].clone(), layer, scaling)
    dual_chunk.clear_decode_tables()
    assert_close_guarding(step.double(), expected[:, -rows:], broken[:, -rows:], atol=1e-5, rtol=1e-5)
