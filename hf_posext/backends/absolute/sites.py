"""Where a model keeps absolute positions: learned tables, sinusoidal buffers, ALiBi, and what its window sizes.

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
sizes is found the same way: BERT's ``position_ids`` / ``token_type_ids`` buffers, GPT-Neo's causal (and
local-band) mask buffers, integer attributes such as OPT's ``max_target_positions`` and the config's
window fields. Nothing here changes the model (:mod:`hf_posext.backends.absolute.plan` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext.backends.rope import sites as families
from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.record import ABSENT, config_attribute
from hf_posext.methods.learned import sinusoid_table

__all__ = [
    "TableSite",
    "SinusoidSite",
    "BufferSite",
    "LengthAttribute",
    "AbsolutePositions",
    "find_absolute_positions",
]

#: Config attributes that can hold a model's maximum length (resolved through ``attribute_map``).
_WINDOW_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length")
#: Integer module attributes whose name says "a length in positions".
_LENGTH_NAME_HINTS = ("position", "max_seq", "max_target", "max_len", "seq_len")


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
