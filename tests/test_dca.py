"""Dual Chunk Attention against an independent construction of the paper's three position-index sets.

The reference below is written from An et al. 2024 (section 3, "Dual Chunk Attention"), not from our
code: it takes q and k *before* any rotation, builds the key index set and the intra-, successive- and
inter-chunk query index sets as plain Python lists, rotates q and k to them in float64 and picks each
score by how many chunks separate query and key. Tiny Llama models with a large init range (0.1) so
that their logits depend strongly on position.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import dual_chunk, dual_chunk_kernels
from hf_posext.backends.attention.dual_chunk import DualChunkLayerSettings, dual_chunk_decode, dual_chunk_explicit, dual_chunk_fused
from hf_posext.methods.dual_chunk import relative_distance
from hf_posext.models import tiny_model
from tests.conftest import assert_close_guarding, logits_of, model_bypassing_the_attention_registry, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

CHUNK_SIZE, LOCAL_WINDOW = 24, 4  # chunks of 20 tokens on a 64-token model


def _ids(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _model(implementation: str = "sdpa"):
    model = tiny_model("llama", initializer_range=0.1)
    model.set_attn_implementation(implementation)
    return model


# --------------------------------------------------------------------------------------------------
# The reference construction (slow, float64, from the paper)
# --------------------------------------------------------------------------------------------------


def _index_sets(length: int, chunk_size: int, local_window: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """P_k, P_q^intra, P_q^succ, P_q^inter for positions 0..length-1, as the paper lists them.

    Chunk length s = chunk_size - local_window. Keys and intra-chunk queries: [0, 1, ..., s-1] repeated.
    Successive-chunk queries: [s, s+1, ..., s+w-1, then chunk_size for the rest of the chunk], repeated
    (w = local_window). Inter-chunk queries: one constant, the largest index, min(2s - 1, chunk_size).
    """
    s = chunk_size - local_window
    within = [0 + r for r in range(s)]
    successive = [s + r if r < local_window else chunk_size for r in range(s)]
    keys = [within[p % s] for p in range(length)]
    intra = [within[p % s] for p in range(length)]
    succ = [successive[p % s] for p in range(length)]
    inter = [min(2 * s - 1, chunk_size)] * length
    return keys, intra, succ, inter


def _rope64(states: torch.Tensor, positions: list[int], inv_freq: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE of raw ``states`` [B, H, T, D] at ``positions``, in float64."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = states.shape[-1] // 2
    x = states.double()
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference_attention(q, k, v, inv_freq, chunk_size, local_window, scaling=None):
    """The paper's Dual Chunk Attention on raw (unrotated) q [B,H,T,D], k and v [B,H,T,D]: [B,T,H,D] float64."""
    length = q.shape[2]
    s = chunk_size - local_window
    keys, intra, succ, inter = _index_sets(length, chunk_size, local_window)
    k_rot = _rope64(k, keys, inv_freq)
    scores = {name: _rope64(q, indices, inv_freq) @ k_rot.transpose(2, 3) for name, indices in
              (("intra", intra), ("succ", succ), ("inter", inter))}
    out = torch.empty(q.shape[:3] + (length,), dtype=torch.float64)
    for i in range(length):
        for j in range(length):
            gap = i // s - j // s
            name = "intra" if gap <= 0 else "succ" if gap == 1 else "inter"
            out[:, :, i, j] = scores[name][:, :, i, j]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    causal = torch.arange(length)[:, None] >= torch.arange(length)[None, :]
    out = (out * scaling).masked_fill(~causal, float("-inf"))
    return (torch.softmax(out, -1) @ v.double()).transpose(1, 2)


def _layer(inv_freq, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, mask_kind="sdpa"):
    return DualChunkLayerSettings(inv_freq.double(), inv_freq.numel() * 2, False, chunk_size, local_window, mask_kind)


# --------------------------------------------------------------------------------------------------
# Kernels against the reference
# --------------------------------------------------------------------------------------------------


def test_relative_distance_stays_inside_chunk_size_and_is_exact_where_the_paper_says():
    chunk_size, local_window = 24, 4
    s = chunk_size - local_window
    for i in range(0, 130):
        for j in range(0, i + 1):
            d = relative_distance(i, j, chunk_size, local_window)
            assert 0 <= d <= chunk_size
            if i // s == j // s or (i // s == j // s + 1 and i % s < local_window):
                assert d == i - j  # intra-chunk, and the local window of the successive chunk: true distances


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused CPU kernel / explicit fallback
@pytest.mark.parametrize("block", [2048, 7])
def test_kernels_match_the_reference_construction(dtype, block):
    torch.manual_seed(0)
    length = 97  # chunks of 20: five chunks, the last one partial
    q, k, v = torch.randn(1, 4, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)  # grouped-query
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    expected = reference_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), inv_freq, CHUNK_SIZE, LOCAL_WINDOW)
    true = list(range(length))
    rq, rk = _rope64(q, true, inv_freq).to(dtype), _rope64(k, true, inv_freq).to(dtype)
    pos = torch.arange(length)[None]
    layer = _layer(inv_freq)
    explicit = dual_chunk_explicit(rq, rk, v.to(dtype), None, pos, pos, layer, 8 ** -0.5, block_elements=4 * 3 * length * block)
    fused = dual_chunk_fused(rq, rk, v.to(dtype), None, 0, layer, 8 ** -0.5, block=block)
    assert explicit.dtype == fused.dtype == dtype
    torch.testing.assert_close(explicit.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.double(), expected, atol=1e-5, rtol=1e-5)
    # The last 13 queries against the whole cache (what a chunked prefill with a KV cache computes).
    tail = dual_chunk_fused(rq[:, :, -13:], rk, v.to(dtype), None, length - 13, layer, 8 ** -0.5, block=block)
    torch.testing.assert_close(tail.double(), expected[:, -13:], atol=1e-5, rtol=1e-5)
    step = dual_chunk_explicit(rq[:, :, -1:], rk, v.to(dtype), None, pos[:, -1:], pos, layer, 8 ** -0.5)
    torch.testing.assert_close(step.double(), expected[:, -1:], atol=1e-5, rtol=1e-5)


def test_kernels_take_a_padding_mask():
    torch.manual_seed(1)
    length = 70
    q, k, v = torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    true = list(range(length))
    rq, rk = _rope64(q, true, inv_freq).float(), _rope64(k, true, inv_freq).float()
    pos = torch.arange(length)[None]
    mask = torch.ones(1, 1, length, length, dtype=torch.bool).tril()
    mask[..., 5] = False
    mask[..., 30:33] = False
    layer = _layer(inv_freq)
    explicit = dual_chunk_explicit(rq, rk, v, mask, pos, pos, layer, 8 ** -0.5)
    fused = dual_chunk_fused(rq, rk, v, mask, 0, layer, 8 ** -0.5, block=9)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    unmasked = dual_chunk_explicit(rq, rk, v, None, pos, pos, layer, 8 ** -0.5)
    assert (unmasked - explicit).abs().max() > 1e-2  # the mask mattered


def _decode_case(rows: int, layout: str, mask: str | None, seed: int = 0):
    """Rotated q/k/v of 97 tokens (five chunks of 20), batch 2, grouped-query, and the last ``rows`` queries."""
    torch.manual_seed(seed)
    length, head_dim = 97, 8
    rotary_dim = 4 if layout == "partial" else 8
    q, k, v = torch.randn(2, 4, length, head_dim), torch.randn(2, 2, length, head_dim), torch.randn(2, 2, length, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    layer = DualChunkLayerSettings(inv_freq, rotary_dim, layout == "interleaved", CHUNK_SIZE, LOCAL_WINDOW, "sdpa")
    attention_mask = None
    if mask is not None:
        allowed = torch.ones(2, 1, rows, length, dtype=torch.bool).tril(length - rows)
        allowed[0, ..., 3] = False
        allowed[1, ..., 40:44] = False
        attention_mask = allowed if mask == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return q, k, v, attention_mask, layer, torch.arange(length)[None]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved", "partial"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_decode_step_equals_the_explicit_and_prefill_paths(rows, layout, mask):
    """The few-kernel decode step against the explicit pass on the same step and against the fused prefill's
    last rows; the unchunked (plain) attention is the effect it guards."""
    q, k, v, attention_mask, layer, pos = _decode_case(rows, layout, mask)
    scaling = 8 ** -0.5
    step_positions = pos[:, -rows:].clone()
    new = dual_chunk_decode(q[:, :, -rows:], k, v, attention_mask, step_positions, layer, scaling)
    old = dual_chunk_explicit(q[:, :, -rows:], k, v, attention_mask, step_positions, pos, layer, scaling)
    plain = dual_chunk_explicit(q[:, :, -rows:], k, v, attention_mask, step_positions, pos, dataclasses.replace(layer, chunk_size=None), scaling)
    assert_close_guarding(new, old, plain, atol=1e-5, rtol=1e-5)
    if mask is None:
        prefill = dual_chunk_fused(q, k, v, None, 0, layer, scaling)[:, -rows:]
        assert_close_guarding(new, prefill, plain, atol=1e-5, rtol=1e-5)
    # The tables built by this call serve the next layer of the step (same position_ids tensor) and no other step.
    again = dual_chunk_decode(q[:, :, -rows:] * 0.5, k, v, attention_mask, step_positions, layer, scaling)
    torch.testing.assert_close(again, dual_chunk_explicit(q[:, :, -rows:] * 0.5, k, v, attention_mask, step_positions, pos, layer, scaling),
                               atol=1e-5, rtol=1e-5)
    shorter = dual_chunk_decode(q[:, :, -rows - 1:-1], k[:, :, :-1], v[:, :, :-1], None, step_positions - 1, layer, scaling)
    torch.testing.assert_close(shorter, dual_chunk_fused(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], None, 0, layer, scaling)[:, -rows:],
                               atol=1e-5, rtol=1e-5)


def test_decode_step_check_fails_with_a_wrong_position_set(monkeypatch):
    """A broken decode step (inter-chunk queries one position off) is caught by the comparison above."""
    real = dual_chunk_kernels._query_offsets_by_distance

    def one_off(*args, **kwargs):
        offsets, distances = real(*args, **kwargs)
        return offsets + (torch.arange(distances) >= 2).view(-1, *([1] * (offsets.dim() - 1))), distances

    monkeypatch.setattr(dual_chunk_kernels, "_query_offsets_by_distance", one_off)
    dual_chunk.clear_decode_tables()
    q, k, v, _, layer, pos = _decode_case(1, "rotate_half", None)
    new = dual_chunk_decode(q[:, :, -1:], k, v, None, pos[:, -1:].clone(), layer, 8 ** -0.5)
    prefill = dual_chunk_fused(q, k, v, None, 0, layer, 8 ** -0.5)[:, -1:]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(new, prefill, atol=1e-5, rtol=1e-5)
    dual_chunk.clear_decode_tables()


# --------------------------------------------------------------------------------------------------
# The patched model against the reference
# --------------------------------------------------------------------------------------------------


def _reference_model_logits(model, ids):
    """Logits of ``model`` (unpatched) with its attention replaced by :func:`reference_attention`.

    transformers hands the attention function q and k already rotated to their true positions; the
    reference un-rotates them (float64) and applies the paper's construction to the raw vectors.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    inv_freq = model.model.rotary_emb.inv_freq.double()

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        length = query.shape[2]
        back = [-p for p in range(length)]
        raw_q, raw_k = _rope64(query, back, inv_freq), _rope64(key, back, inv_freq)
        groups = query.shape[1] // key.shape[1]
        out = reference_attention(raw_q, raw_k.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                  inv_freq, CHUNK_SIZE, LOCAL_WINDOW, scaling)
        return out.to(query.dtype), None

    AttentionInterface.register("dca_reference_test", attention)
    AttentionMaskInterface.register("dca_reference_test", sdpa_mask)
    model.set_attn_implementation("dca_reference_test")
    try:
        return logits_of(model, ids, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_patched_model_matches_the_reference_construction(implementation):
    ids = _ids(110)
    reference = _reference_model_logits(_model(), ids)
    model = _model(implementation)
    unpatched = logits_of(model, ids)
    hf_posext.patch(model, "dca", factor=2, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    patched = logits_of(model, ids)
    torch.testing.assert_close(patched, reference, atol=1e-5, rtol=1e-5)
    assert (patched - unpatched).abs().max() > 0.1  # what the tolerance guards: >= 1e4 x atol


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_identity_when_the_sequence_fits_in_one_chunk(implementation):
    model = _model(implementation)
    ids = _ids(20)  # chunk length 24 - 4 = 20
    before = logits_of(model, ids)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    after = logits_of(model, ids)
    if implementation == "sdpa":
        assert torch.equal(after, before)  # transformers' own SDPA function runs
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    longer = _ids(60)
    assert (logits_of(model, longer)[:, 20:] - logits_of(_model(implementation), longer)[:, 20:]).abs().max() > 0.1


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_cached_generation_equals_full_recompute(implementation):
    model = _model(implementation)
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    assert model.config._attn_implementation == dual_chunk.IMPLEMENTATIONS[implementation]
    ids = _ids(130)
    full = logits_of(model, ids)
    for prefix, step in ((50, 1), (30, 25), (97, 3)):  # one token at a time; chunks past the decode limit
        with torch.no_grad():
            out = model(ids[:, :prefix], use_cache=True)
            cache, parts = out.past_key_values, [out.logits]
            for start in range(prefix, 130, step):
                out = model(ids[:, start : start + step], past_key_values=cache, use_cache=True)
                cache, parts = out.past_key_values, parts + [out.logits]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids[:, :70], use_cache=True, **kwargs)
        uncached = model.generate(ids[:, :70], use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_left_padded_batch_matches_single_rows():
    model = _model("sdpa")
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    long_row, short_row = _ids(90, seed=1)[0], _ids(75, seed=2)[0]
    batch = torch.stack((long_row, torch.cat((torch.zeros(15, dtype=torch.long), short_row))))
    mask = torch.ones_like(batch)
    mask[1, :15] = 0
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, **kwargs)
        alone = model.generate(short_row[None], **kwargs)
    assert torch.equal(together[1, 15:], alone[0])


def test_unpatch_restores_everything_bit_for_bit():
    model = _model("sdpa")
    ids = _ids(100)
    before_logits = logits_of(model, ids)
    before_config = json.loads(model.config.to_json_string())
    before_dict = dict(model.config.__dict__)
    hf_posext.patch(model, "dca", factor=4)
    assert model.config.dual_chunk_attention_config == {"chunk_size": 48, "local_size": 4}  # no length scale: no L there
    assert model.config.max_position_embeddings == 256
    hf_posext.patch(model, "dca", factor=2, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)  # replaces, never compounds
    hf_posext.unpatch(model)
    assert model.config.__dict__ == before_dict
    assert json.loads(model.config.to_json_string()) == before_config
    assert torch.equal(logits_of(model, ids), before_logits)
    assert not any(hasattr(m, "_hf_posext_dca") for m in model.modules())


def test_paper_defaults_describe_and_replacement_by_other_methods():
    model = _model("sdpa")
    hf_posext.patch(model, "dca", target_length=512)
    report = hf_posext.describe(model)
    assert (report.kind, report.method, report.factor, report.current_window) == ("attention", "dca", 8.0, 512)
    assert report.params["chunk_size"] == 48 and report.params["local_window"] == 4  # 3L/4 and L/16 of 64
    ids = _ids(150)
    first = logits_of(model, ids)
    hf_posext.patch(model, "self-extend", group_size=4, neighbor_window=16)  # another attention-level method replaces it
    assert hf_posext.describe(model).method == "self-extend" and not dual_chunk.is_patched(model)
    hf_posext.patch(model, "yarn", factor=2)  # and a frequency method
    assert hf_posext.describe(model).kind == "rope" and not dual_chunk.is_patched(model)
    hf_posext.patch(model, "dca", target_length=512)
    torch.testing.assert_close(logits_of(model, ids), first, atol=0, rtol=0)
    assert "dca" in hf_posext.available_methods()


def test_save_and_load_round_trip_writes_vllms_fields(tmp_path):
    model = _model("sdpa")
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    ids = _ids(130)
    expected = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dual_chunk_attention_config"] == {"chunk_size": 24, "local_size": 4}
    assert saved["max_position_embeddings"] == 256
    assert saved["hf_posext"]["method"] == "dca" and "hf_posext_dca" not in json.dumps(saved)
    loaded = hf_posext.load(tmp_path)
    assert hf_posext.describe(loaded).params["chunk_size"] == CHUNK_SIZE
    torch.testing.assert_close(logits_of(loaded, ids), expected, atol=1e-5, rtol=1e-5)
    hf_posext.unpatch(loaded)
    assert loaded.config.max_position_embeddings == 64 and not hasattr(loaded.config, "dual_chunk_attention_config")
    # vLLM's fields are what load reads: an edit there is what the loaded model runs.
    saved["dual_chunk_attention_config"]["chunk_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert hf_posext.describe(hf_posext.load(tmp_path)).params["chunk_size"] == 32


@pytest.mark.parametrize("qwen2", [False, True])
def test_checkpoint_with_only_vllms_field_loads_with_dca(tmp_path, qwen2):
    """A Qwen2.5-1M-style config.json: dual_chunk_attention_config and a raised max_position_embeddings,
    no hf_posext record. hf_posext.load applies DCA from the field; a malformed field is one clear error."""
    from hf_posext.core.errors import RecordError

    model = tiny_model("qwen2" if qwen2 else "llama", initializer_range=0.1)
    model.set_attn_implementation("sdpa")
    ids = _ids(130)
    unpatched = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    # Qwen2.5-1M's field holds original_max_position_embeddings: SGLang scales, so load does too.
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW, attention_scale=True)
    expected = logits_of(model, ids)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "hf_posext" not in config and config["max_position_embeddings"] == 64
    field = {"chunk_size": CHUNK_SIZE, "local_size": LOCAL_WINDOW, "original_max_position_embeddings": 64}
    config.update(max_position_embeddings=256, dual_chunk_attention_config=field)  # as Qwen2.5-1M's config.json
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = hf_posext.load(tmp_path)
    report = hf_posext.describe(loaded)
    assert (report.method, report.factor, report.original_window, report.current_window) == ("dca", 4.0, 64, 256)
    assert report.params["chunk_size"] == CHUNK_SIZE and report.params["local_window"] == LOCAL_WINDOW
    assert report.params["attention_scale"] is True
    assert_close_guarding(logits_of(loaded, ids), expected, unpatched, atol=1e-5, rtol=1e-5)
    for bad, message in (
        ({"chunk_size": 24}, "needs integer chunk_size and local_size"),
        ({"chunk_size": 24, "local_size": 24}, "local_window"),
        ({"chunk_size": 24, "local_size": 4, "original_max_position_embeddings": 16}, "chunk_size"),
        ([24, 4], "must be an object"),
    ):
        config["dual_chunk_attention_config"] = bad
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(RecordError, match=message) as error:
            hf_posext.load(tmp_path)
        assert "dual_chunk_attention_config" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "method, kwargs, message",
    [
        ("dca", {"factor": 4, "chunk_size": 65}, "larger than the model's original window"),
        ("dca", {"factor": 4, "chunk_size": 24, "local_window": 24}, "must be smaller than chunk_size"),
        ("dca", {"factor": 4, "local_window": 48}, "must be smaller than chunk_size"),
        ("dca", {"factor": 4, "chunk_size": 2.5}, "chunk_size must be an integer"),
        ("dca", {"factor": 4, "chunk_sise": 24}, "Did you mean 'chunk_size'"),
        ("dca", {"factor": 4, "beta_fast": 32}, "has no parameter 'beta_fast'"),
        ("dca", {}, "needs its size"),
        ("dca+string", {"factor": 4}, "stacks two attention-level methods"),
        ("yarn+dca", {"factor": 4, "dca.factor": 2}, r"'dca.factor': a composition has one size, its frequency part's"),
    ],
)
def test_bad_input_is_one_clear_error_and_leaves_the_model_untouched(method, kwargs, message):
    model = _model("sdpa")
    hf_posext.patch(model, "self-extend", group_size=2, neighbor_window=8)  # a previous patch must survive too
    before = dict(model.config.__dict__)
    with pytest.raises(ValueError, match=message) as error:
        hf_posext.patch(model, method, **kwargs)
    assert "\n" not in str(error.value)
    assert model.config.__dict__ == before
    assert not dual_chunk.is_patched(model) and hf_posext.describe(model).method == "self-extend"


def test_model_without_rope_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=128))
    before = dict(model.config.__dict__)
    with pytest.raises(ValueError, match="rope|RoPE|rotary|learned|attention"):
        hf_posext.patch(model, "dca", factor=2)
    assert model.config.__dict__ == before


def test_attention_bypassing_the_registry_is_refused():
    from hf_posext.core.errors import UnsupportedModelError

    model = model_bypassing_the_attention_registry()
    before = dict(model.config.__dict__)
    with pytest.raises(UnsupportedModelError, match="Dual Chunk Attention cannot be applied"):
        hf_posext.patch(model, "dca", factor=2)
    assert model.config.__dict__ == before


def test_gradients_flow_through_the_explicit_path():
    model = _model("sdpa")
    hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
    ids = _ids(70)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item()) and model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["gemma3", "gpt_neox", "gptj", "phi", "qwen2"])
def test_other_families_sdpa_eager_and_cache_agree(family):
    """Partial rotary (gpt_neox, phi), interleaved pairs and a fixed sin/cos table (gptj), sliding layers
    left plain (gemma3): the fused path, the explicit path and the cache agree."""
    ids = _ids(90)
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model(family, initializer_range=0.1)
        model.set_attn_implementation(implementation)
        unpatched = logits_of(model, ids[:, :60])  # GPT-J's own sin/cos table stops at 64
        hf_posext.patch(model, "dca", factor=4, chunk_size=CHUNK_SIZE, local_window=LOCAL_WINDOW)
        outputs[implementation] = full = logits_of(model, ids)
        assert (full[:, :60] - unpatched).abs().max() > 1e-3
        with torch.no_grad():
            out = model(ids[:, :60], use_cache=True)
            cache, parts = out.past_key_values, [out.logits]
            for start in range(60, 90):
                out = model(ids[:, start : start + 1], past_key_values=cache, use_cache=True)
                cache, parts = out.past_key_values, parts + [out.logits]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], atol=1e-5, rtol=1e-5)
