"""A folder saved after ``patch`` under transformers 5 loads with ``hf_posext.load`` under transformers 4.57.

transformers 5 keeps the rotary base only in ``rope_parameters``; the 4.57 config classes read ``rope_theta`` and
``rope_scaling``, and the record's pre-patch snapshot says neither existed. Without a bridge, 4.57 fails with
``AttributeError: ... has no attribute 'rope_theta'`` (Llama, Cohere, gpt-oss, DeepSeek-V2, Llama 4); with it, the
model loads with the same logits as the one saved. Gemma 3 keeps its bases and scaling per layer type
(``rope_parameters`` nested); the save writes them as the fields 4.57's Gemma 3 reads (``rope_theta``/``rope_scaling``
for the global layers, ``rope_local_base_freq`` for the sliding ones), so stock ``from_pretrained`` reads it too:
without them it loads the model silently unscaled. A family 4.57 does not have, and a scaling 4.57's config class
rejects (OLMo takes only linear/dynamic, Phi-3 only longrope), are refused in one line. Every folder goes through one
4.57 process (starting one costs seconds). ``bench/legacy_load_sweep.py`` runs the same check over every family.
"""

from __future__ import annotations

import json
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

#: Families 4.57 has (they load with the logits saved) and families it lacks (refused in one line).
LOADED = ["LlamaForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "DeepseekV2ForCausalLM", "GptOssForCausalLM",
          "Llama4ForCausalLM", "Gemma3ForCausalLM"]
#: Families whose folder stock ``from_pretrained`` under 4.57 also reads as the patched model.
STOCK_LOADED = ["LlamaForCausalLM", "Gemma3ForCausalLM"]
REFUSED = ["Gemma4ForCausalLM", "Qwen3_5ForCausalLM", "Mistral4ForCausalLM"]
#: Families 4.57 has whose config class rejects the saved yarn ``rope_scaling``.
REJECTED_SCALING = ["OlmoForCausalLM", "Phi3ForCausalLM"]
ALL = LOADED + REFUSED + REJECTED_SCALING

LOAD_SCRIPT = """
import json, sys, torch, hf_posext
from transformers import AutoModelForCausalLM
found = {}
folders, stock = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for folder in folders:
    try:
        model = hf_posext.load(folder)
    except ValueError as error:
        found[folder] = {"refused": str(error)}
        continue
    ids = torch.load(folder + "/ids.pt")
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, folder + "/logits-4.57.pt")
        if folder in stock:
            torch.save(AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids).logits, folder + "/stock-4.57.pt")
    found[folder] = {"method": hf_posext.describe(model).method}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded_under_4_57(tmp_path_factory):
    """Every family saved patched (yarn x2) under transformers 5, then loaded by one transformers 4.57 process."""
    root = tmp_path_factory.mktemp("saved")
    expected = {}
    for class_name in ALL:
        model = build_tiny(class_name)
        hf_posext.patch(model, "yarn", factor=2)
        ids = input_ids(model, 64)
        with torch.no_grad():
            expected[class_name] = model(input_ids=ids).logits
        model.save_pretrained(root / class_name)
        torch.save(ids, root / class_name / "ids.pt")
    folders = [str(root / name) for name in ALL]
    stock = [str(root / name) for name in STOCK_LOADED]
    result = subprocess.run([str(TF457_PYTHON), "-c", LOAD_SCRIPT, json.dumps(folders), json.dumps(stock)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    return {name: (found[str(root / name)], root / name, expected[name]) for name in ALL}


@pytest.mark.parametrize("class_name", LOADED)
def test_a_transformers_5_save_loads_under_4_57_with_the_same_logits(loaded_under_4_57, class_name):
    found, folder, expected = loaded_under_4_57[class_name]
    assert found == {"method": "yarn"}
    loaded = torch.load(folder / "logits-4.57.pt")
    assert float((loaded - expected).abs().max()) < 1e-4


def _refusal(loaded_under_4_57, class_name: str) -> tuple[str, dict]:
    """The one line hf_posext.load gave under 4.57 for ``class_name``'s save, and that save's config."""
    found, folder, _ = loaded_under_4_57[class_name]
    return found["refused"], json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("class_name", REFUSED)
def test_a_family_4_57_does_not_have_is_refused_in_one_line(loaded_under_4_57, class_name):
    message, config = _refusal(loaded_under_4_57, class_name)
    model_type = config["model_type"]
    assert "\n" not in message and f"holds a {model_type!r} model, which transformers 4.57" in message
    assert f"load it with a transformers that has {model_type!r} (>= 5." in message


@pytest.mark.parametrize("class_name", STOCK_LOADED)
def test_stock_from_pretrained_under_4_57_reads_the_patched_model(loaded_under_4_57, class_name):
    """Gemma 3's scaled global layers reach 4.57 only through the legacy fields (without them: 6e-3 off, unscaled)."""
    _, folder, expected = loaded_under_4_57[class_name]
    assert float((torch.load(folder / "stock-4.57.pt") - expected).abs().max()) < 1e-4


def test_gemma3_save_writes_the_fields_4_57_reads_per_layer_type(loaded_under_4_57):
    _, folder, _ = loaded_under_4_57["Gemma3ForCausalLM"]
    config = json.loads((folder / "config.json").read_text())
    full, sliding = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    assert config["rope_scaling"] == {key: value for key, value in full.items() if key != "rope_theta"}
    assert config["rope_local_base_freq"] == sliding["rope_theta"]
    assert "rope_theta" not in config  # yarn: the generic config reader fails with it; 4.57's default (1e6) is right


@pytest.mark.parametrize("class_name", REJECTED_SCALING)
def test_a_scaling_the_4_57_config_class_rejects_is_refused_in_one_line(loaded_under_4_57, class_name):
    message, config = _refusal(loaded_under_4_57, class_name)
    model_type = config["model_type"]
    assert "\n" not in message and f"holds a {model_type!r} model saved by transformers 5." in message
    assert "rejects the rope_scaling of its hf_posext yarn x2 patch" in message
    assert message.endswith(f"load it with transformers >= {config['transformers_version']}.")
