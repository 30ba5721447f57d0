"""The scaffolding every attention-level method shares: registration in transformers' attention registry,
the probe that finds and verifies the attention modules, and the patch / unpatch / describe / load flow.

A method (:mod:`~hf_posext.backends.attention.self_extend`, :mod:`~hf_posext.backends.attention.dual_chunk`)
describes itself with an :class:`AttentionMethod` and keeps only its math: its settings, its per-layer
settings, its attention function and what it writes into the config.

How it hooks into transformers: attention modules of transformers 5.x rotate q and k and then call the
function registered under ``config._attn_implementation`` in ``transformers.AttentionInterface`` (and
build the mask with the builder registered under the same name in ``AttentionMaskInterface``). Each
method registers its function under ``<prefix>_sdpa`` and ``<prefix>_eager`` (the mask convention of the
implementation the model used before) and :func:`install` selects it with ``model.set_attn_implementation``.
The registered function stays defined in the method's own module: the evaluation fingerprints an
attention-level cell by the source of that module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hf_posext.backends.attention.kernels import rotate
from hf_posext.backends.rope import surgery as rope_surgery
from hf_posext.core.loading import config_kwargs, model_class_for
from hf_posext.core.record import CONFIG_KEY, FREQUENCY_FIELD, ScalingReport, restore_config, snapshot_config, text_config
from hf_posext.core.request import ScalingRequest

__all__ = [
    "AttentionMethod",
    "AttentionLayer",
    "AttentionState",
    "register",
    "find_attention_layers",
    "is_patched",
    "current_settings",
    "original_length",
    "install",
    "update",
    "uninstall",
    "report",
    "load_unpatched",
]

_PROBE_IMPLEMENTATION = "hf_posext_attention_probe"


@dataclass(frozen=True)
class AttentionMethod:
    """How one attention-level method plugs into transformers and into a model.

    Attributes:
        name: the method name (``"dca"``).
        label: its name in messages (``"Dual Chunk Attention"``).
        attention: the function registered in ``AttentionInterface`` (same signature as SDPA's).
        implementations: registry names keyed by mask convention, ``{"sdpa": ..., "eager": ...}``.
        layer_attribute: attribute of each attention module holding its per-layer settings.
        state_attribute: key in ``model.__dict__`` holding the :class:`AttentionState`.
        config_keys: config fields the method writes besides ``config.hf_posext`` (unpatch restores them;
            load removes them before loading the plain model, then the method writes them again).
        scaled_word: what a scaled layer is, for describe's note on partly scaled models (``"chunked"``).
    """

    name: str
    label: str
    attention: Callable[..., Any]
    implementations: dict[str, str]
    layer_attribute: str
    state_attribute: str
    config_keys: tuple[str, ...] = ()
    scaled_word: str = "scaled"


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module an attention-level method drives, with the rotary embedding that feeds it.

    Attributes:
        path: the module's name in the model. module: the attention module.
        inv_freq: its rotary inverse frequencies (float64, CPU). rotary_dim: channels carrying RoPE.
        interleaved: GPT-J pair layout instead of rotate_half halves.
        scaled: False for a layer type the method leaves alone (Gemma 3 sliding-window layers).
    """

    path: str
    module: nn.Module
    inv_freq: torch.Tensor
    rotary_dim: int
    interleaved: bool
    scaled: bool


@dataclass
class AttentionState:
    """What :func:`install` changed, kept on the model so that :func:`uninstall` puts it back.

    Attributes:
        settings: the method's resolved settings. base_implementation: the attention implementation before.
        modules: ``(path, module)`` of every attention module carrying per-layer settings.
        config_snapshot: the config fields as they were. swapped_sites: rotary sites whose module was swapped.
        max_positions: ``max_position_embeddings`` before patching (None when not an integer).
    """

    settings: Any
    base_implementation: str
    modules: list[tuple[str, nn.Module]]
    config_snapshot: dict[str, Any]
    swapped_sites: list[Any]
    max_positions: int | None


# --------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------

_REGISTERED: set[str] = set()


def register(method: AttentionMethod | None = None) -> None:
    """Register ``method``'s attention functions and mask builders, and the probe's (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if _PROBE_IMPLEMENTATION not in _REGISTERED:
        AttentionInterface.register(_PROBE_IMPLEMENTATION, _probe_attention)
        AttentionMaskInterface.register(_PROBE_IMPLEMENTATION, sdpa_mask)
        _REGISTERED.add(_PROBE_IMPLEMENTATION)
    if method is None or method.name in _REGISTERED:
        return
    for mask_kind, name in method.implementations.items():
        AttentionInterface.register(name, method.attention)
        AttentionMaskInterface.register(name, eager_mask if mask_kind == "eager" else sdpa_mask)
    _REGISTERED.add(method.name)


def call_settings(module: nn.Module, query: torch.Tensor, scaling: float | None, kwargs: dict[str, Any], *,
                  attribute: str, title: str, method: str) -> tuple[Any, float]:
    """What every registered attention function checks first: the settings the patch attached to ``module``,
    no attention sinks, and the scale (``1/sqrt(head size)`` when the model passes none).

    Args:
        attribute: the module attribute holding the method's layer settings.
        title: the method's name in messages ("Dual Chunk Attention"); method: its registry name ("dca").

    Raises:
        RuntimeError: the module carries no settings (a copied model, a hand-edited config).
        ValueError: the model passes attention sinks (``s_aux``), which no split or chunked kernel here applies.
    """
    settings = getattr(module, attribute, None)
    if settings is None:
        raise RuntimeError(
            f"{type(module).__name__} is set to {title} but carries no {title} settings (was the model copied or "
            f"its config edited by hand?). Call hf_posext.patch(model, {method!r}, ...) again."
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{title} does not support attention sinks (s_aux); unpatch this model.")
    return settings, query.shape[-1] ** -0.5 if scaling is None else scaling


def plain_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float, kwargs: dict[str, Any]):
    """transformers' own SDPA attention function: the calls a method leaves exactly as the model computes them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


# --------------------------------------------------------------------------------------------------
# Finding the attention modules: does attention go through the registry, with q/k rotated as the
# rotary module says?
# --------------------------------------------------------------------------------------------------

_PROBE_RECORD: list[tuple[nn.Module, torch.Tensor, torch.Tensor, bool]] | None = None


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _PROBE_RECORD is not None:
        _PROBE_RECORD.append((module, query.detach().float().clone(), key.detach().float().clone(),
                              kwargs.get("s_aux") is not None))
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _record_attention(model: nn.Module, positions: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor, bool]]:
    global _PROBE_RECORD
    device = next(model.parameters()).device
    ids = (torch.arange(positions.shape[1]) % max(2, int(getattr(model.config, "vocab_size", 2) or 2))).to(device)[None]
    _PROBE_RECORD = []
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions.to(device), use_cache=False)
        return _PROBE_RECORD
    finally:
        _PROBE_RECORD = None


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    scale = max(float(b.abs().max()), 1e-6)
    return float((a - b).abs().max()) <= tol * scale


def _unsupported(model: nn.Module, reason: str, label: str) -> ValueError:
    from hf_posext.core.errors import UnsupportedModelError

    return UnsupportedModelError(
        f"{label} cannot be applied to {type(model).__name__}: {reason}. It needs a RoPE model whose "
        "attention modules call transformers' attention-function registry with rotated q and k (Llama, "
        "Mistral, Qwen, Gemma, Phi, GPT-NeoX, GPT-J... in transformers 5.x); use a frequency method such "
        "as 'yarn' for this model."
    )


def _probe(model: nn.Module, rotary: dict[str, tuple[torch.Tensor, int, bool, bool]], names: dict[int, str], label: str) -> list[nn.Module]:
    """Check, with two tiny forwards, that every attention call goes through the registry with q/k
    rotated by the frequencies found (``rotary``: path -> inv_freq, rotary_dim, interleaved, scaled);
    returns the attention modules in call order. Restores the model."""
    original = model.config._attn_implementation
    was_training = model.training
    model.eval()
    length, shift = 6, 5
    try:
        model.set_attn_implementation(_PROBE_IMPLEMENTATION)
        if model.config._attn_implementation != _PROBE_IMPLEMENTATION:
            raise ValueError("set_attn_implementation had no effect")
        first = _record_attention(model, torch.arange(length)[None])
        second = _record_attention(model, torch.arange(length)[None] + shift)
    except Exception as error:
        raise _unsupported(model, f"its attention could not be routed through transformers' AttentionInterface ({error})", label) from error
    finally:
        model.set_attn_implementation(original)
        model.train(was_training)
    if not first or len(first) != len(second):
        raise _unsupported(model, "its attention modules do not call the AttentionInterface registry", label)
    sinks = sorted({names.get(id(module), type(module).__name__) for module, *_, has_sinks in first if has_sinks})
    if sinks:
        raise _unsupported(model, f"its attention in {sinks[0]}{' and others' if len(sinks) > 1 else ''} adds learned "
                                  "attention sinks (s_aux), which the split and chunked kernels cannot apply", label)
    modules = []
    dtype = next(model.parameters()).dtype
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    checked_types = set()
    for (module, q1, k1, _), (module2, q2, k2, _) in zip(first, second):
        if module is not module2:
            raise _unsupported(model, "its attention modules are called in a different order on each forward", label)
        if id(module) not in names:
            raise _unsupported(model, f"an attention call came from {type(module).__name__}, which is not a submodule", label)
        if module not in modules:
            modules.append(module)
        entry = rotary.get(names[id(module)])
        if entry is None or not entry[3]:
            continue
        inv_freq, rotary_dim, interleaved, _ = entry
        kind = (float(inv_freq[0]), rotary_dim)
        if kind in checked_types:
            continue  # one layer per rotary embedding: later layers see only float drift
        checked_types.add(kind)
        delta = torch.full((1, length), shift)
        for name, before, after in (("queries", q1, q2), ("keys", k1, k2)):
            if not _close(rotate(before, delta, inv_freq, rotary_dim, interleaved), after, tol):
                raise _unsupported(
                    model,
                    f"the {name} reaching attention in {names[id(module)]} are not rotated the way its rotary "
                    f"module describes (rotary dim {rotary_dim}, {'interleaved' if interleaved else 'rotate_half'} layout)",
                    label,
                )
    return modules


def _layer_type(model: nn.Module, module: nn.Module) -> str | None:
    layer_types = getattr(model.config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types and isinstance(index, int) and 0 <= index < len(layer_types):
        return layer_types[index]
    return None


def _rotary_per_module(model: nn.Module, sites: list, label: str) -> dict[str, tuple[torch.Tensor, int, bool, bool]]:
    """path -> (inv_freq float64 CPU, rotary dim, interleaved, scaled) for every module with a ``layer_idx``."""
    from hf_posext.methods.rope import RotaryBase

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
        inv_freq, _ = current.spec.compute(
            RotaryBase(main.bases[layer_type], dim), current.original_max_position_embeddings, current.factor, None,
            current.parsed_params,
        )
        frequencies[layer_type] = (inv_freq.double().cpu(), dim, layer_type in main.scaled_layer_types)
    interleaved = main.layout == "sin_cos_half"
    per_module = {}
    for path, module in model.named_modules():
        if not hasattr(module, "layer_idx"):
            continue
        layer_type = _layer_type(model, module) if len(frequencies) > 1 else next(iter(frequencies))
        if layer_type in frequencies:
            inv_freq, dim, scaled = frequencies[layer_type]
            per_module[path] = (inv_freq, dim, interleaved, scaled)
    return per_module


def find_attention_layers(model: nn.Module, label: str) -> tuple[list[AttentionLayer], list[tuple[Any, nn.Module]]]:
    """The attention modules of a RoPE model, verified by a probe, for an attention-level method (read-only).

    Args:
        model: the model. label: the method's name for error messages (e.g. ``"Dual Chunk Attention"``).

    Returns:
        The layers, and ``(rotary site, replacement module)`` pairs for fixed sin/cos tables (GPT-J) that
        stop at the original window and must be swapped for a length-free rotary module.

    Raises:
        UnsupportedModelError: attention bypasses transformers' registry, or q/k are not rotated the
            way the model's rotary module says. ValueError: a dynamic rotary embedding.
    """
    from hf_posext.backends.rope.sites import build_rotary_module, find_rotary_sites
    from hf_posext.core.request import ScalingConfig

    stacked = rope_surgery.patched_sites(model)  # a composition: the frequencies of hf_posext's own rotary modules
    sites = stacked if stacked is not None else find_rotary_sites(model)
    rotary = _rotary_per_module(model, sites, label)
    names = {id(module): path for path, module in model.named_modules()}
    register()  # the probe's attention function
    modules = _probe(model, rotary, names, label)
    missing = [names[id(m)] for m in modules if names[id(m)] not in rotary]
    if missing:
        raise _unsupported(model, f"no rotary settings for attention module(s) {', '.join(missing[:3])}", label)
    layers = [AttentionLayer(names[id(m)], m, *rotary[names[id(m)]]) for m in modules]
    # A fixed sin/cos table (GPT-J's embed_positions) stops at the original window; attention-level
    # methods keep true positions, so those modules are swapped for our identical, length-free rotary module.
    swaps = []
    for site in (site for site in sites if site.layout == "sin_cos_half" and stacked is None):
        window = site.current[site.scaled_layer_types[0]].original_max_position_embeddings
        swaps.append((site, build_rotary_module(site, ScalingConfig("none", 1.0, window))))
    return layers, swaps


# --------------------------------------------------------------------------------------------------
# patch / unpatch / describe / load
# --------------------------------------------------------------------------------------------------


def is_patched(model: nn.Module, method: AttentionMethod) -> bool:
    """True when ``model`` runs ``method`` installed by :func:`install`."""
    return isinstance(model, nn.Module) and method.state_attribute in model.__dict__


def current_settings(model: nn.Module, method: AttentionMethod) -> Any:
    """The settings ``method`` was installed with on ``model``."""
    return model.__dict__[method.state_attribute].settings


def original_length(model: nn.Module, method: AttentionMethod, request: ScalingRequest) -> int:
    """The window L ``request`` is sized on: its override, the previous patch's, the window of hf_posext's
    frequency scaling the method is stacked on (a composition such as ``yarn+string``), or the rotary module's
    pre-training window.

    Raises:
        ValueError: ``request`` is not for ``method``; a bad override.
    """
    from hf_posext.backends.rope.sites import find_rotary_sites

    if request.method != method.name:
        raise ValueError(f"{method.label} handles method {method.name!r}, got {request.method!r}.")
    override = request.original_max_position_embeddings
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 2:
            raise ValueError(f"original_max_position_embeddings must be an integer >= 2, got {override!r}.")
        return override
    if is_patched(model, method):
        return current_settings(model, method).original_max_position_embeddings
    frequency = rope_surgery.patched_sites(model)
    if frequency is not None:  # stacked on hf_posext's frequency scaling: sized on the window it gives
        main = next(site for site in frequency if site.scaled_layer_types)
        return main.current[main.scaled_layer_types[0]].target_length
    main = next(site for site in find_rotary_sites(model) if site.scaled_layer_types)
    return main.current[main.scaled_layer_types[0]].original_max_position_embeddings


def declared_window(model: nn.Module) -> int | None:
    """The window the model's config declares (``max_position_embeddings`` of the config the main rotary
    module reads), or None when it declares none. With a static frequency scaling in the config it is the
    scaled window (131072 for Llama 3.1, whose llama3 scaling starts from 8192), not the original one."""
    from hf_posext.backends.rope.sites import find_rotary_sites

    sites = rope_surgery.patched_sites(model) or find_rotary_sites(model)
    main = next(site for site in sites if site.scaled_layer_types)
    value = getattr(main.config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def install(
    model: nn.Module,
    method: AttentionMethod,
    settings: Any,
    layer_settings: Callable[[AttentionLayer, str], Any],
    write_config: Callable[[Any, Any, str, int | None], None],
) -> nn.Module:
    """Install ``method`` on an unpatched model; everything is checked before anything changes.

    Args:
        model: the model. method: the method. settings: its resolved settings (kept in the state).
        layer_settings: ``(layer, mask_kind) -> per-layer settings`` set on each attention module
            (``mask_kind`` is ``"sdpa"`` or ``"eager"``, the convention of the implementation before).
        write_config: ``(config, settings, base implementation, max_position_embeddings before)``: writes
            the record and the method's config fields.

    Returns:
        The same model.
    """
    base = model.config._attn_implementation or "eager"
    mask_kind = "eager" if base == "eager" else "sdpa"
    register(method)
    layers, swaps = find_attention_layers(model, method.label)  # read-only (the probe restores what it sets)
    config = model.config
    snapshot = snapshot_config(config, ("_attn_implementation_internal", CONFIG_KEY) + method.config_keys)
    model.set_attn_implementation(method.implementations[mask_kind])
    for layer in layers:
        setattr(layer.module, method.layer_attribute, layer_settings(layer, mask_kind))
    for site, replacement in swaps:
        setattr(site.parent, site.attribute, replacement)
    max_positions = getattr(config, "max_position_embeddings", None)
    max_positions = max_positions if isinstance(max_positions, int) and not isinstance(max_positions, bool) else None
    frequency = rope_surgery.patch_record(model)  # read before the method's own record replaces it
    write_config(config, settings, base, max_positions)
    _attach_frequency_record(config, frequency)
    model.__dict__[method.state_attribute] = AttentionState(
        settings, base, [(layer.path, layer.module) for layer in layers], snapshot, [site for site, _ in swaps], max_positions,
    )
    return model


def update(
    model: nn.Module,
    method: AttentionMethod,
    settings: Any,
    retune: Callable[[Any], Any],
    write_config: Callable[[Any, Any, str, int | None], None],
) -> nn.Module:
    """New settings for a model ``method`` already runs on (never compounds, nothing to re-verify).

    ``retune``: ``old per-layer settings -> new`` for each scaled layer.
    """
    state: AttentionState = model.__dict__[method.state_attribute]
    for _, module in state.modules:
        layer = getattr(module, method.layer_attribute)
        if layer.scaled:
            setattr(module, method.layer_attribute, retune(layer))
    state.settings = settings
    frequency = (getattr(model.config, CONFIG_KEY, None) or {}).get(FREQUENCY_FIELD)
    write_config(model.config, settings, state.base_implementation, state.max_positions)
    _attach_frequency_record(model.config, frequency)
    return model



def _attach_frequency_record(config: Any, frequency: dict[str, Any] | None) -> None:
    """Keep the record of hf_posext's frequency scaling under the attention method's own (a composition):
    ``config.hf_posext`` holds one record, so the stacked method's carries the other in :data:`FREQUENCY_FIELD`."""
    record = getattr(config, CONFIG_KEY, None)
    if frequency is not None and isinstance(record, dict):
        frequency.pop(FREQUENCY_FIELD, None)
        record[FREQUENCY_FIELD] = frequency


def uninstall(model: nn.Module, method: AttentionMethod) -> nn.Module:
    """Remove ``method``: the original attention implementation, rotary modules and config fields, exactly.

    Raises:
        ValueError: the model is not patched with ``method``.
    """
    state: AttentionState | None = model.__dict__.get(method.state_attribute)
    if state is None:
        raise ValueError(f"This model is not patched with {method.label} (nothing to unpatch).")
    model.set_attn_implementation(state.base_implementation)
    for _, module in state.modules:
        module.__dict__.pop(method.layer_attribute, None)
    for site in state.swapped_sites:
        setattr(site.parent, site.attribute, site.module)
    restore_config(model.config, state.config_snapshot)
    del model.__dict__[method.state_attribute]
    return model


def report(
    model: nn.Module, method: AttentionMethod, factor: float, current_window: int, params: dict[str, Any], notes: list[str]
) -> ScalingReport:
    """A :class:`~hf_posext.core.record.ScalingReport` of kind ``"attention"``: ``notes`` are the method's,
    followed by the shared ones (swapped rotary tables, layers left alone)."""
    state: AttentionState = model.__dict__[method.state_attribute]
    scaled = [path for path, module in state.modules if getattr(module, method.layer_attribute).scaled]
    notes = list(notes)
    if state.swapped_sites:
        notes.append("fixed sin/cos table replaced by an identical rotary module without a length limit")
    if len(scaled) != len(state.modules):
        notes.append(f"{method.scaled_word} in {len(scaled)} of {len(state.modules)} attention layers (others: sliding window)")
    return ScalingReport(
        family=getattr(model.config, "model_type", type(model).__name__),
        kind="attention",
        method=method.name,
        factor=factor,
        original_window=state.settings.original_max_position_embeddings,
        current_window=current_window,
        dynamic=False,
        sites=list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", path) for path, _ in state.modules)),
        params={**params, "attn_implementation": state.base_implementation},
        stock_loadable=False,
        notes=notes,
    )


def load_unpatched(
    path: str, record: dict[str, Any], method: AttentionMethod, read_config: Callable[[Any], Any], **from_pretrained_kwargs: Any
) -> tuple[nn.Module, Any]:
    """Load a folder saved with ``method`` as the model was before patching (the caller patches it again).

    Args:
        path: the folder. record: its ``config.hf_posext`` record.
        method: the method (its config fields are removed before loading).
        read_config: called with the (text) config as saved, before anything is removed; what it returns
            (the method's settings read from the config) is returned beside the model.
        **from_pretrained_kwargs: for ``from_pretrained``; ``attn_implementation`` defaults to the recorded one.

    Returns:
        ``(model, read_config's result)``.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs))
    target = text_config(config)
    saved = read_config(target)
    for key in (CONFIG_KEY,) + tuple(key for key in method.config_keys if key != "max_position_embeddings"):
        target.__dict__.pop(key, None)
    before = record.get("max_position_embeddings_before")
    if isinstance(before, int) and hasattr(target, "max_position_embeddings"):
        target.max_position_embeddings = before
    from_pretrained_kwargs.setdefault("attn_implementation", record.get("attn_implementation") or "sdpa")
    frequency = record.get(FREQUENCY_FIELD)
    if frequency is not None:  # a composition: the frequency scaling first, exactly as it was saved
        return rope_surgery.load_rope(path, frequency, config=config, **from_pretrained_kwargs), saved
    model = model_class_for(config).from_pretrained(path, config=config, **from_pretrained_kwargs)
    return model, saved
