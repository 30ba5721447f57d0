"""Loading a model and its tokenizer for evaluation (a hub name, a local folder, or a tiny test model)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

__all__ = ["AUTO_DTYPE", "AsciiTokenizer", "auto_dtype_note", "check_device_name", "check_dtype_name", "cpu_has_native_bfloat16",
           "dtype_line", "evaluation_dtype", "is_tiny_model_name", "load_model_and_tokenizer", "resolve_dtype",
           "transformers_progress_bars"]

#: ``--dtype auto``: the dtype each evaluation task runs in where none is given (:func:`evaluation_dtype`).
AUTO_DTYPE = "auto"
#: Tasks scored by whether the answer is found, where bfloat16 may replace float32 on a CPU that has it natively.
RETRIEVAL_TASKS = ("passkey", "needle", "ruler")


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively (AVX-512 BF16 or AMX, through oneDNN)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def evaluation_dtype(dtype: str, task: str, device: str | torch.device | None) -> str:
    """The dtype ``task`` runs in: ``dtype`` itself unless it is ``"auto"``.

    ``auto`` is float32, except retrieval (passkey, needle, RULER) on a CPU with native bfloat16, which runs
    in bfloat16: there a 16384-token trial of SmolLM2-135M takes 0.41x float32's time with the same answers
    on the paired trials measured (``bench/results/cpu_retrieval_dtype/``). Perplexity stays float32: its
    differences between methods can be smaller than bfloat16's rounding. Accelerators keep float32 (pass
    ``--dtype bfloat16`` there: it is the usual choice, but it was not measured against float32 here).
    """
    if dtype != AUTO_DTYPE:
        return dtype
    on_cpu = device is not None and torch.device(device).type == "cpu"
    return "bfloat16" if task in RETRIEVAL_TASKS and on_cpu and cpu_has_native_bfloat16() else "float32"


def auto_dtype_note(tasks: Sequence[str], device: str | torch.device | None) -> str:
    """One line saying what ``--dtype auto`` chose for ``tasks`` on ``device``, and why (printed before a run)."""
    chosen: dict[str, list[str]] = {}
    for task in dict.fromkeys(tasks):
        chosen.setdefault(evaluation_dtype(AUTO_DTYPE, task, device), []).append(task)
    parts = "; ".join(f"{dtype} for {', '.join(names)}" for dtype, names in chosen.items())
    retrieval = any(task in RETRIEVAL_TASKS for task in tasks)
    on_cpu = device is not None and torch.device(device).type == "cpu"
    if retrieval and on_cpu and cpu_has_native_bfloat16():
        why = "this CPU runs bfloat16 natively: retrieval in bfloat16, perplexity in float32"
    elif retrieval and on_cpu:
        why = "this CPU has no native bfloat16 (no AVX-512 BF16 or AMX), where bfloat16 is slower than float32"
    elif retrieval:
        why = "float32 off the CPU; pass --dtype bfloat16 to choose it"
    else:
        why = "perplexity stays float32"
    return f"--dtype auto: {parts} ({why})"


def native_bfloat16_feature() -> str:
    """The name of the CPU feature that runs bfloat16 natively (``AMX-BF16``, ``AVX-512 BF16``), as Linux lists it;
    ``native bfloat16`` where the flags cannot be read."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return "native bfloat16"
    if "amx_bf16" in flags:
        return "AMX-BF16"
    return "AVX-512 BF16" if "avx512_bf16" in flags else "native bfloat16"


def resolve_dtype(dtype: str, tasks: str | Sequence[str], device: str | torch.device | None) -> tuple[str, str]:
    """The dtype an evaluation of ``tasks`` runs in under ``--dtype dtype`` on ``device``, and why, in words.

    The one resolution every command that takes ``--dtype`` prints (:func:`dtype_line`), so that a figure can be
    matched with the dtype it was computed in. Several tasks that run in different dtypes give
    ``"float32 for perplexity; bfloat16 for passkey"``.

    Returns:
        ``(dtype, reason)``, e.g. ``("bfloat16", "auto: this CPU has AMX-BF16, where passkey runs in 0.41x ...")``.
    """
    names = [tasks] if isinstance(tasks, str) else list(dict.fromkeys(tasks))
    if dtype != AUTO_DTYPE:
        return dtype, f"--dtype {dtype}, as given"
    chosen: dict[str, list[str]] = {}
    for task in names:
        chosen.setdefault(evaluation_dtype(AUTO_DTYPE, task, device), []).append(task)
    text = next(iter(chosen)) if len(chosen) <= 1 else "; ".join(f"{d} for {', '.join(t)}" for d, t in chosen.items())
    retrieval = [task for task in names if task in RETRIEVAL_TASKS]
    on_cpu = device is not None and torch.device(device).type == "cpu"
    if retrieval and on_cpu and "bfloat16" in chosen:
        why = (f"auto: this CPU has {native_bfloat16_feature()}, where retrieval took 0.41x float32's time with the same "
               "answers; pass --dtype float32 to match float32 figures, such as the README's")
    elif retrieval and on_cpu:
        why = "auto: this CPU has no native bfloat16 (AVX-512 BF16 or AMX), where bfloat16 is slower than float32"
    elif retrieval:
        why = "auto: float32 off the CPU; pass --dtype bfloat16 to choose it"
    elif "perplexity" in names:
        why = "auto: perplexity stays float32, its differences between methods can be smaller than bfloat16's rounding"
    else:
        why = "auto: float32; bfloat16 is chosen only for retrieval on a CPU that runs it natively"
    return text or "float32", why


def dtype_line(dtype: str, reason: str) -> str:
    """The line a command prints first about its dtype: ``dtype: bfloat16 (auto: this CPU has AMX-BF16, ...)``."""
    return f"dtype: {dtype} ({reason})"


class AsciiTokenizer:
    """A character tokenizer for the 128-token tiny test models (``hf_posext.models.tiny_model``).

    Token id = the character's code point for ASCII text; any other character becomes ``?``. It has no
    special tokens. Real models use their own tokenizer; this one only makes tiny-model runs possible.
    """

    bos_token_id = None
    eos_token_id = None
    vocab_size = 128

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) if ord(c) < 128 else ord("?") for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(int(i)) for i in ids)


def check_dtype_name(dtype: str) -> str:
    """``dtype`` as given, once it is ``auto`` or a floating dtype torch has; else one line naming the choices
    (for commands that load their models late, so that a typo is refused before anything is loaded or written).

    Raises:
        ValueError: not ``auto`` nor a floating-point dtype name.
    """
    if dtype == AUTO_DTYPE:
        return dtype
    try:
        floating = _dtype(dtype).is_floating_point
    except ValueError:
        floating = False
    if not floating:
        raise ValueError(f"Unknown dtype {dtype!r}; use {AUTO_DTYPE} (the default), float32, bfloat16 or float16.")
    return dtype


def check_device_name(device: str) -> str:
    """``device`` as given, once it names a device this torch can use; else one line saying what to pass.

    Raises:
        ValueError: not a device name, or CUDA asked for where this torch has none.
    """
    try:
        value = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device} is not a device name; use cpu, cuda, cuda:1 or mps.") from None
    if value.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here (torch {torch.__version__}); use --device cpu.")
    return device


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}
    name = aliases.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use {AUTO_DTYPE} (the default), float32, bfloat16 or float16.")
    return value


def is_tiny_model_name(name: str) -> bool:
    """Whether ``name`` asks for the tiny random test model (``tiny``, ``tiny:FAMILY``, ``tiny:FAMILY:WINDOW``)."""
    return name == "tiny" or name.startswith("tiny:")


def load_model_and_tokenizer(
    name: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    device_map: str | None = None,
    attn_implementation: str | None = None,
    adapter: str | None = None,
):
    """Load a causal LM and its tokenizer for evaluation.

    Args:
        name: a hub name, a local folder, ``"smollm2-135m"``, or ``"tiny"`` / ``"tiny:FAMILY"`` / ``"tiny:FAMILY:WINDOW"`` (a tiny
            random model from :func:`hf_posext.models.tiny_model` with :class:`AsciiTokenizer`, for
            smoke tests).
        dtype: weights dtype.
        device: where to put the model (ignored with ``device_map``).
        device_map: e.g. ``"auto"`` to spread a model too big for one device.
        attn_implementation: e.g. ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``.
        adapter: a LoRA adapter folder written by the recipes: its files checked against its manifest and its
            record against ``name`` (:func:`hf_posext.adapters.check_adapter`) before anything loads, the base's
            weights against the recorded fingerprint once it loads, then applied with its recorded scaling and
            merged (:func:`hf_posext.adapters.load_adapted_model`).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        FileNotFoundError, ValueError, DamagedFileError: a missing folder, a folder that is not a causal LM,
            a truncated weights file, a missing or damaged tokenizer, a damaged or altered adapter file
            (:class:`hf_posext.adapters.AdapterFileError`), an adapter for another base or scaling. All of these
            are found before the weights are loaded: the adapter and the folder are checked, then the tokenizer
            loaded, and only then the model.
    """
    from hf_posext.core.loading import check_causal_lm_folder
    from hf_posext.models import load_model, load_tokenizer, resolve_model_path, tiny_model

    if adapter:
        from hf_posext.adapters import check_adapter

        check_adapter(adapter, name)  # the base and scaling it was trained on, before anything loads
    if is_tiny_model_name(name):
        _, family, window = (name.split(":") + ["", ""])[:3]
        overrides = {}
        if window:
            if not window.isdigit():
                raise ValueError(f"Bad tiny model spec {name!r}: use tiny, tiny:FAMILY or tiny:FAMILY:WINDOW (e.g. tiny:llama:512).")
            overrides["n_positions" if family == "gptj" else "max_position_embeddings"] = int(window)
        model = tiny_model(family or "llama", **overrides).to(_dtype(dtype))
        if device:
            model.to(device)
        return model, AsciiTokenizer()
    kwargs: dict[str, Any] = {}
    if device_map:
        kwargs["device_map"] = device_map
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    torch_dtype = _dtype(dtype)
    check_causal_lm_folder(resolve_model_path(name), name, kwargs)  # a T5 folder is named as such, not as tokenizer-less
    tokenizer = load_tokenizer(name)  # a bad tokenizer must not cost a model load
    if adapter:
        from hf_posext.adapters import load_adapted_model

        return load_adapted_model(name, adapter, dtype=torch_dtype, device=device, **kwargs), tokenizer
    return load_model(name, dtype=torch_dtype, device=device, **kwargs), tokenizer


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars (loading weights) off inside the block when not ``enabled``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()
