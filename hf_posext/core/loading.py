"""What every backend's ``load`` shares: the config-loading arguments and the model class of a config."""

from __future__ import annotations

from typing import Any

__all__ = ["config_kwargs", "model_class_for"]

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
