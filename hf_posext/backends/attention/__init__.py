"""The attention-level backend: methods that change attention itself, installed through transformers'
attention-function registry. The shared scaffolding (registration, probe, patch/unpatch/describe/load
flow) is :mod:`hf_posext.backends.attention.registration`, shared math :mod:`hf_posext.backends.attention.kernels`;
each method is one module with its math and the same entry points (patch, unpatch, describe, load,
is_patched, current_request): Self-Extend in :mod:`hf_posext.backends.attention.self_extend`, Dual Chunk
Attention in :mod:`hf_posext.backends.attention.dual_chunk`, STRING in
:mod:`hf_posext.backends.attention.shifted_positions`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from hf_posext.backends.attention import dual_chunk, self_extend, shifted_positions
from hf_posext.backends.rope import RopeBackend
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest

__all__ = ["AttentionBackend"]

#: method name -> its surgery (one entry per attention-level method).
_METHODS = {
    module.METHOD.name: SimpleNamespace(
        is_patched=module.is_patched, patch=patch, unpatch=unpatch, describe=describe, load=load,
        current_request=module.current_request,
    )
    for module, patch, unpatch, describe, load in (
        (self_extend, self_extend.patch_self_extend, self_extend.unpatch_self_extend, self_extend.describe_self_extend,
         self_extend.load_self_extend),
        (dual_chunk, dual_chunk.patch_dual_chunk, dual_chunk.unpatch_dual_chunk, dual_chunk.describe_dual_chunk,
         dual_chunk.load_dual_chunk),
        (shifted_positions, shifted_positions.patch_string, shifted_positions.unpatch_string,
         shifted_positions.describe_string, shifted_positions.load_string),
    )
}


def _patched_method(model: nn.Module) -> str | None:
    return next((name for name, method in _METHODS.items() if method.is_patched(model)), None)


class AttentionBackend:
    """Self-Extend, Dual Chunk Attention and STRING on RoPE models whose attention modules call transformers'
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
        return _METHODS[request.method].patch(model, request)

    def unpatch(self, model: nn.Module) -> nn.Module:
        return _METHODS[_patched_method(model)].unpatch(model)

    def current_request(self, model: nn.Module) -> ScalingRequest:
        return _METHODS[_patched_method(model)].current_request(model)

    def describe(self, model: nn.Module) -> ScalingReport:
        return _METHODS[_patched_method(model)].describe(model)

    def record_from_config(self, config: Any, source: str) -> dict[str, Any] | None:
        """A record for a config written by another tool (vLLM's DCA field), or None (see
        :func:`~hf_posext.backends.attention.dual_chunk.record_from_vllm_config`)."""
        return dual_chunk.record_from_vllm_config(config, source)

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        method = _METHODS.get(record.get("method"))
        if method is None:
            raise ValueError(
                f"{path}: unrecognised attention-level record {record!r}; expected method "
                f"{' or '.join(repr(name) for name in _METHODS)}."
            )
        return method.load(path, record, **from_pretrained_kwargs)
