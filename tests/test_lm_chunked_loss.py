"""The chunked loss equals F.cross_entropy over full logits, in value and in every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_posext.lm.chunked_loss import IGNORE_INDEX, chunked_causal_lm_loss

TOLERANCE = 1e-5


def _data(seed=0, batch=2, tokens=37, width=16, vocab=50, bias=False):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, tokens, width, generator=generator, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(vocab, width, generator=generator) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (batch, tokens), generator=generator)
    labels[torch.rand(batch, tokens, generator=generator) < 0.3] = IGNORE_INDEX
    b = (torch.randn(vocab, generator=generator) * 0.1).requires_grad_() if bias else None
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, num_items=None, softcap=None):
    logits = (hidden @ weight.t() + (0 if bias is None else bias)).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    shifted = labels[:, 1:]
    total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (num_items if num_items is not None else (shifted != IGNORE_INDEX).sum())


def _relative(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_full_logits(chunk_size, bias):
    hidden, weight, b, labels = _data(bias=bias)
    expected = _reference(hidden, weight, b, labels)
    got = chunked_causal_lm_loss(hidden, weight, labels, bias=b, chunk_size=chunk_size)
    assert _relative(got, expected) < TOLERANCE
    for g, e in zip(_grads(got, hidden, weight, b), _grads(expected, hidden, weight, b)):
        assert _relative(g, e) < TOLERANCE


def test_num_items_in_batch_and_softcap():
    hidden, weight, _, labels = _data(seed=1)
    expected = _reference(hidden, weight, None, labels, num_items=123, softcap=3.0)
    got = chunked_causal_lm_loss(hidden, weight, labels, num_items_in_batch=torch.tensor(123), chunk_size=10, softcap=3.0)
    assert _relative(got, expected) < TOLERANCE
    for g, e in zip(_grads(got, hidden, weight), _grads(expected, hidden, weight)):
        assert _relative(g, e) < TOLERANCE


def test_pre_shifted_labels_match():
    hidden, weight, _, labels = _data(seed=2)
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    a = chunked_causal_lm_loss(hidden, weight, labels)
    b = chunked_causal_lm_loss(hidden, weight, shift_labels_=shifted)
    assert float(a) == float(b)


def test_off_by_one_shift_is_detected():
    """The comparison is sharp enough: scoring unshifted labels is far outside the tolerance."""
    hidden, weight, _, labels = _data(seed=3)
    expected = _reference(hidden, weight, None, labels)
    broken = chunked_causal_lm_loss(hidden, weight, shift_labels_=labels)
    assert _relative(broken, expected) > 100 * TOLERANCE


def test_bad_arguments_are_refused():
    hidden, weight, _, labels = _data()
    with pytest.raises(ValueError, match="exactly one"):
        chunked_causal_lm_loss(hidden, weight)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_causal_lm_loss(hidden, weight, labels, chunk_size=0)


def test_liger_missing_is_refused_in_one_line(monkeypatch):
    import importlib.util

    from hf_posext.lm.chunked_loss import check_liger_available

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(ValueError, match="pip install liger-kernel") as error:
        check_liger_available()
    assert "\n" not in str(error.value)
