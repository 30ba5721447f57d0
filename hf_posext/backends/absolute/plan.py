"""Patching a model with absolute positions as a list of changes: plan them, apply them, revert them.

Every change is an :class:`Assignment` (``target.<name>``: original -> new) worked out before anything
changes, so a patch that fails leaves the model as it was and ``unpatch`` puts back the original
objects (the original ``Parameter``, buffers and config values: bit for bit). The numbers come from the
registered method (:mod:`hf_posext.methods.learned`); this module only places them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from hf_posext.backends.absolute.sites import AbsolutePositions
from hf_posext.core.record import ABSENT, CONFIG_KEY
from hf_posext.core.request import ScalingConfig
from hf_posext.methods import get_method
from hf_posext.methods.learned import MAX_TABLE_ROWS, ScaledSinusoidRows, scaled_sinusoid_rows

__all__ = [
    "Assignment",
    "AbsoluteState",
    "SIDECAR_NAME",
    "stock_loadable",
    "original_window",
    "check_sizes",
    "plan_assignments",
    "apply_assignments",
    "revert_assignments",
    "build_record",
]

#: File written next to a saved patched model: the original (pre-patch) learned tables.
SIDECAR_NAME = "hf_posext_absolute.safetensors"
#: Largest square mask buffer (GPT-Neo's causal mask) rebuilt for a new window: 2^32 elements.
_MAX_MASK_ELEMENTS = 2**32


@dataclass
class Assignment:
    """One change: ``target.<name>`` goes from ``original`` to ``new`` (``ABSENT`` = not set)."""

    target: Any
    name: str
    original: Any
    new: Any
    how: str  # "parameter", "buffer", "attribute", "config"

    def set(self, value: Any) -> None:
        """Put ``value`` in place (a ``Parameter``/buffer slot, an instance attribute or a config field)."""
        if self.how == "parameter":
            self.target._parameters[self.name] = value
        elif self.how == "buffer":
            self.target._buffers[self.name] = value
        elif self.how == "config":
            if value is ABSENT:
                self.target.__dict__.pop(self.name, None)
            else:
                self.target.__dict__[self.name] = copy.deepcopy(value)
        elif value is ABSENT:
            self.target.__dict__.pop(self.name, None)
        else:
            self.target.__dict__[self.name] = value


@dataclass
class AbsoluteState:
    """What a patch keeps on the model (``unpatch``, ``describe``, patching again, saving).

    Attributes:
        scaling: method, factor and pre-training window.
        positions: the sites found, with their pre-patch objects.
        assignments: every change made, to revert.
        new_window: the window after patching.
        tokenizers: (tokenizer, pre-patch ``model_max_length``) pairs.
        original_tables_available: False for a model loaded without :data:`SIDECAR_NAME` (no unpatch).
        stock_loadable: whether stock ``from_pretrained`` rebuilds the patched model.
        notes: warnings of the patch (an alias resolved), repeated by ``describe``.
    """

    scaling: ScalingConfig
    positions: AbsolutePositions
    assignments: list[Assignment]
    new_window: int
    tokenizers: list[tuple[Any, Any]] = field(default_factory=list)
    original_tables_available: bool = True
    stock_loadable: bool = True
    notes: list[str] = field(default_factory=list)


def stock_loadable(kind: str, method: str) -> bool:
    """Whether stock ``from_pretrained`` rebuilds the patched model: not for rescaled sinusoids (recomputed on load)."""
    return not (kind == "sinusoidal" and not get_method(method, kind).baseline)


def original_window(positions: AbsolutePositions, override: int | None) -> int | None:
    """The pre-training window L: ``override`` (a positive int, checked by ScalingRequest) or the model's own."""
    if override is None:
        return positions.window
    if positions.kind == "learned" and override > positions.window:
        raise ValueError(
            f"original_max_position_embeddings={override} is larger than the learned table ({positions.window} "
            f"position rows at {', '.join(t.path for t in positions.tables)}); it can be at most {positions.window}."
        )
    return override


def check_sizes(positions: AbsolutePositions, scaling: ScalingConfig, new_window: int) -> None:
    """Refuse a window whose tables or masks would be too large (nothing is changed here).

    Raises:
        ValueError: a table over :data:`~hf_posext.methods.learned.MAX_TABLE_ROWS` rows, or a causal mask
            over 2^32 elements; the message gives the largest factor or window that fits.
    """
    current = positions.window
    delta = new_window - (current or new_window)
    for table in positions.tables:
        rows = table.original_weight.shape[0] + delta
        if table.offset + new_window > MAX_TABLE_ROWS or rows > MAX_TABLE_ROWS:
            raise ValueError(
                f"A {new_window}-position window needs {max(rows, table.offset + new_window)} rows in the table at "
                f"{table.path!r}, above hf_posext's limit of {MAX_TABLE_ROWS} (2^20). Use a smaller factor "
                f"(at most {MAX_TABLE_ROWS // max(1, scaling.original_max_position_embeddings)} for this model)."
            )
    for site in positions.sinusoids:
        if site.original_buffer.shape[0] + delta > MAX_TABLE_ROWS:
            raise ValueError(
                f"A {new_window}-position window needs a {site.original_buffer.shape[0] + delta}-row sinusoid table at "
                f"{site.path!r}, above hf_posext's limit of {MAX_TABLE_ROWS} (2^20). Use a smaller factor."
            )
    for buffer in positions.buffers:
        new_length = buffer.original.shape[-1] + delta
        if buffer.rule == "band" and new_length * new_length > _MAX_MASK_ELEMENTS:
            raise ValueError(
                f"{buffer.path} is a {buffer.original.shape[-1]}x{buffer.original.shape[-1]} causal mask; a "
                f"{new_window}-position window would make it {new_length}x{new_length} (over 2^32 elements) in every "
                f"layer that has one. Use a smaller factor (new window at most {int(math.isqrt(_MAX_MASK_ELEMENTS)) - (buffer.original.shape[-1] - (current or 0))})."
            )


def plan_assignments(
    positions: AbsolutePositions,
    scaling: ScalingConfig,
    factor: Fraction,
    new_window: int,
    record: dict[str, Any],
    base_record: Any,
    loaded_tables: dict[str, torch.Tensor] | None = None,
) -> list[Assignment]:
    """Every change patching makes (nothing is changed here).

    Args:
        positions: what :func:`~hf_posext.backends.absolute.sites.find_absolute_positions` found (with the
            pre-patch tables, buffers and lengths as its originals).
        scaling: method, factor and pre-training window.
        factor: s as an exact fraction.
        new_window: L', the window after patching.
        record: the ``hf_posext`` record the config will hold.
        base_record: the record the config held before (``ABSENT`` when none), restored by unpatch.
        loaded_tables: table path -> saved (extended) weight, used instead of resampling (``load``).

    Raises:
        ValueError: sizes too large (see :func:`check_sizes`).
    """
    check_sizes(positions, scaling, new_window)
    delta = new_window - (positions.window or new_window)
    spec = scaling.spec
    assignments: list[Assignment] = []
    for table in positions.tables:
        original = table.original_weight
        if loaded_tables is not None and table.path in loaded_tables:
            new_weight = loaded_tables[table.path]
        else:
            rows = original.detach()
            prefix = rows[: table.offset]
            used = rows[table.offset : table.offset + scaling.original_max_position_embeddings]
            resampled = spec.compute(used, new_window, factor, scaling.parsed_params)
            new_weight = torch.cat([prefix, resampled], dim=0)
        parameter = nn.Parameter(new_weight.detach().clone(), requires_grad=original.requires_grad)
        assignments.append(Assignment(table.module, "weight", original, parameter, "parameter"))
        assignments.append(Assignment(table.module, "num_embeddings", original.shape[0], parameter.shape[0], "attribute"))
    for site in positions.sinusoids:
        if not spec.baseline:
            compute = spec.compute
            rows = max(site.original_buffer.shape[0] + delta, site.offset + new_window)
            table = scaled_sinusoid_rows(
                rows, site.dim, site.offset, site.padding_rows, lambda n: compute(n, factor, scaling.parsed_params)
            )
            table = table.to(dtype=site.original_buffer.dtype, device=site.original_buffer.device)
            assignments.append(Assignment(site.module, site.buffer_name, site.original_buffer, table, "buffer"))
            if site.regrows:
                regrow = ScaledSinusoidRows(site.offset, site.padding_rows, factor, spec.name)
                assignments.append(Assignment(site.module, "get_embedding", site.original_get_embedding, regrow, "attribute"))
    cache: dict = {}
    for buffer in positions.buffers:
        rebuilt = buffer.rebuild(buffer.original.shape[-1] + delta, cache)
        assignments.append(Assignment(buffer.module, buffer.name, buffer.original, rebuilt, "buffer"))
    for attribute in positions.attributes:
        assignments.append(Assignment(attribute.module, attribute.name, attribute.original, attribute.original + delta, "attribute"))
    config = positions.config
    for name, value in positions.config_fields.items():
        assignments.append(Assignment(config, name, value, value + delta, "config"))
    assignments.append(Assignment(config, CONFIG_KEY, base_record, record, "config"))
    return assignments


def apply_assignments(assignments: list[Assignment]) -> None:
    """Make every change; on a failure, undo the ones made and re-raise."""
    done = []
    try:
        for assignment in assignments:
            assignment.set(assignment.new)
            done.append(assignment)
    except Exception:
        for assignment in reversed(done):
            assignment.set(assignment.original)
        raise


def revert_assignments(assignments: list[Assignment]) -> None:
    """Put back every original object, last change first."""
    for assignment in reversed(assignments):
        assignment.set(assignment.original)


def build_record(scaling: ScalingConfig, positions: AbsolutePositions, new_window: int, original_config: dict[str, Any]) -> dict[str, Any]:
    """The ``hf_posext`` record of the config: the scaling, the new window, what it replaced, the tables."""
    return {
        **scaling.to_dict(),
        "current_window": new_window,
        "original_config": original_config,
        "tables": [
            {"path": t.path, "offset": t.offset, "original_rows": int(t.original_weight.shape[0])}
            for t in positions.tables
        ],
        "sidecar": SIDECAR_NAME if positions.tables else None,
    }
