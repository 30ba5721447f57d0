"""Which weights train: LoRA targets (and the error for a missing one), LongLoRA extras, full mode."""

from __future__ import annotations

import pytest
import torch

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)

from hf_posext.models import tiny_model
from hf_posext.training.config import FinetuneSection
from hf_posext.training.lora import (
    LoraTargetError,
    check_lora_targets,
    extra_parameter_names,
    linear_module_names,
    setup_trainable,
    trainable_state_dict,
)


def test_linear_module_names_of_a_llama():
    names = linear_module_names(tiny_model("llama"))
    assert names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_missing_target_names_the_module_and_suggests():
    model = tiny_model("llama")
    with pytest.raises(LoraTargetError, match=r"'qkv_proj'.*not found in LlamaForCausalLM.*q_proj"):
        check_lora_targets(model, ["qkv_proj"])
    with pytest.raises(LoraTargetError, match=r"'c_attn'"):
        check_lora_targets(model, ["q_proj", "c_attn"])
    check_lora_targets(model, ["q_proj", "model.layers.0.self_attn.v_proj"])  # full names work too
    check_lora_targets(model, ["all-linear"])


def test_lora_trains_only_adapters_and_requested_extras():
    model = tiny_model("llama")
    section = FinetuneSection(rank=2, alpha=4, target_modules=["q_proj", "v_proj"], train_norms=True, train_embeddings=True)
    extras = extra_parameter_names(model, True, True)
    assert "model.embed_tokens.weight" in extras and "model.norm.weight" in extras
    assert "model.layers.0.input_layernorm.weight" in extras
    peft_model = setup_trainable(model, section)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if "lora_" in n]
    assert len(lora) == 2 * 2 * 2  # A and B, q and v, 2 layers
    assert all("lora_" in n or "norm" in n or "embed_tokens" in n for n in trainable)
    assert not any("q_proj.base_layer" in n for n in trainable)
    # the trainable state is exactly what a checkpoint stores
    assert sorted(trainable_state_dict(peft_model)) == sorted(trainable)


def test_lora_on_gpt2_conv1d_and_full_mode():
    model = tiny_model("llama")
    full = setup_trainable(model, FinetuneSection(mode="full"))
    assert full is model and all(p.requires_grad for p in model.parameters())
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert "c_attn" in linear_module_names(gpt2)
    wrapped = setup_trainable(gpt2, FinetuneSection(rank=2, target_modules=["c_attn"]))
    out = wrapped(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8)))
    out.loss.backward()
    assert any(p.grad is not None for n, p in wrapped.named_parameters() if "lora_" in n)
