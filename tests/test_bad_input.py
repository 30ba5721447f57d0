"""Bad input, as a careless user gives it, through the API and the CLI.

Every case asserts the rules of docs/errors.md:
- one line that names the problem (and the fix where there is one);
- from the CLI: exit 2 for a usage error, 1 for a runtime error (a damaged file), no traceback;
- the model is left as it was: every parameter, buffer and config field, the module types and the
  hf_posext state (a previous patch included);
- the model folders are left as they were (every file hashed) and nothing is written where the output
  would have gone; where the error can be found from the arguments, no model is loaded.

The model folders are built once per session; each case works on fresh copies of the models in memory.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import hf_posext
from hf_posext.cli import main
from hf_posext.core.errors import DamagedFileError
from hf_posext.models import tiny_config, tiny_model

# --------------------------------------------------------------------------------------------------
# Session fixtures: model folders and files every case reads (hashed before and after each case)
# --------------------------------------------------------------------------------------------------


def _save_with_record(source: Path, target: Path, record: Any) -> None:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["hf_posext"] = record
    (target / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Saved models (plain, patched, T5, damaged) and other inputs, under one root (``root``)."""
    import transformers

    root = tmp_path_factory.mktemp("bad-input")
    paths = {name: root / name for name in (
        "llama", "yarn", "dynamic", "t5", "truncated", "bad_json", "record_list", "record_no_method",
        "no_weights", "results", "not_results", "corrupt_tokenizer", "tokenizer_missing_field", "good_results",
        "json_folder_results", "yarn_betas",
    )}
    tiny_model("llama").save_pretrained(paths["llama"])
    hf_posext.patch(tiny_model("llama"), "yarn", factor=2).save_pretrained(paths["yarn"])
    hf_posext.patch(tiny_model("llama"), "dynamic-ntk", factor=2).save_pretrained(paths["dynamic"])
    hf_posext.patch(tiny_model("llama"), "yarn", factor=2, beta_fast=16, beta_slow=2).save_pretrained(paths["yarn_betas"])
    torch.manual_seed(0)
    t5_config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(t5_config).save_pretrained(paths["t5"])
    shutil.copytree(paths["llama"], paths["truncated"])
    weights = paths["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(paths["llama"], paths["bad_json"])
    (paths["bad_json"] / "config.json").write_text('{"model_type": "llama",')
    _save_with_record(paths["llama"], paths["record_list"], ["yarn", 2])
    _save_with_record(paths["llama"], paths["record_no_method"], {"version": 1, "kind": "rope", "factor": 2})
    # The shipped tiny llama has a real tokenizer: one copy with its tokenizer.json cut short, one with a
    # tokenizer.json that is valid JSON but lacks the tokenizer's fields.
    shipped = Path(__file__).parent / "data" / "training" / "tiny-llama"
    shutil.copytree(shipped, paths["corrupt_tokenizer"])
    tokenizer_json = paths["corrupt_tokenizer"] / "tokenizer.json"
    tokenizer_json.write_bytes(tokenizer_json.read_bytes()[:100])
    shutil.copytree(shipped, paths["tokenizer_missing_field"])
    (paths["tokenizer_missing_field"] / "tokenizer.json").write_text('{"version": "1.0"}')
    shutil.copytree(paths["llama"], paths["no_weights"])
    (paths["no_weights"] / "model.safetensors").unlink()
    paths["results"].mkdir()
    (paths["results"] / "perplexity-x.json").write_text(json.dumps(
        {"task": "perplexity", "config": {}, "cells": {"a": {"method": "none", "factor": 1.0, "length": 64}}, "runs": []}))
    paths["not_results"].mkdir()
    (paths["not_results"] / "notes.json").write_text("[1, 2, 3]")
    good_cell = {"method": "none", "factor": 1.0, "length": 64, "ppl": 10.0, "nll": 2.302585, "tokens": 63}
    for name in ("good_results", "json_folder_results"):
        paths[name].mkdir()
        (paths[name] / "perplexity-x.json").write_text(json.dumps(
            {"task": "perplexity", "config": {}, "cells": {"a": good_cell}, "runs": []}))
    (paths["json_folder_results"] / "old.json").mkdir()  # a folder whose name looks like a results file
    (root / "scaling_list.yaml").write_text("model:\n  name: tiny\nscaling:\n  - method\n  - yarn\n")
    paths["scaling_list_yaml"] = root / "scaling_list.yaml"
    import random

    (root / "noise.txt").write_bytes(random.Random(0).randbytes(5000))  # a perplexity of it would measure noise
    paths["noise_txt"] = root / "noise.txt"
    (root / "syntax.yaml").write_text("model:\n  name: tiny\n bad: [\n")
    (root / "text.bin").write_bytes(b"\x00\x01")
    paths["syntax_yaml"] = root / "syntax.yaml"
    paths["text_bin"] = root / "text.bin"
    paths["root"] = root
    return paths


def folder_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path (folders without files count too)."""
    digest = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        digest[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
    return digest


@pytest.fixture(scope="session")
def pristine(folders) -> dict[str, str]:
    return folder_digest(folders["root"])


# --------------------------------------------------------------------------------------------------
# A model's whole state
# --------------------------------------------------------------------------------------------------


def model_snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """Everything a failed call must leave as it was: tensors, config, module types, hf_posext state."""
    def tensors(items):
        return {name: tensor.detach().clone() for name, tensor in items}

    state = {key: copy.copy(value) for key, value in vars(model).items() if "posext" in key}
    try:
        description = repr(hf_posext.describe(model).to_dict())
    except ValueError as error:  # a model on the meta device cannot be described either
        description = str(error)
    return {
        "parameters": tensors(model.named_parameters()),
        "buffers": tensors(model.named_buffers()),
        "config": json.dumps(model.config.to_dict(), sort_keys=True, default=str),
        "attn_implementation": model.config._attn_implementation,
        "modules": [(name, type(module).__qualname__) for name, module in model.named_modules()],
        "posext_state": repr(state),
        "describe": description,
    }


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    for kind in ("parameters", "buffers"):
        assert before[kind].keys() == after[kind].keys(), f"{kind} added or removed"
        for name, tensor in before[kind].items():
            other = after[kind][name]
            assert (tensor.shape, tensor.dtype, tensor.device) == (other.shape, other.dtype, other.device), f"{kind[:-1]} {name} changed"
            if not tensor.is_meta:
                assert torch.equal(tensor, other), f"{kind[:-1]} {name} changed"
    for key in ("config", "attn_implementation", "modules", "posext_state", "describe"):
        assert before[key] == after[key], f"the model's {key} changed"


# --------------------------------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------------------------------


def _plain() -> torch.nn.Module:
    return tiny_model("llama")


def _yarn() -> torch.nn.Module:
    return hf_posext.patch(tiny_model("llama"), "yarn", factor=2)


def _self_extend() -> torch.nn.Module:
    return hf_posext.patch(tiny_model("llama"), "self-extend", group_size=4, window=16)


def _gpt2() -> torch.nn.Module:
    return tiny_model_gpt2()


def tiny_model_gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)).eval()


def _meta() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("llama"))


P = hf_posext.patch
MODELS = {"plain": _plain, "yarn": _yarn, "self-extend": _self_extend, "gpt2": _gpt2, "meta": _meta}

#: (id, model, call(model, folders), error type, message pattern)
API_CASES: list[tuple[str, str, Callable[[Any, dict], Any], type, str]] = [
    ("unknown-method", "plain", lambda m, f: P(m, "yran", factor=2), ValueError, r"Unknown method 'yran'.*Known methods: .*yarn"),
    ("unknown-method-keeps-yarn", "yarn", lambda m, f: P(m, "yran", factor=2), ValueError, r"Unknown method 'yran'"),
    ("unknown-method-keeps-self-extend", "self-extend", lambda m, f: P(m, "yran", factor=2), ValueError, r"Unknown method 'yran'"),
    ("method-not-a-name", "plain", lambda m, f: P(m, None, factor=2), TypeError, r"method must be a name"),
    ("method-of-another-kind", "gpt2", lambda m, f: P(m, "yarn", factor=2), ValueError, r"'yarn' applies to rope .* Methods valid here: linear"),
    ("factor-below-1", "plain", lambda m, f: P(m, "yarn", factor=0.5), ValueError, r"factor=0.5 is below 1.*Use factor >= 1"),
    ("factor-negative", "yarn", lambda m, f: P(m, "linear", factor=-2), ValueError, r"factor=-2.* is below 1"),
    ("factor-nan-keeps-yarn", "yarn", lambda m, f: P(m, "yarn", factor=float("nan")), ValueError, r"factor must be a finite number >= 1, got nan"),
    ("factor-nan-keeps-self-extend", "self-extend", lambda m, f: P(m, "yarn", factor=float("nan")), ValueError, r"finite number >= 1, got nan"),
    ("factor-inf", "plain", lambda m, f: P(m, "ntk", factor=float("inf")), ValueError, r"finite number >= 1, got inf"),
    ("factor-string", "plain", lambda m, f: P(m, "yarn", factor="2"), ValueError, r"finite number >= 1, got '2'"),
    ("factor-bool", "plain", lambda m, f: P(m, "yarn", factor=True), ValueError, r"finite number >= 1, got True"),
    ("factor-and-target", "plain", lambda m, f: P(m, "yarn", factor=2, target_length=128), ValueError, r"factor.*target_length"),
    ("no-size", "yarn", lambda m, f: P(m, "linear"), ValueError, r"needs its size: exactly one of factor .* or target_length"),
    ("target-below-window", "plain", lambda m, f: P(m, "yarn", target_length=10), ValueError, r"target_length=10 is shorter than the model's original window \(64 tokens\)"),
    ("target-zero", "plain", lambda m, f: P(m, "yarn", target_length=0), ValueError, r"target_length must be a positive integer, got 0"),
    ("unknown-param-keeps-self-extend", "self-extend", lambda m, f: P(m, "yarn", factor=2, beta_fats=3), ValueError, r"no parameter 'beta_fats'. Did you mean 'beta_fast'"),
    ("param-wrong-type", "plain", lambda m, f: P(m, "yarn", factor=2, beta_fast="x"), ValueError, r"beta_fast must be a positive number, got 'x'"),
    ("param-of-paramless-method", "plain", lambda m, f: P(m, "linear", factor=2, foo=1), ValueError, r"'linear' has no parameter 'foo'"),
    ("self-extend-group-0-keeps-yarn", "yarn", lambda m, f: P(m, "self-extend", group_size=0, window=32), ValueError, r"group_size must be an integer >= 1, got 0"),
    ("self-extend-window-negative", "plain", lambda m, f: P(m, "self-extend", group_size=4, window=-1), ValueError, r"window must be an integer >= 1, got -1"),
    ("self-extend-window-too-big", "plain", lambda m, f: P(m, "self-extend", group_size=4, window=100), ValueError, r"window=100 must be smaller than the model's original window \(64"),
    ("self-extend-group-fraction", "self-extend", lambda m, f: P(m, "self-extend", group_size=1.5, window=16), ValueError, r"group_size must be an integer >= 1, got 1.5"),
    ("original-window-zero", "plain", lambda m, f: P(m, "yarn", factor=2, original_max_position_embeddings=0), ValueError, r"original_max_position_embeddings must be a positive integer, got 0"),
    ("longrope-without-factors", "yarn", lambda m, f: P(m, "longrope", factor=2), ValueError, r"'longrope' needs per-dimension factors"),
    ("longrope-missing-file", "plain", lambda m, f: P(m, "longrope", factor=2, factors=str(f["root"] / "none.json")), ValueError, r"factor file '.*none.json' does not exist"),
    ("theta-negative-base", "plain", lambda m, f: P(m, "theta", factor=2, base=-1), ValueError, r"base must be a positive number, got -1"),
    ("meta-device", "meta", lambda m, f: P(m, "yarn", factor=2), ValueError, r"is on the meta device .*load real weights first"),
    ("meta-device-self-extend", "meta", lambda m, f: P(m, "self-extend", group_size=4, window=16), ValueError, r"is on the meta device"),
    ("patch-not-a-model", None, lambda m, f: P(3, "yarn", factor=2), TypeError, r"Expected a transformers model .* got int"),
    ("unpatch-unpatched", "plain", lambda m, f: hf_posext.unpatch(m), ValueError, r"not patched by hf_posext \(nothing to unpatch\)"),
    ("describe-not-a-model", None, lambda m, f: hf_posext.describe("llama"), TypeError, r"Expected a transformers model"),
    ("load-missing-folder", None, lambda m, f: hf_posext.load(f["root"] / "missing"), FileNotFoundError, r"no such model folder: .*missing"),
    ("load-truncated-weights", None, lambda m, f: hf_posext.load(f["truncated"]), DamagedFileError, r"truncated/model.safetensors is truncated or corrupt"),
    ("load-record-not-a-dict", None, lambda m, f: hf_posext.load(f["record_list"]), hf_posext.RecordError, r"record_list/config.json: field 'hf_posext' must be a mapping"),
    ("load-record-without-method", None, lambda m, f: hf_posext.load(f["record_no_method"]), hf_posext.RecordError, r"record_no_method/config.json: field 'hf_posext' has no 'method'"),
    ("load-bad-json", None, lambda m, f: hf_posext.load(f["bad_json"]), OSError, r"bad_json/config.json' is not a valid JSON file"),
    ("load-model-t5", None, lambda m, f: _load_model(f["t5"]), ValueError, r"holds a 't5' model \(T5ForConditionalGeneration\), not a causal language model"),
    ("load-tokenizer-missing", None, lambda m, f: _load_tokenizer(f["llama"]), ValueError, r"llama has no tokenizer \(none of tokenizer.json, .*tokenizer.save_pretrained"),
    ("load-tokenizer-corrupt", None, lambda m, f: _load_tokenizer(f["corrupt_tokenizer"]), DamagedFileError, r"corrupt_tokenizer/tokenizer.json is truncated or corrupt .*tokenizer.save_pretrained"),
    ("load-tokenizer-missing-field", None, lambda m, f: _load_tokenizer(f["tokenizer_missing_field"]), DamagedFileError,
     r"tokenizer_missing_field has no usable tokenizer: its tokenizer.json, tokenizer_config.json cannot be loaded \(KeyError"),
    ("eval-load-no-tokenizer", None, lambda m, f: _load_for_eval(f["llama"]), ValueError, r"llama has no tokenizer"),
    ("eval-load-corrupt-tokenizer", None, lambda m, f: _load_for_eval(f["corrupt_tokenizer"]), DamagedFileError, r"tokenizer.json is truncated or corrupt"),
    ("eval-load-t5-before-tokenizer", None, lambda m, f: _load_for_eval(f["t5"]), ValueError, r"holds a 't5' model"),
    ("lm-eval-model-corrupt-tokenizer", None, lambda m, f: _lm_eval_model(f["corrupt_tokenizer"]), DamagedFileError, r"tokenizer.json is truncated or corrupt"),
    ("lm-eval-model-no-tokenizer", None, lambda m, f: _lm_eval_model(f["llama"]), ValueError, r"llama has no tokenizer"),
    ("export-dynamic-for-vllm", None, lambda m, f: _export(f["dynamic"], "vllm", f["root"] / "out"), ValueError, r"dynamic-ntk.*vllm"),
    ("export-truncated", None, lambda m, f: _export(f["truncated"], "transformers", f["root"] / "out"), ValueError, r"model.safetensors is truncated or corrupt"),
    ("train-config-yaml-syntax", None, lambda m, f: _load_config(f["syntax_yaml"]), ValueError, r"syntax.yaml: line 3, column 2: not valid YAML"),
    ("train-config-unknown-key", None, lambda m, f: _load_config(None, ["model.name=x", "train.max_stepz=3"]), ValueError, r"Unknown config key 'train.max_stepz'. Did you mean 'train.max_steps'"),
]


def _load_model(path):
    from hf_posext.models import load_model

    return load_model(str(path))


def _load_tokenizer(path):
    from hf_posext.models import load_tokenizer

    return load_tokenizer(str(path))


def _load_for_eval(path):
    from hf_posext.evaluation.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(str(path))


def _lm_eval_model(path):
    from hf_posext.integrations.lm_eval.model import PosextHFLM

    return PosextHFLM(pretrained=str(path), posext_method="yarn", posext_factor=2, device="cpu")


def _export(source, target, out):
    from hf_posext.export import export

    return export(source, target, out)


def _load_config(path, overrides=None):
    from hf_posext.training.config import load_config

    return load_config(path, overrides)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail a case if it reaches ``from_pretrained`` of any model class."""
    from transformers import PreTrainedModel

    def refuse(cls, *args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize("case_id, model_kind, call, error_type, pattern", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input_is_one_clear_line_and_changes_nothing(case_id, model_kind, call, error_type, pattern, folders, pristine, no_model_loading):
    model = MODELS[model_kind]() if model_kind else None
    before = model_snapshot(model) if model is not None else None
    with pytest.raises(error_type) as raised:
        call(model, folders)
    message = str(raised.value)
    assert re.search(pattern, message), message
    assert "\n" not in message, f"a multi-line message: {message!r}"
    if model is not None:
        assert_same_snapshot(before, model_snapshot(model))
    assert folder_digest(folders["root"]) == pristine


def test_the_api_cases_cover_every_kind_of_model_state():
    assert {c[1] for c in API_CASES} == set(MODELS) | {None}
    assert len(API_CASES) >= 40


# --------------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------------

USAGE, RUNTIME = 2, 1
_PATCH = ["patch", "{llama}", "--method", "yarn", "--factor", "2", "--out", "{out}"]
_PPL = ["eval", "perplexity", "--model", "{llama}", "--methods", "none", "--lengths", "64", "--out", "{out}"]
_PASSKEY = ["eval", "passkey", "--model", "{llama}", "--methods", "none", "--lengths", "64", "--out", "{out}"]
_NEEDLE = ["eval", "needle", "--model", "{llama}", "--methods", "none", "--lengths", "64", "--out", "{out}"]
_TRAIN = ["train", "--config", "recipes/configs/tiny/ci-stage1-cpu.yaml", "output.dir={out}"]


def _with(argv: list[str], **changes: str) -> list[str]:
    """``argv`` with option values replaced (``lengths="inf"``) or added, ``model="..."`` for the model."""
    argv = list(argv)
    for key, value in changes.items():
        if key in ("model", "folder") and "{llama}" in argv:
            argv[argv.index("{llama}")] = value
            continue
        option = "--" + key.replace("_", "-")
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    return argv


#: (id, argv, exit code, message pattern, may load a model)
CLI_CASES: list[tuple[str, list[str], int, str, bool]] = [
    # patch
    ("patch-missing-folder", _with(_PATCH, model="{missing}"), USAGE, r"no such model folder: .*missing", False),
    ("patch-out-is-a-file", _with(_PATCH, out="{file}"), USAGE, r"--out .*notes.txt is a file; give a folder", False),
    ("patch-out-under-a-file", _with(_PATCH, out="{file}/model"), USAGE, r"--out .*notes.txt/model cannot be created: .*notes.txt is a file", False),
    ("patch-unknown-method", _with(_PATCH, method="wavelet"), USAGE, r"Unknown method 'wavelet'", False),
    ("patch-factor-below-1", _with(_PATCH, factor="0.5"), USAGE, r"factor=0.5 is below 1", False),
    ("patch-factor-nan", _with(_PATCH, factor="nan"), USAGE, r"factor must be a finite number >= 1, got nan", False),
    ("patch-param-typo", _with(_PATCH, param="beta_fats=2"), USAGE, r"no parameter 'beta_fats'. Did you mean 'beta_fast'", False),
    ("patch-param-without-value", _with(_PATCH, param="beta_fast"), USAGE, r"--param expects key=value, got 'beta_fast' \(e.g. --param beta_fast=32\)", False),
    ("patch-target-below-window", [a for a in _PATCH if a not in ("--factor", "2")] + ["--target-length", "10"], USAGE,
     r"target_length=10 is shorter than the model's original window", True),
    ("patch-factor-and-target", _PATCH + ["--target-length", "128"], USAGE, r"not allowed with argument", False),
    ("patch-self-extend-group-0", _with(_PATCH, method="self-extend", factor="1", param="group_size=0"), USAGE, r"group_size must be an integer >= 1", False),
    ("patch-t5-with-rope-method", _with(_PATCH, model="{t5}"), USAGE, r"'yarn' applies to rope position encodings, but this model uses relative ones", True),
    ("patch-truncated-weights", _with(_PATCH, model="{truncated}"), RUNTIME, r"truncated/model.safetensors is truncated or corrupt", False),
    ("patch-bad-config-json", _with(_PATCH, model="{bad_json}"), RUNTIME, r"bad_json/config.json' is not a valid JSON file", False),
    ("patch-record-not-a-dict", _with(_PATCH, model="{record_list}"), RUNTIME, r"config.json: field 'hf_posext' must be a mapping", False),
    ("patch-record-without-method", _with(_PATCH, model="{record_no_method}"), RUNTIME, r"field 'hf_posext' has no 'method'", False),
    ("patch-no-weights", _with(_PATCH, model="{no_weights}"), RUNTIME, r"no file named model.safetensors", True),
    ("patch-corrupt-tokenizer", _with(_PATCH, model="{corrupt_tokenizer}"), RUNTIME, r"corrupt_tokenizer/tokenizer.json is truncated or corrupt", False),
    ("patch-tokenizer-missing-field", _with(_PATCH, model="{tokenizer_missing_field}"), RUNTIME, r"has no usable tokenizer: .*KeyError", False),
    # describe / inspect
    ("describe-missing-folder", ["describe", "{missing}"], USAGE, r"no such model folder", False),
    ("describe-truncated-weights", ["describe", "{truncated}"], RUNTIME, r"model.safetensors is truncated or corrupt", False),
    ("describe-plain-load-truncated", ["describe", "{truncated}", "--no-hf-posext-load"], RUNTIME, r"model.safetensors is truncated or corrupt", False),
    ("describe-record-not-a-dict", ["describe", "{record_list}"], RUNTIME, r"field 'hf_posext' must be a mapping", False),
    ("inspect-unknown-method", ["inspect", "{llama}", "--method", "wavelet", "--factor", "2"], USAGE, r"Unknown method 'wavelet'", False),
    ("inspect-factor-negative", ["inspect", "{llama}", "--method", "yarn", "--factor", "-1"], USAGE, r"factor=-1.0 is below 1", False),
    # eval: arguments, all refused before the model is loaded
    ("eval-length-inf", _with(_PPL, lengths="inf"), USAGE, r"Bad length 'inf'", False),
    ("eval-length-word", _with(_PPL, lengths="abc"), USAGE, r"Bad length 'abc'", False),
    ("eval-length-zero", _with(_PPL, lengths="0"), USAGE, r"Length 0 is too short: a length is a number of tokens >= 2", False),
    ("eval-length-negative", _with(_PPL, lengths="-5"), USAGE, r"Length -5 is too short", False),
    ("eval-no-length", _with(_PPL, lengths=","), USAGE, r"No length given: pass e.g. --lengths", False),
    ("eval-chunk-size-zero", _with(_PPL, chunk_size="0"), USAGE, r"--chunk-size must be a positive number of tokens, got 0", False),
    ("eval-batch-size-zero", _with(_PPL, batch_size="0"), USAGE, r"--batch-size must be a positive number", False),
    ("eval-max-windows-zero", _with(_PPL, max_windows="0"), USAGE, r"--max-segments must be a positive number of segments", False),
    ("eval-max-tokens-zero", _with(_PPL, max_tokens="0"), USAGE, r"--max-tokens must be a positive number of tokens", False),
    ("eval-factor-below-1", _with(_PPL, factor="0.5"), USAGE, r"--factor must be a finite number >= 1, got 0.5", False),
    ("eval-factor-nan", _with(_PPL, factor="nan"), USAGE, r"--factor must be a finite number >= 1, got nan", False),
    ("eval-unknown-method", _with(_PPL, methods="none,yran"), USAGE, r"Unknown method 'yran'", False),
    ("eval-no-method", _with(_PPL, methods=","), USAGE, r"No method given", False),
    ("eval-param-typo", _with(_PPL, methods="none,yarn", param="beta_fats=2"), USAGE, r"no parameter 'beta_fats'", False),
    ("eval-self-extend-group-0", _with(_PPL, methods="self-extend", param="group_size=0"), USAGE, r"group_size must be an integer >= 1, got 0", False),
    ("eval-unknown-dtype", _with(_PPL, dtype="float99"), USAGE, r"Unknown dtype 'float99'; use auto \(the default\), float32, bfloat16 or float16", False),
    ("eval-unknown-device", _with(_PPL, device="tpu"), USAGE, r"--device tpu is not a device name; use cpu", False),
    ("eval-out-is-a-file", _with(_PPL, out="{file}"), USAGE, r"--out .*notes.txt is a file; give a folder", False),
    ("eval-out-under-a-file", _with(_PPL, out="{file}/results"), USAGE, r"--out .*notes.txt/results cannot be created: .*notes.txt is a file", False),
    ("eval-missing-data", _with(_PPL, data="{missing}"), USAGE, r"Text source '.*missing' does not exist", False),
    ("eval-data-of-another-type", _with(_PPL, data="{text_bin}"), USAGE, r"text.bin: unsupported file type '.bin'", False),
    ("eval-unknown-builtin-data", _with(_PPL, data="builtin:nope"), USAGE, r"Unknown built-in text 'builtin:nope'", False),
    ("eval-data-not-text", _with(_PPL, data="{noise_txt}"), USAGE, r"^.*error: \d\d% of .*noise.txt is not UTF-8 text .*Convert it", False),
    ("eval-needle-haystack-not-text", _with(_NEEDLE, haystack="{noise_txt}"), USAGE, r"\d\d% of .*noise.txt is not UTF-8 text", False),
    ("eval-passkey-depth-above-1", _with(_PASSKEY, depths="0,2"), USAGE, r"depth 2.0 is outside \[0.0, 1.0\]", False),
    ("eval-passkey-depth-word", _with(_PASSKEY, depths="x"), USAGE, r"Bad depth 'x'", False),
    ("eval-passkey-trials-zero", _with(_PASSKEY, trials="0"), USAGE, r"--trials must be a positive number of prompts", False),
    ("eval-passkey-max-new-tokens-zero", _with(_PASSKEY, max_new_tokens="0"), USAGE, r"--max-new-tokens must be a positive number", False),
    ("eval-needle-missing-haystack", _with(_NEEDLE, haystack="{missing}"), USAGE, r"Text source '.*missing' does not exist", False),
    ("eval-tiny-spec", _with(_PPL, model="tiny:llama:abc"), USAGE, r"Bad tiny model spec 'tiny:llama:abc'", False),
    # eval: the model folder
    ("eval-missing-model", _with(_PPL, model="{missing}"), USAGE, r"no such model folder", False),
    ("eval-t5-folder", _with(_PPL, model="{t5}"), USAGE, r"holds a 't5' model \(T5ForConditionalGeneration\), not a causal language model", False),
    ("eval-truncated-weights", _with(_PPL, model="{truncated}"), RUNTIME, r"truncated/model.safetensors is truncated or corrupt", False),
    ("eval-bad-config-json", _with(_PPL, model="{bad_json}"), RUNTIME, r"config.json' is not a valid JSON file", False),
    # eval: the tokenizer is loaded (and refused) before the model
    ("eval-no-tokenizer", _PPL, USAGE, r"llama has no tokenizer \(none of .*tokenizer.save_pretrained", False),
    ("eval-corrupt-tokenizer", _with(_PPL, model="{corrupt_tokenizer}"), RUNTIME, r"corrupt_tokenizer/tokenizer.json is truncated or corrupt", False),
    ("eval-tokenizer-missing-field", _with(_PPL, model="{tokenizer_missing_field}"), RUNTIME, r"has no usable tokenizer: its tokenizer.json, .* cannot be loaded", False),
    ("eval-passkey-no-tokenizer", _PASSKEY, USAGE, r"llama has no tokenizer", False),
    ("eval-passkey-corrupt-tokenizer", _with(_PASSKEY, model="{corrupt_tokenizer}"), RUNTIME, r"tokenizer.json is truncated or corrupt", False),
    ("eval-needle-no-tokenizer", _NEEDLE, USAGE, r"llama has no tokenizer", False),
    ("eval-needle-corrupt-tokenizer", _with(_NEEDLE, model="{corrupt_tokenizer}"), RUNTIME, r"tokenizer.json is truncated or corrupt", False),
    # report
    ("report-missing-folder", ["report", "{missing}"], USAGE, r"Results folder .*missing does not exist", False),
    ("report-cell-without-numbers", ["report", "{results}"], RUNTIME, r"perplexity-x.json.*cell 'a' lacks its 'ppl'", False),
    ("report-not-a-results-file", ["report", "{not_results}"], RUNTIME, r"notes.json", False),
    ("report-json-named-folder", ["report", "{json_folder_results}"], RUNTIME,
     r"json_folder_results/old.json is a folder, not a results file; rename it or move it out of", False),
    ("report-out-is-a-file", ["report", "{good_results}", "--out", "{file}"], USAGE, r"--out .*notes.txt is a file; give a folder", False),
    ("report-out-under-a-file", ["report", "{good_results}", "--out", "{file}/report"], USAGE,
     r"--out .*notes.txt/report cannot be created: .*notes.txt is a file, not a folder", False),
    # export
    ("export-dynamic-for-vllm", ["export", "{dynamic}", "--for", "vllm", "--out", "{out}"], USAGE, r"dynamic-ntk.*vllm", False),
    ("export-out-is-source", ["export", "{yarn}", "--for", "transformers", "--out", "{yarn}"], USAGE, r"is the source folder: choose a new folder", False),
    ("export-out-not-empty", ["export", "{yarn}", "--for", "transformers", "--out", "{llama}"], USAGE, r"exists and is not empty: choose a new folder or pass --overwrite", False),
    ("export-missing-folder", ["export", "{missing}", "--for", "vllm", "--out", "{out}"], USAGE, r"no saved model folder at .*missing", False),
    ("export-truncated-weights", ["export", "{truncated}", "--for", "vllm", "--out", "{out}"], RUNTIME, r"model.safetensors is truncated or corrupt", False),
    ("export-bad-config-json", ["export", "{bad_json}", "--for", "vllm", "--out", "{out}"], RUNTIME, r"bad_json/config.json is not valid JSON", False),
    ("export-unknown-target", ["export", "{yarn}", "--for", "tgi", "--out", "{out}"], USAGE, r"invalid choice: 'tgi'", False),
    ("export-yarn-betas-for-llama-cpp", ["export", "{yarn_betas}", "--for", "llama.cpp", "--out", "{out}"], USAGE,
     r"yarn with beta_fast=16, beta_slow=2: llama.cpp's converter writes the betas but its Llama loader does not read them", False),
    ("export-out-under-a-file", ["export", "{yarn}", "--for", "vllm", "--out", "{file}/served"], USAGE,
     r"--out .*notes.txt/served cannot be created: .*notes.txt is a file, not a folder", False),
    # train
    ("train-missing-config", ["train", "--config", "{missing}"], USAGE, r"Recipe config '.*missing' not found", False),
    ("train-yaml-syntax", ["train", "--config", "{syntax_yaml}"], USAGE, r"syntax.yaml: line 3, column 2: not valid YAML", False),
    ("train-unknown-key", _TRAIN + ["train.max_stepz=3"], USAGE, r"Unknown config key 'train.max_stepz'", False),
    ("train-scaling-section-a-list", ["train", "--config", "{scaling_list_yaml}"], USAGE,
     r"scaling_list.yaml: section 'scaling' must be a mapping of keys \(e.g. scaling: yarn:factor=4, or \{method: yarn, factor: 4\}", False),
    ("train-data-not-text", _TRAIN + ["data.source={noise_txt}"], USAGE, r"data.source: \d\d% of .*noise.txt is not UTF-8 text", False),
    ("train-data-missing", _TRAIN + ["data.source={missing}"], USAGE, r"data.source: Text source '.*missing' does not exist", False),
    ("train-output-dir-under-a-file", _TRAIN + ["output.dir={file}/run"], USAGE,
     r"output.dir .*notes.txt/run cannot be created: .*notes.txt is a file, not a folder", False),
    ("train-negative-learning-rate", _TRAIN + ["train.learning_rate=-1"], USAGE, r"train.learning_rate must be > 0, got -1", False),
    ("train-steps-not-a-number", _TRAIN + ["train.max_steps=abc"], USAGE, r"train.max_steps expects an integer, got 'abc'", False),
    ("train-resume-not-a-run", ["train", "--resume", "{llama}"], USAGE, r"llama holds no checkpoint and no train_config.yaml: not a training run folder", False),
    ("train-no-config", ["train"], USAGE, r"--config is required", False),
    ("train-no-tokenizer", _TRAIN + ["model.name={llama}"], USAGE, r"llama has no tokenizer", False),
    ("train-corrupt-tokenizer", _TRAIN + ["model.name={corrupt_tokenizer}"], RUNTIME, r"tokenizer.json is truncated or corrupt", False),
    # lm-eval: the tokenizer is checked before any task or model is built
    ("lm-eval-compare-no-tokenizer", ["lm-eval-compare", "{llama}", "--methods", "none", "--tasks", "lambada_openai"], USAGE, r"llama has no tokenizer", False),
    ("lm-eval-compare-corrupt-tokenizer", ["lm-eval-compare", "{corrupt_tokenizer}", "--methods", "none", "--tasks", "lambada_openai"], RUNTIME,
     r"tokenizer.json is truncated or corrupt", False),
]


def _fill(argv: list[str], folders: dict[str, Path], tmp_path: Path) -> list[str]:
    values = {name: str(path) for name, path in folders.items()}
    values.update(out=str(tmp_path / "out"), file=str(tmp_path / "notes.txt"), missing=str(tmp_path / "missing"))
    return [item.format(**values) for item in argv]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run ``hf-posext argv`` in this process: (exit code, its one error line)."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, f"expected one error line, got {err!r}"
    assert err.rstrip().endswith(errors[0]), f"the error is not the last line: {err!r}"
    return code, errors[0]


@pytest.mark.parametrize("case_id, argv, code, pattern, may_load", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_clear_line_and_changes_nothing(case_id, argv, code, pattern, may_load, folders, pristine, tmp_path, capsys, request):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if not may_load:
        request.getfixturevalue("no_model_loading")
    (tmp_path / "notes.txt").write_text("keep me")
    before = folder_digest(tmp_path)
    exit_code, line = run_cli(_fill(argv, folders, tmp_path), capsys)
    assert re.search(pattern, line), line
    assert exit_code == code, line
    assert folder_digest(tmp_path) == before, "something was written"
    assert folder_digest(folders["root"]) == pristine


def test_the_suite_has_at_least_60_cases_of_each_exit_code():
    assert len(API_CASES) + len(CLI_CASES) >= 60
    assert {c[2] for c in CLI_CASES} == {USAGE, RUNTIME}


def test_an_unexpected_error_is_one_line_with_its_type_and_exit_1(folders, capsys, monkeypatch):
    import importlib

    cli_main = importlib.import_module("hf_posext.cli.main")

    def broken(args):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setitem(cli_main.SUBCOMMANDS, "methods", ("list", lambda p: None, broken))
    assert run_cli(["methods"], capsys) == (1, "hf-posext methods: error: RuntimeError: disk on fire second line")
    monkeypatch.setenv("HF_POSEXT_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["methods"])

