"""``hf-posext eval card``: perplexity, passkey, needle and the six offline RULER tasks, models x methods x lengths.

RULER runs through lm-eval's own task objects (templates, ``gen_prefix``, generation settings, scoring) and
the ``hf-posext`` harness model, one sample at a time so that a killed run resumes where it stopped:

1. samples are generated once per (task, tokenizer hash, length, seed) with lm-eval's generators (the first
   ``n`` of them: the generators draw sample after sample from one seeded RNG, so the first ``n`` do not depend
   on how many are drawn) and cached (:class:`~hf_posext.evaluation.card.SampleCache`); every row with that
   tokenizer reads the same samples, and the key is written to every results file;
2. before any model runs, every (row, task, length) is checked: prompt + generation must fit the harness's
   ``max_length`` and the row's window after scaling, else the run is refused in one line;
3. each sample's response, score and timings (prefill, generation, harness overhead) go to one JSON-lines
   file per (row, task, length) (:class:`~hf_posext.evaluation.card.SampleResults`).

Perplexity, passkey and needle run through :mod:`hf_posext.evaluation` into ``OUT/tasks`` (resumable per cell).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import gc
import hashlib
import io
import json
import logging
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hf_posext.api import describe, patch, unpatch
from hf_posext.core.grammar import MODEL_ARGUMENT, format_request
from hf_posext.core.request import ScalingRequest, parse_param_items
from hf_posext.evaluation.deferred_cache import DeferredSampleWrites
from hf_posext.evaluation.card import (
    CARD_TASKS, ENDING_BUDGET, RULER_DOWNLOAD_TASKS, RULER_OFFLINE_TASKS, SHORT_BUDGETS, ModelSpec, SampleCache, SampleResults,
    is_base_row, perplexity_cell_fields,
    card_row_labels, check_length_budget, earlier_card, first_budget, in_row_order, merged_row_order, needs_full_budget, parse_model_specs, relabelled_rows, row_label, sample_cache_key, score_summary,
    tokenizer_hash, ruler_cell_fields, write_card, markdown_card,
)
from hf_posext.evaluation.paired import kept_trials
from hf_posext.integrations.lm_eval.launcher import import_harness

__all__ = ["Row", "card_model_rows", "ruler_docs", "ruler_task", "limit_ruler_samples", "run_ruler_cell", "run_card", "download_problem", "forget_downloads", "import_ruler_generators",
           "ForwardTimer", "device_synchronizer", "AS_SAVED", "trial_scores",
           "stored_endings", "ending_sample_key"]


#: The method name that evaluates a model with the scaling saved in it (none would remove it).
AS_SAVED = "as-saved"


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


# ------------------------------------------------------------------ rows


@dataclass
class Row:
    """One card row: a model spec under one method, with the report of the model as evaluated."""

    index: int
    spec: ModelSpec
    request: ScalingRequest | None  # None: as saved
    report: dict[str, Any]
    base: bool
    saved: dict[str, Any] | None = None  # the model's own scaling, before the row's method was patched

    @property
    def label(self) -> str:
        """``"fine-tuned, yarn ×4 + string"``: an attention method patched on a model whose frequency scaling
        lives in its config is named with that scaling, which it runs on; parameters the run asked for follow
        (``"fine-tuned, yarn ×4 + string (shifted_offset 16384)"``)."""
        report, saved = self.report, self.saved or {}
        if report.get("kind") == "attention" and saved.get("kind") == "rope" and (saved.get("method") or "none") != "none":
            report = {**report, "method": f"{saved['method']}+{report['method']}", "factor": saved.get("factor")}
        return row_label(self.spec.name, report, dict(self.request.params) if self.request else None)

    @property
    def window(self) -> int:
        return int(self.report["current_window"])

    def results_name(self, dtype: str, device: str) -> str:
        """The name of this row's sample files: readable, and the same whichever other rows a run has (so a
        run with more or fewer rows resumes this row's samples), different for another dtype or device."""
        readable = re.sub(r"[^A-Za-z0-9.]+", "-", f"{self.spec.name}-{self._method_name()}").strip("-")[:60]
        return f"{readable}-{dtype}-{self._results_hash(dtype, device)}"

    def sample_path(self, folder: Path, task: str, length: int, dtype: str, device: str) -> Path:
        """This row's sample file for ``task`` at ``length`` in ``folder``. Where it does not exist but one file
        differs from its name only in the label part (the same model, method, dtype and device, saved when the
        row had another label), that file is the row's: its samples are resumed, not computed again."""
        path = folder / f"{task}-{length}-{self.results_name(dtype, device)}.jsonl"
        if path.exists():
            return path
        earlier = sorted(folder.glob(f"{glob.escape(task)}-{length}-*-{dtype}-{self._results_hash(dtype, device)}.jsonl"))
        return earlier[0] if len(earlier) == 1 else path

    def _method_name(self) -> str:
        return f"{self.request.label}-x{self.request.factor:g}" if self.request else AS_SAVED

    def _results_hash(self, dtype: str, device: str) -> str:
        text = f"{self.spec.key}|{self._method_name()}|{dtype}|{device}"
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    def posext_args(self) -> dict[str, Any]:
        if self.request is None:
            return {}
        return {MODEL_ARGUMENT: format_request(self.request)}


def _requests(methods: str, params: dict[str, Any], factor: float | None, lengths: list[int], original_window: int) -> list[ScalingRequest | None]:
    from hf_posext.evaluation.arguments import parse_methods
    from hf_posext.evaluation.grid import resolve_factor_for

    names = [m.strip() for m in methods.split(",") if m.strip()]
    others = [m for m in names if m != AS_SAVED]
    parsed = iter(parse_methods(others, params) if others else [])
    requests: list[ScalingRequest | None] = []
    for name in names:
        if name == AS_SAVED:
            requests.append(None)
            continue
        request = next(parsed)
        requests.append(ScalingRequest(request.method, resolve_factor_for(request, factor, lengths, original_window), params=request.params))
    return requests


def _check_requests(specs: list[ModelSpec], args: Any) -> None:
    """Every row's method names, parameters and given factors, checked as :func:`card_model_rows` will use them (a factor
    sized from a model's window is checked there, once the window is known).

    Raises:
        ValueError: an unknown method or parameter, or a factor below 1.
    """
    from hf_posext.evaluation.arguments import parse_methods

    params = parse_param_items(args.param)
    for spec in specs:
        for methods, factor in (spec.methods or ((args.methods, None),)):
            factor = factor if factor is not None else args.factor
            names = [m.strip() for m in methods.split(",") if m.strip() and m.strip() != AS_SAVED]
            for request in parse_methods(names, params) if names else []:
                if factor is not None:
                    ScalingRequest(request.method, factor, params=request.params)


def _as_request(report: dict[str, Any]) -> ScalingRequest:
    """The request that reproduces a saved scaling (for the evaluation tasks, which patch every method)."""
    params = dict(report.get("params") or {})
    for part in report.get("parts") or []:
        params.update(part.get("params") or {})
    return ScalingRequest(report["method"], float(report.get("factor") or 1), params=tuple(sorted(params.items())))


def card_model_rows(specs: list[ModelSpec], args: Any, lengths: list[int]) -> list[Row]:
    """Every row with its report, computed on each model (loaded once, patched and restored per method)."""
    from hf_posext.evaluation.loading import load_model_and_tokenizer

    rows: list[Row] = []
    for spec_index, spec in enumerate(specs):
        model, _ = load_model_and_tokenizer(spec.model, dtype="float32", device="cpu", adapter=spec.adapter)
        saved = describe(model).to_dict()
        if spec.methods:
            requests = [r for name, factor in spec.methods
                        for r in _requests(name, parse_param_items(args.param), factor if factor is not None else args.factor, lengths,
                                           saved["original_window"])]
        else:
            requests = _requests(args.methods, parse_param_items(args.param), args.factor, lengths, saved["original_window"])
        for request in requests:
            if request is None:
                report = saved
            else:
                patch(model, request.method, request.factor, **request.params_dict)
                report = describe(model).to_dict()
                unpatch(model)
            rows.append(Row(len(rows), spec, request, report, base=is_base_row(spec_index, spec, request.method if request else None, saved),
                            saved=saved))
        del model
        gc.collect()
    return rows


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


# ------------------------------------------------------------------ the card


def _merged(skipped: list[dict[str, str]], earlier: list[dict[str, str]]) -> list[dict[str, str]]:
    return skipped + [item for item in earlier if item not in skipped]


def _ruler_tasks(tasks: list[str]) -> list[str]:
    chosen = []
    for task in tasks:
        if task == "ruler":
            chosen.extend(RULER_OFFLINE_TASKS)
        elif task in RULER_OFFLINE_TASKS:
            chosen.append(task)
    return list(dict.fromkeys(chosen))


def _parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    known = set(CARD_TASKS) | set(RULER_OFFLINE_TASKS) | set(RULER_DOWNLOAD_TASKS)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ValueError(f"--tasks: unknown task {unknown[0]!r}; use perplexity, passkey, needle, ruler or a RULER task "
                         f"({', '.join(RULER_OFFLINE_TASKS)}).")
    if not tasks:
        raise ValueError("--tasks is empty; pass e.g. --tasks perplexity,passkey,needle,ruler.")
    return tasks


def _tokenizer_path(spec: ModelSpec) -> str:
    """The folder or hub name lm-eval reads the row's tokenizer from (RULER samples are drawn with it)."""
    from hf_posext.core.loading import check_tokenizer_files
    from hf_posext.evaluation.loading import is_tiny_model_name
    from hf_posext.models import resolve_model_path

    if is_tiny_model_name(spec.model):
        raise ValueError(f"{spec.model}: the RULER tasks need a model whose tokenizer is saved (lm-eval draws the samples "
                         "with it) and the tiny test models have none; save one to a folder (tiny_model(...).save_pretrained(DIR) "
                         "and a tokenizer beside it) and pass DIR, or run the card's other tasks on it.")
    path = resolve_model_path(spec.model)
    check_tokenizer_files(path, spec.model)
    return path


def _evaluation_cells(rows: list[Row], tasks: list[str], lengths: list[int], args: Any,
                      done: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Perplexity, passkey and needle for every row through hf_posext.evaluation (resumable per segment and trial);
    ``done`` gets the cells so far after each row's task (the card is written then: a run of hours shows them, and
    a run stopped later keeps them on its card)."""
    from hf_posext.evaluation import needle, passkey, perplexity
    from hf_posext.evaluation.loading import evaluation_dtype, load_model_and_tokenizer
    from hf_posext.evaluation.proportions import pooled_proportion

    wanted = [t for t in ("perplexity", "passkey", "needle") if t in tasks]
    if not wanted:
        return []
    out = Path(args.out) / "tasks"
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials = max(1, math.ceil(args.samples / len(depths)))
    cells: list[dict[str, Any]] = []
    dtypes = {task: evaluation_dtype(args.dtype, task, args.device) for task in wanted}
    for spec, dtype in ((spec, dtype) for spec in dict.fromkeys(row.spec for row in rows) for dtype in dict.fromkeys(dtypes.values())):
        model, tokenizer = load_model_and_tokenizer(spec.model, dtype=dtype, device=args.device, adapter=spec.adapter)
        for row in (r for r in rows if r.spec == spec):
            request = row.request or _as_request(row.report)
            common = dict(methods=[request], lengths=lengths, factor=request.factor, out_dir=out, model_name=spec.key,
                          extra_config={"dtype": dtype}, progress=args.progress)
            for task in (t for t in wanted if dtypes[t] == dtype):
                if task == "perplexity":
                    store = perplexity.evaluate_perplexity(model, tokenizer, data=args.ppl_data, max_segments=min(8, args.samples), **common)
                elif task == "passkey":
                    store = passkey.evaluate_passkey(model, tokenizer, depths=depths, trials=trials, seed=args.seed, **common)
                else:
                    store = needle.evaluate_needle(model, tokenizer, haystack=args.haystack, depths=depths, trials=trials, seed=args.seed, **common)
                prefix = f"{request.label}|factor={request.factor:g}|"
                records = {cid: r for cid, r in store.cells.items() if cid.startswith(prefix)}
                for length in lengths:
                    at = [r for r in records.values() if r["length"] == length]
                    if not at:
                        continue
                    base = {"task": task, "kind": task, "row": row.label, "row_index": row.index, "length": length,
                            "base": row.base, "in_window": length <= row.window, "source": str(store.path)}
                    if task == "perplexity":
                        ((cell_id, record),) = [(cid, r) for cid, r in records.items() if r["length"] == length]
                        cells.append({**base, "n": record.get("windows") or record.get("segments") or 1, "mean": record["ppl"],
                                      "low": None, "high": None, "text": f"{record['ppl']:.2f}", "cell_id": cell_id,
                                      **perplexity_cell_fields(store.data, length, cell_id)})
                    else:
                        pooled = pooled_proportion(at, "greedy_accuracy") or pooled_proportion(at, "teacher_forced_accuracy")
                        low, high = pooled.interval
                        trial_key = {"task": task, "length": length, "seed": args.seed, "depths": list(depths), "trials": trials,
                                     **({"haystack": str(args.haystack)} if task == "needle" else {})}
                        cells.append({**base, "n": pooled.trials, "k": pooled.successes, "mean": pooled.rate, "low": low,
                                      "high": high, "text": pooled.text(), "sample_key": trial_key, "scores": trial_scores(at)})
                if done is not None:
                    done(list(cells))
        del model
        gc.collect()
    return cells


def trial_scores(records: list[dict[str, Any]]) -> dict[str, float]:
    """``{"DEPTH/TRIAL": 1.0 or 0.0}``: each passkey or needle trial's greedy outcome, from its cell records' kept
    units (records written before trials were kept give none), so that the card pairs rows trial by trial."""
    return {f"{depth:g}/{trial}": 1.0 if unit["greedy"] else 0.0
            for record in records for _length, depth, trial, unit in kept_trials(record)}


def stored_endings(path: Path, model: str, dtype: str, instructions: tuple[str, ...] | list[str]) -> list[dict[str, Any]] | None:
    """A row's chat-ending records from an earlier run, when ``path`` holds them for the same model, dtype,
    budget (:data:`ENDING_BUDGET`) and instructions in the same order; None when there is no such file, or it holds
    another model's, dtype's, budget's or instruction set's (then the row is answered again and the file replaced).

    Raises:
        DamagedFileError: ``path`` is not a readable ending results file (named, never reused).
    """
    from hf_posext.core.errors import DamagedFileError

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


def _ending_cells(rows: list[Row], args: Any, skipped: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The short-context row: each row's answers to a few chat-formatted instructions, and whether they end
    with the end-of-turn token within :data:`ENDING_BUDGET` tokens (where the original model's end). A row whose
    results file holds its answers to the same instructions (:func:`stored_endings`) is read back, not run again."""
    from hf_posext.evaluation.ending import INSTRUCTIONS, answer_endings, chat_prompt, ended_like
    from hf_posext.evaluation.loading import evaluation_dtype, load_model_and_tokenizer

    out = Path(args.out) / "tasks"
    dtype = evaluation_dtype(args.dtype, "ending", args.device)
    cells: list[dict[str, Any]] = []
    reference: list[dict[str, Any]] | None = None
    for spec in dict.fromkeys(row.spec for row in rows):
        model, tokenizer = load_model_and_tokenizer(spec.model, dtype=dtype, device=args.device, adapter=spec.adapter)
        try:
            longest = max(len(chat_prompt(tokenizer, instruction)) for instruction in INSTRUCTIONS)
        except ValueError as error:
            skipped.append({"what": f"{spec.name}: ending", "reason": str(error)})
            continue
        length = 1 << (longest + ENDING_BUDGET - 1).bit_length()
        for row in (r for r in rows if r.spec == spec):
            if longest + ENDING_BUDGET > row.window:  # no answer fits: 0/48 would read as "never ends its turn"
                reason = (f"prompt {longest} + {ENDING_BUDGET} generated tokens = {longest + ENDING_BUDGET} > the model's "
                          f"window {row.window}")
                if not args.skip_over_window:
                    raise ValueError(f"{row.label}: ending: {reason}; scale it (e.g. --methods yarn --factor "
                                     f"{math.ceil((longest + ENDING_BUDGET) / row.window * 2) / 2:g}), or pass --skip-over-window.")
                skipped.append({"what": f"{row.label}: ending", "reason": reason})
                continue
            path = out / f"ending-{row.results_name(dtype, args.device)}.json"
            records = stored_endings(path, spec.key, dtype, INSTRUCTIONS)
            if records is None:
                if row.request is not None and row.request.method != "none":
                    patch(model, row.request.method, row.request.factor, **row.request.params_dict)
                try:
                    records = answer_endings(model, tokenizer, INSTRUCTIONS, max_new_tokens=ENDING_BUDGET)
                finally:
                    if row.request is not None and row.request.method != "none":
                        unpatch(model)
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_name(path.name + ".tmp")
                temporary.write_text(json.dumps({"row": row.label, "model": spec.key, "budget": ENDING_BUDGET, "dtype": dtype,
                                                 "records": records}, indent=1))
                temporary.replace(path)
            if row.base and reference is None:
                reference = records
            scores = [1.0 if r["ended"] else 0.0 for r in records]
            cells.append({"task": "ending", "kind": "ending", "row": row.label, "row_index": row.index, "length": length,
                          "base": row.base, "in_window": length <= row.window, "source": str(path), "records": records,
                          "sample_key": ending_sample_key(INSTRUCTIONS), "scores": {str(i): v for i, v in enumerate(scores)},
                          "mean_generated_tokens": sum(r["generated_tokens"] for r in records) / len(records),
                          **score_summary(scores)})
        del model
        gc.collect()
    if reference is not None:
        for cell in cells:
            cell.update(ended_like(cell.pop("records"), reference))
            cell["text"] += (f"; {cell['also_ended']}/{cell['reference_ended']} where the base model's end; "
                             f"{cell['mean_generated_tokens']:.0f} tokens an answer")
    else:
        for cell in cells:
            cell.pop("records")
    return cells


def run_card(args: Any) -> int:
    """Run ``hf-posext eval card`` with parsed ``args`` (see :func:`hf_posext.evaluation.card.add_card_arguments`)."""
    from hf_posext.core.locks import hold_folder, hold_parts
    from hf_posext.core.paths import check_output_folder
    from hf_posext.evaluation.card_checks import card_seed_problem
    from hf_posext.evaluation.store import results_part
    from hf_posext.evaluation.arguments import parse_lengths
    from hf_posext.evaluation.loading import check_device_name, check_dtype_name, transformers_progress_bars
    from hf_posext.text_sources import check_text_source

    started = time.time()
    specs = parse_model_specs(args.models)
    lengths = parse_lengths(args.lengths)
    tasks = _parse_tasks(args.tasks)
    if args.samples < 1:
        raise ValueError(f"--samples must be a positive number of samples, got {args.samples}.")
    check_dtype_name(args.dtype)
    check_device_name(args.device)
    check_output_folder(args.out, "--out", "the card")
    if args.sample_cache:
        check_output_folder(args.sample_cache, "--sample-cache", "the RULER samples")
    for task, source in (("perplexity", args.ppl_data), ("needle", args.haystack)):
        if task in tasks:
            check_text_source(source)
    _check_requests(specs, args)  # a bad method or factor is named before any model loads
    seed_problem = card_seed_problem(args.out, args.seed)  # before the card is written again
    if seed_problem:
        raise ValueError(seed_problem)
    if "ending" in tasks:
        _check_chat_templates(specs)
    # one run writes a card folder at a time: a second would drop the first's newer cells from card.json; and its
    # tasks' results files in OUT/tasks are held as `eval TASK --out OUT/tasks` holds them
    parts = [results_part(task, spec.key) for task in ("perplexity", "passkey", "needle") if task in tasks for spec in specs]
    with hold_folder(args.out, "--out", "the card"), hold_parts(Path(args.out) / "tasks", parts, "--out", "the card"), \
            transformers_progress_bars(args.progress):
        return _run_card_holding_folder(args, specs, lengths, tasks, started)


def _check_chat_templates(specs: list[ModelSpec]) -> None:
    """Refuse a row whose tokenizer's chat template cannot be rendered, before any model loads (a tokenizer without
    one is listed as skipped by the ending task, as before)."""
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


def _run_card_holding_folder(args: Any, specs: list[ModelSpec], lengths: list[int], tasks: list[str], started: float) -> int:
    """:func:`run_card` once its arguments are checked and its folder is held."""
    from hf_posext.evaluation.loading import AUTO_DTYPE, auto_dtype_note, evaluation_dtype

    ruler = _ruler_tasks(tasks)
    downloads = [name for name in RULER_DOWNLOAD_TASKS if "ruler" in tasks or name in tasks]
    out = Path(args.out)
    if ruler or downloads:
        import_harness()
        import_ruler_generators()  # first, so that their import's nltk noise is dropped wherever a task loads them
    # the tasks that need a download run where their data can be fetched, and are listed as skipped elsewhere
    skipped: list[dict[str, str]] = []
    for name in downloads:
        problem = download_problem(name)
        if problem is None:
            ruler.append(name)
        else:
            skipped.append({"what": name, "reason": problem})
    rows = card_model_rows(specs, args, lengths)

    # RULER samples (generated once per tokenizer) and every length budget, before any model runs.
    # written once every cell is known to fit (a refused run leaves no samples behind)
    cache = DeferredSampleWrites(SampleCache(args.sample_cache or out / "ruler-samples"))
    plans: list[tuple[Row, str, int, list[dict[str, Any]], dict[str, Any], str]] = []
    problems: list[str] = []
    if ruler:
        from transformers import AutoTokenizer

        tokenizers: dict[str, tuple[str, Any]] = {}
        for spec in specs:
            path = _tokenizer_path(spec)
            tokenizers[spec.key] = (path, AutoTokenizer.from_pretrained(path))
        for task_name in ruler:
            for length in lengths:
                for row in rows:
                    path, tokenizer = tokenizers[row.spec.key]
                    docs, key = ruler_docs(task_name, path, tokenizer, length, args.samples, args.seed, cache, args.progress)
                    task = ruler_task(task_name, docs, path, length)
                    full = int(task.config.generation_kwargs.get("max_gen_toks", 256))
                    prompt = max(len(tokenizer(task.doc_to_text(doc) + " " + doc.get("gen_prefix", ""))["input_ids"]) for doc in docs)
                    max_length = args.max_length or row.window
                    problem = check_length_budget(row.label, task_name, length, prompt, full, row.window, max_length)
                    if problem and args.skip_over_window and prompt + full > row.window:
                        # over the row's window (max_length defaults to it): listed, not run; a --max-length
                        # below the window is the user's setting, and refused like any other
                        reason = check_length_budget(row.label, task_name, length, prompt, full, row.window, prompt + full)
                        skipped.append({"what": f"{row.label}: {task_name} at {length}", "reason": reason.split(": ", 2)[2].split(";")[0]})
                        continue
                    if problem:
                        problems.append(problem)
                        continue
                    plans.append((row, task_name, length, docs, key, path))
        if problems:
            more = f" ({len(problems) - 1} more cells do not fit)" if len(problems) > 1 else ""
            raise ValueError(problems[0] + more)
        cache.flush()

    # An earlier run's cells in this folder that this run does not compute stay on the card (read before
    # anything runs: a damaged card.json is named here, not overwritten).
    covered = {(task, row.label, length) for task in [*(t for t in tasks if t != "ruler"), *ruler] for row in rows for length in lengths}
    covered |= {("ending", row.label, None) for row in rows if "ending" in tasks}
    carried, carried_skipped, carried_rows = earlier_card(out, [row.label for row in rows], covered)
    carried_skipped = [item for item in carried_skipped if item.get("what") not in downloads]  # this run's word on them
    # the rows stay where the earlier card had them (a run of some of its rows does not reorder the card)
    position = merged_row_order(card_row_labels(out), [row.label for row in rows])

    def write(cells: list[dict[str, Any]], skipped_now: list[dict[str, str]], settings_now: dict[str, Any]) -> dict[str, Path]:
        placed, placed_settings = in_row_order(cells, settings_now, position)
        return write_card(out, placed, skipped_now, placed_settings)
    # a row relabelled since the earlier run (the same model and scaling) resumes that run's samples
    # (Row.sample_path): the cells this run covers are its own now, not an earlier row's to show beside it
    relabelled = relabelled_rows(carried_rows, [{"label": row.label, "model": row.spec.key, "report": row.report} for row in rows])
    carried = [cell for cell in carried if not (cell["row"] in relabelled and (
        {(cell["task"], relabelled[cell["row"]], cell["length"]), (cell["task"], relabelled[cell["row"]], None)} & covered))]
    carried_rows = [row for row in carried_rows if any(cell["row"] == row.get("label") for cell in carried)]
    # ... and those it covers stay on the partial cards until this run reaches them (a long run would otherwise
    # show fewer cells than the folder holds for hours), marked as unfinished
    redone = [cell for cell in earlier_card(out, [row.label for row in rows], set())[0]
              if cell.get("kind") == "ruler" and ((cell["task"], cell["row"], cell["length"]) in covered)]

    def waiting(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
        have = {(cell["task"], cell["row"], cell["length"]) for cell in done}
        return [{**cell, "running": True, "text": f"{cell['text']}, an earlier run's until this run reaches it"}
                for cell in redone if (cell["task"], cell["row"], cell["length"]) not in have]

    def settings(partial: bool) -> dict[str, Any]:
        return {"models": [spec.key for spec in specs], "methods": args.methods, "factor": args.factor, "lengths": lengths,
                "tasks": tasks, "samples": args.samples, "seed": args.seed, "budget": args.budget, "dtype": args.dtype,
                "dtypes": {task: evaluation_dtype(args.dtype, "ruler" if task in ruler else task, args.device)
                           for task in [*tasks, *ruler]},  # each RULER task by name ("ruler" names them all)
                "device": args.device, "max_length": args.max_length,
                "rows": [{"label": r.label, "model": r.spec.key, "base": r.base, "report": r.report} for r in rows] + carried_rows,
                "short_budgets": SHORT_BUDGETS, "seconds": round(time.time() - started, 1), "partial": partial}

    if args.dtype == AUTO_DTYPE:
        print(auto_dtype_note(["ruler" if task in ruler else task for task in tasks], args.device), file=sys.stderr)
    def written_so_far(done: list[dict[str, Any]]) -> None:
        write(done + carried + waiting(done), _merged(skipped, carried_skipped), settings(partial=True))

    cells = _evaluation_cells(rows, tasks, lengths, args, written_so_far)
    if "ending" in tasks:
        cells.extend(_ending_cells(rows, args, skipped))
    if plans:
        write(cells + carried + waiting(cells), _merged(skipped, carried_skipped), settings(partial=True))

    if plans:
        from hf_posext.integrations.lm_eval.model import PosextHFLM

        # Task by task, each length for every row before the next length: a run stopped early has whole
        # comparisons (every row on the same samples) rather than every cell of the first row. One model is
        # held at a time; a row's model is built again when its next cell comes (seconds, against minutes
        # of samples).
        ruler_dtype = evaluation_dtype(args.dtype, "ruler", args.device)
        order = {name: i for i, name in enumerate(ruler)}
        held: tuple[Row, Any] | None = None
        for row, task_name, length, docs, key, path in sorted(plans, key=lambda p: (order[p[1]], p[2], p[0].index)):
            if held is None or held[0] is not row:
                held = None
                gc.collect()
                model_args: dict[str, Any] = {"dtype": ruler_dtype}
                if row.spec.adapter:
                    model_args["peft"] = row.spec.adapter
                held = (row, PosextHFLM(pretrained=_tokenizer_path(row.spec), device=args.device, batch_size=1,
                                        max_length=args.max_length or row.window, **model_args, **row.posext_args()))
            lm = held[1]
            task = ruler_task(task_name, docs, path, length)
            header = {"row": row.label, "model": row.spec.key, "request": row.request.to_dict() if row.request else AS_SAVED,
                      "report": {k: row.report.get(k) for k in ("method", "factor", "current_window", "original_window")},
                      "task": task_name, "length": length, "sample_key": key, "budget": args.budget,
                      "dtype": ruler_dtype, "device": args.device}
            results = SampleResults(row.sample_path(out / "ruler", task_name, length, ruler_dtype, args.device), header)
            run_ruler_cell(lm, task, docs, length, results, args.budget, args.progress, row.label)
            cells.append({"task": task_name, "kind": "ruler", "row": row.label, "row_index": row.index, "length": length,
                          "base": row.base, "in_window": length <= row.window, "sample_key": key, "source": str(results.path),
                          **ruler_cell_fields(results.records, len(docs))})
            write(cells + carried + waiting(cells), _merged(skipped, carried_skipped),
                       settings(partial=True))  # a long run shows what it has so far
        held = None
        gc.collect()

    final, final_settings = in_row_order(cells + carried, settings(partial=False), position)
    paths = write_card(out, final, _merged(skipped, carried_skipped), final_settings)
    print(markdown_card(final, _merged(skipped, carried_skipped)))  # the card.md just written
    print(f"\ncard: {paths['html']} (+ {paths['json'].name}, {paths['markdown'].name}, plots); {time.time() - started:.0f} s")
    return 0
