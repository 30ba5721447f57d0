"""The absolute-position backend: learned tables, sinusoidal encodings and ALiBi length limits
(sites: where they are; plan: the changes; surgery: patch, unpatch, describe, load)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_posext.backends.absolute import surgery as absolute
from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest

__all__ = ["AbsoluteBackend"]


class AbsoluteBackend:
    """Learned (GPT-2, OPT), sinusoidal and ALiBi positions; ``tokenizer=`` follows the new window."""

    name = "absolute"
    method_kinds = ("learned", "sinusoidal", "alibi")
    record_kinds = ("learned", "sinusoidal", "alibi")
    applies_over: tuple[str, ...] = ()

    def detect(self, model: nn.Module) -> str | None:
        state = absolute.patch_state(model)
        if state is not None:
            return state.positions.kind
        try:
            positions = absolute.find_absolute_positions(model)
        except UnsupportedModelError:
            return "learned"  # ours to handle: patch_absolute reports the problem
        return None if positions is None else positions.kind

    def is_patched(self, model: nn.Module) -> bool:
        return absolute.is_patched(model)

    def patch(self, model: nn.Module, request: ScalingRequest, **extras: Any) -> nn.Module:
        unknown = [k for k in extras if k != "tokenizer"]
        if unknown:
            raise ValueError(f"Unknown argument(s) {', '.join(unknown)} for models with absolute positions.")
        return absolute.patch_absolute(model, request, **extras)

    def unpatch(self, model: nn.Module) -> nn.Module:
        return absolute.unpatch_absolute(model)

    def current_request(self, model: nn.Module) -> ScalingRequest:
        state = absolute.patch_state(model)
        scaling = state.scaling
        return ScalingRequest.from_kwargs(
            scaling.method, target_length=state.new_window,
            original_max_position_embeddings=scaling.original_max_position_embeddings, **scaling.params,
        )

    def describe(self, model: nn.Module) -> ScalingReport:
        return absolute.describe_absolute(model)

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        return absolute.load_absolute(path, record, **from_pretrained_kwargs)
