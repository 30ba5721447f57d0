"""Each attention-level method at and around its documented boundaries.

STRING keeps a distance d exact while ``d < S`` and shifts it from ``d = S`` on: a sequence of exactly S
tokens is the model's own, S + 1 tokens shift one pair. DCA splits into chunks of ``chunk_size -
local_window`` tokens and, with ``attention_scale``, multiplies scores by ``f(T)^2``, ``f(T) = max(1, 0.1
ln(T / L) + 1)``: between the chunk length and the window L the factor must clip to 1, past L it must
not. Self-Extend keeps distances below its neighbor window W exact and groups the others. Each boundary is
checked one token below, at, and one above, against the float64 reference constructions of the method's
own test module, on SDPA, eager and cached decode steps.
"""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import self_extend, self_extend_kernels
from hf_posext.models import tiny_model
from tests import test_dca, test_dca_scale, test_self_extend, test_string
from tests.conftest import logits_of, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

WINDOW = 64  # the tiny Llama's max_position_embeddings
ATOL = RTOL = 1e-5


def _model(implementation: str = "sdpa"):
    model = tiny_model("llama", initializer_range=0.1)
    model.set_attn_implementation(implementation)
    return model


def _ids(length: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(7))


def _steps(model, ids, prefix: int) -> torch.Tensor:
    """Logits of a prefill of ``prefix`` tokens, then one cached token at a time to the end."""
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for position in range(prefix, ids.shape[1]):
            out = model(ids[:, position : position + 1], past_key_values=cache, use_cache=True)
            cache, parts = out.past_key_values, parts + [out.logits]
    return torch.cat(parts, 1)


def _differs(a: torch.Tensor, b: torch.Tensor, margin: float = 100.0) -> bool:
    return (a.float() - b.float()).abs().max().item() > margin * (ATOL + RTOL * b.abs().max().item())


# --------------------------------------------------------------------------------------------------
# STRING: exactly S and S + 1 tokens
# --------------------------------------------------------------------------------------------------

S, W_LOCAL = test_string.SHIFT, test_string.LOCAL  # 24, 6


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("length", [S - 1, S, S + 1, S + 2])
def test_string_prefill_at_and_around_the_shifted_offset(implementation, length):
    ids = _ids(length)
    reference = test_string._reference_logits(_model(), ids)
    model = _model(implementation)
    unpatched = logits_of(model, ids)
    hf_posext.patch(model, "string", shifted_offset=S, local_value=W_LOCAL)
    patched = logits_of(model, ids)
    torch.testing.assert_close(patched, reference, atol=ATOL, rtol=RTOL)
    if length <= S:  # every distance is below S: the model's own attention (on SDPA its very kernel, bit for bit)
        torch.testing.assert_close(patched, unpatched, atol=ATOL, rtol=RTOL)
        assert implementation != "sdpa" or torch.equal(patched, unpatched)
    else:  # distance S (the last query, the first key) is shifted: the last row must change
        assert _differs(patched[:, S:], unpatched[:, S:])
        torch.testing.assert_close(patched[:, :S], unpatched[:, :S], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_string_decode_steps_across_the_shifted_offset(implementation):
    ids = _ids(S + 3)
    reference = test_string._reference_logits(_model(), ids)
    model = _model(implementation)
    unpatched = logits_of(model, ids)
    unpatched_steps = _steps(model, ids, S - 2)
    hf_posext.patch(model, "string", shifted_offset=S, local_value=W_LOCAL)
    cached = _steps(model, ids, S - 2)  # steps with S - 1, S, S + 1, S + 2, S + 3 keys
    torch.testing.assert_close(cached, reference, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cached[:, :S], unpatched[:, :S], atol=ATOL, rtol=RTOL)
    assert implementation != "sdpa" or torch.equal(cached[:, :S], unpatched_steps[:, :S])  # up to S keys: SDPA itself
    assert _differs(cached[:, S], unpatched[:, S])  # the step with S + 1 keys is the first one shifted


# --------------------------------------------------------------------------------------------------
# DCA: the chunk length, and the length scale between the chunk length and the window
# --------------------------------------------------------------------------------------------------

CHUNK_SIZE, LOCAL_WINDOW = test_dca.CHUNK_SIZE, test_dca.LOCAL_WINDOW  # 24, 4: chunks of 20 tokens
CHUNK = CHUNK_SIZE - LOCAL_WINDOW


def _dca(implementation: str, scale: bool):
    model = _model(implementation)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, attention_scale=scale)
    return model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("length", [CHUNK, CHUNK + 1, CHUNK_SIZE + 1, CHUNK_SIZE + 2])
def test_dca_prefill_at_and_past_one_chunk(implementation, length):
    """Past one chunk the successive-chunk query index is ``min(inside + CHUNK, CHUNK_SIZE)``: exact up to
    position CHUNK_SIZE (CHUNK_SIZE + 1 tokens), capped from position CHUNK_SIZE + 1 on."""
    ids = _ids(length)
    reference = test_dca._reference_model_logits(_model(), ids)
    model = _model(implementation)
    unpatched = logits_of(model, ids)
    patched = logits_of(_dca(implementation, False), ids)
    torch.testing.assert_close(patched, reference, atol=ATOL, rtol=RTOL)
    if length <= CHUNK:  # one chunk: SDPA itself, bit for bit
        assert implementation != "sdpa" or torch.equal(patched, unpatched)
    if length <= CHUNK_SIZE + 1:
        torch.testing.assert_close(patched, unpatched, atol=ATOL, rtol=RTOL)
    else:
        assert _differs(patched[:, -1], unpatched[:, -1])


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("length", [CHUNK + 1, 40, WINDOW - 1, WINDOW, WINDOW + 1])
def test_dca_length_scale_clips_to_one_up_to_the_window(implementation, length):
    """Prefill: f(T) = 1 for CHUNK < T <= L (scaled = unscaled), f(T) > 1 from T = L + 1 (the reference)."""
    ids = _ids(length)
    scaled = logits_of(_dca(implementation, True), ids)
    unscaled = logits_of(_dca(implementation, False), ids)
    if length <= WINDOW:
        torch.testing.assert_close(scaled, unscaled, atol=1e-6, rtol=1e-6)
    else:
        expected = test_dca_scale._reference_logits(_model(), ids, test_dca_scale._squared)
        torch.testing.assert_close(scaled, expected, atol=ATOL, rtol=RTOL)
        assert _differs(scaled, unscaled, margin=20)  # measured: f(65)^2 = 1.0031 moves logits 78x the tolerance


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_dca_length_scale_of_decode_steps_clips_to_one_up_to_the_window(implementation):
    """Decode steps with T = 30 .. 67 keys: unscaled up to T = L, scaled by f(T)^2 from T = L + 1."""
    ids = _ids(WINDOW + 3)
    prefix = 30
    scaled = _steps(_dca(implementation, True), ids, prefix)
    unscaled = _steps(_dca(implementation, False), ids, prefix)
    expected = test_dca_scale._reference_logits(_model(), ids, test_dca_scale._squared, use_cache_steps=(prefix, WINDOW + 3 - prefix))
    # scaled[:, t] is the logit of position t (T = t + 1 keys); expected[:, 0] is the prefill's last one.
    torch.testing.assert_close(scaled[:, prefix - 1 :], expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(scaled[:, :WINDOW], unscaled[:, :WINDOW], atol=1e-6, rtol=1e-6)
    assert _differs(scaled[:, WINDOW], unscaled[:, WINDOW], margin=20)  # the step with L + 1 keys is the first one scaled


# --------------------------------------------------------------------------------------------------
# Self-Extend: the neighbor window W - 1, W, W + 1
# --------------------------------------------------------------------------------------------------

GROUP, NEIGHBOR = 3, 20
# A grouped pair (i, j), i - j >= W, is seen at i // G - j // G + W - W // G: the pair (W, 0) at W (the same
# as exact), the pair (W + 1, 1) at W + 1 since W % G + 1 >= G (20 % 3 = 2). So the first pair a distance
# check off by one (d <= W exact) would move is at position W + 1: the logits differ from W + 2 tokens on.
FIRST_MOVED = NEIGHBOR + 1


def _self_extend_reference(model, ids):
    """Logits of the unpatched ``model`` with attention replaced by test_self_extend's float64 construction
    (q and k un-rotated from their true positions; a cached call scores zero rows in front of its queries)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    inv_freq = model.model.rotary_emb.inv_freq.double()

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        groups = query.shape[1] // key.shape[1]
        back = -torch.arange(kv_len)[None]
        padded = torch.cat((query.new_zeros(query.shape[0], query.shape[1], kv_len - q_len, query.shape[3]), query), 2)
        raw_q, raw_k = test_self_extend._rope(padded, back, inv_freq), test_self_extend._rope(key, back, inv_freq)
        out = test_self_extend._reference(raw_q, raw_k.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                          GROUP, NEIGHBOR, inv_freq)
        return out[:, kv_len - q_len :].to(query.dtype), None

    AttentionInterface.register("self_extend_boundary_reference_test", attention)
    AttentionMaskInterface.register("self_extend_boundary_reference_test", sdpa_mask)
    model.set_attn_implementation("self_extend_boundary_reference_test")
    try:
        return logits_of(model, ids, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")


def _self_extend(implementation: str):
    model = _model(implementation)
    hf_posext.patch(model, "self-extend", group_size=GROUP, neighbor_window=NEIGHBOR)
    return model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("length", [NEIGHBOR - 1, NEIGHBOR, NEIGHBOR + 1, NEIGHBOR + 2, NEIGHBOR + 3])
def test_self_extend_prefill_at_and_around_the_neighbor_window(implementation, length):
    ids = _ids(length)
    reference = _self_extend_reference(_model(), ids)
    unpatched = logits_of(_model(implementation), ids)
    patched = logits_of(_self_extend(implementation), ids)
    torch.testing.assert_close(patched, reference, atol=ATOL, rtol=RTOL)
    if length <= NEIGHBOR:  # every pair inside the window: SDPA itself, bit for bit
        assert implementation != "sdpa" or torch.equal(patched, unpatched)
    if length <= FIRST_MOVED:
        torch.testing.assert_close(patched, unpatched, atol=ATOL, rtol=RTOL)
    else:
        assert _differs(patched[:, FIRST_MOVED:], unpatched[:, FIRST_MOVED:])


@pytest.mark.parametrize("decode_path", [False, True])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_self_extend_decode_steps_across_the_neighbor_window(monkeypatch, implementation, decode_path):
    """One token at a time from W - 2 to W + 3 keys; ``decode_path``: the accelerator decode kernel, forced on CPU."""
    if decode_path:
        monkeypatch.setattr(self_extend, "DECODE_DEVICES", ("cpu",))
    ids = _ids(NEIGHBOR + 3)
    reference = _self_extend_reference(_model(), ids)
    unpatched = logits_of(_model(implementation), ids)
    cached = _steps(_self_extend(implementation), ids, NEIGHBOR - 2)
    torch.testing.assert_close(cached, reference, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(cached[:, :FIRST_MOVED], unpatched[:, :FIRST_MOVED], atol=ATOL, rtol=RTOL)
    assert _differs(cached[:, FIRST_MOVED], unpatched[:, FIRST_MOVED])  # W + 2 keys: the first pair moved


# --------------------------------------------------------------------------------------------------
# The fused kernels against the explicit ones, swept across each boundary (query blocks of every size)
# --------------------------------------------------------------------------------------------------

HEAD_DIM = 8


def _rotated_qkv(kv_len: int, q_len: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, q_len, HEAD_DIM, generator=generator)
    k, v = torch.randn(1, 2, kv_len, HEAD_DIM, generator=generator), torch.randn(1, 2, kv_len, HEAD_DIM, generator=generator)
    return q, k, v


def _inv_freq(rotary_dim: int = HEAD_DIM) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))


def _sweep(boundary: int):
    for kv_len in range(boundary - 1, boundary + 3):
        for q_len in sorted(n for n in {1, 2, 5, kv_len - 1, kv_len} if n <= kv_len):
            for start in (0, 3):  # the first key's position
                yield kv_len, q_len, start


@pytest.mark.parametrize("block", [1, 3, 512])
def test_string_split_equals_the_explicit_kernel_across_the_shifted_offset(block):
    from hf_posext.backends.attention.shifted_positions import StringLayerSettings, string_explicit, string_split

    layer = StringLayerSettings(_inv_freq(), HEAD_DIM, False, 6, 2, 1.0, "sdpa")
    for kv_len, q_len, start in _sweep(6):
        q, k, v = _rotated_qkv(kv_len, q_len)
        first = start + kv_len - q_len
        expected = string_explicit(q, k, v, None, torch.arange(first, first + q_len)[None],
                                   torch.arange(start, start + kv_len)[None], layer, HEAD_DIM ** -0.5)
        split = string_split(q, k, v, None, first, layer, HEAD_DIM ** -0.5, block=block)
        torch.testing.assert_close(split, expected, atol=1e-5, rtol=1e-5, msg=f"kv_len {kv_len}, q_len {q_len}, start {start}")


@pytest.mark.parametrize("block", [1, 3, 512])
def test_dca_fused_equals_the_explicit_kernel_across_the_chunk_length(block):
    from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_explicit, dual_chunk_fused

    layer = DualChunkLayerSettings(_inv_freq(), HEAD_DIM, False, 8, 2, "sdpa")  # chunks of 6
    for boundary in (6, 8, 12):
        for kv_len, q_len, start in _sweep(boundary):
            if start:
                continue  # the fused path starts at a chunk boundary of the cache: keys from 0
            q, k, v = _rotated_qkv(kv_len, q_len)
            first = kv_len - q_len
            expected = dual_chunk_explicit(q, k, v, None, torch.arange(first, kv_len)[None], torch.arange(kv_len)[None],
                                           layer, HEAD_DIM ** -0.5)
            fused = dual_chunk_fused(q, k, v, None, first, layer, HEAD_DIM ** -0.5, block=block)
            torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-5, msg=f"kv_len {kv_len}, q_len {q_len}")


@pytest.mark.parametrize("block", [1, 3, 512])
def test_self_extend_split_equals_the_grouped_kernel_across_the_neighbor_window(block):
    from hf_posext.backends.attention import self_extend_kernels
    from hf_posext.backends.attention.self_extend import grouped_attention, split_grouped_attention

    group, window = 3, 5
    for kv_len, q_len, start in _sweep(window):
        q, k, v = _rotated_qkv(kv_len, q_len)
        first = start + kv_len - q_len
        query_positions, key_positions = torch.arange(first, first + q_len)[None], torch.arange(start, start + kv_len)[None]
        expected = grouped_attention(q, k, v, None, query_positions, key_positions, _inv_freq(), HEAD_DIM, False, group,
                                     window, HEAD_DIM ** -0.5)
        key_grouped = self_extend_kernels.to_grouped(k, key_positions, "key", group, window, _inv_freq(), HEAD_DIM, False)
        split = split_grouped_attention(q, k, v, key_grouped, None, query_positions, key_positions, _inv_freq(), HEAD_DIM,
                                        False, group, window, HEAD_DIM ** -0.5, block=block)
        torch.testing.assert_close(split, expected, atol=1e-5, rtol=1e-5, msg=f"kv_len {kv_len}, q_len {q_len}, start {start}")


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_decode_kernels_mask_the_future_of_every_row_without_a_mask(rows):
    """With no attention mask, a decode step of ``rows`` queries must still hide from each query the keys
    after it (one row has none; two rows is the smallest case where the future table matters)."""
    from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_decode, dual_chunk_explicit
    from hf_posext.backends.attention.self_extend import SelfExtendLayerSettings, grouped_attention, self_extend_decode

    kv_len = 30
    q, k, v = _rotated_qkv(kv_len, rows)
    query_positions, key_positions = torch.arange(kv_len - rows, kv_len)[None], torch.arange(kv_len)[None]
    dca = DualChunkLayerSettings(_inv_freq(), HEAD_DIM, False, 8, 2, "sdpa")
    torch.testing.assert_close(dual_chunk_decode(q, k, v, None, query_positions, dca, HEAD_DIM ** -0.5),
                               dual_chunk_explicit(q, k, v, None, query_positions, key_positions, dca, HEAD_DIM ** -0.5),
                               atol=1e-5, rtol=1e-5)
    self_ext = SelfExtendLayerSettings(_inv_freq(), HEAD_DIM, False, 3, 5, "sdpa")
    torch.testing.assert_close(self_extend_decode(q, k, v, None, query_positions, self_ext, HEAD_DIM ** -0.5),
                               grouped_attention(q, k, v, None, query_positions, key_positions, _inv_freq(), HEAD_DIM, False,
                                                 3, 5, HEAD_DIM ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method,kwargs,length", [
    ("string", dict(shifted_offset=S, local_value=W_LOCAL), 16),
    ("string", dict(shifted_offset=S, local_value=W_LOCAL), 17),
    ("string", dict(shifted_offset=S, local_value=W_LOCAL), 18),
    # DCA's prompts of at most DECODE_QUERIES (16) tokens run its decode kernel: equal values, not SDPA's bits
    ("dca", dict(factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW), 17),
    ("dca", dict(factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW), 18),
])
def test_short_prompts_past_the_decode_size_stay_the_models_own_bit_for_bit(method, kwargs, length):
    """Prompts of DECODE_QUERIES (16) tokens and one or two more, inside S / one chunk: SDPA itself."""
    ids = _ids(length)
    unpatched = logits_of(_model("sdpa"), ids)
    model = _model("sdpa")
    hf_posext.patch(model, method, **kwargs)
    assert torch.equal(logits_of(model, ids), unpatched)


def test_self_extend_keys_out_of_position_order_take_the_general_path():
    """Keys whose positions step back by one (pairs swapped: 1, 0, 3, 2, ...) are not in position order, so
    the block bounds found by binary search do not apply; with a mask from the positions, the result is
    the same as for the keys in order. Query blocks of one row put every query at its own bound."""
    from hf_posext.backends.attention.self_extend import grouped_attention

    group, window, length = 3, 5, 40
    q, k, v = _rotated_qkv(length, length, seed=4)
    order = torch.arange(length).view(-1, 2).flip(-1).reshape(-1)  # 1, 0, 3, 2, ...
    positions = torch.arange(length)[None]
    mask = lambda keys: (keys[:, None, None, :] <= positions[:, None, :, None])  # noqa: E731
    in_order = grouped_attention(q, k, v, mask(positions), positions, positions, _inv_freq(), HEAD_DIM, False, group, window,
                                 HEAD_DIM ** -0.5, block_elements=1)
    swapped = grouped_attention(q, k[:, :, order], v[:, :, order], mask(order[None]), positions, order[None], _inv_freq(),
                                HEAD_DIM, False, group, window, HEAD_DIM ** -0.5, block_elements=1)
    torch.testing.assert_close(swapped, in_order, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len,decodes", [(self_extend.DECODE_QUERIES, True), (self_extend.DECODE_QUERIES + 1, False)])
def test_self_extend_decode_kernel_takes_calls_of_up_to_decode_queries(monkeypatch, q_len, decodes):
    """The documented bound: a call of at most ``DECODE_QUERIES`` queries past the window runs the decode
    kernel (where the device takes it), one more runs the prefill kernels; both give the same values."""
    monkeypatch.setattr(self_extend, "DECODE_DEVICES", ("cpu",))
    calls = []
    decode = self_extend.self_extend_decode
    monkeypatch.setattr(self_extend, "self_extend_decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    model = _self_extend("sdpa")
    ids = _ids(NEIGHBOR + 20)
    with torch.no_grad():
        cache = model(ids[:, :-q_len], use_cache=True).past_key_values
        calls.clear()
        step = model(ids[:, -q_len:], past_key_values=cache, use_cache=True).logits
    assert bool(calls) is decodes
    torch.testing.assert_close(step, _self_extend_reference(_model(), ids)[:, -q_len:], atol=ATOL, rtol=RTOL)
