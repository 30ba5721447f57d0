"""ScalingConfig: which method, by how much, from which original window — validated, JSON round-trip."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from hf_posext.methods import Method, get_method

__all__ = ["ScalingConfig", "resolve_factor"]


def resolve_factor(factor: float | None, target_length: int | None, original_length: int) -> float:
    """Return the scale factor from exactly one of ``factor`` and ``target_length``.

    Raises:
        ValueError: both or neither given, a factor below 1 or not finite, a target shorter than the
            original window.
    """
    if (factor is None) == (target_length is None):
        raise ValueError(
            "Give exactly one of factor= (e.g. factor=4) or target_length= (e.g. target_length="
            f"{4 * original_length}); got factor={factor!r}, target_length={target_length!r}."
        )
    if target_length is not None:
        if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length <= 0:
            raise ValueError(f"target_length must be a positive integer, got {target_length!r}.")
        if target_length < original_length:
            raise ValueError(
                f"target_length={target_length} is shorter than the model's original window "
                f"({original_length} tokens); scaling only extends. Use target_length >= {original_length}."
            )
        return target_length / original_length
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ValueError(f"factor must be a finite number >= 1, got {factor!r}.")
    if factor < 1:
        raise ValueError(
            f"factor={factor} is below 1: scaling extends the window, it cannot shrink it. "
            "Use factor >= 1 (factor=1 leaves the model unchanged)."
        )
    return float(factor)


@dataclass
class ScalingConfig:
    """A validated scaling request.

    Attributes:
        method: registered method name (``hf_posext.available_methods()``).
        factor: scale s >= 1; the patched window is ``original_max_position_embeddings * factor``.
        original_max_position_embeddings: the window the model was pre-trained with (L).
        params: the method's keyword parameters, with defaults filled in.
        kind: ``"rope"`` or ``"learned"``.
    """

    method: str
    factor: float
    original_max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)
    kind: str = "rope"

    def __post_init__(self) -> None:
        spec = get_method(self.method, self.kind)
        self.method = spec.name
        self.factor = resolve_factor(self.factor, None, self.original_max_position_embeddings)
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"original_max_position_embeddings must be positive, got {self.original_max_position_embeddings}."
            )
        parsed = spec.parse_params(dict(self.params))
        self.params = dataclasses.asdict(parsed)
        self._parsed = parsed

    @property
    def spec(self) -> Method:
        return get_method(self.method, self.kind)

    @property
    def parsed_params(self) -> Any:
        """The method's parameter dataclass instance."""
        return self._parsed

    @property
    def target_length(self) -> int:
        """The window after scaling: round(L * s)."""
        return int(round(self.original_max_position_embeddings * self.factor))

    @property
    def is_identity(self) -> bool:
        return self.factor == 1 and self.method in ("linear", "ntk", "yarn", "llama3", "none")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (stored in ``config.json`` under ``hf_posext``)."""
        params = {k: v for k, v in self.params.items() if v is not None}
        return {
            "kind": self.kind,
            "method": self.method,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "params": params,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScalingConfig":
        return cls(
            method=data["method"],
            factor=data["factor"],
            original_max_position_embeddings=data["original_max_position_embeddings"],
            params=dict(data.get("params", {})),
            kind=data.get("kind", "rope"),
        )
