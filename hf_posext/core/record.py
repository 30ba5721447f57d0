"""The saved record (``config.hf_posext``), the report :func:`hf_posext.describe` returns, and config
snapshot/restore: the one copy of each, shared by every backend.

The record is what ``save_pretrained`` writes into ``config.json`` under :data:`CONFIG_KEY`::

    {"version": 1, "kind": "rope", "method": "yarn", "factor": 4.0,
     "original_max_position_embeddings": 2048, "params": {...}, ...backend fields}

Records written before versioning (no ``version``) are read as version 1.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hf_posext.core.errors import RecordError
from hf_posext.core.integrity import stable_digest
from hf_posext.methods import METHODS, kinds_of

__all__ = [
    "CONFIG_KEY",
    "FREQUENCY_FIELD",
    "RECORD_VERSION",
    "ABSENT",
    "ScalingReport",
    "config_attribute",
    "snapshot_config",
    "restore_config",
    "jsonable",
    "make_record",
    "validate_record",
    "DIGEST_FIELD",
    "record_digest",
    "seal_record",
    "text_config",
]

#: Name of the config attribute (and config.json key) holding hf_posext's record of a scaling.
CONFIG_KEY = "hf_posext"
#: The field of a composition's record (an attention-level method, kind ``attention``) that holds the record
#: of the frequency scaling it is stacked on (``yarn+string``): ``config.hf_posext`` holds one record.
FREQUENCY_FIELD = "frequency_scaling"
#: Version of the record layout written by this release.
RECORD_VERSION = 1
#: Marks a config field that did not exist (in snapshots; survives a JSON round trip as this text).
ABSENT = "__absent__"
_REQUIRED_FIELDS = ("method", "factor", "original_max_position_embeddings")
#: The field of a record that holds :func:`record_digest` of the rest of it, as the record was saved: a record edited
#: by hand (a factor, a window, its ``original_config``) no longer matches it. Records saved before it have none.
DIGEST_FIELD = "digest"


@dataclass
class ScalingReport:
    """What :func:`hf_posext.describe` returns; ``str()`` gives a readable summary, ``to_dict()`` a JSON-able one."""

    family: str
    kind: str
    method: str
    factor: float
    original_window: int
    current_window: int
    dynamic: bool
    sites: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    stock_loadable: bool | None = None
    notes: list[str] = field(default_factory=list)
    #: A composition's parts (``yarn+string``: the frequency scaling's report, then the attention method's).
    parts: list["ScalingReport"] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["parts"] = [part.to_dict() for part in self.parts]
        return data

    def __str__(self) -> str:
        lines = [
            f"family:          {self.family}",
            f"position kind:   {self.kind}",
            f"method:          {self.method}" + (f" {self.params}" if self.params else ""),
            f"factor:          {self.factor:g}" + (" (dynamic: depends on the sequence length)" if self.dynamic else ""),
            f"original window: {self.original_window}",
            f"current window:  {self.current_window}",
            f"modules:         {', '.join(self.sites)}",
        ]
        if self.stock_loadable is not None:
            lines.append(
                "saved model:     "
                + ("loads with stock transformers" if self.stock_loadable else "needs hf_posext.load (stock loads it unscaled)")
            )
        lines += [f"note:            {note}" for note in self.notes]
        for part in self.parts:
            lines.append(f"part {part.method}:" + " " * max(1, 11 - len(part.method))
                         + f"{part.kind}, x{part.factor:g}, window {part.original_window} -> {part.current_window}"
                         + (f" {part.params}" if part.params else ""))
        return "\n".join(lines)


def config_attribute(config: Any, key: str) -> str:
    """The attribute a config stores ``key`` under (``n_positions`` for GPT-2's ``max_position_embeddings``)."""
    return getattr(config, "attribute_map", {}).get(key, key)


def snapshot_config(config: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """Deep copies of the config fields ``keys`` (:data:`ABSENT` for a field that is not set)."""
    snapshot = {}
    for key in keys:
        name = config_attribute(config, key)
        snapshot[name] = copy.deepcopy(config.__dict__[name]) if name in config.__dict__ else ABSENT
    return snapshot


def restore_config(config: Any, snapshot: dict[str, Any]) -> None:
    """Put back every field of ``snapshot`` exactly (removing the ones that were :data:`ABSENT`)."""
    for name, value in snapshot.items():
        if isinstance(value, str) and value == ABSENT:
            config.__dict__.pop(name, None)
        else:
            config.__dict__[name] = copy.deepcopy(value)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (what ``save_pretrained`` would write)."""
    return json.loads(json.dumps(value, default=str))


def text_config(config: Any) -> Any:
    """The config holding the language model's fields (the text config of a multimodal config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def make_record(kind: str, method: str, factor: float, original_window: int, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A versioned record of a scaling, ready for ``config.hf_posext``."""
    return {
        "version": RECORD_VERSION,
        "kind": kind,
        "method": method,
        "factor": factor,
        "original_max_position_embeddings": original_window,
        "params": {k: v for k, v in params.items() if v is not None},
        **extra,
    }


def record_digest(record: dict[str, Any]) -> str:
    """A digest of ``record``'s content as saved to JSON (its :data:`DIGEST_FIELD` left out)."""
    content = jsonable({key: value for key, value in record.items() if key != DIGEST_FIELD})
    return stable_digest(content)


def seal_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its :data:`DIGEST_FIELD` set to :func:`record_digest` (written with the record, checked on load)."""
    return {**record, DIGEST_FIELD: record_digest(record)}


def validate_record(record: Any, source: str | os.PathLike) -> dict[str, Any] | None:
    """Check a record read from ``source`` (a config file); None when there is none.

    Args:
        record: the value of ``config.hf_posext`` (None or absent: the model is not scaled by hf_posext).
        source: the file it came from, named in errors.

    Returns:
        The record with ``version`` and ``kind`` filled in (``kind`` defaults to ``"rope"``).

    Raises:
        RecordError: not a dict, a missing or mistyped field, a version that is not a positive integer or is
            newer than this release reads, an unknown kind or method, a kind its method does not have.
    """
    if record is None:
        return None
    where = f"{os.fspath(source)}: field {CONFIG_KEY!r}"
    if not isinstance(record, dict):
        raise RecordError(
            f"{where} must be a mapping written by hf_posext.patch + save_pretrained, got {type(record).__name__} "
            f"{record!r:.60}; remove the field to load the model unscaled, or re-save it with hf_posext."
        )
    fix = f"re-save the model with hf_posext, or remove {CONFIG_KEY!r} to load it unscaled"
    version = record.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise RecordError(f"{where}.version is {version!r}, not a record version (a positive integer); {fix}.")
    if version > RECORD_VERSION:
        raise RecordError(
            f"{where}.version is {version!r}, but this hf_posext reads records up to version {RECORD_VERSION}; "
            "upgrade hf_posext."
        )
    kind = record.get("kind", "rope")
    if not isinstance(kind, str):
        raise RecordError(f"{where}.kind must be the name of a kind of position (e.g. 'rope'), got {kind!r}; {fix}.")
    if kind not in METHODS:
        raise RecordError(f"{where}.kind is {kind!r}, which this hf_posext cannot load; upgrade hf_posext.")
    for name in _REQUIRED_FIELDS:
        if name not in record:
            raise RecordError(
                f"{where} has no {name!r} (it has {sorted(record)}); re-save the model with hf_posext, or remove "
                f"{CONFIG_KEY!r} to load it unscaled."
            )
    method = record["method"]
    if not isinstance(method, str):
        raise RecordError(f"{where}.method must be a method name, got {method!r}.")
    method_kinds = kinds_of(method)
    if not method_kinds:
        raise RecordError(
            f"{where}.method is {method!r}, which this hf_posext does not know (known: "
            f"{', '.join(sorted({name for methods in METHODS.values() for name in methods}))}); upgrade hf_posext, or {fix}."
        )
    if kind not in method_kinds:
        raise RecordError(
            f"{where}.kind is {kind!r}, but its method {method!r} is of kind {' / '.join(map(repr, method_kinds))}: the record "
            f"contradicts itself; {fix}."
        )
    factor = record["factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise RecordError(f"{where}.factor must be a finite number >= 1, got {factor!r}; {fix}.")
    original = record["original_max_position_embeddings"]
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise RecordError(
            f"{where}.original_max_position_embeddings must be a positive integer (the pre-training window), "
            f"got {original!r}; {fix}."
        )
    if "params" in record and not isinstance(record["params"], dict):
        raise RecordError(f"{where}.params must be a mapping of method parameters, got {record['params']!r}.")
    return {**record, "version": version, "kind": kind}
