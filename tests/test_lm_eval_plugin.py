"""The ``hf-posext`` lm-evaluation-harness model: argument handling, patching inside the harness,
the ``hf-posext lm-eval`` command on a small local task, and RULER on SmolLM2 (real_model)."""

from __future__ import annotations

import json
import math
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

import hf_posext  # noqa: E402
from hf_posext.integrations.lm_eval.compare import compare_methods, format_comparison, parse_method_spec  # noqa: E402
from hf_posext.integrations.lm_eval.launcher import resolve_embedded_names  # noqa: E402
from hf_posext.integrations.lm_eval.model import MODEL_NAME, PosextHFLM, parse_posext_args  # noqa: E402
from hf_posext.models import tiny_model  # noqa: E402
from tests.conftest import assert_close_guarding  # noqa: E402

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
REPO_ROOT = Path(__file__).resolve().parents[1]
PASSAGE = json.loads((TASKS_DIR / "posext_tiny.jsonl").read_text().splitlines()[0])["text"]


def _char_tokenizer():
    """A character-level tokenizer (76 ids: fits the tiny models' 128-token vocabulary), built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2 match tiny_model's pad/bos/eos
    vocab = {token: i for i, token in enumerate(specials + list(string.ascii_letters + string.digits + " .,:;?!'-\n"))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny llama (window 64) and a character tokenizer saved to a folder, as a user's model would be."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    return str(folder)


def _rolling_loglikelihood(lm: PosextHFLM, text: str) -> float:
    from lm_eval.api.instance import Instance

    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    return lm.loglikelihood_rolling([request], disable_tqdm=True)[0]


# ------------------------------------------------------------------ arguments (nothing is loaded)


def test_parse_posext_args_splits_scaling_params_and_the_rest():
    request, rest = parse_posext_args(
        {"pretrained": "m", "dtype": "float32", "posext_method": "yarn", "posext_factor": 2, "posext_beta_fast": "16"}
    )
    assert (request.method, request.factor, request.params_dict) == ("yarn", 2.0, {"beta_fast": 16})
    assert rest == {"pretrained": "m", "dtype": "float32"}


def test_posext_method_none_is_the_baseline_even_when_the_harness_reads_it_as_None():
    request, _ = parse_posext_args({"posext_method": None})  # the harness parses the text "none" to None
    assert (request.method, request.factor) == ("none", 1.0)
    request, _ = parse_posext_args({"posext": None})
    assert (request.method, request.factor) == ("none", 1.0)
    assert parse_method_spec("none") == {"posext": "none"}
    assert parse_method_spec("dynamic-yarn:target_length=16384:beta_fast=16") == {
        "posext": "dynamic-yarn:target_length=16384:beta_fast=16",
    }


@pytest.mark.parametrize(
    "posext_args, message",
    [
        ({"posext_method": "yran", "posext_factor": 2}, "Did you mean 'yarn'"),
        ({"posext_method": "yarn", "posext_factor": 2, "posext_beta_fats": 16}, "Did you mean 'beta_fast'"),
        ({"posext_factor": 2}, "without posext_method"),
        ({"posext_method": "yarn"}, "exactly one of posext_factor"),
        ({"posext_method": "yarn", "posext_factor": 2, "posext_target_length": 4096}, "exactly one of posext_factor"),
        ({"posext_method": "linear", "posext_factor": 0.5}, "posext_factor=0.5 is below 1"),
        ({"posext_method": "linear", "posext_target_length": "long"}, "posext_target_length must be a positive integer"),
        # a DCA shape that cannot work on any model is refused before one is loaded
        ({"posext_method": "dca", "posext_factor": 2, "posext_chunk_size": 16, "posext_local_window": 16},
         "local_window=16 must be smaller than chunk_size=16"),
        ({"posext_method": "dca", "posext_factor": 2, "posext_chunk_size": 16, "posext_local_window": 40},
         "local_window=40 must be smaller than chunk_size=16"),
    ],
)
def test_bad_posext_arguments_fail_before_the_model_loads(tmp_path, posext_args, message):
    # The folder does not exist: reaching the loader would raise OSError, not this ValueError.
    with pytest.raises(ValueError, match=message):
        PosextHFLM(pretrained=str(tmp_path / "no-such-model"), device="cpu", **posext_args)


def test_embedded_model_names_become_local_paths(monkeypatch):
    monkeypatch.setattr("hf_posext.models.resolve_model_path", lambda name: f"/cache/{name.lower()}")
    argv = ["run", "--model_args", "pretrained=smollm2-135m,posext_method=yarn", "--metadata",
            '{"tokenizer": "SmolLM2-135M"}', "--model_args=pretrained=smollm2-135m-other,tokenizer=smollm2-135m"]
    assert resolve_embedded_names(argv) == [
        "run", "--model_args", "pretrained=/cache/smollm2-135m,posext_method=yarn", "--metadata",
        '{"tokenizer": "/cache/smollm2-135m"}', "--model_args=pretrained=smollm2-135m-other,tokenizer=/cache/smollm2-135m",
    ]


# ------------------------------------------------------------------ the model inside the harness


def test_model_is_patched_when_the_harness_creates_it(tiny_dir):
    baseline = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="none")
    scaled = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="linear", posext_target_length=256)
    report = hf_posext.describe(scaled.model)
    assert (report.method, report.factor, report.original_window, report.current_window) == ("linear", 4.0, 64, 256)
    assert scaled.posext_report == report.to_dict()
    assert (baseline.max_length, scaled.max_length) == (64, 256)
    info = scaled.get_model_info()  # what the harness writes to results["config"]
    assert info["posext"]["method"] == "linear" and info["posext_request"]["target_length"] == 256
    # The passage is ~200 tokens: the scaled model reads it in one window, the baseline in rolling 64-token ones.
    assert len(scaled.tok_encode(PASSAGE)) > 128
    assert _rolling_loglikelihood(scaled, PASSAGE) != _rolling_loglikelihood(baseline, PASSAGE)


def test_dynamic_method_sets_the_harness_context_to_the_scaled_window(tiny_dir):
    lm = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="dynamic-yarn", posext_factor=2)
    assert lm.model.config.max_position_embeddings == 64  # dynamic methods keep the config's window...
    assert lm.max_length == 128  # ...so the plugin tells the harness the scaled one
    explicit = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="dynamic-yarn", posext_factor=2, max_length=100)
    assert explicit.max_length == 100
    assert math.isfinite(_rolling_loglikelihood(lm, PASSAGE))


def test_a_dynamic_method_generating_inside_its_scaled_window_gets_no_false_length_reminder(tiny_dir):
    """Dynamic methods keep max_position_embeddings at the original window (64), so transformers warns that a
    generation "exceeded the model's predefined maximum length" however far inside the scaled window (128) it is.
    The plugin drops that reminder inside the scaled window and keeps it past it."""
    import logging

    import transformers.utils.logging as transformers_logging
    from lm_eval.api.instance import Instance

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    def generate(lm: PosextHFLM, characters: int) -> None:
        transformers_logging.warning_once.cache_clear()  # a warning_once: shown again for each call here
        request = Instance("generate_until", {}, (PASSAGE[:characters], {"max_gen_toks": 4, "until": ["\n\n"]}), 0)
        lm.generate_until([request], disable_tqdm=True)

    handler, verbosity = Keep(), transformers_logging.get_verbosity()
    logging.getLogger("transformers").addHandler(handler)
    transformers_logging.set_verbosity_warning()  # the suite runs at error level
    try:
        lm = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="dynamic-ntk", posext_factor=2)
        assert lm.model.config.max_position_embeddings == 64 and lm.max_length == 128
        generate(lm, 100)  # 104 tokens: past the declared window, inside the scaled one
        assert not [m for m in seen if "friendly reminder" in m], seen
        past = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="dynamic-ntk", posext_factor=2, max_length=300)
        generate(past, 200)  # 204 tokens: past the scaled window too, where the reminder is true
        assert [m for m in seen if "friendly reminder" in m], seen
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        transformers_logging.set_verbosity(verbosity)


def test_saved_patched_model_gets_its_scaling_back(tiny_dir, tmp_path):
    # dynamic-yarn is not a transformers rope type: stock loading drops it, the plugin re-applies it.
    model = hf_posext.patch(tiny_model("llama"), "dynamic-yarn", factor=2)
    model.save_pretrained(tmp_path)
    _char_tokenizer().save_pretrained(tmp_path)
    lm = PosextHFLM(pretrained=str(tmp_path), device="cpu")
    assert (lm.posext_report["method"], lm.posext_report["factor"]) == ("dynamic-yarn", 2.0)
    ids = torch.randint(4, 76, (1, 100), generator=torch.Generator().manual_seed(0))
    reference = hf_posext.load(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, reference(ids).logits)


def test_already_loaded_model_is_patched_too(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    lm = PosextHFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(tiny_dir), posext_method="yarn", posext_factor=2)
    assert hf_posext.describe(model).method == "yarn" and lm.max_length == 128


def test_registered_with_the_harness():
    from lm_eval.api.registry import get_model

    assert get_model(MODEL_NAME) is PosextHFLM



def test_the_old_import_paths_still_reach_the_integration_with_a_deprecation_warning():
    import importlib

    from hf_posext.integrations.lm_eval import launcher

    for old in ("hf_posext.lm_eval", "hf_posext.lm_eval_plugin"):
        sys.modules.pop(old, None)
        with pytest.warns(FutureWarning, match=f"{old} is now hf_posext.integrations.lm_eval"):
            importlib.import_module(old)
    old_launcher, old_plugin = sys.modules["hf_posext.lm_eval"], sys.modules["hf_posext.lm_eval_plugin"]

    assert old_plugin.PosextHFLM is PosextHFLM and old_plugin.parse_posext_args is parse_posext_args
    assert old_launcher.main is launcher.main and old_launcher.compare_methods is compare_methods


# ------------------------------------------------------------------ the commands


def test_hf_posext_lm_eval_command_runs_a_local_task(tiny_dir, tmp_path):
    from hf_posext.cli import main

    code = main([
        "lm-eval", "run", "--model", MODEL_NAME, "--device", "cpu", "--batch_size", "2",
        "--model_args", f"pretrained={tiny_dir},posext_method=linear,posext_target_length=512",
        "--include_path", str(TASKS_DIR), "--tasks", "posext_tiny_ppl", "posext_tiny_choice",
        "--output_path", str(tmp_path), "--log_samples",
    ])
    assert code == 0
    (results_file,) = tmp_path.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    posext = results["config"]["posext"]  # describe(model) as seen inside the harness
    assert (posext["method"], posext["factor"], posext["current_window"]) == ("linear", 8.0, 512)
    ppl = results["results"]["posext_tiny_ppl"]
    assert ppl["sample_len"] == 6 and 1 < ppl["word_perplexity,none"] < math.inf
    # The accuracy is the patched model's own: each choice's log-likelihood, recomputed here with the
    # model patched as the harness was asked to, equals the harness's; the unpatched model's does not.
    samples = [json.loads(line) for line in next(tmp_path.rglob("samples_posext_tiny_choice_*.jsonl")).read_text().splitlines()]
    from transformers import AutoModelForCausalLM

    patched = hf_posext.patch(AutoModelForCausalLM.from_pretrained(tiny_dir), "linear", target_length=512)
    unpatched = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = _char_tokenizer()
    harness, ours, plain, correct = [], [], [], []
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        requests = [sample["arguments"][key] for key in sorted(sample["arguments"])]
        scores = [_continuation_logprob(patched, tokenizer, r["arg_0"], r["arg_1"]) for r in requests]
        plain += [_continuation_logprob(unpatched, tokenizer, r["arg_0"], r["arg_1"]) for r in requests]
        harness += [float(response[0]) for response in sample["filtered_resps"]]
        ours += scores
        correct.append(max(range(len(scores)), key=scores.__getitem__) == int(sample["target"]))
    assert len(correct) == 6
    assert_close_guarding(torch.tensor(harness), torch.tensor(ours), torch.tensor(plain), atol=1e-5, rtol=0)
    assert results["results"]["posext_tiny_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct), abs=1e-12)


def _continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) under ``model``, character tokens (as the harness scores a choice)."""
    ids = torch.tensor(tokenizer(context + continuation, add_special_tokens=False)["input_ids"])[None]
    with torch.no_grad():
        logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
    picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[-len(continuation):].sum().item()


def test_compare_methods_builds_tasks_once_and_scores_each_method(tiny_dir, tmp_path):
    out = tmp_path / "comparison.json"
    rows = compare_methods(
        tiny_dir, ["none", "linear:target_length=256"], ["posext_tiny_ppl"], include_path=str(TASKS_DIR),
        max_length=256, limit=3, output_path=out,
    )
    scores = {(r["method"], r["metric"]): r["value"] for r in rows}
    assert set(scores) >= {("none", "bits_per_byte"), ("linear:target_length=256", "bits_per_byte")}
    assert scores[("none", "bits_per_byte")] != scores[("linear:target_length=256", "bits_per_byte")]
    saved = json.loads(out.read_text())
    assert saved["reports"]["linear:target_length=256"]["report"]["factor"] == 4.0
    assert "| linear:target_length=256 |" in format_comparison(rows)


def test_eval_script_reaches_the_harness_not_itself():
    # eval/lm_eval.py shares the harness's package name; it must still import the real harness.
    result = subprocess.run([sys.executable, str(REPO_ROOT / "eval" / "lm_eval.py"), "run", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--model_args" in result.stdout


# ------------------------------------------------------------------ RULER on the real model


@pytest.mark.real_model
def test_ruler_niah_on_smollm2_offline(tmp_path):
    pytest.importorskip("wonderwords")
    pytest.importorskip("nltk")
    from hf_posext.cli import main

    # niah_single_1 builds its haystack from a repeated sentence: no dataset download. The tokenizer
    # comes from the local SmolLM2 folder (the command maps smollm2-135m to it).
    code = main([
        "lm-eval", "run", "--model", MODEL_NAME, "--device", "cpu",
        "--model_args", "pretrained=smollm2-135m,posext_method=yarn,posext_factor=2,dtype=float32",
        "--tasks", "niah_single_1", "--metadata", '{"max_seq_lengths": [1024]}', "--limit", "2",
        "--gen_kwargs", "max_gen_toks=24", "--output_path", str(tmp_path),
    ])
    assert code == 0
    (results_file,) = tmp_path.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["config"]["posext"]["method"] == "yarn" and results["config"]["posext"]["current_window"] == 16384
    niah = results["results"]["niah_single_1"]
    assert niah["sample_len"] == 2
    # Well inside SmolLM2's 8192 window, yarn x2 still finds the needle (measured: 2 of 2).
    assert niah["1024,none"] >= 0.5


# ------------------------------------------------------------------ regressions of the shared request parser and loader


def test_a_misspelt_method_in_a_fresh_process_says_did_you_mean():
    # Was: RuntimeError "dictionary changed size during iteration" (method kinds registered while iterated).
    code = (
        "from hf_posext.integrations.lm_eval.model import parse_posext_args\n"
        "try:\n    parse_posext_args({'posext_method': 'yarnn', 'posext_factor': 2})\n"
        "except ValueError as error:\n    print('ValueError:', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ValueError: Unknown method 'yarnn'. Did you mean 'yarn'?" in result.stdout


def test_self_extend_through_the_harness_model(tiny_dir):
    # Was: posext_method=self-extend rejected as an unknown method.
    from transformers import AutoModelForCausalLM

    lm = PosextHFLM(pretrained=tiny_dir, device="cpu", posext_method="self-extend", posext_group_size=4, posext_neighbor_window=16)
    assert (lm.posext_report["method"], lm.posext_report["params"]["group_size"]) == ("self-extend", 4)
    reference = hf_posext.patch(AutoModelForCausalLM.from_pretrained(tiny_dir), "self-extend", group_size=4, neighbor_window=16)
    ids = torch.randint(4, 76, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(
    "family, method, params",
    [("gpt2", "linear", {"factor": 2}), ("llama", "self-extend", {"group_size": 4, "neighbor_window": 16})],
)
def test_a_saved_scaling_is_reloaded_exactly_as_hf_posext_load_does(tmp_path, family, method, params):
    # Was: a saved linear GPT-2 failed to re-apply, and Self-Extend came back on the stock attention
    # implementation instead of the recorded one.
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        base = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    else:
        base = tiny_model(family)
    model = hf_posext.patch(base, method, **params)
    model.save_pretrained(tmp_path)
    _char_tokenizer().save_pretrained(tmp_path)
    lm = PosextHFLM(pretrained=str(tmp_path), device="cpu")
    reference = hf_posext.load(str(tmp_path))
    assert lm.posext_report == hf_posext.describe(reference).to_dict()
    assert lm.model.config._attn_implementation == reference.config._attn_implementation
    ids = torch.randint(4, 76, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, reference(ids).logits)


def test_a_second_comparison_into_one_output_file_is_refused_before_any_task_is_built(tiny_dir, tmp_path, monkeypatch):
    """Each comparison writes its own rows: a second one into the file another is writing would replace them."""
    from hf_posext.core.locks import FolderBusyError, lock_file_writer

    import lm_eval.tasks

    out = tmp_path / "comparison.json"
    holder = lock_file_writer(out)  # the first comparison, still running
    monkeypatch.setattr(lm_eval.tasks, "get_task_dict", lambda *a, **k: pytest.fail("tasks built before the check"))
    try:
        with pytest.raises(FolderBusyError, match=r"comparison.json is being written by another run .*give another "
                                                  r"--out for the comparison") as error:
            compare_methods(tiny_dir, ["none"], ["posext_tiny_ppl"], include_path=str(TASKS_DIR), output_path=out)
        assert "\n" not in str(error.value)
    finally:
        holder.release()
    assert not out.exists()
