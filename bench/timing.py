"""Timing and operation counting shared by the attention cost benchmarks (bench/dca_cost.py,
bench/self_extend_cost.py). Run those scripts as ``python bench/<name>.py``: this folder is then on
``sys.path``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any, Callable

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

__all__ = ["sync", "timed", "count_operations", "METADATA_OPERATIONS"]

#: aten operations that only make a new view or read metadata: no kernel runs for them on a GPU.
METADATA_OPERATIONS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::slice", "aten::select",
    "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::permute", "aten::t", "aten::as_strided",
    "aten::alias", "aten::detach", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::resolve_conj", "aten::resolve_neg", "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk",
    "aten::unbind", "aten::narrow", "aten::broadcast_tensors", "aten::result_type", "aten::contiguous",
    "aten::is_nonzero", "aten::view_as", "aten::expand_as", "aten::squeeze_", "aten::unsqueeze_", "aten::to",
    "aten::matmul", "aten::dropout", "aten::lift", "aten::numpy_T", "aten::set_", "aten::resize_",
    "aten::_reshape_alias", "aten::is_same_size", "aten::real", "aten::sym_size", "aten::sym_stride", "aten::size",
    "aten::stride", "aten::clone_if_needed", "aten::zeros_like_meta",
})
#: aten operations that read a value back to the host (a device synchronisation on a GPU).
SYNC_OPERATIONS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::allclose"})


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(function: Callable[[], Any], device: str) -> float:
    """Seconds one call of ``function`` takes under ``torch.no_grad()``, device work included."""
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        function()
    sync(device)
    return time.perf_counter() - start


def count_operations(function: Callable[[], Any]) -> dict[str, Any]:
    """The aten operations one call of ``function`` runs, counted with ``torch.profiler`` on CPU.

    Returns:
        ``{"aten": n, "kernels": n, "syncs": n, "kernel_names": {name: count}}``: ``aten`` counts the
        operations called from Python (no aten parent); ``kernels`` the innermost operations that compute
        or copy (not a view, allocation or metadata operation, and no such child): about the kernels a GPU
        launches;
        ``syncs`` the reads of a value back to the host.
    """
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as profiler:
        function()
    events = [event for event in profiler.events() if event.name.startswith("aten::")]
    top = [event for event in events if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")]

    def computes(event) -> bool:
        return event.name not in METADATA_OPERATIONS and event.name not in SYNC_OPERATIONS

    # A kernel: an operation that computes or copies, none of whose children does (its children, if any,
    # only allocate or make views): what launches one kernel on a GPU.
    leaves = Counter(
        event.name for event in events
        if computes(event) and not any(computes(child) for child in event.cpu_children if child.name.startswith("aten::"))
    )
    return {
        "aten": len(top),
        "kernels": sum(leaves.values()),
        "syncs": sum(1 for event in events if event.name == "aten::_local_scalar_dense"),
        "kernel_names": dict(sorted(leaves.items(), key=lambda item: -item[1])),
    }


if __name__ == "__main__":  # a helper module, imported by the benchmarks above; `--help` says so
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
