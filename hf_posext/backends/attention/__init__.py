"""The attention-level backend: methods that change attention itself, installed through transformers'
attention-function registry. Each method is one module with the same five entry points (patch, unpatch,
describe, load, is_patched): Self-Extend in :mod:`hf_posext.backends.attention.self_extend`, Dual Chunk
Attention in :mod:`hf_posext.backends.attention.dual_chunk`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from hf_posext.backends.attention import dual_chunk, self_extend
from hf_posext.backends.rope import RopeBackend
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest

__all__ = ["AttentionBackend"]

#: method name -> its surgery (one entry per attention-level method).
_METHODS = {
    "self-extend": SimpleNamespace(
        is_patched=self_extend.is_patched, patch=self_extend.patch_self_extend, unpatch=self_extend.unpatch_self_extend,
        describe=self_extend.describe_self_extend, load=self_extend.load_self_extend,
        params=lambda s: {"group_size": s.group_size, "neighbor_window": s.neighbor_window}, settings=self_extend.current_settings,
        factor=lambda s: None,
    ),
    "dca": SimpleNamespace(
        is_patched=dual_chunk.is_patched, patch=dual_chunk.patch_dual_chunk, unpatch=dual_chunk.unpatch_dual_chunk,
        describe=dual_chunk.describe_dual_chunk, load=dual_chunk.load_dual_chunk,
        params=lambda s: {"chunk_size": s.chunk_size, "local_window": s.local_window}, settings=dual_chunk.current_settings,
        factor=lambda s: s.factor,
    ),
}


def _patched_method(model: nn.Module) -> str | None:
    return next((name for name, method in _METHODS.items() if method.is_patched(model)), None)


class AttentionBackend:
    """Self-Extend and Dual Chunk Attention on RoPE models whose attention modules call transformers'
    attention registry."""

    name = "attention"
    method_kinds = ("attention",)
    record_kinds = ("attention",)
    applies_over: tuple[str, ...] = ("rope",)

    def detect(self, model: nn.Module) -> str | None:
        if _patched_method(model) or RopeBackend().detect(model):
            return "attention"
        return None

    def is_patched(self, model: nn.Module) -> bool:
        return _patched_method(model) is not None

    def patch(self, model: nn.Module, request: ScalingRequest, **extras: Any) -> nn.Module:
        if extras:
            raise ValueError(f"{', '.join(f'{k}=' for k in extras)} does not apply to attention-level methods.")
        current = _patched_method(model)
        if current is not None and current != request.method:
            # One attention-level method replaces another: undo it, put it back if the new one fails.
            restore = self.current_request(model)
            _METHODS[current].unpatch(model)
            try:
                return self.patch(model, request)
            except Exception:
                self.patch(model, restore)
                raise
        return _METHODS[request.method].patch(
            model, request.method, request.factor, target_length=request.target_length,
            original_max_position_embeddings=request.original_max_position_embeddings, **request.params_dict,
        )

    def unpatch(self, model: nn.Module) -> nn.Module:
        return _METHODS[_patched_method(model)].unpatch(model)

    def current_request(self, model: nn.Module) -> ScalingRequest:
        name = _patched_method(model)
        method = _METHODS[name]
        settings = method.settings(model)
        return ScalingRequest.from_kwargs(
            name, method.factor(settings), original_max_position_embeddings=settings.original_max_position_embeddings,
            **method.params(settings),
        )

    def describe(self, model: nn.Module) -> ScalingReport:
        return _METHODS[_patched_method(model)].describe(model)

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        method = _METHODS.get(record.get("method"))
        if method is None:
            raise ValueError(
                f"{path}: unrecognised attention-level record {record!r}; expected method "
                f"{' or '.join(repr(name) for name in _METHODS)}."
            )
        return method.load(path, record, **from_pretrained_kwargs)
