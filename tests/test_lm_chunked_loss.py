"""The chunked causal-LM loss equals transformers' own loss, and so do its gradients (1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.lm.chunked_loss import (chunked_causal_lm_loss, linear_cross_entropy, sequence_mean_causal_lm_loss,
                                       sequence_mean_weights, shift_labels)
from hf_posext.models import tiny_model

RELATIVE = 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Largest difference within 1e-5 of the reference's largest magnitude."""
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= RELATIVE * scale, (actual - expected).abs().max().item() / scale


def _batch(seed: int = 0, length: int = 96, ignored: int = 17):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, length), generator=generator)
    labels = ids.clone()
    labels[0, :ignored] = -100  # a prompt that is not scored
    labels[1, -5:] = -100       # padding at the end
    # PoSE-style positions: two chunks with a gap, so the loss depends on more than token order.
    positions = torch.cat([torch.arange(length // 2), torch.arange(length // 2) + 300])[None].expand(2, -1)
    # The mask is explicit, as in training: without one, transformers 5 reads a jump in position ids as
    # the start of a new packed sequence and blocks attention across it.
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": torch.ones_like(ids)}


def _gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _position_sensitive_model():
    model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(model, "yarn", factor=8)
    return model.train()


@pytest.mark.parametrize("num_items_in_batch", [None, 250])
@pytest.mark.parametrize("chunk_size", [7, 1024])
def test_loss_and_every_gradient_equal_the_plain_loss(chunk_size, num_items_in_batch):
    batch = _batch()
    model = _position_sensitive_model()
    plain = model(**batch, num_items_in_batch=num_items_in_batch).loss
    plain.backward()
    expected = _gradients(model)
    model.zero_grad(set_to_none=True)
    chunked = chunked_causal_lm_loss(model, batch, num_items_in_batch=num_items_in_batch, chunk_size=chunk_size)
    chunked.backward()
    actual = _gradients(model)
    _close(chunked.detach(), plain.detach())
    assert set(actual) == set(expected)
    for name in expected:
        _close(actual[name], expected[name])


def test_equal_under_lora_with_tied_embeddings_frozen():
    from peft import LoraConfig, get_peft_model

    batch = _batch(seed=1)
    model = get_peft_model(_position_sensitive_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False))
    plain = model(**batch).loss
    plain.backward()
    expected = _gradients(model)
    model.zero_grad(set_to_none=True)
    chunked = chunked_causal_lm_loss(model, batch, chunk_size=50)
    chunked.backward()
    _close(chunked.detach(), plain.detach())
    for name, gradient in _gradients(model).items():
        _close(gradient, expected[name])


def test_linear_cross_entropy_with_bias_matches_cross_entropy_of_full_logits():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(300, 16, generator=generator, requires_grad=True)
    bias = torch.randn(300, generator=generator, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=generator)
    targets[::5] = -100
    reference = torch.nn.functional.cross_entropy(hidden @ weight.T + bias, targets, ignore_index=-100)
    expected = torch.autograd.grad(reference, (hidden, weight, bias))
    loss = linear_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=8)
    actual = torch.autograd.grad(loss, (hidden, weight, bias))
    _close(loss.detach(), reference.detach())
    for a, e in zip(actual, expected):
        _close(a, e)


def test_shift_labels_aligns_each_position_with_the_next_token():
    assert shift_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]


def test_no_gradient_work_without_grad_and_clear_errors():
    model = _position_sensitive_model()
    batch = _batch()
    with torch.no_grad():
        plain = model(**batch).loss
        _close(chunked_causal_lm_loss(model, batch, chunk_size=64), plain)
    with pytest.raises(ValueError, match="chunk_size=0"):
        linear_cross_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="no `labels`"):
        chunked_causal_lm_loss(model, {"input_ids": batch["input_ids"]})
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        chunked_causal_lm_loss(model, batch)
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back after every call


def _uneven_batch():
    """Row 0 trains on every token, row 1 on 3 answer tokens only (a retrieval sample's labels)."""
    batch = _batch(seed=3)
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][1, :-4] = -100
    return batch


@pytest.mark.parametrize("loss", ["chunked", "plain"])
def test_sequence_mean_loss_weighs_every_sequence_the_same_and_so_do_its_gradients(loss):
    batch = _uneven_batch()
    model = _position_sensitive_model()
    rows = [{k: v[b : b + 1] for k, v in batch.items()} for b in range(2)]
    reference = (model(**rows[0]).loss + model(**rows[1]).loss) / 2
    reference.backward()
    expected = _gradients(model)
    token_mean = model(**batch).loss.detach()
    model.zero_grad(set_to_none=True)
    actual = sequence_mean_causal_lm_loss(model, batch, loss=loss, chunk_size=13)
    actual.backward()
    _close(actual.detach(), reference.detach())
    for name, gradient in _gradients(model).items():
        _close(gradient, expected[name])
    # The check can fail: the token mean (every token weighs the same) is far from the sequence mean.
    assert abs(token_mean - reference.detach()) > 100 * RELATIVE * abs(reference.detach())


def test_sequence_mean_weights_and_their_errors():
    targets = torch.tensor([[1, 2, 3, 4], [-100, -100, 5, -100], [-100, -100, -100, -100]])
    weights = sequence_mean_weights(targets)
    assert weights.tolist() == [[0.125] * 4, [0.0, 0.0, 0.5, 0.0], [0.0] * 4]  # 2 rows count; the empty one does not
    with pytest.raises(ValueError, match="not both"):
        linear_cross_entropy(torch.zeros(4, 2), torch.zeros(3, 2), targets[0], num_items_in_batch=4, token_weights=weights[0])
    with pytest.raises(ValueError, match="3 token weights for 4 targets"):
        linear_cross_entropy(torch.zeros(4, 2), torch.zeros(3, 2), targets[0].clamp(max=2), token_weights=torch.ones(3))
    with pytest.raises(ValueError, match="loss='dense': use 'chunked' or 'plain'"):
        sequence_mean_causal_lm_loss(_position_sensitive_model(), _uneven_batch(), loss="dense")
