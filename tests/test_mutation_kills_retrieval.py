"""Retrieval scoring with answers right at some tokens and wrong at others, rows that disagree, short answers.

The passkey tests score all-right and all-wrong answers only; these check every per-row, per-token
number score_retrieval returns against an independent computation (one plain forward of the model
over prompt + answer, and ``model.generate``), in a batch whose rows have different results.
"""

from __future__ import annotations

import pytest
import torch

import hf_posext
from hf_posext.evaluation.retrieval import score_retrieval, score_retrieval_grouped
from hf_posext.models import tiny_model


class DigitTokenizer:
    """Decodes token t as the digit t mod 10, so every generated text is an integer to compare."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(str(int(t) % 10) for t in ids)


TOKENIZER = DigitTokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, max_position_embeddings=32, initializer_range=0.1)  # prompts run past the window


def _prompts(rows: int, length: int = 40) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(3, 128, (rows, length), generator=generator).tolist()


def _answer(model, prompt: list[int], length: int, wrong: set[int]) -> list[int]:
    """The model's greedy continuation, except at the positions in ``wrong`` (one token off there)."""
    answer: list[int] = []
    with torch.no_grad():
        for k in range(length):
            token = int(model(torch.tensor([prompt + answer])).logits[0, -1].argmax())
            answer.append((token + 1) % 128 if k in wrong else token)
    return answer


def _greedy_text(model, prompt: list[int], new_tokens: int) -> str:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return TOKENIZER.decode(out[0, len(prompt):].tolist())


@pytest.mark.parametrize("generate", [True, False])
@pytest.mark.parametrize("method", ["none", "yarn"])
def test_partly_right_answers_score_per_token_and_per_row(model, generate, method):
    hf_posext.patch(model, method, factor=1.0 if method == "none" else 4.0)
    try:
        prompts = _prompts(3)
        wrong = [set(), {2}, {0, 3}]  # all right, 3 of 4 right, 2 of 4 right
        answers = [_answer(model, p, 4, w) for p, w in zip(prompts, wrong)]
        texts = [_greedy_text(model, p, 6) for p in prompts]
        expected = [texts[0], texts[1][:-1] + str((int(texts[1][-1]) + 1) % 10), texts[2]]
        results = score_retrieval(model, TOKENIZER, prompts, answers, expected, max_new_tokens=6, generate=generate)
    finally:
        hf_posext.unpatch(model)
    assert [r["answer_token_accuracy"] for r in results] == [1.0, 0.75, 0.5]
    assert [r["teacher_forced"] for r in results] == [True, False, False]
    if generate:
        assert [r["generated"] for r in results] == texts
        assert [r["greedy"] for r in results] == [True, False, True]
    else:
        assert all("greedy" not in r and "generated" not in r for r in results)


@pytest.mark.parametrize("answer_length", [1, 2])
def test_short_answers_keep_the_cache_rewound(model, answer_length):
    """One- and two-token answers: the teacher-forced tokens are dropped from the cache before generating."""
    prompts = _prompts(2)
    answers = [_answer(model, prompts[0], answer_length, set()), _answer(model, prompts[1], answer_length, {answer_length - 1})]
    texts = [_greedy_text(model, p, 5) for p in prompts]
    results = score_retrieval(model, TOKENIZER, prompts, answers, texts, max_new_tokens=5)
    assert [r["generated"] for r in results] == texts
    assert [r["greedy"] for r in results] == [True, True]
    assert [r["teacher_forced"] for r in results] == [True, False]
    assert [r["answer_token_accuracy"] for r in results] == [1.0, 1.0 - 1.0 / answer_length]


def test_default_and_minimum_number_of_generated_tokens(model):
    prompt = _prompts(1)[0]
    answer = _answer(model, prompt, 3, set())
    assert len(score_retrieval(model, TOKENIZER, [prompt], [answer], ["0"])[0]["generated"]) == 12  # the default
    # Never fewer tokens than the answer has.
    assert len(score_retrieval(model, TOKENIZER, [prompt], [answer], ["0"], max_new_tokens=1)[0]["generated"]) == 3


def test_grouped_scoring_returns_results_in_input_order(model):
    prompts = _prompts(3) + _prompts(1, length=30)
    answers = [_answer(model, prompts[0], 2, set()), _answer(model, prompts[1], 3, {1}), _answer(model, prompts[2], 2, {0}),
               _answer(model, prompts[3], 2, set())]
    items = [(p, a, "0") for p, a in zip(prompts, answers)]
    results = score_retrieval_grouped(model, TOKENIZER, items, generate=False)
    assert [r["answer_token_accuracy"] for r in results] == pytest.approx([1.0, 2 / 3, 0.5, 1.0])


def test_unequal_lengths_in_one_batch_are_refused(model):
    with pytest.raises(ValueError, match="one length"):
        score_retrieval(model, TOKENIZER, [[5, 6, 7], [5, 6]], [[1], [1]], ["1", "1"])
    with pytest.raises(ValueError, match="one length"):
        score_retrieval(model, TOKENIZER, [[5, 6], [5, 6]], [[1], [1, 2]], ["1", "1"])
