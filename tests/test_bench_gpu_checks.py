"""bench/gpu_checks.py runs on GPU machines, which CI lacks: run its checks on CPU so the script cannot rot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "bench" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_check_passes_on_cpu_and_is_written(tmp_path):
    script = _load_script()
    out = tmp_path / "checks.json"
    with pytest.warns(UserWarning, match="stored in torch.bfloat16"):  # the bf16 check casts a model
        failures = script.main(["--device", "cpu", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert failures == 0 and len(results) == 13
    assert all(r["passed"] for r in results)
    names = " / ".join(r["check"] for r in results)
    assert "cached generation vs full recompute" in names and "unpatch restores the exact logits" in names
