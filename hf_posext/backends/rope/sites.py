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
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext.backends.rope.module import RotaryEntry, ScaledRotaryEmbedding
from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.request import ScalingConfig
from hf_posext.methods.rope import RotaryBase
from hf_posext.methods.transformers import ROPE_TYPES, method_for_rope_type

__all__ = [
    "WINDOW_IS_ORIGINAL",
    "RotarySite",
    "UnsupportedModelError",
    "find_rotary_sites",
    "rope_parameters",
    "set_rope_parameters",
    "original_window",
    "SUPPORTED_FAMILIES",
    "accepts_position_ids",
    "frequency_buffers",
]

#: Families covered by the tests (any model with the same structure works too).
SUPPORTED_FAMILIES = (
    "llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2, gemma3 (full-attention layers), olmo, olmo2, "
    "falcon, stablelm, phi, phi3, gpt_neox (partial rotary), gptj"
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
        if params["rope_type"] == "longrope" and params.get("original_max_position_embeddings"):
            # 4.x LongRoPE reads the pre-training window from the config itself (Phi-3 style).
            config.original_max_position_embeddings = params["original_max_position_embeddings"]


#: transformers rope types whose ``max_position_embeddings`` is the pre-training window L (the served
#: length is L * factor): ``dynamic`` scales from it, ``linear`` never reads it, and vLLM and SGLang
#: multiply it by the factor for both (as for lmsys/vicuna-13b-v1.5-16k: 4096 with linear x4).
WINDOW_IS_ORIGINAL = ("default", "dynamic", "linear")


def original_window(config, params: dict[str, Any] | None) -> int:
    """The pre-training window L: ``original_max_position_embeddings`` if scaled, else the max length."""
    params = params or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "dynamic") and params.get("original_max_position_embeddings"):
        return int(params["original_max_position_embeddings"])
    if rope_type not in WINDOW_IS_ORIGINAL and getattr(config, "original_max_position_embeddings", None):
        return int(config.original_max_position_embeddings)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            if rope_type not in WINDOW_IS_ORIGINAL and params.get("factor"):
                return int(round(value / params["factor"]))
            return value
    raise UnsupportedModelError(
        "Could not find the model's window in its config (max_position_embeddings / n_positions); "
        "pass original_max_position_embeddings= to patch()."
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
    if method == "none":
        factor = 1.0
    if method == "dynamic-ntk":
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


def _probe_positions(limit: int) -> torch.Tensor:
    points = sorted({0, 1, 2, 3, 7, 31, 100, 1000, limit // 2, limit - 1})
    return torch.tensor([[p for p in points if 0 <= p < limit]], dtype=torch.long)


def probe(module: nn.Module, positions: torch.Tensor, layer_type: str | None = None) -> tuple[torch.Tensor, ...]:
    """Run a rotary module on ``positions`` in float32 (its output, as a tuple of tensors)."""
    x = torch.zeros(1, positions.shape[1], 1, dtype=torch.float32, device=positions.device)
    with torch.no_grad():
        if layer_type is None:
            out = module(x, position_ids=positions)
        else:
            out = module(x, position_ids=positions, layer_type=layer_type)
    return tuple(t.float() for t in out)


def outputs_match(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], tol: float = 1e-4) -> bool:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False
    return all(torch.allclose(x.cpu(), y.cpu(), atol=tol, rtol=tol) for x, y in zip(a, b))


def _candidate_thetas(config, params: dict[str, Any] | None) -> list[float]:
    values = []
    if params and params.get("rope_theta"):
        values.append(float(params["rope_theta"]))
    for name in ("rope_theta", "rotary_emb_base", "rope_local_base_freq"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and value > 0:
            values.append(float(value))
    values.append(10000.0)  # transformers' default_theta (GPT-J hard-codes it)
    return list(dict.fromkeys(values))


def _identify(site_module: nn.Module, layout: str, dim: int, config, layer_type: str | None, path: str):
    """Find (theta, current scaling) reproducing the module, or raise UnsupportedModelError."""
    params = rope_parameters(config, layer_type) or {"rope_type": "default"}
    window = original_window(config, params)
    limit = window
    positions = _probe_positions(limit).to(next(iter(site_module.buffers())).device)
    try:
        actual = probe(site_module, positions, layer_type)
    except Exception as error:  # the module's own forward failed on a plain call
        raise UnsupportedModelError(
            f"The rotary module at {path!r} ({type(site_module).__name__}) could not be called as "
            f"forward(x, position_ids{', layer_type' if layer_type else ''}): {error}"
        ) from error
    # A model cast with .half() / .to(torch.bfloat16) carries rounded inverse frequencies: compare against
    # ours rounded the same way (the patched module keeps them float32, as loading with dtype= does).
    rounded = {b.dtype for name, b in site_module.named_buffers() if "inv_freq" in name and b.is_floating_point()}
    rounded = [d for d in rounded if d != torch.float32]
    tried = []
    for theta in _candidate_thetas(config, params):
        current = scaling_from_transformers(config, params, window)
        entry = RotaryEntry(RotaryBase(theta, dim), current)
        ours = ScaledRotaryEmbedding({None: entry}, layout=layout, device=positions.device)
        if outputs_match(probe(ours, positions), actual):
            return theta, current
        if len(rounded) == 1:
            buffer = ours._buffers[ours._buffer_name(None)]
            ours._buffers[ours._buffer_name(None)] = buffer.to(rounded[0]).float()
            if outputs_match(probe(ours, positions), actual):
                warnings.warn(
                    f"The rotary frequencies at {path!r} are stored in {rounded[0]} (the model was cast with "
                    ".half() or .to(dtype)), which rounds them and shifts every position's angle. The patched "
                    "model computes them in float32, as from_pretrained(..., dtype=...) does; unpatch restores "
                    "the rounded ones. Load with dtype= instead of casting to keep the original model exact.",
                    stacklevel=4,
                )
                return theta, current
        tried.append(f"{theta:g}")
    raise UnsupportedModelError(
        f"The rotary module at {path!r} ({type(site_module).__name__}, layer type {layer_type!r}) does not "
        f"produce what its config describes (rope_type={params.get('rope_type')!r}, tried bases "
        f"{', '.join(tried)}, rotary dim {dim}, layout {layout}). This transformers version may have changed "
        "how rotary embeddings are computed; please report it with your transformers version."
    )


def find_rotary_sites(model: nn.Module) -> list[RotarySite]:
    """Every rotary module of ``model`` with its verified base and current scaling.

    Raises:
        UnsupportedModelError: no rotary module found, or one whose output cannot be reproduced.
    """
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
        layer_types = [lt for lt in dims if lt is not None]
        if layer_types:
            # Per-layer-type RoPE (Gemma 3): scale the full-attention layers, keep the sliding ones.
            scaled = tuple(lt for lt in layer_types if "full" in lt or "global" in lt) or tuple(layer_types)
            site.scaled_layer_types = scaled
        for layer_type, dim in dims.items():
            theta, current = _identify(module, layout, dim, config, layer_type, path)
            site.bases[layer_type], site.current[layer_type] = theta, current
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
    for layer_type, dim in site.dims.items():
        rope = RotaryBase(site.bases[layer_type], dim)
        if layer_type in site.scaled_layer_types:
            entries[layer_type] = RotaryEntry(rope, scaling)
        else:
            entries[layer_type] = RotaryEntry(rope, site.current[layer_type])
    return ScaledRotaryEmbedding(entries, layout=site.layout, device=site.device)
