"""Needle in a haystack (Kamradt 2023; scored as in RULER, Hsieh et al. 2024), side by side.

The haystack is any text (a folder of .txt/.jsonl/.parquet files, a dataset, or the built-in
``builtin:python-docs``), split into sentences. For a cell (length, depth) the prompt is::

    <haystack sentences, with the needle inserted at the sentence boundary nearest to depth>
    <question>

sized so prompt + ``max_new_tokens`` is exactly the length (haystack sentences are taken from the
start, cycling if the haystack is shorter, which the record notes). The default needle is RULER-style,
``"The special magic number for {key} is: {value}."``, with a seeded random key word and 7-digit value
per (length, depth, trial), and the answer is scored like passkey: greedy first integer, and
teacher-forced argmax of the answer tokens.
"""

from __future__ import annotations

import os
import random
from typing import Any, Sequence

import torch

from hf_posext.core.request import ScalingRequest
from hf_posext.text_sources import encode_text, load_documents, split_sentences
from hf_posext.evaluation.grid import Cell, Unit, run_grid
from hf_posext.evaluation.passkey import refuse_short_lengths, retrieval_metrics
from hf_posext.evaluation.retrieval import score_retrieval_grouped
from hf_posext.evaluation.store import ResultStore
from hf_posext.lm.distributed import Distributed

__all__ = ["NEEDLE", "QUESTION", "KEYS", "Haystack", "draw_needle", "draw_haystack_start", "build_needle_prompt", "evaluate_needle",
           "needle_tokens_needed", "check_needle_lengths"]

NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text? The special magic number for {key} mentioned in the provided text is"
#: Key words for the needle (drawn per trial).
KEYS = ("amber", "harbor", "violet", "granite", "meadow", "copper", "lantern", "orchid", "summit", "willow", "falcon", "cedar")


class Haystack:
    """Haystack sentences, tokenized once.

    Raises:
        ValueError: the source holds no sentence.
    """

    def __init__(self, tokenizer: Any, source: str | os.PathLike | Sequence[str], text_field: str | None = None) -> None:
        documents = [str(d) for d in source] if isinstance(source, (list, tuple)) else load_documents(source, text_field=text_field)
        sentences = [s for document in documents for s in split_sentences(document)]
        if not sentences:
            raise ValueError(f"The haystack {source!r} is empty: it holds no sentence of text. Point --haystack at a folder of .txt files.")
        self.source = "<in-memory documents>" if isinstance(source, (list, tuple)) else str(source)
        self.sentences = sentences
        self.tokens = [encode_text(tokenizer, " " + s if i else s) for i, s in enumerate(sentences)]
        self.total_tokens = sum(map(len, self.tokens))

    def take(self, budget: int, start: int = 0) -> tuple[list[list[int]], bool]:
        """Whole sentences (token ids) from sentence ``start`` on, up to ``budget`` tokens, cycling if needed.

        Returns:
            ``(sentences, cycled)``; ``cycled`` is True when the haystack was shorter than the budget.
        """
        taken: list[list[int]] = []
        used = 0
        count = 0
        cycled = False
        while True:
            sentence = self.tokens[(start + count) % len(self.tokens)]
            if used + len(sentence) > budget:
                break
            taken.append(sentence)
            used += len(sentence)
            count += 1
            if count > len(self.tokens):  # a sentence taken a second time (taking each once is no cycle)
                cycled = True
            if count > 10 * len(self.tokens) + budget:
                break
        return taken, cycled


def draw_needle(seed: int, length: int, depth: float, trial: int) -> tuple[str, str]:
    """(key word, 7-digit value), a pure function of (seed, length, depth, trial)."""
    rng = random.Random(f"needle-{seed}-{length}-{depth}-{trial}")
    return rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))


def draw_haystack_start(seed: int, length: int, depth: float, trial: int, sentences: int) -> int:
    """The haystack sentence a trial's text starts at, a pure function of (seed, length, depth, trial).

    Each trial reads another stretch of the haystack, so that trials differ in their text as well as in
    their needle (and a cell's trials are closer to independent samples).
    """
    return random.Random(f"needle-start-{seed}-{length}-{depth}-{trial}").randrange(sentences)


def build_needle_prompt(tokenizer: Any, haystack: Haystack, total_tokens: int, depth: float, key: str, value: str,
                        start: int = 0) -> tuple[list[int], list[int], dict[str, Any]]:
    """Prompt ids of exactly ``total_tokens`` tokens, answer ids (`` {value}``), and facts about the build.

    The haystack is read from its sentence ``start`` on.

    Raises:
        ValueError: ``total_tokens`` is too short for the needle and question.
    """
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    needle = encode(" " + NEEDLE.format(key=key, value=value))
    question = encode("\n" + QUESTION.format(key=key))
    answer = encode(" " + value)
    budget = total_tokens - len(needle) - len(question)
    if budget <= 0:
        raise ValueError(f"A needle prompt of {total_tokens} tokens cannot hold the needle, the question and one haystack token "
                         f"({len(needle) + len(question) + 1} tokens; the cell's length is the prompt plus the generated tokens); "
                         "check the lengths first with check_needle_lengths.")
    sentences, cycled = haystack.take(budget, start)
    # Insert at the sentence boundary whose token offset is nearest to depth x haystack tokens.
    offsets = [0]
    for sentence in sentences:
        offsets.append(offsets[-1] + len(sentence))
    target = depth * offsets[-1]
    boundary = min(range(len(offsets)), key=lambda i: abs(offsets[i] - target))
    body = [t for s in sentences[:boundary] for t in s] + needle + [t for s in sentences[boundary:] for t in s]
    pad = budget - offsets[-1]
    # Fill the few tokens a whole sentence could not with the start of the next sentence, before the question.
    next_sentence = haystack.tokens[(start + len(sentences)) % len(haystack.tokens)]
    filler = (next_sentence * (pad // max(1, len(next_sentence)) + 1))[:pad]
    prompt = body + filler + question
    assert len(prompt) == total_tokens, (len(prompt), total_tokens)
    info = {"needle_token_offset": offsets[boundary], "haystack_cycled": cycled, "haystack_start": start}
    return prompt, answer, info


def needle_tokens_needed(tokenizer: Any, length: int, depths: Sequence[float], trials: int, seed: int, max_new_tokens: int) -> int:
    """The fewest tokens a needle cell of ``length`` needs: every trial's needle and question with one haystack token,
    plus the ``max_new_tokens`` generated (the needles are those the cells of ``length`` draw)."""
    encode = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    prompts = (draw_needle(seed, length, depth, trial) for depth in depths for trial in range(trials))
    return max(encode(" " + NEEDLE.format(key=key, value=value)) + encode("\n" + QUESTION.format(key=key))
               for key, value in prompts) + 1 + max_new_tokens


def check_needle_lengths(tokenizer: Any, lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int,
                         max_new_tokens: int) -> None:
    """Refuse a length too short for its needle prompts, suggesting one that fits (run before the model loads).

    Raises:
        ValueError: a length below what its prompts need; the message gives a length that fits.
    """
    refuse_short_lengths("needle", lambda length: needle_tokens_needed(tokenizer, length, depths, trials, seed, max_new_tokens),
                         lengths, "the needle, the question and one haystack token", max_new_tokens)


def evaluate_needle(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    haystack: str | os.PathLike | Sequence[str] = "builtin:python-docs",
    methods: Sequence[ScalingRequest],
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 10,
    factor: float | None = None,
    seed: int = 0,
    vary_haystack: bool = True,
    generate: bool = True,
    max_new_tokens: int = 12,
    out_dir: str | os.PathLike = "results",
    model_name: str = "model",
    text_field: str | None = None,
    batch_size: int = 1,
    overwrite: bool = False,
    reuse_identical: bool = True,
    dist: Distributed | None = None,
    progress: bool = True,
    extra_config: dict[str, Any] | None = None,
) -> ResultStore:
    """Needle retrieval accuracy of each method over lengths x depths (x trials).

    Args are as in :func:`hf_posext.evaluation.passkey.evaluate_passkey`, plus ``haystack`` (a text source
    or a list of strings), ``text_field``, and ``vary_haystack``: each trial reads the haystack from its own
    seeded sentence (:func:`draw_haystack_start`; the default), or every trial from the first sentence (the
    format of results written before per-trial starts).

    Returns:
        The :class:`ResultStore`; one record per (method, length, depth).
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}.")
    check_needle_lengths(tokenizer, lengths, depths, trials, seed, max_new_tokens)  # before the haystack is read
    dist = dist or Distributed()
    hay = Haystack(tokenizer, haystack, text_field)
    run_config = {"task": "needle", "model": model_name, "haystack": hay.source, "seed": seed, "generate": generate,
                  "max_new_tokens": max_new_tokens, "needle": NEEDLE, **(extra_config or {})}
    if vary_haystack:
        run_config["haystack_start"] = "per-trial"  # absent: every trial from sentence 0 (older results files)
    store = ResultStore(out_dir, "needle", run_config, overwrite=overwrite, write=dist.is_main)

    def plan(length: int) -> list[Cell]:
        cells = []
        for depth in depths:
            units, cycled = [], False
            for trial in range(trials):
                key, value = draw_needle(seed, length, depth, trial)
                start = draw_haystack_start(seed, length, depth, trial, len(hay.sentences)) if vary_haystack else 0
                prompt, answer, info = build_needle_prompt(tokenizer, hay, length - max_new_tokens, depth, key, value, start)
                cycled = cycled or info["haystack_cycled"]
                units.append(Unit(("needle", length, depth, trial), (prompt, answer, value)))
            cells.append(Cell({"depth": depth}, units, {"haystack_cycled": cycled}))
        return cells

    def evaluate(batch: list[tuple[list[int], list[int], str]]) -> list[dict[str, Any]]:
        results = score_retrieval_grouped(model, tokenizer, batch, max_new_tokens=max_new_tokens, generate=generate)
        return [{**r, "value": b[2]} for r, b in zip(results, batch)]

    return run_grid(
        model=model, methods=methods, lengths=lengths, factor=factor, plan=plan, evaluate=evaluate,
        aggregate=retrieval_metrics, store=store, dist=dist, batch_size=batch_size, reuse_identical=reuse_identical,
        progress=progress, description="needle ", unit_name="trial",
    )
