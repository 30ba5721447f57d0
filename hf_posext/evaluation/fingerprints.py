"""What a stored cell was computed with: the rotary frequencies a model uses at a length, their hash, and
for an attention-level method (Self-Extend, DCA) its settings and the code of its attention kernel.

The grid compares them to decide whether a stored cell is stale and whether two methods compute the
same function at a length (then one result serves both). A RoPE method is pinned down by its rotary
frequencies; an attention-level method also changes how positions enter the attention scores, so
:func:`attention_function` records its settings and a hash of its kernel's code: a cell computed with
other settings or another version of the kernel is recomputed, not reused. A docstring or comment edit
is not another version (:func:`kernel_code_hash`, :func:`same_attention_function`).

A results file is keyed by the model's name or path, not its weights: :func:`weights_fingerprint` pins
down the weights a cell was computed on (a sha256 over every element of every parameter), so a model
retrained into the same folder is not read back from the old model's cells. Cells written before it hashed
every element carry :func:`sampled_weights_fingerprint` (a plain hex digest, no prefix) and are checked
against that.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import math
from pathlib import Path
from typing import Any

import torch

from hf_posext.api import describe, fixed_length
from hf_posext.core.errors import UnsupportedModelError
# One weights fingerprint (every element hashed; its prefix tells it from an older cell's bare sampled hex digest)
from hf_posext.core.integrity import FULL_WEIGHTS_PREFIX, stable_digest, weights_fingerprint

__all__ = [
    "rope_fingerprint",
    "hash_frequencies",
    "rope_frequencies",
    "same_frequencies",
    "attention_function",
    "same_attention_function",
    "kernel_source_hash",
    "kernel_code_hash",
    "function_fingerprint",
    "weights_fingerprint",
    "sampled_weights_fingerprint",
    "is_full_weights_fingerprint",
    "FULL_WEIGHTS_PREFIX",
    "KERNEL_INDEPENDENT_PARAMS",
]

#: Elements hashed per parameter by :func:`sampled_weights_fingerprint` (results written before the full hash).
WEIGHT_SAMPLES_PER_PARAMETER = 65536

#: Parameters that choose how the scores are computed, not what they are (eager and SDPA agree).
KERNEL_INDEPENDENT_PARAMS = ("attn_implementation",)


def rope_fingerprint(model: torch.nn.Module, length: int) -> str | None:
    """A hash of the rotary frequencies the model uses for ``length`` tokens (None if not a RoPE model).

    Two methods with the same fingerprint compute the same function at this length (e.g. dynamic YaRN
    equals the unpatched model inside the original window, and static YaRN with s = length / window at
    ``length``): the grid then reuses the result instead of recomputing it, and records that it did.
    The hash is exact, so it is for comparisons on one machine; across machines compare
    :func:`rope_frequencies` with :func:`same_frequencies`.
    """
    return hash_frequencies(rope_frequencies(model, length))


def hash_frequencies(frequencies: list[dict[str, Any]] | None) -> str | None:
    if frequencies is None:
        return None
    return stable_digest(frequencies, length=None, algorithm="sha1")


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
        if describe(model).kind not in ("rope", "attention", "rope+attention"):  # an attention-level method keeps RoPE
            return None
    except UnsupportedModelError:  # no positions hf-posext knows: nothing to pin down (any other error is a bug: raised)
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


def _kernel_package_sources(model: torch.nn.Module) -> dict[str, bytes] | None:
    """The ``.py`` files of the package that defines the attention function the config names, by file name.

    The registered function's module imports its math from sibling modules (the shared kernels, the
    registration flow, another method's helpers), so every ``.py`` file of that package counts (None: not found).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(model.config, "_attn_implementation", None)
    function = ALL_ATTENTION_FUNCTIONS.get(name) if name else None
    module = inspect.getmodule(function) if function is not None else None
    source_file = getattr(module, "__file__", None)
    if source_file is None:
        return None
    return {path.name: path.read_bytes() for path in sorted(Path(source_file).parent.glob("*.py"))}


def kernel_source_hash(sources: dict[str, bytes]) -> str:
    """sha256 over a package's files (``{file name: bytes}``) in name order: any edit changes it, a comment too."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name] + b"\0")
    return digest.hexdigest()


def kernel_code_hash(sources: dict[str, bytes]) -> str | None:
    """sha256 over the syntax trees of a package's files, docstrings removed (None: a file does not parse).

    What the code computes, not how it is written: comments, docstrings, line wrapping and blank lines do not
    change it; any change of a statement, name or constant does. ``ast.dump`` can differ between Python
    versions, so the hash is compared within one version; :func:`same_attention_function` also accepts an
    equal :func:`kernel_source_hash`, which holds across versions.
    """
    digest = hashlib.sha256()
    for name in sorted(sources):
        try:
            tree = ast.parse(sources[name])
        except (SyntaxError, ValueError):
            return None
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        digest.update(name.encode() + b"\0" + ast.dump(tree, include_attributes=False).encode() + b"\0")
    return digest.hexdigest()


def attention_function(model: torch.nn.Module) -> dict[str, Any] | None:
    """The method, settings and kernel-code hash of an attention-level patch (None: no such patch).

    Two cells with different results here computed different functions. The kernel hash is of every
    module in the package that defines the registered attention function: any edit there, even a
    comment, recomputes the cells (the safe direction: a cell is never trusted across a change of its code).
    """
    try:
        report = describe(model)
    except UnsupportedModelError:
        return None
    attention = report.parts[-1] if report.parts else report  # a composition (yarn+string): its attention part
    if attention.kind != "attention":
        return None
    params = {key: value for key, value in sorted(attention.params.items()) if key not in KERNEL_INDEPENDENT_PARAMS}
    sources = _kernel_package_sources(model)
    return {"method": report.method, "params": params,
            "kernel_sha256": kernel_source_hash(sources) if sources is not None else None,
            "kernel_code_sha256": kernel_code_hash(sources) if sources is not None else None}


def same_attention_function(stored: dict[str, Any] | None, current: dict[str, Any] | None) -> bool:
    """Whether a stored cell's :func:`attention_function` computes what the model computes now.

    The method and settings must be equal, and the kernel's code the same: the same source files
    (``kernel_sha256``), or the same syntax trees without docstrings (``kernel_code_sha256``, absent from
    cells written before it was kept), so a docstring or comment edit does not throw away hours of results.
    """
    if stored is None or current is None:
        return stored is current
    if (stored.get("method"), stored.get("params")) != (current.get("method"), current.get("params")):
        return False
    same_source = stored.get("kernel_sha256") is not None and stored.get("kernel_sha256") == current.get("kernel_sha256")
    code = stored.get("kernel_code_sha256")
    return same_source or (code is not None and code == current.get("kernel_code_sha256"))


def function_fingerprint(frequencies: list[dict[str, Any]] | None, attention: dict[str, Any] | None) -> str | None:
    """One hash of what a (method, length) computes: its rotary frequencies and, if any, its attention function."""
    current = hash_frequencies(frequencies)
    if attention is None:
        return current
    return hashlib.sha1(f"{current}|{json.dumps(attention, sort_keys=True)}".encode()).hexdigest()


def is_full_weights_fingerprint(value: Any) -> bool:
    """Whether a stored ``model_weights`` was made by :func:`weights_fingerprint` (else: the sampled hash)."""
    return isinstance(value, str) and value.startswith(FULL_WEIGHTS_PREFIX)


def sampled_weights_fingerprint(model: torch.nn.Module) -> str:
    """The weights hash of cells written before :func:`weights_fingerprint` hashed every element.

    sha256 over names, shapes, dtypes and a sample of the values: every parameter of up to
    :data:`WEIGHT_SAMPLES_PER_PARAMETER` elements whole, a larger one by that many elements at an even
    stride (elements ``0, k, 2k, ...`` of the flattened parameter, ``k = ceil(numel / 65536)``). A change
    confined to the elements between the samples goes unseen; it is kept only to check those older cells.
    """
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(f"{name}|{tuple(parameter.shape)}|{parameter.dtype}|".encode())
        if parameter.device.type == "meta" or parameter.numel() == 0:
            continue
        flat = parameter.detach().reshape(-1)
        stride = -(-flat.numel() // WEIGHT_SAMPLES_PER_PARAMETER)
        sample = flat[::stride].contiguous().cpu()
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
