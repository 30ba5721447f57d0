"""Layer 3: model surgery, one backend per kind of position, behind one protocol.

A backend finds its positions in a model by structure (never by model name), and patches, unpatches,
describes and loads them. :mod:`hf_posext.api` loops over :data:`BACKENDS` in order; nothing outside a
backend knows its method names.

=========== ======================================== =================================
backend     positions                                 implementation
=========== ======================================== =================================
absolute    learned tables, sinusoids, ALiBi limits   :mod:`hf_posext.backends.absolute.surgery`
rope        rotary embedding modules                  :mod:`hf_posext.backends.rope.surgery`
attention   attention-level methods (Self-Extend)     :mod:`hf_posext.backends.attention.self_extend`
relative    T5-style relative position bias           :mod:`hf_posext.backends.relative`
=========== ======================================== =================================
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from hf_posext.backends.absolute import AbsoluteBackend
from hf_posext.backends.attention import AttentionBackend
from hf_posext.backends.relative import RelativeBackend
from hf_posext.backends.rope import RopeBackend
from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest

__all__ = ["Backend", "BACKENDS", "backend_for_record", "primary_backend"]


class Backend(Protocol):
    """What every backend implements.

    Attributes:
        name: the backend's name (``rope``, ``absolute``, ``attention``, ``relative``).
        method_kinds: the method kinds of :mod:`hf_posext.methods` it applies.
        record_kinds: the ``kind`` values of the saved records it loads.
        applies_over: for a backend that works on top of another one's positions (attention-level
            methods on RoPE models), the names of those backends; empty for a backend of its own positions.
    """

    name: str
    method_kinds: tuple[str, ...]
    record_kinds: tuple[str, ...]
    applies_over: tuple[str, ...]

    def detect(self, model: nn.Module) -> str | None:
        """The method kind this model's positions take here, or None when the backend sees none (read-only).

        May raise :class:`~hf_posext.core.errors.UnsupportedModelError` to say why positions that look
        like its kind cannot be used (the caller reports it when no other backend applies).
        """

    def is_patched(self, model: nn.Module) -> bool:
        """True when this backend patched ``model`` in memory."""

    def patch(self, model: nn.Module, request: ScalingRequest, **extras: Any) -> nn.Module:
        """Apply ``request``, replacing a previous patch of this backend; validates before changing anything."""

    def unpatch(self, model: nn.Module) -> nn.Module:
        """Restore what :meth:`patch` changed, bit for bit."""

    def current_request(self, model: nn.Module) -> ScalingRequest:
        """The request that re-creates the current patch (to restore it when a new patch fails)."""

    def describe(self, model: nn.Module) -> ScalingReport:
        """Report of a patched model, or of an unpatched one this backend detects."""

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        """Load a folder saved with a record of one of :attr:`record_kinds` and re-apply its scaling."""


#: Backends in the order :func:`hf_posext.patch` tries them. Absolute comes before RoPE because an ALiBi
#: model may carry an unused rotary module (Falcon with ``alibi=True``); ``absolute`` never claims a
#: model whose rotary module is in use.
BACKENDS: tuple[Backend, ...] = (AbsoluteBackend(), RopeBackend(), AttentionBackend(), RelativeBackend())


def backend_for_record(kind: str) -> Backend | None:
    """The backend that loads saved records of ``kind`` (None when no backend does)."""
    return next((backend for backend in BACKENDS if kind in backend.record_kinds), None)


def primary_backend(model: nn.Module) -> Backend:
    """The backend owning the model's positions: the first in :data:`BACKENDS` order, overlays aside,
    that detects them.

    Raises:
        UnsupportedModelError: none does (the first reason a backend gave, or a list of what is supported).
    """
    patched = next((backend for backend in BACKENDS if backend.is_patched(model)), None)
    if patched is not None:
        # A patched model is not re-detected: its positions are the patched backend's (or, for an
        # overlay, those of the backend it works over).
        owner = patched.applies_over[0] if patched.applies_over else patched.name
        return next(backend for backend in BACKENDS if backend.name == owner)
    refusal = None
    for backend in BACKENDS:
        if backend.applies_over:
            continue
        try:
            if backend.detect(model) is not None:
                return backend
        except UnsupportedModelError as error:
            refusal = refusal or error
    raise refusal or UnsupportedModelError(
        f"{type(model).__name__} has no position encoding hf_posext recognises (rotary embedding, learned or "
        "sinusoidal table, ALiBi, T5-style relative bias)."
    )
