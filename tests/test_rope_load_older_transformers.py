"""A folder saved after ``patch`` under transformers 5 loads with ``hf_posext.load`` under transformers 4.57.

transformers 5 keeps the rotary base only in ``rope_parameters``; the 4.57 config classes read ``rope_theta`` and
``rope_scaling``, and the record's pre-patch snapshot says neither existed. Without a bridge, 4.57 fails with
``AttributeError: ... has no attribute 'rope_theta'`` (Llama, Cohere, gpt-oss, DeepSeek-V2, Llama 4); with it, the
model loads with the same logits as the one saved.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

import hf_posext
from hf_posext.family_sweep.tiny import build_tiny, input_ids
from tests.conftest import transformers_major
from tests.test_export import TF457_PYTHON

pytestmark = [
    pytest.mark.skipif(transformers_major() < 5, reason="saves as transformers 5 does"),
    pytest.mark.skipif(not TF457_PYTHON.exists(), reason="no transformers 4.57 venv (.venv-tf457, made by scripts/test.sh)"),
]

LOAD_SCRIPT = """
import sys, torch, hf_posext
model = hf_posext.load(sys.argv[1])
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
print(hf_posext.describe(model).method)
"""


@pytest.mark.parametrize("class_name", ["LlamaForCausalLM", "CohereForCausalLM", "DeepseekV2ForCausalLM"])
def test_a_transformers_5_save_loads_under_4_57_with_the_same_logits(tmp_path, class_name):
    model = build_tiny(class_name)
    hf_posext.patch(model, "yarn", factor=2)
    ids = input_ids(model, 64)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "saved")
    torch.save(ids, tmp_path / "ids.pt")
    result = subprocess.run([str(TF457_PYTHON), "-c", LOAD_SCRIPT, str(tmp_path / "saved"), str(tmp_path / "ids.pt"),
                             str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "yarn"
    loaded = torch.load(tmp_path / "logits.pt")
    assert float((loaded - expected).abs().max()) < 1e-4
