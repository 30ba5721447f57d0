"""The chunked loss on the paths tests/test_lm_chunked_loss.py leaves out (found by bench/mutation.py).

Pre-shifted ``shift_labels``, a model wrapped the way DDP and DeepSpeed wrap it (``.module``), the loss
scaled before backward (the gradient must follow the scale), a chunk with no counted token, a head that
gets fewer hidden states than labels, mismatched shapes, and heads the loss must refuse.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_posext
from hf_posext.lm.chunked_loss import IGNORE_INDEX, check_output_head, chunked_causal_lm_loss, linear_cross_entropy, shift_labels
from hf_posext.models import tiny_model


def _model():
    model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(model, "yarn", factor=8)
    return model.train()


def _batch(length: int = 40):
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :9] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


class Wrapper(nn.Module):
    """What DDP and DeepSpeed's engine look like to the loss: the model under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_pre_shifted_labels_and_a_wrapped_model_give_the_plain_loss():
    model, batch = _model(), _batch()
    plain = model(**batch).loss
    shifted = {"input_ids": batch["input_ids"], "shift_labels": shift_labels(batch["labels"])}
    torch.testing.assert_close(chunked_causal_lm_loss(model, shifted, chunk_size=16), plain, atol=0, rtol=1e-5)
    torch.testing.assert_close(chunked_causal_lm_loss(Wrapper(model), batch, chunk_size=16), plain, atol=0, rtol=1e-5)
    assert "forward" not in vars(model.lm_head)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gradients_follow_a_scaled_loss_and_skip_fully_ignored_chunks(with_bias):
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(24, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 50, (24,), generator=generator)
    targets[:8] = IGNORE_INDEX  # the first chunk of 8 counts nothing
    targets[13] = IGNORE_INDEX
    inputs = (hidden, weight) + ((bias,) if with_bias else ())
    logits = hidden @ weight.T + (bias if with_bias else 0)
    reference = 3.0 * torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / 40
    expected = torch.autograd.grad(reference, inputs)
    loss = 3.0 * linear_cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=40, chunk_size=8)
    actual = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, reference, atol=0, rtol=1e-5)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)
    assert actual[0][:8].abs().max() == 0  # no gradient to the hidden states of ignored tokens


def test_no_counted_token_at_all_gives_zero_gradients():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    targets = torch.full((6,), IGNORE_INDEX)
    total = linear_cross_entropy(hidden, weight, targets, num_items_in_batch=1, chunk_size=4)
    total.backward()
    assert total.item() == 0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_mismatched_shapes_and_truncated_heads_are_clear_errors():
    with pytest.raises(ValueError, match="5 targets for 6 hidden states"):
        linear_cross_entropy(torch.zeros(6, 4), torch.zeros(9, 4), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="weight has 3 input features but the hidden states have 4"):
        linear_cross_entropy(torch.zeros(6, 4), torch.zeros(9, 3), torch.zeros(6, dtype=torch.long))
    model, batch = _model(), _batch()
    with pytest.raises(ValueError, match=r"sent \(2, 1\) hidden states to its head for \(2, 40\) labels; is `logits_to_keep` set"):
        chunked_causal_lm_loss(model, dict(batch, logits_to_keep=1))
    assert "forward" not in vars(model.lm_head)  # put back after an error too


@pytest.mark.parametrize("field, value", [("logit_scale", 2.0), ("logit_scale", 0.0), ("logits_scaling", 0.5)])
def test_heads_whose_logits_are_rescaled_are_refused(field, value):
    model = _model()
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=f"{field}={value}"):
        check_output_head(model)
    setattr(model.config, field, 1.0)
    assert check_output_head(model) is model.lm_head
    model.lm_head = nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="plain nn.Linear output head, found Sequential"):
        check_output_head(model)


def test_only_the_tensors_are_positional():
    """``bias``, ``num_items_in_batch`` and ``chunk_size`` are keyword-only: a positional fourth argument
    (the bias of another head, a token count) is a TypeError, never silently read as something else."""
    hidden, weight, targets = torch.randn(6, 4), torch.randn(10, 4), torch.randint(0, 10, (6,))
    with pytest.raises(TypeError):
        linear_cross_entropy(hidden, weight, targets, torch.zeros(10))
    by_name = linear_cross_entropy(hidden=hidden, weight=weight, targets=targets, bias=torch.zeros(10), chunk_size=4)
    torch.testing.assert_close(by_name, torch.nn.functional.cross_entropy(hidden @ weight.T, targets))
