"""bench/llama_cpp_scoring.py: its verdict rule, and the committed llama.cpp scores against export's refusal rule."""

from __future__ import annotations

import copy
import json

import pytest

from tests.bench_helpers import BENCH, load_bench_script
from hf_posext.export import serving_problems

RESULTS = BENCH / "results" / "llama_cpp_scoring" / "llama_cpp_scoring.json"


@pytest.fixture(scope="module")
def scoring():
    return load_bench_script("llama_cpp_scoring")


@pytest.fixture(scope="module")
def measured():
    return json.loads(RESULTS.read_text())


def test_committed_scores_match_exports_refusal_rule(scoring, measured):
    """export --for llama.cpp refuses exactly the cases llama.cpp scored far (>= 100x the control) from transformers."""
    assert set(measured["cases"]) == set(scoring.CASES)
    for kv_cache in scoring.KV_CACHE_TYPES:
        control = measured["cases"]["none"][f"kv_cache_{kv_cache}"]["against_transformers"]["mean_abs_dnll"]
        for case, (method, params, _) in scoring.CASES.items():
            delta = measured["cases"][case][f"kv_cache_{kv_cache}"]["against_transformers"]["mean_abs_dnll"]
            refused = bool(serving_problems({"method": method, "kind": "rope", "params": params}, "llama.cpp"))
            if refused:
                assert delta >= 100 * control, (case, kv_cache, delta, control)
            else:
                assert delta <= 10 * control, (case, kv_cache, delta, control)


def test_refused_export_is_served_as_the_default_betas(measured):
    """llama.cpp's scores of the betas-16/2 export match transformers' yarn at 32/1 as closely as the control does."""
    case = measured["cases"]["yarn-betas-16-2"]
    for kv_cache in ("F16", "F32"):
        control = measured["cases"]["none"][f"kv_cache_{kv_cache}"]["against_transformers"]["mean_abs_dnll"]
        as_default = case[f"kv_cache_{kv_cache}"]["against_transformers_default_betas"]["mean_abs_dnll"]
        assert as_default <= 10 * control


def test_check_flags_an_accepted_export_that_disagrees_and_a_refused_one_that_agrees(scoring, measured):
    assert all(v.startswith("ok") for v in scoring.check(measured["cases"]))
    broken = copy.deepcopy(measured["cases"])
    broken["ntk"]["kv_cache_F32"]["against_transformers"]["mean_abs_dnll"] = 1.0
    broken["yarn-betas-16-2"]["kv_cache_F16"]["against_transformers"]["mean_abs_dnll"] = 0.002
    unexpected = [v for v in scoring.check(broken) if v.startswith("UNEXPECTED")]
    assert len(unexpected) == 2
    assert "ntk (exported), KV cache F32" in unexpected[1] and "yarn-betas-16-2 (refused), KV cache F16" in unexpected[0]
