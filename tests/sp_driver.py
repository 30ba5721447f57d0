"""Driver for tests/test_training_sequence_parallel.py: one training step of a tiny Llama, loss and gradients.

Run as `python tests/sp_driver.py OUT MODE` (1 process, no parallelism: the reference) or under
`torchrun --nproc_per_node 2 tests/sp_driver.py OUT MODE --sp 2` (transformers' Trainer, DeepSpeed Ulysses
through accelerate's ParallelismConfig, ZeRO-3). MODE is "full" or "lora". Rank 0 writes OUT (torch.save of
{"loss": float, "grads": {name: tensor}}), gradients taken just before the optimizer step.
"""

from __future__ import annotations

import argparse
import os

import torch

from tests.training_helpers import exit_without_teardown

SEQUENCE = 256
VOCAB = 96


def tiny_model(mode: str):
    """A 2-layer Llama with RoPE (position-sensitive), seeded; LoRA-wrapped when mode == "lora"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        torch.manual_seed(1)
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.data.normal_(0, 0.1)
    return model


def example():
    """One sequence with PoSE-style position ids (a skip in the middle) and some ignored labels."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (SEQUENCE,), generator=generator)
    half = SEQUENCE // 2
    position_ids = torch.cat([torch.arange(half), torch.arange(half) + 700])
    labels = input_ids.clone()
    labels[:17] = -100
    labels[150:160] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def reference(out: str, mode: str) -> None:
    """Plain forward/backward on one process."""
    model = tiny_model(mode)
    batch = {key: value[None] for key, value in example().items()}
    loss = model(**batch).loss
    loss.backward()
    grads = {_clean(name): p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    torch.save({"loss": float(loss.detach()), "grads": grads}, out)


def sequence_parallel(out: str, mode: str, sp_size: int, zero_stage: int = 3) -> None:
    """One Trainer step under DeepSpeed Ulysses; gradients read with safe_get_full_grad before the step."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_posext.training.config import ParallelismSection
    from hf_posext.training.parallel import accelerate_parallelism_config

    recorded = {}
    original_step = deepspeed.DeepSpeedEngine.step
    original_backward = deepspeed.DeepSpeedEngine.backward

    def backward(engine, loss, *args, **kwargs):
        recorded.setdefault("loss", float(loss.detach()))
        return original_backward(engine, loss, *args, **kwargs)

    def step(engine, *args, **kwargs):
        if "grads" not in recorded:
            recorded["grads"] = {_clean(name): safe_get_full_grad(p).detach().clone()
                                 for name, p in engine.module.named_parameters() if p.requires_grad}
        return original_step(engine, *args, **kwargs)

    deepspeed.DeepSpeedEngine.backward = backward
    deepspeed.DeepSpeedEngine.step = step
    request = ParallelismSection(sp_size=sp_size, sp_backend="deepspeed")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": zero_stage}, "gradient_clipping": "auto",
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}}}
    args = TrainingArguments(output_dir=os.path.dirname(out) + "/trainer", max_steps=1, per_device_train_batch_size=1,
                             learning_rate=0.0, max_grad_norm=0.0, report_to=[], save_strategy="no", logging_strategy="no",
                             deepspeed=ds_config, parallelism_config=accelerate_parallelism_config(request),
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=tiny_model(mode), args=args, train_dataset=[example()], data_collator=default_data_collator)
    trainer.train()
    if torch.distributed.get_rank() == 0:
        torch.save(recorded, out)


def _clean(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("module.", "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["full", "lora"])
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage (3 is what the recipes use)")
    options = parser.parse_args(argv)
    if options.sp == 1:
        reference(options.out, options.mode)
    else:
        sequence_parallel(options.out, options.mode, options.sp, options.zero)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
