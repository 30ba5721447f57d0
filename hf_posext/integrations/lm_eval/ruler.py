"""The suite's RULER runner: perplexity's and passkey's sibling that needs lm-evaluation-harness.

RULER runs through lm-eval's own task objects (templates, ``gen_prefix``, generation settings, scoring) and
the ``hf-posext`` harness model, one sample at a time so that a killed run resumes where it stopped:

1. samples are generated once per (task, tokenizer hash, length, seed) with lm-eval's generators (the first
   ``n`` of them: the generators draw sample after sample from one seeded RNG, so the first ``n`` do not depend
   on how many are drawn) and cached (:class:`~hf_posext.card.samples.SampleCache`); every row with that
   tokenizer reads the same samples, and the key is written to every results file;
2. before any model runs, every (row, task, length) is checked (:func:`plan_ruler_cells`): prompt + generation must
   fit the harness's ``max_length`` and the row's window after scaling, else the run is refused in one line;
3. each sample's response, score and timings (prefill, generation, harness overhead) go to one JSON-lines
   file per (row, task, length) (:class:`~hf_posext.card.samples.SampleResults`), and each finished cell is
   handed back to the suite (:func:`run_ruler_plans`), which writes the card.

Control flows one way: :mod:`hf_posext.card.run` calls this module; this module uses the suite's vocabulary
(rows, samples, budgets, cells) and never calls back into the run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from hf_posext.card.budgets import SHORT_BUDGETS, check_length_budget, first_budget, needs_full_budget
from hf_posext.card.rows import tokenizer_path
from hf_posext.card.samples import SampleCache, SampleResults, sample_cache_key, tokenizer_hash
from hf_posext.card.settings import CardSettings
from hf_posext.card.spec import AS_SAVED, RULER_DOWNLOAD_TASKS, Row, ruler_tasks
from hf_posext.card.stats import Cell, ruler_cell_fields
from hf_posext.integrations.lm_eval.launcher import import_harness

__all__ = ["import_ruler_generators", "limit_ruler_samples", "download_problem", "forget_downloads", "ruler_docs", "ruler_task",
           "ForwardTimer", "device_synchronizer", "run_ruler_cell", "RulerPlan", "available_ruler_tasks", "plan_ruler_cells",
           "run_ruler_plans"]


# ------------------------------------------------------------------ RULER samples


#: The generator functions lm-eval's RULER datasets call with ``num_samples=500`` (niah, vt, cwe, fwe).
_GENERATORS = ("generate_samples", "sys_vartrack_w_noise_random", "sys_word_pair_random", "sys_kwext")


def import_ruler_generators() -> None:
    """Import lm-eval's RULER generator modules. Their first import draws from ``random``: done before the
    seed is set, the samples do not depend on whether this process generated others before.

    The first import also tries to download nltk's ``punkt_tab`` (only the essay-haystack tasks use it) and then
    prints "Downloaded punkt_tab on rank 0" whether or not it could; offline that was four lines of nltk errors
    and a false claim in every card log. Those lines are dropped (the essay tasks' check says whether punkt_tab
    is there, :func:`download_problem`); anything else the import prints is passed on.
    """
    names = ("common_utils", "cwe_utils", "fwe_utils", "niah_utils", "prepare_niah", "vt_utils")
    if all(f"lm_eval.tasks.ruler.{name}" in sys.modules for name in names):
        return
    import nltk

    printed, errors = io.StringIO(), io.StringIO()
    download = nltk.download

    def quiet_download(*args: Any, **kwargs: Any) -> Any:  # nltk prints its errors to the stderr of its import time
        return download(*args, **{"quiet": True, "print_error_to": errors, **kwargs})

    nltk.download = quiet_download
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            from lm_eval.tasks.ruler import common_utils, cwe_utils, fwe_utils, niah_utils, prepare_niah, vt_utils  # noqa: F401
    finally:
        nltk.download = download
    for text, stream in ((printed.getvalue(), sys.stdout), (errors.getvalue(), sys.stderr)):
        kept = [line for line in text.splitlines(keepends=True)
                if not line.startswith("[nltk_data]") and line.strip() != "Downloaded punkt_tab on rank 0"]
        stream.write("".join(kept))


def limit_ruler_samples(dataset: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``dataset`` (a task's ``custom_dataset``) drawing ``n`` samples instead of 500.

    lm-eval runs a task file's ``!function`` module afresh for each task it loads, so the generator is
    replaced in that copy's globals, the ones ``dataset`` calls; the generators draw their samples in turn
    from the global RNG, so the first ``n`` are those of a 500-sample draw.

    Raises:
        RuntimeError: ``dataset`` calls none of the known generators (an lm-eval release that renamed them:
            fail loudly rather than silently draw 500 samples of a 32768-token task, minutes each).
    """
    names = [name for name in _GENERATORS if callable(dataset.__globals__.get(name))]
    if not names:
        raise RuntimeError(f"{dataset.__module__}.{dataset.__name__} calls none of lm-eval's RULER generators "
                           f"({', '.join(_GENERATORS)}); this lm-eval release is not supported by hf-posext's card.")

    def limited(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, num_samples: int = 500, **kwargs: Any) -> Any:
            return function(*args, num_samples=min(num_samples, n), **kwargs)
        return wrapper

    @functools.wraps(dataset)
    def run(**kwargs: Any) -> Any:
        scope = dataset.__globals__
        saved = {name: scope[name] for name in names}
        try:
            scope.update({name: limited(function) for name, function in saved.items()})
            return dataset(**kwargs)
        finally:
            scope.update(saved)
    return run


#: What each RULER task that needs a download fetches, as lm-eval's own loader in the task's module: the loader
#: caches what it fetched, so the samples drawn next use the same copy (the keyword form is the one the tasks use).
_DOWNLOAD_LOADERS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: ("get_haystack", {"type_haystack": "essay"}) for name in
       ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue")},
    "ruler_qa_squad": ("read_squad", {}),
    "ruler_qa_hotpot": ("read_hotpotqa", {}),
}
#: Loaders that fetch from the Hugging Face hub with ``requests``, which ignores ``HF_HUB_OFFLINE``.
_HUB_BY_REQUESTS = {"read_hotpotqa"}


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


@functools.lru_cache(maxsize=None)
def _fetch_problem(task_name: str, loader: str) -> str | None:
    """None once ``loader`` of ``task_name``'s module has fetched its data (or found it cached), else why not."""
    if loader in _HUB_BY_REQUESTS and _hub_offline():
        return "HF_HUB_OFFLINE is set"
    function = _task_config(task_name)["custom_dataset"].__globals__.get(loader)
    if not callable(function):
        raise RuntimeError(f"lm-eval's {task_name} module has no {loader}(); this lm-eval release is not supported by "
                           "hf-posext's card.")
    try:
        function(**_DOWNLOAD_LOADERS[task_name][1])
    except Exception as error:  # a network, hub or HTTP error: the task is listed as skipped with it
        text = " ".join(f"{type(error).__name__}: {error}".split())
        return text if len(text) <= 200 else text[:197] + "..."
    if loader == "get_haystack":  # the essay haystack is cut into sentences with nltk's punkt_tab (a download too)
        import nltk

        try:
            nltk.data.find("tokenizers/punkt_tab")
        except LookupError:
            return ("nltk's punkt_tab sentence data is not installed, and lm-eval could not download it: "
                    "python -m nltk.downloader punkt_tab")
    return None


def forget_downloads() -> None:
    """Forget what this process fetched, or failed to fetch, for the download tasks (lm-eval's loaders' copies
    included): the next :func:`download_problem` tries again, e.g. once the network is back."""
    _fetch_problem.cache_clear()
    for task_name, (loader, _) in _DOWNLOAD_LOADERS.items():
        scope = _task_config(task_name)["custom_dataset"].__globals__
        for name in (loader, "download_json"):
            if hasattr(scope.get(name), "cache_clear"):
                scope[name].cache_clear()


def download_problem(task_name: str) -> str | None:
    """Whether the RULER task ``task_name``, which needs a download, can run here: None once its data is fetched
    (from the network, or lm-eval's or datasets' cache), else one line for the card's skipped list.

    The data is fetched by lm-eval's own loader, the one its sample generator calls, so a task that passes runs on
    the copy fetched here. Each source is tried once per process.
    """
    loader, _ = _DOWNLOAD_LOADERS[task_name]
    problem = _fetch_problem(task_name if loader != "get_haystack" else "niah_single_2", loader)
    if problem is None:
        return None
    return f"needs a download ({RULER_DOWNLOAD_TASKS[task_name]}), which failed here ({problem}); it runs where that can be fetched"


def _ruler_folder() -> str:
    import lm_eval.tasks

    return str(Path(lm_eval.tasks.__file__).parent / "ruler")


@functools.lru_cache(maxsize=None)
def _task_manager(tokenizer_path: str, length: int):
    from lm_eval.tasks import TaskManager

    # Only RULER's folder: indexing the harness's ~15k tasks takes many seconds.
    return TaskManager(include_path=_ruler_folder(), include_defaults=False,
                       metadata={"pretrained": tokenizer_path, "tokenizer": tokenizer_path, "max_seq_lengths": [int(length)]})


def _generator_version() -> str:
    import lm_eval

    return getattr(lm_eval, "__version__", "unknown")


def _task_version(task_name: str) -> Any:
    entry = _index().task_index[task_name]
    return (entry.cfg.get("metadata") or {}).get("version")


@functools.lru_cache(maxsize=1)
def _index():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=_ruler_folder(), include_defaults=False)


def ruler_docs(task_name: str, tokenizer_path: str, tokenizer: Any, length: int, n: int, seed: int,
               cache: SampleCache, progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The first ``n`` samples of a RULER task at ``length``, from the cache or generated (and cached).

    Without ``progress``, lm-eval's generators draw no bar.

    Returns:
        ``(docs, key)``.

    Raises:
        ValueError: lm-eval generates fewer than ``n`` samples at this length.
    """
    key = sample_cache_key(task_name, _task_version(task_name), tokenizer_hash(tokenizer), length, seed, _generator_version())
    docs = cache.get(key, n)
    if docs is not None:
        return docs, key
    import numpy as np

    import_ruler_generators()
    manager = _task_manager(tokenizer_path, length)
    random.seed(seed)
    np.random.seed(seed)
    config = _task_config(task_name)
    config["custom_dataset"] = limit_ruler_samples(config["custom_dataset"], n)
    with _harness_bars(progress):
        task = _load_task(manager, config)
        docs = [dict(doc) for doc in task.eval_docs][:n]
    if len(docs) < n or any(not doc.get("outputs") for doc in docs):
        raise ValueError(f"lm-eval's {task_name} generator gives {len(docs)} usable samples at length {length}, fewer than the "
                         f"{n} asked; use a longer length (the prompt template and answers leave too little room).")
    stored = cache.stored(key)
    if stored and docs[: len(stored)] != stored:  # the generator is not reproducible: never mix two sample sets
        raise ValueError(f"lm-eval's {task_name} samples at {length} differ from the cached {cache.path(key)}; delete it.")
    cache.put(key, docs)
    return docs, key


#: lm-eval's note, at every RULER task it builds, that lengths may be passed with ``--metadata``: the card passes them
#: itself (``--lengths``), so in a card's log the note only misleads.
_METADATA_NOTE = "Custom kwargs can be passed to `--metadata`"


class _DropMetadataNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _METADATA_NOTE not in str(record.msg)


def _load_task(manager: Any, config: dict[str, Any]) -> Any:
    """lm-eval's task for ``config``, built without its ``--metadata`` note (other messages pass)."""
    task_logger, dropping = logging.getLogger("lm_eval.api.task"), _DropMetadataNote()
    task_logger.addFilter(dropping)
    try:
        return next(iter(manager.load_task_or_group([config]).values()))
    finally:
        task_logger.removeFilter(dropping)


def _task_config(task_name: str) -> dict[str, Any]:
    """lm-eval's YAML config of ``task_name``, its functions resolved, as a task of its own (no group tag)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(_index().task_index[task_name].yaml_path, resolve_func=True)
    config.pop("tag", None)
    config["task"] = task_name
    return config


def ruler_task(task_name: str, docs: list[dict[str, Any]], tokenizer_path: str, length: int):
    """lm-eval's own task object for ``task_name`` (its YAML: template, generation settings, scoring) on ``docs``."""
    import datasets

    config = _task_config(task_name)
    config["custom_dataset"] = lambda **_: {"test": datasets.Dataset.from_list(docs)}
    return _load_task(_task_manager(tokenizer_path, length), config)


# ------------------------------------------------------------------ running RULER samples


class ForwardTimer:
    """Times the model's forward calls: the first of a generate call is the prefill, the rest are decoding.

    On CUDA a forward returns once its kernels are queued, so each call is timed between two synchronizations:
    without them a prefill of asynchronous kernels (SDPA) read as its launch time and its work was counted in
    the first decode step, while one that waits for its results on the way (STRING's blocks) read in full.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, float]] = []
        self._start = 0.0
        self._synchronize = device_synchronizer(model)
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        self._synchronize()
        self._start = time.perf_counter()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._tokens = int(ids.shape[-1]) if ids is not None else 0

    def _post(self, module, args, kwargs, output):
        self._synchronize()
        self.calls.append((self._tokens, time.perf_counter() - self._start))

    def reset(self) -> None:
        self.calls = []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def device_synchronizer(model: torch.nn.Module) -> Callable[[], None]:
    """A call that waits for ``model``'s device to finish its queued work (nothing to wait for on the CPU)."""
    devices = sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)

    def synchronize() -> None:
        for device in devices:  # a model spread over several GPUs (device_map) waits for each
            torch.cuda.synchronize(device)
    return synchronize


def _generate(lm: Any, timer: ForwardTimer, context: str, gen_kwargs: dict[str, Any], budget: int) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    timer.reset()
    started = time.perf_counter()
    request = Instance("generate_until", {}, (context, {**gen_kwargs, "max_gen_toks": budget}), 0)
    response = lm.generate_until([request], disable_tqdm=True)[0]
    total = time.perf_counter() - started
    prefill = timer.calls[0][1] if timer.calls else 0.0
    decode = sum(seconds for _, seconds in timer.calls[1:])
    return {"response": response, "generated_tokens": len(timer.calls), "prefill_s": prefill, "generate_s": decode,
            "harness_s": max(0.0, total - prefill - decode), "total_s": total}


#: lm-eval modules that draw a progress bar through their own ``tqdm`` name and take no switch for it: building a
#: task's requests, and RULER's sample generators.
_BAR_MODULES = ("lm_eval.api.task", "lm_eval.tasks.ruler.prepare_niah", "lm_eval.tasks.ruler.cwe_utils",
                "lm_eval.tasks.ruler.fwe_utils", "lm_eval.tasks.ruler.vt_utils", "lm_eval.tasks.ruler.qa_utils")


@contextlib.contextmanager
def _harness_bars(progress: bool):
    """Without ``progress`` (``--no-progress``), turn off the bars lm-eval draws while it builds requests and RULER samples.

    Those calls take no switch for it: each calls the ``tqdm`` of its own module, so this swaps that name for a
    disabled bar while the block runs, in each module of ``_BAR_MODULES`` already imported that has one (a later
    lm-eval without it draws nothing this could turn off).
    """
    swapped = []
    if not progress:
        for name in _BAR_MODULES:
            module = sys.modules.get(name)
            bar = getattr(module, "tqdm", None)
            if callable(bar):
                swapped.append((module, bar))
                module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for module, bar in swapped:
            module.tqdm = bar


def run_ruler_cell(lm: Any, task: Any, docs: list[dict[str, Any]], length: int, results: SampleResults,
                   budget_mode: str = "short", progress: bool = False, label: str = "") -> list[float]:
    """Score every sample of one (row, task, length) not yet in ``results``; returns every sample's score.

    Each sample is generated with lm-eval's request (context, generation settings) for that doc, scored with
    the task's own ``process_results``, and appended to ``results`` with its timings. With ``progress`` a bar
    counts the samples; without (``--no-progress``, a run in the background) each finished sample is one line on
    stderr, so that the run's log shows how far it is.
    """
    from tqdm.auto import tqdm

    task_name = task.config.task
    with _harness_bars(progress):
        task.build_all_requests(limit=None, rank=0, world_size=1)
    pending = [i for i in sorted(task.instances, key=lambda i: i.doc_id) if not results.has(i.doc_id)]
    where = f"{task_name} @ {length}" + (f", {label}" if label else "")
    timer = ForwardTimer(lm.model)
    bar = tqdm(total=len(pending), desc=where, leave=False, disable=not progress)
    try:
        for done, instance in enumerate(pending, start=1):
            context, gen_kwargs = instance.args
            full = int(gen_kwargs.get("max_gen_toks", lm.max_gen_toks))
            short = min(full, SHORT_BUDGETS.get(task_name, full))
            # short, until the cell's samples show that generating again costs more than starting short saves
            budget = first_budget(list(results.records.values()), short, full) if budget_mode == "short" else full
            run = _generate(lm, timer, context, gen_kwargs, budget)
            score = float(task.process_results(instance.doc, [run["response"]])[str(length)])
            record = {"doc_id": instance.doc_id, "score": score, "response": run["response"], "budget": budget,
                      "full_budget": full, "generated_tokens": run["generated_tokens"], "escalated": False,
                      "prompt_tokens": len(lm.tok_encode(context)), "timing": {k: round(v, 4) for k, v in run.items() if k.endswith("_s")}}
            if needs_full_budget(score, run["generated_tokens"], budget, full):
                again = _generate(lm, timer, context, gen_kwargs, full)
                score = float(task.process_results(instance.doc, [again["response"]])[str(length)])
                record.update(score=score, response=again["response"], generated_tokens=again["generated_tokens"], escalated=True,
                              timing_full={k: round(v, 4) for k, v in again.items() if k.endswith("_s")})
            results.add(record)
            bar.update(1)
            if not progress:
                seconds = record["timing"].get("total_s", 0.0) + record.get("timing_full", {}).get("total_s", 0.0)
                print(f"{where}: sample {instance.doc_id} scored {score:.2f} in {seconds:.0f} s ({done} of {len(pending)} "
                      "to run)", file=sys.stderr, flush=True)
    finally:
        bar.close()
        timer.remove()
    return results.scores(range(len(docs)))


# ------------------------------------------------------------------ a suite's RULER cells


@dataclass
class RulerPlan:
    """One RULER cell a suite runs: its row, task, length and samples (checked to fit, :func:`plan_ruler_cells`)."""

    row: Row
    task: str
    length: int
    docs: list[dict[str, Any]]
    key: dict[str, Any]
    tokenizer_path: str


def available_ruler_tasks(tasks: Sequence[str]) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """The RULER tasks a suite of ``tasks`` runs here: the offline ones asked for, and those that need a download
    where their data can be fetched (the others listed as skipped, with why).

    Returns:
        ``(ruler, downloads, skipped)``: the tasks to run, every download task asked for, and the skipped entries.
    """
    ruler = ruler_tasks(tasks)
    downloads = [name for name in RULER_DOWNLOAD_TASKS if "ruler" in tasks or name in tasks]
    if ruler or downloads:
        import_harness()
        import_ruler_generators()  # first, so that their import's nltk noise is dropped wherever a task loads them
    skipped: list[dict[str, str]] = []
    for name in downloads:
        problem = download_problem(name)
        if problem is None:
            ruler.append(name)
        else:
            skipped.append({"what": name, "reason": problem})
    return ruler, downloads, skipped


def plan_ruler_cells(rows: Sequence[Row], ruler: Sequence[str], settings: CardSettings, cache: Any,
                     skipped: list[dict[str, str]]) -> list[RulerPlan]:
    """Every RULER cell of the suite with its samples (drawn once per tokenizer, from ``cache``), each checked to fit
    its row's window and the harness's ``max_length`` before any model runs.

    A cell over its row's window is listed in ``skipped`` with ``skip_over_window``; any other that does not fit
    refuses the run.

    Raises:
        ValueError: a cell that does not fit (the first, and how many more).
    """
    from transformers import AutoTokenizer

    tokenizers: dict[str, tuple[str, Any]] = {}
    for spec in dict.fromkeys(row.spec for row in rows):
        path = tokenizer_path(spec)
        tokenizers[spec.key] = (path, AutoTokenizer.from_pretrained(path))
    plans: list[RulerPlan] = []
    problems: list[str] = []
    for task_name in ruler:
        for length in settings.lengths:
            for row in rows:
                path, tokenizer = tokenizers[row.spec.key]
                docs, key = ruler_docs(task_name, path, tokenizer, length, settings.trials, settings.seed, cache, settings.progress)
                problem = _budget_problem(row, task_name, length, docs, path, tokenizer, settings, skipped)
                if problem:
                    problems.append(problem)
                elif problem is None:
                    plans.append(RulerPlan(row, task_name, length, docs, key, path))
    if problems:
        more = f" ({len(problems) - 1} more cells do not fit)" if len(problems) > 1 else ""
        raise ValueError(problems[0] + more)
    return plans


def _budget_problem(row: Row, task_name: str, length: int, docs: list[dict[str, Any]], path: str, tokenizer: Any,
                    settings: CardSettings, skipped: list[dict[str, str]]) -> str | None:
    """Why a RULER cell cannot run (one line), "" when it is listed as skipped instead, or None when it fits."""
    task = ruler_task(task_name, docs, path, length)
    full = int(task.config.generation_kwargs.get("max_gen_toks", 256))
    prompt = max(len(tokenizer(task.doc_to_text(doc) + " " + doc.get("gen_prefix", ""))["input_ids"]) for doc in docs)
    max_length = settings.max_length or row.window
    problem = check_length_budget(row.label, task_name, length, prompt, full, row.window, max_length)
    if problem and settings.skip_over_window and prompt + full > row.window:
        # over the row's window (max_length defaults to it): listed, not run; a --max-length below the window is the
        # user's setting, and refused like any other
        reason = check_length_budget(row.label, task_name, length, prompt, full, row.window, prompt + full)
        skipped.append({"what": f"{row.label}: {task_name} at {length}", "reason": reason.split(": ", 2)[2].split(";")[0]})
        return ""
    return problem


def run_ruler_plans(plans: Sequence[RulerPlan], ruler: Sequence[str], settings: CardSettings, dtype: str) -> Iterator[Cell]:
    """Run every planned RULER cell (resuming each from its sample file) and yield each finished cell.

    Task by task, each length for every row before the next length: a run stopped early has whole comparisons
    (every row on the same samples) rather than every cell of the first row. One model is held at a time; a row's
    model is built again when its next cell comes (seconds, against minutes of samples). A cell whose sample file
    already holds every sample (a finished run resumed) loads no model.
    """
    order = {name: i for i, name in enumerate(ruler)}
    held: tuple[Row, Any] | None = None
    loaded = False
    try:
        for plan in sorted(plans, key=lambda p: (order[p.task], p.length, p.row.index)):
            results = SampleResults(plan.row.sample_path(settings.out / "ruler", plan.task, plan.length, dtype, settings.device),
                                    _results_header(plan, settings, dtype))
            if not all(results.has(doc_id) for doc_id in range(len(plan.docs))):
                if held is None or held[0] is not plan.row:
                    held = None
                    if loaded:
                        gc.collect()  # the previous row's model goes before the next one loads
                    held, loaded = (plan.row, _harness_model(plan.row, settings, dtype)), True
                task = ruler_task(plan.task, plan.docs, plan.tokenizer_path, plan.length)
                run_ruler_cell(held[1], task, plan.docs, plan.length, results, settings.budget, settings.progress, plan.row.label)
            yield {"task": plan.task, "kind": "ruler", "row": plan.row.label, "row_index": plan.row.index, "length": plan.length,
                   "base": plan.row.base, "in_window": plan.length <= plan.row.window, "sample_key": plan.key,
                   "source": str(results.path), **ruler_cell_fields(results.records, len(plan.docs))}
    finally:
        held = None
        if loaded:
            gc.collect()


def _harness_model(row: Row, settings: CardSettings, dtype: str) -> Any:
    """The ``hf-posext`` harness model of ``row`` (its model, adapter and scaling)."""
    from hf_posext.integrations.lm_eval.model import PosextHFLM

    model_args: dict[str, Any] = {"dtype": dtype}
    if row.spec.adapter:
        model_args["peft"] = row.spec.adapter
    return PosextHFLM(pretrained=tokenizer_path(row.spec), device=settings.device, batch_size=1,
                      max_length=settings.max_length or row.window, **model_args, **row.posext_args())


def _results_header(plan: RulerPlan, settings: CardSettings, dtype: str) -> dict[str, Any]:
    """What a RULER cell's sample file says it holds (a file with another header holds another cell's samples)."""
    row = plan.row
    return {"row": row.label, "model": row.spec.key, "request": row.request.to_dict() if row.request else AS_SAVED,
            "report": {k: row.report.get(k) for k in ("method", "factor", "current_window", "original_window")},
            "task": plan.task, "length": plan.length, "sample_key": plan.key, "budget": settings.budget,
            "dtype": dtype, "device": settings.device}
