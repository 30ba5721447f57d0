"""Finding the attention modules an attention-level method drives, and how their queries and keys are rotated.

Attention-level methods (Self-Extend, DCA, STRING) rotate the queries and keys that reach attention by extra
positions, so for each attention module they need the rotary frequencies, where the rotary channels sit, and
how they are paired. That is found by probing, never by class name: two tiny forwards whose positions differ by
a shift are recorded at the attention call, and the first geometry that turns the first forward's q and k into
the second's is the module's:

=======================  ==========================================================  ==================================
geometry                 q and k at attention                                        families (transformers 5.x)
=======================  ==========================================================  ==================================
halves, first            rotary channels first, channel i paired with i + d/2        Llama, Qwen, Gemma, Mistral, Phi
pairs, first             neighbouring channels paired                                Cohere, GLM, Helium, Ernie 4.5,
                                                                                     Llama 4, GPT-J
halves, last             rotary channels after the position-free ones (latent        DeepSeek-V3, Mistral 4, MiniCPM3,
                         attention: ``cat(q_nope, q_rope)``)                         GLM-4 MoE Lite, Youtu
pairs, last              the same with neighbouring pairs                            DeepSeek-V2
reversed                 any of the above, rotating by minus the angle               NanoChat
no rotation              q and k do not move with positions (NoPE layers)            Llama 4, Cohere 2 global layers
=======================  ==========================================================  ==================================

A layer whose queries and keys do not rotate is left as plain attention by every method. Rotary channels that
sit last are moved first for the method's kernels (:data:`ROTARY_OFFSET_ATTRIBUTE`): a permutation applied to
both q and k, so their dot products, and the attention output, are unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention.kernels import rotate
from hf_posext.backends.rope import surgery as rope_surgery
from hf_posext.backends.rope.rules import TARGET_STATES_ARGUMENT, reads_target_states
from hf_posext.methods.rope import scaled_frequencies

__all__ = [
    "AttentionLayer",
    "PROBE_IMPLEMENTATION",
    "ROTARY_OFFSET_ATTRIBUTE",
    "probe_attention",
    "register_probe",
    "unsupported",
    "drafting_head_refusal",
    "find_attention_layers",
]

#: The registry name of the probe's attention function.
PROBE_IMPLEMENTATION = "hf_posext_attention_probe"
#: Attribute set on an attention module whose rotary channels come after ``offset`` position-free ones.
ROTARY_OFFSET_ATTRIBUTE = "hf_posext_rotary_offset"


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module an attention-level method drives, with the rotary embedding that feeds it.

    Attributes:
        path: the module's name in the model. module: the attention module.
        inv_freq: its rotary inverse frequencies (float64, CPU; negated for a model that rotates by minus the
            angle, zero for the pairs a proportional RoPE leaves alone). rotary_dim: channels carrying RoPE.
        interleaved: neighbouring channels paired (GPT-J, Cohere) instead of rotate_half halves.
        scaled: False for a layer the method leaves alone (Gemma 3 sliding-window layers, NoPE layers).
        rotary_offset: position-free channels before the rotary ones (latent attention; 0 for most models).
        position_free: the layer's q and k carry no rotary position at all (a NoPE layer; never scaled).
    """

    path: str
    module: nn.Module
    inv_freq: torch.Tensor
    rotary_dim: int
    interleaved: bool
    scaled: bool
    rotary_offset: int = 0
    position_free: bool = False


@dataclass(frozen=True)
class _Rotary:
    inv_freq: torch.Tensor
    dim: int
    interleaved: bool
    scaled: bool


_RECORD: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] | None = None


def probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The probe's attention function: records q and k, then runs SDPA (learned sinks, ``s_aux``, are left out:
    the probe reads only q and k)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _RECORD is not None:
        _RECORD.append((module, query.detach().float().clone(), key.detach().float().clone()))
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_probe() -> None:
    """Register :func:`probe_attention` under :data:`PROBE_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE_IMPLEMENTATION, probe_attention)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, sdpa_mask)


def _record_attention(model: nn.Module, positions: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor, bool]]:
    global _RECORD
    device = next(model.parameters()).device
    ids = (torch.arange(positions.shape[1]) % max(2, int(getattr(model.config, "vocab_size", 2) or 2))).to(device)[None]
    _RECORD = []
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions.to(device), use_cache=False)
        return _RECORD
    finally:
        _RECORD = None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    scale = max(float(b.abs().max()), 1e-6)
    return float((a - b).abs().max()) <= tol * scale


def unsupported(model: nn.Module, reason: str, label: str) -> ValueError:
    """The one-line refusal of an attention-level method for ``model`` (an ``UnsupportedModelError``)."""
    from hf_posext.core.errors import UnsupportedModelError

    return UnsupportedModelError(
        f"{label} cannot be applied to {type(model).__name__}: {reason}. It needs a RoPE model whose "
        "attention modules call transformers' attention-function registry with rotated q and k (Llama, "
        "Mistral, Qwen, Gemma, Phi, GPT-NeoX, GPT-J... in transformers 5.x); use a frequency method such "
        "as 'yarn' for this model."
    )


def drafting_head_refusal(model: nn.Module, label: str) -> ValueError:
    """The one-line refusal of an attention-level method for a drafting head (an ``UnsupportedModelError``): the
    keys it attends to arrive from its target model, rotated there, so the method cannot re-rotate them."""
    from hf_posext.core.errors import UnsupportedModelError

    return UnsupportedModelError(
        f"{label} cannot be applied to {type(model).__name__}: it is a drafting head that attends to its target "
        f"model's keys ({TARGET_STATES_ARGUMENT}), rotated by the target at positions and frequencies it cannot see, "
        f"so {label} cannot re-rotate them. Patch the target model with {label} and leave this head unpatched (the "
        "target checks every drafted token), or patch both with the same frequency method, e.g. 'yarn'."
    )


def _shifted(states: torch.Tensor, shift: int, inv_freq: torch.Tensor, dim: int, interleaved: bool, offset: int) -> torch.Tensor:
    delta = torch.full((1, states.shape[-2]), shift)
    if offset == 0:
        return rotate(states, delta, inv_freq, dim, interleaved)
    return torch.cat((states[..., :offset], rotate(states[..., offset:], delta, inv_freq, dim, interleaved)), dim=-1)


def _geometry(recorded: tuple, rotary: _Rotary, shift: int, tol: float) -> tuple[torch.Tensor, bool, int] | str:
    """``(inv_freq, interleaved, offset)`` of the first geometry that maps the first forward's q and k onto the
    second's; ``"none"`` when neither moves with positions; ``"unknown"`` when no geometry fits."""
    q1, k1, q2, k2 = recorded
    if _close(q1, q2, tol) and _close(k1, k2, tol):
        return "none"
    head_dim = q1.shape[-1]
    if head_dim != k1.shape[-1] or rotary.dim > head_dim:
        return "unknown"
    offsets = (0,) if rotary.dim == head_dim else (0, head_dim - rotary.dim)
    for sign in (1.0, -1.0):
        inv_freq = rotary.inv_freq * sign
        for offset in offsets:
            for interleaved in (rotary.interleaved, not rotary.interleaved):
                if all(_close(_shifted(before, shift, inv_freq, rotary.dim, interleaved, offset), after, tol)
                       for before, after in ((q1, q2), (k1, k2))):
                    return inv_freq, interleaved, offset
    return "unknown"


def _record_twice(model: nn.Module, label: str, length: int, shift: int) -> tuple[list, list]:
    original = model.config._attn_implementation
    was_training = model.training
    model.eval()
    try:
        model.set_attn_implementation(PROBE_IMPLEMENTATION)
        if model.config._attn_implementation != PROBE_IMPLEMENTATION:
            raise ValueError("set_attn_implementation had no effect")
        first = _record_attention(model, torch.arange(length)[None])
        second = _record_attention(model, torch.arange(length)[None] + shift)
    except Exception as error:
        raise unsupported(model, f"its attention could not be routed through transformers' AttentionInterface ({error})", label) from error
    finally:
        model.set_attn_implementation(original)
        model.train(was_training)
    return first, second


def _probe(model: nn.Module, rotary: dict[str, _Rotary], names: dict[int, str], label: str) -> list[AttentionLayer]:
    """Check, with two tiny forwards, that every attention call goes through the registry with q/k rotated by
    the frequencies found, and find each module's geometry; the layers in call order. Restores the model."""
    length, shift = 6, 5
    first, second = _record_twice(model, label, length, shift)
    if not first or len(first) != len(second):
        raise unsupported(model, "its attention modules do not call the AttentionInterface registry", label)
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 3e-2
    layers: dict[int, AttentionLayer] = {}
    for (module, q1, k1), (module2, q2, k2) in zip(first, second):
        if module is not module2:
            raise unsupported(model, "its attention modules are called in a different order on each forward", label)
        if id(module) not in names:
            raise unsupported(model, f"an attention call came from {type(module).__name__}, which is not a submodule", label)
        path = names[id(module)]
        entry = rotary.get(path)
        if entry is None:
            own = next((f"{path}.{name.rsplit('.', 1)[0]}" for name, _ in module.named_buffers() if "." in name
                        and name.endswith("inv_freq")), None)  # a rotary module inside the attention module
            raise unsupported(model, f"its attention module {path} holds its own rotary module ({own}), whose positions an "
                                     "attention-level method cannot follow" if own else
                                     f"no rotary module of the model feeds its attention module {path}", label)
        if id(module) in layers:
            continue
        found = _geometry((q1, k1, q2, k2), entry, shift, tol)
        if found == "unknown" and not entry.scaled:  # a layer the method leaves alone: its geometry does not matter
            layers[id(module)] = AttentionLayer(path, module, entry.inv_freq, entry.dim, entry.interleaved, False)
            continue
        if found == "unknown":
            raise unsupported(
                model,
                f"the queries or keys reaching attention in {path} are not rotated the way its rotary module describes "
                f"(rotary dim {entry.dim} of {q1.shape[-1]} channels; no pairing, placement or direction fits)",
                label,
            )
        if found == "none":  # a NoPE layer: nothing to re-rotate, the methods leave it as it is
            layers[id(module)] = AttentionLayer(path, module, entry.inv_freq, entry.dim, entry.interleaved, False, 0, True)
            continue
        inv_freq, interleaved, offset = found
        layers[id(module)] = AttentionLayer(path, module, inv_freq, entry.dim, interleaved, entry.scaled, offset)
    return list(layers.values())


def _layer_type(model: nn.Module, module: nn.Module) -> str | None:
    layer_types = getattr(model.config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types and isinstance(index, int) and 0 <= index < len(layer_types):
        return layer_types[index]
    return None


def _rotary_per_module(model: nn.Module, sites: list, label: str) -> dict[str, _Rotary]:
    """path -> the rotary embedding feeding it, for every module with a ``layer_idx``."""
    main = next(site for site in sites if site.scaled_layer_types)
    frequencies = {}
    for layer_type, dim in main.dims.items():
        current = main.current[layer_type]
        if current.spec.dynamic:
            raise ValueError(
                f"The model's own rotary embedding is dynamic ({current.method}): its frequencies change with the "
                f"sequence length, so {label} cannot re-rotate cached keys consistently. Load the model with a "
                f"static rope_type (or unscaled) before applying {label}."
            )
        inv_freq, _ = scaled_frequencies(
            current.spec, main.rotary_base(layer_type), current.original_max_position_embeddings, current.factor, None,
            current.parsed_params,
        )
        frequencies[layer_type] = _Rotary(inv_freq.double().cpu(), dim, main.layout == "sin_cos_half",
                                          layer_type in main.scaled_layer_types)
    per_module = {}
    for path, module in model.named_modules():
        if not hasattr(module, "layer_idx"):
            continue
        layer_type = _layer_type(model, module) if len(frequencies) > 1 else next(iter(frequencies))
        if layer_type in frequencies:
            per_module[path] = frequencies[layer_type]
    return per_module


def rotary_readers(layers: list[AttentionLayer]) -> list[tuple[str, str]]:
    """``(attention path, class name)`` of each scaled attention layer that holds a module of its own taking
    ``position_embeddings`` (found by its forward's signature): a sparse-attention indexer (DeepSeek-V3.2's DSA,
    GLM-5, HY-V4) that ranks keys with the rotary positions outside the attention function. A frequency method
    scales its positions too; an attention-level method, which changes only the attention function, cannot."""
    found = []
    for layer in (layer for layer in layers if layer.scaled):
        for child in layer.module.modules():
            if child is not layer.module and "position_embeddings" in inspect.signature(child.forward).parameters:
                found.append((layer.path, type(child).__name__))
                break
    return found


def find_attention_layers(model: nn.Module, label: str) -> tuple[list[AttentionLayer], list[tuple[Any, nn.Module]]]:
    """The attention modules of a RoPE model, verified by a probe, for an attention-level method (read-only).

    Args:
        model: the model. label: the method's name for error messages (e.g. ``"Dual Chunk Attention"``).

    Returns:
        The layers, and ``(rotary site, replacement module)`` pairs for fixed sin/cos tables (GPT-J) that
        stop at the original window and must be swapped for a length-free rotary module.

    Raises:
        UnsupportedModelError: attention bypasses transformers' registry, q/k are rotated in no way the probe
            knows, or a drafting head's keys come from its target model. ValueError: a dynamic rotary embedding.
    """
    from hf_posext.backends.rope.sites import build_rotary_module, find_rotary_sites
    from hf_posext.core.request import ScalingConfig

    if reads_target_states(model):  # checked first: its forward cannot even run without the target's states
        raise drafting_head_refusal(model, label)
    stacked = rope_surgery.patched_sites(model)  # a composition: the frequencies of hf_posext's own rotary modules
    sites = stacked if stacked is not None else find_rotary_sites(model)
    rotary = _rotary_per_module(model, sites, label)
    names = {id(module): path for path, module in model.named_modules()}
    register_probe()
    layers = _probe(model, rotary, names, label)
    readers = rotary_readers(layers)
    if readers:
        path, reader = readers[0]
        raise unsupported(model, f"its attention in {path}{' and others' if len(readers) > 1 else ''} holds {reader}, "
                                 "a sparse-attention indexer that picks the keys by their rotary positions, which "
                                 f"{label} does not remap (it would pick them at positions past the window)", label)
    # A fixed sin/cos table (GPT-J's embed_positions) stops at the original window; attention-level
    # methods keep true positions, so those modules are swapped for our identical, length-free rotary module.
    swaps = []
    for site in (site for site in sites if site.layout == "sin_cos_half" and stacked is None):
        window = site.current[site.scaled_layer_types[0]].original_max_position_embeddings
        swaps.append((site, build_rotary_module(site, ScalingConfig("none", 1.0, window))))
    return layers, swaps
