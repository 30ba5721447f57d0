"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300), side by side.

Prompt (the landmark-attention format): a task description, filler sentences repeated, the passkey
line at a chosen depth of the filler, more filler, then the question::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. (repeated)
    The pass key is 48213. Remember it. 48213 is the pass key.
    The grass is green. ... (repeated)
    What is the pass key? The pass key is

The prompt is built from token ids so that prompt + ``max_new_tokens`` is exactly the cell's length;
the passkey line starts at a filler-sentence-group boundary nearest to ``depth`` (0 = right after the
task description, 1 = just before the question). Passkeys are 5-digit integers drawn from a seeded RNG
per (length, depth, trial), so every method sees the same prompts.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable, Sequence

import torch

from hf_posext.core.request import ScalingRequest
from hf_posext.evaluation.grid import Cell, Unit, run_grid
from hf_posext.evaluation.retrieval import score_retrieval_grouped
from hf_posext.evaluation.store import ResultStore
from hf_posext.lm.distributed import Distributed

__all__ = ["TASK_DESCRIPTION", "FILLER", "passkey_line", "QUESTION", "build_passkey_prompt", "evaluate_passkey", "retrieval_metrics",
           "passkey_tokens_needed", "check_passkey_lengths", "shortest_fitting_length", "refuse_short_lengths"]

TASK_DESCRIPTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def passkey_line(passkey: str) -> str:
    """The line that hides the passkey."""
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key."


def draw_passkey(seed: int, length: int, depth: float, trial: int) -> str:
    """A 5-digit passkey, a pure function of (seed, length, depth, trial)."""
    return str(random.Random(f"passkey-{seed}-{length}-{depth}-{trial}").randint(10000, 99999))


def build_passkey_prompt(tokenizer: Any, total_tokens: int, depth: float, passkey: str) -> tuple[list[int], list[int]]:
    """Token ids of a passkey prompt of exactly ``total_tokens`` tokens, and of the answer `` {passkey}``.

    Raises:
        ValueError: ``total_tokens`` leaves no room for the filler.
    """
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    head = encode(TASK_DESCRIPTION + "\n")
    secret = encode("\n" + passkey_line(passkey) + "\n")
    tail = encode("\n" + QUESTION)
    filler = encode(FILLER)
    answer = encode(" " + passkey)
    bos = getattr(tokenizer, "bos_token_id", None)
    prefix = [bos] if bos is not None and _adds_bos(tokenizer) else []
    room = total_tokens - len(prefix) - len(head) - len(secret) - len(tail)
    if room < len(filler):
        raise ValueError(f"A passkey prompt of {total_tokens} tokens leaves no room for the filler: the prompt needs at least "
                         f"{total_tokens - room + len(filler)} (the cell's length is the prompt plus the generated tokens); "
                         "check the lengths first with check_passkey_lengths.")
    groups = room // len(filler)
    before_groups = round(depth * groups)
    before = filler * before_groups
    after = (filler * (groups - before_groups + 1))[: room - len(before)]
    prompt = prefix + head + before + secret + after + tail
    assert len(prompt) == total_tokens, (len(prompt), total_tokens)
    return prompt, answer


def shortest_fitting_length(needed: Callable[[int], int], length: int) -> int:
    """The first length from ``length`` on, following ``needed``, whose own prompts fit: ``needed(n) <= n``.

    ``needed(n)`` is the tokens the cells of length ``n`` need (their hidden values, drawn per length, can take
    a token more or less), so the length that fits is found by moving up to what each length needs.
    """
    for _ in range(1000):  # needed(n) is bounded (the longest hidden value), so this ends after a few steps
        need = needed(length)
        if need <= length:
            return length
        length = need
    return length


def passkey_tokens_needed(tokenizer: Any, length: int, depths: Sequence[float], trials: int, seed: int,
                          max_new_tokens: int) -> int:
    """The fewest tokens a passkey cell of ``length`` needs: every trial's prompt with one filler group, plus the
    ``max_new_tokens`` generated (the passkeys are those the cells of ``length`` draw)."""
    encode = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    prefix = 1 if getattr(tokenizer, "bos_token_id", None) is not None and _adds_bos(tokenizer) else 0
    fixed = prefix + encode(TASK_DESCRIPTION + "\n") + encode("\n" + QUESTION) + encode(FILLER)
    secret = max(encode("\n" + passkey_line(draw_passkey(seed, length, depth, trial)) + "\n")
                 for depth in depths for trial in range(trials))
    return fixed + secret + max_new_tokens


def check_passkey_lengths(tokenizer: Any, lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int,
                          max_new_tokens: int) -> None:
    """Refuse a length too short for its passkey prompts, suggesting one that fits (run before the model loads).

    Raises:
        ValueError: a length below what its prompts need; the message gives a length that fits.
    """
    refuse_short_lengths("passkey", lambda length: passkey_tokens_needed(tokenizer, length, depths, trials, seed, max_new_tokens),
                         lengths, "the task text, the pass key line, one filler group and the question", max_new_tokens)


def refuse_short_lengths(task: str, needed: Callable[[int], int], lengths: Sequence[int], parts: str,
                         max_new_tokens: int) -> None:
    """Raise for the shortest of ``lengths`` whose ``task`` prompts need more tokens than it has (``needed(n)``,
    generated tokens included; ``parts`` says what the prompt holds), suggesting a length that fits.

    Raises:
        ValueError: a length below what its prompts need; the message gives a length that fits.
    """
    for length in sorted(lengths):
        need = needed(length)
        if need > length:
            raise ValueError(
                f"Length {length} is too short for a {task} prompt: it needs {need} tokens ({parts}: "
                f"{need - max_new_tokens}, plus {max_new_tokens} generated); use a length of at least "
                f"{shortest_fitting_length(needed, need)}, or fewer --max-new-tokens."
            )


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        ids = tokenizer.encode("a", add_special_tokens=True)
    except TypeError:
        return False
    return bool(ids) and ids[0] == bos


def retrieval_metrics(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over trials, greedy (if generated) and teacher-forced, with the counts of correct trials."""
    teacher_forced = sum(bool(r["teacher_forced"]) for r in results)
    metrics: dict[str, Any] = {
        "trials": len(results),
        "teacher_forced_correct": teacher_forced,
        "teacher_forced_accuracy": teacher_forced / len(results),
        "answer_token_accuracy": sum(r["answer_token_accuracy"] for r in results) / len(results),
    }
    if all("greedy" in r for r in results):
        greedy = sum(bool(r["greedy"]) for r in results)
        metrics["greedy_correct"] = greedy
        metrics["greedy_accuracy"] = greedy / len(results)
    return metrics


def evaluate_passkey(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    methods: Sequence[ScalingRequest],
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 10,
    factor: float | None = None,
    seed: int = 0,
    generate: bool = True,
    max_new_tokens: int = 10,
    out_dir: str | os.PathLike = "results",
    model_name: str = "model",
    batch_size: int = 1,
    overwrite: bool = False,
    reuse_identical: bool = True,
    dist: Distributed | None = None,
    progress: bool = True,
    extra_config: dict[str, Any] | None = None,
) -> ResultStore:
    """Passkey accuracy of each method over lengths x depths x trials.

    Args:
        model: the loaded (unpatched) model.
        tokenizer: its tokenizer.
        methods: methods to compare.
        lengths: total tokens per prompt (prompt + ``max_new_tokens``).
        depths: passkey positions, 0 (start) to 1 (end).
        trials: prompts per (length, depth), each with its own passkey (10 x the 5 default depths = 50 per
            length, enough for a 95 % interval of about +-0.1 around a rate near 0.9).
        factor: scale factor (None: longest length / original window).
        seed: passkey RNG seed.
        generate: also score greedy generation (otherwise teacher-forced only: one forward per trial).
        max_new_tokens: greedy decoding steps.
        out_dir: results folder.
        model_name: the model's name in the results.
        batch_size: prompts per forward.
        overwrite: recompute finished cells.
        reuse_identical: reuse results between methods computing the same function at a length.
        dist: process group.
        progress: show progress bars (``--no-progress`` turns them off).
        extra_config: more run-config entries.

    Returns:
        The :class:`ResultStore`; one record per (method, length, depth) with ``teacher_forced_accuracy``,
        ``greedy_accuracy`` (if generated), ``answer_token_accuracy``, ``trials``.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}.")
    check_passkey_lengths(tokenizer, lengths, depths, trials, seed, max_new_tokens)  # before any results file
    dist = dist or Distributed()
    run_config = {"task": "passkey", "model": model_name, "seed": seed, "generate": generate, "max_new_tokens": max_new_tokens,
                  "format": "landmark-attention", **(extra_config or {})}
    store = ResultStore(out_dir, "passkey", run_config, overwrite=overwrite, write=dist.is_main)

    def plan(length: int) -> list[Cell]:
        cells = []
        for depth in depths:
            units = []
            for trial in range(trials):
                key = draw_passkey(seed, length, depth, trial)
                prompt, answer = build_passkey_prompt(tokenizer, length - max_new_tokens, depth, key)
                units.append(Unit(("passkey", length, depth, trial), (prompt, answer, key)))
            cells.append(Cell({"depth": depth}, units))
        return cells

    def evaluate(batch: list[tuple[list[int], list[int], str]]) -> list[dict[str, Any]]:
        results = score_retrieval_grouped(model, tokenizer, batch, max_new_tokens=max_new_tokens, generate=generate)
        return [{**r, "passkey": b[2]} for r, b in zip(results, batch)]

    return run_grid(
        model=model, methods=methods, lengths=lengths, factor=factor, plan=plan, evaluate=evaluate,
        aggregate=retrieval_metrics, store=store, dist=dist, batch_size=batch_size, reuse_identical=reuse_identical,
        progress=progress, description="passkey ", unit_name="trial",
    )
