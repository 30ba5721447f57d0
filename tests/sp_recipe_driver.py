"""Driver for tests/test_training_sp_recipe.py: one optimizer step of OUR recipe path (config -> train() ->
PosextTrainer), recording the loss and every gradient of the LAST optimizer step (after the earlier steps
updated the weights: LoRA's B starts at zero, so the first step's A gradients are all zero).

    python tests/sp_recipe_driver.py OUT RUN_DIR [key=value ...]                      (1 process: the reference)
    accelerate launch --config_file recipes/accelerate/deepspeed_ulysses_cpu_2proc.yaml \
        tests/sp_recipe_driver.py OUT RUN_DIR parallelism.sp_backend=deepspeed parallelism.sp_size=2 [key=value ...]

Rank 0 writes OUT: torch.save({"loss": float, "grads": {name: tensor}}). The loss is the sum of what the
Trainer's training_step returns over the step's micro-batches (the step's mean loss in both cases).
Gradients: param.grad at on_pre_optimizer_step without DeepSpeed; under DeepSpeed (which steps inside
backward) deepspeed.utils.safe_get_full_grad, read when the engine first steps.
"""

from __future__ import annotations

import sys

import torch
from transformers import TrainerCallback

from tests.training_helpers import exit_without_teardown, tiny_config


def _clean(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("module.", "")


def main(argv: list[str]) -> int:
    from hf_posext.training import trainer as engine

    out, run_dir, overrides = argv[0], argv[1], argv[2:]
    config = tiny_config(run_dir, *overrides)
    recorded: dict = {"loss": 0.0, "steps": 0}

    original_step = engine.PosextTrainer.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = original_step(self, model, inputs, num_items_in_batch)
        if self.state.global_step == config.train.max_steps - 1:
            recorded["loss"] += float(loss)
            recorded["steps"] += 1
        return loss

    engine.PosextTrainer.training_step = training_step

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not config.parallelism.sequence_parallel:  # the last call is the last step
                recorded["grads"] = {_clean(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    if config.parallelism.sequence_parallel:
        import deepspeed
        from deepspeed.utils import safe_get_full_grad

        original_engine_step = deepspeed.DeepSpeedEngine.step

        def engine_step(ds_engine, *args, **kwargs):
            if ds_engine.is_gradient_accumulation_boundary():  # the last boundary is the last step
                recorded["grads"] = {_clean(n): safe_get_full_grad(p).detach().clone()
                                     for n, p in ds_engine.module.named_parameters() if p.requires_grad}
            return original_engine_step(ds_engine, *args, **kwargs)

        deepspeed.DeepSpeedEngine.step = engine_step

    original_init = engine.PosextTrainer.__init__

    def init(self, *args, callbacks=None, **kwargs):
        original_init(self, *args, callbacks=[*(callbacks or []), Gradients()], **kwargs)

    engine.PosextTrainer.__init__ = init
    engine.train(config, progress=False)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return 0
    torch.save(recorded, out)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
