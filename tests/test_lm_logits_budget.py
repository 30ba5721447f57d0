"""The scoring chunk shrinks with the vocabulary: at most LOGITS_BUDGET logits a chunk, same loss."""

from __future__ import annotations

import pytest
import torch

from hf_posext.lm.chunked_loss import LOGITS_BUDGET, chunk_for_vocabulary, linear_cross_entropy
from hf_posext.lm.scoring import chunked_nll
from hf_posext.models import tiny_model


def test_the_chunk_shrinks_with_the_vocabulary_and_rows():
    assert chunk_for_vocabulary(2048, 49152) == 2048  # SmolLM2: as before
    assert chunk_for_vocabulary(2048, 262144) == 384  # Gemma 3: 384 x 262144 float32 logits = 384 MiB
    assert chunk_for_vocabulary(2048, 262144, rows=4) == 96
    assert chunk_for_vocabulary(2048, 10**12) == 1 and chunk_for_vocabulary(2048, 262144, logits_budget=None) == 2048
    assert LOGITS_BUDGET == 2048 * 49152
    with pytest.raises(ValueError, match="logits_budget=0 must be a positive number of logits"):
        chunk_for_vocabulary(2048, 1, logits_budget=0)


def test_scoring_runs_the_head_in_budget_sized_chunks_with_the_same_nll():
    model = tiny_model("llama", max_position_embeddings=512)
    ids = torch.randint(3, 128, (1, 201))
    whole, count = chunked_nll(model, ids, 4096, logits_budget=None)
    sizes = []
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: sizes.append(inputs[0].shape[1]))
    try:
        budgeted, _ = chunked_nll(model, ids, 4096, logits_budget=128 * 30)  # 128 words: 30 positions a chunk
    finally:
        handle.remove()
    assert sizes == [30] * 6 + [20] and count == 200
    assert abs(float(whole[0] - budgeted[0])) < 1e-3


def test_the_training_loss_takes_the_same_budget():
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 8, requires_grad=True), torch.randn(1000, 8)
    targets = torch.randint(0, 1000, (50,))
    reference = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
    calls = []
    linear = torch.nn.functional.linear
    try:
        torch.nn.functional.linear = lambda x, *a, **k: calls.append(x.shape[0]) or linear(x, *a, **k)
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=1024, logits_budget=1000 * 16)
    finally:
        torch.nn.functional.linear = linear
    assert calls == [16, 16, 16, 2]
    torch.testing.assert_close(loss, reference)
