"""Absolute position encodings: learned tables, sinusoidal encodings and ALiBi (model surgery).

:mod:`hf_posext.backends.rope.surgery` hands a model here when :func:`detect` finds no rotary module but one of:

- a **learned table**: an ``nn.Embedding`` (or subclass) that is not the token embedding and whose row
  count matches the config's window, e.g. GPT-2/GPT-Neo ``transformer.wpe`` (``n_positions`` /
  ``max_position_embeddings``), OPT/BioGPT ``embed_positions`` (2 offset rows before position 0, read
  from the module's ``offset``), BERT/RoBERTa ``embeddings.position_embeddings`` (RoBERTa's positions
  start at ``padding_idx + 1``);
- a **sinusoidal** encoding: a 2-D buffer whose rows equal sin/cos of the position (XGLM and the other
  fairseq-style modules that keep ``weights``, ``offset`` and regrow on demand);
- **ALiBi**: no position module, and a config or model that declares ALiBi (BLOOM, MPT, Falcon with
  ``alibi=True``).

Detection is by structure (row counts, buffer contents), never by class names. What else a window
sizes is found the same way and resized with the table: BERT's ``position_ids`` / ``token_type_ids``
buffers, GPT-Neo's causal (and local-band) mask buffers, integer attributes such as OPT's
``max_target_positions``, the config's window fields and, when passed, the tokenizer's
``model_max_length``.

Patching records what it changed (:class:`_Assignment`), so :func:`unpatch_absolute` puts back the
original objects (the original ``Parameter``, buffers and config values: bit for bit). A patched learned
model saves with stock ``save_pretrained`` (the table is just bigger, so stock ``from_pretrained`` loads
it); hf_posext also writes the original table to ``hf_posext_absolute.safetensors`` next to the weights
so that ``hf_posext.load(path)`` followed by ``unpatch`` restores the pre-patch model exactly.
"""

from __future__ import annotations

import copy
import json
import math
import os
import types
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from hf_posext.backends.rope import sites as families
from hf_posext.core.errors import UnsupportedModelError, check_model
from hf_posext.core.loading import config_kwargs, model_class_for
from hf_posext.core.record import ABSENT, CONFIG_KEY, ScalingReport, config_attribute
from hf_posext.core.request import ScalingConfig, ScalingRequest, resolve_factor
from hf_posext.methods import BASELINE, get_method, resolve_method
from hf_posext.methods.learned import MAX_TABLE_ROWS, exact_factor

__all__ = [
    "detect",
    "is_patched",
    "patch_absolute",
    "unpatch_absolute",
    "describe_absolute",
    "load_absolute",
    "find_absolute_positions",
    "sinusoid_table",
    "AbsolutePositions",
    "SIDECAR_NAME",
]

#: File written next to a saved patched model: the original (pre-patch) learned tables.
SIDECAR_NAME = "hf_posext_absolute.safetensors"
_STATE_ATTRIBUTE = "_hf_posext_absolute_state"

#: Config attributes that can hold a model's maximum length (resolved through ``attribute_map``).
_WINDOW_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length")
#: Integer module attributes whose name says "a length in positions".
_LENGTH_NAME_HINTS = ("position", "max_seq", "max_target", "max_len", "seq_len")
#: Largest square mask buffer (GPT-Neo's causal mask) rebuilt for a new window: 2^32 elements.
_MAX_MASK_ELEMENTS = 2**32


# --------------------------------------------------------------------------------------------------
# Sinusoids
# --------------------------------------------------------------------------------------------------


def sinusoid_table(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Sinusoidal encodings (tensor2tensor / fairseq layout) at real-valued ``positions``.

    Row for position x: ``[sin(x * w_0), ..., sin(x * w_{h-1}), cos(x * w_0), ..., cos(x * w_{h-1})]``
    (a zero column appended when ``dim`` is odd), with h = dim // 2 and w_i = exp(-i * ln(base) / (h - 1)).
    The operations follow transformers' XGLM implementation in the same order and float32, so integer
    positions reproduce its table bit for bit.

    Args:
        positions: 1-D tensor of positions (any float dtype; evaluated in float32 as transformers does).
        dim: embedding width.
        base: the wavelength base (10000 in every model that uses this layout).

    Returns:
        float32 tensor ``[len(positions), dim]``.
    """
    half_dim = dim // 2
    step = math.log(base) / (half_dim - 1)
    frequencies = torch.exp(torch.arange(half_dim, dtype=torch.int64).float() * -step)
    angles = positions.to(torch.float32).unsqueeze(1) * frequencies.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).view(positions.shape[0], -1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(positions.shape[0], 1)], dim=1)
    return table


def _scaled_sinusoid_rows(num_rows: int, dim: int, offset: int, padding_rows: tuple[int, ...], positions_fn) -> torch.Tensor:
    """Rows 0..num_rows-1 of a sinusoid table whose position rows (from ``offset``) use ``positions_fn``."""
    positions = torch.arange(num_rows, dtype=torch.float64)
    if num_rows > offset:
        positions[offset:] = positions_fn(num_rows - offset) + offset
    table = sinusoid_table(positions, dim)
    for row in padding_rows:
        if row < num_rows:
            table[row] = 0
    return table


class _ScaledSinusoidRows:
    """Picklable stand-in for a sinusoidal module's ``get_embedding``: regrowth stays scaled."""

    def __init__(self, offset: int, padding_rows: tuple[int, ...], factor: Fraction, method: str) -> None:
        self.offset, self.padding_rows, self.factor, self.method = offset, padding_rows, factor, method

    def __call__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None) -> torch.Tensor:
        compute = get_method(self.method, "sinusoidal").compute
        table = _scaled_sinusoid_rows(
            num_embeddings, embedding_dim, self.offset, self.padding_rows, lambda n: compute(n, self.factor, None)
        )
        return table.to(torch.get_default_dtype())


# --------------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------------


@dataclass
class TableSite:
    """A learned position table: ``module.weight`` rows ``offset .. offset + window - 1`` are positions 0..window-1."""

    path: str
    module: nn.Embedding
    offset: int
    window: int
    original_weight: nn.Parameter | None


@dataclass
class SinusoidSite:
    """A sinusoidal encoding kept in a buffer (rows from ``offset`` are positions 0, 1, ...)."""

    path: str
    module: nn.Module
    buffer_name: str
    offset: int
    padding_rows: tuple[int, ...]
    dim: int
    original_buffer: torch.Tensor
    regrows: bool
    original_get_embedding: Any = None


@dataclass
class BufferSite:
    """A buffer sized by the window (``rule``: ``arange``, ``zeros`` or ``band``), rebuilt for a new one."""

    path: str
    module: nn.Module
    name: str
    original: torch.Tensor
    rule: str
    band_width: int | None = None

    def rebuild(self, length: int, cache: dict) -> torch.Tensor:
        """The buffer for ``length`` positions (identical tensors are shared between modules)."""
        original = self.original
        if self.rule == "arange":
            shape = original.shape[:-1] + (length,)
            return torch.arange(length, dtype=original.dtype, device=original.device).expand(shape).clone()
        if self.rule == "zeros":
            return torch.zeros(original.shape[:-1] + (length,), dtype=original.dtype, device=original.device)
        key = (self.rule, self.band_width, length, original.shape[:-2], original.dtype, str(original.device))
        if key not in cache:
            full = torch.ones((length, length), dtype=torch.bool, device=original.device).tril()
            if self.band_width is not None:
                full = torch.bitwise_xor(full, torch.tril(full, -self.band_width))
            cache[key] = full.view(*original.shape[:-2], length, length).to(original.dtype)
        return cache[key]


@dataclass
class LengthAttribute:
    """An integer attribute of a module that holds a length (OPT's ``max_target_positions``)."""

    path: str
    module: nn.Module
    name: str
    original: int


@dataclass
class AbsolutePositions:
    """What a model uses for absolute positions and everything sized by its window.

    Attributes:
        kind: ``"learned"``, ``"sinusoidal"`` or ``"alibi"``.
        family: the config's ``model_type``.
        window: the window positions are defined for now (rows of the table; the config's limit).
        tables / sinusoids: the position modules.
        buffers / attributes: other things sized by the window.
        config: the config object holding the window fields.
        config_fields: attribute name -> original value, for the config fields that hold lengths.
    """

    kind: str
    family: str
    window: int | None
    tables: list[TableSite] = field(default_factory=list)
    sinusoids: list[SinusoidSite] = field(default_factory=list)
    buffers: list[BufferSite] = field(default_factory=list)
    attributes: list[LengthAttribute] = field(default_factory=list)
    config: Any = None
    config_fields: dict[str, int] = field(default_factory=dict)

    @property
    def site_paths(self) -> list[str]:
        paths = [t.path for t in self.tables] + [s.path for s in self.sinusoids]
        return paths or ["(attention bias: ALiBi)"]


def _window_fields(config) -> dict[str, int]:
    """Config attribute name -> value, for each field that holds a maximum length."""
    found = {}
    for key in _WINDOW_FIELDS:
        name = config_attribute(config, key)
        value = config.__dict__.get(name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[name] = value
    return found


def _has_rotary(model: nn.Module) -> bool:
    for _, module in model.named_modules():
        if type(module).__name__ == "ScaledRotaryEmbedding":
            return True
        if families.accepts_position_ids(module) and families.frequency_buffers(module) is not None:
            return True
    return False


def _excluded_embeddings(model: nn.Module) -> set[int]:
    excluded = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError, TypeError):
            module = None
        if module is not None:
            excluded.add(id(module))
    return excluded


def _find_tables(model: nn.Module, fields: dict[str, int]) -> list[TableSite]:
    excluded = _excluded_embeddings(model)
    tables = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or id(module) in excluded:
            continue
        rows = module.num_embeddings
        module_offset = getattr(module, "offset", None)
        module_offset = module_offset if isinstance(module_offset, int) and not isinstance(module_offset, bool) else None
        matches = any(rows == value or (module_offset is not None and rows == value + module_offset) for value in fields.values())
        if not matches:
            continue
        if module_offset is not None:
            offset = module_offset
        elif module.padding_idx is not None:
            offset = module.padding_idx + 1  # fairseq/RoBERTa convention: positions start after padding_idx
        else:
            offset = 0
        if rows - offset <= 0:
            continue
        tables.append(TableSite(path, module, offset, rows - offset, module.weight))
    return tables


def _find_sinusoids(model: nn.Module, fields: dict[str, int]) -> list[SinusoidSite]:
    if not fields:
        return []
    smallest = min(fields.values())
    sites = []
    for path, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.dim() != 2 or not buffer.is_floating_point() or buffer.shape[0] < smallest or buffer.shape[1] < 4:
                continue
            rows, dim = buffer.shape
            table = buffer.detach().float().cpu()
            padding_rows = tuple(int(r) for r in torch.nonzero(table.abs().sum(dim=1) == 0).flatten()[:4])
            reference = sinusoid_table(torch.arange(rows, dtype=torch.float64), dim)
            for row in padding_rows:
                reference[row] = 0
            tolerance = 1e-5 if buffer.dtype == torch.float32 or buffer.dtype == torch.float64 else 1e-2
            if not torch.allclose(table, reference, atol=tolerance, rtol=0):
                continue
            module_offset = getattr(module, "offset", None)
            if isinstance(module_offset, int) and not isinstance(module_offset, bool):
                offset = module_offset
            elif isinstance(getattr(module, "padding_idx", None), int):
                offset = module.padding_idx + 1
            else:
                offset = 0
            regrows = callable(getattr(type(module), "make_weights", None)) and callable(getattr(type(module), "get_embedding", None))
            sites.append(SinusoidSite(path, module, name, offset, padding_rows, dim, buffer, regrows,
                                      module.__dict__.get("get_embedding", ABSENT)))
    return sites


def _config_declares_alibi(config) -> bool:
    """Falcon's ``alibi=True``, MPT's ``attn_config.alibi``: ALiBi even where a rotary module exists unused."""
    if getattr(config, "alibi", False) is True:
        return True
    attn_config = getattr(config, "attn_config", None)
    return attn_config is not None and getattr(attn_config, "alibi", False) is True


def _declares_alibi(model: nn.Module) -> bool:
    if _config_declares_alibi(model.config):
        return True
    for _, module in model.named_modules():
        if getattr(module, "use_alibi", False) is True:
            return True
        if any("alibi" in name for name in dir(type(module)) if not name.startswith("__")):
            return True
    return False


def _find_window_buffers(model: nn.Module, lengths: set[int], skip: set[int]) -> list[BufferSite]:
    sites = []
    for path, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if id(buffer) in skip or buffer.dim() == 0:
                continue
            length = buffer.shape[-1]
            if length not in lengths:
                continue
            if buffer.dtype in (torch.int64, torch.int32) and buffer.dim() <= 2 and all(d == 1 for d in buffer.shape[:-1]):
                flat = buffer.reshape(-1)
                if torch.equal(flat, torch.arange(length, dtype=buffer.dtype, device=buffer.device)):
                    sites.append(BufferSite(f"{path}.{name}", module, name, buffer, "arange"))
                elif not flat.any():
                    sites.append(BufferSite(f"{path}.{name}", module, name, buffer, "zeros"))
            elif buffer.dtype == torch.bool and buffer.dim() >= 2 and buffer.shape[-2] == length:
                square = buffer.reshape(-1, length, length)[0]
                if not all(d == 1 for d in buffer.shape[:-2]):
                    continue
                width = int(square[-1].sum())
                causal = torch.ones((length, length), dtype=torch.bool, device=buffer.device).tril()
                band_width = None if width >= length else width
                if band_width is not None:
                    causal = torch.bitwise_xor(causal, torch.tril(causal, -band_width))
                if torch.equal(square, causal):
                    sites.append(BufferSite(f"{path}.{name}", module, name, buffer, "band", band_width))
    return sites


def _find_length_attributes(model: nn.Module, lengths: set[int]) -> list[LengthAttribute]:
    found = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, bool) or not isinstance(value, int) or value not in lengths:
                continue
            if name == "num_embeddings" or not any(hint in name for hint in _LENGTH_NAME_HINTS):
                continue
            found.append(LengthAttribute(f"{path}.{name}".lstrip("."), module, name, value))
    return found


def find_absolute_positions(model: nn.Module) -> AbsolutePositions | None:
    """What ``model`` uses for absolute positions, or None (RoPE models, models without positions).

    Raises:
        UnsupportedModelError: a model with both a learned table and a sinusoidal encoding.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    alibi_by_config = _config_declares_alibi(config)
    if not alibi_by_config and _has_rotary(model):
        return None
    family = getattr(config, "model_type", type(model).__name__)
    fields = _window_fields(config)
    tables = [] if alibi_by_config else _find_tables(model, fields)
    sinusoids = [] if alibi_by_config else _find_sinusoids(model, fields)
    if tables and sinusoids:
        raise UnsupportedModelError(
            f"{type(model).__name__} has both learned position tables ({', '.join(t.path for t in tables)}) and "
            f"sinusoidal encodings ({', '.join(s.path for s in sinusoids)}); hf_posext patches one kind per model."
        )
    if tables:
        kind = "learned"
        windows = {t.window for t in tables}
        window = min(windows)
        # Everything sized like a table or a config field moves with the table.
        lengths = {t.module.num_embeddings for t in tables} | set(fields.values())
    elif sinusoids:
        kind = "sinusoidal"
        window = min(fields.values())
        lengths = set(fields.values())
    elif _declares_alibi(model):
        kind = "alibi"
        window = min(fields.values()) if fields else None
        lengths = set(fields.values())
    else:
        return None
    skip = {id(t.module.weight) for t in tables} | {id(s.original_buffer) for s in sinusoids}
    buffers = _find_window_buffers(model, lengths, skip) if lengths else []
    attributes = _find_length_attributes(model, lengths) if lengths else []
    return AbsolutePositions(kind, family, window, tables, sinusoids, buffers, attributes, config, dict(fields))


def detect(model: nn.Module) -> bool:
    """True when ``model`` encodes positions with a learned table, sinusoids or ALiBi (not RoPE)."""
    try:
        return find_absolute_positions(model) is not None
    except UnsupportedModelError:
        return True  # ours to handle: patch_absolute reports the problem


def patch_state(model: nn.Module) -> "_AbsoluteState | None":
    """The patch state :func:`patch_absolute` keeps on ``model`` (None when not patched)."""
    state = getattr(model, "__dict__", {}).get(_STATE_ATTRIBUTE)
    return state if isinstance(state, _AbsoluteState) else None


def is_patched(model: nn.Module) -> bool:
    """True when :func:`patch_absolute` patched this model in memory."""
    return isinstance(getattr(model, "__dict__", {}).get(_STATE_ATTRIBUTE), _AbsoluteState)


# --------------------------------------------------------------------------------------------------
# Planning and applying changes
# --------------------------------------------------------------------------------------------------


@dataclass
class _Assignment:
    """One change: ``target.<name>`` goes from ``original`` to ``new`` (``ABSENT`` = not set)."""

    target: Any
    name: str
    original: Any
    new: Any
    how: str  # "parameter", "buffer", "attribute", "config"

    def set(self, value: Any) -> None:
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
class _AbsoluteState:
    scaling: ScalingConfig
    positions: AbsolutePositions
    assignments: list[_Assignment]
    new_window: int
    tokenizers: list[tuple[Any, Any]] = field(default_factory=list)
    original_tables_available: bool = True
    stock_loadable: bool = True
    notes: list[str] = field(default_factory=list)


def _resolve_method(name: Any, kind: str) -> tuple[str, list[str]]:
    """The registered method for ``kind`` and any warning to emit (an alias such as ALiBi's 'linear')."""
    method, notes = resolve_method(name, kind)
    return method.name, notes


def _stock_loadable(kind: str, method: str) -> bool:
    """Whether stock ``from_pretrained`` rebuilds the patched model: not for rescaled sinusoids (recomputed on load)."""
    return not (kind == "sinusoidal" and not get_method(method, kind).baseline)


def _original_window(positions: AbsolutePositions, override: int | None) -> int | None:
    """The pre-training window L: ``override`` (a positive int, checked by ScalingRequest) or the model's own."""
    if override is None:
        return positions.window
    if positions.kind == "learned" and override > positions.window:
        raise ValueError(
            f"original_max_position_embeddings={override} is larger than the learned table ({positions.window} "
            f"position rows at {', '.join(t.path for t in positions.tables)}); it can be at most {positions.window}."
        )
    return override


def _plan(
    positions: AbsolutePositions,
    scaling: ScalingConfig,
    factor: Fraction,
    new_window: int,
    record: dict[str, Any],
    base_record: Any,
    loaded_tables: dict[str, torch.Tensor] | None = None,
) -> list[_Assignment]:
    """Every change patching makes (nothing is changed here). Raises ValueError on sizes too large."""
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

    spec = scaling.spec
    assignments: list[_Assignment] = []
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
        assignments.append(_Assignment(table.module, "weight", original, parameter, "parameter"))
        assignments.append(_Assignment(table.module, "num_embeddings", original.shape[0], parameter.shape[0], "attribute"))
    for site in positions.sinusoids:
        if not spec.baseline:
            compute = spec.compute
            rows = max(site.original_buffer.shape[0] + delta, site.offset + new_window)
            table = _scaled_sinusoid_rows(
                rows, site.dim, site.offset, site.padding_rows, lambda n: compute(n, factor, scaling.parsed_params)
            )
            table = table.to(dtype=site.original_buffer.dtype, device=site.original_buffer.device)
            assignments.append(_Assignment(site.module, site.buffer_name, site.original_buffer, table, "buffer"))
            if site.regrows:
                regrow = _ScaledSinusoidRows(site.offset, site.padding_rows, factor, spec.name)
                assignments.append(_Assignment(site.module, "get_embedding", site.original_get_embedding, regrow, "attribute"))
    cache: dict = {}
    for buffer in positions.buffers:
        rebuilt = buffer.rebuild(buffer.original.shape[-1] + delta, cache)
        assignments.append(_Assignment(buffer.module, buffer.name, buffer.original, rebuilt, "buffer"))
    for attribute in positions.attributes:
        assignments.append(_Assignment(attribute.module, attribute.name, attribute.original, attribute.original + delta, "attribute"))
    config = positions.config
    for name, value in positions.config_fields.items():
        assignments.append(_Assignment(config, name, value, value + delta, "config"))
    assignments.append(_Assignment(config, CONFIG_KEY, base_record, record, "config"))
    return assignments


def _apply(assignments: list[_Assignment]) -> None:
    done = []
    try:
        for assignment in assignments:
            assignment.set(assignment.new)
            done.append(assignment)
    except Exception:
        for assignment in reversed(done):
            assignment.set(assignment.original)
        raise


def _revert(assignments: list[_Assignment]) -> None:
    for assignment in reversed(assignments):
        assignment.set(assignment.original)


def _update_tokenizers(tokenizer: Any, new_window: int) -> list[tuple[Any, Any]]:
    if tokenizer is None:
        return []
    if not hasattr(tokenizer, "model_max_length"):
        raise TypeError(
            f"tokenizer= must be a transformers tokenizer (with model_max_length), got {type(tokenizer).__name__}."
        )
    return [(tokenizer, tokenizer.model_max_length)]


def _record(scaling: ScalingConfig, positions: AbsolutePositions, new_window: int, original_config: dict[str, Any]) -> dict[str, Any]:
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
    previous: _AbsoluteState | None = model.__dict__.get(_STATE_ATTRIBUTE)
    if previous is not None:
        positions = previous.positions
        if not previous.original_tables_available:
            raise ValueError(
                "This model was loaded from a folder without hf_posext's original-table file "
                f"({SIDECAR_NAME}), so its pre-patch table is unknown and it cannot be patched again. "
                "Load the original checkpoint and patch that."
            )
    else:
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
    method_name, notes = _resolve_method(request.method, positions.kind)
    factor, target_length = request.factor, request.target_length
    original_max_position_embeddings = request.original_max_position_embeddings
    window = _original_window(positions, original_max_position_embeddings)
    if window is None:
        if original_max_position_embeddings is None and target_length is None:
            resolve_factor(factor, None, 1)  # still reject bad factors
            warnings.warn(
                f"{positions.family} uses ALiBi and its config records no length limit: it already runs at any "
                "length, so hf_posext.patch changed nothing.",
                stacklevel=3,
            )
            return model
        window = target_length if original_max_position_embeddings is None else original_max_position_embeddings
    scale = resolve_factor(factor, target_length, window)
    scaling = ScalingConfig(method_name, scale, window, request.params_dict, kind=positions.kind)
    exact = exact_factor(scale, target_length, window)
    new_window = int(target_length) if target_length is not None else scaling.target_length
    if positions.window is not None and new_window < positions.window:
        raise ValueError(
            f"The new window ({new_window} = {window} x {scale:g}) is shorter than the {positions.window} positions "
            f"the model already has; use a factor of at least {positions.window / window:g}."
        )
    original_config = {}
    config = positions.config
    for name, value in positions.config_fields.items():
        original_config[name] = value
    base_record = config.__dict__.get(CONFIG_KEY, ABSENT) if previous is None else next(
        a.original for a in previous.assignments if a.how == "config" and a.name == CONFIG_KEY
    )
    if base_record is not ABSENT:
        original_config[CONFIG_KEY] = base_record
    record = _record(scaling, positions, new_window, json.loads(json.dumps(original_config, default=str)))
    assignments = _plan(positions, scaling, exact, new_window, record, base_record)
    _update_tokenizers(tokenizer, new_window)  # validates before anything changes

    if previous is not None:
        _revert(previous.assignments)
        for tok, value in previous.tokenizers:
            tok.model_max_length = value
    tokenizers = _update_tokenizers(tokenizer, new_window)  # original lengths, after the previous patch is undone
    try:
        _apply(assignments)
    except Exception:
        if previous is not None:
            _apply(previous.assignments)
        raise
    for tok, _ in tokenizers:
        tok.model_max_length = new_window
    if previous is not None and tokenizer is None:
        # Keep the tokenizer given to the previous patch in step with the new window.
        tokenizers = previous.tokenizers
        for tok, _ in tokenizers:
            tok.model_max_length = new_window
    stock_loadable = _stock_loadable(positions.kind, method_name)
    state = _AbsoluteState(scaling, positions, assignments, new_window, tokenizers, True, stock_loadable, notes)
    model.__dict__[_STATE_ATTRIBUTE] = state
    if positions.tables:
        model.__dict__["save_pretrained"] = types.MethodType(_save_with_original_tables, model)
    for note in notes:
        warnings.warn(note, stacklevel=3)
    if positions.kind == "alibi":
        lifted = ", ".join(f"config.{name}" for name in positions.config_fields) or "nothing (no limit in the config)"
        warnings.warn(
            f"{positions.family} uses ALiBi, which needs no scaling; hf_posext only lifted the length limit "
            f"({lifted}) to {new_window} tokens.",
            stacklevel=3,
        )
    return model


def unpatch_absolute(model: nn.Module) -> nn.Module:
    """Restore what :func:`patch_absolute` changed: the original table ``Parameter``, buffers, config
    fields and tokenizer ``model_max_length``, bit for bit.

    Raises:
        ValueError: the model is not patched, or was loaded without its original-table file.
    """
    check_model(model)
    state: _AbsoluteState | None = model.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        raise ValueError("This model is not patched by hf_posext (nothing to unpatch).")
    if not state.original_tables_available:
        raise ValueError(
            f"This model was loaded from a folder without {SIDECAR_NAME}, so its pre-patch position table is "
            "unknown and cannot be restored. Load the original checkpoint instead."
        )
    _revert(state.assignments)
    for tokenizer, value in state.tokenizers:
        tokenizer.model_max_length = value
    model.__dict__.pop("save_pretrained", None)
    del model.__dict__[_STATE_ATTRIBUTE]
    return model


def _save_with_original_tables(self: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained``, plus the original learned tables in :data:`SIDECAR_NAME` (for exact unpatch)."""
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    state: _AbsoluteState | None = self.__dict__.get(_STATE_ATTRIBUTE)
    if state is not None and state.original_tables_available and kwargs.get("is_main_process", True):
        from safetensors.torch import save_file

        tensors = {
            table.path: table.original_weight.detach().to("cpu").contiguous().clone()
            for table in state.positions.tables
        }
        save_file(tensors, os.path.join(os.fspath(save_directory), SIDECAR_NAME), metadata={"format": "pt", "writer": "hf_posext"})
    return result


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
    state: _AbsoluteState | None = model.__dict__.get(_STATE_ATTRIBUTE)
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
    if positions.window is not None:
        positions.window -= delta
    sidecar = _read_sidecar(path) if positions.tables else None
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
    # The config the model was loaded with already holds the record; unpatch removes it (or restores an older one).
    base_record = original_config.get(CONFIG_KEY, ABSENT)
    exact = exact_factor(scaling.factor, None, scaling.original_max_position_embeddings)
    assignments = _plan(positions, scaling, exact, new_window, dict(record), base_record, loaded_tables=loaded_tables)
    _apply(assignments)
    stock_loadable = _stock_loadable(positions.kind, scaling.method)
    state = _AbsoluteState(scaling, positions, assignments, new_window, [], available, stock_loadable)
    model.__dict__[_STATE_ATTRIBUTE] = state
    if positions.tables:
        model.__dict__["save_pretrained"] = types.MethodType(_save_with_original_tables, model)
    return model
