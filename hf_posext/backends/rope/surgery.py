"""The RoPE backend's surgery: patch_rope / unpatch_rope / describe_rope / load_rope of rotary modules (no math here; the methods do the numbers).

``patch_rope`` validates everything before it changes anything, swaps each rotary module for a
:class:`~hf_posext.backends.rope.module.ScaledRotaryEmbedding`, updates the config so ``save_pretrained`` records the
scaling, and remembers the originals so ``unpatch_rope`` restores the model and its config exactly.

How the config records a scaling: ``config.hf_posext`` holds our description (method, factor,
parameters, the original values of every config field we changed). Where transformers has the same
rule for this model, ``rope_parameters`` (5.x) / ``rope_scaling`` (4.5x) is set to it too, so stock
``from_pretrained`` reproduces the patched model without hf_posext; this is checked when patching by
building the model's own rotary class from the new config and comparing outputs. Otherwise the RoPE
fields keep their original values (stock transformers then loads the unscaled model) and
:func:`load` re-applies the scaling. A patched model's ``save_pretrained`` adds the legacy fields transformers
4.x reads, where transformers 5 can still resume training from the folder, and otherwise warns with the fix
(:mod:`hf_posext.core.saved_config`; docs/serving.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from hf_posext.backends.rope.attention_scale import ScaleChange, folds_rope_scale, softmax_scale_changes
from hf_posext.backends.rope.module import ScaledRotaryEmbedding
from hf_posext.backends.rope.rules import (
    TARGET_STATES_ARGUMENT, kept_method_parameters, kept_rope_keys, layers_without_rope, reads_target_states,
)
from hf_posext.backends.rope.sites import (
    RotarySite,
    build_rotary_module,
    fill_legacy_rope_fields,
    find_rotary_sites,
    outputs_match,
    probe,
    rope_parameters,
    set_rope_parameters,
    window_attribute,
)
from hf_posext.backends.saving import (
    check_tokenizer,
    install_save_pretrained,
    remove_save_pretrained,
    restore_tokenizer_lengths,
    set_tokenizer_lengths,
)
from hf_posext.core.errors import check_model
from hf_posext.core.loading import config_kwargs, model_class_for
from hf_posext.core.record import CONFIG_KEY, ScalingReport, jsonable, restore_config, snapshot_config, text_config
from hf_posext.core.request import ScalingConfig, ScalingRequest, resolve_factor
from hf_posext.core.saved_config import (
    older_readers_differ, older_readers_ignore_scaling, plain_save_legacy_fields, write_json_atomically,
)
from hf_posext.methods import get_method
from hf_posext.user_warnings import warn_at_caller
from hf_posext.methods.transformers import stock_rope_parameters, window_is_scaled

__all__ = ["patch_rope", "unpatch_rope", "describe_rope", "load_rope", "is_patched", "current_scaling", "fixed_length", "ScalingReport", "CONFIG_KEY"]

_STATE_ATTRIBUTE = "_hf_posext_state"
_CONFIG_FIELDS = (
    "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "n_positions",
    "original_max_position_embeddings", CONFIG_KEY,
)


@dataclass
class _PatchState:
    scaling: ScalingConfig
    sites: list[RotarySite]
    new_modules: list[ScaledRotaryEmbedding]
    config_snapshots: list[tuple[Any, dict[str, Any]]]
    stock_loadable: bool
    wrapped_generate: bool = False
    tokenizers: list[tuple[Any, Any]] = field(default_factory=list)
    scale_changes: list[ScaleChange] = field(default_factory=list)


def _state(model: nn.Module) -> _PatchState | None:
    return model.__dict__.get(_STATE_ATTRIBUTE)


def _snapshot(config) -> dict[str, Any]:
    return snapshot_config(config, _CONFIG_FIELDS)


def _original_snapshot(config) -> dict[str, Any]:
    """Snapshot of the *pre-training* config fields: from a saved hf_posext record if there is one."""
    record = getattr(config, CONFIG_KEY, None)
    if isinstance(record, dict) and "original_config" in record:
        return dict(record["original_config"])
    return _snapshot(config)


def _construct_like(module: nn.Module, config) -> nn.Module:
    cls = type(module)
    try:
        return cls(config=config)
    except TypeError:
        return cls(config)


def _stock_reproduces(site: RotarySite, new_module: ScaledRotaryEmbedding, config, scaling: ScalingConfig) -> bool:
    """Does the model's own rotary class, built from ``config``, compute what ``new_module`` does?"""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stock = _construct_like(site.module, config).to(site.device)
    except Exception:
        return False
    length = max(scaling.target_length, scaling.original_max_position_embeddings + 2)
    positions = torch.tensor([[0, 1, 5, 99, length // 3, length - 2, length - 1]], device=site.device)
    for layer_type in site.dims:
        try:
            if not outputs_match(probe(stock, positions, layer_type), probe(new_module, positions, layer_type), tol=1e-5):
                return False
        except Exception:
            return False
    return True


def config_round_trips(config) -> bool:
    """Does ``config`` survive ``to_dict`` -> ``from_dict``? A family's config class may accept fewer rope types
    than transformers has (Phi-3: default and longrope only), and then refuses the saved folder at load time."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            type(config).from_dict(config.to_dict())
    except Exception:
        return False
    return True


def _plan_config(
    config, original: dict[str, Any], scaling: ScalingConfig, theta: float, rotary_dim: int, layer_type: Any,
    scaled_sites: list[tuple[RotarySite, ScaledRotaryEmbedding]],
) -> tuple[dict[str, Any], bool, dict[str, Any] | None]:
    """The config fields ``config`` gets for ``scaling`` (changes nothing), whether stock transformers
    reproduces the patched modules from them, and the rope dict transformers has for the rule (None: none).

    Where transformers has the rule, the fields are its ``rope_parameters`` and window, checked by building
    the model's own rotary class from them; otherwise the original RoPE fields stay (stock loads the unscaled
    model) and the new window is advertised only through the hf_posext record.
    """
    window = scaling.original_max_position_embeddings
    work = copy.deepcopy(config)
    restore_config(work, {k: v for k, v in original.items() if k != CONFIG_KEY})
    base_params = rope_parameters(work, layer_type) or {}
    stock = stock_rope_parameters(
        scaling.method, scaling.factor, window, scaling.params, theta, rotary_dim, identity=scaling.is_identity,
        base_rope_type=base_params.get("rope_type", "default"),
    )
    if stock is not None:
        stock.update(kept_rope_keys(base_params, stock))
        set_rope_parameters(work, stock, layer_type)
        # transformers' dynamic type scales from max_position_embeddings = L, and its linear type never reads
        # it: both keep L there, which is what vLLM and SGLang multiply by the factor to get the served length
        # (a linear config with L*s would advertise L*s^2). yarn, llama3 and longrope read L from their dict.
        # ("default" here is ntk/theta: a new base, served at L * s, so the scaled window is written).
        keeps_window = stock["rope_type"] != "default" and not window_is_scaled(stock["rope_type"])
        setattr(work, window_attribute(work), window if keeps_window else scaling.target_length)
        if config_round_trips(work) and all(_stock_reproduces(site, module, work, scaling) for site, module in scaled_sites):
            return _snapshot(work), True, stock
    work = copy.deepcopy(config)
    restore_config(work, {k: v for k, v in original.items() if k != CONFIG_KEY})
    if scaling.spec.dynamic:
        setattr(work, window_attribute(work), window)
    return _snapshot(work), False, stock


def _scale_changes(
    model: nn.Module, config, original: dict[str, Any], rope_dict: dict[str, Any] | None, layer_type: Any,
    previous: _PatchState | None,
) -> list[ScaleChange]:
    """Softmax scales that follow the rope dict (the MLA rule), for the dict transformers reads for the patch
    (the unscaled default where it has no rule)."""
    before = copy.deepcopy(config)
    restore_config(before, {k: v for k, v in original.items() if k != CONFIG_KEY})
    base = rope_parameters(before, layer_type) or {}
    after_dict = rope_dict or {"rope_type": "default", "rope_theta": base.get("rope_theta")}
    if not folds_rope_scale(base, after_dict):
        return []
    after = copy.deepcopy(before)
    set_rope_parameters(after, {**after_dict, **kept_rope_keys(base, after_dict)}, layer_type)
    originals = {id(change.module): change.original for change in previous.scale_changes} if previous else {}
    return softmax_scale_changes(model, before, after, originals)


def _plan_configs(
    model: nn.Module, sites: list[RotarySite], new_modules: list[ScaledRotaryEmbedding], scaling: ScalingConfig,
    previous: _PatchState | None,
) -> tuple[list[tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]], list[ScaleChange]]:
    """(config, original fields, new fields, record) for every config the model saves, and the attention
    softmax scales that follow the rope dict (:mod:`~hf_posext.backends.rope.attention_scale`); changes nothing.

    Only the model's own configs are written: a rotary module holding a private copy (Granite SWA builds one
    config copy per base, and keys its tables by that copy's ``rope_theta``) keeps it untouched, and then
    stock ``from_pretrained`` is not trusted to rebuild the patch (the record says so; ``hf_posext.load`` does).
    """
    own = [text_config(model.config)] if hasattr(model, "config") else []
    own += [c for c in (getattr(model, "config", None),) if c is not None and c is not own[0]]
    scaled = [(site, module) for site, module in zip(sites, new_modules) if site.scaled_layer_types]
    configs = [c for c in own if any(site.config is c for site, _ in scaled)] or own[:1]
    private = any(all(site.config is not c for c in configs) for site, _ in scaled)
    planned, scale_changes = [], []
    for config in configs:
        original = _original_snapshot(config) if previous is None else next(s for c, s in previous.config_snapshots if c is config)
        config_sites = [(site, module) for site, module in scaled if site.config is config] or scaled[:1]
        # Each config keeps the base of its own rotary module.
        config_site = config_sites[0][0]
        config_type = config_site.scaled_layer_types[0]
        theta = config_site.bases[config_type]
        new_values, site_ok, rope_dict = _plan_config(
            config, original, scaling, theta, config_site.dims[config_type], config_type, config_sites
        )
        scale_changes += _scale_changes(model, config, original, rope_dict, config_type, previous)
        new_record = {
            **scaling.to_dict(),
            "original_theta": theta,
            "stock_loadable": site_ok and not private,
            "original_config": jsonable({k: v for k, v in original.items() if k != CONFIG_KEY}),
        }
        planned.append((config, original, new_values, new_record))
    return planned, scale_changes


def patch_rope(model: nn.Module, request: ScalingRequest, *, tokenizer: Any = None) -> nn.Module:
    """Scale the model's rotary modules as ``request`` says (:func:`hf_posext.patch` routes RoPE requests here).

    ``tokenizer``: a tokenizer whose ``model_max_length`` is set to the new window L * s (restored by
    ``unpatch``), so that saving it tells vLLM the served length (it caps its length there).

    Raises:
        ValueError: a method that is not a RoPE method, a bad factor or target, no supported rotary
            module. In every case the model is left untouched (a previous patch included).
    """
    check_model(model)
    spec = get_method(request.method, "rope")
    previous = _state(model)
    if previous is not None:
        sites = previous.sites
        config_snapshots = previous.config_snapshots
    else:
        sites = find_rotary_sites(model)
        config_snapshots = []
    main_site = next(site for site in sites if site.scaled_layer_types)
    main_type = main_site.scaled_layer_types[0]
    record = getattr(main_site.config, CONFIG_KEY, None) if previous is None else None
    if isinstance(record, dict) and record.get("original_max_position_embeddings") and record.get("original_theta"):
        # A model saved patched and loaded with stock transformers: scale from the pre-training values.
        window = int(record["original_max_position_embeddings"])
        for site in sites:
            for layer_type in site.scaled_layer_types:
                site.bases[layer_type] = float(record["original_theta"])
    else:
        window = main_site.current[main_type].original_max_position_embeddings
    if request.original_max_position_embeddings is not None:  # validated by ScalingRequest
        window = request.original_max_position_embeddings
    scale = resolve_factor(request.factor, request.target_length, window)
    scaling = ScalingConfig(spec.name, scale, window, kept_method_parameters(main_site.current[main_type], spec.name, request.params_dict))
    new_modules = [build_rotary_module(site, scaling) for site in sites]
    check_tokenizer(tokenizer)

    # Work out every config change before touching the model.
    planned, scale_changes = _plan_configs(model, sites, new_modules, scaling, previous)
    stock_loadable = all(record["stock_loadable"] for *_, record in planned)

    # Apply: nothing above changed the model; from here on, undo on any failure.
    if previous is not None:
        _remove_generate_wrapper(model, previous)
    applied = []
    try:
        for site, module in zip(sites, new_modules):
            setattr(site.parent, site.attribute, module)
            applied.append(site)
        snapshots = []
        for config, original, new_values, new_record in planned:
            current = _snapshot(config) if previous is None else next(s for c, s in config_snapshots if c is config)
            snapshots.append((config, current))
            restore_config(config, new_values)
            setattr(config, CONFIG_KEY, new_record)
        _set_scales(previous.scale_changes if previous else [], patched=False)
        _set_scales(scale_changes, patched=True)
    except Exception:
        for site in applied:
            setattr(site.parent, site.attribute, site.module)
        for config, snapshot in config_snapshots or []:
            restore_config(config, snapshot)
        _set_scales(scale_changes, patched=False)
        _set_scales(previous.scale_changes if previous else [], patched=True)
        raise
    state = _PatchState(scaling, sites, new_modules, snapshots, stock_loadable, scale_changes=scale_changes)
    if reads_target_states(model):  # only its queries move: a target left as it was disagrees with it, silently
        warn_at_caller(_drafting_head_note(f"hf_posext.patch(target, {scaling.method!r}, factor={scaling.factor:g})"))
    state.tokenizers = set_tokenizer_lengths(previous.tokenizers if previous else [], tokenizer, scaling.target_length)
    model.__dict__[_STATE_ATTRIBUTE] = state
    if any(module.is_dynamic for module in new_modules):
        _install_generate_wrapper(model, state)
    install_save_pretrained(model, _complete_saved_config)
    return model


def _set_scales(changes: list[ScaleChange], patched: bool) -> None:
    for change in changes:
        change.module.scaling = change.patched if patched else change.original


def _complete_saved_config(model: nn.Module, save_directory: str) -> None:
    """After ``save_pretrained``: the legacy RoPE fields that transformers 4.x needs, in the form every
    transformers reads alike (:func:`~hf_posext.core.saved_config.plain_save_legacy_fields`); a warning with
    the fix when no such form exists and 4.x would read the folder as another model."""
    path = os.path.join(save_directory, "config.json")
    if os.path.isfile(path):
        with open(path) as file:
            saved = json.load(file)
        completed = plain_save_legacy_fields(saved)
        if completed != saved:
            write_json_atomically(path, completed)
        if older_readers_ignore_scaling(completed):
            warnings.warn(
                f"transformers 4.x's {completed.get('model_type')} ignores rope_scaling: with transformers 4.x (and the "
                "runtimes built on it) a stock from_pretrained loads this model unscaled; load it there with "
                "hf_posext.load(SAVED_DIR), or with transformers >= 5",
                stacklevel=3,  # the caller of save_pretrained
            )
        elif older_readers_differ(completed):
            # One text for every folder, so that Python shows it once per call site (not at every checkpoint).
            warnings.warn(
                "the saved config.json holds its yarn/llama3/longrope scaling only in rope_parameters (with the "
                "legacy fields, transformers 5 could not resume a Trainer run from it): transformers 4.x and the "
                "runtimes built on it load this model unscaled, with their default rope_theta; for them run `hf-posext export SAVED_DIR --for "
                "transformers --out NEW_DIR` (or --for vllm / sglang / llama.cpp), see docs/serving.md",
                stacklevel=3,  # the caller of save_pretrained
            )


def unpatch_rope(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_rope`: the original rotary modules and config fields, exactly (ValueError if not patched)."""
    check_model(model)
    state = _state(model)
    if state is None:
        raise ValueError("This model is not patched by hf_posext (nothing to unpatch).")
    for site in state.sites:
        device = next(iter(getattr(site.parent, site.attribute).buffers()), None)
        original = site.module
        if device is not None:
            original.to(device.device)
        setattr(site.parent, site.attribute, original)
    for config, snapshot in state.config_snapshots:
        restore_config(config, snapshot)
    _set_scales(state.scale_changes, patched=False)
    restore_tokenizer_lengths(state.tokenizers)
    _remove_generate_wrapper(model, state)
    remove_save_pretrained(model)
    del model.__dict__[_STATE_ATTRIBUTE]
    return model


def _planned_generation_length(model: nn.Module, args: tuple, kwargs: dict) -> int | None:
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if inputs is None and kwargs.get("inputs_embeds") is not None:
        prompt = kwargs["inputs_embeds"].shape[1]
    elif isinstance(inputs, torch.Tensor):
        prompt = inputs.shape[-1]
    else:
        return None
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None) if "max_length" not in kwargs else None)
    if max_new is not None:
        return prompt + int(max_new)
    max_length = kwargs.get("max_length", getattr(config, "max_length", None))
    return int(max_length) if max_length is not None else None


def _install_generate_wrapper(model: nn.Module, state: _PatchState) -> None:
    original_generate = model.generate

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        length = _planned_generation_length(model, args, kwargs)
        with fixed_length(model, length):
            return original_generate(*args, **kwargs)

    model.generate = generate
    state.wrapped_generate = True


def _remove_generate_wrapper(model: nn.Module, state: _PatchState) -> None:
    if state.wrapped_generate:
        model.__dict__.pop("generate", None)
        state.wrapped_generate = False


@contextlib.contextmanager
def fixed_length(model: nn.Module, length: int | None) -> Iterator[None]:
    """Fix the length that dynamic methods scale for, for every forward pass inside the block.

    ``generate`` on a patched model does this by itself (prompt length + ``max_new_tokens``). Use it
    when you drive a KV cache by hand: scale once for the final length so cached keys and new queries
    share one rotation. Outside the block each forward uses its own length. No-op on static methods.

    Example:
        >>> with hf_posext.fixed_length(model, prompt_len + 256):
        ...     out = model(prompt_ids, use_cache=True); ...  # then step with past_key_values
    """
    state = _state(model)
    modules = state.new_modules if state is not None else []
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(module.fixed_length(length))
        yield


def describe_rope(model: nn.Module) -> ScalingReport:
    """:func:`hf_posext.describe` for a RoPE model, patched or not (then: the scaling transformers applies, if any)."""
    check_model(model)
    family = getattr(model.config, "model_type", type(model).__name__)
    state = _state(model)
    if state is not None:
        scaling = state.scaling
        notes = []
        site = next(s for s in state.sites if s.scaled_layer_types)
        if len(site.dims) > 1:
            kept = [str(t) for t in site.dims if t not in site.scaled_layer_types]
            notes.append(f"scaled layer types: {', '.join(map(str, site.scaled_layer_types))}"
                         + (f"; unchanged: {', '.join(kept)}" if kept else ""))
        notes += _rope_layer_notes(site)
        if scaling.spec.dynamic:
            notes.append("generate() fixes the scale for prompt + max_new_tokens so the KV cache stays consistent")
        if reads_target_states(model):
            notes.append(_drafting_head_note(f"hf_posext.patch(target, {scaling.method!r}, factor={scaling.factor:g})"))
        return ScalingReport(
            family=family, kind="rope", method=scaling.method, factor=scaling.factor,
            original_window=scaling.original_max_position_embeddings, current_window=scaling.target_length,
            dynamic=scaling.spec.dynamic, sites=[s.path for s in state.sites],
            params={k: v for k, v in scaling.params.items() if v is not None},
            stock_loadable=state.stock_loadable, notes=notes,
        )
    sites = find_rotary_sites(model)
    site = next(s for s in sites if s.scaled_layer_types)
    current = site.current[site.scaled_layer_types[0]]
    notes = []
    if not current.spec.baseline:
        notes.append("scaled by the model's own config (transformers' built-in rope_type)")
    record = getattr(site.config, CONFIG_KEY, None)
    if isinstance(record, dict):
        notes.append(f"saved by hf_posext with {record.get('method')} x{record.get('factor')}; use hf_posext.load to restore it exactly")
    if reads_target_states(model):
        notes.append(_drafting_head_note(None))
    return ScalingReport(
        family=family, kind="rope", method=current.method, factor=current.factor,
        original_window=current.original_max_position_embeddings, current_window=current.target_length,
        dynamic=current.spec.dynamic, sites=[s.path for s in sites],
        params={k: v for k, v in current.params.items() if v is not None}, notes=notes,
    )


def _drafting_head_note(target_patch: str | None) -> str:
    """``describe``'s note on a drafting head: only its queries carry its rotary positions, so a scaling of it is
    right only when its target model carries the same one (``target_patch``: the call that does it, if known)."""
    same = f"the same scaling ({target_patch})" if target_patch else "any scaling given to this head (same method, same factor)"
    return (f"a drafting head: the keys it attends to are its target model's ({TARGET_STATES_ARGUMENT}), rotated by the "
            f"target, so patch the target with {same}, or queries and keys disagree")


def _rope_layer_notes(site: RotarySite) -> list[str]:
    """``describe``'s notes on the layers a patch leaves alone: NoPE / non-attention layers, non-rotating pairs."""
    notes = []
    without = layers_without_rope(site.config)
    if without:
        total = getattr(site.config, "num_hidden_layers", None)
        notes.append(
            f"layers without RoPE left untouched: {', '.join(map(str, without))}"
            + (f" ({total - len(without)} of {total} layers scaled)" if isinstance(total, int) else "")
        )
    for layer_type in site.scaled_layer_types:
        pairs = site.rotated.get(layer_type)
        if pairs is not None:
            name = "" if layer_type is None else f"{layer_type}: "
            notes.append(f"{name}proportional partial rotary, {pairs} of {site.dims[layer_type] // 2} pairs rotate (the rest stay 0)")
    return notes


def is_patched(model: nn.Module) -> bool:
    """True when :func:`patch_rope` scaled this model's rotary modules in memory."""
    return _state(model) is not None


def current_scaling(model: nn.Module) -> ScalingConfig:
    """The scaling a patched model runs with."""
    return model.__dict__[_STATE_ATTRIBUTE].scaling


def patched_sites(model: nn.Module) -> list[RotarySite] | None:
    """The rotary sites of a model this backend patched, each describing what its module computes now (the
    patch's scaling on the scaled layer types), for a method stacked on the patch; None when not patched.

    The sites' ``module`` is the replacement module in place; ``parent``/``attribute`` say where it sits.
    """
    state = _state(model)
    if state is None:
        return None
    return [
        dataclasses.replace(site, module=module, current={
            layer_type: state.scaling if layer_type in site.scaled_layer_types else scaling
            for layer_type, scaling in site.current.items()
        })
        for site, module in zip(state.sites, state.new_modules)
    ]


def patch_record(model: nn.Module) -> dict[str, Any] | None:
    """The saved record (``config.hf_posext``) this backend's patch wrote on the main config; None when not patched."""
    state = _state(model)
    if state is None:
        return None
    config = next(site.config for site in state.sites if site.scaled_layer_types)
    record = getattr(config, CONFIG_KEY, None)
    return copy.deepcopy(record) if isinstance(record, dict) else None


def load_rope(path: str, record: dict[str, Any], config: Any = None, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a RoPE model saved after :func:`patch_rope` (``record``: its validated ``hf_posext`` record).

    The config's RoPE fields are reset to the pre-patch values kept in the record, the weights are
    loaded, and the scaling is re-applied by :func:`patch_rope`, so the model equals the one that was saved.
    ``config``: the folder's config, already read (and cleared of the fields of a method stacked on this
    scaling); None reads it from ``path``.
    """
    from transformers import AutoConfig

    if config is None:
        config = AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs))
    target = text_config(config)
    restore_config(target, dict(record.get("original_config", {})))
    fill_legacy_rope_fields(target)  # a transformers 5 save loaded by transformers 4.x
    target.__dict__.pop(CONFIG_KEY, None)
    model = model_class_for(config).from_pretrained(path, config=config, **from_pretrained_kwargs)
    scaling = ScalingConfig.from_dict(record)
    return patch_rope(model, ScalingRequest.from_kwargs(
        scaling.method, scaling.factor, original_max_position_embeddings=scaling.original_max_position_embeddings,
        **{k: v for k, v in scaling.params.items() if v is not None},
    ))
