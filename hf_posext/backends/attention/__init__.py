"""The attention-level backend: methods that change attention itself (Self-Extend), installed through
transformers' attention-function registry (surgery in :mod:`hf_posext.backends.attention.self_extend`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_posext.backends.attention import self_extend
from hf_posext.backends.rope import RopeBackend
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest

__all__ = ["AttentionBackend"]


class AttentionBackend:
    """Self-Extend on RoPE models whose attention modules call transformers' attention registry."""

    name = "attention"
    method_kinds = ("attention",)
    record_kinds = ("attention",)
    applies_over: tuple[str, ...] = ("rope",)

    def detect(self, model: nn.Module) -> str | None:
        if self_extend.is_patched(model) or RopeBackend().detect(model):
            return "attention"
        return None

    def is_patched(self, model: nn.Module) -> bool:
        return self_extend.is_patched(model)

    def patch(self, model: nn.Module, request: ScalingRequest, **extras: Any) -> nn.Module:
        if extras:
            raise ValueError(f"{', '.join(f'{k}=' for k in extras)} does not apply to attention-level methods.")
        return self_extend.patch_self_extend(
            model, request.method, request.factor, target_length=request.target_length,
            original_max_position_embeddings=request.original_max_position_embeddings, **request.params_dict,
        )

    def unpatch(self, model: nn.Module) -> nn.Module:
        return self_extend.unpatch_self_extend(model)

    def current_request(self, model: nn.Module) -> ScalingRequest:
        settings = self_extend.current_settings(model)
        return ScalingRequest.from_kwargs(
            "self-extend", original_max_position_embeddings=settings.original_max_position_embeddings,
            group_size=settings.group_size, neighbor_window=settings.neighbor_window,
        )

    def describe(self, model: nn.Module) -> ScalingReport:
        return self_extend.describe_self_extend(model)

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        return self_extend.load_self_extend(path, record, **from_pretrained_kwargs)
