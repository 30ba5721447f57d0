"""Attention kernels on the cases the model-level tests rarely reach (found by bench/mutation.py).

``attention_with_lse`` has a fused CPU path (float32 / bfloat16) and an explicit one (other dtypes, other
devices): both must give output 0 and log-sum-exp -inf on a row with no key to attend, and equal
softmax attention elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_posext.backends.attention.kernels import attention_with_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused CPU kernel / explicit path
def test_rows_without_keys_are_empty_and_the_others_are_softmax_attention(dtype):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=generator, dtype=dtype) for _ in range(3))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    mask[..., 2, :] = False  # query 2 sees no key
    output, lse = attention_with_lse(q, k, v, mask, 0.5)
    scores = (q.double() @ k.double().transpose(2, 3) * 0.5).masked_fill(~mask, -math.inf)
    expected_lse = torch.logsumexp(scores, -1)
    expected = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ v.double()
    assert torch.all(output[..., 2, :] == 0) and torch.all(lse[..., 2] == -math.inf)
    torch.testing.assert_close(output.double(), expected, atol=1e-6, rtol=1e-5)
    keep = torch.arange(5) != 2
    torch.testing.assert_close(lse[..., keep].double(), expected_lse[..., keep], atol=1e-6, rtol=1e-6)
    causal, causal_lse = attention_with_lse(q, k, v, None, 0.5, is_causal=True)
    full = torch.ones(5, 5, dtype=torch.bool).tril()
    by_mask, by_mask_lse = attention_with_lse(q, k, v, full, 0.5)
    torch.testing.assert_close(causal, by_mask, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(causal_lse, by_mask_lse, atol=1e-6, rtol=1e-5)


def test_decode_masks_per_head_or_with_extra_rows_equal_the_shared_mask():
    from hf_posext.backends.attention.kernels import finish_decode

    generator = torch.Generator().manual_seed(1)
    batch, kv_heads, groups, rows, keys = 2, 2, 3, 4, 9
    scores = torch.randn(batch, kv_heads, groups, rows, keys, generator=generator)
    value = torch.randn(batch, kv_heads, keys, 5, generator=generator)
    shared = torch.rand(batch, 1, rows, keys, generator=generator) > 0.3
    shared[..., 0] = True
    expected = finish_decode(scores, shared, None, value)
    per_head = shared.expand(batch, kv_heads * groups, rows, keys).clone()
    extra_rows = torch.cat([shared, torch.zeros(batch, 1, 2, keys, dtype=torch.bool)], dim=2)
    for mask in (per_head, extra_rows, torch.zeros(shared.shape).masked_fill(~shared, torch.finfo(torch.float32).min)):
        torch.testing.assert_close(finish_decode(scores, mask, None, value), expected)
    assert expected.shape == (batch, rows, kv_heads * groups, 5)
    assert not torch.allclose(finish_decode(scores, None, None, value), expected)  # the mask mattered


def test_dual_chunk_explicit_takes_a_per_head_mask():
    from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_explicit

    generator = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 30, 8, generator=generator), torch.randn(2, 2, 30, 8, generator=generator), torch.randn(2, 2, 30, 8, generator=generator)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    layer = DualChunkLayerSettings(inv_freq, 8, False, 12, 2, "sdpa")
    pos = torch.arange(30)[None]
    shared = torch.ones(2, 1, 30, 30, dtype=torch.bool).tril()
    shared[1, ..., 4:7] = False
    expected = dual_chunk_explicit(q, k, v, shared, pos, pos, layer, 8 ** -0.5)
    per_head = dual_chunk_explicit(q, k, v, shared.expand(2, 4, 30, 30).clone(), pos, pos, layer, 8 ** -0.5)
    torch.testing.assert_close(per_head, expected)
    assert not torch.allclose(dual_chunk_explicit(q, k, v, None, pos, pos, layer, 8 ** -0.5), expected)


def test_attention_method_parameters_have_their_lower_bounds():
    from hf_posext.methods.attention import SelfExtendParams, check_neighbor_window
    from hf_posext.methods.dual_chunk import DualChunkParams, check_chunk_sizes

    assert SelfExtendParams(group_size=1, neighbor_window=1).group_size == 1
    with pytest.raises(ValueError, match="group_size must be an integer >= 1, got 0"):
        SelfExtendParams(group_size=0)
    with pytest.raises(ValueError, match="neighbor_window must be an integer >= 1, got 0"):
        SelfExtendParams(neighbor_window=0)
    check_neighbor_window(1, 64)
    with pytest.raises(ValueError, match="neighbor_window must be an integer >= 1, got 0"):
        check_neighbor_window(0, 64)
    assert DualChunkParams(chunk_size=2, local_window=0).local_window == 0
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 2, got 1"):
        DualChunkParams(chunk_size=1)
    with pytest.raises(ValueError, match="local_window must be an integer >= 0, got -1"):
        DualChunkParams(local_window=-1)
    check_chunk_sizes(2, 0, 64)
    with pytest.raises(ValueError, match="local_window must be an integer >= 0, got -1"):
        check_chunk_sizes(24, -1, 64)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 2, got 1"):
        check_chunk_sizes(1, 0, 64)
    # A window that does not fit the chunk: the suggestion is a valid window (0 for a chunk of 3).
    with pytest.raises(ValueError, match=r"Use e\.g\. local_window=0\.$"):
        check_chunk_sizes(3, 3, 64)
    with pytest.raises(ValueError, match=r"Use e\.g\. local_window=10\.$"):  # a quarter of the chunk, below L / 16
        check_chunk_sizes(40, 40, 4096)


def test_step_tables_are_reused_only_for_the_same_positions_and_frequencies():
    from hf_posext.backends.attention.kernels import StepTables

    tables, built = StepTables(), []
    positions, frequencies = torch.arange(5)[None], torch.ones(4)

    def build():
        built.append(1)
        return len(built)

    assert tables.get(("k",), positions, frequencies, build) == 1
    assert tables.get(("k",), positions, frequencies, build) == 1  # the next layer of the step: reused
    assert tables.get(("k",), positions, torch.ones(4), build) == 2  # other frequencies (a re-patch): rebuilt
    assert tables.get(("k",), positions.clone(), torch.ones(4), build) == 3  # another step: rebuilt
    assert tables.get(("k",), None, frequencies, build) == 4  # no positions: never reused


def test_dual_chunk_logit_cap_is_the_same_in_the_explicit_pass_and_the_decode_step():
    """Gemma 2's logit cap: cap * tanh(score / cap), applied alike by both paths; it changes the result."""
    from hf_posext.backends.attention import dual_chunk
    from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_decode, dual_chunk_explicit

    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 50, 8, generator=generator) * 3 for _ in range(3))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    layer = DualChunkLayerSettings(inv_freq, 8, False, 16, 4, "sdpa")
    pos = torch.arange(50)[None]
    capped = dual_chunk_explicit(q[:, :, -3:], k, v, None, pos[:, -3:], pos, layer, 0.5, softcap=2.0)
    dual_chunk.clear_decode_tables()
    step = dual_chunk_decode(q[:, :, -3:], k, v, None, pos[:, -3:].clone(), layer, 0.5, softcap=2.0)
    dual_chunk.clear_decode_tables()
    torch.testing.assert_close(step, capped, atol=1e-5, rtol=1e-5)
    uncapped = dual_chunk_explicit(q[:, :, -3:], k, v, None, pos[:, -3:], pos, layer, 0.5)
    assert (uncapped - capped).abs().max() > 1e-2


def test_a_chunk_as_long_as_the_window_is_accepted():
    from hf_posext.methods.dual_chunk import check_chunk_sizes

    check_chunk_sizes(64, 16, 64)  # chunk_size == original window: every distance still fits
    with pytest.raises(ValueError, match=r"chunk_size=65 is larger than the model's original window \(64 tokens\)"):
        check_chunk_sizes(65, 16, 64)


def test_a_self_extend_decode_step_rotates_only_the_new_keys(monkeypatch):
    """Each decode step reuses the grouped rotation of the keys the layer saw at the previous step: with a
    cache of n keys it rotates the 1 new key, not all n + 1 again (the cost of a step would grow with n)."""
    import hf_posext
    from hf_posext.backends.attention import self_extend_kernels
    from hf_posext.models import tiny_model

    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=10)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    rotated = []
    real = self_extend_kernels.rotate_with
    monkeypatch.setattr(self_extend_kernels, "rotate_with", lambda states, *a, **kw: rotated.append(states.shape[2]) or real(states, *a, **kw))
    with torch.no_grad():
        cache = model(ids[:, :40], use_cache=True).past_key_values
        prefill, rotated[:] = list(rotated), []
        for t in range(40, 44):
            cache = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).past_key_values
    assert 40 in prefill  # the prompt's keys are rotated once per layer
    assert rotated and max(rotated) == 1, rotated  # every step: the new query and the one new key only


def test_dca_with_a_score_budget_below_one_row_still_runs_a_row_at_a_time():
    """block_elements smaller than one query row's scores: one query per block, the same output (not a zero step)."""
    from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_explicit

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    layer = DualChunkLayerSettings(inv_freq, 8, False, 12, 3, "sdpa")
    pos = torch.arange(30)[None]
    whole = dual_chunk_explicit(q, k, v, None, pos, pos, layer, 8 ** -0.5)
    by_rows = dual_chunk_explicit(q, k, v, None, pos, pos, layer, 8 ** -0.5, block_elements=1)
    torch.testing.assert_close(by_rows, whole, atol=1e-12, rtol=0)


def test_dca_refusal_suggests_a_whole_local_window():
    from hf_posext.methods.dual_chunk import DualChunkParams

    with pytest.raises(ValueError, match=r"Use e\.g\. local_window=6\.$"):
        DualChunkParams(chunk_size=25, local_window=25)
