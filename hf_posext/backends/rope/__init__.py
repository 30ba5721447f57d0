"""The RoPE backend: rotary embedding modules found by structure (surgery in :mod:`hf_posext.backends.rope.surgery`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_posext.backends.rope import surgery as patching
from hf_posext.backends.rope.sites import find_rotary_sites
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest

__all__ = ["RopeBackend"]


class RopeBackend:
    """Frequency scaling of rotary embeddings (linear, NTK, YaRN, Llama 3, LongRoPE, ...); ``tokenizer=`` follows the new window."""

    name = "rope"
    method_kinds = ("rope",)
    record_kinds = ("rope",)
    applies_over: tuple[str, ...] = ()

    def detect(self, model: nn.Module) -> str | None:
        if patching.is_patched(model):
            return "rope"
        find_rotary_sites(model)  # raises UnsupportedModelError saying why these are not usable rotary modules
        return "rope"

    def is_patched(self, model: nn.Module) -> bool:
        return patching.is_patched(model)

    def patch(self, model: nn.Module, request: ScalingRequest, **extras: Any) -> nn.Module:
        tokenizer = extras.pop("tokenizer", None)
        _no_extras(extras, "RoPE")
        return patching.patch_rope(model, request, tokenizer=tokenizer)

    def unpatch(self, model: nn.Module) -> nn.Module:
        return patching.unpatch_rope(model)

    def current_request(self, model: nn.Module) -> ScalingRequest:
        scaling = patching.current_scaling(model)
        params = {k: v for k, v in scaling.params.items() if v is not None}
        return ScalingRequest.from_kwargs(
            scaling.method, scaling.factor, original_max_position_embeddings=scaling.original_max_position_embeddings, **params
        )

    def describe(self, model: nn.Module) -> ScalingReport:
        return patching.describe_rope(model)

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        return patching.load_rope(path, record, **from_pretrained_kwargs)


def _no_extras(extras: dict[str, Any], kind: str) -> None:
    if extras:
        raise ValueError(
            f"{', '.join(f'{k}=' for k in extras)} does not apply to {kind} models (the only extra is tokenizer=, "
            "whose model_max_length follows the new window)."
        )
