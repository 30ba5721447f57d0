"""The evolution of a LongRoPE factor search: mutation, crossover and the pool of evaluated candidates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hf_posext.search.factors import make_monotone
from hf_posext.search.result import SearchResult

__all__ = ["factor_key", "mutate", "crossover", "Breeding", "Population"]


def factor_key(factors: torch.Tensor) -> tuple[float, ...]:
    return tuple(round(float(v), 4) for v in factors)


def mutate(parent: torch.Tensor, generator: torch.Generator, rate: float, scale: float, max_factor: float) -> torch.Tensor:
    chosen = torch.rand(parent.shape, generator=generator, dtype=torch.float64) < rate
    if not bool(chosen.any()):
        chosen[int(torch.randint(parent.numel(), (1,), generator=generator))] = True
    noise = torch.exp(torch.randn(parent.shape, generator=generator, dtype=torch.float64) * scale)
    return make_monotone(torch.where(chosen, parent * noise, parent), max_factor)


def crossover(first: torch.Tensor, second: torch.Tensor, generator: torch.Generator, max_factor: float) -> torch.Tensor:
    cut = int(torch.randint(1, first.numel(), (1,), generator=generator)) if first.numel() > 1 else 0
    return make_monotone(torch.cat((first[:cut], second[cut:])), max_factor)


@dataclass(frozen=True)
class Breeding:
    """How children are drawn: the search's evolution settings and its random generator."""

    mutation_rate: float
    mutation_scale: float
    crossover_fraction: float
    max_factor: float
    generator: torch.Generator

    def mutate(self, parent: torch.Tensor) -> torch.Tensor:
        return mutate(parent, self.generator, self.mutation_rate, self.mutation_scale, self.max_factor)

    def child(self, parents: list[torch.Tensor], seen: set[tuple[float, ...]]) -> torch.Tensor:
        """A crossover of two parents (share ``crossover_fraction``; mutated if already ``seen``), else a
        mutation of one."""
        if len(parents) > 1 and float(torch.rand((), generator=self.generator)) < self.crossover_fraction:
            a, b = torch.randperm(len(parents), generator=self.generator)[:2].tolist()
            child = crossover(parents[a], parents[b], self.generator, self.max_factor)
            return self.mutate(child) if factor_key(child) in seen else child
        return self.mutate(parents[int(torch.randint(len(parents), (1,), generator=self.generator))])


@dataclass
class Population:
    """Every candidate evaluated so far: its fitness (mean NLL), its factors and its record."""

    fitness: dict[tuple[float, ...], float] = field(default_factory=dict)
    vectors: dict[tuple[float, ...], torch.Tensor] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)

    @classmethod
    def resumed_from(cls, previous: SearchResult | None) -> "Population":
        population = cls()
        for record in previous.candidates if previous is not None else []:
            values = torch.tensor(record["long_factor"], dtype=torch.float64)
            population.fitness[factor_key(values)], population.vectors[factor_key(values)] = float(record["nll"]), values
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
            if factor_key(candidate) not in self.fitness:
                todo.setdefault(factor_key(candidate), candidate)
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

    def children(self, count: int, parent_keys: list[tuple[float, ...]], breeding: Breeding) -> list[torch.Tensor]:
        """Up to ``count`` new candidates bred from ``parent_keys``, none evaluated or drawn before."""
        made: list[torch.Tensor] = []
        seen = set(self.fitness)
        parents = [self.vectors[key] for key in parent_keys]
        for _ in range(50 * count):
            if len(made) >= count:
                break
            child = breeding.child(parents, seen)
            if factor_key(child) not in seen:
                seen.add(factor_key(child))
                made.append(child)
        return made
