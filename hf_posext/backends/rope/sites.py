"""Where each architecture keeps its positional module, found by structure rather than class names.

A *rotary site* is a module that owns RoPE frequencies (an ``inv_freq`` buffer, per-layer-type
``{type}_inv_freq`` buffers, or GPT-J's ``embed_positions`` sin/cos table) and whose ``forward`` takes
``position_ids``. For each site we find the base and current scaling that reproduce its output on probe
positions with our own methods; a site we cannot reproduce is an error, never a silent guess. That
probe is what keeps patching correct across transformers releases: if a release changes a module's
output convention, ``patch`` fails loudly instead of producing a subtly wrong model.

This module also reads and writes the RoPE fields of a config across transformers versions: 5.x keeps
them in ``config.rope_parameters`` (with ``rope_theta``), 4.5x in ``config.rope_scaling`` plus
``config.rope_theta``.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext.backends.rope.identify import identify_rotary, outputs_match, probe, rotated_pairs
from hf_posext.backends.rope.module import MIRRORED_ATTRIBUTES, RotaryEntry, ScaledRotaryEmbedding
from hf_posext.backends.rope.rules import scaled_layer_types
from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.request import ScalingConfig
from hf_posext.methods.rope import RotaryBase
from hf_posext.methods import get_method
from hf_posext.methods.transformers import ROPE_TYPES, method_for_rope_type, reads_top_level_original_window, window_is_scaled

__all__ = [
    "fill_legacy_rope_fields",
    "refuse_codebook_positions",
    "RotarySite",
    "UnsupportedModelError",
    "find_rotary_sites",
    "rope_parameters",
    "set_rope_parameters",
    "original_window",
    "SUPPORTED_FAMILIES",
    "accepts_position_ids",
    "frequency_buffers",
    "probe",
    "outputs_match",
]

#: Families covered by the tests (any model with the same structure works too).
SUPPORTED_FAMILIES = (
    "llama, mistral, qwen2/3, qwen3.5 (multimodal rows), gemma 1-3, gemma 4 and lfm3 (proportional, global layers), "
    "llama 4 (complex, NoPE layers), gpt-oss, cohere 1/2 (interleaved), deepseek v2/v3/v4 (MLA), phi, phi3, gpt_neox, gptj"
)



def _is_v5_config(config) -> bool:
    return "rope_parameters" in config.__dict__ or hasattr(type(config), "standardize_rope_params")


def rope_parameters(config, layer_type: str | None = None) -> dict[str, Any] | None:
    """The RoPE settings of ``config`` as one flat dict with ``rope_type`` and ``rope_theta``.

    Works for transformers 5.x (``rope_parameters``, nested per layer type for Gemma 3) and 4.5x
    (``rope_scaling`` + ``rope_theta``). Returns ``None`` when the config has no RoPE settings.
    """
    if _is_v5_config(config):
        params = getattr(config, "rope_parameters", None)
        if not params:
            return None
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        params = dict(params)
        params.setdefault("rope_type", params.get("type", "default"))
        return params
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = getattr(config, "rope_theta", None)
    if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None) is not None:
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    if theta is None and not scaling:
        return None
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling.pop("type", None)
    if theta is not None:
        scaling["rope_theta"] = theta
    return scaling


def set_rope_parameters(config, params: dict[str, Any], layer_type: str | None = None) -> None:
    """Write flat RoPE settings (as returned by :func:`rope_parameters`) into ``config``, any version."""
    params = dict(params)
    if _is_v5_config(config):
        current = getattr(config, "rope_parameters", None)
        if layer_type is not None and isinstance(current, dict) and isinstance(current.get(layer_type), dict):
            nested = copy.deepcopy(current)
            nested[layer_type] = params
            config.rope_parameters = nested
        else:
            config.rope_parameters = params
        return
    theta = params.pop("rope_theta", None)
    if theta is not None:
        config.rope_theta = theta
    if params.get("rope_type", "default") == "default":
        params.pop("rope_type", None)
        params.pop("partial_rotary_factor", None)
        config.rope_scaling = None if not params else params
    else:
        params["type"] = params["rope_type"]  # 4.x reads either spelling; older code only "type"
        config.rope_scaling = params
        if reads_top_level_original_window(params["rope_type"]) and params.get("original_max_position_embeddings"):
            # e.g. 4.x LongRoPE reads the pre-training window from the config itself (Phi-3 style).
            config.original_max_position_embeddings = params["original_max_position_embeddings"]


#: The layer type whose base and scaling a 4.x config of a per-layer-type model holds in its top-level ``rope_theta``
#: and ``rope_scaling`` (Gemma 3 and 3n, OLMo 3: the global layers; the others' base has a field of its own).
LEGACY_TOP_LEVEL_LAYER_TYPE = "full_attention"


def fill_legacy_rope_fields(config) -> None:
    """Give a transformers 4.x config the ``rope_theta`` and ``rope_scaling`` that a folder saved by transformers 5
    keeps only in ``rope_parameters`` (the record's pre-patch snapshot removes the top-level ones): without them its
    model finds no ``rope_theta`` at all (``AttributeError``), or builds the class's default base. A nested
    ``rope_parameters`` gives them from :data:`LEGACY_TOP_LEVEL_LAYER_TYPE`'s dict; the other layer types' bases
    (``rope_local_base_freq``) are the saved file's own fields. transformers 5 configs (their class standardises
    ``rope_parameters``; ``rope_scaling`` only aliases it) are left as they are."""
    params = config.__dict__.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(LEGACY_TOP_LEVEL_LAYER_TYPE), dict):
        params = params[LEGACY_TOP_LEVEL_LAYER_TYPE]
    if not isinstance(params, dict) or "rope_theta" not in params or hasattr(type(config), "standardize_rope_params"):
        return
    if "rope_theta" not in config.__dict__:
        config.rope_theta = params["rope_theta"]
    if config.__dict__.get("rope_scaling") is None:
        scaled = params.get("rope_type", "default") != "default"
        config.rope_scaling = {key: value for key, value in params.items() if key != "rope_theta"} if scaled else None


def original_window(config, params: dict[str, Any] | None) -> int:
    """The pre-training window L: ``original_max_position_embeddings`` if scaled, else the max length."""
    params = params or {}
    scaled = window_is_scaled(params.get("rope_type", "default"))
    if scaled and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    if scaled and getattr(config, "original_max_position_embeddings", None):
        return int(config.original_max_position_embeddings)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            if scaled and params.get("factor"):
                return int(round(value / params["factor"]))
            return value
    local = getattr(config, "attention_window_size", None)
    if isinstance(local, int) and local > 0:  # local attention only (RecurrentGemma): no distance past the band
        raise UnsupportedModelError(
            f"{getattr(config, 'model_type', 'this model')} attends only within a sliding window of {local} tokens "
            "(attention_window_size) and declares no window of positions (max_position_embeddings): no relative "
            f"distance past {local} ever reaches its rotary embedding, so it runs at any length as it is: there is "
            "nothing to scale."
        )
    raise UnsupportedModelError(
        "Could not find the model's window in its config (max_position_embeddings / n_positions): set "
        "model.config.max_position_embeddings to its pre-training length, then patch."
    )


def scaling_from_transformers(config, params: dict[str, Any], window: int) -> ScalingConfig:
    """Our ScalingConfig equivalent to a transformers rope dict (``rope_type`` + parameters)."""
    rope_type = params.get("rope_type", "default")
    if method_for_rope_type(rope_type) is None:
        raise UnsupportedModelError(
            f"The model already uses rope_type={rope_type!r}, which hf_posext cannot reproduce; supported "
            f"starting points: {', '.join(ROPE_TYPES)}."
        )
    method, keys = method_for_rope_type(rope_type)
    method_params = {k: params[k] for k in keys if params.get(k) is not None}
    factor = params.get("factor")
    if factor is None:
        max_len = getattr(config, "max_position_embeddings", None) or window
        factor = max(1.0, max_len / window)
    if get_method(method).baseline:
        factor = 1.0
    if not window_is_scaled(rope_type):  # dynamic scales from the config's max_position_embeddings = L
        window = getattr(config, "max_position_embeddings", window)
    return ScalingConfig(method, float(factor), int(window), method_params)


@dataclass
class RotarySite:
    """A rotary module inside a model, with what is needed to replace it.

    Attributes:
        path: dotted module path (``"model.rotary_emb"``).
        parent: the module holding it; ``attribute``: its attribute name there.
        module: the module itself (the original, for unpatching).
        layout: output convention (see :data:`hf_posext.backends.rope.module.LAYOUTS`).
        dims: rotary dimension per layer type (key ``None`` when there is one RoPE).
        bases: base theta per layer type, as verified by the probe.
        current: per layer type, the ScalingConfig reproducing what the module does now.
        config: the config object the module reads (``model.config`` or a text sub-config).
        scaled_layer_types: layer types that patching scales (Gemma 3: only ``full_attention``).
        rotated: per layer type, the pairs that rotate in a proportional RoPE (None: all of them).
        position_rows: multimodal RoPE: the row of 3-D position ids each pair rotates by (None: plain).
    """

    path: str
    parent: nn.Module
    attribute: str
    module: nn.Module
    layout: str
    dims: dict[str | None, int]
    config: Any
    bases: dict[str | None, float] = field(default_factory=dict)
    current: dict[str | None, ScalingConfig] = field(default_factory=dict)
    scaled_layer_types: tuple[str | None, ...] = (None,)
    rotated: dict[str | None, int | None] = field(default_factory=dict)
    position_rows: torch.Tensor | None = None

    def rotary_base(self, layer_type: str | None) -> RotaryBase:
        """The unscaled rotary embedding of ``layer_type`` (base, rotary dim, rotating pairs)."""
        return RotaryBase(self.bases[layer_type], self.dims[layer_type], self.rotated.get(layer_type))

    @property
    def device(self) -> torch.device:
        for buffer in self.module.buffers():
            return buffer.device
        return torch.device("cpu")


def accepts_position_ids(module: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def frequency_buffers(module: nn.Module) -> tuple[str, dict[str | None, int]] | None:
    """(layout, rotary dim per layer type) from a module's own buffers, or None if it holds no RoPE."""
    buffers = dict(module.named_buffers(recurse=False))
    if "inv_freq" in buffers:
        return "cos_sin", {None: 2 * buffers["inv_freq"].numel()}
    typed = {
        name[: -len("_inv_freq")]: 2 * tensor.numel()
        for name, tensor in buffers.items()
        if name.endswith("_inv_freq") and not name.endswith("original_inv_freq") and not name.endswith("long_inv_freq")
    }
    if typed:
        return "cos_sin", typed
    table = buffers.get("embed_positions")
    if table is not None and table.dim() == 2:
        return "sin_cos_half", {None: int(table.shape[1])}
    return None


def refuse_codebook_positions(model: nn.Module) -> None:
    """Refuse a model whose positions count codebooks, not tokens (CSM's depth decoder): one token per codebook,
    so its window is the number of codebooks and there is no longer sequence to extend."""
    config = getattr(model, "config", None)
    codebooks = getattr(config, "num_codebooks", None)
    window = getattr(config, "max_position_embeddings", None)
    if isinstance(codebooks, int) and isinstance(window, int) and codebooks == window:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s positions count its {codebooks} codebooks (one token per codebook, and "
            "they index its embedding table), so there is no longer sequence to extend; scale the model that "
            "feeds it (CSM's backbone) instead."
        )


def find_rotary_sites(model: nn.Module) -> list[RotarySite]:
    """Every rotary module of ``model`` with its verified base and current scaling.

    Raises:
        UnsupportedModelError: no rotary module found, or one whose output cannot be reproduced, or positions
            that count codebooks rather than tokens.
    """
    refuse_codebook_positions(model)
    sites = []
    for path, module in model.named_modules():
        if isinstance(module, ScaledRotaryEmbedding) or not accepts_position_ids(module):
            continue
        found = frequency_buffers(module)
        if found is None:
            continue
        layout, dims = found
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        config = getattr(module, "config", None) or getattr(model, "config", None)
        if hasattr(config, "get_text_config") and getattr(config, "rope_parameters", None) is None:
            config = config.get_text_config()
        site = RotarySite(path, parent, attribute, module, layout, dims, config)
        _identify_site(site)
        layer_types = [lt for lt in dims if lt is not None]
        if layer_types:
            site.scaled_layer_types = scaled_layer_types(site.current)
        local_theta = getattr(config, "rope_local_base_freq", None)
        model_config = getattr(model, "config", config)
        if hasattr(model_config, "get_text_config"):
            model_config = model_config.get_text_config()
        if not layer_types and local_theta is not None and site.bases[None] == float(local_theta) != _global_theta(model_config):
            # transformers 4.x Gemma 3 keeps a second rotary module for its sliding-window layers
            # (base rope_local_base_freq): those layers attend locally and are left unscaled.
            site.scaled_layer_types = ()
        sites.append(site)
    if not sites:
        kinds = _describe_position_modules(model)
        raise UnsupportedModelError(
            f"No rotary (RoPE) module found in {type(model).__name__}{kinds}. hf_posext patches models whose "
            f"rotary module takes position_ids (families: {SUPPORTED_FAMILIES})."
        )
    return sites


def _identify_site(site: RotarySite) -> None:
    """Fill ``site``'s bases, current scaling, layout, rotating pairs and position rows from probes.

    Raises:
        UnsupportedModelError: a layer type that no candidate reproduces.
    """
    buffers = dict(site.module.named_buffers(recurse=False))
    for layer_type, dim in site.dims.items():
        buffer = buffers.get("inv_freq" if layer_type is None else f"{layer_type}_inv_freq")
        pairs = rotated_pairs(buffer) if buffer is not None else None
        params = rope_parameters(site.config, layer_type) or {"rope_type": "default"}
        window = original_window(site.config, params)
        current = scaling_from_transformers(site.config, params, window)
        theta, layout, rows = identify_rotary(
            site.module, site.layout, dim, pairs, site.config, params, current, site.path, layer_type
        )
        site.layout = layout
        site.bases[layer_type], site.current[layer_type], site.rotated[layer_type] = theta, current, pairs
        if rows is not None:
            site.position_rows = rows


def _global_theta(config) -> float | None:
    params = rope_parameters(config) or {}
    value = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(value) if value is not None else None


def _describe_position_modules(model: nn.Module) -> str:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and ("pos" in n or "wpe" in n)]
    if names:
        return f" (found learned position tables: {', '.join(names)}; learned tables need the 'learned' methods)"
    return " (no position embedding module found either)"


def window_attribute(config) -> str:
    """The config attribute holding the model's maximum length."""
    for name in ("max_position_embeddings", "n_positions"):
        if hasattr(config, name):
            return name
    return "max_position_embeddings"


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def build_rotary_module(site: RotarySite, scaling: ScalingConfig) -> ScaledRotaryEmbedding:
    """Our rotary module for ``site``: ``scaling`` on its scaled layer types, the current rule on the others."""
    entries = {}
    for layer_type in site.dims:
        rope = site.rotary_base(layer_type)
        if layer_type in site.scaled_layer_types:
            entries[layer_type] = RotaryEntry(rope, scaling)
        else:
            entries[layer_type] = RotaryEntry(rope, site.current[layer_type])
    return ScaledRotaryEmbedding(
        entries, layout=site.layout, device=site.device, position_rows=site.position_rows,
        mirrored={name: getattr(site.module, name) for name in MIRRORED_ATTRIBUTES if hasattr(site.module, name)},
    )
