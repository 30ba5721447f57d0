"""The machinery every evaluation shares: models, methods, processes, results on disk, the grid loop.

One run evaluates one model under several scaling methods side by side: the model is loaded once and
patched with each method in turn (``"none"`` is the unpatched baseline), so every method sees exactly the
same weights, text, passkeys and seeds.

Work is a grid of *cells* (method x length x ...); each cell is made of *units* (perplexity windows,
passkey trials). Under ``accelerate launch --num_processes N`` (or ``torchrun``) the pending units of a
(method, length) step are split round-robin across processes, evaluated, and gathered to every process,
so the numbers do not depend on N (with ``batch_size=1``). After each step the main process writes the
cell records to one JSON file per run (plus a CSV), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import datetime as _datetime
import hashlib
import json
import math
import os
import platform
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from hf_posext.api import describe, fixed_length, patch, unpatch
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingRequest
from hf_posext.core.version import VERSION
from hf_posext.evaluation.fingerprints import attention_function
from hf_posext.lm.distributed import Distributed
from hf_posext.lm.scoring import base_model, head_logits
from hf_posext.methods import check_method_name

__all__ = [
    "AsciiTokenizer",
    "Distributed",
    "MethodRequest",
    "ResultStore",
    "Unit",
    "Cell",
    "load_model_and_tokenizer",
    "parse_methods",
    "parse_lengths",
    "parse_floats",
    "resolve_factor_for",
    "apply_method",
    "run_grid",
    "rope_fingerprint",
    "rope_frequencies",
    "same_frequencies",
    "base_model",
    "head_logits",
    "versions",
]


# --------------------------------------------------------------------------------------------------
# Models and tokenizers
# --------------------------------------------------------------------------------------------------


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


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}
    name = aliases.get(dtype, dtype)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use float32, bfloat16 or float16.")
    return value


def load_model_and_tokenizer(
    name: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    device_map: str | None = None,
    attn_implementation: str | None = None,
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

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    from hf_posext.models import load_model, load_tokenizer, tiny_model

    if name == "tiny" or name.startswith("tiny:"):
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
    model = load_model(name, dtype=_dtype(dtype), device=device, **kwargs)
    return model, load_tokenizer(name)


def versions() -> dict[str, str]:
    """Versions of the software that produced a result."""
    import accelerate
    import transformers

    return {
        "hf_posext": VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
    }


# --------------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------------


def MethodRequest(name: str, factor: float | None = None, params: tuple[tuple[str, Any], ...] = ()) -> ScalingRequest:  # noqa: N802
    """A method to evaluate: a :class:`ScalingRequest` whose factor may be left to the grid (None: chosen
    from the lengths). Kept under this name for the evaluation code that builds requests by hand."""
    return ScalingRequest(name, factor, params=params)


def parse_methods(text: str | Sequence[str], params: dict[str, Any] | None = None) -> list[ScalingRequest]:
    """``"none,yarn,dynamic-yarn"`` -> scaling requests; each name and the parameters are validated.

    Args:
        text: comma-separated method names (any kind: ``self-extend`` too).
        params: method parameters given to every method but ``none``.

    Raises:
        ValueError: an empty list, an unknown method (with the known ones), a parameter a method lacks.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if not names:
        raise ValueError("No method given: pass e.g. --methods none,yarn,dynamic-yarn.")
    requests = []
    for name in names:
        method = check_method_name(name)
        method_params = tuple((params or {}).items()) if method != "none" else ()
        requests.append(ScalingRequest(method, params=method_params))
    return requests


def parse_lengths(text: str | Sequence[int]) -> list[int]:
    """``"2048,4096"`` (or ``"4k,8k"``) -> sorted unique positive ints."""
    items = text.split(",") if isinstance(text, str) else list(text)
    lengths = []
    for item in items:
        item = str(item).strip().lower()
        if not item:
            continue
        multiplier = 1024 if item.endswith("k") else 1
        try:
            number = float(item.rstrip("k")) * multiplier
            if not math.isfinite(number) or number != int(number):
                raise ValueError(item)
            value = int(number)
        except ValueError as error:
            raise ValueError(f"Bad length {item!r}: lengths are whole token counts such as 4096 or 4k.") from error
        if value < 2:
            raise ValueError(f"Length {value} is too short: a length is a number of tokens >= 2.")
        lengths.append(value)
    if not lengths:
        raise ValueError("No length given: pass e.g. --lengths 2048,4096,8192.")
    return sorted(set(lengths))


def parse_floats(text: str | Sequence[float], name: str, low: float = 0.0, high: float = 1.0) -> list[float]:
    """``"0,0.5,1"`` -> floats within [low, high]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    values = []
    for item in items:
        if str(item).strip() == "":
            continue
        try:
            value = float(item)
        except ValueError as error:
            raise ValueError(f"Bad {name} {item!r}: expected numbers such as 0,0.5,1.") from error
        if not low <= value <= high:
            raise ValueError(f"{name} {value} is outside [{low}, {high}].")
        values.append(value)
    if not values:
        raise ValueError(f"No {name} given.")
    return values


def resolve_factor_for(method: MethodRequest, factor: float | None, lengths: Sequence[int], original_window: int) -> float:
    """The factor a method runs with: 1 for ``none``, else ``factor``, else longest length / window (>= 1)."""
    if method.method == "none":
        return 1.0
    if method.factor is not None:
        return float(method.factor)
    if factor is not None:
        return float(factor)
    return max(1.0, max(lengths) / original_window)


@contextlib.contextmanager
def apply_method(model: torch.nn.Module, method: MethodRequest, factor: float) -> Iterator[ScalingReport]:
    """Patch ``model`` with ``method`` for the block, then restore it exactly; yields the scaling report."""
    patch(model, method.method, factor, **method.params_dict)
    try:
        yield describe(model)
    finally:
        unpatch(model)


def check_length(report: ScalingReport, length: int, method_label: str) -> str | None:
    """Warn (never fail) when ``length`` exceeds what the method and factor claim to support."""
    if report.dynamic or length <= report.current_window:
        return None
    message = (
        f"{method_label} x{report.factor:g} supports {report.current_window} tokens; evaluating {length} "
        "anyway (that is the experiment: expect degraded numbers)."
    )
    warnings.warn(message, stacklevel=2)
    return message


def rope_fingerprint(model: torch.nn.Module, length: int) -> str | None:
    """A hash of the rotary frequencies the model uses for ``length`` tokens (None if not a RoPE model).

    Two methods with the same fingerprint compute the same function at this length (e.g. dynamic YaRN
    equals the unpatched model inside the original window, and static YaRN with s = length / window at
    ``length``): the grid then reuses the result instead of recomputing it, and records that it did.
    The hash is exact, so it is for comparisons on one machine; across machines compare
    :func:`rope_frequencies` with :func:`same_frequencies`.
    """
    return _hash_frequencies(rope_frequencies(model, length))


def _hash_frequencies(frequencies: list[dict[str, Any]] | None) -> str | None:
    if frequencies is None:
        return None
    return hashlib.sha1(json.dumps(frequencies, sort_keys=True).encode()).hexdigest()


def rope_frequencies(model: torch.nn.Module, length: int) -> list[dict[str, Any]] | None:
    """The inverse frequencies and attention factor of every rotary module for ``length`` tokens.

    What a stored cell is checked against when it is read back (see :func:`run_grid`). Frequencies,
    not the cos/sin tables: a GPU, or a CPU with other vector instructions, rounds the trigonometry
    differently in the last bit, while the frequencies are computed before any trigonometry, on the
    CPU, so two machines agree on them to a float32 rounding. :func:`same_frequencies` compares them
    with a tolerance far below what any change of method or factors makes. None if the model has no RoPE.
    """
    from hf_posext.backends.rope.module import ScaledRotaryEmbedding

    try:
        if describe(model).kind not in ("rope", "attention"):  # an attention-level method keeps the model's RoPE
            return None
    except Exception:
        return None
    entries: list[dict[str, Any]] = []
    with fixed_length(model, length):
        for name, module in model.named_modules():
            if isinstance(module, ScaledRotaryEmbedding):
                for layer_type in module.entries:
                    inv_freq, attention = module.frequencies(length, layer_type, device="cpu")
                    entries.append({"module": name, "layer_type": layer_type, "inv_freq": inv_freq.float().tolist(),
                                    "attention": float(attention)})
            elif type(module).__name__.endswith("RotaryEmbedding"):
                buffer = next(module.buffers(), None)
                device = buffer.device if buffer is not None else "cpu"
                try:  # a dynamic rope type updates its buffers for the length on a forward
                    module(torch.zeros(1, dtype=torch.float32, device=device), torch.arange(length, device=device)[None])
                except Exception:
                    pass  # another forward signature (e.g. per layer type): static buffers are read as they are
                for buffer_name, tensor in module.named_buffers(recurse=False):
                    if not buffer_name.endswith("inv_freq") or "original" in buffer_name:
                        continue
                    # transformers names them inv_freq, or {layer_type}_inv_freq with several layer types
                    layer_type = None if buffer_name == "inv_freq" else buffer_name[: -len("_inv_freq")]
                    scaling = getattr(module, f"{layer_type}_attention_scaling", None) if layer_type else None
                    if scaling is None:
                        scaling = getattr(module, "attention_scaling", 1.0)
                    if isinstance(scaling, dict):
                        scaling = scaling.get(layer_type, 1.0)
                    entries.append({"module": name, "layer_type": layer_type, "inv_freq": tensor.float().cpu().tolist(),
                                    "attention": float(scaling) if isinstance(scaling, (int, float)) else repr(scaling)})
    return sorted(entries, key=lambda e: (e["module"], str(e["layer_type"]))) or None


def same_frequencies(a: list[dict[str, Any]], b: list[dict[str, Any]], rtol: float = 1e-6) -> bool:
    """Whether two :func:`rope_frequencies` results describe the same rotary embedding (to ``rtol``)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x["module"], x["layer_type"]) != (y["module"], y["layer_type"]) or len(x["inv_freq"]) != len(y["inv_freq"]):
            return False
        if isinstance(x["attention"], str) or isinstance(y["attention"], str):
            if x["attention"] != y["attention"]:
                return False
        elif not math.isclose(x["attention"], y["attention"], rel_tol=rtol):
            return False
        if not all(math.isclose(u, v, rel_tol=rtol) for u, v in zip(x["inv_freq"], y["inv_freq"])):
            return False
    return True


# --------------------------------------------------------------------------------------------------
# Results on disk
# --------------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip("/").split("/")[-1]).strip("-") or "model"


class ResultStore:
    """One JSON file per run (config, versions, per-cell records, timing) and a CSV next to it.

    ``versions`` is the latest run's; ``runs[i]["versions"]`` is run i's, and each cell's ``run`` says
    which run computed it.

    The file name is ``{task}-{model}-{hash of the run config}.json``: the same command finds its own
    file again and skips the cells already in it; a different model, text or seed writes a new file.
    Methods and lengths are cells, not config, so adding a method to a finished run only computes it.
    """

    def __init__(self, out_dir: str | os.PathLike, task: str, run_config: dict[str, Any], *, overwrite: bool = False, write: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.task = task
        self.write = write
        key = hashlib.sha1(json.dumps(run_config, sort_keys=True, default=str).encode()).hexdigest()[:8]
        self.path = self.out_dir / f"{task}-{_slug(str(run_config.get('model', 'model')))}-{key}.json"
        self.data: dict[str, Any] = {"task": task, "config": run_config, "versions": versions(), "cells": {}, "runs": []}
        if self.path.exists() and not overwrite:
            from hf_posext.evaluation.results_files import read_results_file

            previous = read_results_file(self.path)  # a damaged file is named, never reused or silently replaced
            self.data["cells"] = previous["cells"]
            self.data["runs"] = previous.get("runs", [])
        self._started = time.time()
        # Cells of one file can come from several runs on different machines (a CPU and a GPU, say): each
        # run keeps its own versions, and each cell the index of the run that computed it.
        self.data["runs"].append({"started": _datetime.datetime.now().isoformat(timespec="seconds"), "seconds": None,
                                  "versions": self.data["versions"]})

    def has(self, cell_id: str) -> bool:
        return cell_id in self.data["cells"]

    def get(self, cell_id: str) -> dict[str, Any]:
        return self.data["cells"][cell_id]

    @property
    def cells(self) -> dict[str, dict[str, Any]]:
        return self.data["cells"]

    def put(self, cell_id: str, record: dict[str, Any]) -> None:
        self.data["cells"][cell_id] = {**record, "run": len(self.data["runs"]) - 1}
        self.save()

    def save(self, **run_info: Any) -> None:
        self.data["runs"][-1]["seconds"] = round(time.time() - self._started, 2)
        self.data["runs"][-1].update(run_info)
        if not self.write:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)
        from hf_posext.evaluation.report import write_csv

        write_csv(self.data, self.path.with_suffix(".csv"))


# --------------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------------


@dataclass
class Unit:
    """One piece of work: ``key`` identifies its input (for reuse), ``payload`` is what the evaluator needs."""

    key: Any
    payload: Any


@dataclass
class Cell:
    """A grid cell at one length: its extra coordinates (e.g. depth) and its units."""

    coords: dict[str, Any]
    units: list[Unit]
    info: dict[str, Any] = field(default_factory=dict)


def cell_id(method: MethodRequest, factor: float, length: int, coords: dict[str, Any]) -> str:
    parts = [method.label, f"factor={factor:g}", f"length={length}"] + [f"{k}={v}" for k, v in sorted(coords.items())]
    return "|".join(parts)


def run_grid(
    *,
    model: torch.nn.Module,
    methods: Sequence[MethodRequest],
    lengths: Sequence[int],
    factor: float | None,
    plan: Callable[[int], list[Cell]],
    evaluate: Callable[[list[Any]], list[dict[str, Any]]],
    aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]],
    store: ResultStore,
    dist: Distributed | None = None,
    batch_size: int = 1,
    reuse_identical: bool = True,
    progress: bool = True,
    description: str = "",
) -> ResultStore:
    """Evaluate every (method, length, cell) not yet in ``store``, side by side on one model.

    Args:
        model: the loaded model (patched here with each method in turn, restored afterwards).
        methods: methods to compare.
        lengths: sequence lengths in tokens.
        factor: the scale factor (None: longest length / the model's original window).
        plan: ``length -> cells`` (same on every process: deterministic).
        evaluate: evaluates a batch of unit payloads -> one result dict per payload (each with a
            ``"seconds"`` entry added here).
        aggregate: unit results of one cell -> the cell's metrics.
        store: where records go (and which cells are done); build it with ``write=dist.is_main``.
        dist: process group (None: one process).
        batch_size: units per forward pass.
        reuse_identical: reuse a unit result when another method computes the same function at this
            length (see :func:`rope_fingerprint`).
        progress: show a progress bar (main process only).
        description: progress bar label.
    """
    from tqdm.auto import tqdm

    dist = dist or Distributed()
    original_window = describe(model).original_window
    memo: dict[tuple[str, Any], tuple[dict[str, Any], str]] = {}
    plans = {length: plan(length) for length in lengths}
    for method in methods:
        method_factor = resolve_factor_for(method, factor, lengths, original_window)
        ids = {length: [cell_id(method, method_factor, length, c.coords) for c in plans[length]] for length in lengths}
        stored = [store.get(i) for length in lengths for i in ids[length] if store.has(i)]
        if len(stored) == sum(map(len, ids.values())) and not any(
            "rope_frequencies" in r or "attention_function" in r for r in stored
        ):
            continue  # all done, nothing to re-check
        with apply_method(model, method, method_factor) as report:
            for length in lengths:
                # A stored cell counts only if the method still computes the same rotary function: a
                # factors file rewritten by a new search, or a changed formula, makes it stale. The check
                # compares frequencies, so cells computed on another machine (a GPU) are not stale.
                # Records without frequencies (written before they were kept) are trusted by label.
                # An attention-level method (Self-Extend) is checked by its settings and kernel code too.
                frequencies = rope_frequencies(model, length)
                attention = attention_function(model)
                current = _hash_frequencies(frequencies)
                if attention is not None:
                    current = hashlib.sha1(f"{current}|{json.dumps(attention, sort_keys=True)}".encode()).hexdigest()
                stale = [i for i in ids[length] if store.has(i) and (
                    (frequencies is not None and store.get(i).get("rope_frequencies") is not None
                     and not same_frequencies(store.get(i)["rope_frequencies"], frequencies))
                    or ("attention_function" in store.get(i) and store.get(i)["attention_function"] != attention))]
                if stale:
                    warnings.warn(f"{method.label} x{method_factor:g} @ {length}: {len(stale)} stored cell(s) were computed "
                                  "with another rotary embedding or attention kernel (changed parameters, factors file or "
                                  "code); recomputing them.", stacklevel=2)
                cells = [c for c, i in zip(plans[length], ids[length]) if not store.has(i) or i in stale]
                if not cells:
                    continue
                warning = check_length(report, length, method.label)
                fingerprint = current if reuse_identical else None
                units = [unit for cell in cells for unit in cell.units]
                needed = [u for u in units if fingerprint is None or (fingerprint, u.key) not in memo]
                local = dist.shard(needed)
                results: list[tuple[int, dict[str, Any]]] = []
                bar = tqdm(total=len(local), desc=f"{description}{method.label} @ {length}", disable=not (progress and dist.is_main), leave=False)
                index_of = {id(u): i for i, u in enumerate(needed)}
                for start in range(0, len(local), batch_size):
                    batch = local[start : start + batch_size]
                    began = time.time()
                    outputs = evaluate([u.payload for u in batch])
                    seconds = (time.time() - began) / len(batch)
                    for unit, output in zip(batch, outputs):
                        results.append((index_of[id(unit)], {**output, "seconds": seconds}))
                    bar.update(len(batch))
                bar.close()
                gathered = dict(dist.gather(results))
                label = f"{method.label} x{method_factor:g}"
                computed = {}
                for i, unit in enumerate(needed):
                    computed[id(unit)] = gathered[i]
                    if fingerprint is not None:
                        memo[(fingerprint, unit.key)] = (gathered[i], label)
                for cell in cells:
                    unit_results, reused_from = [], set()
                    for unit in cell.units:
                        if id(unit) in computed:
                            unit_results.append(computed[id(unit)])
                        else:
                            result, origin = memo[(fingerprint, unit.key)]
                            unit_results.append({**result, "seconds": 0.0})
                            reused_from.add(origin)
                    record = {
                        "method": method.method,
                        "label": method.label,
                        "params": method.params_dict,
                        "factor": method_factor,
                        "length": length,
                        **cell.coords,
                        **aggregate(unit_results),
                        **cell.info,
                        "supported_window": report.current_window,
                        "dynamic": report.dynamic,
                        "beyond_window": warning is not None,
                        "seconds": round(sum(r["seconds"] for r in unit_results), 3),
                        "units": unit_results,
                    }
                    if reused_from:
                        record["reused_from"] = sorted(reused_from)
                    if current is not None:
                        record["rope_fingerprint"] = current
                    if frequencies is not None:
                        record["rope_frequencies"] = frequencies
                    if attention is not None:
                        record["attention_function"] = attention
                    store.put(cell_id(method, method_factor, length, cell.coords), record)
                dist.barrier()
    store.save(world_size=dist.world_size)
    return store
