"""One LongRoPE factor search run: settings, the model's rotary target, scoring and the generations."""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from hf_posext.core.deprecation import renamed_keyword
from hf_posext.search.evolution import Breeding, Population, factor_key
from hf_posext.search.factors import calibration_segments, initial_factors, make_monotone, rescale_factors
from hf_posext.search.result import SearchResult

__all__ = ["search_factors"]


def _resumable(
    resume: Any, target_length: int, original_length: int, dim: int, calibration_sha1: str
) -> SearchResult | None:
    """Load and check a search to continue: same target, window, rotary dimension and calibration."""
    if resume is None:
        return None
    previous = resume if isinstance(resume, SearchResult) else SearchResult.load(resume)
    name = "the given SearchResult" if isinstance(resume, SearchResult) else repr(str(resume))
    problems = []
    if previous.target_length != target_length:
        problems.append(f"target_length {previous.target_length} (now {target_length})")
    if previous.original_max_position_embeddings != original_length:
        problems.append(f"a {previous.original_max_position_embeddings}-token window (this model's is {original_length})")
    if len(previous.long_factor) != dim // 2:
        problems.append(f"{len(previous.long_factor)} factors (this model needs {dim // 2})")
    if previous.settings.get("calibration_sha1") not in (None, calibration_sha1):
        problems.append("other calibration segments (data, segments or bos differ)")
    if problems:
        raise ValueError(f"resume: {name} is another search: " + "; ".join(problems) + ". Start a new search, or "
                         "pass it as start_from= to seed one.")
    if not previous.candidates:
        raise ValueError(f"resume: {name} lists no evaluated candidates (written before resume existed); "
                         "pass it as start_from= instead.")
    return previous


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def _check_search_settings(target_length: int, segments: int, population: int, generations: int, parents: int,
                           mutation_rate: float, mutation_scale: float, crossover_fraction: float) -> None:
    """Raise ValueError on a setting no search can run with (before anything is computed)."""
    _check_positive_int("target_length", target_length, 2)
    _check_positive_int("segments", segments)
    _check_positive_int("population", population, 2)
    _check_positive_int("generations", generations, 0)
    _check_positive_int("parents", parents)
    if parents >= population:
        raise ValueError(f"parents ({parents}) must be smaller than population ({population}) so each generation has children.")
    for name, value, low, high in (("mutation_rate", mutation_rate, 0.0, 1.0), ("crossover_fraction", crossover_fraction, 0.0, 1.0)):
        if not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}.")
    if not isinstance(mutation_scale, (int, float)) or mutation_scale <= 0:
        raise ValueError(f"mutation_scale must be positive, got {mutation_scale!r}.")


@dataclass(frozen=True)
class _RotaryTarget:
    """The model's rotary base and dimension, its original window L and the scale s = target / L."""

    theta: float
    dim: int
    original_length: int
    scale: float


def _rotary_target(model: nn.Module, target_length: int, original_max_position_embeddings: int | None) -> _RotaryTarget:
    """Read the unscaled rotary embedding the search works on; ValueError on a patched or scaled model."""
    from hf_posext.api import patched_backend
    from hf_posext.backends.rope.sites import find_rotary_sites

    if patched_backend(model) is not None:
        raise ValueError("search_factors needs the unpatched model: call hf_posext.unpatch(model) first.")
    main = next(site for site in find_rotary_sites(model) if site.scaled_layer_types)
    layer_type = main.scaled_layer_types[0]
    current = main.current[layer_type]
    if not current.spec.baseline:
        raise ValueError(
            f"The model's config already scales RoPE ({current.method}); search factors from an unscaled model "
            "(load it without rope scaling)."
        )
    original_length = original_max_position_embeddings or current.original_max_position_embeddings
    if target_length <= original_length:
        raise ValueError(
            f"target_length={target_length} is inside the original window ({original_length} tokens): LongRoPE's long "
            "factors only apply past it. Use a target_length above the window."
        )
    return _RotaryTarget(main.bases[layer_type], main.dims[layer_type], original_length, target_length / original_length)


def _starting_points(target: _RotaryTarget, carried: list[torch.Tensor], max_factor: float) -> dict[str, torch.Tensor]:
    """PI, YaRN, NTK and the carried earlier searches, projected onto the search space, by name."""
    starts = {name: make_monotone(values, max_factor)
              for name, values in initial_factors(target.theta, target.dim, target.original_length, target.scale).items()}
    for index, values in enumerate(carried):
        starts["start_from" if index == 0 else f"start_from_{index}"] = make_monotone(values, max_factor)
    return starts


def _first_generation(starts: dict[str, torch.Tensor], size: int, breeding: Breeding) -> list[torch.Tensor]:
    """The distinct starting points, filled up to ``size`` with mutations of them."""
    first: list[torch.Tensor] = []
    for values in starts.values():
        if all(factor_key(values) != factor_key(c) for c in first):
            first.append(values)
    seeds = list(first)
    while len(first) < size:
        extra = breeding.mutate(seeds[int(torch.randint(len(seeds), (1,), generator=breeding.generator))])
        if all(factor_key(extra) != factor_key(c) for c in first):
            first.append(extra)
    return first


def _candidate_scorer(model: nn.Module, target: _RotaryTarget, ids: torch.Tensor, chunk_size: int, progress: bool, dist: Any
                      ) -> Callable[[list[tuple[tuple[float, ...], torch.Tensor]], int], list[tuple]]:
    """``score(todo, generation)``: this process's share of ``todo`` patched and scored, gathered from all."""
    from hf_posext.api import patch
    from hf_posext.lm.scoring import chunked_nll

    device = next(model.parameters()).device

    def score(todo: list[tuple[tuple[float, ...], torch.Tensor]], generation: int) -> list[tuple]:
        mine = dist.shard(todo)
        if progress and dist.is_main:
            from tqdm.auto import tqdm

            mine = tqdm(mine, desc=f"search generation {generation}", unit="cand")
        results = []
        for key, candidate in mine:
            began = time.perf_counter()
            patch(model, "longrope", target.scale, original_max_position_embeddings=target.original_length,
                  long_factor=[float(v) for v in candidate])
            total, tokens = 0.0, 0
            with torch.no_grad():
                for row in ids:
                    nll, scored = chunked_nll(model, row[None].to(device), chunk_size)
                    total += float(nll.sum())
                    tokens += scored
            results.append((key, total / tokens, time.perf_counter() - began))
        return dist.gather(results)

    return score


@dataclass
class _Search:
    """One search run: the candidates so far, how children are bred and scored, and what is written out."""

    target: _RotaryTarget
    target_length: int
    settings: dict[str, Any]
    pool: Population
    breeding: Breeding
    score: Callable[[list[tuple[tuple[float, ...], torch.Tensor]], int], list[tuple]]
    output: str | os.PathLike | None
    is_main: bool
    start_time: float
    seconds_before: float = 0.0
    initial_nll: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    def seconds(self) -> float:
        """Seconds searched, this run and the runs it resumes."""
        return self.seconds_before + time.perf_counter() - self.start_time

    def evaluate(self, candidates: list[torch.Tensor], generation: int) -> None:
        todo = self.pool.new(candidates)
        self.pool.add(todo, self.score(todo, generation), generation)

    def finish_generation(self, generation: int) -> None:
        """Log the generation and rewrite the output: a stopped search resumes from here."""
        self.history.append({"generation": generation, "best_nll": self.pool.best_nll(),
                             "evaluations": len(self.pool.fitness), "seconds": self.seconds()})
        if self.output is not None and self.is_main:
            self.result().save(self.output)

    def first_generation(self, starts: dict[str, torch.Tensor], size: int) -> None:
        """Score the starting points (and mutations of them, up to ``size``); name their fitness."""
        self.evaluate(_first_generation(starts, size, self.breeding), 0)
        self.initial_nll = {name: self.pool.fitness[factor_key(values)] for name, values in starts.items()}
        self.finish_generation(0)

    def more_generations(self, count: int, children: int, parents: int, processes: int, time_budget_s: float | None) -> None:
        """Up to ``count`` generations of ``children`` bred from the best ``parents``, within the time budget."""
        done = max(entry["generation"] for entry in self.history)
        for generation in range(done + 1, done + count + 1):
            wave = math.ceil(children / processes) * self.pool.seconds_per_candidate()
            if time_budget_s is not None and time.perf_counter() - self.start_time + wave > time_budget_s:
                self.history.append({"generation": generation, "stopped": "time budget", "estimated_seconds": wave})
                return
            self.evaluate(self.pool.children(children, self.pool.ranked()[:parents], self.breeding), generation)
            self.finish_generation(generation)

    def result(self) -> SearchResult:
        best = self.pool.ranked()[0]
        return SearchResult(
            long_factor=[float(v) for v in self.pool.vectors[best]], factor=self.target.scale,
            target_length=self.target_length, original_max_position_embeddings=self.target.original_length,
            best_nll=self.pool.fitness[best], initial_nll=self.initial_nll, history=self.history,
            evaluations=len(self.pool.fitness), seconds=self.seconds(), settings=self.settings, candidates=self.pool.records,
        )


def search_factors(
    model: nn.Module, target_length: int, data: Any, *, tokenizer: Any = None, segments: int = 1,
    population: int = 8, generations: int = 4, parents: int = 3,
    mutation_rate: float = 0.3, mutation_scale: float = 0.15, crossover_fraction: float = 0.5,
    max_factor: float | None = None, original_max_position_embeddings: int | None = None,
    time_budget_s: float | None = None, chunk_size: int = 2048, seed: int = 0,
    output: str | os.PathLike | None = None, progress: bool = True, bos: str = "auto", text_field: str | None = None,
    start_from: Any = None, resume: str | os.PathLike | SearchResult | None = None, windows: int | None = None,
) -> SearchResult:
    """Evolutionary search for per-dimension RoPE factors (LongRoPE) minimising perplexity at a length.

    Args:
        model: an unpatched RoPE causal LM (it is patched per candidate and unpatched at the end).
        target_length: the length to extend to; the fitness is measured on segments of this many tokens.
        data: calibration text or token ids (see :func:`calibration_segments`).
        tokenizer: the model's tokenizer (needed when ``data`` is text).
        segments: calibration segments per candidate (each one forward pass of ``target_length`` tokens).
        population: candidates per generation (the first generation: PI, YaRN, NTK and their mutations).
        generations: generations after the first (the search evaluates about
            ``population + generations * (population - parents)`` candidates).
        parents: best candidates kept each generation and bred from.
        mutation_rate: chance that each factor of a child is mutated.
        mutation_scale: standard deviation of the log-normal mutation step.
        crossover_fraction: share of children made by crossing two parents (the rest: mutations).
        max_factor: upper bound of every factor (default: 2 s, room above PI's s for low frequencies).
        original_max_position_embeddings: override the pre-training window L read from the config.
        time_budget_s: stop before a generation that would not finish within this many seconds
            (estimated from the measured time per candidate); the best found so far is returned.
        chunk_size: positions per output-head chunk of the loss.
        seed: RNG seed (every process must use the same one).
        output: write the result JSON there (main process only).
        progress: show a progress bar per generation.
        bos, text_field: how calibration text is cut (see :func:`calibration_segments`).
        start_from: earlier search results (a JSON path, :class:`SearchResult` or dict, or a list of
            them), e.g. the factors searched at 2x when searching 4x; each joins the first generation,
            carried to this scale by :func:`rescale_factors`, named ``start_from`` (``start_from_1``, ...).
        resume: a result of this same search (JSON path or :class:`SearchResult`: same target length,
            window and calibration segments) to continue for up to ``generations`` more generations (see
            "Resume" in :mod:`hf_posext.search`).
        windows: the old name of ``segments`` (a FutureWarning; the result's settings keep ``"windows"``).

    Returns:
        A :class:`SearchResult`; ``result.best_nll <= min(result.initial_nll.values())`` always.

    Raises:
        ValueError: bad settings, a patched model, a target inside the original window, too little data.

    Example:
        >>> result = hf_posext.search_factors(model, 16384, "books/", tokenizer=tok, output="factors.json")
        >>> hf_posext.patch(model, "longrope", factor=result.factor, factors="factors.json")
    """
    from hf_posext.lm.distributed import Distributed

    start_time = time.perf_counter()
    segments = renamed_keyword("windows", windows, "segments", segments, 1)
    _check_search_settings(target_length, segments, population, generations, parents, mutation_rate, mutation_scale,
                           crossover_fraction)
    target = _rotary_target(model, target_length, original_max_position_embeddings)
    max_factor = _max_factor(max_factor, target.scale)
    earlier, carried = _earlier_searches(start_from, resume, target)
    ids = calibration_segments(data, target_length, segments, tokenizer, bos=bos, text_field=text_field)
    calibration_sha1 = _digest(ids)
    resumed = _resumable(resume, target_length, target.original_length, target.dim, calibration_sha1)
    dist = Distributed()
    settings = {"population": population, "generations": generations, "parents": parents, "mutation_rate": mutation_rate,
                "mutation_scale": mutation_scale, "crossover_fraction": crossover_fraction, "max_factor": max_factor,
                "windows": int(ids.shape[0]), "seed": seed, "processes": dist.world_size, "time_budget_s": time_budget_s,
                "start_from": earlier, "calibration_sha1": calibration_sha1, "resumed_from": _resume_name(resume)}
    search = _Search(
        target=target, target_length=target_length, settings=settings, pool=Population.resumed_from(resumed),
        breeding=Breeding(mutation_rate, mutation_scale, crossover_fraction, max_factor, torch.Generator().manual_seed(seed)),
        score=_candidate_scorer(model, target, ids, chunk_size, progress, dist), output=output, is_main=dist.is_main,
        start_time=start_time, seconds_before=float(resumed.seconds) if resumed is not None else 0.0,
    )
    found = _run_generations(model, search, carried, max_factor, resumed, population, generations, parents,
                             dist.world_size, time_budget_s)
    if output is not None and dist.is_main:
        found.save(output)
    dist.barrier()
    return found


def _max_factor(max_factor: float | None, scale: float) -> float:
    """The upper bound of every factor: ``max_factor``, default 2 s; ValueError below PI's s."""
    max_factor = float(max_factor) if max_factor is not None else 2.0 * scale
    if max_factor < scale:
        raise ValueError(f"max_factor ({max_factor}) must be at least the scale s = {scale:g} (PI's factor).")
    return max_factor


def _earlier_searches(start_from: Any, resume: Any, target: _RotaryTarget) -> tuple[list[str], list[torch.Tensor]]:
    """``start_from`` as (names for the record, factors carried to this scale); ValueError with ``resume`` too."""
    if resume is not None and start_from is not None:
        raise ValueError("Give start_from= (seed a new search) or resume= (continue one), not both.")
    previous = [] if start_from is None else list(start_from) if isinstance(start_from, (list, tuple)) else [start_from]
    carried = [rescale_factors(item, target.scale, dim=target.dim, original_length=target.original_length) for item in previous]
    names = [str(item) if isinstance(item, (str, os.PathLike)) else type(item).__name__ for item in previous]
    return names, carried


def _digest(ids: torch.Tensor) -> str:
    """A short digest of the calibration segments: a resumed search must measure on the same ones."""
    return hashlib.sha1(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def _resume_name(resume: Any) -> str | None:
    """How the record names the search it resumed."""
    return None if resume is None else str(resume) if isinstance(resume, (str, os.PathLike)) else "SearchResult"


def _run_generations(model: nn.Module, search: _Search, carried: list[torch.Tensor], max_factor: float,
                     resumed: SearchResult | None, population: int, generations: int, parents: int, processes: int,
                     time_budget_s: float | None) -> SearchResult:
    """The first generation (or the resumed search's history), then the others; the model is unpatched after."""
    from hf_posext.api import patched_backend, unpatch

    try:
        if resumed is None:
            search.first_generation(_starting_points(search.target, carried, max_factor), population)
        else:
            search.initial_nll, search.history = dict(resumed.initial_nll), [e for e in resumed.history if "best_nll" in e]
        search.more_generations(generations, population - parents, parents, processes, time_budget_s)
    finally:
        if patched_backend(model) is not None:
            unpatch(model)
    return search.result()
