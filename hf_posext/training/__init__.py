"""Fine-tuning for longer context: PoSE sampling, LoRA setup, transformers' Trainer with checkpoint/resume.

>>> from hf_posext.training import load_config, train
>>> train(load_config("recipes/configs/tiny/ci-stage1-cpu.yaml", ["train.max_steps=4"]))

Importing this package loads no model and needs no optional dependency; ``peft`` is needed for LoRA.
The names below are imported on first use, so ``hf-posext`` commands that do not train never import
transformers' ``Trainer`` (seconds of start-up).
"""

import importlib
from typing import Any

__all__ = ["ConfigError", "TrainConfig", "load_config", "pose_position_ids", "train", "TrainResult", "find_latest_checkpoint"]

#: Public name -> the module that defines it.
_HOMES = {
    "ConfigError": "hf_posext.training.config",
    "TrainConfig": "hf_posext.training.config",
    "load_config": "hf_posext.training.config",
    "pose_position_ids": "hf_posext.training.pose",
    "train": "hf_posext.training.trainer",
    "TrainResult": "hf_posext.training.trainer",
    "find_latest_checkpoint": "hf_posext.training.trainer",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hf_posext.training' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
