"""The suite's samples on disk: the RULER sample cache and the per-sample results files.

RULER samples are generated once per (task, tokenizer hash, length, seed) and cached (:class:`SampleCache`): every
row with that tokenizer reads the same samples, and the key is written to every results file. Each sample's
response, score and timings go to one JSON-lines file per (row, task, length) (:class:`SampleResults`), so that a
killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable

from hf_posext.core.errors import DamagedFileError
from hf_posext.core.files import write_text_atomic
from hf_posext.core.integrity import json_digest, stable_digest

__all__ = ["SAMPLE_RECORD_VERSION", "tokenizer_hash", "sample_cache_key", "SampleCache", "SampleResultsError", "SampleResults",
           "header_differences", "read_sample_records", "DeferredSampleWrites"]


#: Bump when the per-sample record changes meaning.
SAMPLE_RECORD_VERSION = 1


def tokenizer_hash(tokenizer: Any) -> str:
    """A hash of what a tokenizer does (not of its files): its class, backend model and special tokens.

    Two folders holding the same tokenizer with a different ``model_max_length`` (``hf-posext patch`` sets it)
    hash the same, so a base model and its fine-tune share their RULER samples.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = json.loads(backend.to_str())
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        body = sorted(vocab.items())
    description = {
        "class": type(tokenizer).__name__.removesuffix("Fast"),
        "backend": body,
        "special": {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
        "added": sorted(str(token) for token in getattr(tokenizer, "all_special_tokens", [])),
    }
    return stable_digest(description)  # sha256, 16 hex digits: the sample caches of earlier runs are keyed by it


def sample_cache_key(task: str, task_version: Any, tokenizer_key: str, length: int, seed: int, generator_version: str) -> dict[str, Any]:
    """The key under which a task's samples are generated once and shared by every row with that tokenizer."""
    return {"task": task, "task_version": str(task_version), "tokenizer": tokenizer_key, "length": int(length),
            "seed": int(seed), "lm_eval": generator_version}


def _key_name(key: dict[str, Any]) -> str:
    digest = stable_digest(key, length=10, algorithm="sha1")  # the names earlier runs wrote their samples under
    return f"{key['task']}-{key['length']}-seed{key['seed']}-{key['tokenizer'][:8]}-{digest}.json"


class SampleCache:
    """RULER samples on disk, one JSON file per key (:func:`sample_cache_key`): ``{"key", "docs"}``.

    ``get`` returns the first ``n`` docs when the file holds at least ``n``; ``put`` writes atomically, with a digest
    of the docs. A file whose key does not match its name, whose docs do not match their digest, or that is not
    JSON, is named in the error, never reused.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    def path(self, key: dict[str, Any]) -> Path:
        return self.folder / _key_name(key)

    def get(self, key: dict[str, Any], n: int) -> list[dict[str, Any]] | None:
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DamagedFileError(f"RULER sample cache {path} is not readable JSON ({type(error).__name__}); "
                                   "delete it to generate the samples again.") from None
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("docs"), list):
            raise DamagedFileError(f"RULER sample cache {path} does not hold the samples of {key}; delete it to generate them again.")
        docs = data["docs"]
        if data.get("digest") is None:  # a cache before digests has none: read as it is, and said once
            warnings.warn(f"RULER sample cache {path} has no digest (written before digests, or removed by hand), so an "
                          "edit of its docs cannot be detected; delete it to generate the samples again with one.", stacklevel=2)
        elif data["digest"] != json_digest(docs):
            raise DamagedFileError(f"RULER sample cache {path}: its docs do not match their digest (edited after they were "
                                   "generated); delete it to generate the samples again.")
        return docs[:n] if len(docs) >= n else None

    def stored(self, key: dict[str, Any]) -> list[dict[str, Any]]:
        """Every doc stored under ``key`` ([] when none)."""
        if self.get(key, 0) is None:
            return []
        return json.loads(self.path(key).read_text(encoding="utf-8"))["docs"]

    def put(self, key: dict[str, Any], docs: list[dict[str, Any]]) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": key, "digest": json_digest(docs), "docs": docs}, default=str))
        return path


# ------------------------------------------------------------------ per-sample results


class SampleResultsError(DamagedFileError):
    """A per-sample results file that cannot be used; the message names the file and the line."""


_SAMPLE_FIELDS = {"doc_id": int, "score": (int, float), "response": str}


class SampleResults:
    """One JSON-lines file per (row, task, length): a header line (the row, the sample-cache key), then one
    line per finished sample. A killed run loses at most the sample it was computing; a line that is not a
    complete record (other than a cut-off last line, which a kill leaves) is named and the file refused.

    Args:
        path: the ``.jsonl`` file.
        header: what identifies the cell (model, method request, task, length, sample key, dtype) and its row's
            label; an existing file with another header is refused (it holds another cell's samples), one that
            differs only in the label is read.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.header = {"record_version": SAMPLE_RECORD_VERSION, **header}
        self.records: dict[int, dict[str, Any]] = {}
        if self.path.exists():
            self._read()

    def _read(self) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline, else a line a kill cut off
        for number, line in enumerate(lines, start=1):
            self._take(number, line)
        if tail.strip():
            try:
                self._take(len(lines) + 1, tail)
                lines.append(tail)
            except SampleResultsError:
                pass  # the sample being written when the run was killed: computed again
            self.path.write_bytes(b"".join(line + b"\n" for line in lines))

    def _take(self, number: int, line: bytes) -> None:
        if number == 1:
            value = _json_line(self.path, number, line)
            if _identity(value) != _identity(self.header):
                differences = header_differences(_identity(value), _identity(self.header))
                raise SampleResultsError(f"{self.path} holds another cell's samples ({'; '.join(differences)}); move the "
                                         "file away to compute this cell anew, or run with the settings it was made with.")
            return
        value = _sample_line(self.path, number, line)
        self.records[int(value["doc_id"])] = value

    def has(self, doc_id: int) -> bool:
        return doc_id in self.records

    def add(self, record: dict[str, Any]) -> None:
        problem = _sample_problem(record)
        if problem:
            raise ValueError(f"sample record {problem}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a", encoding="utf-8") as handle:
            if new:
                handle.write(json.dumps(self.header, default=str) + "\n")
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records[int(record["doc_id"])] = record

    def scores(self, doc_ids: Iterable[int]) -> list[float]:
        return [float(self.records[i]["score"]) for i in doc_ids if i in self.records]


#: Header fields that only present a cell (its row's label): a file whose header differs in them alone holds
#: the same cell's samples (a label written by an older release reads as the same row).
_PRESENTATION_FIELDS = ("row",)


def header_differences(there: Any, here: Any, field: str = "", most: int = 3) -> list[str]:
    """Where two sample-file headers differ, as ``"FIELD is A in the file, B in this run"`` (nested fields dotted:
    ``sample_key.tokenizer``), at most ``most`` of them, so that a refusal names what changed in one line."""
    if not (isinstance(there, dict) and isinstance(here, dict)):
        return [] if there == here else [f"{field or 'the header'} is {there!r} in the file, {here!r} in this run"]
    found: list[str] = []
    for key in sorted(set(there) | set(here), key=str):
        name = f"{field}.{key}" if field else str(key)
        if key not in there or key not in here:
            found.append(f"{name} is {'in this run only' if key not in there else 'in the file only'}")
        else:
            found += header_differences(there[key], here[key], name, most)
        if len(found) >= most:
            break
    return found[:most]


def _identity(header: Any) -> Any:
    return {k: v for k, v in header.items() if k not in _PRESENTATION_FIELDS} if isinstance(header, dict) else header


def _json_line(path: Path, number: int, line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SampleResultsError(f"{path} line {number} is not a JSON record; delete the file to redo this cell's "
                                 "samples, or remove that line.") from None


def _sample_line(path: Path, number: int, line: bytes) -> dict[str, Any]:
    """Line ``number`` of a per-sample results file as a sample record, or SampleResultsError naming it."""
    value = _json_line(path, number, line)
    problem = _sample_problem(value)
    if problem:
        raise SampleResultsError(f"{path} line {number} {problem}; delete the file to redo this cell's samples.")
    return value


def _sample_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "is not an object"
    for name, kind in _SAMPLE_FIELDS.items():
        if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
            return f"lacks its {name!r}"
    if not 0 <= value["score"] <= 1:
        return f"has score {value['score']!r}, outside [0, 1]"
    return None


def read_sample_records(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """A per-sample results file's records by doc id, read without changing the file (a run may be appending
    to it: a last line without its newline is the sample being written, and is left out).

    Raises:
        FileNotFoundError: no such file.
        SampleResultsError: a line that is not a complete sample record (the message names the file and line).
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    lines.pop()  # b"" after the last newline, or the line being written
    records: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines[1:], start=2):
        value = _sample_line(path, number, line)
        records[int(value["doc_id"])] = value
    return records


class DeferredSampleWrites:
    """A :class:`SampleCache` whose writes wait for :meth:`flush` (reads see them).

    A suite draws every cell's RULER samples before it checks that each cell fits its row's window and the harness's
    ``--max-length`` (the budget needs the prompts' lengths). A refused run must leave nothing behind, so the samples
    it draws wait here, in memory, until :meth:`flush` writes them after the last check.
    """

    def __init__(self, cache: SampleCache) -> None:
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
