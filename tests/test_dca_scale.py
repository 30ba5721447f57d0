"""DCA's length scale (``attention_scale=True``) against an independent float64 construction.

SGLang's dual-chunk backend (sglang 0.5.4, docs/serving.md) multiplies, when the model's
``dual_chunk_attention_config`` holds ``original_max_position_embeddings`` = L > 0, the keys and the
softmax scale of a prefill each by ``f = max(1, 0.1 ln(T / L) + 1)`` with T the request's sequence length
(the prompt length), and in a decode step the query by ``f(T)`` with T the length including the new token.
The reference below is :func:`tests.test_dca.reference_attention` (the paper's index sets, float64) with
its score scaling multiplied by ``f(T)^2``, T taken as the key count of the call; it handles a decode call
(fewer queries than keys) by scoring zero rows in front of the real queries and keeping the last rows.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import dual_chunk
from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_decode, dual_chunk_explicit, dual_chunk_fused
from tests.conftest import assert_close_guarding, logits_of, transformers_major
from tests.test_dca import CHUNK_SIZE, LOCAL_WINDOW, _ids, _model, _rope64, reference_attention

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

WINDOW = 64  # the tiny Llama's max_position_embeddings


def sglang_factor(length: int, original: int = WINDOW) -> float:
    """YaRN's factor clipped at 1, written out as SGLang writes it."""
    return max(1.0, 0.1 * math.log(length / original) + 1.0)


def _reference_logits(model, ids, multiplier, use_cache_steps=None):
    """Logits of the unpatched ``model`` with attention replaced by the float64 reference, every score of a
    call multiplied by ``multiplier(T, q_len)`` (T: keys in the call). ``use_cache_steps``: (prefix, steps)
    to run a prefill and one-token cached steps instead of one forward."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    inv_freq = model.model.rotary_emb.inv_freq.double()

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        groups = query.shape[1] // key.shape[1]
        back = [-p for p in range(kv_len)]
        padded = torch.cat((query.new_zeros(query.shape[0], query.shape[1], kv_len - q_len, query.shape[3]), query), 2)
        raw_q, raw_k = _rope64(padded, back, inv_freq), _rope64(key, back, inv_freq)
        out = reference_attention(raw_q, raw_k.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                  inv_freq, CHUNK_SIZE, LOCAL_WINDOW, scaling * multiplier(kv_len, q_len))
        return out[:, kv_len - q_len:].to(query.dtype), None

    AttentionInterface.register("dca_scale_reference_test", attention)
    AttentionMaskInterface.register("dca_scale_reference_test", sdpa_mask)
    model.set_attn_implementation("dca_scale_reference_test")
    try:
        if use_cache_steps is None:
            return logits_of(model, ids, use_cache=False)
        return _cached_logits(model, ids, *use_cache_steps)
    finally:
        model.set_attn_implementation("sdpa")


def _cached_logits(model, ids, prefix, steps):
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, parts = out.past_key_values, [out.logits[:, -1:]]
        for position in range(prefix, prefix + steps):
            out = model(ids[:, position : position + 1], past_key_values=cache, use_cache=True)
            cache, parts = out.past_key_values, parts + [out.logits]
    return torch.cat(parts, 1)


def _squared(length: int, q_len: int) -> float:
    return sglang_factor(length) ** 2


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_prefill_scores_scale_by_the_square_of_yarns_factor_of_the_sequence_length(implementation):
    ids = _ids(150)
    reference = _reference_logits(_model(), ids, _squared)
    # Broken variants: the factor once (query side only), and each query's own length (causal, not SGLang's).
    once = _reference_logits(_model(), ids, lambda length, q_len: sglang_factor(length))
    model = _model(implementation)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, attention_scale=True)
    patched = logits_of(model, ids)
    assert_close_guarding(patched, reference, once, atol=1e-5, rtol=1e-5)  # measured: 1880x the tolerance
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    assert_close_guarding(patched, reference, logits_of(model, ids), atol=1e-5, rtol=1e-5)  # the scale is on


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_decode_steps_scale_by_the_length_with_the_new_token(implementation):
    ids = _ids(140)
    prefix, steps = 110, 6
    reference = _reference_logits(_model(), ids, _squared, (prefix, steps))
    # Broken: the prompt's length kept for the decode steps.
    stale = _reference_logits(_model(), ids, lambda length, q_len: sglang_factor(length if q_len > 1 else prefix) ** 2,
                              (prefix, steps))
    model = _model(implementation)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, attention_scale=True)
    assert_close_guarding(_cached_logits(model, ids, prefix, steps)[:, 1:], reference[:, 1:], stale[:, 1:],
                          atol=1e-5, rtol=1e-5)  # measured: 160x the tolerance
    torch.testing.assert_close(_cached_logits(model, ids, prefix, steps), reference, atol=1e-5, rtol=1e-5)


def test_decode_kernel_folds_the_scale_per_row():
    """Two rows of different lengths (left padding): each row's scale comes from its own last position."""
    torch.manual_seed(3)
    length = 130
    q, k, v = torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    layer = DualChunkLayerSettings(inv_freq, 8, False, CHUNK_SIZE, LOCAL_WINDOW, "sdpa", True, WINDOW)
    positions = torch.stack((torch.arange(length), torch.arange(length) - 30))  # row 1: 30 pads in front
    rq = torch.stack([_rope64(q[b : b + 1], positions[b].tolist(), inv_freq)[0] for b in range(2)]).float()
    rk = torch.stack([_rope64(k[b : b + 1], positions[b].tolist(), inv_freq)[0] for b in range(2)]).float()
    mask = torch.ones(2, 1, 1, length, dtype=torch.bool)
    mask[1, ..., :30] = False
    dual_chunk.clear_decode_tables()
    step = dual_chunk_decode(rq[:, :, -1:], rk, v, mask, positions[:, -1:].clone(), layer, 8 ** -0.5)
    for row, (first, total) in enumerate(((0, length), (30, length - 30))):
        plain = dataclass_replace(layer, scale_length=None)
        expected = dual_chunk_explicit(rq[row : row + 1, :, -1:], rk[row : row + 1, :, first:], v[row : row + 1, :, first:],
                                       None, positions[row : row + 1, -1:], positions[row : row + 1, first:], plain,
                                       8 ** -0.5 * sglang_factor(total) ** 2)
        torch.testing.assert_close(step[row : row + 1], expected, atol=1e-5, rtol=1e-5)
    fused = dual_chunk_fused(rq[:1], rk[:1], v[:1], None, 0, dataclass_replace(layer, scale_length=None),
                             8 ** -0.5 * sglang_factor(length) ** 2)
    torch.testing.assert_close(step[:1], fused[:, -1:], atol=1e-5, rtol=1e-5)
    dual_chunk.clear_decode_tables()


def dataclass_replace(layer, **changes):
    import dataclasses

    return dataclasses.replace(layer, **changes)


def test_identity_up_to_the_original_window():
    ids = _ids(WINDOW)
    model = _model("sdpa")
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    off = logits_of(model, ids)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, attention_scale=True)
    assert torch.equal(logits_of(model, ids), off)  # f(T) = 1 for T <= L: the very same computation


def test_saved_field_says_whether_sglang_scales_and_load_follows_it(tmp_path):
    model = _model("sdpa")
    ids = _ids(130)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, attention_scale=True)
    scaled = logits_of(model, ids)
    model.save_pretrained(tmp_path / "on")
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    plain = logits_of(model, ids)
    model.save_pretrained(tmp_path / "off")
    on = json.loads((tmp_path / "on" / "config.json").read_text())
    off = json.loads((tmp_path / "off" / "config.json").read_text())
    assert on["dual_chunk_attention_config"] == {"chunk_size": 24, "local_size": 4, "original_max_position_embeddings": 64}
    assert off["dual_chunk_attention_config"] == {"chunk_size": 24, "local_size": 4}  # SGLang: original_max_position_embeddings 0, no scale
    loaded = hf_posext.load(tmp_path / "on")
    assert hf_posext.describe(loaded).params["attention_scale"] is True
    assert_close_guarding(logits_of(loaded, ids), scaled, plain, atol=1e-5, rtol=1e-5)
    assert hf_posext.describe(hf_posext.load(tmp_path / "off")).params["attention_scale"] is False
    # The field is what loads: removing original_max_position_embeddings there turns the scale off.
    del on["dual_chunk_attention_config"]["original_max_position_embeddings"]
    (tmp_path / "on" / "config.json").write_text(json.dumps(on))
    assert hf_posext.describe(hf_posext.load(tmp_path / "on")).params["attention_scale"] is False


def test_bad_attention_scale_is_one_clear_error():
    model = _model("sdpa")
    before = dict(model.config.__dict__)
    with pytest.raises(ValueError, match="attention_scale must be true or false") as error:
        hf_posext.patch(model, "dca", factor=4, attention_scale="yes")
    assert "\n" not in str(error.value) and model.config.__dict__ == before


def test_decode_kernel_scales_every_query_of_a_step_by_the_calls_length():
    """A step of several new queries (speculative decoding, a short chunk): one scale for the call, from the
    length with the last new token, as SGLang takes ``orig_seq_lens``; not each query's own or the first one's."""
    torch.manual_seed(4)
    length, new = 130, 16
    q, k, v = torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    layer = DualChunkLayerSettings(inv_freq, 8, False, CHUNK_SIZE, LOCAL_WINDOW, "sdpa", True, WINDOW)
    positions = torch.arange(length)[None]
    rq, rk = _rope64(q, positions[0].tolist(), inv_freq).float(), _rope64(k, positions[0].tolist(), inv_freq).float()
    dual_chunk.clear_decode_tables()
    step = dual_chunk_decode(rq[:, :, -new:], rk, v, None, positions[:, -new:].clone(), layer, 8 ** -0.5)
    dual_chunk.clear_decode_tables()
    plain = dataclass_replace(layer, scale_length=None)

    def explicit(total):
        return dual_chunk_explicit(rq[:, :, -new:], rk, v, None, positions[:, -new:], positions, plain,
                                   8 ** -0.5 * sglang_factor(total) ** 2)

    # Broken: the first new query's length (length - new + 1) instead of the call's.
    assert_close_guarding(step, explicit(length), explicit(length - new + 1), atol=1e-5, rtol=1e-5)
