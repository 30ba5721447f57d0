"""bench/gpu_checks.py runs on GPU machines, which CI lacks: run its checks on CPU so the script cannot rot,
and show that each check fails on a broken variant (a check that cannot fail proves nothing on the GPU)."""

from __future__ import annotations

import json

import pytest

from tests.bench_helpers import load_bench_script

import hf_posext


def _failed(results: list[dict]) -> set[str]:
    return {r["check"] for r in results if not r["passed"]}


def test_every_check_passes_on_cpu_with_a_margin_and_is_written(tmp_path):
    script = load_bench_script("gpu_checks")
    out = tmp_path / "checks.json"
    with pytest.warns(UserWarning, match="stored in torch.bfloat16"):  # the bf16 check casts a model
        failures = script.main(["--device", "cpu", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert failures == 0 and len(results) == 15
    assert all(r["passed"] and r["margin"] >= 100 for r in results)
    names = " / ".join(r["check"] for r in results)
    assert "cached generation vs full recompute" in names and "unpatch restores the exact logits" in names


def test_a_patch_that_does_nothing_fails_every_check(monkeypatch):
    script = load_bench_script("gpu_checks")
    monkeypatch.setattr(script.hf_posext, "patch", lambda model, *args, **kwargs: model)
    monkeypatch.setattr(script.hf_posext, "unpatch", lambda model: model)
    results = script.run_checks("cpu")
    assert _failed(results) == {r["check"] for r in results}


def test_frequencies_that_follow_a_bfloat16_cast_fail_the_half_precision_check(monkeypatch):
    """The fix the bf16 check guards: patched frequency tables stay float32 when the model is half precision."""
    script = load_bench_script("gpu_checks")
    real_patch = hf_posext.patch

    def patch_then_round_tables(model, *args, **kwargs):
        real_patch(model, *args, **kwargs)
        dtype = next(model.parameters()).dtype
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype).float()  # rounded, as a plain .to(dtype) would
        return model

    monkeypatch.setattr(script.hf_posext, "patch", patch_then_round_tables)
    with pytest.warns(UserWarning, match="stored in torch.bfloat16"):
        results = script.run_checks("cpu")
    assert _failed(results) == {"yarn on a bfloat16-cast model: rotary cos/sin equal float32 tables rounded once"}


def test_a_cache_that_drops_the_attention_method_fails_the_cache_checks(monkeypatch):
    script = load_bench_script("gpu_checks")
    real_cached = script.cached_logits

    def cached_without_the_method(model, ids, prefix, step):
        from hf_posext.api import patched_backend

        restore = patched_backend(model).current_request(model)
        hf_posext.unpatch(model)
        try:
            return real_cached(model, ids, prefix, step)
        finally:
            hf_posext.patch(model, restore.method, restore.factor, **restore.params_dict)

    monkeypatch.setattr(script, "cached_logits", cached_without_the_method)
    results = script.run_checks("cpu")
    assert _failed(results) == {f"{method} {implementation}: cached generation vs full recompute"
                                for method in ("self-extend", "dca") for implementation in ("sdpa", "eager")}


def test_dca_index_sets_off_by_one_fail_the_dca_path_check(monkeypatch):
    """The explicit pass (eager, and decode steps) with chunk size and local window one short: the fused path disagrees."""
    from hf_posext.backends.attention import dual_chunk

    script = load_bench_script("gpu_checks")
    real_explicit = dual_chunk.dual_chunk_explicit

    def shifted(query, key, value, attention_mask, query_positions, key_positions, layer, *args, **kwargs):
        if layer.chunk_size is not None:
            layer = dual_chunk.dataclasses.replace(layer, chunk_size=layer.chunk_size - 1, local_window=layer.local_window - 1)
        return real_explicit(query, key, value, attention_mask, query_positions, key_positions, layer, *args, **kwargs)

    monkeypatch.setattr(dual_chunk, "dual_chunk_explicit", shifted)
    results = [r for r in script.run_checks("cpu") if r["check"].startswith("dca")]
    # The eager path is explicit throughout (consistent with itself); on the SDPA path the prefill is fused.
    assert _failed(results) == {"dca sdpa: cached generation vs full recompute",
                                "dca: SDPA path (fused calls, log-sum-exp merge) vs eager path (explicit scores)"}
