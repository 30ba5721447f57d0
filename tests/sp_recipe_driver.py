"""Driver for tests/test_training_sp_recipe.py: one optimizer step of OUR recipe path (config -> train() ->
PosextTrainer), recording the loss and every gradient of the LAST optimizer step (after the earlier steps
updated the weights: LoRA's B starts at zero, so the first step's A gradients are all zero).

    python tests/sp_recipe_driver.py OUT RUN_DIR [key=value ...]                      (1 process: the reference)
    accelerate launch --config_file recipes/accelerate/deepspeed_ulysses_cpu_2proc.yaml \
        tests/sp_recipe_driver.py OUT RUN_DIR parallelism.sp_backend=deepspeed parallelism.sp_size=2 [key=value ...]

Rank 0 writes OUT: torch.save({"loss": float, "grads": {name: tensor}}). The loss is the sum of what the
Trainer's training_step returns over the step's micro-batches (the step's mean loss in both cases), averaged
over the ranks (the data-parallel groups' mean when processes > sp_size).
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


def _fix_torch_gloo_subgroup_scatter() -> None:
    """Let several sequence-parallel groups train on CPU, for the data-parallel x sequence-parallel test only.

    torch's gloo backward of ``torch.distributed.nn.functional.all_gather`` (an all-to-all made of scatters)
    passes the source's rank in the group as ``src``, a global rank, so in the group of ranks {2, 3} it
    fails with "Global rank 0 is not part of group". The engine refuses such a launch on CPU; with this
    fix (``group_src``) the arithmetic of the GPU path can still be compared on CPU.
    """
    import torch.distributed as dist
    from torch.distributed.nn import functional

    def forward(ctx, group, out_tensor_list, *tensors):
        ctx.group = group
        ctx.input_tensor_size_list = [tensors[i].size() for i in range(dist.get_world_size(group=group))]
        tensors = tuple(t.contiguous() for t in tensors)
        for i in range(dist.get_world_size(group=group)):
            dist.scatter(out_tensor_list[i], list(tensors) if i == dist.get_rank(group=group) else None,
                         group=group, group_src=i)
        return tuple(out_tensor_list)

    functional._AlltoAll.forward = staticmethod(forward)

    from hf_posext.training import parallel

    original = parallel.validate_parallelism
    parallel.validate_parallelism = lambda request, **kwargs: original(request, **{**kwargs, "cuda_available": True})


def main(argv: list[str]) -> int:
    from hf_posext.training import trainer as engine

    if argv[0] == "--fix-gloo-subgroups":
        _fix_torch_gloo_subgroup_scatter()
        argv = argv[1:]
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
    if torch.distributed.is_initialized():
        # Every rank of a sequence-parallel group holds its group's loss; with several groups (data parallel x
        # sequence parallel) the step's loss is the mean over the groups, i.e. over all ranks.
        total = torch.tensor([recorded["loss"]], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        recorded["loss"] = float(total) / torch.distributed.get_world_size()
        if torch.distributed.get_rank() != 0:
            return 0
    torch.save(recorded, out)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
