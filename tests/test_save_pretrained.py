"""The normal save path: a patched model's ``save_pretrained`` folder is served right without ``export``.

Per method, on transformers 5.x and 4.57: stock ``from_pretrained`` of the saved folder gives the patched
logits (or ``describe`` says why not); config.json carries the legacy fields; linear keeps
``max_position_embeddings`` = L; a tokenizer given to ``patch`` saves the served length.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import hf_posext
from hf_posext.models import tiny_model

L = 64
FACTOR = 4.0
SEQ = 200  # well past L, inside L * FACTOR
LONGROPE_FACTORS = [1.0, 1.5, 3.0, 4.5]  # tiny Llama: rotary dim 8 -> 4 frequencies
REPO = Path(__file__).resolve().parents[1]
TF457_PYTHON = Path(os.environ.get("HF_POSEXT_TF457_PYTHON", REPO / ".venv-tf457" / "bin" / "python"))


def test_dynamic_ntk_is_stock_loadable_on_a_smollm2_shaped_llama():
    """Head dim 64, theta 1e5, L 8192 (SmolLM2-135M's rotary shape), x8: the patch-time check must accept it.

    transformers computes the dynamic base from a 0-d int64 tensor, i.e. in float32; a float64 base was
    a few ulps off, which position 65535 turned into 1.9e-3 in cos/sin, and the check rejected the method.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny_model("llama", hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                       max_position_embeddings=8192, rope_theta=1e5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(model, "dynamic-ntk", 8.0)
    assert hf_posext.describe(model).stock_loadable is True
    rotary = model.model.rotary_emb
    for length in (8193, 20000, 65536):
        ours, _ = rotary.frequencies(length)
        stock, _ = ROPE_INIT_FUNCTIONS["dynamic"](model.config, "cpu", seq_len=torch.tensor(length))
        assert torch.equal(ours, stock), length
