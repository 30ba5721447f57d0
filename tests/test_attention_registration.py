"""What every attention-level method (Self-Extend, DCA, STRING) checks when transformers calls it."""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.backends.attention.dual_chunk import dual_chunk_attention
from hf_posext.backends.attention.self_extend import self_extend_attention
from hf_posext.backends.attention.shifted_positions import string_attention
from hf_posext.models import tiny_model
from tests.conftest import transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

CASES = [
    ("self-extend", {"group_size": 2, "neighbor_window": 8}, self_extend_attention, "Self-Extend"),
    ("dca", {"factor": 2}, dual_chunk_attention, "Dual Chunk Attention"),
    ("string", {}, string_attention, "STRING attention"),
]


def _patched(method, params):
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    hf_posext.patch(model, method, **params)
    attention = model.model.layers[0].self_attn
    settings = [name for name in vars(attention) if name.startswith("_hf_posext")]
    assert len(settings) == 1, settings
    return model, attention, settings[0]


@pytest.mark.parametrize("method, params, function, title", CASES, ids=[c[0] for c in CASES])
def test_a_layer_without_its_settings_names_the_method_and_the_fix(method, params, function, title):
    model, attention, attribute = _patched(method, params)
    delattr(attention, attribute)
    message = (f"LlamaAttention is set to {title} but carries no {title} settings (was the model copied or its "
               f"config edited by hand?). Call hf_posext.patch(model, '{method}', ...) again.")
    with pytest.raises(RuntimeError) as info:
        model(torch.arange(3, 20)[None])
    assert str(info.value) == message


@pytest.mark.parametrize("method, params, function, title", CASES, ids=[c[0] for c in CASES])
def test_attention_sinks_join_the_softmax_and_the_default_scale_is_one_over_root_d(method, params, function, title):
    model, attention, _ = _patched(method, params)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    # learned sinks (gpt-oss): one logit per head beside every row's scores, with no value
    sinks = torch.tensor([-1.0, 0.0, 1.0, 3.0])
    scores = (q @ k.transpose(2, 3) * 8 ** -0.5).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(1, 4, 6, 1)], dim=-1).softmax(-1)[..., :-1]
    with_sinks, _ = function(attention, q, k, v, None, s_aux=sinks)
    torch.testing.assert_close(with_sinks, (weights @ v).transpose(1, 2), atol=1e-6, rtol=1e-6)
    # Six tokens: inside every method's plain range, so the call is causal softmax attention at scale 8 ** -0.5.
    out, _ = function(attention, q, k, v, None, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    doubled, _ = function(attention, q, k, v, None, scaling=2 * 8 ** -0.5, is_causal=True)
    assert (doubled - expected).abs().max() > 1e-2  # a given scale is used, not replaced by the default
