"""Fine-tuning for longer context: PoSE sampling, LoRA setup, transformers' Trainer with checkpoint/resume.

>>> from hf_posext.training import load_config, train
>>> train(load_config("recipes/configs/tiny/lora_pose.yaml", ["train.max_steps=4"]))

Importing this package loads no model and needs no optional dependency; ``peft`` is needed for LoRA.
"""

from hf_posext.training.config import ConfigError, TrainConfig, load_config
from hf_posext.training.pose import pose_position_ids
from hf_posext.training.trainer import TrainResult, find_latest_checkpoint, train

__all__ = ["ConfigError", "TrainConfig", "load_config", "pose_position_ids", "train", "TrainResult", "find_latest_checkpoint"]
