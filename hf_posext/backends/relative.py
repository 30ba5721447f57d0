"""The relative-position-bias backend: T5, mT5, UMT5, Flan-T5 (and any model built the same way).

Where the positions live: each attention module that owns a bias table has
``relative_attention_bias`` (an ``nn.Embedding`` with one row per bucket), ``relative_attention_num_buckets``,
``relative_attention_max_distance`` and a ``_relative_position_bucket`` that maps relative distances
(key position - query position) to buckets; ``compute_bias`` calls it for the encoder's self-attention,
the decoder's self-attention and wherever else a bias is computed. They are found by that structure,
never by model name.

How a method is applied: the module's bucketing is wrapped per instance, so the buckets see
``compute(distance)`` instead of the distance (``linear``: trunc(d / s), :mod:`hf_posext.methods.relative`).
Nothing else changes: no weight, no buffer, no config field but ``config.hf_posext``. A probe at patch
time checks that ``compute_bias`` really calls the wrapped bucketing; a transformers release that
computes the bias another way gets a clear error instead of a silently unscaled model.

The window of a relative-bias model is ``relative_attention_max_distance``: the distance up to which
buckets tell distances apart (``none`` keeps it: every longer distance shares the last bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hf_posext.core.errors import UnsupportedModelError
from hf_posext.core.loading import config_kwargs, model_class_for
from hf_posext.core.record import CONFIG_KEY, ScalingReport, make_record, restore_config, snapshot_config, text_config
from hf_posext.core.request import ScalingRequest, resolve_factor
from hf_posext.methods import BASELINE, get_method

__all__ = ["RelativeBackend", "BiasSite", "find_bias_sites"]

_STATE_ATTRIBUTE = "_hf_posext_relative_state"
_BUCKET_ATTRIBUTE = "_relative_position_bucket"
_KIND = "relative"


@dataclass
class BiasSite:
    """One attention module that computes a relative position bias."""

    path: str
    module: nn.Module
    num_buckets: int
    max_distance: int


@dataclass
class _RelativeState:
    request: ScalingRequest
    factor: float
    window: int
    sites: list[BiasSite]
    config_snapshot: dict[str, Any]
    stock_loadable: bool


def find_bias_sites(model: nn.Module) -> list[BiasSite]:
    """Every module with a relative-position bias table, in module order.

    Raises:
        UnsupportedModelError: a bias table whose module has no bucketing function to intercept.
    """
    sites = []
    for path, module in model.named_modules():
        table = getattr(module, "relative_attention_bias", None)
        if not isinstance(table, nn.Embedding):
            continue
        buckets = getattr(module, "relative_attention_num_buckets", None)
        distance = getattr(module, "relative_attention_max_distance", None)
        if not callable(getattr(type(module), _BUCKET_ATTRIBUTE, None)) or not isinstance(buckets, int) or not isinstance(distance, int):
            raise UnsupportedModelError(
                f"{path or type(module).__name__} has a relative_attention_bias table but no {_BUCKET_ATTRIBUTE} / "
                "relative_attention_num_buckets / relative_attention_max_distance to scale it through; this "
                "transformers release computes T5-style bias differently from the one hf_posext supports (5.x)."
            )
        sites.append(BiasSite(path, module, buckets, distance))
    return sites


def _wrapped_bucketing(original: Callable[..., torch.Tensor], compute: Callable[..., torch.Tensor], factor: float, params: Any, calls: list[int]) -> Callable[..., torch.Tensor]:
    """``original`` applied to ``compute(distances)``; counts its calls in ``calls`` (for the probe)."""

    def bucket(relative_position: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(compute(relative_position, factor, params), *args, **kwargs)

    return bucket


def _install(sites: list[BiasSite], compute: Callable[..., torch.Tensor], factor: float, params: Any) -> list[int]:
    calls = [0]
    for site in sites:
        original = getattr(site.module, _BUCKET_ATTRIBUTE)
        site.module.__dict__[_BUCKET_ATTRIBUTE] = _wrapped_bucketing(original, compute, factor, params, calls)
    return calls


def _remove(sites: list[BiasSite]) -> None:
    for site in sites:
        site.module.__dict__.pop(_BUCKET_ATTRIBUTE, None)


def _probe(sites: list[BiasSite], compute: Callable[..., torch.Tensor], factor: float, params: Any) -> None:
    """Check that each site's ``compute_bias`` goes through the bucketing we wrap (leaves no trace: a patch
    already installed, when re-patching, is put back as it was, so a failed re-patch keeps it)."""
    for site in sites:
        installed = site.module.__dict__.pop(_BUCKET_ATTRIBUTE, None)
        calls = _install([site], compute, factor, params)
        try:
            with torch.no_grad():
                site.module.compute_bias(3, 3, device=site.module.relative_attention_bias.weight.device)
        except Exception as error:
            raise UnsupportedModelError(f"{site.path}: computing its relative bias failed ({error}).") from error
        finally:
            _remove([site])
            if installed is not None:
                site.module.__dict__[_BUCKET_ATTRIBUTE] = installed
        if calls[0] == 0:
            raise UnsupportedModelError(
                f"{site.path}.compute_bias does not call {_BUCKET_ATTRIBUTE}, so hf_posext cannot scale its relative "
                "distances; this transformers release is not supported for relative-bias scaling."
            )


def _state(model: nn.Module) -> _RelativeState | None:
    return model.__dict__.get(_STATE_ATTRIBUTE)


class RelativeBackend:
    """T5-style relative position bias: ``none`` (extrapolate) and ``linear`` (distances / s)."""

    name = "relative"
    method_kinds = (_KIND,)
    record_kinds = (_KIND,)
    applies_over: tuple[str, ...] = ()

    def detect(self, model: nn.Module) -> str | None:
        if _state(model) is not None:
            return _KIND
        try:
            return _KIND if find_bias_sites(model) else None
        except UnsupportedModelError:
            return _KIND  # ours to handle: patch reports the problem

    def is_patched(self, model: nn.Module) -> bool:
        return _state(model) is not None

    def patch(self, model: nn.Module, request: ScalingRequest, **extras: Any) -> nn.Module:
        """Scale the relative distances every bias table sees (validates everything first).

        Raises:
            ValueError: a method of another kind (``yarn``), unknown parameter, extra arguments, a
                factor below 1, a target shorter than the window.
            UnsupportedModelError: no bias table, or one whose bias bypasses the bucketing function.
        """
        if extras:
            raise ValueError(f"{', '.join(f'{k}=' for k in extras)} does not apply to relative-bias models.")
        spec = get_method(request.method, _KIND)
        params = spec.parse_params(request.params_dict)
        previous = _state(model)
        sites = previous.sites if previous is not None else find_bias_sites(model)
        if not sites:
            raise UnsupportedModelError(f"{type(model).__name__} has no relative_attention_bias table.")
        window = request.original_max_position_embeddings or min(site.max_distance for site in sites)
        factor = resolve_factor(request.factor, request.target_length, window)
        _probe(sites, spec.compute, factor, params)

        config = model.config
        snapshot = previous.config_snapshot if previous is not None else snapshot_config(config, (CONFIG_KEY,))
        if previous is not None:
            _remove(sites)
        _install(sites, spec.compute, factor, params)
        # Stock transformers buckets the distances as they are: it reproduces the patch when the method leaves them so.
        distances = torch.arange(-4 * int(window * factor), 4 * int(window * factor) + 1)
        stock_loadable = torch.equal(spec.compute(distances, factor, params), distances)
        setattr(config, CONFIG_KEY, make_record(
            _KIND, spec.name, factor, window, request.params_dict,
            current_window=int(math.floor(window * factor)), stock_loadable=stock_loadable,
        ))
        model.__dict__[_STATE_ATTRIBUTE] = _RelativeState(request, factor, window, sites, snapshot, stock_loadable)
        return model

    def unpatch(self, model: nn.Module) -> nn.Module:
        state = _state(model)
        if state is None:
            raise ValueError("This model is not patched by hf_posext (nothing to unpatch).")
        _remove(state.sites)
        restore_config(model.config, state.config_snapshot)
        del model.__dict__[_STATE_ATTRIBUTE]
        return model

    def current_request(self, model: nn.Module) -> ScalingRequest:
        return _state(model).request

    def describe(self, model: nn.Module) -> ScalingReport:
        state = _state(model)
        family = getattr(model.config, "model_type", type(model).__name__)
        sites = state.sites if state is not None else find_bias_sites(model)
        notes = [
            f"{len(sites)} bias table(s), {sites[0].num_buckets} buckets: exact up to distance "
            f"{sites[0].num_buckets // 4} (encoder) / {sites[0].num_buckets // 2} (decoder), logarithmic up to "
            f"{sites[0].max_distance}, one shared bucket beyond"
        ] if sites else []
        if state is None:
            record = getattr(model.config, CONFIG_KEY, None)
            if isinstance(record, dict):
                notes.append(
                    f"saved by hf_posext with {record.get('method')} x{record.get('factor')} and loaded without it "
                    "(unscaled now); use hf_posext.load(path) to restore it"
                )
            window = min((s.max_distance for s in sites), default=0)
            return ScalingReport(family, _KIND, BASELINE, 1.0, window, window, False, [s.path for s in sites], {}, None, notes)
        if not state.stock_loadable:
            notes.append(
                "stock from_pretrained loads this model unscaled: transformers has no relative-distance scaling "
                "(use hf_posext.load)"
            )
        return ScalingReport(
            family, _KIND, state.request.method, state.factor, state.window, int(math.floor(state.window * state.factor)),
            False, [s.path for s in state.sites], state.request.params_dict, state.stock_loadable, notes,
        )

    def load(self, path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **config_kwargs(from_pretrained_kwargs))
        text_config(config).__dict__.pop(CONFIG_KEY, None)
        model = model_class_for(config).from_pretrained(path, config=config, **from_pretrained_kwargs)
        request = ScalingRequest.from_kwargs(
            record["method"], record["factor"],
            original_max_position_embeddings=record.get("original_max_position_embeddings"), **record.get("params", {}),
        )
        return self.patch(model, request)
