"""How many tokens a RULER sample may generate, and whether a cell fits its row's window at all.

A sample is generated with a short budget first (:data:`SHORT_BUDGETS`) and again with the task's full budget only
when that could change its score (:func:`needs_full_budget`); once a cell's samples show that starting short costs
more than it saves, its next samples start at the full budget (:func:`first_budget`). The score is the full budget's
either way.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

__all__ = ["SHORT_BUDGETS", "check_length_budget", "needs_full_budget", "first_budget"]


#: Tokens generated per RULER sample before the answer is checked (lm-eval's own budgets: niah 128, vt 30,
#: cwe 120, fwe 50). A sample that uses the whole short budget without scoring 1 is generated again with the
#: task's full budget (:func:`needs_full_budget`), so the score is always the one the full budget gives.
SHORT_BUDGETS = {"niah_single_1": 24, "niah_multikey_2": 24, "niah_multikey_3": 64, "ruler_vt": 30,
                 "ruler_cwe": 120, "ruler_fwe": 50}


def check_length_budget(row: str, task: str, length: int, prompt_tokens: int, max_gen_toks: int, window: int | None,
                        max_length: int) -> str | None:
    """Why a RULER cell cannot run as asked (one line), or None.

    lm-eval truncates the left of a context longer than ``max_length - max_gen_toks`` without a word; a
    model asked past its window (after scaling) reads positions it was never given.
    """
    need = prompt_tokens + max_gen_toks
    if need > max_length:
        return (f"{row}: {task} at {length}: prompt {prompt_tokens} + {max_gen_toks} generated tokens = {need} > the harness's "
                f"max_length {max_length}; lm-eval would cut the prompt's start. Raise --max-length or drop length {length}.")
    if window is not None and need > window:
        return (f"{row}: {task} at {length}: prompt {prompt_tokens} + {max_gen_toks} generated tokens = {need} > the model's "
                f"window {window}; scale it (e.g. --methods yarn:factor={math.ceil(need / window * 2) / 2:g}), "
                f"drop length {length}, or pass --skip-over-window.")
    return None


def needs_full_budget(score: float, generated_tokens: int, budget: int, full_budget: int) -> bool:
    """Whether a sample generated with ``budget`` tokens must be generated again with ``full_budget``.

    Greedy decoding makes the short output a prefix of the full one, and lm-eval's score (every answer
    contained in the output) can only rise as the output grows. So the short output's score is final when
    it already scores 1, or when generation stopped before the budget (an end of sequence or stop string:
    the full budget would stop at the same place).
    """
    return budget < full_budget and score < 1 and generated_tokens >= budget


def first_budget(records: Sequence[dict[str, Any]], short: int, full: int) -> int:
    """The budget to generate a cell's next sample with under ``--budget short``: ``short``, or ``full`` once the
    cell's finished samples show that starting short costs more than it saves.

    Starting short saves ``(full - short)`` decode steps on every sample, and costs a second prefill and ``full``
    decode steps on each sample that must be generated again (:func:`needs_full_budget`). With ``r`` the share
    of the cell's samples generated again so far (Laplace's rule: ``(again + 1) / (n + 2)``), ``p`` the prefill's
    seconds and ``d`` a decode step's (medians over the finished samples), the next sample starts at ``full`` when
    ``r * (p + full * d) > (full - short) * d``. A long prompt's prefill dwarfs the decode steps: on 2 CPU cores
    a 32768-token sample's prefill took about 560 s and 128 decode steps 19 s, so a single sample generated again
    cost more than the short budget saves on 36. The score is the full budget's either way; only time changes.
    Before any sample has finished, ``short``.
    """
    if short >= full:
        return full
    timed = [r for r in records if r.get("timing") and r.get("generated_tokens")]
    if not timed:
        return short
    again = sum(bool(r.get("escalated")) for r in records)
    share = (again + 1) / (len(records) + 2)
    prefill = statistics.median(float(r["timing"]["prefill_s"]) for r in timed)
    step = statistics.median(float(r["timing"]["generate_s"]) / max(1, int(r["generated_tokens"]) - 1) for r in timed)
    return full if share * (prefill + full * step) > (full - short) * step else short

