"""Attention-level methods on a position-sensitive tiny model, each check >= 100x its tolerance from a broken variant.

On the default tiny model (init 0.02) the logits barely depend on position: a neighbour window or a
local window one off moves them by about 4e-4, under 30x a 1e-5 tolerance (measured). With init 0.1
the same one-off change moves them by 0.27 (Self-Extend) and 0.29 (DCA), about 8000x the tolerance,
while sdpa and eager differ by 1.2e-6. Every comparison below goes through ``assert_close_guarding``,
which fails unless the broken variant is >= 100x the tolerance away.
"""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.models import tiny_model
from tests.conftest import assert_close_guarding, logits_of, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

# (method, settings, the same settings one off: the broken variant each check must tell apart)
CASES = {
    "self-extend": (dict(group_size=3, neighbor_window=10), dict(group_size=3, neighbor_window=11)),
    "dca": (dict(factor=2, chunk_size=24, local_window=4), dict(factor=2, chunk_size=24, local_window=5)),
}


def _ids(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))


def _patched(method: str, settings: dict, implementation: str = "eager"):
    model = tiny_model("llama", initializer_range=0.1)
    model.set_attn_implementation(implementation)
    return hf_posext.patch(model, method, **settings)


@pytest.mark.parametrize("method", sorted(CASES))
def test_sdpa_equals_eager_far_from_a_one_off_variant(method):
    settings, one_off = CASES[method]
    ids = _ids(120)
    eager = logits_of(_patched(method, settings), ids)
    broken = logits_of(_patched(method, one_off), ids)
    assert_close_guarding(logits_of(_patched(method, settings, "sdpa"), ids), eager, broken, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", sorted(CASES))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_cached_chunks_equal_full_recompute_far_from_a_one_off_variant(method, implementation):
    settings, one_off = CASES[method]
    ids = _ids(110, batch=1)
    model = _patched(method, settings, implementation)
    full = logits_of(model, ids)
    broken = logits_of(_patched(method, one_off, implementation), ids)
    with torch.no_grad():
        out = model(ids[:, :70], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for start in (70, 85, 100, 105, 106, 107, 108, 109):  # chunks, then single tokens
            stop = {70: 85, 85: 100, 100: 105}.get(start, start + 1)
            out = model(ids[:, start:stop], past_key_values=cache, use_cache=True)
            cache, parts = out.past_key_values, parts + [out.logits]
    cached = torch.cat(parts, 1)
    assert cached.shape == full.shape
    assert_close_guarding(cached[:, 70:], full[:, 70:], broken[:, 70:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", sorted(CASES))
def test_save_and_load_far_from_a_one_off_variant(method, tmp_path):
    settings, one_off = CASES[method]
    ids = _ids(120, batch=1)
    model = _patched(method, settings, "sdpa")
    expected = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    broken = logits_of(_patched(method, one_off, "sdpa"), ids)
    assert_close_guarding(logits_of(hf_posext.load(tmp_path), ids), expected, broken, atol=1e-5, rtol=1e-5)
