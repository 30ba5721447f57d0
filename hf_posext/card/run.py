"""``hf-posext eval suite``: the whole run, as phases: :func:`run_card` takes a :class:`~hf_posext.card.settings.CardSettings`.

1. check the settings against the disk (text sources, folders, requests, chat templates) before anything loads;
2. hold the folder, read its ``card.json`` once (:class:`~hf_posext.card.folder.CardFolder`);
3. build the rows on their models (:func:`~hf_posext.card.rows.card_model_rows`);
4. draw and check every RULER cell (:func:`~hf_posext.integrations.lm_eval.ruler.plan_ruler_cells`);
5. run the task runners (:mod:`hf_posext.card.tasks`, then RULER), writing the partial card as cells come;
6. write the final card and print it.

Control flows one way: this module calls the task runners, which hand cells back; :class:`CardWriter` alone writes
the card.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hf_posext.card.budgets import SHORT_BUDGETS
from hf_posext.card.folder import CardFolder, earlier_card, in_row_order, merged_row_order, write_card
from hf_posext.card.rows import card_model_rows, check_adapter_rows, check_requests
from hf_posext.card.samples import DeferredSampleWrites, SampleCache
from hf_posext.card.settings import CardSettings
from hf_posext.card.spec import RULER_DOWNLOAD_TASKS, RULER_OFFLINE_TASKS, Row, relabelled_rows
from hf_posext.card.stats import Cell
from hf_posext.card.tasks import EVALUATION_TASKS, check_chat_templates, ending_cells, evaluation_cells
from hf_posext.integrations.lm_eval import ruler as ruler_runner

__all__ = ["run_card", "check_settings", "run_in_folder", "CardWriter"]


def run_card(settings: CardSettings) -> int:
    """Run a suite: every row × task × length of ``settings``, into ``settings.out`` (resumable; an earlier card's other
    cells stay on it). Prints the card; returns the exit code (0).

    Raises:
        ValueError: settings that cannot run (named in one line, before any model loads).
        FolderInUseError: another run holds ``settings.out`` or its tasks' results files.
    """
    from hf_posext.core.locks import hold_folder, hold_parts
    from hf_posext.evaluation.loading import transformers_progress_bars
    from hf_posext.evaluation.store import results_part

    started = time.time()
    settings = settings.with_device()
    check_settings(settings)
    # one run writes a card folder at a time: a second would drop the first's newer cells from card.json; and its
    # tasks' results files in OUT/tasks are held as `eval TASK --out OUT/tasks` holds them
    parts = [results_part(task, spec.key) for task in EVALUATION_TASKS if task in settings.tasks for spec in settings.models]
    with hold_folder(settings.out, "--out", "the suite"), hold_parts(settings.out / "tasks", parts, "--out", "the suite"), \
            transformers_progress_bars(settings.progress):
        return run_in_folder(settings, started)


def check_settings(settings: CardSettings) -> None:
    """What can be checked before any model loads: the folders, the text sources, the requests and chat templates.

    Raises:
        ValueError: a bad folder, method, parameter, factor or chat template.
        AdapterMismatchError: an adapter row asking for another base model or scaling than its adapter's.
        FileNotFoundError: a text source that looks like a path but does not exist.
    """
    from hf_posext.core.files import check_output_folder
    from hf_posext.text_sources import check_text_source

    check_output_folder(settings.out, "--out", "the suite")
    if settings.sample_cache:
        check_output_folder(settings.sample_cache, "--sample-cache", "the RULER samples")
    for task, source in (("perplexity", settings.data), ("needle", settings.haystack)):
        if task in settings.tasks:
            check_text_source(source)
    check_requests(settings.models, settings.methods, settings.factor, settings.params)  # named before any model loads
    # an adapter row evaluated at a scaling other than its training's (x8 for x4, or none) computes what nobody trained
    check_adapter_rows(settings.models, settings.methods, settings.factor, settings.params, settings.lengths)
    if "ending" in settings.tasks:
        check_chat_templates(settings.models)


def run_in_folder(settings: CardSettings, started: float) -> int:
    """:func:`run_card` once its settings are checked and its folder is held."""
    from hf_posext.evaluation.loading import dtype_line, evaluation_dtype, resolve_dtype

    earlier = CardFolder.read(settings.out)  # the one read of card.json: a damaged one is named here, not overwritten
    seed_problem = earlier.seed_problem(settings.seed)
    if seed_problem:
        raise ValueError(seed_problem)
    ruler, downloads, skipped = ruler_runner.available_ruler_tasks(settings.tasks)
    rows = card_model_rows(settings.models, settings.lengths, settings.methods, settings.factor, settings.params)
    plans: list[Any] = []
    if ruler:  # RULER samples (drawn once per tokenizer) and every length budget, before any model runs; written once
        # every cell is known to fit (a refused run leaves no samples behind)
        cache = DeferredSampleWrites(SampleCache(settings.sample_cache or settings.out / "ruler-samples"))
        plans = ruler_runner.plan_ruler_cells(rows, ruler, settings, cache, skipped)
        cache.flush()
    # the dtype chosen, and why, once the run is known to go ahead (a refusal stays one line) and before any model
    # loads: a figure is matched with the dtype it was computed in (each RULER task as "ruler")
    ruler_names = {"ruler", *RULER_OFFLINE_TASKS, *RULER_DOWNLOAD_TASKS}
    print(dtype_line(*resolve_dtype(settings.dtype, ["ruler" if task in ruler_names else task for task in settings.tasks],
                                    settings.device)), file=sys.stderr)
    writer = CardWriter(settings, earlier, rows, ruler, downloads, skipped, started)
    cells = evaluation_cells(rows, settings, writer.partial)
    if "ending" in settings.tasks:
        cells.extend(ending_cells(rows, settings, skipped))
    if plans:
        writer.partial(cells)
        for cell in ruler_runner.run_ruler_plans(plans, ruler, settings, evaluation_dtype(settings.dtype, "ruler", settings.device)):
            cells.append(cell)
            writer.partial(cells)  # a long run shows what it has so far
    paths = writer.final(cells)
    print(paths["markdown"].read_text(encoding="utf-8").rstrip("\n"))  # the card.md just written (its comparisons computed once)
    print(f"\ncard: {paths['html']} (+ {paths['json'].name}, {paths['markdown'].name}, plots); {time.time() - started:.0f} s")
    return 0


class CardWriter:
    """Writes one run's card: partial while the run goes on, final at its end.

    The card shows the run's cells; the earlier card's cells the run does not cover (another task, row or length),
    each as its run made it; and, until the run reaches them, the earlier cells it covers, marked unfinished (a long
    run would otherwise show fewer cells than the folder holds for hours). Rows stay where the earlier card had them.

    Args:
        settings: the run's settings.
        earlier: the run's folder as read before anything ran.
        rows: the run's rows.
        ruler: the RULER tasks the run computes.
        downloads: the RULER tasks that need a download it was asked for (this run's word on them replaces an
            earlier one's).
        skipped: what the run skips; runners append to it, and every write shows it.
        started: when the run started (``time.time()``).
    """

    def __init__(self, settings: CardSettings, earlier: CardFolder, rows: Sequence[Row], ruler: Sequence[str],
                 downloads: Sequence[str], skipped: list[dict[str, str]], started: float) -> None:
        self.settings, self.rows, self.ruler, self.skipped, self.started = settings, list(rows), list(ruler), skipped, started
        labels = [row.label for row in rows]
        covered = {(task, row.label, length) for task in [*(t for t in settings.tasks if t != "ruler"), *ruler]
                   for row in rows for length in settings.lengths}
        covered |= {("ending", row.label, None) for row in rows if "ending" in settings.tasks}
        carried, carried_skipped, carried_rows = earlier_card(earlier, labels, covered)
        self.carried_skipped = [item for item in carried_skipped if item.get("what") not in downloads]  # this run's word on them
        # the rows stay where the earlier card had them (a run of some of its rows does not reorder the card)
        self.position = merged_row_order(earlier.row_labels(), labels)
        # a row relabelled since the earlier run (the same model and scaling) resumes that run's samples
        # (Row.sample_path): the cells this run covers are its own now, not an earlier row's to show beside it
        relabelled = relabelled_rows(carried_rows, [{"label": row.label, "model": row.spec.key, "report": row.report} for row in rows])
        self.carried = [cell for cell in carried if not (cell["row"] in relabelled and (
            {(cell["task"], relabelled[cell["row"]], cell["length"]), (cell["task"], relabelled[cell["row"]], None)} & covered))]
        self.carried_rows = [row for row in carried_rows if any(cell["row"] == row.get("label") for cell in self.carried)]
        self.redone = [cell for cell in earlier_card(earlier, labels, set())[0]
                       if cell.get("kind") == "ruler" and (cell["task"], cell["row"], cell["length"]) in covered]

    def _waiting(self, done: Sequence[Cell]) -> list[Cell]:
        have = {(cell["task"], cell["row"], cell["length"]) for cell in done}
        return [{**cell, "running": True, "text": f"{cell['text']}, an earlier run's until this run reaches it"}
                for cell in self.redone if (cell["task"], cell["row"], cell["length"]) not in have]

    def _skipped(self) -> list[dict[str, str]]:
        return self.skipped + [item for item in self.carried_skipped if item not in self.skipped]

    def card_settings(self, partial: bool) -> dict[str, Any]:
        """The settings ``card.json`` keeps (the keys earlier releases wrote: ``samples`` is ``--trials``)."""
        from hf_posext.evaluation.loading import evaluation_dtype

        s = self.settings
        return {"models": [spec.key for spec in s.models], "methods": s.methods, "factor": s.factor, "lengths": list(s.lengths),
                "tasks": list(s.tasks), "samples": s.trials, "seed": s.seed, "budget": s.budget, "dtype": s.dtype,
                "dtypes": {task: evaluation_dtype(s.dtype, "ruler" if task in self.ruler else task, s.device)
                           for task in [*s.tasks, *self.ruler]},  # each RULER task by name ("ruler" names them all)
                "device": s.device, "max_length": s.max_length,
                "rows": [{"label": r.label, "model": r.spec.key, "base": r.base, "report": r.report} for r in self.rows]
                + self.carried_rows,
                "short_budgets": SHORT_BUDGETS, "seconds": round(time.time() - self.started, 1), "partial": partial}

    def partial(self, done: Sequence[Cell]) -> None:
        """Write the card with the cells done so far (and the earlier cells the run has not reached yet)."""
        placed, settings = in_row_order([*done, *self.carried, *self._waiting(done)], self.card_settings(partial=True), self.position)
        write_card(self.settings.out, placed, self._skipped(), settings)

    def final(self, done: Sequence[Cell]) -> dict[str, Path]:
        """Write the finished card; returns its paths (``{"json", "markdown", "html"}``)."""
        placed, settings = in_row_order([*done, *self.carried], self.card_settings(partial=False), self.position)
        return write_card(self.settings.out, placed, self._skipped(), settings)
