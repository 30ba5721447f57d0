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
from hf_posext.integrations.lm_eval.model import PosextHFLM  # noqa: E402
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
