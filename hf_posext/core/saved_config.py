"""The RoPE fields of a saved ``config.json`` that older readers need, and atomic edits of saved JSON files.

transformers 5 saves only ``rope_parameters``. transformers 4.x (and the serving runtimes built on it)
read a top-level ``rope_theta`` and ``rope_scaling`` instead: without them they load theta = 10000 and
no scaling. transformers 5 itself reads ``rope_scaling`` first when both are present, so the copy must
equal ``rope_parameters``. Setting ``config.rope_scaling`` in memory does not help (in 5.x it only
aliases ``rope_parameters``), so these fields are written into the saved file after ``save_pretrained``.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["flat_rope_parameters", "with_legacy_rope_fields", "write_json_atomically", "add_legacy_rope_fields",
           "set_tokenizer_max_length"]


def flat_rope_parameters(config: dict[str, Any]) -> dict[str, Any] | None:
    """The one RoPE dict of a saved config (``rope_parameters``, else ``rope_scaling``); None when there is
    none or it is nested per layer type (Gemma 3), which no legacy field can express."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(params, dict) or "rope_type" not in params and "type" not in params:
        return None
    return dict(params)


def with_legacy_rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` plus the fields transformers 4.x reads, all equal to what transformers 5 reads.

    Args:
        config: a parsed ``config.json``.

    Returns:
        A new dict with a top-level ``rope_theta`` and a ``rope_scaling`` copy identical to
        ``rope_parameters``; for ``longrope`` also a top-level ``original_max_position_embeddings``
        (transformers 4.57's ``_compute_longrope_parameters`` reads the window only there, and
        transformers 5 gives that field priority, so both agree). Unchanged when there is no flat RoPE dict
        with a ``rope_theta`` (a 4.x save already has the legacy fields).
    """
    result = copy.deepcopy(config)
    params = flat_rope_parameters(config)
    if params is None or "rope_theta" not in params or "rope_parameters" not in config:
        return result
    result["rope_parameters"] = params
    result["rope_scaling"] = copy.deepcopy(params)
    result["rope_theta"] = params["rope_theta"]
    if params.get("rope_type") == "longrope" and params.get("original_max_position_embeddings"):
        result["original_max_position_embeddings"] = params["original_max_position_embeddings"]
    return result


def write_json_atomically(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename (never half-written)."""
    path = Path(path)
    handle, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(staged, path)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise


def add_legacy_rope_fields(folder: str | os.PathLike) -> bool:
    """Rewrite ``folder/config.json`` with :func:`with_legacy_rope_fields` (atomically); True when it changed."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    updated = with_legacy_rope_fields(config)
    if updated == config:
        return False
    write_json_atomically(path, updated)
    return True


def set_tokenizer_max_length(folder: str | os.PathLike, length: int) -> bool:
    """Set ``model_max_length`` in ``folder/tokenizer_config.json`` if that file exists; True when it changed."""
    path = Path(folder) / "tokenizer_config.json"
    if not path.exists():
        return False
    data = json.loads(path.read_text())
    if data.get("model_max_length") == length:
        return False
    data["model_max_length"] = length
    write_json_atomically(path, data)
    return True
