"""bench/add_kernel_code_hashes.py: stored attention cells get the code hash of the version that wrote them,
from git, so a docstring edit made before the code hash existed does not recompute them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hf_posext import patch
from hf_posext.evaluation import fingerprints
from hf_posext.models import tiny_model
from tests.bench_helpers import load_bench_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_working_trees_source_hash_maps_to_its_code_hash(monkeypatch):
    script = load_bench_script("add_kernel_code_hashes")
    monkeypatch.chdir(ROOT)
    hashes = script.code_hash_by_source_hash(script.PACKAGE)
    current = fingerprints.attention_function(patch(copy.deepcopy(tiny_model("llama", seed=0)), "string"))
    assert hashes[current["kernel_sha256"]] == current["kernel_code_sha256"]


def test_cells_get_the_code_hash_of_their_source_and_unknown_code_is_left_and_named(tmp_path):
    script = load_bench_script("add_kernel_code_hashes")
    cells = {
        "old": {"attention_function": {"method": "string", "kernel_sha256": "a"}, "ppl": 2.0},
        "never committed": {"attention_function": {"method": "string", "kernel_sha256": "z"}},
        "new": {"attention_function": {"method": "string", "kernel_sha256": "b", "kernel_code_sha256": "kept"}},
        "rope": {"rope_frequencies": []},
    }
    path = tmp_path / "passkey-x.json"
    path.write_text(json.dumps({"task": "passkey", "cells": cells}))
    changed, unknown = script.add_code_hashes(path, {"a": "code-a", "b": "code-b", "z-not": "x"})
    saved = json.loads(path.read_text())["cells"]
    assert (changed, unknown) == (1, ["never committed"])
    assert saved["old"] == {"attention_function": {"method": "string", "kernel_sha256": "a",
                                                   "kernel_code_sha256": "code-a"}, "ppl": 2.0}
    assert saved["never committed"] == cells["never committed"]
    assert saved["new"]["attention_function"]["kernel_code_sha256"] == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passkey-x.json"]  # no staged file left behind
    before = path.read_text()
    assert script.add_code_hashes(path, {"a": "code-a"}) == (0, ["never committed"])  # idempotent
    assert path.read_text() == before
