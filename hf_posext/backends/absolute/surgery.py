"""Absolute position encodings: patch, unpatch, describe and load (learned tables, sinusoids, ALiBi limits).

:mod:`hf_posext.backends.rope.surgery` hands a model here when :func:`detect` finds no rotary module but a
learned position table, a sinusoidal encoding or ALiBi (found by
:mod:`~hf_posext.backends.absolute.sites`). Patching resamples the table with the registered method
(:mod:`hf_posext.methods.learned`) and moves everything else the window sizes with it, as a list of
changes (:mod:`~hf_posext.backends.absolute.plan`) that :func:`unpatch_absolute` reverts bit for bit; when
passed, the tokenizer's ``model_max_length`` follows.

A patched learned model saves with stock ``save_pretrained`` (the table is just bigger, so stock
``from_pretrained`` loads it); hf_posext also writes the original table to ``hf_posext_absolute.safetensors``
next to the weights so that ``hf_posext.load(path)`` followed by ``unpatch`` restores the pre-patch model exactly.
"""

from __future__ import annotations

import json
import os
import warnings
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from hf_posext.backends.absolute.plan import (
    SIDECAR_NAME,
    AbsoluteState,
    apply_assignments,
    build_record,
    original_window,
    plan_assignments,
    revert_assignments,
    stock_loadable,
)
from hf_posext.backends.absolute.sites import AbsolutePositions, find_absolute_positions
from hf_posext.backends.saving import (
    check_tokenizer,
    install_save_pretrained,
    remove_save_pretrained,
    restore_tokenizer_lengths,
    set_tokenizer_lengths,
)
from hf_posext.core.errors import UnsupportedModelError, check_model
from hf_posext.core.loading import config_kwargs, model_class_for
from hf_posext.core.record import ABSENT, CONFIG_KEY, ScalingReport
from hf_posext.core.request import ScalingConfig, ScalingRequest, resolve_factor
from hf_posext.methods import BASELINE, resolve_method
from hf_posext.methods.learned import exact_factor, sinusoid_table

__all__ = [
    "detect",
    "is_patched",
    "patch_state",
    "patch_absolute",
    "unpatch_absolute",
    "describe_absolute",
    "load_absolute",
    "find_absolute_positions",
    "sinusoid_table",
    "AbsolutePositions",
    "SIDECAR_NAME",
]

_STATE_ATTRIBUTE = "_hf_posext_absolute_state"


def detect(model: nn.Module) -> bool:
    """True when ``model`` encodes positions with a learned table, sinusoids or ALiBi (not RoPE)."""
    try:
        return find_absolute_positions(model) is not None
    except UnsupportedModelError:
        return True  # ours to handle: patch_absolute reports the problem


def patch_state(model: nn.Module) -> AbsoluteState | None:
    """The patch state :func:`patch_absolute` keeps on ``model`` (None when not patched)."""
    state = getattr(model, "__dict__", {}).get(_STATE_ATTRIBUTE)
    return state if isinstance(state, AbsoluteState) else None


def is_patched(model: nn.Module) -> bool:
    """True when :func:`patch_absolute` patched this model in memory."""
    return patch_state(model) is not None


# --------------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------------


def patch_absolute(model: nn.Module, request: ScalingRequest, tokenizer: Any = None) -> nn.Module:
    """Extend the window of a model with absolute positions (see :func:`hf_posext.patch`).

    Learned tables are resampled (``"linear"``: T'[p] = interpolation of T at p/s), sinusoidal encodings
    are evaluated at p/s (``"linear"``) or continued (``"none"``), ALiBi models only get their length
    limit lifted. The config's window fields, window-sized buffers and length attributes follow.

    Args:
        model: a transformers model whose positions :func:`detect` recognises.
        request: the method (``"linear"`` or ``"none"``; ``hf_posext.available_methods()`` lists them per
            kind), factor or target length, and the pre-training window L if overridden (default: the
            table's rows / the config's window; for a learned table at most the number of position rows).
        tokenizer: its ``model_max_length`` is set to the new window (and restored by unpatch).

    Returns:
        The same model, patched in place. Patching again replaces the previous patch.

    Raises:
        TypeError: not a transformers model; a ``tokenizer`` without ``model_max_length``.
        ValueError: a method not valid for this kind of positions (the message lists the valid ones),
            unknown parameter, bad factor, a table over 2^20 rows. The model is unchanged on any error.
        UnsupportedModelError: no absolute positions found.
    """
    check_model(model)
    previous = patch_state(model)
    positions = _positions_to_patch(model, previous)
    method, notes = resolve_method(request.method, positions.kind)
    resolved = _resolve_scaling(positions, request, method.name)
    if resolved is None:
        return model  # ALiBi without a length limit: nothing to change
    scaling, exact, new_window = resolved
    record, base_record = _record_for(positions, scaling, new_window, previous)
    assignments = plan_assignments(positions, scaling, exact, new_window, record, base_record)
    check_tokenizer(tokenizer)

    # Nothing above changed the model; from here on, undo on any failure.
    if previous is not None:
        revert_assignments(previous.assignments)
    try:
        apply_assignments(assignments)
    except Exception:
        if previous is not None:
            apply_assignments(previous.assignments)
        raise
    tokenizers = set_tokenizer_lengths(previous.tokenizers if previous else [], tokenizer, new_window)
    loadable = stock_loadable(positions.kind, scaling.method)
    model.__dict__[_STATE_ATTRIBUTE] = AbsoluteState(scaling, positions, assignments, new_window, tokenizers, True, loadable, notes)
    if positions.tables:
        install_save_pretrained(model, _save_original_tables)
    _warn_patched(positions, notes, new_window)
    return model


def _positions_to_patch(model: nn.Module, previous: AbsoluteState | None) -> AbsolutePositions:
    """The sites to patch: the previous patch's (with their pre-patch objects), else found on the model."""
    if previous is not None:
        if not previous.original_tables_available:
            raise ValueError(
                "This model was loaded from a folder without hf_posext's original-table file "
                f"({SIDECAR_NAME}), so its pre-patch table is unknown and it cannot be patched again. "
                "Load the original checkpoint and patch that."
            )
        return previous.positions
    record = getattr(model.config, CONFIG_KEY, None)
    if isinstance(record, dict) and record.get("kind", "rope") != "rope":
        raise ValueError(
            f"This model was saved after hf_posext patching ({record.get('method')} x{record.get('factor'):g}, "
            f"{record.get('current_window')} positions) and loaded without hf_posext, so its positions are "
            "already extended. Load it with hf_posext.load(path) to patch it again or unpatch it."
        )
    positions = find_absolute_positions(model)
    if positions is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no learned position table, sinusoidal encoding or ALiBi that hf_posext recognises."
        )
    return positions


def _resolve_scaling(
    positions: AbsolutePositions, request: ScalingRequest, method_name: str
) -> tuple[ScalingConfig, Fraction, int] | None:
    """(scaling, exact factor, new window) for ``request``; None (with a warning) for ALiBi without a limit."""
    factor, target_length = request.factor, request.target_length
    override = request.original_max_position_embeddings
    window = original_window(positions, override)
    if window is None:
        if override is None and target_length is None:
            resolve_factor(factor, None, 1)  # still reject bad factors
            warnings.warn(
                f"{positions.family} uses ALiBi and its config records no length limit: it already runs at any "
                "length, so hf_posext.patch changed nothing.",
                stacklevel=4,  # as from patch_absolute at stacklevel 3
            )
            return None
        window = target_length if override is None else override
    scale = resolve_factor(factor, target_length, window)
    scaling = ScalingConfig(method_name, scale, window, request.params_dict, kind=positions.kind)
    exact = exact_factor(scale, target_length, window)
    new_window = int(target_length) if target_length is not None else scaling.target_length
    if positions.window is not None and new_window < positions.window:
        raise ValueError(
            f"The new window ({new_window} = {window} x {scale:g}) is shorter than the {positions.window} positions "
            f"the model already has; use a factor of at least {positions.window / window:g}."
        )
    return scaling, exact, new_window


def _record_for(
    positions: AbsolutePositions, scaling: ScalingConfig, new_window: int, previous: AbsoluteState | None
) -> tuple[dict[str, Any], Any]:
    """The config's new ``hf_posext`` record, and the one it held before any patch (``ABSENT`` when none)."""
    original_config = dict(positions.config_fields)
    if previous is None:
        base_record = positions.config.__dict__.get(CONFIG_KEY, ABSENT)
    else:
        base_record = next(a.original for a in previous.assignments if a.how == "config" and a.name == CONFIG_KEY)
    if base_record is not ABSENT:
        original_config[CONFIG_KEY] = base_record
    record = build_record(scaling, positions, new_window, json.loads(json.dumps(original_config, default=str)))
    return record, base_record


def _warn_patched(positions: AbsolutePositions, notes: list[str], new_window: int) -> None:
    """The patch's notes (an alias resolved), and for ALiBi that only the length limit moved."""
    for note in notes:
        warnings.warn(note, stacklevel=4)  # as from patch_absolute at stacklevel 3
    if positions.kind == "alibi":
        lifted = ", ".join(f"config.{name}" for name in positions.config_fields) or "nothing (no limit in the config)"
        warnings.warn(
            f"{positions.family} uses ALiBi, which needs no scaling; hf_posext only lifted the length limit "
            f"({lifted}) to {new_window} tokens.",
            stacklevel=4,
        )


def unpatch_absolute(model: nn.Module) -> nn.Module:
    """Restore what :func:`patch_absolute` changed: the original table ``Parameter``, buffers, config
    fields and tokenizer ``model_max_length``, bit for bit.

    Raises:
        ValueError: the model is not patched, or was loaded without its original-table file.
    """
    check_model(model)
    state = patch_state(model)
    if state is None:
        raise ValueError("This model is not patched by hf_posext (nothing to unpatch).")
    if not state.original_tables_available:
        raise ValueError(
            f"This model was loaded from a folder without {SIDECAR_NAME}, so its pre-patch position table is "
            "unknown and cannot be restored. Load the original checkpoint instead."
        )
    revert_assignments(state.assignments)
    restore_tokenizer_lengths(state.tokenizers)
    remove_save_pretrained(model)
    del model.__dict__[_STATE_ATTRIBUTE]
    return model


def _save_original_tables(model: nn.Module, save_directory: str) -> None:
    """After ``save_pretrained``: the original learned tables in :data:`SIDECAR_NAME` (for exact unpatch)."""
    state = patch_state(model)
    if state is not None and state.original_tables_available:
        from safetensors.torch import save_file

        tensors = {
            table.path: table.original_weight.detach().to("cpu").contiguous().clone()
            for table in state.positions.tables
        }
        save_file(tensors, os.path.join(save_directory, SIDECAR_NAME), metadata={"format": "pt", "writer": "hf_posext"})


# --------------------------------------------------------------------------------------------------
# describe / load
# --------------------------------------------------------------------------------------------------


def _kind_notes(positions: AbsolutePositions) -> list[str]:
    if positions.kind == "alibi":
        limit = ", ".join(f"config.{name}={value}" for name, value in positions.config_fields.items())
        return [
            "ALiBi needs no scaling: it biases attention by distance and extrapolates by design. "
            + (f"hf_posext.patch only lifts the length limit ({limit})." if limit else "This model has no length limit to lift.")
        ]
    if positions.kind == "sinusoidal":
        return ["sinusoidal encodings are defined at every position: 'linear' evaluates them at p/s, 'none' continues them"]
    offsets = {t.offset for t in positions.tables}
    if offsets != {0}:
        return [f"position 0 is table row {', '.join(map(str, sorted(offsets)))} (rows before it are kept as they are)"]
    return []


def describe_absolute(model: nn.Module) -> ScalingReport:
    """:class:`~hf_posext.backends.rope.surgery.ScalingReport` for a model with absolute positions (kind learned/sinusoidal/alibi)."""
    check_model(model)
    state = patch_state(model)
    if state is not None:
        positions = state.positions
        notes = _kind_notes(positions) + list(state.notes)
        if not state.original_tables_available:
            notes.append(f"loaded without {SIDECAR_NAME}: unpatch is not possible")
        if state.tokenizers:
            notes.append(f"tokenizer model_max_length set to {state.new_window}")
        return ScalingReport(
            family=positions.family, kind=positions.kind, method=state.scaling.method, factor=state.scaling.factor,
            original_window=state.scaling.original_max_position_embeddings, current_window=state.new_window,
            dynamic=False, sites=positions.site_paths, params=dict(state.scaling.params),
            stock_loadable=state.stock_loadable, notes=notes,
        )
    positions = find_absolute_positions(model)
    if positions is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no absolute position encoding hf_posext recognises.")
    notes = _kind_notes(positions)
    record = getattr(model.config, CONFIG_KEY, None)
    if isinstance(record, dict) and record.get("kind", "rope") != "rope":
        notes.append(
            f"saved by hf_posext with {record.get('method')} x{record.get('factor'):g} and loaded without it; "
            "use hf_posext.load(path) to unpatch or re-patch"
        )
    window = positions.window or 0
    return ScalingReport(
        family=positions.family, kind=positions.kind, method=BASELINE, factor=1.0, original_window=window,
        current_window=window, dynamic=False, sites=positions.site_paths, params={}, stock_loadable=None, notes=notes,
    )


def _read_sidecar(path: str) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    if os.path.isdir(path):
        file = os.path.join(path, SIDECAR_NAME)
        return load_file(file) if os.path.exists(file) else None
    try:
        from huggingface_hub import hf_hub_download

        return load_file(hf_hub_download(path, SIDECAR_NAME))
    except Exception:  # no such file in the repo, or offline: unpatch will say what is missing
        return None


def _as_before_patch(
    positions: AbsolutePositions, delta: int, sidecar: dict[str, torch.Tensor] | None
) -> tuple[bool, dict[str, torch.Tensor]]:
    """Make the sites of a model loaded patched hold their pre-patch originals (every length ``delta`` shorter).

    Returns:
        (whether every original table was in the sidecar, table path -> the loaded, extended weight).
    """
    if positions.window is not None:
        positions.window -= delta
    available = True
    loaded_tables = {}
    for table in positions.tables:
        loaded_tables[table.path] = table.module.weight.detach().clone()
        original = sidecar.get(table.path) if sidecar else None
        if original is None:
            available = False
            table.original_weight = nn.Parameter(table.module.weight.detach()[: table.module.num_embeddings - delta].clone(),
                                                 requires_grad=table.module.weight.requires_grad)
        else:
            table.original_weight = nn.Parameter(original.to(dtype=table.module.weight.dtype, device=table.module.weight.device),
                                                 requires_grad=table.module.weight.requires_grad)
        table.window = table.original_weight.shape[0] - table.offset
    for site in positions.sinusoids:
        site.original_buffer = site.original_buffer[: site.original_buffer.shape[0] - delta].clone()
    for buffer in positions.buffers:
        buffer.original = buffer.rebuild(buffer.original.shape[-1] - delta, {}).clone()
    for attribute in positions.attributes:
        attribute.original = attribute.original - delta
    positions.config_fields = {name: value - delta for name, value in positions.config_fields.items()}
    return available, loaded_tables


def load_absolute(path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved after :func:`patch_absolute` and restore its patch state.

    The saved weights (the extended, possibly fine-tuned table) are used as they are; the original
    table comes from :data:`SIDECAR_NAME` so that ``unpatch`` restores the pre-patch model exactly.
    Sinusoidal ``linear`` patches are re-applied (their table is computed, not saved).

    Args:
        path: the folder (or hub name) passed to ``hf_posext.load``.
        record: the ``hf_posext`` record of its config.
        **from_pretrained_kwargs: passed to the model class's ``from_pretrained``.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs))
    model = model_class_for(config).from_pretrained(path, **from_pretrained_kwargs)
    positions = find_absolute_positions(model)
    if positions is None:
        raise UnsupportedModelError(f"{path} has an hf_posext {record.get('kind')!r} record but no such positions were found.")
    scaling = ScalingConfig.from_dict(record)
    new_window = int(record.get("current_window") or scaling.target_length)
    original_config = dict(record.get("original_config", {}))
    # The loaded model is sized for the new window; shift every length back by the same amount.
    common = [name for name in positions.config_fields if name in original_config]
    delta = positions.config_fields[common[0]] - int(original_config[common[0]]) if common else 0
    sidecar = _read_sidecar(path) if positions.tables else None
    available, loaded_tables = _as_before_patch(positions, delta, sidecar)
    # The config the model was loaded with already holds the record; unpatch removes it (or restores an older one).
    base_record = original_config.get(CONFIG_KEY, ABSENT)
    exact = exact_factor(scaling.factor, None, scaling.original_max_position_embeddings)
    assignments = plan_assignments(positions, scaling, exact, new_window, dict(record), base_record, loaded_tables=loaded_tables)
    apply_assignments(assignments)
    loadable = stock_loadable(positions.kind, scaling.method)
    model.__dict__[_STATE_ATTRIBUTE] = AbsoluteState(scaling, positions, assignments, new_window, [], available, loadable)
    if positions.tables:
        install_save_pretrained(model, _save_original_tables)
    return model
