"""The ``hf-posext`` model for lm-evaluation-harness: any harness task on any scaled model.

Importing this module registers ``hf-posext`` with the harness. The class is a subclass of the
harness's own ``hf`` model (``lm_eval.models.huggingface.HFLM``) that patches the model right after
the harness creates it, so batching, ``max_length``, ``accelerate launch`` data parallelism,
``parallelize=True`` (``device_map``), PEFT adapters and the rest behave exactly as with ``hf``.
One addition: under ``accelerate launch`` on CPU (gloo) the requests are sharded across processes
too (the ``hf`` model shards only across GPUs, so every CPU process would repeat all the work).

Model arguments (``--model_args``), on top of every ``hf`` argument:

* ``posext=REQUEST``: the scaling request in the request grammar (:mod:`hf_posext.core.grammar`), e.g.
  ``posext=yarn:factor=4``, ``posext=yarn:factor=4:beta_fast=16``, ``posext=none`` for the baseline. Its ``:``
  separators survive the harness's comma-separated model arguments.
* ``pretrained=smollm2-135m`` (or any embedded name in :data:`hf_posext.models.EMBEDDED_MODELS`) works.
* Deprecated (one release, with a warning naming the new form): ``posext_method``, ``posext_factor``,
  ``posext_target_length``, ``posext_original_max_position_embeddings`` and ``posext_<parameter>``.

Without ``posext`` the model is evaluated as saved; a folder written by
``save_pretrained`` after ``hf_posext.patch`` gets its scaling re-applied (as :func:`hf_posext.load`
would). Unknown parameters and unknown methods raise ``ValueError`` before anything loads.

``peft=ADAPTER`` with an adapter written by hf-posext's recipes (it holds ``posext_adapter.json``) is checked
as :func:`hf_posext.adapters.load_adapted_model` checks it: its files against their manifest and its base
model and scaling before anything loads, the base's weights once loaded. Without ``posext`` the
adapter's recorded scaling is applied; a ``posext`` request without a factor takes the adapter's factor (as
``hf-posext eval --adapter`` does: ``posext=yarn+string`` on a yarn x4 adapter is yarn+string x4); a scaling other
than the recorded one is refused, with the fix in this spelling (``posext=yarn:factor=4``). Its trained norms/embeddings are loaded with it. Any other PEFT adapter is loaded as the ``hf`` model loads it.

When ``max_length`` is not given, the harness's context limit is the scaled window
(``describe(model).current_window``), not the config's ``max_position_embeddings``, which dynamic
methods leave at the original window. For the same reason transformers' "friendly reminder - the current text
generation call has exceeded the model's predefined maximum length" is dropped for a generation that fits the
scaled window (it would be false there); past the scaled window it is shown.

Example:
    >>> import lm_eval, hf_posext.integrations.lm_eval.model  # registers "hf-posext"
    >>> lm_eval.simple_evaluate(model="hf-posext", tasks=["niah_single_1"],
    ...     model_args="pretrained=/path/to/model,posext=yarn:factor=2",
    ...     metadata={"max_seq_lengths": [16384]})
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from hf_posext.api import describe, load, patch, patched_backend, read_record
from hf_posext.core.grammar import MODEL_ARGUMENT, format_request, parse_request
from hf_posext.core.loading import check_tokenizer_files
from hf_posext.core.record import CONFIG_KEY
from hf_posext.core.request import MODEL_ARGS_PREFIX, ScalingRequest
from hf_posext.core.version import VERSION
from hf_posext.models import resolve_model_path
from hf_posext.user_warnings import warn_at_caller

__all__ = ["MODEL_NAME", "POSEXT_PREFIX", "POSEXT_ARGUMENT", "parse_posext_args", "PosextHFLM"]

logger = logging.getLogger(__name__)

#: The name the model is registered under (``--model hf-posext``).
MODEL_NAME = "hf-posext"
#: Prefix of the model arguments this plugin consumes.
POSEXT_PREFIX = MODEL_ARGS_PREFIX
#: The model argument holding the whole request in the request grammar (``posext=yarn:factor=4``).
POSEXT_ARGUMENT = MODEL_ARGUMENT


def parse_posext_args(model_args: dict[str, Any], *, sized: bool = True) -> tuple[ScalingRequest | None, dict[str, Any]]:
    """Split harness model arguments into a validated :class:`~hf_posext.core.request.ScalingRequest` (None when
    no request is given) and the rest.

    With ``sized=False`` a request without a factor is returned as it is (an hf-posext adapter gives it the factor
    it was trained with); by default it is refused unless the method needs none.

    The request is one argument in the request grammar (:mod:`hf_posext.core.grammar`), whose ``:`` separators
    survive the harness's comma-separated model arguments: ``posext=yarn:factor=4:beta_fast=16``. The older
    ``posext_method=yarn,posext_factor=4`` (:meth:`ScalingRequest.from_model_args`) still works for one release,
    with a deprecation line naming the new form.

    Raises:
        ValueError: an unknown method, an unknown method parameter, a missing or doubled factor, both spellings.
    """
    if POSEXT_ARGUMENT in model_args:
        old = sorted(key for key in model_args if key.startswith(POSEXT_PREFIX))
        if old:
            raise ValueError(f"{POSEXT_ARGUMENT}= carries the whole request: leave out {', '.join(old)} "
                             f"(write e.g. {POSEXT_ARGUMENT}=yarn:factor=4:beta_fast=16).")
        text = model_args[POSEXT_ARGUMENT]
        rest = {key: value for key, value in model_args.items() if key != POSEXT_ARGUMENT}
        request = parse_request("none" if text is None else str(text), where=f"{POSEXT_ARGUMENT}=")
        return (_sized(request, text) if sized else request), rest
    request, rest = ScalingRequest.from_model_args(model_args, sized=sized)
    if request is not None:
        warn_at_caller(f"{POSEXT_PREFIX}method=... is deprecated and will be removed: write "
                       f"{POSEXT_ARGUMENT}={format_request(request)} (one model argument).", FutureWarning)
    return request, rest


#: Where the fix of an adapter mismatch starts in :func:`hf_posext.adapters.check_adapter`'s message (it names
#: ``hf-posext eval`` flags, which lm-eval does not take).
_EVAL_FIX = ": evaluate it "
#: The same for another base model (``pass --model BASE``).
_EVAL_BASE_FIX = ": pass --model "


def _with_lm_eval_fix(message: str, record: Any) -> str:
    """An adapter-mismatch ``message`` with its fix in lm-eval's spelling (``posext=yarn:factor=4``)."""
    head = message.split(_EVAL_FIX, 1)[0] if _EVAL_FIX in message else message.rstrip(".")
    trained = f"{record.method}:factor={record.factor:g}"
    return (f"{head}: pass {POSEXT_ARGUMENT}={trained} (or leave {POSEXT_ARGUMENT}= out to take the adapter's; an "
            f"attention-level method may be stacked on it without a factor: {POSEXT_ARGUMENT}={record.method}+string), "
            "or train an adapter for that scaling.")


def _sized(request: ScalingRequest, text: Any) -> ScalingRequest:
    """``request.require_size()``, its refusal naming the model argument as given (``posext= 'yarn+string': ...``)."""
    try:
        return request.require_size()
    except ValueError as error:
        raise ValueError(f"{POSEXT_ARGUMENT}= {str(text)!r}: {error}") from None


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


def _saved_record(pretrained: Any) -> dict[str, Any] | None:
    """The validated hf_posext record saved in the folder ``pretrained``, if any (config only, no weights)."""
    if not isinstance(pretrained, str):
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(pretrained)
    except (OSError, ValueError):
        return None  # the harness's own loader reports a missing or unreadable model
    return read_record(pretrained, config)


#: transformers' logger and the start of its warning for a generation past ``config.max_position_embeddings``.
_REMINDER_LOGGER = "transformers.generation.stopping_criteria"
_REMINDER = "This is a friendly reminder - the current text generation call has exceeded the model's predefined"


class _DropWindowReminder(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_REMINDER)


@contextlib.contextmanager
def _without_window_reminder() -> Iterator[None]:
    """transformers' reminder dropped for the block. It is a ``warning_once``: once dropped, a later generation past
    the same declared window in this process does not show it either (the harness's own generations stop at
    ``max_length``, the scaled window by default). A reworded reminder is shown, not dropped."""
    reminder_logger = logging.getLogger(_REMINDER_LOGGER)
    dropping = _DropWindowReminder()
    reminder_logger.addFilter(dropping)
    try:
        yield
    finally:
        reminder_logger.removeFilter(dropping)


class _LoadWithHfPosext:
    """Stands in for the harness's ``AUTO_MODEL_CLASS``: ``from_pretrained`` is :func:`hf_posext.load`."""

    @staticmethod
    def from_pretrained(path: str, **kwargs: Any):
        return load(path, **kwargs)


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
        request, rest = parse_posext_args(kwargs, sized=False)
        self.posext_request = request
        self.posext_report: dict[str, Any] | None = None
        self.posext_adapter: str | None = None
        if isinstance(pretrained, str) and isinstance(rest.get("peft"), str):
            self._check_posext_adapter(pretrained, rest["peft"])
        if self.posext_adapter is None and request is not None:
            # without an hf-posext adapter to take it from, a request must carry its size (posext=none needs none)
            self.posext_request = (_sized(request, kwargs[POSEXT_ARGUMENT]) if POSEXT_ARGUMENT in kwargs else
                                   request.require_size(prefix=POSEXT_PREFIX))
        if isinstance(pretrained, str):
            pretrained = resolve_model_path(pretrained)
            if isinstance(rest.get("tokenizer"), str):
                rest["tokenizer"] = resolve_model_path(rest["tokenizer"])
            if not rest.get("tokenizer") and not rest.get("gguf_file"):
                check_tokenizer_files(pretrained)  # a folder without a usable tokenizer, named in one line
            elif isinstance(rest.get("tokenizer"), str):
                check_tokenizer_files(rest["tokenizer"])
        _prefer_gloo_on_cpu()
        super().__init__(pretrained=pretrained, **rest)
        if not isinstance(pretrained, str):
            # The harness skips model creation for an already-loaded model: patch it here.
            self._apply_posext()
        self._enable_cpu_data_parallel()

    def _check_posext_adapter(self, pretrained: str, folder: str) -> None:
        """For an adapter written by hf-posext's recipes: check it (files, base, scaling) and take its scaling."""
        import os

        from hf_posext.adapters import ADAPTER_RECORD, AdapterMismatchError, check_adapter

        if not os.path.isfile(os.path.join(folder, ADAPTER_RECORD)):
            return  # another PEFT adapter: the harness loads it as usual
        request = self.posext_request
        try:
            record = check_adapter(folder, pretrained)  # its files and its base, before any scaling is compared
        except AdapterMismatchError as error:  # another base: the fix in lm-eval's spelling
            raise AdapterMismatchError(str(error).replace(_EVAL_BASE_FIX, ": pass pretrained=")) from None
        if request is None:
            self.posext_request = ScalingRequest.from_kwargs(record.method, record.factor, **record.params)
        else:
            if request.factor is None and request.target_length is None and not request.sizes_itself():
                # posext=yarn+string without a factor: the factor the adapter was trained with (as eval --adapter)
                request = dataclasses.replace(request, factor=record.factor)
            try:
                check_adapter(folder, pretrained, request.method, request.factor, request.params_dict,
                              target_length=request.target_length, original_window=request.original_max_position_embeddings,
                              verify=False)
            except AdapterMismatchError as error:
                raise AdapterMismatchError(_with_lm_eval_fix(str(error), record)) from None
            self.posext_request = request.require_size()
        self.posext_adapter = folder

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
        if self.posext_adapter is not None:
            # An hf-posext adapter: the base loads plainly, its weights are checked, then the adapter (with its
            # trained norms/embeddings) is applied and merged, as load_adapted_model does (the harness ties the
            # weights of the model it gets: PEFT's wrapper of a tied, trained embedding does not survive that),
            # and the scaling is applied below.
            from hf_posext.adapters import apply_adapter, check_base_weights

            kwargs["peft"] = None
            super()._create_model(pretrained, **kwargs)
            check_base_weights(self.posext_adapter, self._model, str(pretrained))
            self._model = apply_adapter(self._model, self.posext_adapter).merge_and_unload()
            self._apply_posext()
            return
        if self.posext_request is None and _saved_record(pretrained) is not None:
            # A folder saved after hf_posext.patch: load it exactly as hf_posext.load does (same backend,
            # same recorded attention implementation), with the harness's own loading arguments.
            auto_class = self.AUTO_MODEL_CLASS
            self.AUTO_MODEL_CLASS = _LoadWithHfPosext
            try:
                super()._create_model(pretrained, **kwargs)
            finally:
                self.AUTO_MODEL_CLASS = auto_class
        else:
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
        if request is not None:
            patch(model, **request.patch_kwargs())
        elif patched_backend(model) is None and getattr(model.config, CONFIG_KEY, None) is not None:
            logger.warning(
                "hf-posext: the model passed in carries a saved hf_posext scaling but is not patched; load it with "
                "hf_posext.load(path) (or pass its folder as pretrained=) to evaluate it scaled."
            )
        report = describe(model)
        self.posext_report = report.to_dict()
        logger.info("hf-posext: evaluating a model scaled as follows:\n%s", report)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        window = int(self.posext_report["current_window"]) if self.posext_report is not None else None
        declared = getattr(self._patch_target().config, "max_position_embeddings", None)
        if window is None or not isinstance(declared, int) or not declared < max_length <= window:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        with _without_window_reminder():  # inside the scaled window, past the declared one (dynamic methods)
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

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
        info["posext"] = dict(self.posext_report or {}, hf_posext_version=VERSION)
        info["posext_request"] = self.posext_request.to_dict() if self.posext_request is not None else None
        return info
