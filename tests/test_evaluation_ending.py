"""The ending check (hf_posext.evaluation.ending): does each answer end with the end-of-turn token?"""

from __future__ import annotations

import json

import pytest
import torch

from hf_posext.evaluation.ending import INSTRUCTIONS, answer_endings, chat_prompt, end_token_ids, ended_like
from hf_posext.models import tiny_model
from tests.card_helpers import LENGTH, char_tokenizer

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"


def _tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _always(token: int):
    """A tiny model that always predicts ``token`` (its output head picks it whatever the hidden state)."""
    model = tiny_model("llama", max_position_embeddings=LENGTH)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0 ...
    model.lm_head.register_forward_hook(lambda module, args, output: output.index_fill(-1, torch.tensor([token]), 1.0))  # ... but one
    return model


def test_an_answer_that_stops_on_the_end_token_ended_and_one_that_runs_out_did_not():
    tokenizer = _tokenizer()
    end = tokenizer.convert_tokens_to_ids("</s>")
    assert end in end_token_ids(tokenizer)
    ended = answer_endings(_always(end), tokenizer, INSTRUCTIONS[:2], max_new_tokens=8)
    assert [(r["ended"], r["generated_tokens"], r["response"]) for r in ended] == [(True, 1, "")] * 2
    letter = tokenizer.convert_tokens_to_ids("a")
    running = answer_endings(_always(letter), tokenizer, INSTRUCTIONS[:2], max_new_tokens=8)
    assert [(r["ended"], r["generated_tokens"], r["response"]) for r in running] == [(False, 8, "a" * 8)] * 2
    assert ended_like(running, ended) == {"reference_ended": 2, "also_ended": 0, "only_reference": 2, "only_here": 0}
    assert ended_like(ended, running) == {"reference_ended": 0, "also_ended": 0, "only_reference": 0, "only_here": 2}
    assert ended_like(ended, ended) == {"reference_ended": 2, "also_ended": 2, "only_reference": 0, "only_here": 0}


def test_ended_like_pairs_by_instruction_and_leaves_out_instructions_one_side_lacks():
    reference = [{"instruction": "a", "ended": True}, {"instruction": "b", "ended": False}, {"instruction": "c", "ended": True},
                 {"instruction": "d", "ended": True}]
    records = [{"instruction": "c", "ended": False}, {"instruction": "b", "ended": True}, {"instruction": "a", "ended": True},
               {"instruction": "e", "ended": True}]  # d unanswered here, e unanswered by the reference
    assert ended_like(records, reference) == {"reference_ended": 3, "also_ended": 1, "only_reference": 1, "only_here": 1}


def test_the_card_pairs_the_rows_chat_endings_instruction_by_instruction():
    from hf_posext.card.render import markdown_card

    def cell(row, index, ended, key="k"):
        return {"task": "ending", "kind": "ending", "row": row, "row_index": index, "length": 256, "base": index == 0,
                "in_window": True, "text": f"{sum(ended)}/{len(ended)}", "sample_key": key,
                "scores": {str(i): float(e) for i, e in enumerate(ended)}}

    base, tuned = [True] * 8, [i >= 6 for i in range(8)]  # 6 of the base model's 8 endings lost
    markdown = markdown_card([cell("base", 0, base), cell("tuned", 1, tuned)])
    assert "| base vs tuned | 6:0 of 8 (p = 0.031) |" in markdown and "| tuned | 2/8 |" in markdown
    assert "Paired samples (RULER)" not in markdown  # the endings' pairs stay in their own section
    # answers to another instruction set (another sample key) are not paired
    assert "| pair | paired |" not in markdown_card([cell("base", 0, base), cell("tuned", 1, tuned, key="other")])


def test_the_prompt_is_the_chat_template_with_the_assistant_turn_opened():
    tokenizer = _tokenizer()
    text = tokenizer.decode(chat_prompt(tokenizer, "Hi?"))
    assert text.endswith("user: Hi?</s><s>assistant: ")
    plain = char_tokenizer()
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(plain, "Hi?")


def test_the_card_ending_row_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    from hf_posext.cli import main
    from hf_posext.evaluation import ending

    # four of the instructions: a tiny model runs out its whole budget on each (the full set took 191 s under load)
    monkeypatch.setattr(ending, "INSTRUCTIONS", INSTRUCTIONS[:4])

    folder = tmp_path / "model"
    tiny_model("llama", max_position_embeddings=LENGTH).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    plain = tmp_path / "plain"
    tiny_model("llama", max_position_embeddings=LENGTH).save_pretrained(plain)
    char_tokenizer().save_pretrained(plain)
    out = tmp_path / "card"
    assert main(["eval", "suite", "--models", f"base={folder}@none;yarn:2,plain={plain}", "--lengths", str(LENGTH), "--tasks", "ending",
                 "--out", str(out), "--no-progress"]) == 0
    card = json.loads((out / "card.json").read_text())
    cells = {c["row"]: c for c in card["cells"]}
    assert set(cells) == {"base, unscaled", "base, yarn ×2"}
    assert all(c["n"] == 4 and c["reference_ended"] == cells["base, unscaled"]["k"] for c in cells.values())
    assert [s for s in card["skipped"] if s["what"] == "plain: ending" and "no chat template" in s["reason"]]
    # its own table, not a length column beside the card's lengths
    markdown = (out / "card.md").read_text()
    assert "Chat endings: short instructions" in markdown and "| task | row |" not in markdown
    yarn = cells["base, yarn ×2"]
    assert {"only_reference", "only_here"} <= set(yarn) and yarn["also_ended"] + yarn["only_reference"] == yarn["reference_ended"]
    assert f"| base, yarn ×2 | {yarn['text']} |" in markdown
    assert yarn["mean_generated_tokens"] == sum(r["generated_tokens"] for r in json.loads(
        next((out / "tasks").glob("ending-base-yarn-x2-*.json")).read_text())["records"]) / 4
    assert yarn["text"].endswith(f"; {yarn['mean_generated_tokens']:.0f} tokens an answer")
    (pair,) = [p for p in card["paired"] if p["task"] == "ending"]
    assert pair["n"] == 4 and f"| {pair['first']} vs {pair['second']} | {pair['text']} |" in markdown
    assert "<h2>Chat endings</h2>" in (out / "card.html").read_text()
    path = next((out / "tasks").glob("ending-base-yarn-x2-*.json"))
    stored = json.loads(path.read_text())
    assert len(stored["records"]) == 4 and stored["budget"] == 128

    # a second run reads the answers back; other instructions are answered again; a damaged file is named
    def refuse(*args, **kwargs):
        raise AssertionError("answered again")

    monkeypatch.setattr(ending, "answer_endings", refuse)
    assert main(["eval", "suite", "--models", f"base={folder}@none;yarn:2", "--lengths", str(LENGTH), "--tasks", "ending",
                 "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "card.json").read_text())["cells"] == card["cells"]
    monkeypatch.setattr(ending, "INSTRUCTIONS", INSTRUCTIONS[4:6])
    capsys.readouterr()
    assert main(["eval", "suite", "--models", f"base={folder}@none", "--lengths", str(LENGTH), "--tasks", "ending", "--out", str(out),
                 "--no-progress"]) != 0
    assert "answered again" in capsys.readouterr().err
    path.write_text("{not json")
    assert main(["eval", "suite", "--models", f"base={folder}@yarn:2", "--lengths", str(LENGTH), "--tasks", "ending", "--out",
                 str(out), "--no-progress"]) != 0
    assert f"chat-ending results {path} are not readable" in capsys.readouterr().err


def test_a_chat_template_that_is_not_valid_jinja_is_refused_by_the_card_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    from hf_posext.cli import main
    from hf_posext.evaluation.ending import ChatTemplateError, chat_prompt
    import hf_posext.evaluation.loading as loading
    from hf_posext.models import tiny_model

    folder = tmp_path / "chat-model"
    tiny_model("llama", max_position_embeddings=512).save_pretrained(folder)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }"  # a brace short
    tokenizer.save_pretrained(folder)
    with pytest.raises(ChatTemplateError, match=r"chat template is not a valid Jinja template \("):
        chat_prompt(AutoTokenizer.from_pretrained(folder), "Say hello.")
    monkeypatch.setattr(loading, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()  # the save's own output
    out = tmp_path / "card"
    code = main(["eval", "suite", "--models", str(folder), "--methods", "none", "--tasks", "ending", "--lengths", "256",
                 "--trials", "1", "--out", str(out), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and f"{folder}: the tokenizer's chat template is not a valid Jinja template" in error, error
    assert len(error.splitlines()) == 1 and not out.exists()


def test_a_row_whose_window_cannot_hold_a_prompt_and_its_answer_is_refused_or_listed_as_skipped(tmp_path, capsys):
    """A 64-token window holds no chat prompt plus a 128-token answer: scoring it 0/48 read as "never ends its turn"."""
    from hf_posext.cli import main

    folder = tmp_path / "short"
    tiny_model("llama", max_position_embeddings=64).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    capsys.readouterr()
    out = tmp_path / "card"
    argv = ["eval", "suite", "--models", f"base={folder}@none", "--lengths", "64", "--tasks", "ending", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    (line,) = [line for line in error.splitlines() if "error:" in line]  # beside the note of what --dtype auto chose
    assert "base, unscaled: ending: prompt" in line and "> the model's window 64" in line and "--skip-over-window" in line, error
    assert main([*argv, "--skip-over-window"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["cells"] == [] and [s for s in card["skipped"] if s["what"] == "base, unscaled: ending"
                                    and "window 64" in s["reason"]], card["skipped"]
