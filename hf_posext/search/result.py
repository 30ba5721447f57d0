"""The result of a LongRoPE factor search: the JSON that ``patch(model, "longrope", factors=PATH)`` reads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SearchResult", "read_result_json"]


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
        data = read_result_json(path, "search result")
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


def read_result_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON at ``path``; ValueError naming ``what`` when it is missing or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: no file {str(path)!r}; give the JSON an earlier search_factors run wrote.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{what}: {str(path)!r} is not JSON ({error}).") from error
