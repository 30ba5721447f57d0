"""Shared helper for the tests/test_bench_*.py modules: load a bench/ script as a module, without running it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` (bench/ is not a package) and return the module.

    Args:
        name: the script's file name without ``.py``, e.g. ``"gpu_checks"``.
    """
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
