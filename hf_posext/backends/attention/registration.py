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

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hf_posext.backends.attention.probe import (
    PROBE_IMPLEMENTATION,
    ROTARY_OFFSET_ATTRIBUTE,
    AttentionLayer,
    find_attention_layers,
    register_probe,
)
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


@dataclass
class AttentionState:
    """What :func:`install` changed, kept on the model so that :func:`uninstall` puts it back.

    Attributes:
        settings: the method's resolved settings. base_implementation: the attention implementation before.
        modules: ``(path, module)`` of every attention module carrying per-layer settings.
        config_snapshot: the config fields as they were. swapped_sites: rotary sites whose module was swapped.
        max_positions: ``max_position_embeddings`` before patching (None when not an integer).
        position_free: paths of the attention modules whose q and k carry no rotary position (NoPE layers).
    """

    settings: Any
    base_implementation: str
    modules: list[tuple[str, nn.Module]]
    config_snapshot: dict[str, Any]
    swapped_sites: list[Any]
    max_positions: int | None
    position_free: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------

_REGISTERED: set[str] = set()


def register(method: AttentionMethod | None = None) -> None:
    """Register ``method``'s attention functions and mask builders, and the probe's (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if PROBE_IMPLEMENTATION not in _REGISTERED:
        register_probe()
        _REGISTERED.add(PROBE_IMPLEMENTATION)
    if method is None or method.name in _REGISTERED:
        return
    attention = _rotary_channels_first(method.attention)
    for mask_kind, name in method.implementations.items():
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, eager_mask if mask_kind == "eager" else sdpa_mask)
    _REGISTERED.add(method.name)


def _rotary_channels_first(attention: Callable[..., Any]) -> Callable[..., Any]:
    """``attention`` for modules whose rotary channels come last (latent attention): the same channel
    permutation on q and k puts them first, as the kernels expect; dot products and the output are unchanged.
    Wrapped so that the function keeps its module and name (the evaluation fingerprints cells by them)."""

    @functools.wraps(attention)
    def call(module, query, key, value, *args, **kwargs):
        offset = getattr(module, ROTARY_OFFSET_ATTRIBUTE, 0)
        if offset:
            query, key = query.roll(-offset, dims=-1), key.roll(-offset, dims=-1)
        return attention(module, query, key, value, *args, **kwargs)

    return call


def call_settings(module: nn.Module, query: torch.Tensor, scaling: float | None, kwargs: dict[str, Any], *,
                  attribute: str, title: str, method: str) -> tuple[Any, float]:
    """What every registered attention function checks first: the settings the patch attached to ``module``,
    and the scale (``1/sqrt(head size)`` when the model passes none).

    Args:
        attribute: the module attribute holding the method's layer settings.
        title: the method's name in messages ("Dual Chunk Attention"); method: its registry name ("dca").

    Raises:
        RuntimeError: the module carries no settings (a copied model, a hand-edited config).
    """
    settings = getattr(module, attribute, None)
    if settings is None:
        raise RuntimeError(
            f"{type(module).__name__} is set to {title} but carries no {title} settings (was the model copied or "
            f"its config edited by hand?). Call hf_posext.patch(model, {method!r}, ...) again."
        )
    return settings, query.shape[-1] ** -0.5 if scaling is None else scaling


def plain_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float, kwargs: dict[str, Any]):
    """transformers' own SDPA attention function: the calls a method leaves exactly as the model computes them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


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
        if layer.rotary_offset:
            setattr(layer.module, ROTARY_OFFSET_ATTRIBUTE, layer.rotary_offset)
    for site, replacement in swaps:
        setattr(site.parent, site.attribute, replacement)
    max_positions = getattr(config, "max_position_embeddings", None)
    max_positions = max_positions if isinstance(max_positions, int) and not isinstance(max_positions, bool) else None
    frequency = rope_surgery.patch_record(model)  # read before the method's own record replaces it
    write_config(config, settings, base, max_positions)
    _attach_frequency_record(config, frequency)
    model.__dict__[method.state_attribute] = AttentionState(
        settings, base, [(layer.path, layer.module) for layer in layers], snapshot, [site for site, _ in swaps], max_positions,
        tuple(layer.path for layer in layers if layer.position_free),
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
        module.__dict__.pop(ROTARY_OFFSET_ATTRIBUTE, None)
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
        free = len(state.position_free)
        others = "sliding window" if not free else (
            "no rotary position (NoPE)" if free == len(state.modules) - len(scaled)
            else f"{free} with no rotary position (NoPE), the rest sliding window")
        notes.append(f"{method.scaled_word} in {len(scaled)} of {len(state.modules)} attention layers (others: {others})")
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
