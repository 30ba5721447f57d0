"""The RoPE fields of a saved ``config.json`` that older readers need, and atomic edits of saved JSON files.

transformers 5 saves only ``rope_parameters``. transformers 4.x (and the serving runtimes built on it)
read a top-level ``rope_theta`` and ``rope_scaling`` instead: without them they load theta = 10000 and
no scaling. transformers 5 itself reads ``rope_scaling`` first when both are present, so the copy must
equal ``rope_parameters``. Setting ``config.rope_scaling`` in memory does not help (in 5.x it only
aliases ``rope_parameters``), so these fields can only be written into the saved file.

``hf-posext export`` writes them; a plain ``save_pretrained`` does not, because transformers 5.24 cannot
read them back through the generic ``PreTrainedConfig.from_json_file``: with ``rope_scaling`` and
``rope_theta`` present and a ``yarn``, ``llama3`` or ``longrope`` type, it raises ``AttributeError: ...
no attribute 'max_position_embeddings'``, and ``Trainer`` calls exactly that when it resumes from a
checkpoint. :func:`older_readers_differ` tells a save when to warn instead.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["flat_rope_parameters", "with_legacy_rope_fields", "older_readers_differ", "write_json_atomically",
           "set_tokenizer_max_length"]

#: The rotary base transformers 4.x assumes when a config has no ``rope_theta``.
LEGACY_DEFAULT_THETA = 10000.0


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


def older_readers_differ(config: dict[str, Any]) -> bool:
    """True when transformers 4.x would load ``config`` as another model than transformers 5 does.

    That is a transformers 5 layout (``rope_parameters`` without the legacy fields) with a scaling
    ``rope_type`` or a base other than 4.x's default of 10000.
    """
    params = flat_rope_parameters(config)
    if params is None or "rope_parameters" not in config or with_legacy_rope_fields(config) == config:
        return False
    return params.get("rope_type", "default") != "default" or float(params.get("rope_theta", 0)) != LEGACY_DEFAULT_THETA


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
