"""``hf-posext lm-eval-compare`` passes the harness's chat options through (tiny task, tiny model, offline)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from hf_posext.cli import main  # noqa: E402
from hf_posext.models import tiny_model  # noqa: E402

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    """A tiny llama and a character tokenizer with a chat template, saved like a user's model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_chat")
    tiny_model("llama").save_pretrained(folder)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list(string.ascii_letters + string.digits + " .,:;?!'-\n"))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


def _compare(model_dir: str, out: Path, *options: str) -> dict:
    code = main(["lm-eval-compare", model_dir, "--methods", "none", "--tasks", "posext_tiny_choice", "--include-path", str(TASKS_DIR),
                 "--limit", "2", "--max-length", "256", "--out", str(out), *options])
    assert code == 0
    return json.loads(out.read_text())


def test_chat_options_reach_the_harness(chat_model_dir, tmp_path):
    plain = _compare(chat_model_dir, tmp_path / "plain.json")
    chat = _compare(chat_model_dir, tmp_path / "chat.json", "--apply_chat_template", "--system_instruction", "Be brief.")
    assert plain["settings"]["apply_chat_template"] is False and plain["settings"]["fewshot_as_multiturn"] is False
    assert not plain["reports"]["none"]["first_prompt"].startswith(("system:", "user:"))
    assert chat["settings"]["apply_chat_template"] is True and chat["settings"]["fewshot_as_multiturn"] is True  # the harness's default
    assert chat["settings"]["system_instruction"] == "Be brief."
    prompt = chat["reports"]["none"]["first_prompt"]
    assert prompt.startswith("system: Be brief.\nuser: ") and prompt.endswith("assistant: ")
    assert plain["reports"]["none"]["first_prompt"].strip() in prompt  # the same question, wrapped in the template
    no_turns = _compare(chat_model_dir, tmp_path / "no_turns.json", "--apply_chat_template", "--fewshot_as_multiturn", "false")
    assert no_turns["settings"]["fewshot_as_multiturn"] is False


def test_fewshot_as_multiturn_without_a_chat_template_is_refused_first(chat_model_dir, tmp_path, capsys):
    code = main(["lm-eval-compare", chat_model_dir, "--methods", "none", "--tasks", "posext_tiny_choice", "--include-path", str(TASKS_DIR),
                 "--fewshot_as_multiturn", "--out", str(tmp_path / "x.json")])
    assert code == 2
    assert "--fewshot_as_multiturn needs --apply_chat_template" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
