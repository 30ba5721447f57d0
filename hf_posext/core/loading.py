"""What every backend's ``load`` shares: the config-loading arguments and the model class of a config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hf_posext.core.errors import DamagedFileError

__all__ = ["config_kwargs", "model_class_for", "check_weight_files", "require_causal_lm", "require_loaded_weights"]

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
