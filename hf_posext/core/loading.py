"""What every backend's ``load`` shares: the config-loading arguments and the model class of a config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hf_posext.core.errors import DamagedFileError

__all__ = [
    "config_kwargs",
    "model_class_for",
    "check_weight_files",
    "require_causal_lm",
    "require_loaded_weights",
    "TOKENIZER_FILES",
    "tokenizer_files",
    "check_tokenizer_files",
    "check_causal_lm_folder",
    "check_known_model_type",
]

_CONFIG_KWARGS = ("trust_remote_code", "revision", "token")


def config_kwargs(from_pretrained_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``from_pretrained`` arguments that ``AutoConfig.from_pretrained`` also needs."""
    return {k: v for k, v in from_pretrained_kwargs.items() if k in _CONFIG_KWARGS}


def model_class_for(config: Any) -> Any:
    """The class named in ``config.architectures`` (the head the folder was saved with), else
    ``AutoModelForCausalLM`` when it knows the config.

    Raises:
        ValueError: neither applies (names the config's model type and architectures).
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    raise ValueError(
        f"No model class for model_type {getattr(config, 'model_type', '?')!r} (architectures: "
        f"{getattr(config, 'architectures', None)}); load the model yourself and call hf_posext.patch on it."
    )


def check_known_model_type(path: str | os.PathLike, from_pretrained_kwargs: dict[str, Any] | None = None) -> None:
    """Refuse, in one line, a local folder whose ``config.json`` names a model type the installed transformers does
    not have (a family newer than it), instead of transformers' own several-sentence error.

    A hub name, a folder without ``config.json``, remote code (``auto_map`` with ``trust_remote_code``) and a
    config.json that is not readable JSON are left to ``from_pretrained``.

    Raises:
        ValueError: names the model type, the transformers that saved it and the one installed.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return
    try:
        saved = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    model_type = saved.get("model_type") if isinstance(saved, dict) else None
    if not isinstance(model_type, str) or model_type in CONFIG_MAPPING_NAMES:
        return
    if saved.get("auto_map") and (from_pretrained_kwargs or {}).get("trust_remote_code"):
        return
    by = saved.get("transformers_version")
    if by == transformers.__version__:  # a sub-model this release builds and saves, but whose type AutoConfig lacks
        raise ValueError(
            f"{config_path} holds a {model_type!r} model, which transformers {by} (installed) saves but cannot load "
            f"back: its AutoConfig has no {model_type!r}. Load it with a later transformers release whose AutoConfig "
            f"has it."
        )
    raise ValueError(
        f"{config_path} holds a {model_type!r} model, which transformers {transformers.__version__} (installed) does "
        f"not have{f'; it was saved by transformers {by}' if by else ''}: load it with a transformers that has "
        f"{model_type!r}{f' (>= {by})' if by else ''}."
    )


def check_weight_files(path: str | os.PathLike) -> None:
    """Open the header of every ``*.safetensors`` file in folder ``path`` (no tensor is read).

    A truncated or corrupt weights file is then named before ``from_pretrained`` starts; a hub name
    (not a local folder) is left to ``from_pretrained``.

    Raises:
        DamagedFileError: a weights file cannot be opened (names the file and the fix).
    """
    folder = Path(path)
    if not folder.is_dir():
        return
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # SafetensorError, OSError: both mean the file cannot be used
            detail = " ".join(str(error).split())
            raise DamagedFileError(
                f"{file} is truncated or corrupt ({detail}); save or download the model again"
            ) from None


def require_causal_lm(config: Any, name: str) -> None:
    """Refuse a config that ``AutoModelForCausalLM`` cannot load, in one line.

    Raises:
        ValueError: names the folder, its model type and architectures, and what to do instead.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or getattr(config, "auto_map", None):
        return
    raise ValueError(
        f"{name} holds a {getattr(config, 'model_type', '?')!r} model ({', '.join(getattr(config, 'architectures', None) or []) or 'no architectures'}), "
        "not a causal language model, which this command needs; give a decoder-only model (e.g. llama, "
        "qwen2, gpt2), or load and patch this one in Python with hf_posext.load / hf_posext.patch"
    )


def require_loaded_weights(model: Any) -> None:
    """Refuse a model whose weights are on the meta device (built without data), before any change.

    Raises:
        ValueError: names the first such parameter and how to get real weights.
    """
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_meta:
            raise ValueError(
                f"the model's {name} is on the meta device (no data: built under init_empty_weights or "
                "torch.device('meta')); hf_posext finds and patches positions by running them, so load real "
                "weights first (from_pretrained, or to_empty() then load_state_dict)"
            )


#: Files any saved tokenizer has at least one of (fast, sentencepiece, BPE and WordPiece tokenizers).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
    "merges.txt", "special_tokens_map.json",
)
#: Tokenizer files that are JSON, parsed by :func:`check_tokenizer_files` to name a damaged one.
_TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")


def tokenizer_files(path: str | os.PathLike) -> list[str]:
    """The names of the tokenizer files (:data:`TOKENIZER_FILES`) in folder ``path``; [] for no folder."""
    folder = Path(path)
    return [name for name in TOKENIZER_FILES if (folder / name).is_file()]


def check_tokenizer_files(path: str | os.PathLike, name: str | None = None) -> None:
    """Refuse a local model folder without a tokenizer, or with a tokenizer JSON file that cannot be parsed.

    Cheap (no tokenizer is built), so commands call it before loading a model; a hub name (not a local
    folder) is left to ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: the folder has none of :data:`TOKENIZER_FILES` (names the folder and the fix).
        DamagedFileError: a tokenizer JSON file is truncated or corrupt (names the file and the fix).
    """
    folder = Path(path)
    if not folder.is_dir():
        return
    shown = name or str(path)
    if not tokenizer_files(folder):
        raise ValueError(
            f"{shown} has no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...); save one beside the "
            f"model with tokenizer.save_pretrained({shown!r})"
        )
    for file_name in _TOKENIZER_JSON_FILES:
        file = folder / file_name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            detail = " ".join(str(error).split())[:120]
            raise DamagedFileError(
                f"{file} is truncated or corrupt ({detail}); save the tokenizer again with "
                f"tokenizer.save_pretrained({shown!r})"
            ) from None


def check_causal_lm_folder(path: str, name: str, from_pretrained_kwargs: dict[str, Any]) -> None:
    """Everything :func:`hf_posext.models.load_model` checks before it loads weights: the config is a causal
    LM's and every local safetensors file opens (see :func:`require_causal_lm`, :func:`check_weight_files`).

    Args:
        path: the resolved folder (or hub name).
        name: what the user gave, for messages.
        from_pretrained_kwargs: the loading arguments (``trust_remote_code``, ``revision``, ``token`` are used).
    """
    from transformers import AutoConfig

    require_causal_lm(AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs)), name)
    check_weight_files(path)
