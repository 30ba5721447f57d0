"""Banded sliding-window attention (hf_posext.backends.attention.sliding_window) equals transformers' masked path.

The tolerance (1e-5 on float32 logits) sits far below the effect of the sliding window itself (the same model
with every layer full attends differently by ~1e-1) and of an off-by-one window (checked below to be caught).
"""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import sliding_window
from hf_posext.backends.attention.sliding_window import applies_to, banded_attention, banded_sliding_attention
from hf_posext.lm.scoring import chunked_nll
from hf_posext.models import tiny_model

WINDOW = 16
TOLERANCE = 1e-5
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _gemma3(implementation: str = "sdpa", window: int = WINDOW):
    model = tiny_model("gemma3", max_position_embeddings=512, sliding_window=window, num_hidden_layers=4,
                       layer_types=LAYERS)
    model.set_attn_implementation(implementation)
    return model


def _masked_reference(query, key, value, window, scaling):
    distance = torch.arange(query.shape[2])[:, None] - torch.arange(key.shape[2])
    band = (distance >= 0) & (distance < window)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=band, scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


@pytest.mark.parametrize("tokens,window,block", [(100, 16, None), (100, 16, 7), (33, 40, None), (64, 1, 5)])
def test_the_kernel_equals_sdpa_under_the_band_mask(tokens, window, block):
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, tokens, 8), torch.randn(2, 2, tokens, 8), torch.randn(2, 2, tokens, 8)
    ours = banded_attention(query, key, value, window, 0.3, block)
    torch.testing.assert_close(ours, _masked_reference(query, key, value, window, 0.3), atol=1e-6, rtol=1e-5)
    if tokens > window:  # an off-by-one window is far outside the tolerance
        wrong = _masked_reference(query, key, value, window + 1, 0.3)
        assert (ours - wrong).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_tiny_gemma3_gives_the_masked_logits_and_the_kernel_runs(implementation, monkeypatch):
    model = _gemma3(implementation)
    ids = torch.randint(3, 128, (2, 150))
    calls = []
    kernel = sliding_window.banded_attention
    monkeypatch.setattr(sliding_window, "banded_attention", lambda *a, **k: calls.append(a[3]) or kernel(*a, **k))
    with torch.no_grad():
        masked = model(ids).logits
        with banded_sliding_attention(model) as active:
            banded = model(ids).logits
    assert active and calls == [WINDOW] * 3  # the three sliding layers, not the full one
    assert model.config._attn_implementation == implementation  # restored
    torch.testing.assert_close(banded, masked, atol=TOLERANCE, rtol=0)
    full = _gemma3(implementation, window=4096)  # every layer sees everything: the effect of the window
    with torch.no_grad():
        assert (full(ids).logits - masked).abs().max() > 1000 * TOLERANCE


def test_a_broken_band_is_caught_by_the_tolerance(monkeypatch):
    model = _gemma3()
    ids = torch.randint(3, 128, (1, 150))
    kernel = sliding_window.banded_attention
    monkeypatch.setattr(sliding_window, "banded_attention", lambda q, k, v, window, *a, **kw: kernel(q, k, v, window + 1, *a, **kw))
    with torch.no_grad():
        masked = model(ids).logits
        with banded_sliding_attention(model):
            broken = model(ids).logits
    assert (broken - masked).abs().max() > 100 * TOLERANCE


def test_padding_and_short_inputs_take_the_masked_path_with_the_same_result():
    model = _gemma3()
    ids = torch.randint(3, 128, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: transformers builds the mask, the band is not used
    with torch.no_grad():
        masked = model(ids, attention_mask=mask).logits
        with banded_sliding_attention(model):
            banded = model(ids, attention_mask=mask).logits
            short = model(ids[:, :WINDOW]).logits  # within the window: plain causal attention
        torch.testing.assert_close(banded, masked, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(short, model(ids[:, :WINDOW]).logits, atol=TOLERANCE, rtol=0)


def test_perplexity_scoring_uses_the_band_and_matches_the_masked_scoring(monkeypatch):
    model = _gemma3()
    ids = torch.randint(3, 128, (1, 200))
    masked, count = chunked_nll(model, ids, 64, banded=False)
    calls = []
    kernel = sliding_window.banded_attention
    monkeypatch.setattr(sliding_window, "banded_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    banded, _ = chunked_nll(model, ids, 64)
    assert calls and count == 199
    assert abs(float(banded[0] - masked[0])) / count < TOLERANCE


def test_it_stays_off_where_it_does_not_apply():
    llama = tiny_model("llama")
    assert applies_to(llama) == "no sliding-window layer"
    model = _gemma3()
    hf_posext.patch(model, "self-extend", factor=4)  # an attention-level method owns the attention
    assert "only 'sdpa' or 'eager'" in applies_to(model)
    with banded_sliding_attention(model) as active:
        assert not active
    hf_posext.unpatch(model)
    hf_posext.patch(model, "yarn", factor=2)  # a frequency method leaves the attention to transformers
    assert applies_to(model) is None
    with banded_sliding_attention(model, enabled=False) as active:
        assert not active and model.config._attn_implementation == "sdpa"


def test_the_band_marker_stands_for_transformers_own_sliding_mask():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from hf_posext.backends.attention.sliding_window import BandMask

    theirs = sdpa_mask(batch_size=1, q_length=40, kv_length=40, mask_function=sliding_window_causal_mask_function(WINDOW),
                       local_size=WINDOW, allow_is_causal_skip=True)
    assert torch.equal(BandMask(WINDOW, 40).tensor(), theirs)


def test_a_band_marker_reaching_another_call_is_refused_in_one_line():
    from hf_posext.backends.attention.sliding_window import BandMask

    sliding_window.register()
    from transformers import AttentionInterface

    attention = AttentionInterface()[sliding_window.IMPLEMENTATION]
    query = torch.randn(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match=r"BandMask\(window=16, length=40\) reached an attention call of 1 queries and 40 keys"):
        attention(torch.nn.Module(), query, torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), BandMask(WINDOW, 40))
