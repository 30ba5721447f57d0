"""Searched per-dimension RoPE rescale factors, LongRoPE-style (Ding et al. 2024).

Ding, Zhang, Zhang, Xu, Shang, Xu, Yang, Yang 2024, "LongRoPE: Extending LLM Context Window Beyond 2
Million Tokens" (arXiv:2402.13753), section 3.2: an evolutionary search over per-dimension rescale
factors lambda_i (theta'_i = theta_i / lambda_i), with the fitness the perplexity at the target length.

What this module does, and where it differs from the paper:

* Search space: d/2 factors, each in ``[1, max_factor]`` and non-decreasing with the dimension index
  (low frequencies are stretched at least as much as high ones: the paper's monotonicity constraint).
  Every candidate is projected onto that space by a running maximum.
* Initial population: the frequency parts of PI (every factor s), YaRN (theta_i / theta'_i of
  :func:`hf_posext.methods.rope.yarn`) and NTK-aware scaling, then mutations of them. ``start_from=``
  adds the factors of earlier searches at other scales (LongRoPE extends progressively, each search
  seeded from the one before), carried to the new scale s' by ``lambda_i ** (ln s' / ln s)``: that maps
  an extrapolated dimension (1) to 1 and an interpolated one (s) to s', and keeps the order. The paper also
  searches n-hat, a number of initial tokens left unscaled; we do not (it needs a position-dependent
  rotary table, which ``longrope`` does not have).
* Generations: keep the best ``parents`` (elitism), fill the population with mutations (each factor
  multiplied by ``exp(N(0, mutation_scale))`` with probability ``mutation_rate``) and one-point
  crossovers of two parents; a candidate already evaluated is never evaluated twice.
* Fitness: mean next-token NLL (log-perplexity) of ``model`` patched with ``longrope`` and the
  candidate, on calibration segments of exactly ``target_length`` tokens; the loss runs over chunks of
  the final hidden states (:func:`hf_posext.lm.scoring.chunked_nll`), never the full logits.
  The attention factor is LongRoPE's sqrt(1 + ln s / ln L) for every candidate, as ``longrope`` applies.
* Data parallel: launched with several processes (``accelerate launch --num_processes N`` or
  ``torchrun``), each process evaluates its share of a generation's candidates and the results are
  gathered; every process draws the same candidates from the same seed, so they stay in step.

The result is a JSON file that ``hf_posext.patch(model, "longrope", factor=s, factors=PATH)`` reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from hf_posext.core.deprecation import renamed_keyword

__all__ = [
    "SearchResult",
    "search_factors",
    "initial_factors",
    "rescale_factors",
    "make_monotone",
    "calibration_segments",
    "calibration_windows",
]


@dataclass
class SearchResult:
    """What :func:`search_factors` found.

    Attributes:
        long_factor: the best per-dimension factors (d/2 values, non-decreasing).
        factor: the scale s = target_length / original window that ``longrope`` needs alongside them.
        target_length: the length the fitness was measured at.
        original_max_position_embeddings: the model's pre-training window L.
        best_nll: fitness of ``long_factor`` (mean NLL per token; perplexity = exp).
        initial_nll: fitness of each named starting point (``pi``, ``yarn``, ``ntk``, and ``start_from``
            when an earlier search seeded this one).
        history: per generation: best NLL so far, candidates evaluated, seconds elapsed.
        evaluations: candidates evaluated in all.
        seconds: wall-clock time of the search.
        settings: the search settings (population, generations, ...), for the record.
        candidates: every candidate evaluated: ``long_factor``, ``nll``, ``generation``, ``seconds``;
            what ``search_factors(..., resume=...)`` continues from.
    """

    long_factor: list[float]
    factor: float
    target_length: int
    original_max_position_embeddings: int
    best_nll: float
    initial_nll: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)
    evaluations: int = 0
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def best_ppl(self) -> float:
        return math.exp(self.best_nll)

    @property
    def initial_best_nll(self) -> float:
        return min(self.initial_nll.values())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["method"] = "longrope"
        data["best_ppl"] = self.best_ppl
        data["initial_ppl"] = {name: math.exp(nll) for name, nll in self.initial_nll.items()}
        data["usage"] = f"hf_posext.patch(model, 'longrope', factor={self.factor:g}, factors='THIS_FILE.json')"
        return data

    @classmethod
    def load(cls, path: str | os.PathLike) -> SearchResult:
        """Read the JSON :meth:`save` wrote."""
        data = _read_result_json(path, "search result")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"long_factor", "factor", "target_length", "original_max_position_embeddings", "best_nll", "initial_nll"} - set(data)
        if missing:
            raise ValueError(f"{str(path)!r} is not a search result: it lacks {sorted(missing)}.")
        return cls(**{key: value for key, value in data.items() if key in names})

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON that ``patch(model, "longrope", factor=s, factors=path)`` reads."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


def _read_result_json(path: str | os.PathLike, what: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: no file {str(path)!r}; give the JSON an earlier search_factors run wrote.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: {str(path)!r} is not JSON ({error}).") from error


def make_monotone(factors: torch.Tensor, max_factor: float) -> torch.Tensor:
    """Project factors onto the search space: clamp to ``[1, max_factor]``, then a running maximum."""
    clamped = factors.double().clamp(1.0, max_factor)
    return torch.cummax(clamped, dim=-1).values


def initial_factors(theta: float, dim: int, original_length: int, factor: float) -> dict[str, torch.Tensor]:
    """The starting points: per-dimension factors theta_i / theta'_i of PI, YaRN and NTK-aware scaling."""
    from hf_posext.methods import get_method
    from hf_posext.methods.rope import RotaryBase

    rope = RotaryBase(theta, dim)
    original = rope.inv_freq().double()
    starts = {}
    for name, method in (("pi", "linear"), ("yarn", "yarn"), ("ntk", "ntk")):
        spec = get_method(method)
        inv_freq, _ = spec.compute(rope, original_length, factor, None, spec.parse_params({}))
        starts[name] = original / inv_freq.double()
    return starts


def rescale_factors(factors: Any, to_scale: float, *, dim: int | None = None, original_length: int | None = None) -> torch.Tensor:
    """Carry factors searched at scale s to scale s' = ``to_scale``: ``lambda_i ** (ln s' / ln s)``.

    A dimension left unscaled (1) stays 1, one interpolated by PI's s becomes s', and the order of the
    factors is kept, so the result is a valid starting point of a search at the new scale.

    Args:
        factors: a :class:`SearchResult`, the path of the JSON it wrote, or a mapping with ``long_factor``
            and ``factor`` (the scale s the factors were searched at).
        to_scale: the new scale s' (> 1).
        dim: when given, the rotary dimension the factors must fit (``dim // 2`` values).
        original_length: when given, the pre-training window the factors must have been searched for.

    Raises:
        ValueError: a missing or unreadable file, no ``long_factor``/``factor``, a scale <= 1, factors
            for another rotary dimension or window.
    """
    if isinstance(factors, SearchResult):
        data: dict[str, Any] = factors.to_dict()
        source = "the given SearchResult"
    elif isinstance(factors, (str, os.PathLike)):
        data = _read_result_json(factors, "start_from")
        source = repr(str(factors))
    elif isinstance(factors, dict):
        data, source = factors, "the given mapping"
    else:
        raise ValueError(f"start_from takes search results (JSON paths, SearchResult or dicts), got {type(factors).__name__}.")
    if not isinstance(data, dict) or "long_factor" not in data or "factor" not in data:
        raise ValueError(f"start_from: {source} needs 'long_factor' and 'factor' (the JSON search_factors writes).")
    old_scale = float(data["factor"])
    if old_scale <= 1.0 or to_scale <= 1.0:
        raise ValueError(f"start_from: both scales must exceed 1 (searched at {old_scale:g}, now {to_scale:g}).")
    values = torch.tensor([float(v) for v in data["long_factor"]], dtype=torch.float64)
    if dim is not None and values.numel() != dim // 2:
        raise ValueError(
            f"start_from: {source} holds {values.numel()} factors, this model's rotary dimension {dim} needs {dim // 2}."
        )
    searched_window = data.get("original_max_position_embeddings")
    if original_length is not None and searched_window is not None and int(searched_window) != original_length:
        raise ValueError(
            f"start_from: {source} was searched for a {searched_window}-token window, this model's is {original_length}."
        )
    return values.clamp_min(1.0) ** (math.log(to_scale) / math.log(old_scale))


def calibration_segments(
    data: Any, target_length: int, segments: int, tokenizer: Any = None, *, bos: str = "auto", text_field: str | None = None
) -> torch.Tensor:
    """``[segments, target_length]`` token ids to measure the fitness on.

    Args:
        data: token ids (a tensor or list of lists, each at least ``target_length`` long), or text: a
            source understood by :func:`hf_posext.text_sources.load_documents` (file, folder, dataset name,
            ``builtin:python-docs``) or a list of document strings (needs ``tokenizer``).
        target_length: tokens per segment.
        segments: how many segments (the first ones, documents joined).
        tokenizer: the model's tokenizer, for text.
        bos: start segments with BOS: ``"auto"`` (when the tokenizer adds one), ``"yes"``, ``"no"``.
        text_field: JSON field / column holding the text of .jsonl / .parquet sources.

    Raises:
        ValueError: too little data for one segment, text without a tokenizer.
    """
    if isinstance(data, torch.Tensor) or (isinstance(data, (list, tuple)) and data and not isinstance(data[0], str)):
        rows = [list(map(int, row)) for row in (data.tolist() if isinstance(data, torch.Tensor) else data)]
        rows = [row[:target_length] for row in rows if len(row) >= target_length][:segments]
        if not rows:
            raise ValueError(f"No row of the given token ids has the {target_length} tokens one calibration segment needs.")
        return torch.tensor(rows, dtype=torch.long)
    if tokenizer is None:
        raise ValueError("Calibration text needs the model's tokenizer: search_factors(..., tokenizer=tokenizer).")
    from hf_posext.text_sources import load_documents
    from hf_posext.evaluation.perplexity import make_segments, tokenize_documents, uses_bos

    documents = [str(d) for d in data] if isinstance(data, (list, tuple)) else load_documents(data, text_field=text_field)
    token_docs = tokenize_documents(tokenizer, documents, concatenate=True)
    found, _ = make_segments(token_docs, target_length, segments, uses_bos(tokenizer, bos))
    return torch.tensor([ids for _, _, ids in found], dtype=torch.long)


calibration_windows = calibration_segments  # its name before evaluation segments were called segments


def _key(factors: torch.Tensor) -> tuple[float, ...]:
    return tuple(round(float(v), 4) for v in factors)


def _mutate(parent: torch.Tensor, generator: torch.Generator, rate: float, scale: float, max_factor: float) -> torch.Tensor:
    chosen = torch.rand(parent.shape, generator=generator, dtype=torch.float64) < rate
    if not bool(chosen.any()):
        chosen[int(torch.randint(parent.numel(), (1,), generator=generator))] = True
    noise = torch.exp(torch.randn(parent.shape, generator=generator, dtype=torch.float64) * scale)
    return make_monotone(torch.where(chosen, parent * noise, parent), max_factor)


def _crossover(first: torch.Tensor, second: torch.Tensor, generator: torch.Generator, max_factor: float) -> torch.Tensor:
    cut = int(torch.randint(1, first.numel(), (1,), generator=generator)) if first.numel() > 1 else 0
    return make_monotone(torch.cat((first[:cut], second[cut:])), max_factor)


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


@dataclass(frozen=True)
class _Breeding:
    """How children are drawn: the search's evolution settings and its random generator."""

    mutation_rate: float
    mutation_scale: float
    crossover_fraction: float
    max_factor: float
    generator: torch.Generator

    def mutate(self, parent: torch.Tensor) -> torch.Tensor:
        return _mutate(parent, self.generator, self.mutation_rate, self.mutation_scale, self.max_factor)

    def child(self, parents: list[torch.Tensor], seen: set[tuple[float, ...]]) -> torch.Tensor:
        """A crossover of two parents (share ``crossover_fraction``; mutated if already ``seen``), else a
        mutation of one."""
        if len(parents) > 1 and float(torch.rand((), generator=self.generator)) < self.crossover_fraction:
            a, b = torch.randperm(len(parents), generator=self.generator)[:2].tolist()
            child = _crossover(parents[a], parents[b], self.generator, self.max_factor)
            return self.mutate(child) if _key(child) in seen else child
        return self.mutate(parents[int(torch.randint(len(parents), (1,), generator=self.generator))])


@dataclass
class _Population:
    """Every candidate evaluated so far: its fitness (mean NLL), its factors and its record."""

    fitness: dict[tuple[float, ...], float] = field(default_factory=dict)
    vectors: dict[tuple[float, ...], torch.Tensor] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)

    @classmethod
    def resumed_from(cls, previous: SearchResult | None) -> "_Population":
        population = cls()
        for record in previous.candidates if previous is not None else []:
            values = torch.tensor(record["long_factor"], dtype=torch.float64)
            population.fitness[_key(values)], population.vectors[_key(values)] = float(record["nll"]), values
            if record.get("seconds"):
                population.eval_seconds.append(float(record["seconds"]))
            population.records.append(dict(record))
        return population

    def ranked(self) -> list[tuple[float, ...]]:
        return sorted(self.fitness, key=lambda k: self.fitness[k])

    def best_nll(self) -> float:
        return self.fitness[self.ranked()[0]]

    def seconds_per_candidate(self) -> float:
        return sum(self.eval_seconds) / max(1, len(self.eval_seconds))

    def new(self, candidates: list[torch.Tensor]) -> list[tuple[tuple[float, ...], torch.Tensor]]:
        """The candidates not evaluated yet, each once, as ``(key, factors)``."""
        todo: dict[tuple[float, ...], torch.Tensor] = {}
        for candidate in candidates:
            if _key(candidate) not in self.fitness:
                todo.setdefault(_key(candidate), candidate)
        return list(todo.items())

    def add(self, todo: list[tuple[tuple[float, ...], torch.Tensor]], scores: list[tuple], generation: int) -> None:
        """Record the gathered ``(key, nll, seconds)`` scores of ``todo``, in ``todo``'s order."""
        seconds_of = {}
        for key, value, seconds in scores:
            self.fitness[key], seconds_of[key] = value, seconds
            self.eval_seconds.append(seconds)
        for key, candidate in todo:
            self.vectors[key] = candidate
            self.records.append({"long_factor": [float(v) for v in candidate], "nll": self.fitness[key],
                                 "generation": generation, "seconds": seconds_of[key]})

    def children(self, count: int, parent_keys: list[tuple[float, ...]], breeding: _Breeding) -> list[torch.Tensor]:
        """Up to ``count`` new candidates bred from ``parent_keys``, none evaluated or drawn before."""
        made: list[torch.Tensor] = []
        seen = set(self.fitness)
        parents = [self.vectors[key] for key in parent_keys]
        for _ in range(50 * count):
            if len(made) >= count:
                break
            child = breeding.child(parents, seen)
            if _key(child) not in seen:
                seen.add(_key(child))
                made.append(child)
        return made


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


def _first_generation(starts: dict[str, torch.Tensor], size: int, breeding: _Breeding) -> list[torch.Tensor]:
    """The distinct starting points, filled up to ``size`` with mutations of them."""
    first: list[torch.Tensor] = []
    for values in starts.values():
        if all(_key(values) != _key(c) for c in first):
            first.append(values)
    seeds = list(first)
    while len(first) < size:
        extra = breeding.mutate(seeds[int(torch.randint(len(seeds), (1,), generator=breeding.generator))])
        if all(_key(extra) != _key(c) for c in first):
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
    pool: _Population
    breeding: _Breeding
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
        self.initial_nll = {name: self.pool.fitness[_key(values)] for name, values in starts.items()}
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
    model: nn.Module,
    target_length: int,
    data: Any,
    *,
    tokenizer: Any = None,
    segments: int = 1,
    population: int = 8,
    generations: int = 4,
    parents: int = 3,
    mutation_rate: float = 0.3,
    mutation_scale: float = 0.15,
    crossover_fraction: float = 0.5,
    max_factor: float | None = None,
    original_max_position_embeddings: int | None = None,
    time_budget_s: float | None = None,
    chunk_size: int = 2048,
    seed: int = 0,
    output: str | os.PathLike | None = None,
    progress: bool = True,
    bos: str = "auto",
    text_field: str | None = None,
    start_from: Any = None,
    resume: str | os.PathLike | SearchResult | None = None,
    windows: int | None = None,
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
            window and calibration segments) to continue: its candidates are not evaluated again, it
            goes on with up to ``generations`` more generations, and ``time_budget_s`` counts this run
            only. With ``output``, the JSON is rewritten after every generation, so a search that was
            stopped (time budget, crash) resumes from its last finished generation. The children drawn
            after a resume differ from those an uninterrupted run would have drawn.
        windows: the old name of ``segments`` (a FutureWarning). The result's settings keep the key
            ``"windows"`` for the number of segments, as files written before the rename do.

    Returns:
        A :class:`SearchResult`; ``result.best_nll <= min(result.initial_nll.values())`` always.

    Raises:
        ValueError: bad settings, a patched model, a target inside the original window, too little data.

    Example:
        >>> result = hf_posext.search_factors(model, 16384, "books/", tokenizer=tok, output="factors.json")
        >>> hf_posext.patch(model, "longrope", factor=result.factor, factors="factors.json")
    """
    from hf_posext.api import patched_backend, unpatch
    from hf_posext.lm.distributed import Distributed

    start_time = time.perf_counter()
    segments = renamed_keyword("windows", windows, "segments", segments, 1)
    _check_search_settings(target_length, segments, population, generations, parents, mutation_rate, mutation_scale,
                           crossover_fraction)
    target = _rotary_target(model, target_length, original_max_position_embeddings)
    max_factor = float(max_factor) if max_factor is not None else 2.0 * target.scale
    if max_factor < target.scale:
        raise ValueError(f"max_factor ({max_factor}) must be at least the scale s = {target.scale:g} (PI's factor).")
    if resume is not None and start_from is not None:
        raise ValueError("Give start_from= (seed a new search) or resume= (continue one), not both.")
    previous = [] if start_from is None else list(start_from) if isinstance(start_from, (list, tuple)) else [start_from]
    carried = [rescale_factors(item, target.scale, dim=target.dim, original_length=target.original_length) for item in previous]
    ids = calibration_segments(data, target_length, segments, tokenizer, bos=bos, text_field=text_field)
    calibration_sha1 = hashlib.sha1(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    resumed = _resumable(resume, target_length, target.original_length, target.dim, calibration_sha1)
    dist = Distributed()
    settings = {
        "population": population, "generations": generations, "parents": parents, "mutation_rate": mutation_rate,
        "mutation_scale": mutation_scale, "crossover_fraction": crossover_fraction, "max_factor": max_factor,
        "windows": int(ids.shape[0]), "seed": seed, "processes": dist.world_size, "time_budget_s": time_budget_s,
        "start_from": [str(item) if isinstance(item, (str, os.PathLike)) else type(item).__name__ for item in previous],
        "calibration_sha1": calibration_sha1,
        "resumed_from": None if resume is None else str(resume) if isinstance(resume, (str, os.PathLike)) else "SearchResult",
    }
    search = _Search(
        target=target, target_length=target_length, settings=settings, pool=_Population.resumed_from(resumed),
        breeding=_Breeding(mutation_rate, mutation_scale, crossover_fraction, max_factor, torch.Generator().manual_seed(seed)),
        score=_candidate_scorer(model, target, ids, chunk_size, progress, dist), output=output, is_main=dist.is_main,
        start_time=start_time, seconds_before=float(resumed.seconds) if resumed is not None else 0.0,
    )
    try:
        if resumed is None:
            search.first_generation(_starting_points(target, carried, max_factor), population)
        else:
            search.initial_nll, search.history = dict(resumed.initial_nll), [e for e in resumed.history if "best_nll" in e]
        search.more_generations(generations, population - parents, parents, dist.world_size, time_budget_s)
    finally:
        if patched_backend(model) is not None:
            unpatch(model)
    found = search.result()
    if output is not None and dist.is_main:
        found.save(output)
    dist.barrier()
    return found
