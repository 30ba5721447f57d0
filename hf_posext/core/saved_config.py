"""The RoPE fields of a saved ``config.json`` that older readers need, and atomic edits of saved JSON files.

transformers 5 saves only ``rope_parameters``. transformers 4.x (and the serving runtimes built on it)
read a top-level ``rope_theta`` and ``rope_scaling`` instead: without them they load their class's default
theta (10000 for Llama) and no scaling. transformers 5 itself reads ``rope_scaling`` first when both are
present, so the copy must equal ``rope_parameters``. Setting ``config.rope_scaling`` in memory does not help
(in 5.x it only aliases ``rope_parameters``), so these fields can only be written into the saved file.

A config whose ``rope_parameters`` is keyed by layer type (Gemma 3, Gemma 3n, OLMo 3, ModernBERT) was saved by
4.x as top-level fields too, each setting some layer types: Gemma 3's ``rope_theta`` and ``rope_scaling`` its global
(``full_attention``) layers and ``rope_local_base_freq`` its sliding ones. transformers 5's config classes still take
those names as arguments and put each where it belongs, so :func:`legacy_layout` reads the layout off the installed
config class (no family list), and the legacy fields are written where every layer type a name sets agrees.

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
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_posext.core.files import write_json_atomic

__all__ = [
    "flat_rope_parameters", "LEGACY_THETA_NAMES", "LegacyLayout", "legacy_layout", "nested_legacy_fields",
    "with_legacy_rope_fields", "plain_save_legacy_fields", "older_readers_differ", "LEGACY_SCALING_IGNORED",
    "older_readers_ignore_scaling", "legacy_default_theta", "check_installed_transformers_reads", "write_json_atomically",
    "set_tokenizer_max_length", "save_tokenizer_with_max_length",
]

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

#: transformers 4.57.6 model types whose rotary module ignores ``rope_scaling`` (it sets ``rope_type = "default"``
#: whatever the config says: ``grep -n '^        self.rope_type = "default"' models/*/modeling_*.py`` in ``.venv-tf457``,
#: Pixtral's vision encoder left out). Stock 4.x loads a scaled save of these unscaled; no legacy field can help.
LEGACY_SCALING_IGNORED = frozenset({"nemotron"})

#: Rope types whose legacy ``rope_scaling`` next to a top-level ``rope_theta`` transformers 5.24's generic
#: ``PreTrainedConfig`` cannot read (its ``standardize_rope_params`` needs ``max_position_embeddings``).
GENERIC_READER_FAILS_WITH_THETA = frozenset({"llama3", "yarn", "longrope"})

#: The top-level rotary bases transformers 4.x configs of per-layer-type models read: ``rope_theta`` (Gemma 3's global
#: layers, OLMo 3's), ``rope_local_base_freq`` (Gemma 3 and 3n's sliding layers), ModernBERT's pair.
LEGACY_THETA_NAMES = ("rope_theta", "rope_local_base_freq", "global_rope_theta", "local_rope_theta")


@dataclass(frozen=True)
class LegacyLayout:
    """Which layer types of a nested ``rope_parameters`` each legacy top-level field sets.

    Attributes:
        thetas: legacy base name (:data:`LEGACY_THETA_NAMES`) -> the layer types whose ``rope_theta`` it sets.
        scaling: the layer types ``rope_scaling`` is merged into.
    """

    thetas: dict[str, tuple[str, ...]]
    scaling: tuple[str, ...]


def _probe_config(config_class: type, **legacy: Any) -> dict[str, Any] | None:
    """The nested ``rope_parameters`` of a default ``config_class`` built with ``legacy`` arguments (None if it
    does not build or does not nest)."""
    try:
        params = config_class(**legacy).rope_parameters
    except Exception:  # a config class that needs other arguments has no layout to read: no legacy fields
        return None
    return params if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()) else None


@functools.lru_cache(maxsize=None)
def legacy_layout(model_type: str) -> LegacyLayout | None:
    """How the installed (5.x) config class of ``model_type`` maps 4.x's top-level RoPE fields onto its nested
    ``rope_parameters``: each legacy name is passed alone with a distinct value, and the layer types that take it
    are read back. None when the class does not nest its ``rope_parameters`` (or is not a 5.x class)."""
    from transformers import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        return None
    if _probe_config(config_class) is None:
        return None
    thetas = {}
    for index, name in enumerate(LEGACY_THETA_NAMES):
        marker = 12345.0 + index
        params = _probe_config(config_class, **{name: marker}) or {}
        layer_types = tuple(sorted(t for t, p in params.items() if p.get("rope_theta") == marker))
        if layer_types:
            thetas[name] = layer_types
    params = _probe_config(config_class, rope_scaling={"rope_type": "linear", "factor": 3.0}) or {}
    scaling = tuple(sorted(t for t, p in params.items() if p.get("rope_type") == "linear" and p.get("factor") == 3.0))
    return LegacyLayout(thetas, scaling)


def _nested_rope_parameters(config: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not any(isinstance(v, dict) for v in params.values()):
        return None
    # the per-layer-type dicts; transformers 5.10's Laguna also leaves top-level {"rope_type": "default",
    # "rope_theta": None} beside them, which no layer reads
    return {key: value for key, value in params.items() if isinstance(value, dict)}


def nested_legacy_fields(config: dict[str, Any]) -> dict[str, Any] | None:
    """The legacy top-level fields that say what a nested ``rope_parameters`` says, as :func:`legacy_layout` maps them.

    Args:
        config: a parsed ``config.json``.

    Returns:
        None when ``rope_parameters`` is not nested per layer type; else each legacy base whose layer types share one
        ``rope_theta``, and ``rope_scaling`` (without ``rope_theta``: transformers 5 merges it into the layer types'
        dicts, 4.x reads the base apart) when every layer type it sets has the same scaling and that is not the
        default. A scaling no legacy field can carry (some of those layer types scaled, others not) is left out:
        :func:`older_readers_differ` reports it.
    """
    params = _nested_rope_parameters(config)
    if params is None:
        return None
    layout = legacy_layout(config.get("model_type") or "")
    if layout is None:
        return {}
    fields: dict[str, Any] = {}
    for name, layer_types in layout.thetas.items():
        bases = {params[t].get("rope_theta") for t in layer_types if t in params}
        if len(bases) == 1 and None not in bases:
            fields[name] = bases.pop()
    scalings = [{k: v for k, v in params[t].items() if k != "rope_theta"} for t in layout.scaling if t in params]
    if scalings and all(s == scalings[0] for s in scalings) and scalings[0].get("rope_type", "default") != "default":
        fields["rope_scaling"] = copy.deepcopy(scalings[0])
    return fields


def flat_rope_parameters(config: dict[str, Any]) -> dict[str, Any] | None:
    """The one RoPE dict of a saved config (``rope_parameters``, else ``rope_scaling``); None when there is
    none or it is nested per layer type (Gemma 3), which no legacy field can express."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(params, dict) or "rope_type" not in params and "type" not in params:
        return None
    if any(isinstance(value, dict) for value in params.values()):
        return None  # nested per layer type, with top-level keys beside the layer types' dicts
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
        with a ``rope_theta`` (a 4.x save already has the legacy fields). A nested ``rope_parameters`` gets the
        fields of :func:`nested_legacy_fields`.
    """
    result = copy.deepcopy(config)
    nested = nested_legacy_fields(config)
    if nested is not None:
        result.update(copy.deepcopy(nested))
        return result
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
        when the saved theta is 4.57's default for the model type; otherwise ``config`` unchanged. A nested
        ``rope_parameters`` follows the same rule with the type of its ``rope_scaling``.
    """
    full = with_legacy_rope_fields(config)
    params = full.get("rope_scaling") if _nested_rope_parameters(config) is not None else flat_rope_parameters(full)
    if params is None or full == config:
        return full
    if params.get("rope_type", params.get("type")) not in GENERIC_READER_FAILS_WITH_THETA or "rope_theta" not in full:
        return full
    if float(full["rope_theta"]) != legacy_default_theta(config.get("model_type")):
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


def older_readers_ignore_scaling(config: dict[str, Any]) -> bool:
    """True when ``config`` is scaled and transformers 4.x's class for it ignores every scaling field
    (:data:`LEGACY_SCALING_IGNORED`): stock 4.x loads it unscaled, and only ``hf_posext.load`` scales it there."""
    params = flat_rope_parameters(config)
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    return config.get("model_type") in LEGACY_SCALING_IGNORED and rope_type != "default"


def _nested_readers_differ(config: dict[str, Any]) -> bool:
    """:func:`older_readers_differ` for a nested ``rope_parameters``: a legacy base or the scaling that 4.x would read
    otherwise, or a scaled layer type no legacy field carries."""
    expected = nested_legacy_fields(config) or {}
    for name, value in expected.items():
        default = legacy_default_theta(config.get("model_type")) if name == "rope_theta" else None
        if name != "rope_scaling" and config.get(name, default) != value:
            return True
    scaled = any(p.get("rope_type", "default") != "default" for p in config["rope_parameters"].values())
    return scaled and ("rope_scaling" not in expected or config.get("rope_scaling") != expected["rope_scaling"])


def check_installed_transformers_reads(path: str | os.PathLike, from_pretrained_kwargs: dict[str, Any] | None = None) -> None:
    """Refuse, in one line and before any weight is read, a folder saved by a newer major transformers whose config
    the installed one rejects (transformers 4.57's OLMo takes only a two-field linear/dynamic ``rope_scaling``, its
    Phi-3 only longrope): its own error is a traceback from inside the config class.

    Raises:
        ValueError: names the folder, the model type, both versions, the config class's own complaint and the fix.
    """
    import transformers
    from transformers import AutoConfig

    config_path = Path(path) / "config.json"
    try:
        saved = json.loads(config_path.read_text())
        by = str(saved.get("transformers_version") or "")
        newer = int(by.split(".")[0]) > int(transformers.__version__.split(".")[0])
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):  # no readable local config: from_pretrained's job
        return
    if not newer:
        return
    kwargs = {k: v for k, v in (from_pretrained_kwargs or {}).items() if k in ("trust_remote_code", "revision")}
    try:
        AutoConfig.from_pretrained(os.fspath(path), **kwargs)
    except (ValueError, TypeError, KeyError) as error:
        complaint = " ".join(str(error).split())[:240]
        record = saved.get("hf_posext")
        what = "its config"
        if "rope_scaling" in complaint:
            what = (f"the rope_scaling of its hf_posext {record.get('method')} x{record.get('factor'):g} patch"
                    if isinstance(record, dict) and isinstance(record.get("factor"), (int, float)) else "its rope_scaling")
        raise ValueError(
            f"{config_path} holds a {saved.get('model_type')!r} model saved by transformers {by}, and transformers "
            f"{transformers.__version__} (installed) rejects {what} ({type(error).__name__}: {complaint}): load it with "
            f"transformers >= {by}."
        ) from None


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
