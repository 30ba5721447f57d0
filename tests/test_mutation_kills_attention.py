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
