"""``bench/patch_overhead.py --decode``: one generation step after n cached tokens, unpatched against each method,
on a tiny random-weight LLaMA (the bench's own numbers come from SmolLM2; here only that it runs and what it writes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_decode_mode_times_each_step_after_the_cached_tokens_and_writes_its_table(tmp_path, monkeypatch):
    from hf_posext.models import tiny_config

    monkeypatch.syspath_prepend(str(BENCH))
    import patch_overhead

    config = tmp_path / "config.json"
    config.write_text(tiny_config("llama", max_position_embeddings=256).to_json_string())
    out = tmp_path / "decode.json"
    calls = []
    step = patch_overhead._decode_step_seconds

    def counted(model, length, steps, device, trace=None):
        calls.append((length, steps))
        return step(model, length, steps, device, trace)

    monkeypatch.setattr(patch_overhead, "_decode_step_seconds", counted)
    assert patch_overhead.main(["--decode", "--random-weights", str(config), "--methods", "yarn,yarn+string", "--lengths", "64,128",
                                "--repeats", "2", "--steps", "3", "--profile", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["method"], r["length"]) for r in result["rows"]] == [("yarn", 64), ("yarn", 128), ("yarn+string", 64), ("yarn+string", 128)]
    assert all(r["ratio"] == r["step_ms"] / r["unpatched_step_ms"] and r["step_ms"] > 0 for r in result["rows"])
    # a warm-up step per length, then 2 rounds x 3 methods (unpatched first) x 2 lengths, 3 steps each
    # then one traced round per method at the last length (--profile)
    assert calls == [(64, 1), (128, 1)] + [(n, 3) for n in (64, 128) for _ in range(3)] * 2 + [(128, 3)] * 3
    profile = result["profile"]
    assert set(profile) == {"none", "yarn", "yarn+string"} and all(len(ops) == 4 for ops in profile.values())
    assert all(0 < op["share"] <= 1 and op["calls"] >= 1 for ops in profile.values() for op in ops)
    assert all(ops[0]["ms_a_step"] >= ops[-1]["ms_a_step"] for ops in profile.values())

    assert all(len(result["raw_seconds"][m][str(n)]) == 6 for m in ("none", "yarn", "yarn+string") for n in (64, 128))
    table = out.with_suffix(".md").read_text()
    assert "| yarn+string | 128 |" in table and "One generation step" in table and sys.modules["patch_overhead"] is patch_overhead


def test_a_decode_step_extends_the_cache_it_is_given(monkeypatch):
    """The step runs at position n against n cached keys: the cache grows by one key a step."""
    import torch

    from hf_posext.models import tiny_model

    monkeypatch.syspath_prepend(str(BENCH))
    import patch_overhead

    model = tiny_model("llama", max_position_embeddings=256).eval()
    cache = patch_overhead._filled_cache(model, 50)
    assert cache.get_seq_length() == 50
    made = []
    monkeypatch.setattr(patch_overhead, "_filled_cache", lambda m, n: made.append(cache) or cache)
    assert len(patch_overhead._decode_step_seconds(model, 50, 3, "cpu")) == 3
    assert made == [cache] and cache.get_seq_length() == 53 and cache.layers[0].keys.dtype == torch.float32


def test_a_step_profile_traces_the_steps_not_the_filling_of_the_cache(monkeypatch):
    from types import SimpleNamespace

    from hf_posext.models import tiny_model

    monkeypatch.syspath_prepend(str(BENCH))
    import patch_overhead

    model = tiny_model("llama", max_position_embeddings=256).eval()
    names = [op["name"] for op in patch_overhead._step_profile(model, None, 128, SimpleNamespace(steps=2, device="cpu"), top=1000)]
    assert "aten::mm" in names or "aten::addmm" in names or "aten::matmul" in names
    assert "aten::normal_" not in names  # the cache's random keys and values are drawn before the trace starts
