"""RULER samples kept back until a card run is known to go on.

A card draws every cell's RULER samples before it checks that each cell fits its row's window and the harness's
``--max-length`` (the budget needs the prompts' lengths). A refused run must leave nothing behind, so the samples it
draws wait here, in memory, until :meth:`DeferredSampleWrites.flush` writes them after the last check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DeferredSampleWrites"]


class DeferredSampleWrites:
    """A :class:`~hf_posext.evaluation.card.SampleCache` whose writes wait for :meth:`flush` (reads see them)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.pending: dict[Path, tuple[dict[str, Any], list[dict[str, Any]]]] = {}

    def path(self, key: dict[str, Any]) -> Path:
        return self.cache.path(key)

    def get(self, key: dict[str, Any], n: int) -> list[dict[str, Any]] | None:
        if self.path(key) in self.pending:
            docs = self.pending[self.path(key)][1]
            return docs[:n] if len(docs) >= n else None
        return self.cache.get(key, n)

    def stored(self, key: dict[str, Any]) -> list[dict[str, Any]]:
        if self.path(key) in self.pending:
            return list(self.pending[self.path(key)][1])
        return self.cache.stored(key)

    def put(self, key: dict[str, Any], docs: list[dict[str, Any]]) -> Path:
        self.pending[self.path(key)] = (key, list(docs))
        return self.path(key)

    def flush(self) -> None:
        """Write every sample set kept back (atomically, one file each)."""
        for key, docs in self.pending.values():
            self.cache.put(key, docs)
        self.pending.clear()
