"""Scoring a prompt whose answer is a number: greedy generation and a teacher-forced check.

Used by passkey and needle. For a batch of equal-length prompts and their answer tokens:

* teacher-forced: with the answer appended, is every answer token the model's argmax? (what a
  one-forward-pass score measures; also the fraction of answer tokens that are argmax);
* greedy: decode ``max_new_tokens`` tokens greedily and compare the first integer in the text with the
  answer.

Both share one prefill of the prompt with a KV cache; dynamic methods are fixed to the length
``prompt + max_new_tokens`` for the whole block (:func:`hf_posext.fixed_length`), as ``generate`` would, so
cached keys and new queries share one rotation.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Sequence

import torch

from hf_posext.api import fixed_length
from hf_posext.lm.scoring import base_model, head_logits

__all__ = ["score_retrieval", "score_retrieval_grouped", "first_integer"]

_INTEGER = re.compile(r"\d+")


def first_integer(text: str) -> str | None:
    """The first run of digits in ``text`` (None when there is none)."""
    match = _INTEGER.search(text)
    return match.group(0) if match else None


def _keep_past(cache: Any) -> None:
    # A sliding-window layer (Gemma 3's local layers) drops the keys that leave its window as tokens arrive, so it
    # could not rewind the answer tokens past it; recording keeps them until the crop (transformers 5.x; a no-op
    # for full-attention layers, and absent where a cache cannot record).
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()


def _drop_last(cache: Any, count: int) -> None:
    # A negative crop removes tokens from the end in transformers 4.57 and 5.x alike.
    if count <= 0:
        return
    if not hasattr(cache, "crop"):
        raise TypeError(f"Cannot rewind a {type(cache).__name__} KV cache; use generate=False.")
    cache.crop(-count)


def _cache_argument(decoder: torch.nn.Module) -> str:
    # transformers 5.x renamed the decoder's ``past_key_values`` argument to ``cache``.
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _returned_cache(output: Any) -> Any:
    return output.get("cache", None) if output.get("cache", None) is not None else output.get("past_key_values")


@torch.no_grad()
def score_retrieval(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    expected: Sequence[str],
    *,
    max_new_tokens: int = 12,
    generate: bool = True,
) -> list[dict[str, Any]]:
    """Score prompts whose correct continuation is ``answers`` (token ids) / ``expected`` (digits).

    Args:
        model: a causal LM.
        tokenizer: decodes the generated tokens.
        prompts: equal-length prompt token ids.
        answers: the answer's token ids per prompt (equal lengths; e.g. `` 48213``).
        expected: the answer as a digit string per prompt.
        max_new_tokens: greedy decoding steps (>= answer length).
        generate: also decode greedily (otherwise only the teacher-forced score).

    Returns:
        One dict per prompt: ``teacher_forced`` (all answer tokens argmax), ``answer_token_accuracy``,
        and with ``generate``: ``greedy`` (first integer == expected) and ``generated`` (text).
    """
    lengths = {len(p) for p in prompts}
    answer_lengths = {len(a) for a in answers}
    if len(lengths) != 1 or len(answer_lengths) != 1:
        raise ValueError("score_retrieval needs prompts of one length and answers of one length per batch.")
    prompt_length, answer_length = lengths.pop(), answer_lengths.pop()
    max_new_tokens = max(max_new_tokens, answer_length)
    decoder = base_model(model)
    device = next(decoder.parameters()).device
    prompt_ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
    answer_ids = torch.tensor([list(a) for a in answers], dtype=torch.long, device=device)
    results: list[dict[str, Any]] = []
    with fixed_length(model, prompt_length + max_new_tokens):
        if not generate:
            # One forward pass over prompt + answer; only the positions predicting the answer get logits.
            ids = torch.cat([prompt_ids, answer_ids[:, :-1]], dim=1)
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            logits = head_logits(model, hidden[:, prompt_length - 1 :])
        else:
            cache_name = _cache_argument(decoder)
            out = decoder(input_ids=prompt_ids, use_cache=True)
            cache = _returned_cache(out)
            first = head_logits(model, out.last_hidden_state[:, -1:])
            if answer_length > 1:
                _keep_past(cache)
                rest = decoder(input_ids=answer_ids[:, :-1], use_cache=True, **{cache_name: cache}).last_hidden_state
                logits = torch.cat([first, head_logits(model, rest)], dim=1)
                _drop_last(cache, answer_length - 1)
            else:
                logits = first
        predicted = logits.argmax(-1).to(answer_ids.device)
        matches = predicted == answer_ids
        for row in range(len(prompts)):
            results.append({
                "teacher_forced": bool(matches[row].all()),
                "answer_token_accuracy": float(matches[row].float().mean()),
            })
        if generate:
            token = first[:, -1].argmax(-1).to(device)
            generated = [token]
            for _ in range(max_new_tokens - 1):
                hidden = decoder(input_ids=token[:, None], use_cache=True, **{cache_name: cache}).last_hidden_state
                token = head_logits(model, hidden[:, -1:])[:, -1].argmax(-1).to(device)
                generated.append(token)
            tokens = torch.stack(generated, dim=1).tolist()
            for row, result in enumerate(results):
                text = tokenizer.decode(tokens[row], skip_special_tokens=True)
                result["generated"] = text
                result["greedy"] = first_integer(text) == expected[row]
    return results


def score_retrieval_grouped(
    model: torch.nn.Module,
    tokenizer: Any,
    items: Sequence[tuple[Sequence[int], Sequence[int], str]],
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`score_retrieval` over ``(prompt, answer, expected)`` items of mixed answer lengths.

    Items are batched by (prompt length, answer length); results come back in input order.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (prompt, answer, _) in enumerate(items):
        groups.setdefault((len(prompt), len(answer)), []).append(index)
    results: list[dict[str, Any] | None] = [None] * len(items)
    for indices in groups.values():
        scored = score_retrieval(
            model, tokenizer, [items[i][0] for i in indices], [items[i][1] for i in indices], [items[i][2] for i in indices], **kwargs
        )
        for index, result in zip(indices, scored):
            results[index] = result
    return results  # type: ignore[return-value]
