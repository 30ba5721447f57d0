"""The RoPE fields of a saved ``config.json`` that older readers need, and atomic edits of saved JSON files.

transformers 5 saves only ``rope_parameters``. transformers 4.x (and the serving runtimes built on it)
read a top-level ``rope_theta`` and ``rope_scaling`` instead: without them they load their class's default
theta (10000 for Llama) and no scaling. transformers 5 itself reads ``rope_scaling`` first when both are
present, so the copy must equal ``rope_parameters``. Setting ``config.rope_scaling`` in memory does not help
(in 5.x it only aliases ``rope_parameters``), so these fields can only be written into the saved file.

Two forms:

- :func:`with_legacy_rope_fields`, the full form (``hf-posext export`` writes it): top-level ``rope_theta``,
  ``rope_scaling``, and longrope's top-level window.
- :func:`plain_save_legacy_fields`, what a plain ``save_pretrained`` writes: the full form where
  transformers 5.24's generic ``PreTrainedConfig.from_json_file`` (which ``Trainer`` runs when it resumes
  from a checkpoint) can read it back. It cannot for a ``yarn``, ``llama3`` or ``longrope`` type next to a
  top-level ``rope_theta``: ``PreTrainedConfig.__post_init__`` then standardises the RoPE dict before it
  has set any other key, and ``standardize_rope_params`` reads ``self.max_position_embeddings`` (raising
  ``AttributeError``). Without the top-level ``rope_theta`` the generic reader skips that step, and 4.x
  reads its class's default theta: right only when the saved theta is that default. Otherwise no form
  serves all three readers (``bench/legacy_rope_fields.py``), and :func:`older_readers_differ` tells the
  save to warn.

A saved tokenizer's ``model_max_length`` is the served length too (serving runtimes cap the length there; vLLM:
docs/serving.md): :func:`save_tokenizer_with_max_length` saves a tokenizer object with it, the one place that does,
and :func:`set_tokenizer_max_length` edits it in tokenizer files already saved (a copied folder).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from hf_posext.core.files import write_json_atomic

__all__ = ["flat_rope_parameters", "with_legacy_rope_fields", "plain_save_legacy_fields", "older_readers_differ",
           "legacy_default_theta", "write_json_atomically", "set_tokenizer_max_length",
           "save_tokenizer_with_max_length"]

#: The rotary base transformers 4.x assumes when a config has no ``rope_theta`` (most classes).
LEGACY_DEFAULT_THETA = 10000.0

#: transformers 4.57.6 config classes whose ``rope_theta`` default is not 10000 (``inspect.signature`` of each
#: class in ``CONFIG_MAPPING_NAMES``, run in ``.venv-tf457``).
LEGACY_OTHER_DEFAULT_THETAS = {
    "apertus": 12e6, "bitnet": 5e5, "blt": 5e5, "csm": 5e5, "dinov3_vit": 100.0, "ernie4_5": 5e5,
    "ernie4_5_moe": 5e5, "evolla": 5e5, "falcon_h1": 1e5, "flex_olmo": 5e5, "fuyu": 25000.0,
    "gemma3_text": 1e6, "gemma3n_text": 1e6, "gpt_oss": 150000.0, "helium": 1e5, "kyutai_speech_to_text": 1e5,
    "lfm2": 1e6, "llama4_text": 5e5, "longcat_flash": 1e7, "minimax": 1e6, "mixtral": 1e6, "persimmon": 25000.0,
    "phimoe": 1e6, "qwen2_5_vl_text": 1e6, "qwen2_vl_text": 1e6, "qwen3_vl_moe_text": 5e6,
    "qwen3_vl_text": 5e6, "smollm3": 2e6,
}

#: Rope types whose legacy ``rope_scaling`` next to a top-level ``rope_theta`` transformers 5.24's generic
#: ``PreTrainedConfig`` cannot read (its ``standardize_rope_params`` needs ``max_position_embeddings``).
GENERIC_READER_FAILS_WITH_THETA = frozenset({"llama3", "yarn", "longrope"})


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


def legacy_default_theta(model_type: str | None) -> float:
    """The ``rope_theta`` transformers 4.57 assumes for ``model_type`` when config.json has none."""
    return LEGACY_OTHER_DEFAULT_THETAS.get(model_type or "", LEGACY_DEFAULT_THETA)


def plain_save_legacy_fields(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` plus the legacy fields in the form that transformers 5 (``from_pretrained`` and the generic
    ``PreTrainedConfig.from_json_file``) and 4.57 all read as the same model, where one exists.

    Args:
        config: a parsed ``config.json`` (transformers 5 layout).

    Returns:
        A new dict: the full form of :func:`with_legacy_rope_fields` for rope types other than
        :data:`GENERIC_READER_FAILS_WITH_THETA`; for those, the same without the top-level ``rope_theta``
        when the saved theta is 4.57's default for the model type; otherwise ``config`` unchanged.
    """
    full = with_legacy_rope_fields(config)
    params = flat_rope_parameters(full)
    if params is None or full == config:
        return full
    if params.get("rope_type", params.get("type")) not in GENERIC_READER_FAILS_WITH_THETA:
        return full
    if float(params["rope_theta"]) != legacy_default_theta(config.get("model_type")):
        return copy.deepcopy(config)
    del full["rope_theta"]
    return full


def older_readers_differ(config: dict[str, Any]) -> bool:
    """True when transformers 4.x would load ``config`` as another model than transformers 5 does.

    4.x reads the top-level ``rope_theta`` (else its class default), ``rope_scaling`` (else no scaling) and,
    for longrope, the top-level ``original_max_position_embeddings``. Configs without a transformers 5 flat
    ``rope_parameters`` dict (4.x saves, Gemma 3's nested dicts) are never reported.
    """
    params = flat_rope_parameters(config)
    if params is None or "rope_parameters" not in config or "rope_theta" not in params:
        return False
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = config.get("rope_theta", legacy_default_theta(config.get("model_type")))
    if float(theta) != float(params["rope_theta"]):
        return True
    if rope_type != "default" and config.get("rope_scaling") != params:
        return True
    window = params.get("original_max_position_embeddings")
    return rope_type == "longrope" and bool(window) and config.get("original_max_position_embeddings") != window


def write_json_atomically(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename (never half-written)."""
    write_json_atomic(path, data, sort_keys=True, final_newline=True)


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


def save_tokenizer_with_max_length(tokenizer: Any, folder: str | os.PathLike, length: int) -> None:
    """Set ``tokenizer.model_max_length = length`` (the object keeps it), then save the tokenizer into ``folder``.

    Args:
        tokenizer: a transformers tokenizer.
        folder: where to save it (``tokenizer.save_pretrained``).
        length: the served length, a patched model's current window (``describe(model).current_window``).
    """
    tokenizer.model_max_length = length
    tokenizer.save_pretrained(os.fspath(folder))
