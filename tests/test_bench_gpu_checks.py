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
    assert failures == 0 and len(results) == 20
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
                                for method in ("self-extend", "dca", "string") for implementation in ("sdpa", "eager")}


def test_string_causal_squares_in_key_order_fail_the_string_path_check(monkeypatch):
    """The fused prefill's exact square left in reversed order (its output not flipped back): the SDPA path
    disagrees with the eager one and with its own cached decode steps (explicit scores)."""
    import torch

    from hf_posext.backends.attention import shifted_positions

    script = load_bench_script("gpu_checks")
    real_flip = torch.Tensor.flip

    def triangles_unflipped(call, block_query, block_shifted, rows, edge, near):
        def call_kept(q, rows_, low, high, causal=False, band=None, flip=False):
            output, lse = call(q, rows_, low, high, causal=causal, band=band, flip=flip)
            # flipped once more here, so that the helper's flip back leaves them reversed
            return (real_flip(output, 2), real_flip(lse, 2)) if flip else (output, lse)
        return real_triangles(call_kept, block_query, block_shifted, rows, edge, near)

    real_triangles = shifted_positions._triangle_parts
    monkeypatch.setattr(shifted_positions, "_triangle_parts", triangles_unflipped)
    results = [r for r in script.run_checks("cpu") if r["check"].startswith("string")]
    assert _failed(results) == {"string sdpa: cached generation vs full recompute",
                                "string: SDPA path (causal squares, log-sum-exp merge) vs eager path (explicit scores)"}


def test_dca_index_sets_off_by_one_fail_the_dca_path_check(monkeypatch):
    """The explicit pass (eager) and the decode step with chunk size and local window one short: the fused
    prefill disagrees with both."""
    from hf_posext.backends.attention import dual_chunk

    script = load_bench_script("gpu_checks")
    real_explicit, real_decode = dual_chunk.dual_chunk_explicit, dual_chunk.dual_chunk_decode

    def one_short(layer):
        if layer.chunk_size is None:
            return layer
        return dual_chunk.dataclasses.replace(layer, chunk_size=layer.chunk_size - 1, local_window=layer.local_window - 1)

    def shifted(query, key, value, attention_mask, query_positions, key_positions, layer, *args, **kwargs):
        return real_explicit(query, key, value, attention_mask, query_positions, key_positions, one_short(layer), *args, **kwargs)

    def shifted_decode(query, key, value, attention_mask, position_ids, layer, *args, **kwargs):
        return real_decode(query, key, value, attention_mask, position_ids, one_short(layer), *args, **kwargs)

    monkeypatch.setattr(dual_chunk, "dual_chunk_explicit", shifted)
    monkeypatch.setattr(dual_chunk, "dual_chunk_decode", shifted_decode)
    results = [r for r in script.run_checks("cpu") if r["check"].startswith("dca")]
    # The eager path is explicit throughout (consistent with itself); on the SDPA path the prefill is fused.
    assert _failed(results) == {"dca sdpa: cached generation vs full recompute",
                                "dca: SDPA path (fused calls, log-sum-exp merge) vs eager path (explicit scores)"}
