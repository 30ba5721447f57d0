"""One runner per task of the suite, each turning rows into cells: perplexity, passkey and needle through
:mod:`hf_posext.evaluation` (resumable per window and trial, into ``OUT/tasks``), and the chat endings. The RULER
runner, which needs lm-evaluation-harness, is :mod:`hf_posext.integrations.lm_eval.ruler`.

Runners are handed the rows and the settings, and hand cells back: they never write the card themselves (a
callback, ``done``, gets the cells so far where a run writes its partial card).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from hf_posext.api import patch, unpatch
from hf_posext.card.rows import as_request
from hf_posext.card.settings import CardSettings
from hf_posext.card.spec import ENDING_BUDGET, ModelSpec, Row
from hf_posext.card.stats import Cell, perplexity_cell_fields, score_summary, trial_scores
from hf_posext.core.errors import DamagedFileError
from hf_posext.core.files import write_text_atomic

__all__ = ["EVALUATION_TASKS", "DEPTHS", "RUNNERS", "evaluation_cells", "ending_cells", "stored_endings", "ending_sample_key",
           "check_chat_templates"]

#: The tasks run through :mod:`hf_posext.evaluation`, in the order they run.
EVALUATION_TASKS = ("perplexity", "passkey", "needle")
#: Where passkey and needle hide their number: the suite's trials are spread over these.
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def evaluation_cells(rows: Sequence[Row], settings: CardSettings, done: Callable[[list[Cell]], None] | None = None) -> list[Cell]:
    """Perplexity, passkey and needle for every row through hf_posext.evaluation (resumable per segment and trial);
    ``done`` gets the cells so far after each row's task (the card is written then: a run of hours shows them, and
    a run stopped later keeps them on its card)."""
    from hf_posext.evaluation.loading import evaluation_dtype, load_model_and_tokenizer

    wanted = [t for t in EVALUATION_TASKS if t in settings.tasks]
    if not wanted:
        return []
    cells: list[Cell] = []
    dtypes = {task: evaluation_dtype(settings.dtype, task, settings.device) for task in wanted}
    for spec in dict.fromkeys(row.spec for row in rows):
        for dtype in dict.fromkeys(dtypes.values()):
            model, tokenizer = load_model_and_tokenizer(spec.model, dtype=dtype, device=settings.device, adapter=spec.adapter)
            for row in (r for r in rows if r.spec == spec):
                for task in (t for t in wanted if dtypes[t] == dtype):
                    cells += _row_task_cells(task, row, model, tokenizer, dtype, settings)
                    if done is not None:
                        done(list(cells))
            del model
            gc.collect()
    return cells


def _trials(settings: CardSettings) -> int:
    """Trials at each depth: the suite's samples spread over :data:`DEPTHS`."""
    return max(1, math.ceil(settings.trials / len(DEPTHS)))


def _perplexity(model: Any, tokenizer: Any, settings: CardSettings, common: dict[str, Any]) -> Any:
    """Perplexity over at most 8 windows of ``settings.data`` a length."""
    from hf_posext.evaluation import perplexity

    return perplexity.evaluate_perplexity(model, tokenizer, data=settings.data, max_segments=min(8, settings.trials), **common)


def _passkey(model: Any, tokenizer: Any, settings: CardSettings, common: dict[str, Any]) -> Any:
    """Passkey retrieval: the suite's trials spread over :data:`DEPTHS`, from its seed."""
    from hf_posext.evaluation import passkey

    return passkey.evaluate_passkey(model, tokenizer, depths=DEPTHS, trials=_trials(settings), seed=settings.seed, **common)


def _needle(model: Any, tokenizer: Any, settings: CardSettings, common: dict[str, Any]) -> Any:
    """A needle in ``settings.haystack``: the suite's trials spread over :data:`DEPTHS`, from its seed."""
    from hf_posext.evaluation import needle

    return needle.evaluate_needle(model, tokenizer, haystack=settings.haystack, depths=DEPTHS, trials=_trials(settings),
                                  seed=settings.seed, **common)


#: One runner per task run through :mod:`hf_posext.evaluation`: ``(model, tokenizer, settings, common) -> results store``.
RUNNERS: dict[str, Callable[[Any, Any, CardSettings, dict[str, Any]], Any]] = {
    "perplexity": _perplexity, "passkey": _passkey, "needle": _needle,
}


def _row_task_cells(task: str, row: Row, model: Any, tokenizer: Any, dtype: str, settings: CardSettings) -> list[Cell]:
    """One row's cells of ``task`` at every length, run (or resumed) through its runner (:data:`RUNNERS`)."""
    request = row.request or as_request(row.report)
    common = dict(methods=[request], lengths=list(settings.lengths), factor=request.factor, out_dir=settings.out / "tasks",
                  model_name=row.spec.key, extra_config={"dtype": dtype}, progress=settings.progress)
    store = RUNNERS[task](model, tokenizer, settings, common)
    prefix = f"{request.label}|factor={request.factor:g}|"
    records = {cid: r for cid, r in store.cells.items() if cid.startswith(prefix)}
    cells = []
    for length in settings.lengths:
        at = {cid: r for cid, r in records.items() if r["length"] == length}
        if not at:
            continue
        base: Cell = {"task": task, "kind": task, "row": row.label, "row_index": row.index, "length": length,
                      "base": row.base, "in_window": length <= row.window, "source": str(store.path)}
        if task == "perplexity":
            ((cell_id, record),) = at.items()
            cells.append({**base, "n": record.get("windows") or record.get("segments") or 1, "mean": record["ppl"],
                          "low": None, "high": None, "text": f"{record['ppl']:.2f}", "cell_id": cell_id,
                          **perplexity_cell_fields(store.data, length, cell_id)})
        else:
            cells.append({**base, **_trial_fields(task, length, list(at.values()), settings)})
    return cells


def _trial_fields(task: str, length: int, records: list[dict[str, Any]], settings: CardSettings) -> dict[str, Any]:
    """A passkey or needle cell's numbers: its trials pooled over the depths, and each trial's outcome for pairing."""
    from hf_posext.evaluation.proportions import pooled_proportion

    pooled = pooled_proportion(records, "greedy_accuracy") or pooled_proportion(records, "teacher_forced_accuracy")
    low, high = pooled.interval
    trial_key = {"task": task, "length": length, "seed": settings.seed, "depths": list(DEPTHS), "trials": _trials(settings),
                 **({"haystack": str(settings.haystack)} if task == "needle" else {})}
    return {"n": pooled.trials, "k": pooled.successes, "mean": pooled.rate, "low": low, "high": high, "text": pooled.text(),
            "sample_key": trial_key, "scores": trial_scores(records)}


# ------------------------------------------------------------------ chat endings


def stored_endings(path: Path, model: str, dtype: str, instructions: tuple[str, ...] | list[str]) -> list[dict[str, Any]] | None:
    """A row's chat-ending records from an earlier run, when ``path`` holds them for the same model, dtype,
    budget (:data:`ENDING_BUDGET`) and instructions in the same order; None when there is no such file, or it holds
    another model's, dtype's, budget's or instruction set's (then the row is answered again and the file replaced).

    Raises:
        DamagedFileError: ``path`` is not a readable ending results file (named, never reused).
    """
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        records = data["records"]
        asked = [record["instruction"] for record in records]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise DamagedFileError(f"chat-ending results {path} are not readable ({type(error).__name__}); delete the file to "
                               "answer the instructions again.") from None
    same = (data.get("model"), data.get("dtype"), data.get("budget")) == (model, dtype, ENDING_BUDGET)
    return records if same and asked == list(instructions) else None


def ending_sample_key(instructions: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """What makes two rows' chat endings comparable answer by answer: the same instructions and budget."""
    digest = hashlib.sha1(json.dumps(list(instructions)).encode()).hexdigest()[:16]
    return {"instructions": digest, "count": len(instructions), "budget": ENDING_BUDGET}


def ending_cells(rows: Sequence[Row], settings: CardSettings, skipped: list[dict[str, str]]) -> list[Cell]:
    """The short-context row: each row's answers to a few chat-formatted instructions, and whether they end
    with the end-of-turn token within :data:`~hf_posext.card.spec.ENDING_BUDGET` tokens (where the original model's
    end). A row whose results file holds its answers to the same instructions (:func:`stored_endings`) is read back,
    not run again. A row that cannot run is appended to ``skipped``.

    Raises:
        ValueError: a row's window is too short for an answer, without ``skip_over_window``.
    """
    from hf_posext.evaluation.ending import INSTRUCTIONS, chat_prompt, ended_like
    from hf_posext.evaluation.loading import evaluation_dtype, load_model_and_tokenizer

    dtype = evaluation_dtype(settings.dtype, "ending", settings.device)
    cells: list[Cell] = []
    records_by_row: dict[str, list[dict[str, Any]]] = {}
    reference: list[dict[str, Any]] | None = None
    for spec in dict.fromkeys(row.spec for row in rows):
        model, tokenizer = load_model_and_tokenizer(spec.model, dtype=dtype, device=settings.device, adapter=spec.adapter)
        try:
            longest = max(len(chat_prompt(tokenizer, instruction)) for instruction in INSTRUCTIONS)
        except ValueError as error:
            skipped.append({"what": f"{spec.name}: ending", "reason": str(error)})
            continue
        length = 1 << (longest + ENDING_BUDGET - 1).bit_length()
        for row in (r for r in rows if r.spec == spec):
            if not _ending_fits(row, longest, settings, skipped):
                continue
            records = _row_endings(row, model, tokenizer, dtype, settings)
            if row.base and reference is None:
                reference = records
            records_by_row[row.label] = records
            cells.append(_ending_cell(row, length, records, settings.out / "tasks" / _ending_file(row, dtype, settings)))
        del model
        gc.collect()
    for cell in cells:
        if reference is not None:
            cell.update(ended_like(records_by_row[cell["row"]], reference))
            cell["text"] += (f"; {cell['also_ended']}/{cell['reference_ended']} where the base model's end; "
                             f"{cell['mean_generated_tokens']:.0f} tokens an answer")
    return cells


def _ending_fits(row: Row, longest: int, settings: CardSettings, skipped: list[dict[str, str]]) -> bool:
    """Whether an answer fits ``row``'s window; where not, listed as skipped (or refused without skip_over_window)."""
    if longest + ENDING_BUDGET <= row.window:
        return True
    # no answer fits: 0/48 would read as "never ends its turn"
    reason = f"prompt {longest} + {ENDING_BUDGET} generated tokens = {longest + ENDING_BUDGET} > the model's window {row.window}"
    if not settings.skip_over_window:
        raise ValueError(f"{row.label}: ending: {reason}; scale it (e.g. --methods yarn:factor="
                         f"{math.ceil((longest + ENDING_BUDGET) / row.window * 2) / 2:g}), or pass --skip-over-window.")
    skipped.append({"what": f"{row.label}: ending", "reason": reason})
    return False


def _ending_file(row: Row, dtype: str, settings: CardSettings) -> str:
    return f"ending-{row.results_name(dtype, settings.device)}.json"


def _row_endings(row: Row, model: Any, tokenizer: Any, dtype: str, settings: CardSettings) -> list[dict[str, Any]]:
    """``row``'s chat-ending records: stored by an earlier run, else answered now (patched as the row asks) and stored."""
    from hf_posext.evaluation.ending import INSTRUCTIONS, answer_endings

    path = settings.out / "tasks" / _ending_file(row, dtype, settings)
    records = stored_endings(path, row.spec.key, dtype, INSTRUCTIONS)
    if records is not None:
        return records
    scaled = row.request is not None and row.request.method != "none"
    if scaled:
        patch(model, row.request.method, row.request.factor, **row.request.params_dict)
    try:
        records = answer_endings(model, tokenizer, INSTRUCTIONS, max_new_tokens=ENDING_BUDGET)
    finally:
        if scaled:
            unpatch(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"row": row.label, "model": row.spec.key, "budget": ENDING_BUDGET, "dtype": dtype,
                                        "records": records}, indent=1))
    return records


def _ending_cell(row: Row, length: int, records: list[dict[str, Any]], path: Path) -> Cell:
    from hf_posext.evaluation.ending import INSTRUCTIONS

    scores = [1.0 if r["ended"] else 0.0 for r in records]
    return {"task": "ending", "kind": "ending", "row": row.label, "row_index": row.index, "length": length,
            "base": row.base, "in_window": length <= row.window, "source": str(path),
            "sample_key": ending_sample_key(INSTRUCTIONS), "scores": {str(i): v for i, v in enumerate(scores)},
            "mean_generated_tokens": sum(r["generated_tokens"] for r in records) / len(records), **score_summary(scores)}


def check_chat_templates(specs: Sequence[ModelSpec]) -> None:
    """Refuse a row whose tokenizer's chat template cannot be rendered, before any model loads (a tokenizer without
    one is listed as skipped by the ending task).

    Raises:
        ValueError: a chat template that fails to render (naming the model).
    """
    from hf_posext.evaluation.ending import INSTRUCTIONS, ChatTemplateError, chat_prompt
    from hf_posext.evaluation.loading import is_tiny_model_name
    from hf_posext.models import load_tokenizer

    for spec in dict.fromkeys(specs):
        if is_tiny_model_name(spec.model):
            continue
        try:
            chat_prompt(load_tokenizer(spec.model), INSTRUCTIONS[0])
        except ChatTemplateError as error:
            raise ValueError(f"{spec.model}: {error}") from None
        except ValueError:  # no chat template: the ending task lists the row as skipped
            continue
