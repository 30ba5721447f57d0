"""Self-Extend (grouped attention through transformers' attention registry) on tiny random models."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import self_extend, self_extend_kernels
from hf_posext.backends.rope.sites import UnsupportedModelError
from hf_posext.models import TINY_FAMILIES, tiny_model
from hf_posext.backends.attention.self_extend import grouped_attention, max_extended_length, rotate, size_for_target, split_grouped_attention
from tests.conftest import assert_close_guarding, logits_of, model_bypassing_the_attention_registry, transformers_major, transformers_version

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

# Falcon's attention asks the registry from transformers 5.25 on; before, it bypassed it and was refused (a model
# built to bypass it is tested below)
FAMILIES = [f for f in TINY_FAMILIES if f != "falcon" or transformers_version() >= (5, 25)]


def _ids(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _rope(states: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Standard rotate_half RoPE of unrotated ``states`` [B, H, T, D] at ``positions`` [B, T] (float64)."""
    angles = positions.double()[:, None, :, None] * inv_freq.double()
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = states.shape[-1] // 2
    rotated_half = torch.cat((-states[..., half:], states[..., :half]), -1)
    return states.double() * cos + rotated_half.double() * sin


def _reference(q, k, v, group_size, window, inv_freq):
    """The paper's construction written out: rotate raw q/k at exact and at grouped positions, merge, softmax."""
    length = q.shape[2]
    pos = torch.arange(length)[None]
    shift = window - window // group_size
    neighbour = _rope(q, pos, inv_freq) @ _rope(k, pos, inv_freq).transpose(2, 3)
    grouped = _rope(q, pos // group_size + shift, inv_freq) @ _rope(k, pos // group_size, inv_freq).transpose(2, 3)
    distance = pos[0][:, None] - pos[0][None, :]
    scores = torch.where(distance < window, neighbour, grouped) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return (torch.softmax(scores, -1) @ v.double()).transpose(1, 2)


@pytest.mark.parametrize("block_elements", [1 << 26, 4 * 3 * 7])
def test_grouped_attention_matches_the_papers_construction(block_elements):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 50, 8), torch.randn(1, 4, 50, 8), torch.randn(1, 4, 50, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    pos = torch.arange(50)[None]
    out = grouped_attention(
        _rope(q, pos, inv_freq).float(), _rope(k, pos, inv_freq).float(), v, None, pos, pos,
        inv_freq, 8, False, group_size=3, neighbor_window=7, scaling=8 ** -0.5, block_elements=block_elements,
    )
    torch.testing.assert_close(out.double(), _reference(q, k, v, 3, 7, inv_freq), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused CPU kernel / explicit fallback
@pytest.mark.parametrize("block", [512, 7])
def test_split_attention_matches_the_papers_construction(dtype, block):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 50, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)  # grouped-query
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    pos = torch.arange(50)[None]
    rq, rk = _rope(q, pos, inv_freq).to(dtype), _rope(k, pos, inv_freq).to(dtype)
    key_grouped = self_extend_kernels.to_grouped(rk, pos, "key", 3, 7, inv_freq, 8, False)
    expected = _reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 3, 7, inv_freq)
    out = split_grouped_attention(rq, rk, v.to(dtype), key_grouped, None, pos, pos, inv_freq, 8, False, 3, 7, 8 ** -0.5, block=block)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The last 12 queries against all 50 keys (a KV cache), with a bool mask hiding keys 3 and 20-24:
    # same rows as the explicit blockwise function given the same mask.
    mask = torch.ones(1, 1, 12, 50, dtype=torch.bool).tril(diagonal=38)
    mask[..., 3] = False
    mask[..., 20:25] = False
    args = (pos[:, 38:], pos, inv_freq, 8, False)
    explicit = grouped_attention(rq[:, :, 38:], rk, v.to(dtype), mask, *args, group_size=3, neighbor_window=7, scaling=8 ** -0.5)
    split = split_grouped_attention(rq[:, :, 38:], rk, v.to(dtype), key_grouped, mask, *args, 3, 7, 8 ** -0.5, block=block)
    torch.testing.assert_close(split.double(), explicit.double(), atol=1e-5, rtol=1e-5)


def test_sdpa_path_uses_the_split_attention_and_eager_does_not(monkeypatch):
    calls = []
    original = self_extend.split_grouped_attention
    monkeypatch.setattr(self_extend, "split_grouped_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    ids = _ids(100)
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model("llama", initializer_range=0.1)  # position-sensitive: see test_attention_margins.py
        model.set_attn_implementation(implementation)
        hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=10)
        calls.clear()
        outputs[implementation] = logits_of(model, ids)
        assert bool(calls) == (implementation == "sdpa")
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], atol=1e-5, rtol=1e-5)
    # With gradients (fine-tuning a Self-Extend model) the explicit scores are used: the fused kernel
    # does not differentiate the log-sum-exp the merge needs. Same gradients as eager. A position-sensitive
    # model (init 0.1): a neighbour window one off moves this gradient by 9.5e-3, ~7000x the tolerance
    # (measured; sdpa and eager agree to the bit here). On the default init the whole Self-Extend effect
    # (7.8e-5) was below the old tolerance (1e-4).
    grads = {}
    for implementation, window in (("sdpa", 10), ("eager", 10), ("one_off", 11)):
        torch.manual_seed(0)
        model = tiny_model("llama", initializer_range=0.1)
        model.set_attn_implementation("eager" if implementation == "one_off" else implementation)
        hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=window)
        calls.clear()
        model(ids, labels=ids).loss.backward()
        assert not calls
        grads[implementation] = model.model.layers[0].self_attn.q_proj.weight.grad
    assert_close_guarding(grads["sdpa"], grads["eager"], grads["one_off"], atol=1e-6, rtol=1e-5)


def _decode_case(rows: int, layout: str, mask: str | None):
    """Rotated q/k/v of 60 tokens, batch 2, grouped-query; G=3, W=7 (most keys grouped)."""
    from hf_posext.backends.attention.self_extend import SelfExtendLayerSettings

    torch.manual_seed(3)
    length, head_dim = 60, 8
    rotary_dim = 4 if layout == "partial" else 8
    q, k, v = torch.randn(2, 4, length, head_dim), torch.randn(2, 2, length, head_dim), torch.randn(2, 2, length, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    settings = SelfExtendLayerSettings(inv_freq, rotary_dim, layout == "interleaved", 3, 7, "sdpa")
    attention_mask = None
    if mask is not None:
        allowed = torch.ones(2, 1, rows, length, dtype=torch.bool).tril(length - rows)
        allowed[0, ..., 2] = False
        allowed[1, ..., 50:53] = False  # inside the window of the last query
        attention_mask = allowed if mask == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return q, k, v, attention_mask, settings, torch.arange(length)[None]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved", "partial"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_decode_step_equals_the_explicit_and_prefill_paths(rows, layout, mask):
    """The few-kernel decode step against the explicit blocks on the same step and the fused prefill's last
    rows; plain attention (no grouping) is the effect it guards."""
    from hf_posext.backends.attention.self_extend import self_extend_decode

    q, k, v, attention_mask, settings, pos = _decode_case(rows, layout, mask)
    scaling = 8 ** -0.5
    geometry = (settings.inv_freq, settings.rotary_dim, settings.interleaved)
    step = pos[:, -rows:].clone()
    new = self_extend_decode(q[:, :, -rows:], k, v, attention_mask, step, settings, scaling)
    old = grouped_attention(q[:, :, -rows:], k, v, attention_mask, step, pos, *geometry, 3, 7, scaling)
    plain = grouped_attention(q[:, :, -rows:], k, v, attention_mask, step, pos, *geometry, None, None, scaling)
    assert_close_guarding(new, old, plain, atol=1e-5, rtol=1e-5)
    if mask is None:
        key_grouped = self_extend_kernels.to_grouped(k, pos, "key", 3, 7, *geometry)
        prefill = split_grouped_attention(q, k, v, key_grouped, None, pos, pos, *geometry, 3, 7, scaling)[:, -rows:]
        assert_close_guarding(new, prefill, plain, atol=1e-5, rtol=1e-5)
    # The tables serve the next layer of the same step (same position_ids tensor), and no other step.
    again = self_extend_decode(q[:, :, -rows:] * 0.5, k * 2, v, attention_mask, step, settings, scaling)
    torch.testing.assert_close(again, grouped_attention(q[:, :, -rows:] * 0.5, k * 2, v, attention_mask, step, pos, *geometry, 3, 7, scaling),
                               atol=1e-5, rtol=1e-5)
    shorter = self_extend_decode(q[:, :, -rows - 1:-1], k[:, :, :-1], v[:, :, :-1], None, step - 1, settings, scaling)
    torch.testing.assert_close(shorter, grouped_attention(q[:, :, -rows - 1:-1], k[:, :, :-1], v[:, :, :-1], None, step - 1, pos[:, :-1],
                                                          *geometry, 3, 7, scaling), atol=1e-5, rtol=1e-5)


def test_decode_step_check_fails_with_a_wrong_neighbour_window(monkeypatch):
    """A broken decode step (grouped positions for one more key than the paper says) is caught."""
    from hf_posext.backends.attention.self_extend import self_extend_decode

    real = self_extend_kernels._decode_tables

    def one_short(query_positions, kv_len, settings, head_dim, scaling):
        tables = real(query_positions, kv_len, settings, head_dim, scaling)
        key_positions = query_positions[:, -1:] - torch.arange(kv_len - 1, -1, -1)
        tables.neighbour = (query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)) < settings.neighbor_window - 1
        return tables

    monkeypatch.setattr(self_extend_kernels, "_decode_tables", one_short)
    self_extend.clear_decode_tables()
    q, k, v, _, settings, pos = _decode_case(1, "rotate_half", None)
    geometry = (settings.inv_freq, settings.rotary_dim, settings.interleaved)
    new = self_extend_decode(q[:, :, -1:], k, v, None, pos[:, -1:].clone(), settings, 8 ** -0.5)
    old = grouped_attention(q[:, :, -1:], k, v, None, pos[:, -1:], pos, *geometry, 3, 7, 8 ** -0.5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    self_extend.clear_decode_tables()


def test_rotate_composes_with_rope_both_layouts():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 8)
    inv_freq = 1.0 / (100 ** (torch.arange(0, 4, 2).double() / 4))
    pos = torch.arange(5)[None] * 7
    # partial rotary (first 4 of 8 channels), rotate_half layout
    rotated = torch.cat((_rope(x[..., :4], pos, inv_freq), x[..., 4:].double()), -1)
    moved = rotate(rotated.float(), torch.full((1, 5), 11), inv_freq, 4, False)
    expected = torch.cat((_rope(x[..., :4], pos + 11, inv_freq), x[..., 4:].double()), -1)
    torch.testing.assert_close(moved.double(), expected, atol=1e-5, rtol=1e-5)
    # interleaved pairs (GPT-J): rotating by +d then -d is the identity
    back = rotate(rotate(x, torch.full((1, 5), 5), inv_freq, 4, True), torch.full((1, 5), -5), inv_freq, 4, True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_sizing_rule_matches_the_paper():
    # Figure 3 of the paper: L = 7, W = 4, G = 2 covers a sequence of 10 tokens.
    assert max_extended_length(7, 2, 4) == 10
    # SmolLM2 (L = 8192), default W = L/4 = 2048: 2x needs G = 3, 4x needs G = 6 (G = 5 would put the
    # farthest pair at grouped distance 8192, one past the window).
    assert size_for_target(8192, 16384) == (3, 2048)
    assert size_for_target(8192, 32768) == (6, 2048)
    assert max_extended_length(8192, 5, 2048) < 32768 <= max_extended_length(8192, 6, 2048)
    assert size_for_target(8192, 32768, neighbor_window=1024) == (5, 1024)
    # A target exactly at the rule's limit needs no larger group: Figure 3's 10 tokens need G = 2.
    assert size_for_target(7, 10, neighbor_window=4) == (2, 4)
    assert size_for_target(7, 11, neighbor_window=4) == (3, 4)


def _farthest_distance(length: int, group_size: int, window: int) -> int:
    """The largest relative distance any causal pair of a ``length``-token sequence gets under Self-Extend,
    found over every pair (not by the closed form): exact distance inside the neighbor window, grouped
    beyond it (query at ``i // G + W - W // G``, key at ``j // G``)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    exact = i - j
    grouped = (i // group_size + window - window // group_size) - j // group_size
    distance = torch.where(exact < window, exact, grouped)
    return int(distance[exact >= 0].max())


@pytest.mark.parametrize("original", [7, 12, 16])
def test_sizing_rule_is_the_longest_sequence_inside_the_window(original):
    # Every (G, W) on small windows: the rule's length keeps every distance at most L - 1 and one token
    # more does not; size_for_target's G is the smallest that reaches the target.
    for window in range(1, original):
        for group_size in range(1, 5):
            longest = max_extended_length(original, group_size, window)
            assert _farthest_distance(longest, group_size, window) <= original - 1
            assert _farthest_distance(longest + 1, group_size, window) > original - 1
        for target in range(original, 4 * original):
            group_size, _ = size_for_target(original, target, neighbor_window=window)
            assert _farthest_distance(target, group_size, window) <= original - 1
            assert group_size == 1 or _farthest_distance(target, group_size - 1, window) > original - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_identity_inside_window_extends_and_unpatches_to_the_bit(family):
    model = tiny_model(family)
    ids = _ids(100)
    before_config = json.loads(model.config.to_json_string())
    before_dict = dict(model.config.__dict__)
    base = logits_of(model, ids[:, :60])  # inside the window (GPT-J's table stops at 64)
    # Window covering the whole sequence: exactly the original model.
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=63)
    torch.testing.assert_close(logits_of(model, ids[:, :60]), base, atol=0, rtol=0)
    report = hf_posext.describe(model)
    assert report.kind == "attention" and report.method == "self-extend"
    assert report.current_window == max_extended_length(64, 4, 63)
    # Extended: runs past the original window, and differs from the unpatched model past W.
    hf_posext.patch(model, "self-extend", target_length=256)
    assert hf_posext.describe(model).current_window >= 256
    extended = logits_of(model, ids)
    assert torch.isfinite(extended).all()
    assert not torch.allclose(extended[:, :60], base)
    hf_posext.unpatch(model)
    assert json.loads(model.config.to_json_string()) == before_config
    assert model.config.__dict__ == before_dict
    torch.testing.assert_close(logits_of(model, ids[:, :60]), base, atol=0, rtol=0)
    assert not any(hasattr(m, "_hf_posext_self_extend") for m in model.modules())


@pytest.mark.parametrize(
    "family, implementation", [("llama", "eager"), ("llama", "sdpa"), ("gemma3", "sdpa"), ("gpt_neox", "eager")]
)
def test_cached_generation_matches_full_recompute(family, implementation):
    # A position-sensitive model (init range 0.1): a cache that dropped Self-Extend (the unpatched model's
    # logits) is >= 100x the tolerance away.
    model = tiny_model(family, initializer_range=0.1)
    model.set_attn_implementation(implementation)
    ids = _ids(120)
    unpatched = logits_of(model, ids)
    hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=10)
    assert model.config._attn_implementation == self_extend.IMPLEMENTATIONS[implementation]
    full = logits_of(model, ids)
    with torch.no_grad():
        out = model(ids[:, :90], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for start in range(90, 120, 10):  # chunks of 10, then single tokens
            out = model(ids[:, start : start + 10], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    cached = torch.cat(steps, 1)
    assert_close_guarding(cached[:, 90:], full[:, 90:], unpatched[:, 90:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        out = model(ids[:, :114], use_cache=True)
        cache = out.past_key_values
        for t in range(114, 120):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            torch.testing.assert_close(out.logits[:, -1], full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_decode_path_in_a_model_matches_full_recompute(monkeypatch, implementation):
    """The accelerator decode path (self_extend_decode), forced on CPU, in a model: cached = full recompute."""
    monkeypatch.setattr(self_extend, "DECODE_DEVICES", ("cpu",))
    calls = []
    real = self_extend.self_extend_decode
    monkeypatch.setattr(self_extend, "self_extend_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_model("llama", initializer_range=0.1)
    model.set_attn_implementation(implementation)
    ids = _ids(120)
    unpatched = logits_of(model, ids)
    hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=10)
    full = logits_of(model, ids)
    with torch.no_grad():
        out = model(ids[:, :100], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for start in range(100, 120, 4):  # four tokens per step
            out = model(ids[:, start : start + 4], past_key_values=cache, use_cache=True)
            cache, steps = out.past_key_values, steps + [out.logits]
    assert calls  # the decode path ran
    cached = torch.cat(steps, 1)
    assert_close_guarding(cached[:, 100:], full[:, 100:], unpatched[:, 100:], atol=1e-5, rtol=1e-5)


def test_sdpa_and_eager_paths_agree():
    eager, sdpa = tiny_model("llama", initializer_range=0.1), tiny_model("llama", initializer_range=0.1)
    sdpa.set_attn_implementation("sdpa")
    ids = _ids(120, batch=2)
    unpatched = logits_of(eager, ids)
    for model in (eager, sdpa):
        hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=16)
    assert_close_guarding(logits_of(sdpa, ids), logits_of(eager, ids), unpatched, atol=1e-5, rtol=1e-5)
    hf_posext.unpatch(sdpa)
    assert sdpa.config._attn_implementation == "sdpa"


def test_generate_with_cache_equals_generate_without():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=12)
    ids = _ids(80)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (1, 88)
    assert torch.equal(cached, uncached)


def test_beam_search_with_cache_equals_without():
    # Beam search reorders the KV cache between steps (the reuse check itself is tested directly below).
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=12)
    ids = _ids(70)
    kwargs = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=3, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("reorder", [False, True])
def test_grouped_keys_kept_between_steps_are_reused_only_for_the_same_cache(reorder):
    from types import SimpleNamespace

    from hf_posext.backends.attention.self_extend import SelfExtendLayerSettings, self_extend_attention

    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    q, k, v = torch.randn(2, 4, 41, 8), torch.randn(2, 2, 41, 8), torch.randn(2, 2, 41, 8)

    def module():
        settings = SelfExtendLayerSettings(inv_freq, 8, False, 3, 5, "sdpa")
        return SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, _hf_posext_self_extend=settings)

    stepping = module()
    # A chunked prefill: 23 tokens, then 18 more with the cache (past the decode step's 16 queries).
    self_extend_attention(stepping, q[:, :, :23], k[:, :, :23], v[:, :, :23], None, position_ids=torch.arange(23)[None])
    rows = [1, 0] if reorder else [0, 1]  # beam search reorders the cache between steps
    step = (q[rows, :, 23:], k[rows], v[rows])
    out, _ = self_extend_attention(stepping, *step, None, position_ids=torch.arange(23, 41)[None])
    expected, _ = self_extend_attention(module(), *step, None, position_ids=torch.arange(23, 41)[None])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert stepping._hf_posext_self_extend.grouped_keys[0].shape[2] == 41


def test_left_padded_batch_matches_single_rows():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=12)
    long_row, short_row = _ids(90, seed=1)[0], _ids(75, seed=2)[0]
    batch = torch.stack((long_row, torch.cat((torch.zeros(15, dtype=torch.long), short_row))))
    mask = torch.ones_like(batch)
    mask[1, :15] = 0
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, **kwargs)
        alone = model.generate(short_row[None], **kwargs)
    assert torch.equal(together[1, 15:], alone[0])


def test_replace_not_compound_and_previous_frequency_patch_is_removed():
    model = tiny_model("llama")
    ids = _ids(150)
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=16)
    first = logits_of(model, ids)
    hf_posext.patch(model, "self-extend", group_size=2, neighbor_window=8)
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=16)
    torch.testing.assert_close(logits_of(model, ids), first, atol=0, rtol=0)
    hf_posext.patch(model, "yarn", factor=2)  # a frequency method replaces Self-Extend
    assert hf_posext.describe(model).kind == "rope"
    assert model.config._attn_implementation == "eager"
    with pytest.warns(UserWarning, match=r"self-extend replaced the yarn x2 frequency scaling: it runs on the model's original"):
        hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=16)  # and the other way round, said
    assert hf_posext.describe(model).method == "self-extend"
    torch.testing.assert_close(logits_of(model, ids), first, atol=0, rtol=0)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    hf_posext.patch(model, "self-extend", group_size=3, neighbor_window=16)
    ids = _ids(150)
    expected = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hf_posext"]["kind"] == "attention"
    assert "hf_posext_self_extend" not in json.dumps(saved)  # stock transformers can still load it
    loaded = hf_posext.load(tmp_path)
    assert hf_posext.describe(loaded).params["group_size"] == 3
    torch.testing.assert_close(logits_of(loaded, ids), expected, atol=1e-5, rtol=1e-5)
    hf_posext.unpatch(loaded)
    assert not hasattr(loaded.config, "hf_posext")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "needs its size"),
        ({"group_size": 0}, "group_size must be an integer"),
        ({"group_size": 2.5}, "group_size must be an integer"),
        ({"group_size": 2, "neighbor_window": 64}, "smaller than the model's original window"),
        ({"group_size": 2, "neighbor_windw": 8}, "Did you mean 'neighbor_window'"),
        ({"factor": 0.5}, "below 1"),
        ({"factor": 8, "group_size": 2, "neighbor_window": 16}, "use group_size >= 11"),
        ({"factor": 2, "target_length": 128}, "exactly one"),
    ],
)
def test_bad_settings_raise_clear_errors_and_leave_the_model_untouched(kwargs, message):
    model = tiny_model("llama")
    before = dict(model.config.__dict__)
    with pytest.raises(ValueError, match=message):
        hf_posext.patch(model, "self-extend", **kwargs)
    assert model.config.__dict__ == before
    assert not self_extend.is_patched(model)


def test_the_old_parameter_name_window_still_works_with_a_warning(tmp_path):
    model = tiny_model("llama")
    ids = _ids(200)
    with pytest.warns(FutureWarning, match="'window' is now called 'neighbor_window'"):
        hf_posext.patch(model, "self-extend", group_size=4, window=12)
    assert hf_posext.describe(model).params["neighbor_window"] == 12
    old_name = logits_of(model, ids)
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=12)
    torch.testing.assert_close(logits_of(model, ids), old_name, atol=0, rtol=0)
    with pytest.raises(ValueError, match="give neighbor_window= only"):
        hf_posext.patch(model, "self-extend", group_size=4, window=12, neighbor_window=12)
    # A folder saved before the rename records "window": it loads to the same model.
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hf_posext"]["params"] = {"group_size": 4, "window": 12}
    config["hf_posext"].pop("digest")  # such a folder predates the record's digest too
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(logits_of(hf_posext.load(tmp_path), ids), old_name, atol=0, rtol=0)


def test_model_whose_attention_bypasses_the_registry_is_refused():
    model = model_bypassing_the_attention_registry()
    before = dict(model.config.__dict__)
    with pytest.raises(UnsupportedModelError, match="registry"):
        hf_posext.patch(model, "self-extend", group_size=2, neighbor_window=8)
    assert model.config.__dict__ == before


def test_absolute_position_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=128))
    with pytest.raises(ValueError):
        hf_posext.patch(model, "self-extend", group_size=2, neighbor_window=8)
