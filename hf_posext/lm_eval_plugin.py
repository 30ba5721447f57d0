"""The ``hf-posext`` model for lm-evaluation-harness: any harness task on any scaled model.

Importing this module registers ``hf-posext`` with the harness. The class is a subclass of the
harness's own ``hf`` model (``lm_eval.models.huggingface.HFLM``) that patches the model right after
the harness creates it, so batching, ``max_length``, ``accelerate launch`` data parallelism,
``parallelize=True`` (``device_map``), PEFT adapters and the rest behave exactly as with ``hf``.
One addition: under ``accelerate launch`` on CPU (gloo) the requests are sharded across processes
too (the ``hf`` model shards only across GPUs, so every CPU process would repeat all the work).

Model arguments (``--model_args``), on top of every ``hf`` argument:

* ``posext_method``: a name from :func:`hf_posext.available_methods` (``none`` for the baseline).
* ``posext_factor`` or ``posext_target_length``: how far to scale (exactly one; ``none`` needs neither).
* ``posext_original_max_position_embeddings``: override the pre-training window read from the config.
* ``posext_<name>``: any parameter of the method, e.g. ``posext_beta_fast=32``.
* ``pretrained=smollm2-135m`` (or any embedded name in :data:`hf_posext.models.EMBEDDED_MODELS`) works.

Without ``posext_method`` the model is evaluated as saved; a folder written by
``save_pretrained`` after ``hf_posext.patch`` gets its scaling re-applied (as :func:`hf_posext.load`
would). Unknown ``posext_*`` arguments and unknown methods raise ``ValueError`` before anything loads.

When ``max_length`` is not given, the harness's context limit is the scaled window
(``describe(model).current_window``), not the config's ``max_position_embeddings``, which dynamic
methods leave at the original window.

Example:
    >>> import lm_eval, hf_posext.lm_eval_plugin  # registers "hf-posext"
    >>> lm_eval.simple_evaluate(model="hf-posext", tasks=["niah_single_1"],
    ...     model_args="pretrained=/path/to/model,posext_method=yarn,posext_factor=2",
    ...     metadata={"max_seq_lengths": [16384]})
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hf_posext
from hf_posext.methods import METHODS, Method, get_method
from hf_posext.models import resolve_model_path
from hf_posext.patching import CONFIG_KEY

__all__ = ["MODEL_NAME", "POSEXT_PREFIX", "PosextRequest", "parse_posext_args", "PosextHFLM"]

logger = logging.getLogger(__name__)

#: The name the model is registered under (``--model hf-posext``).
MODEL_NAME = "hf-posext"
#: Prefix of the model arguments this plugin consumes.
POSEXT_PREFIX = "posext_"
_SCALING_KEYS = ("method", "factor", "target_length", "original_max_position_embeddings")


def _coerce(value: Any) -> Any:
    """Read a text value the way the harness reads ``--model_args`` (numbers, booleans, JSON lists)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):  # as the harness reads it
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _find_method(name: Any) -> Method:
    """The registered method ``name`` of whichever position kind has it (the model decides later)."""
    errors = []
    for kind in METHODS:
        try:
            return get_method(name, kind)
        except ValueError as error:
            errors.append(str(error))
    raise ValueError(f"posext_method={name!r}: {errors[0]} (see `hf-posext methods`)")


@dataclass
class PosextRequest:
    """The scaling asked for through ``posext_*`` model arguments, validated without loading anything.

    Attributes:
        method: registered method name, or None for "evaluate the model as saved".
        factor: scale factor s >= 1, or None when ``target_length`` is given.
        target_length: window to reach, or None when ``factor`` is given.
        original_max_position_embeddings: override of the pre-training window, if any.
        params: the method's own parameters (``posext_<name>`` arguments).
    """

    method: str | None = None
    factor: float | None = None
    target_length: int | None = None
    original_max_position_embeddings: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method is None:
            given = [k for k in ("factor", "target_length", "original_max_position_embeddings") if getattr(self, k) is not None]
            given += list(self.params)
            if given:
                raise ValueError(
                    f"{', '.join(POSEXT_PREFIX + k for k in given)} given without posext_method. "
                    "Add posext_method=<name> (e.g. posext_method=yarn; `hf-posext methods` lists them)."
                )
            return
        spec = _find_method(self.method)
        self.method = spec.name
        if self.method == "none" and self.factor is None and self.target_length is None:
            self.factor = 1.0
        if (self.factor is None) == (self.target_length is None):
            raise ValueError(
                f"posext_method={self.method} needs exactly one of posext_factor (e.g. posext_factor=2) or "
                f"posext_target_length (e.g. posext_target_length=16384); got posext_factor={self.factor!r}, "
                f"posext_target_length={self.target_length!r}."
            )
        if self.factor is not None:
            if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor >= 1:
                raise ValueError(f"posext_factor must be a number >= 1, got {self.factor!r}.")
            self.factor = float(self.factor)
        for key in ("target_length", "original_max_position_embeddings"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{POSEXT_PREFIX}{key} must be a positive integer, got {value!r}.")
        try:
            spec.parse_params(dict(self.params))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{error} Pass method parameters as {POSEXT_PREFIX}<name>=<value>.") from error

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (recorded in the harness's results under ``config.posext_request``)."""
        return dict(self.__dict__)


def parse_posext_args(model_args: dict[str, Any]) -> tuple[PosextRequest, dict[str, Any]]:
    """Split harness model arguments into a validated :class:`PosextRequest` and the rest.

    Args:
        model_args: keyword arguments as the harness passes them (``posext_*`` keys are consumed).

    Returns:
        The request and the remaining arguments for the harness's ``hf`` model.

    Raises:
        ValueError: an unknown method, an unknown method parameter, a missing or doubled factor.
    """
    scaling: dict[str, Any] = {}
    params: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in model_args.items():
        if not key.startswith(POSEXT_PREFIX):
            rest[key] = value
            continue
        name = key[len(POSEXT_PREFIX):]
        if not name:
            raise ValueError(f"Model argument {key!r} names no parameter: use posext_<name>=<value>.")
        if name == "method":
            # The harness reads the text "none" as None: posext_method=none is the baseline method.
            scaling[name] = "none" if value is None else value
            continue
        (scaling if name in _SCALING_KEYS else params)[name] = _coerce(value)
    return PosextRequest(**scaling, params=params), rest


def _prefer_gloo_on_cpu() -> None:
    """Under a multi-process launch on a machine without accelerators, make accelerate use gloo.

    ``accelerate`` (1.x) sets up ``MULTI_CPU`` only when asked for the CPU; without it, processes started
    by ``accelerate launch --multi_gpu`` / ``torchrun`` on a CPU-only machine each see a world of one.
    """
    import os

    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    accelerator_api = getattr(torch, "accelerator", None)
    has_accelerator = accelerator_api.is_available() if accelerator_api is not None else torch.cuda.is_available()
    if not has_accelerator:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")


@register_model(MODEL_NAME)
class PosextHFLM(HFLM):
    """The harness's ``hf`` model with :func:`hf_posext.patch` applied when the model is created.

    Args:
        pretrained: hub name, local folder, embedded name (``smollm2-135m``) or a loaded model.
        **kwargs: ``posext_*`` arguments (see the module docstring) and any ``hf`` model argument.

    Attributes:
        posext_request: the validated scaling request.
        posext_report: ``hf_posext.describe(model)`` after patching, as a dict (also written to the
            results under ``config.posext``).
    """

    def __init__(self, pretrained: Any, **kwargs: Any) -> None:
        # Validate before the harness builds anything: a typo must not cost a model download.
        self.posext_request, rest = parse_posext_args(kwargs)
        self.posext_report: dict[str, Any] | None = None
        if isinstance(pretrained, str):
            pretrained = resolve_model_path(pretrained)
            if isinstance(rest.get("tokenizer"), str):
                rest["tokenizer"] = resolve_model_path(rest["tokenizer"])
        _prefer_gloo_on_cpu()
        super().__init__(pretrained=pretrained, **rest)
        if not isinstance(pretrained, str):
            # The harness skips model creation for an already-loaded model: patch it here.
            self._apply_posext()
        self._enable_cpu_data_parallel()

    def _enable_cpu_data_parallel(self) -> None:
        # The harness shards requests across `accelerate launch` processes only when it counts several
        # GPUs; on CPU (gloo) every process would evaluate everything. Shard there too: the evaluator's
        # gathers (accelerator.gather, torch.distributed.gather_object) work on gloo.
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None or accelerator.num_processes <= 1 or self._world_size > 1:
            return
        if self.device.type != "cpu":
            return
        self._rank = accelerator.process_index
        self._world_size = accelerator.num_processes
        logger.info("hf-posext: data parallel on CPU, process %d of %d", self._rank, self._world_size)

    def _create_model(self, pretrained: str, **kwargs: Any) -> None:
        super()._create_model(pretrained, **kwargs)
        self._apply_posext()

    def _patch_target(self):
        # A PEFT wrapper forwards to the base model; the rotary modules live there.
        model = self._model
        if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
            return model.get_base_model()
        return model

    def _apply_posext(self) -> None:
        model = self._patch_target()
        request = self.posext_request
        if request.method is not None:
            hf_posext.patch(
                model, request.method, request.factor, target_length=request.target_length,
                original_max_position_embeddings=request.original_max_position_embeddings, **request.params,
            )
        else:
            self._reapply_saved_scaling(model)
        report = hf_posext.describe(model)
        self.posext_report = report.to_dict()
        logger.info("hf-posext: evaluating a model scaled as follows:\n%s", report)

    @staticmethod
    def _reapply_saved_scaling(model) -> None:
        """Re-apply a scaling recorded by ``save_pretrained`` after ``hf_posext.patch`` (stock loading
        may have dropped it: methods transformers lacks are saved with the original RoPE fields)."""
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        record = getattr(text_config, CONFIG_KEY, None)
        if not isinstance(record, dict) or "method" not in record:
            return
        params = {k: v for k, v in (record.get("params") or {}).items() if v is not None}
        hf_posext.patch(
            model, record["method"], record["factor"],
            original_max_position_embeddings=record.get("original_max_position_embeddings"), **params,
        )

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        if self.posext_report is not None:
            # Dynamic methods keep max_position_embeddings at the original window; the harness would
            # otherwise truncate every context to it.
            return int(self.posext_report["current_window"])
        return super().max_length

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["posext"] = dict(self.posext_report or {}, hf_posext_version=hf_posext.__version__)
        info["posext_request"] = self.posext_request.to_dict()
        return info
