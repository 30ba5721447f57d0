"""Kept for ``import hf_posext.lm_eval_plugin`` (registers ``hf-posext``); the code is in :mod:`hf_posext.integrations.lm_eval.model`."""

from hf_posext.integrations.lm_eval.model import MODEL_NAME, POSEXT_PREFIX, PosextHFLM, parse_posext_args

__all__ = ["MODEL_NAME", "POSEXT_PREFIX", "parse_posext_args", "PosextHFLM"]
