"""hf_posext.export: a saved, exported folder loads with stock from_pretrained to the patched model's logits."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hf_posext
from hf_posext.cli.export_command import add_arguments as add_export_arguments, run as run_export
from hf_posext.export import ExportError, check_serving, export
from hf_posext.models import tiny_model
from tests.conftest import transformers_major

L = 64
FACTOR = 4.0
SEQ = 200  # well past L, inside L * FACTOR
LONGROPE_FACTORS = [1.0, 1.5, 3.0, 4.5]  # tiny Llama: rotary dim 8 -> 4 frequencies

METHODS = {
    "linear": {},
    "ntk": {},
    "theta": {"base": 50000.0},
    "dynamic-ntk": {},
    "yarn": {},
    "llama3": {},
    "longrope": {"long_factor": LONGROPE_FACTORS},
}
REPO = Path(__file__).resolve().parents[1]
TF457_PYTHON = Path(os.environ.get("HF_POSEXT_TF457_PYTHON", REPO / ".venv-tf457" / "bin" / "python"))


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (1, SEQ), generator=torch.Generator().manual_seed(1))


def _patched(method: str):
    model = tiny_model("llama", initializer_range=0.1, max_position_embeddings=L).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(model, method, FACTOR, **METHODS[method])
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _stock_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return _logits(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each method: the folder saved from the patched tiny Llama and the patched model's logits."""
    result = {}
    root = tmp_path_factory.mktemp("saved")
    for method in METHODS:
        model = _patched(method)
        model.save_pretrained(root / method)
        result[method] = (root / method, _logits(model))
    return result


def _expected_problem(method: str, target: str) -> bool:
    if target == "transformers":
        return False
    return method == "dynamic-ntk" or (method == "longrope" and target in ("vllm", "sglang", "llama.cpp"))


@pytest.mark.parametrize("method", list(METHODS))
def test_export_for_transformers_loads_to_the_same_logits(saved, method, tmp_path):
    folder, expected = saved[method]
    out = export(folder, "transformers", tmp_path / "out")
    unscaled = _logits(tiny_model("llama", initializer_range=0.1, max_position_embeddings=L).eval())
    got = _stock_logits(out)
    effect = (unscaled - expected).abs().max().item()
    assert effect > 1e-2, f"{method} does not change the logits of the tiny model ({effect})"
    assert (got - expected).abs().max().item() < effect / 100 and torch.allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("target", ["vllm", "sglang", "llama.cpp"])
@pytest.mark.parametrize("method", list(METHODS))
def test_export_refuses_exactly_the_documented_pairs(saved, method, target, tmp_path):
    folder, _ = saved[method]
    problems = check_serving(folder, target)
    assert bool(problems) == _expected_problem(method, target), problems
    if problems:
        assert method in problems[0] and target in problems[0] and ("yarn" in problems[0])
        with pytest.raises(ExportError):
            export(folder, target, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    else:
        out = export(folder, target, tmp_path / "out")
        assert (out / "model.safetensors").exists()


def test_linear_config_keeps_the_original_window_for_vllm_and_the_served_length_for_llama_cpp(saved, tmp_path):
    folder, _ = saved["linear"]
    for target, length in [("vllm", L), ("sglang", L), ("transformers", L), ("llama.cpp", int(L * FACTOR))]:
        config = json.loads((export(folder, target, tmp_path / target) / "config.json").read_text())
        assert config["max_position_embeddings"] == length, target
        assert config["rope_scaling"] == config["rope_parameters"] and config["rope_parameters"]["factor"] == FACTOR
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]


def test_self_extend_is_refused_for_every_runtime(tmp_path):
    config = {"hf_posext": {"kind": "attention", "method": "self-extend", "factor": 4.0}, "max_position_embeddings": L}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    for target in ("transformers", "vllm", "sglang", "llama.cpp"):
        problems = check_serving(tmp_path / "src", target)
        assert len(problems) == 1 and "self-extend" in problems[0] and "yarn or ntk" in problems[0]


def test_a_t5_linear_model_for_transformers_is_refused_without_a_tautology(tmp_path):
    # Was: "transformers cannot rebuild this scaling from config.json, so transformers cannot either"
    from tests.test_relative import tiny_t5

    model = tiny_t5()
    hf_posext.patch(model, "linear", factor=2.0)
    problem, = check_serving(model, "transformers")
    assert problem == ("linear (relative positions): transformers' from_pretrained cannot rebuild this scaling from "
                       "config.json and would load the model without it; load it with hf_posext.load")
    with pytest.raises(ExportError, match="would load the model without it"):
        export(model, "transformers", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_attention_method_over_a_rope_scaling_names_what_the_runtime_serves_instead():
    # Was: STRING on a model whose config carries yarn x2 was said to be served "unscaled"
    native = tiny_model("llama", max_position_embeddings=L, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": L})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(native, "string")
    problem, = check_serving(native, "vllm")
    assert "vllm would serve yarn x2 (from config.json) without string;" in problem and "unscaled" not in problem
    composed = tiny_model("llama", max_position_embeddings=L)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(composed, "yarn+string", factor=2.0)
    problem, = check_serving(composed, "sglang")
    assert "sglang would serve yarn x2 without string;" in problem
    plain = tiny_model("llama", max_position_embeddings=L)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(plain, "string")
    assert "llama.cpp would serve the model unscaled;" in check_serving(plain, "llama.cpp")[0]


def test_yarn_with_custom_attention_factor_is_refused_where_it_is_ignored(tmp_path):
    model = tiny_model("llama", initializer_range=0.1, max_position_embeddings=L)
    hf_posext.patch(model, "yarn", FACTOR, attention_factor=1.3)
    assert check_serving(model, "vllm") == [] and check_serving(model, "transformers") == []
    assert "attention_factor" in check_serving(model, "llama.cpp")[0]
    assert "attention_factor" in check_serving(model, "sglang")[0]


@pytest.mark.parametrize("params, refused_by", [
    ({"mscale": 1.2, "mscale_all_dim": 0.8}, {"llama.cpp"}),  # SGLang and vLLM compute transformers' ratio
    ({"truncate": False}, {"llama.cpp"}),  # read by vLLM and SGLang (yarn_find_correction_range)
    # read by vLLM, SGLang and llama.cpp's converter, but not by llama.cpp's Llama loader (see bench/llama_cpp_scoring.py)
    ({"beta_fast": 16.0, "beta_slow": 2.0}, {"llama.cpp"}),
    ({"beta_fast": 32.0, "beta_slow": 2.0}, {"llama.cpp"}),
    ({"beta_fast": 32.0, "beta_slow": 1.0}, set()),  # the defaults, spelled out: what llama.cpp uses
    ({"attention_factor": 1.3}, {"sglang", "llama.cpp"}),  # SGLang reads attn_factor, not attention_factor
])
def test_yarn_settings_are_refused_exactly_where_the_runtime_code_ignores_them(params, refused_by):
    model = tiny_model("llama", initializer_range=0.1, max_position_embeddings=L)
    hf_posext.patch(model, "yarn", FACTOR, **params)
    for target in ("transformers", "vllm", "sglang", "llama.cpp"):
        problems = check_serving(model, target)
        assert bool(problems) == (target in refused_by), (target, problems)
        if problems:
            assert any(key in problems[0] for key in params) and target in problems[0] and "\n" not in problems[0]


def test_tokenizer_max_length_is_raised_to_the_served_length(saved, tmp_path):
    folder, _ = saved["yarn"]
    source = tmp_path / "src"
    import shutil

    shutil.copytree(folder, source)
    (source / "tokenizer_config.json").write_text(json.dumps({"model_max_length": L}))
    out = export(source, "vllm", tmp_path / "out")
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == int(L * FACTOR)


def test_exporting_a_model_object_writes_its_tokenizer_without_a_misleading_warning(tmp_path):
    # export(model, "transformers", out) used to write a folder without tokenizer (lm-eval refuses it) and warn
    # the user to run `hf-posext export --for transformers`: the call just made
    from hf_posext.core.loading import check_tokenizer_files

    tokenizer_folder = REPO / "tests" / "data" / "training" / "tiny-llama"
    # a base frequency other than transformers 4.x's default (SmolLM2's 1e5): a plain save_pretrained warns
    model = tiny_model("llama", initializer_range=0.1, max_position_embeddings=L, rope_theta=100000.0).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_posext.patch(model, "yarn", FACTOR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export(model, "transformers", tmp_path / "out", tokenizer=str(tokenizer_folder))
    assert not [w for w in caught if "hf-posext export" in str(w.message)]
    check_tokenizer_files(str(out))  # what `hf-posext lm-eval --model_args pretrained=OUT` checks first
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == int(L * FACTOR)
    torch.testing.assert_close(_stock_logits(out), _logits(model), atol=1e-5, rtol=1e-5)
    with pytest.warns(UserWarning, match="without a tokenizer .*pass tokenizer="):
        bare = export(model, "transformers", tmp_path / "bare")
    assert not (bare / "tokenizer_config.json").exists()
    with pytest.raises(ExportError, match="tokenizer="):
        export(model, "transformers", tmp_path / "bad", tokenizer=str(tmp_path / "no-such-folder"))
    assert not (tmp_path / "bad").exists()


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    return run_export(parser.parse_args(list(argv)))


def test_cli_bad_input_is_refused_before_writing(saved, tmp_path, capsys):
    folder, _ = saved["dynamic-ntk"]
    assert _cli(str(folder), "--for", "vllm", "--out", str(tmp_path / "a")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dynamic-ntk" in err and "vllm" in err and "yarn or ntk" in err
    assert not (tmp_path / "a").exists()
    assert _cli(str(folder), "--for", "transformers", "--out", str(folder)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is the source folder: choose a new folder" in err
    before = sorted(p.name for p in folder.iterdir())
    assert _cli(str(folder), "--for", "transformers", "--out", str(folder / "served")) == 2  # would copy into itself
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is inside the source folder" in err
    assert sorted(p.name for p in folder.iterdir()) == before
    assert _cli(str(folder), "--for", "transformers", "--out", str(folder.parent), "--overwrite") == 2  # would delete it
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "contains the source folder" in err and folder.is_dir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert _cli(str(folder), "--for", "transformers", "--out", str(tmp_path / "full")) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "full" / "keep.txt").exists()
    assert _cli(str(tmp_path / "missing"), "--for", "vllm", "--out", str(tmp_path / "b")) == 2
    assert "no saved model folder" in capsys.readouterr().err
    assert _cli(str(folder), "--for", "transformers", "--out", str(tmp_path / "full"), "--overwrite") == 0
    assert not (tmp_path / "full" / "keep.txt").exists() and (tmp_path / "full" / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


TF457_SCRIPT = """
import sys, warnings, torch, transformers
warnings.simplefilter("ignore")
assert transformers.__version__.startswith("4.57"), transformers.__version__
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.randint(0, 100, (1, int(sys.argv[3])), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[2])
"""


@pytest.mark.skipif(not TF457_PYTHON.exists(), reason="no transformers 4.57 venv (.venv-tf457, made by scripts/test.sh)")
@pytest.mark.parametrize("method", ["linear", "ntk", "theta", "dynamic-ntk", "yarn", "llama3", "longrope"])
def test_legacy_fields_load_to_the_same_logits_on_transformers_4_57(saved, method, tmp_path):
    folder, expected = saved[method]
    out = export(folder, "transformers", tmp_path / "out")
    result = subprocess.run([str(TF457_PYTHON), "-c", TF457_SCRIPT, str(out), str(tmp_path / "logits.pt"), str(SEQ)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    got = torch.load(tmp_path / "logits.pt")
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max().item()


LLAMA_CPP_EXPECTED = REPO / "tests" / "data" / "serving" / "llama_cpp_expected.json"


def test_llama_cpp_expectation_table_agrees_with_transformers():
    """The GGUF rope metadata that bench/llama_cpp_roundtrip.py measured matches the patched models' own numbers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    table = json.loads(LLAMA_CPP_EXPECTED.read_text())
    assert table["none"] == {"context_length": L, "rope.freq_base": 10000.0}
    assert table["linear"]["rope.scaling.type"] == "linear" and table["linear"]["rope.scaling.factor"] == FACTOR
    assert table["yarn"]["rope.scaling.original_context_length"] == L and table["yarn"]["rope.scaling.factor"] == FACTOR
    for method in ("linear", "ntk", "theta", "yarn", "llama3"):
        assert table[method]["context_length"] == int(L * FACTOR), method
    for method in ("ntk", "theta"):
        theta = _patched(method).config.rope_parameters["rope_theta"]
        assert table[method]["rope.freq_base"] == pytest.approx(theta, rel=1e-6) and "rope.scaling.type" not in table[method]
    # llama.cpp divides each frequency by rope_freqs: it must equal transformers' default / llama3 frequencies.
    config = _patched("llama3").config
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.allclose(torch.tensor(table["llama3"]["rope_freqs"]), plain / scaled, rtol=1e-5)
    assert max(table["llama3"]["rope_freqs"]) == FACTOR and min(table["llama3"]["rope_freqs"]) == 1.0


@pytest.mark.skipif(transformers_major() < 5, reason="Gemma 3 nests rope_parameters per layer type only in transformers 5")
@pytest.mark.parametrize("method", ["yarn", "linear"])
def test_a_gemma3_export_for_vllm_carries_the_per_layer_type_fields_4x_runtimes_read(method, tmp_path):
    """vLLM and SGLang builds on transformers 4.x read Gemma 3's global scaling from ``rope_scaling``/``rope_theta`` and
    its sliding layers' base from ``rope_local_base_freq``; without them they serve the model unscaled."""
    from hf_posext.family_sweep.tiny import build_tiny

    model = hf_posext.patch(build_tiny("Gemma3ForCausalLM"), method, factor=2)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((export(tmp_path / "saved", "vllm", tmp_path / "out") / "config.json").read_text())
    full, sliding = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    assert config["rope_theta"] == full["rope_theta"] and config["rope_local_base_freq"] == sliding["rope_theta"]
    assert config["rope_scaling"] == {key: value for key, value in full.items() if key != "rope_theta"}
    if method == "linear":  # vLLM multiplies the window by a linear factor itself
        assert config["max_position_embeddings"] == full.get("original_max_position_embeddings", 32)
