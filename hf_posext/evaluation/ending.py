"""Does a model still end its answers? Short instructions in the model's own chat template, answered greedily:
an instruct model ends its turn (the end-of-turn token) long before a small budget.

A long-context fine-tune on raw text and retrieval records can lose that habit: the model answers, then goes on
with whatever its practice text looked like until the budget runs out. That costs generation time and, for a user
of an instruct model, is a regression that no retrieval score shows. :func:`answer_endings` measures it on a
fixed set of everyday instructions (:data:`INSTRUCTIONS`, nothing like the retrieval tasks), and
:func:`ended_like` compares a model's endings with the original model's on the same instructions.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = [
    "ChatTemplateError", "INSTRUCTIONS", "END_OF_TURN_TOKENS", "end_token_ids", "chat_prompt", "answer_endings", "ended_like"]

#: Everyday instructions, each answerable in a sentence or two. 48, not the 16 of before 2026-12-05: on 16, 13 endings
#: against 15 could not be told apart; paired on 48, 9 answers that end in one row only and none in the other give
#: p = 0.004 (the sign test).
INSTRUCTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Give a synonym for the word happy.",
    "Which animal is known for its long neck?",
    "Translate 'thank you' into Spanish.",
    "In one sentence, why do leaves change colour in autumn?",
    "What do bees make?",
    "Suggest a name for a pet goldfish.",
    "How many days are there in a week?",
    "What is the opposite of cold?",
    "Write a short greeting for a birthday card.",
    "Which planet is closest to the Sun?",
    "What is water made of?",
    "Give one tip for sleeping well.",
    "Name a fruit that is yellow.",
    "What is the boiling point of water in Celsius?",
    "Give an example of a mammal that can fly.",
    "What colour do you get by mixing blue and yellow?",
    "Write one sentence about a rainy day.",
    "How many legs does a spider have?",
    "What is the plural of mouse?",
    "Name a musical instrument with strings.",
    "Which season comes after winter?",
    "Suggest a title for a short story about a lost cat.",
    "What is the largest ocean on Earth?",
    "Give a word that rhymes with light.",
    "What do you call a baby dog?",
    "In one sentence, what does a library do?",
    "What is 9 times 3?",
    "Name one vegetable that grows underground.",
    "Which language is spoken in Brazil?",
    "Write a one-line thank-you note to a neighbour.",
    "What is the main ingredient of guacamole?",
    "How many minutes are there in an hour?",
    "Give one reason to drink water every day.",
    "What shape has three sides?",
    "Name a bird that cannot fly.",
    "What is the freezing point of water in Fahrenheit?",
    "Describe the moon in one sentence.",
    "Which instrument has black and white keys?",
    "What do caterpillars turn into?",
    "Give an antonym of early.",
    "Name a popular breakfast food.",
    "What gas do plants take in from the air?",
    "Write a short sentence inviting a friend to lunch.",
    "Which continent is Egypt in?",
)

#: End-of-turn tokens of common chat templates, used where the tokenizer knows them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")


def end_token_ids(tokenizer: Any) -> list[int]:
    """The ids that end a turn: the tokenizer's eos token and the :data:`END_OF_TURN_TOKENS` it has."""
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.update(vocabulary[token] for token in END_OF_TURN_TOKENS if token in vocabulary)
    return sorted(ids)


class ChatTemplateError(ValueError):
    """A tokenizer's chat template that cannot be rendered (a Jinja syntax or runtime error): named, never skipped."""


def chat_prompt(tokenizer: Any, instruction: str) -> list[int]:
    """``instruction`` as one user turn in the tokenizer's chat template, with the assistant's turn opened.

    Raises:
        ValueError: the tokenizer has no chat template (a base model: nothing to end).
        ChatTemplateError: the template is not valid Jinja, or fails on one user turn (the error's first line).
    """
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template, so there is no turn to end; the ending check needs an instruct "
                         "model's tokenizer.")
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True,
                                            tokenize=True)
    except TemplateError as error:
        detail = " ".join(str(error).split())[:160]
        raise ChatTemplateError(f"the tokenizer's chat template is not a valid Jinja template ({type(error).__name__}: "
                                f"{detail}); fix chat_template in its tokenizer_config.json (or chat_template.jinja), or "
                                "leave ending out of --tasks.") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@torch.no_grad()
def answer_endings(model: torch.nn.Module, tokenizer: Any, instructions: Sequence[str] = INSTRUCTIONS, max_new_tokens: int = 64,
                   end_ids: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Greedy answers to ``instructions``; for each, whether it ended with an end-of-turn token within the budget.

    Args:
        model: a causal LM (patched or not).
        tokenizer: its tokenizer, with a chat template.
        instructions: the user turns.
        max_new_tokens: the budget; an answer still going when it runs out did not end.
        end_ids: the ids that end a turn (default :func:`end_token_ids`).

    Returns:
        One record per instruction: ``instruction``, ``response`` (decoded, end token left out),
        ``generated_tokens``, ``ended``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    ends = list(end_ids) if end_ids is not None else end_token_ids(tokenizer)
    if not ends:
        raise ValueError("the tokenizer names no end-of-turn or eos token; pass end_ids.")
    device = next(model.parameters()).device
    records = []
    for instruction in instructions:
        prompt = torch.tensor([chat_prompt(tokenizer, instruction)], device=device)
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=ends, pad_token_id=ends[0])
        new = output[0, prompt.shape[1]:].tolist()
        cut = next((i for i, token in enumerate(new) if token in ends), None)
        answer = new if cut is None else new[:cut]
        records.append({"instruction": instruction, "response": tokenizer.decode(answer, skip_special_tokens=True),
                        "generated_tokens": len(new), "ended": cut is not None})
    return records


def ended_like(records: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> dict[str, int]:
    """``records`` against the reference's (the original model's) on the same instructions, matched by instruction.

    Returns:
        ``reference_ended`` (k: the instructions the reference ended), ``also_ended`` (j <= k: of those, the ones
        ``records`` ended too), and the discordant pairs for a sign test: ``only_reference`` (ended by the
        reference only, k - j) and ``only_here`` (ended here, not by the reference); instructions only one side
        answered are left out.
    """
    ended = {r["instruction"]: bool(r["ended"]) for r in records}
    theirs = {r["instruction"]: bool(r["ended"]) for r in reference}
    wanted = [i for i, done in theirs.items() if done]
    also = sum(ended.get(i, False) for i in wanted)
    return {"reference_ended": len(wanted), "also_ended": also,
            "only_reference": sum(1 for i in wanted if i in ended) - also,
            "only_here": sum(1 for i, done in ended.items() if done and i in theirs and not theirs[i])}
