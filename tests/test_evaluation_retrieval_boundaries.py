"""Retrieval scoring and prompt construction at their boundaries.

- an answer is found only as a whole number: a generated number that merely contains it (or is contained
  in it) is a miss;
- a dynamic method is scored at the length generation reaches (prompt + ``max_new_tokens``, the cell's
  length), in the teacher-forced pass as in the greedy one;
- a greedy series compared with a teacher-forced-only series is compared on teacher-forced outcomes, both
  sides;
- a passkey or needle prompt plus the generation budget is the cell's length; depth 1 puts the passkey
  right before the question; the needle sits at the sentence boundary nearest its depth, at a tolerance
  a one-sentence shift breaks.
"""

from __future__ import annotations

import json

import pytest
import torch

import hf_posext
from hf_posext.evaluation import needle, passkey, retrieval
from hf_posext.evaluation.arguments import parse_methods
from hf_posext.evaluation.loading import AsciiTokenizer
from hf_posext.evaluation.paired import PairedCount, comparison_tables, paired_counts
from hf_posext.evaluation.results_files import load_results
from hf_posext.evaluation.retrieval import first_integer, score_retrieval
from hf_posext.models import tiny_model

TOKENIZER = AsciiTokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, max_position_embeddings=64, initializer_range=0.1)


# --------------------------------------------------------------------------------------------------
# The answer as a whole number
# --------------------------------------------------------------------------------------------------


class FixedText:
    """Decodes any generated tokens as ``text``: what the model "said" is chosen by the test."""

    def __init__(self, text: str) -> None:
        self.text = text

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.text


@pytest.mark.parametrize("text,found", [
    (" 48213.", True),
    (" 48213 9", True),          # the answer, then another number: the first integer is the answer
    ("The pass key is 48213", True),
    (" 482139", False),          # the answer is a prefix of a longer number
    (" 148213", False),          # ... a suffix of one
    (" 4821", False),            # a prefix of the answer
    (" 1 48213", False),         # another number comes first
    (" no number", False),
])
def test_the_answer_counts_only_as_the_first_whole_number(model, text, found):
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))[0].tolist()
    [result] = score_retrieval(model, FixedText(text), [prompt], [[5, 6]], ["48213"], max_new_tokens=3)
    assert result["greedy"] is found
    assert first_integer(text) == ("48213" if found else first_integer(text))


# --------------------------------------------------------------------------------------------------
# Dynamic methods scored at the length generation reaches
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generate", [True, False])
@pytest.mark.parametrize("max_new_tokens", [2, 9])
def test_a_dynamic_method_is_scored_at_the_prompt_plus_the_generated_tokens(model, monkeypatch, generate, max_new_tokens):
    lengths = []
    real = retrieval.fixed_length

    def spy(m, length):
        lengths.append(length)
        return real(m, length)

    monkeypatch.setattr(retrieval, "fixed_length", spy)
    prompt = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(1))[0].tolist()
    hf_posext.patch(model, "dynamic-ntk", factor=2)
    try:
        # the answer (3 tokens) is what greedy generation produces under the scale for 70 + max_new_tokens
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        answer = out[0, 70:73].tolist()[: max(1, min(3, max_new_tokens))]
        [result] = score_retrieval(model, FixedText("0"), [prompt], [answer], ["0"], max_new_tokens=max_new_tokens,
                                   generate=generate)
    finally:
        hf_posext.unpatch(model)
    assert lengths == [70 + max(max_new_tokens, len(answer))]
    assert result["teacher_forced"] and result["answer_token_accuracy"] == 1.0


def test_the_teacher_forced_logits_are_those_of_the_generation_length(model):
    """The one-forward score uses the frequencies of prompt + max_new_tokens, not of prompt + answer."""
    prompt = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(2))[0].tolist()
    hf_posext.patch(model, "dynamic-ntk", factor=2)
    try:
        seen = {}
        decoder = model.model
        hook = decoder.register_forward_hook(lambda module, args, output: seen.update(hidden=output.last_hidden_state))
        try:
            score_retrieval(model, FixedText("0"), [prompt], [[5, 6, 7]], ["0"], max_new_tokens=30, generate=False)
        finally:
            hook.remove()
        ids = torch.tensor([prompt + [5, 6]])
        with torch.no_grad(), hf_posext.fixed_length(model, 100):
            at_generation_length = decoder(input_ids=ids, use_cache=False).last_hidden_state
        with torch.no_grad():
            at_own_length = decoder(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        hf_posext.unpatch(model)
    torch.testing.assert_close(seen["hidden"], at_generation_length, atol=1e-6, rtol=1e-6)
    assert (at_own_length - at_generation_length).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------------
# A greedy series against a teacher-forced-only series
# --------------------------------------------------------------------------------------------------


def _cell(method: str, greedy: list[int] | None, teacher_forced: list[int], length: int = 128, depth: float = 0.5) -> dict:
    units = [{"teacher_forced": bool(t), "answer_token_accuracy": 1.0 if t else 0.5} for t in teacher_forced]
    cell = {"method": method, "label": method, "factor": 4.0, "length": length, "depth": depth, "supported_window": 64,
            "trials": len(units), "teacher_forced_correct": sum(teacher_forced),
            "teacher_forced_accuracy": sum(teacher_forced) / len(units), "units": units,
            "unit_keys": [["needle", length, depth, t] for t in range(len(units))]}
    if greedy is not None:
        for unit, g in zip(units, greedy):
            unit["greedy"] = bool(g)
        cell.update(greedy_correct=sum(greedy), greedy_accuracy=sum(greedy) / len(units))
    return cell


def _write(folder, name: str, cells: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"needle-{name}.json").write_text(json.dumps({"task": "needle", "config": {"model": "m", "seed": 0},
                                                           "cells": {str(i): c for i, c in enumerate(cells)}}))


@pytest.mark.parametrize("greedy_first", [True, False])
def test_a_greedy_series_against_a_teacher_forced_only_series_pairs_teacher_forced_outcomes(tmp_path, greedy_first):
    # greedy and teacher-forced outcomes of the greedy series disagree, so a mixed pairing shows
    greedy_series = _cell("yarn", greedy=[1, 0, 1, 0], teacher_forced=[1, 1, 0, 0])
    forced_series = _cell("ntk", greedy=None, teacher_forced=[0, 1, 0, 1])
    _write(tmp_path, "a", [greedy_series])
    _write(tmp_path, "b", [forced_series])
    runs = load_results(tmp_path)
    pair = ("yarn x4", "ntk x4") if greedy_first else ("ntk x4", "yarn x4")
    [table] = comparison_tables(runs, [pair])
    [(name, cells)] = table.rows
    assert name.endswith("(teacher-forced)")
    # teacher-forced on both sides: trial 0 yarn only, trial 1 both, trial 2 neither, trial 3 ntk only
    assert cells[128].text.startswith("1:1 of 4 (both 1, neither 1;")
    expected = PairedCount(1, 1, 1, 1)
    assert paired_counts(runs, "needle", *pair, metric="teacher_forced_accuracy") == {128: expected}
    assert paired_counts(runs, "needle", *pair, metric="greedy_accuracy") == {}  # the forced series kept no greedy outcome


def test_two_greedy_series_are_compared_on_greedy_outcomes(tmp_path):
    _write(tmp_path, "a", [_cell("yarn", greedy=[1, 0, 1, 0], teacher_forced=[1, 1, 0, 0])])
    _write(tmp_path, "b", [_cell("ntk", greedy=[0, 0, 1, 1], teacher_forced=[0, 1, 0, 1])])
    [table] = comparison_tables(load_results(tmp_path), [("yarn x4", "ntk x4")])
    [(name, cells)] = table.rows
    assert name.endswith("(greedy)")
    assert cells[128].text.startswith("1:1 of 4 (both 1, neither 1;")  # greedy: trial 0 yarn only, 2 both, 1 neither, 3 ntk


# --------------------------------------------------------------------------------------------------
# Prompt construction
# --------------------------------------------------------------------------------------------------


def _captured_prompts(monkeypatch, module, run) -> list[tuple[int, int]]:
    """(prompt length, max_new_tokens) of every prompt ``run()`` hands to scoring (scores stubbed)."""
    seen: list[tuple[int, int]] = []

    def stub(model, tokenizer, batch, *, max_new_tokens, generate):
        seen.extend((len(prompt), max_new_tokens) for prompt, _answer, _key in batch)
        return [{"teacher_forced": True, "answer_token_accuracy": 1.0, "greedy": True, "generated": ""} for _ in batch]

    monkeypatch.setattr(module, "score_retrieval_grouped", stub)
    run()
    return seen


@pytest.mark.parametrize("max_new_tokens", [1, 6, 10])
def test_passkey_prompt_plus_the_generation_budget_is_the_cells_length(model, tmp_path, monkeypatch, max_new_tokens):
    lengths = [400, 513]
    seen = _captured_prompts(monkeypatch, passkey, lambda: passkey.evaluate_passkey(
        model, TOKENIZER, methods=parse_methods("none"), lengths=lengths, depths=[0.0, 1.0], trials=2, out_dir=tmp_path,
        max_new_tokens=max_new_tokens, progress=False))
    assert sorted({p + n for p, n in seen}) == lengths and all(n == max_new_tokens for _, n in seen)
    assert len(seen) == 2 * 2 * 2


@pytest.mark.parametrize("max_new_tokens", [1, 12])
def test_needle_prompt_plus_the_generation_budget_is_the_cells_length(model, tmp_path, monkeypatch, max_new_tokens):
    (tmp_path / "hay.txt").write_text(" ".join(f"Sentence {i} is about the weather." for i in range(200)))
    lengths = [300, 451]
    seen = _captured_prompts(monkeypatch, needle, lambda: needle.evaluate_needle(
        model, TOKENIZER, methods=parse_methods("none"), lengths=lengths, depths=[0.0, 1.0], trials=2,
        haystack=str(tmp_path / "hay.txt"), out_dir=tmp_path / "out", max_new_tokens=max_new_tokens, progress=False))
    assert sorted({p + n for p, n in seen}) == lengths and all(n == max_new_tokens for _, n in seen)


def _secret_span(text: str, key: str) -> tuple[int, int]:
    line = passkey.passkey_line(key)
    start = text.index(line)
    return start, start + len(line)


@pytest.mark.parametrize("total", [600, 601, 640, 675])  # remainders 0 .. a filler group - 1 after the last whole group
def test_passkey_depth_one_puts_the_key_right_before_the_question(total):
    prompt, _ = passkey.build_passkey_prompt(TOKENIZER, total, 1.0, "48213")
    text = TOKENIZER.decode(prompt)
    _, end = _secret_span(text, "48213")
    question = text.rindex(passkey.QUESTION)
    between = text[end:question]
    # only the few filler tokens no whole filler group fits in (fewer than one group), no whole group
    assert len(between.strip("\n")) < len(passkey.FILLER)
    assert passkey.FILLER not in between
    # depth 0: the key right after the task description
    prompt, _ = passkey.build_passkey_prompt(TOKENIZER, total, 0.0, "48213")
    text = TOKENIZER.decode(prompt)
    start, _ = _secret_span(text, "48213")
    assert text[:start] == passkey.TASK_DESCRIPTION + "\n\n"


@pytest.mark.parametrize("depth", [0.25, 0.5, 0.75])
def test_passkey_depth_places_the_key_at_the_nearest_filler_group(depth):
    total = 2000
    prompt, _ = passkey.build_passkey_prompt(TOKENIZER, total, depth, "48213")
    text = TOKENIZER.decode(prompt)
    start, _ = _secret_span(text, "48213")
    head = len(passkey.TASK_DESCRIPTION) + 1
    before = text[head:start - 1]  # the filler groups before the key
    secret = len("\n" + passkey.passkey_line("48213") + "\n")
    room = total - head - secret - len("\n" + passkey.QUESTION)
    groups = room // len(passkey.FILLER)
    assert before == passkey.FILLER * round(depth * groups)  # exact: one group more or less fails


# Sentences of exactly 40 characters (AsciiTokenizer: one token per character, a space before each but the first).
HAY_SENTENCES = [f"Sentence {i:03d} is about the weather here." for i in range(300)]


@pytest.mark.parametrize("total", [3000, 3013, 3027, 3040])  # the tokens no whole sentence fits in: 0 .. 40
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.33, 0.5, 0.77, 1.0])
def test_the_needle_sits_at_the_sentence_boundary_nearest_its_depth(depth, total):
    hay = needle.Haystack(TOKENIZER, [" ".join(HAY_SENTENCES)])
    first, sentence = len(hay.tokens[0]), len(hay.tokens[1])
    assert {len(t) for t in hay.tokens[1:]} == {sentence}
    needle_text = " " + needle.NEEDLE.format(key="amber", value="1234567")
    prompt, _, info = needle.build_needle_prompt(TOKENIZER, hay, total, depth, "amber", "1234567")
    text = TOKENIZER.decode(prompt)
    offset = text.index(needle_text)
    budget = total - len(needle_text) - len("\n" + needle.QUESTION.format(key="amber"))
    whole = (budget - first) // sentence  # whole sentences after the first that fit
    used = first + sentence * whole  # the haystack tokens taken (the rest of the budget: a part sentence at the end)
    boundaries = [0] + [first + sentence * k for k in range(whole + 1)]
    expected = min(boundaries, key=lambda b: abs(b - depth * used))
    assert offset == expected == info["needle_token_offset"]
    # nearest boundary: within half a sentence of depth x the haystack taken (a one-sentence shift is a whole one off)
    assert abs(offset - depth * used) <= sentence / 2
    assert offset == 0 or text[offset - 1] == "."


# --------------------------------------------------------------------------------------------------
# Length checks: a prompt that exactly fits is accepted, one token less is refused
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module,check,needed", [(passkey, "check_passkey_lengths", "passkey_tokens_needed"),
                                                 (needle, "check_needle_lengths", "needle_tokens_needed")])
def test_a_length_of_exactly_what_its_prompts_need_is_accepted(monkeypatch, module, check, needed):
    monkeypatch.setattr(module, needed, lambda *args, **kwargs: 300)
    getattr(module, check)(TOKENIZER, [300, 512], [0.5], 2, 0, 10)
    with pytest.raises(ValueError, match="Length 299 is too short.*at least 300"):
        getattr(module, check)(TOKENIZER, [299, 512], [0.5], 2, 0, 10)


def test_the_shortest_fitting_length_moves_up_to_what_each_length_needs():
    needs = {100: 101, 101: 101}
    assert passkey.shortest_fitting_length(lambda n: needs.get(n, n), 100) == 101
    assert passkey.shortest_fitting_length(lambda n: 90, 100) == 100


def test_the_shortest_passkey_prompt_holds_exactly_one_filler_group():
    fixed = len(passkey.TASK_DESCRIPTION + "\n") + len("\n" + passkey.passkey_line("48213") + "\n") + len("\n" + passkey.QUESTION)
    shortest = fixed + len(passkey.FILLER)
    prompt, _ = passkey.build_passkey_prompt(TOKENIZER, shortest, 0.5, "48213")
    assert len(prompt) == shortest and passkey.FILLER in TOKENIZER.decode(prompt)
    with pytest.raises(ValueError, match=f"needs at least {shortest}"):
        passkey.build_passkey_prompt(TOKENIZER, shortest - 1, 0.5, "48213")


def test_the_shortest_needle_prompt_holds_one_haystack_token():
    hay = needle.Haystack(TOKENIZER, [" ".join(HAY_SENTENCES)])
    fixed = len(" " + needle.NEEDLE.format(key="amber", value="1234567")) + len("\n" + needle.QUESTION.format(key="amber"))
    prompt, _, _ = needle.build_needle_prompt(TOKENIZER, hay, fixed + 1, 0.5, "amber", "1234567")
    assert len(prompt) == fixed + 1
    with pytest.raises(ValueError, match="cannot hold the needle"):
        needle.build_needle_prompt(TOKENIZER, hay, fixed, 0.5, "amber", "1234567")


@pytest.mark.parametrize("module,run", [
    (passkey, lambda model, out: passkey.evaluate_passkey(model, TOKENIZER, methods=parse_methods("none"), lengths=[400],
                                                          trials=0, out_dir=out, progress=False)),
    (needle, lambda model, out: needle.evaluate_needle(model, TOKENIZER, methods=parse_methods("none"), lengths=[400],
                                                       trials=0, haystack=[" ".join(HAY_SENTENCES)], out_dir=out,
                                                       progress=False)),
])
def test_zero_trials_are_refused(model, tmp_path, module, run):
    with pytest.raises(ValueError, match="trials must be >= 1, got 0"):
        run(model, tmp_path)


def test_the_haystack_takes_a_sentence_that_exactly_fills_the_budget_and_says_cycled_only_when_it_repeats_one():
    hay = needle.Haystack(TOKENIZER, [" ".join(HAY_SENTENCES[:3])])
    lengths = [len(t) for t in hay.tokens]
    taken, cycled = hay.take(sum(lengths[:2]))
    assert [len(t) for t in taken] == lengths[:2] and not cycled  # the second sentence fills the budget exactly
    taken, cycled = hay.take(sum(lengths[:2]) - 1)
    assert [len(t) for t in taken] == lengths[:1]
    taken, cycled = hay.take(sum(lengths))  # every sentence once, none repeated
    assert len(taken) == 3 and not cycled
    taken, cycled = hay.take(sum(lengths) + lengths[0])  # the first sentence again
    assert len(taken) == 4 and cycled


class IdsText:
    """Decodes generated tokens as their ids: the test reads exactly which tokens were generated."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def test_a_sliding_window_cache_rewinds_the_answer_and_generates_as_a_full_recompute():
    """Gemma 3's local layers keep only their window in the KV cache: scoring the answer and then rewinding it past
    the window failed in transformers 5.x ("`crop` was called, but the current layer does not track past states").
    The teacher-forced outcome and the greedy tokens equal those of forwards without a cache."""
    from hf_posext.family_sweep.tiny import build_tiny

    gemma = build_tiny("Gemma3ForCausalLM")  # sliding window 16, window 32
    assert "sliding_attention" in gemma.config.layer_types
    generator = torch.Generator().manual_seed(0)
    prompt, answer = torch.randint(4, 100, (1, 24), generator=generator), torch.randint(4, 100, (1, 3), generator=generator)
    (result,) = score_retrieval(gemma, IdsText(), prompt.tolist(), answer.tolist(), ["0"], max_new_tokens=4)
    with torch.no_grad():
        forced = gemma(input_ids=torch.cat([prompt, answer[:, :-1]], 1), use_cache=False).logits[0, -3:].argmax(-1)
        ids, tokens = prompt, []
        for _ in range(4):
            token = gemma(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            tokens.append(int(token))
            ids = torch.cat([ids, token.view(1, 1)], 1)
    assert result["teacher_forced"] == bool((forced == answer[0]).all())
    assert result["answer_token_accuracy"] == float((forced == answer[0]).float().mean())
    assert result["generated"] == " ".join(map(str, tokens))
