"""Dual Chunk Attention: training-free context extension by chunked position indices (An et al. 2024).

An, Huang, Zhang, Gong, Qiu, Zhou, Kong 2024, "Training-Free Long-Context Scaling of Large Language
Models" (arXiv:2402.17463, ICML 2024; ChunkLlama). The position indices (pure numbers) are in
:mod:`hf_posext.methods.dual_chunk`: with chunk length ``s = chunk_size - local_window`` keys sit at
``j mod s`` and a query sits at ``i mod s`` (intra-chunk), ``min(i mod s + s, chunk_size)``
(successive chunk) or ``min(2s - 1, chunk_size)`` (inter-chunk) depending on how many chunks lie
between it and the key, so no relative distance exceeds ``chunk_size``.

How it hooks into transformers: like Self-Extend, through the public attention-function registry
(``AttentionInterface``, set up by :mod:`hf_posext.backends.attention.registration`), under
``hf_posext_dca_sdpa`` / ``hf_posext_dca_eager``; this module picks the path per call and installs the
method, :mod:`hf_posext.backends.attention.dual_chunk_kernels` keeps the math. q and k arrive rotated to their true positions;
rotating them again by ``R(p' - p)`` moves them to the DCA index ``p'`` (RoPE rotations compose). Keys
move by ``-s * (j // s)`` (a multiple of the chunk length); queries by one of three offsets.

Cost. Up to the chunk length nothing changes (the SDPA path calls transformers' SDPA function). Past it,
on the SDPA path, each block of queries inside one chunk runs at most four fused attention calls with
no explicit mask — intra-chunk keys before the block, the block's causal diagonal, the previous chunk,
the older chunks — merged exactly by their log-sum-exp (the softmax over the whole row, taken in
pieces). A decode step (a few new queries, :func:`dual_chunk_decode`) leaves the key cache as it is:
per layer, the query rotated to its index for every chunk distance at once (one copy of channel
partners, two multiplies), one matmul against the cached keys, one gather picking each key's score, one
softmax, one matmul with the values — about seven kernels, the same at any length, no host
synchronisation; the rotation factors and key index are built once per step for all layers. The eager
path, a logit cap, training and per-row positions use an explicit pass with the keys moved to
``j mod s`` and each query rotated three ways. ``bench/dca_cost.py`` measures prefill and decode step.

Length scale (``attention_scale=True``, Qwen2.5-1M as SGLang serves it; docs/serving.md (S7)): every score
of a call times ``f(T)^2``, ``f(T) = max(1, 0.1 ln(T / L) + 1)``, T the last query's position + 1 of each
batch row. It is folded into the decode tables' rotation factors (no extra kernel), the fused path's
scaling (one T for the batch) and the explicit path's per-row scaling; 1 up to L, so shorter calls are
untouched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.backends.attention import registration
from hf_posext.backends.attention.dual_chunk_kernels import (
    DECODE_QUERIES, FUSED_QUERY_BLOCK, SCORE_BLOCK_ELEMENTS, DualChunkLayerSettings, clear_decode_tables, dual_chunk_decode,
    dual_chunk_explicit, dual_chunk_fused, score_scale,
)
from hf_posext.backends.attention.kernels import call_positions, fused_start
from hf_posext.backends.attention.registration import AttentionLayer, call_settings, plain_attention
from hf_posext.core.record import CONFIG_KEY, ScalingReport, make_record
from hf_posext.core.request import ScalingRequest
from hf_posext.methods.dual_chunk import (
    check_chunk_sizes,
    chunk_length,
    default_chunk_size,
    default_local_window,
    length_scale,
)

__all__ = [
    "METHOD_NAMES",
    "VLLM_CONFIG_KEY",
    "DualChunkSettings",
    "DualChunkLayerSettings",
    "resolve_settings",
    "vllm_config",
    "dual_chunk_explicit",
    "dual_chunk_fused",
    "dual_chunk_decode",
    "clear_decode_tables",
    "dual_chunk_attention",
    "is_patched",
    "current_settings",
    "patch_dual_chunk",
    "unpatch_dual_chunk",
    "describe_dual_chunk",
    "load_dual_chunk",
    "current_request",
    "record_from_vllm_config",
    "METHOD",
    "SCORE_BLOCK_ELEMENTS",
    "FUSED_QUERY_BLOCK",
    "DECODE_QUERIES",
]

#: Method names :func:`hf_posext.patch` routes here.
METHOD_NAMES = {"dca"}
#: The config field vLLM reads (Qwen2.5-1M checkpoints carry it): chunk_size, local_size,
#: original_max_position_embeddings.
VLLM_CONFIG_KEY = "dual_chunk_attention_config"
#: Registry names of our attention functions, keyed by the mask convention they expect.
IMPLEMENTATIONS = {"sdpa": "hf_posext_dca_sdpa", "eager": "hf_posext_dca_eager"}
_LAYER_ATTRIBUTE = "_hf_posext_dca"
_STATE_ATTRIBUTE = "_hf_posext_dca_state"
_LABEL = "Dual Chunk Attention"


@dataclass(frozen=True)
class DualChunkSettings:
    """A validated Dual Chunk Attention request.

    Attributes:
        chunk_size: c, the largest position index a query takes.
        local_window: w; the chunk length is ``c - w``.
        original_max_position_embeddings: L, the pre-training window.
        target_length: the window the model is declared to handle (DCA itself has no length limit).
        attention_scale: scores multiplied by ``length_scale(T, L) ** 2`` (SGLang's Qwen2.5-1M scale).
    """

    chunk_size: int
    local_window: int
    original_max_position_embeddings: int
    target_length: int
    attention_scale: bool = False

    @property
    def chunk_length(self) -> int:
        return chunk_length(self.chunk_size, self.local_window)

    @property
    def factor(self) -> float:
        return self.target_length / self.original_max_position_embeddings


def dual_chunk_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered in transformers' ``AttentionInterface`` (same signature as SDPA's).

    Layers DCA leaves alone (Gemma 3 sliding layers) and prefills that fit in one chunk run plain
    attention (transformers' own SDPA function on the SDPA path); decode steps (at most
    ``DECODE_QUERIES`` queries) run :func:`dual_chunk_decode`; prefills past one chunk run
    :func:`dual_chunk_fused` where it applies; everything else (eager prefill, logit cap, training
    dropout, per-row positions, learned attention sinks) runs :func:`dual_chunk_explicit`. Attention weights
    are not returned.
    """
    layer: DualChunkLayerSettings
    layer, scaling = call_settings(module, query, scaling, kwargs, attribute=_LAYER_ATTRIBUTE, title="Dual Chunk Attention", method="dca")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # sinks: the decode and written-out paths only
    q_len = query.shape[2]
    if layer.chunk_size is not None and q_len <= DECODE_QUERIES and not (dropout and module.training):
        return dual_chunk_decode(query, key, value, attention_mask, kwargs.get("position_ids"), layer, scaling, softcap, sinks), None
    query_positions, key_positions = call_positions(query, key, kwargs.get("position_ids"), _LABEL)
    plain = layer.chunk_size is None
    if not plain and q_len > DECODE_QUERIES:
        # A prefill: one host sync is cheap next to the work, and prompts inside one chunk stay bit for bit the
        # model's (prompts of at most DECODE_QUERIES tokens took the decode kernel above: equal values, not SDPA's bits).
        plain = int(query_positions.max()) < chunk_length(layer.chunk_size, layer.local_window)
    if plain and layer.mask_kind == "sdpa" and softcap is None and sinks is None:
        return plain_attention(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if not plain and q_len > DECODE_QUERIES and sinks is None:
        start = fused_start(layer.mask_kind, attention_mask, query_positions, softcap, dropout, module.training, (query, key, value))
        if start is not None:
            if layer.scale_length is not None:
                scaling = scaling * length_scale(start + q_len, layer.scale_length) ** 2
            return dual_chunk_fused(query, key, value, attention_mask, start, layer, scaling), None
    active = dataclasses.replace(layer, chunk_size=None) if plain else layer
    if not plain and layer.scale_length is not None:  # one scale per batch row (left padding: its own length)
        scaling = scaling * score_scale(query_positions[:, -1], layer.scale_length).view(-1, 1, 1, 1, 1)
    output = dual_chunk_explicit(
        query, key, value, attention_mask, query_positions, key_positions, active, scaling,
        softcap=softcap, dropout=dropout, training=module.training, sinks=sinks,
    )
    return output, None


# --------------------------------------------------------------------------------------------------
# patch / unpatch / describe / load
# --------------------------------------------------------------------------------------------------

def is_patched(model: nn.Module) -> bool:
    """True when ``model`` runs Dual Chunk Attention installed by :func:`patch_dual_chunk`."""
    return registration.is_patched(model, METHOD)


def current_settings(model: nn.Module) -> DualChunkSettings:
    """c, w, L and the target length of a model patched with DCA."""
    return registration.current_settings(model, METHOD)


def resolve_settings(
    factor: float | None, target_length: int | None, original_length: int, chunk_size: int | None, local_window: int | None,
    attention_scale: bool = False,
) -> DualChunkSettings:
    """Fill in the paper's defaults and validate (raises ValueError naming the bad value and the fix)."""
    from hf_posext.core.request import resolve_factor

    chunk_size = default_chunk_size(original_length) if chunk_size is None else chunk_size
    local_window = default_local_window(original_length) if local_window is None else local_window
    check_chunk_sizes(chunk_size, local_window, original_length)
    scale = resolve_factor(factor, target_length, original_length)
    target = target_length if target_length is not None else int(math.ceil(original_length * scale - 1e-9))
    return DualChunkSettings(chunk_size, local_window, original_length, target, bool(attention_scale))


def vllm_config(settings: DualChunkSettings) -> dict[str, int]:
    """The ``dual_chunk_attention_config`` vLLM (and Qwen2.5-1M's config.json) use for these settings.

    ``original_max_position_embeddings`` is written only with ``attention_scale``: SGLang's backend turns
    its length scale on exactly when that field is above 0 (docs/serving.md), so the field says whether the
    scores are scaled, for SGLang and for :func:`hf_posext.load` alike.
    """
    field = {"chunk_size": settings.chunk_size, "local_size": settings.local_window}
    if settings.attention_scale:
        field["original_max_position_embeddings"] = settings.original_max_position_embeddings
    return field


def _write_config(config, settings: DualChunkSettings, base: str, max_positions: int | None) -> None:
    """The record, vLLM's field, and ``max_position_embeddings`` raised to the target window (vLLM sizes its
    context from it: Qwen2.5-1M has 1010000 beside an original 262144); ``max_positions`` is its value
    before patching (kept in the record so that load can put it back)."""
    setattr(config, CONFIG_KEY, make_record(
        "attention", "dca", settings.factor, settings.original_max_position_embeddings,
        {"chunk_size": settings.chunk_size, "local_window": settings.local_window, "attention_scale": settings.attention_scale},
        attn_implementation=base,
        max_position_embeddings_before=max_positions,
    ))
    setattr(config, VLLM_CONFIG_KEY, vllm_config(settings))
    if max_positions is not None:
        config.max_position_embeddings = max(settings.target_length, max_positions)


def _layer(layer: AttentionLayer, mask_kind: str, settings: DualChunkSettings) -> DualChunkLayerSettings:
    return DualChunkLayerSettings(
        layer.inv_freq, layer.rotary_dim, layer.interleaved,
        settings.chunk_size if layer.scaled else None, settings.local_window if layer.scaled else None,
        mask_kind, layer.scaled, _scale_length(settings) if layer.scaled else None,
    )


def _scale_length(settings: DualChunkSettings) -> int | None:
    return settings.original_max_position_embeddings if settings.attention_scale else None


def current_request(model: nn.Module) -> ScalingRequest:
    """The request that re-creates the current DCA patch."""
    settings = current_settings(model)
    return ScalingRequest.from_kwargs(
        "dca", settings.factor, original_max_position_embeddings=settings.original_max_position_embeddings,
        chunk_size=settings.chunk_size, local_window=settings.local_window, attention_scale=settings.attention_scale,
    )


def patch_dual_chunk(model: nn.Module, request: ScalingRequest) -> nn.Module:
    """Install Dual Chunk Attention (use :func:`hf_posext.patch`, which routes here).

    Args:
        model: a RoPE causal LM whose attention uses transformers' attention registry (5.x models).
        request: method ``"dca"``; ``factor`` or ``target_length``: the window the model is declared to
            handle (DCA has no length limit of its own: this sets ``describe``'s current window and the
            saved ``max_position_embeddings``); ``original_max_position_embeddings`` to override L; params
            ``chunk_size`` (c, default 3L/4, at most L) and ``local_window`` (w, default L/16, below c);
            ``attention_scale`` (default False): scores times ``(0.1 ln(T / L) + 1) ** 2`` past L, T the
            sequence length, as SGLang serves Qwen2.5-1M (a save then writes
            ``original_max_position_embeddings`` into ``dual_chunk_attention_config``, which is what turns
            the scale on in SGLang; without it the field is left out).

    Returns:
        The same model. Patching again replaces the previous settings (never compounds).

    Raises:
        ValueError: chunk_size > L, local_window >= chunk_size, a bad factor, a model whose attention
            bypasses the registry or whose rotary embedding is dynamic. The model is unchanged in every case.

    Example:
        >>> hf_posext.patch(model, "dca", factor=4)                       # c = 3L/4, w = L/16
        >>> hf_posext.patch(model, "dca", target_length=32768, chunk_size=6144, local_window=512)
    """
    original = registration.original_length(model, METHOD, request)
    params = request.params_dict
    settings = resolve_settings(request.factor, request.target_length, original, params.get("chunk_size"), params.get("local_window"),
                                bool(params.get("attention_scale", False)))
    if is_patched(model):
        return registration.update(model, METHOD, settings, lambda layer: dataclasses.replace(
            layer, chunk_size=settings.chunk_size, local_window=settings.local_window,
            scale_length=_scale_length(settings)), _write_config)
    return registration.install(model, METHOD, settings, lambda layer, mask_kind: _layer(layer, mask_kind, settings), _write_config)


def unpatch_dual_chunk(model: nn.Module) -> nn.Module:
    """Remove Dual Chunk Attention: the original attention implementation and config fields, exactly.

    Raises:
        ValueError: the model is not patched with DCA.
    """
    return registration.uninstall(model, METHOD)


def describe_dual_chunk(model: nn.Module) -> ScalingReport:
    """A :class:`~hf_posext.core.record.ScalingReport` of kind ``"attention"`` for a DCA model."""
    settings = current_settings(model)
    notes = [
        f"chunks of {settings.chunk_length} tokens; every relative distance <= chunk_size = {settings.chunk_size} "
        f"(original window {settings.original_max_position_embeddings}); no length limit of its own",
        "cost: past one chunk, up to four fused attention calls per query block merged by log-sum-exp; a decode "
        "step rotates the new query once per chunk distance and reads the key cache as it is (see bench/dca_cost.py)",
        (f"scores times (0.1 ln(T / {settings.original_max_position_embeddings}) + 1)^2 past the original window, "
         "T the sequence length (SGLang's Qwen2.5-1M scale)") if settings.attention_scale else
        "no length scale (attention_scale=False, ChunkLlama's DCA)",
        f"saved config carries vLLM's {VLLM_CONFIG_KEY} (chunk_size, local_size"
        + (", original_max_position_embeddings: SGLang scales" if settings.attention_scale else "; no original_max_position_embeddings: SGLang does not scale") + ")",
    ]
    return registration.report(
        model, METHOD, settings.factor, settings.target_length,
        {"chunk_size": settings.chunk_size, "local_window": settings.local_window, "attention_scale": settings.attention_scale}, notes,
    )


def _saved_sizes(path: str, record: dict[str, Any], config: Any) -> tuple[int, int, int, bool]:
    """L, c, w and the length scale of a saved DCA model: vLLM's ``dual_chunk_attention_config`` (so an
    edit there is what loads; the scale is on when it holds ``original_max_position_embeddings`` > 0, as
    SGLang reads it), else the ``hf_posext`` record."""
    from hf_posext.core.errors import RecordError

    params = dict(record.get("params", {}))
    vllm = getattr(config, VLLM_CONFIG_KEY, None) or {}
    if not isinstance(vllm, dict):
        raise RecordError(f"{path}/config.json: {VLLM_CONFIG_KEY} must be an object, got {vllm!r}.")
    try:
        original = int(vllm.get("original_max_position_embeddings", record["original_max_position_embeddings"]))
        chunk_size = int(vllm.get("chunk_size", params["chunk_size"]))
        local_window = int(vllm.get("local_size", params["local_window"]))
    except (KeyError, TypeError, ValueError) as error:
        raise RecordError(
            f"{path}/config.json: a DCA record needs chunk_size and local_window (or {VLLM_CONFIG_KEY} with "
            f"chunk_size, local_size, original_max_position_embeddings); got {record!r}."
        ) from error
    if getattr(config, VLLM_CONFIG_KEY, None) is not None:
        attention_scale = _scale_on(vllm)
    else:
        attention_scale = bool(params.get("attention_scale", False))
    return original, chunk_size, local_window, attention_scale


def _scale_on(field: dict[str, Any]) -> bool:
    """SGLang's rule: the length scale is on when the field's ``original_max_position_embeddings`` is above 0."""
    value = field.get("original_max_position_embeddings", 0)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def record_from_vllm_config(config: Any, source: str) -> dict[str, Any] | None:
    """A DCA record for a config that carries only vLLM's ``dual_chunk_attention_config`` (Qwen2.5-1M
    checkpoints), so that :func:`hf_posext.load` applies DCA; None when the config has no such field.

    The sizes are the field's ``chunk_size`` and ``local_size``; the original window L its
    ``original_max_position_embeddings``, else the config's (top level or in its rope parameters), else
    ``max_position_embeddings``; the factor is ``max_position_embeddings / L`` (at least 1); the length
    scale (``attention_scale``) is on when the field holds ``original_max_position_embeddings`` > 0, as in
    SGLang, which serves Qwen2.5-1M that way.

    Raises:
        RecordError: the field is not an object, or its sizes are missing, not integers, or break DCA's
            rules (chunk_size <= L, local_size < chunk_size), naming ``source`` and the fix; raised before
            any weight is loaded.
    """
    from hf_posext.core.errors import RecordError

    field = getattr(config, VLLM_CONFIG_KEY, None)
    if field is None:
        return None
    where = f"{source}: {VLLM_CONFIG_KEY}"
    if not isinstance(field, dict):
        raise RecordError(f"{where} must be an object with chunk_size and local_size, got {field!r}.")
    chunk_size, local_size = _integer(field.get("chunk_size")), _integer(field.get("local_size"))
    if chunk_size is None or local_size is None:
        raise RecordError(f"{where} needs integer chunk_size and local_size (as Qwen2.5-1M writes them), got {field!r}.")
    max_positions = _integer(getattr(config, "max_position_embeddings", None))
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    candidates = (field.get("original_max_position_embeddings"), getattr(config, "original_max_position_embeddings", None),
                  rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None, max_positions)
    original = next((value for value in candidates if value is not None), None)
    if _integer(original) is None or original < 2:
        raise RecordError(f"{where}: original_max_position_embeddings must be an integer >= 2, got {original!r}.")
    try:
        check_chunk_sizes(chunk_size, local_size, original)
    except ValueError as error:
        raise RecordError(f"{where}: {error} Fix the field in config.json.") from error
    factor = max(1.0, (max_positions or original) / original)
    return make_record("attention", "dca", factor, original,
                       {"chunk_size": chunk_size, "local_window": local_size, "attention_scale": _scale_on(field)})


def load_dual_chunk(path: str, record: dict[str, Any], **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved with DCA and re-apply it.

    The sizes come from the config's ``dual_chunk_attention_config`` (vLLM's fields, so an edit there is
    what loads) and otherwise from the ``hf_posext`` record; the window from the record's ``factor``.
    """
    model, (original, chunk_size, local_window, attention_scale) = registration.load_unpatched(
        path, record, METHOD, lambda config: _saved_sizes(path, record, config), **from_pretrained_kwargs,
    )
    factor = float(record.get("factor") or 1.0)
    return patch_dual_chunk(model, ScalingRequest.from_kwargs(
        "dca", max(1.0, factor), original_max_position_embeddings=original, chunk_size=chunk_size, local_window=local_window,
        attention_scale=attention_scale,
    ))


#: How DCA plugs into transformers (see :mod:`hf_posext.backends.attention.registration`).
METHOD = registration.AttentionMethod(
    name="dca",
    label=_LABEL,
    attention=dual_chunk_attention,
    implementations=IMPLEMENTATIONS,
    layer_attribute=_LAYER_ATTRIBUTE,
    state_attribute=_STATE_ATTRIBUTE,
    config_keys=(VLLM_CONFIG_KEY, "max_position_embeddings"),
    scaled_word="chunked",
)
