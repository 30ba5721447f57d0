"""Every documented ``posext_*`` lm-eval model argument, passed to the harness model and checked in its effect.

Documented in hf_posext/integrations/lm_eval/model.py and README.md: ``posext_method``, ``posext_factor``,
``posext_target_length``, ``posext_original_max_position_embeddings`` and ``posext_<name>`` for any
method parameter (rope, Self-Extend and DCA parameters below). Each model built by the harness class
must equal the one ``hf_posext.patch`` builds with the same arguments, and differ from the one built
without the argument (so the argument is not silently dropped).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

import hf_posext  # noqa: E402
from hf_posext.integrations.lm_eval.model import PosextHFLM, parse_posext_args  # noqa: E402
from hf_posext.models import tiny_model  # noqa: E402
from tests.conftest import transformers_major  # noqa: E402

def _char_tokenizer():
    """A character-level tokenizer (76 ids, inside the tiny models' 128-token vocabulary), built offline."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list(string.ascii_letters + string.digits + " .,:;?!'-\n"))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


IDS = torch.randint(4, 76, (1, 150), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A position-sensitive tiny llama (window 64, init 0.1) and a character tokenizer in a folder."""
    folder = tmp_path_factory.mktemp("tiny_llama_posext_args")
    tiny_model("llama", initializer_range=0.1).save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    return str(folder)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _patched(tiny_dir: str, method: str, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    return hf_posext.patch(model, method, **kwargs)


CASES = [
    # (lm-eval model args, the same request to hf_posext.patch, the request without the argument under test)
    ({"posext_method": "linear", "posext_factor": 2}, ("linear", {"factor": 2}), ("none", {"factor": 1})),
    ({"posext_method": "linear", "posext_target_length": 256}, ("linear", {"target_length": 256}), ("linear", {"factor": 2})),
    (  # the ramp of YaRN depends on the original window (linear's frequencies do not)
        {"posext_method": "yarn", "posext_factor": 4, "posext_original_max_position_embeddings": 32},
        ("yarn", {"factor": 4, "original_max_position_embeddings": 32}),
        ("yarn", {"factor": 4}),
    ),
    (  # head dim 8: only a beta_slow of 4 moves the ramp of this tiny model
        {"posext_method": "yarn", "posext_factor": 4, "posext_beta_fast": 64, "posext_beta_slow": 4},
        ("yarn", {"factor": 4, "beta_fast": 64, "beta_slow": 4}),
        ("yarn", {"factor": 4}),
    ),
    (
        {"posext_method": "self-extend", "posext_group_size": 3, "posext_neighbor_window": 10},
        ("self-extend", {"group_size": 3, "neighbor_window": 10}),
        ("self-extend", {"group_size": 3, "neighbor_window": 11}),
    ),
    (
        {"posext_method": "dca", "posext_factor": 2, "posext_chunk_size": 24, "posext_local_window": 4},
        ("dca", {"factor": 2, "chunk_size": 24, "local_window": 4}),
        ("dca", {"factor": 2, "chunk_size": 24, "local_window": 5}),
    ),
]


@pytest.mark.parametrize("model_args, same, without", CASES, ids=lambda case: ",".join(case) if isinstance(case, dict) else None)
def test_each_posext_argument_reaches_the_model(tiny_dir, model_args, same, without):
    if model_args["posext_method"] in ("self-extend", "dca") and transformers_major() < 5:
        pytest.skip("attention registry dispatch as in transformers 5.x")
    lm = PosextHFLM(pretrained=tiny_dir, device="cpu", dtype="float32", **model_args)
    expected = _patched(tiny_dir, same[0], **same[1])
    report = hf_posext.describe(expected).to_dict()
    assert lm.posext_report == report
    assert lm.max_length == report["current_window"]
    got, want, other = _logits(lm.model), _logits(expected), _logits(_patched(tiny_dir, without[0], **without[1]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (other - want).abs().max() > 1e-2  # >= 1000x the tolerance: the argument changed the model


# ---- peft= with an adapter written by hf-posext's recipes ------------------------------------------------------


@pytest.fixture(scope="module")
def recipe_adapter(tmp_path_factory):
    """A 4-step tiny recipe run: yarn x4, LoRA + trained norms and embeddings (PEFT modules_to_save)."""
    from hf_posext.training.trainer import train
    from tests.training_helpers import tiny_config

    out = tmp_path_factory.mktemp("lm-eval-adapter") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(tiny_config(out, "train.max_steps=4"), progress=False)
    finally:
        torch.set_num_threads(threads)
    return out / "adapter"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_peft_adapter_gets_its_scaling_and_trained_norms(recipe_adapter):
    from hf_posext.adapters import load_adapted_model
    from tests.training_helpers import TINY_MODEL

    lm = PosextHFLM(pretrained=str(TINY_MODEL), peft=str(recipe_adapter), device="cpu", dtype="float32")
    assert (lm.posext_report["method"], lm.posext_report["factor"]) == ("yarn", 4.0)
    assert lm.max_length == 256
    got, want = _logits(lm.model), _logits(load_adapted_model(str(TINY_MODEL), recipe_adapter))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    without_norms = _logits(_lora_only(str(TINY_MODEL), recipe_adapter))
    assert (without_norms - want).abs().max() > 1e-2  # the trained norms/embeddings are part of what was compared


def _lora_only(base_name, folder):
    """The adapter's LoRA weights alone on the patched base (the trained norms/embeddings dropped)."""
    from peft import PeftConfig, PeftModel

    from hf_posext.models import load_model

    config = PeftConfig.from_pretrained(str(folder))
    config.modules_to_save = None
    base = hf_posext.patch(load_model(base_name), "yarn", factor=4)
    model = PeftModel.from_pretrained(base, str(folder), config=config)
    with torch.no_grad():  # PEFT would copy the saved norms into the base anyway: put the original ones back
        for name, parameter in load_model(base_name).named_parameters():
            if "norm" in name or "embed" in name:
                dict(model.get_base_model().named_parameters())[name].copy_(parameter)
    return model


def test_peft_adapter_refuses_another_factor_before_loading(recipe_adapter, monkeypatch):
    from hf_posext.adapters import AdapterMismatchError
    from tests.training_helpers import TINY_MODEL

    monkeypatch.setattr(PosextHFLM, "_create_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(AdapterMismatchError, match=r"trained with yarn x4 \(posext_adapter.json\), not yarn x8"):
        PosextHFLM(pretrained=str(TINY_MODEL), peft=str(recipe_adapter), device="cpu", posext_method="yarn", posext_factor=8)
    with pytest.raises(AdapterMismatchError, match=r"not yarn x8 \(target_length 512\)"):
        PosextHFLM(pretrained=str(TINY_MODEL), peft=str(recipe_adapter), device="cpu", posext_method="yarn",
                   posext_target_length=512)


def test_peft_adapter_with_a_flipped_byte_is_refused(recipe_adapter, tmp_path, monkeypatch):
    import shutil

    from hf_posext.adapters import AdapterFileError
    from tests.training_helpers import TINY_MODEL

    folder = tmp_path / "adapter"
    shutil.copytree(recipe_adapter, folder)
    data = bytearray((folder / "adapter_model.safetensors").read_bytes())
    data[-3] ^= 0x01
    (folder / "adapter_model.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(PosextHFLM, "_create_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(AdapterFileError, match="adapter_model.safetensors does not match its sha256"):
        PosextHFLM(pretrained=str(TINY_MODEL), peft=str(folder), device="cpu")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("spelling", [{"posext": "yarn+string"}, {"posext_method": "yarn+string"}])
def test_peft_adapter_gives_a_composition_without_a_factor_its_factor(recipe_adapter, spelling):
    """posext=yarn+string on a yarn x4 adapter is yarn+string x4, as `hf-posext eval --adapter` takes it."""
    from tests.training_helpers import TINY_MODEL

    lm = PosextHFLM(pretrained=str(TINY_MODEL), peft=str(recipe_adapter), device="cpu", dtype="float32", **spelling)
    assert (lm.posext_request.method, lm.posext_request.factor) == ("yarn+string", 4.0)
    assert lm.posext_report["method"] == "yarn+string" and lm.posext_report["factor"] == 4.0
    with pytest.raises(ValueError, match=r"needs the size of its frequency part"):  # no adapter: no factor to take
        PosextHFLM(pretrained=str(TINY_MODEL), device="cpu", **spelling)


@pytest.mark.parametrize("spelling", [{"posext": "yarn:factor=8"}, {"posext": "yarn+string:factor=8"},
                                      {"posext_method": "yarn", "posext_factor": 8}])
def test_peft_adapter_with_another_factor_names_the_lm_eval_fix(recipe_adapter, monkeypatch, spelling):
    from hf_posext.adapters import AdapterMismatchError
    from tests.training_helpers import TINY_MODEL

    monkeypatch.setattr(PosextHFLM, "_create_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(AdapterMismatchError, match=r"trained with yarn x4 \(posext_adapter.json\), not yarn x8: pass "
                                                   r"posext=yarn:factor=4 \(or leave posext= out") as error:
        PosextHFLM(pretrained=str(TINY_MODEL), peft=str(recipe_adapter), device="cpu", **spelling)
    assert "--methods" not in str(error.value) and "--factor" not in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("text, message", [
    ("yarn+string", r"^posext= 'yarn\+string': method=yarn\+string needs the size of its frequency part"),
    ("yarn", r"^posext= 'yarn': method=yarn needs its size"),
    ("yarn+self-extend:factor=4", r"^posext= 'yarn\+self-extend:factor=4': .*yarn\+self-extend:factor=4:self-extend.group_size=4"),
])
def test_a_request_without_its_size_names_the_model_argument(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_posext_args({"posext": text, "pretrained": "x"})
    assert "\n" not in str(error.value)


def test_peft_adapter_of_another_base_names_the_lm_eval_fix(recipe_adapter, monkeypatch):
    from hf_posext.adapters import AdapterMismatchError

    monkeypatch.setattr(PosextHFLM, "_create_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(AdapterMismatchError, match=r"not 'org/other-model': pass pretrained=\S*tiny-llama\.$") as error:
        PosextHFLM(pretrained="org/other-model", peft=str(recipe_adapter), device="cpu")
    assert "--model" not in str(error.value) and "\n" not in str(error.value)
