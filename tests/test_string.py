"""STRING against an independent construction of the paper's position matrix.

The reference below is written from An et al. 2025 (ICLR, "Why Does the Effective Context Length of LLMs
Fall Short?", section 4: STRING), not from our code: it writes the relative-position matrix out as a plain
Python list of lists, ``P[i][j] = i - j`` when ``i - j < S`` and ``i - j - S + w`` otherwise, takes q and k
*before* any rotation, and scores every pair in float64 with q rotated to ``P[i][j]`` and k at 0 (RoPE
scores depend only on the difference). The broken variant it guards against is the shift without the
local value (``i - j - S``, the matrix's older part starting at 0). Tiny Llama models with a large init
range (0.1) so that their logits depend strongly on position.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import hf_posext
from hf_posext.backends.attention import shifted_positions
from hf_posext.backends.attention.shifted_positions import StringLayerSettings, string_explicit, string_split
from hf_posext.methods.shifted_positions import REFERENCE_ATTENTION_FACTOR, max_covered_length, relative_distance
from hf_posext.models import tiny_model
from tests.conftest import assert_close_guarding, logits_of, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="attention registry dispatch as in transformers 5.x")

WINDOW = 64  # the tiny Llama's max_position_embeddings
SHIFT, LOCAL = 24, 6


def _ids(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _model(implementation: str = "sdpa", **overrides):
    model = tiny_model("llama", initializer_range=0.1, **overrides)
    model.set_attn_implementation(implementation)
    return model


# --------------------------------------------------------------------------------------------------
# The reference construction (slow, float64, from the paper)
# --------------------------------------------------------------------------------------------------


def position_matrix(length: int, shift: int, local: int, drop_local: bool = False) -> list[list[int]]:
    """The paper's STRING relative-position matrix (lower triangle; -1 above the diagonal)."""
    rows = []
    for i in range(length):
        row = []
        for j in range(length):
            d = i - j
            if d < 0:
                row.append(-1)
            elif d < shift:
                row.append(d)
            else:
                row.append(d - shift + (0 if drop_local else local))
        rows.append(row)
    return rows


def _rope64(states: torch.Tensor, positions: list[int], inv_freq: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE of raw ``states`` [B, H, T, D] at ``positions``, in float64."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = states.shape[-1] // 2
    x = states.double()
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference_attention(q, k, v, inv_freq, shift, local, scaling=None, drop_local=False):
    """STRING on raw (unrotated) q, k, v ``[B, H, T, D]``: ``[B, T, H, D]`` float64."""
    length = q.shape[2]
    matrix = position_matrix(length, shift, local, drop_local)
    raw_k = k.double()
    scores = torch.full(q.shape[:3] + (length,), float("-inf"), dtype=torch.float64)
    for p in sorted({p for row in matrix for p in row if p >= 0}):
        at_p = _rope64(q, [p] * length, inv_freq) @ raw_k.transpose(2, 3)  # q at position p, every k at 0
        for i in range(length):
            for j in range(i + 1):
                if matrix[i][j] == p:
                    scores[:, :, i, j] = at_p[:, :, i, j]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return (torch.softmax(scores * scaling, -1) @ v.double()).transpose(1, 2)


def _reference_logits(model, ids, shift=SHIFT, local=LOCAL, drop_local=False, factor=1.0, cached=None):
    """Logits of the unpatched ``model`` with attention replaced by :func:`reference_attention`.

    transformers hands attention q and k rotated to their true positions; the reference un-rotates them
    (float64). A call with fewer queries than keys (a cached step) scores zero rows in front of the real
    queries and keeps the last rows. ``cached``: (prefix, step) to run a prefill then cached calls.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    inv_freq = model.model.rotary_emb.inv_freq.double()

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        groups = query.shape[1] // key.shape[1]
        back = [-p for p in range(kv_len)]
        padded = torch.cat((query.new_zeros(query.shape[0], query.shape[1], kv_len - q_len, query.shape[3]), query), 2)
        raw_q, raw_k = _rope64(padded, back, inv_freq), _rope64(key, back, inv_freq)
        out = reference_attention(raw_q, raw_k.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                  inv_freq, shift, local, scaling * factor ** 2, drop_local)
        return out[:, kv_len - q_len:].to(query.dtype), None

    AttentionInterface.register("string_reference_test", attention)
    AttentionMaskInterface.register("string_reference_test", sdpa_mask)
    model.set_attn_implementation("string_reference_test")
    try:
        return logits_of(model, ids, use_cache=False) if cached is None else _cached_logits(model, ids, *cached)
    finally:
        model.set_attn_implementation("sdpa")


def _cached_logits(model, ids, prefix, step):
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for start in range(prefix, ids.shape[1], step):
            out = model(ids[:, start : start + step], past_key_values=cache, use_cache=True)
            cache, parts = out.past_key_values, parts + [out.logits]
    return torch.cat(parts, 1)


def _layer(inv_freq, shift=SHIFT, local=LOCAL, mask_kind="sdpa", rotary_dim=None):
    rotary_dim = inv_freq.numel() * 2 if rotary_dim is None else rotary_dim
    return StringLayerSettings(inv_freq.double(), rotary_dim, False, shift, local, 1.0, mask_kind)


# --------------------------------------------------------------------------------------------------
# The rule and the kernels against the reference
# --------------------------------------------------------------------------------------------------


def test_position_rule_keeps_near_distances_and_drops_the_largest():
    matrix = position_matrix(100, SHIFT, LOCAL)
    for i in range(100):
        for j in range(i + 1):
            assert relative_distance(i, j, SHIFT, LOCAL) == matrix[i][j]
    assert max(max(row) for row in matrix) == 99 - SHIFT + LOCAL  # the SHIFT - LOCAL largest never used
    assert max_covered_length(WINDOW, SHIFT, LOCAL) == WINDOW + SHIFT - LOCAL
    longest = position_matrix(max_covered_length(WINDOW, SHIFT, LOCAL), SHIFT, LOCAL)
    assert max(max(row) for row in longest) == WINDOW - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused CPU kernel / explicit fallback
@pytest.mark.parametrize("block", [512, 7])
def test_kernels_match_the_reference_construction(dtype, block):
    torch.manual_seed(0)
    length = 97
    q, k, v = torch.randn(1, 4, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)  # grouped-query
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    expected = reference_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), inv_freq, SHIFT, LOCAL)
    broken = reference_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), inv_freq, SHIFT, LOCAL, drop_local=True)
    true = list(range(length))
    rq, rk = _rope64(q, true, inv_freq).to(dtype), _rope64(k, true, inv_freq).to(dtype)
    pos = torch.arange(length)[None]
    layer = _layer(inv_freq)
    explicit = string_explicit(rq, rk, v.to(dtype), None, pos, pos, layer, 8 ** -0.5, block_elements=4 * 2 * length * block)
    split = string_split(rq, rk, v.to(dtype), None, 0, layer, 8 ** -0.5, block=block)
    assert explicit.dtype == split.dtype == dtype
    assert_close_guarding(explicit.double(), expected, broken, atol=1e-5, rtol=1e-5)
    assert_close_guarding(split.double(), expected, broken, atol=1e-5, rtol=1e-5)
    # The last 13 queries against the whole cache (a chunked prefill) and one decode step.
    tail = string_split(rq[:, :, -13:], rk, v.to(dtype), None, length - 13, layer, 8 ** -0.5, block=block)
    torch.testing.assert_close(tail.double(), expected[:, -13:], atol=1e-5, rtol=1e-5)
    step = string_explicit(rq[:, :, -1:], rk, v.to(dtype), None, pos[:, -1:], pos, layer, 8 ** -0.5)
    torch.testing.assert_close(step.double(), expected[:, -1:], atol=1e-5, rtol=1e-5)


def test_kernels_take_a_padding_mask():
    torch.manual_seed(1)
    length, pads = 70, 9
    q, k, v = torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    real = length - pads
    expected = reference_attention(q[:, :, pads:], k[:, :, pads:], v[:, :, pads:], inv_freq, SHIFT, LOCAL)
    positions = torch.arange(length)[None] - pads  # left padding: the real tokens start at 0
    rq = _rope64(q, positions[0].tolist(), inv_freq).float()
    rk = _rope64(k, positions[0].tolist(), inv_freq).float()
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None].clone()
    mask[..., :pads] = False
    layer = _layer(inv_freq)
    for output in (string_explicit(rq, rk, v, mask, positions, positions, layer, 8 ** -0.5),
                   string_split(rq, rk, v, mask, -pads, layer, 8 ** -0.5, block=16),
                   string_explicit(rq, rk, v, torch.zeros(mask.shape).masked_fill(~mask, float("-inf")), positions, positions,
                                   dataclass_replace(layer, mask_kind="eager"), 8 ** -0.5)):
        torch.testing.assert_close(output[:, pads:].double(), expected, atol=1e-5, rtol=1e-5)
    assert real > SHIFT  # the shift is exercised


def test_blocks_that_write_out_their_scores_stay_bounded(monkeypatch):
    """Without a mask (float32 on CPU: the fused kernel) a prefill runs in blocks as large as asked; with a padding
    mask, whose calls write out [rows, keys], or a dtype without a fused kernel, the blocks shrink so that the
    scores stay under SCORE_BLOCK_ELEMENTS (here made tiny), never below MASKED_QUERY_BLOCK."""
    torch.manual_seed(2)
    length = 70
    q, k, v = torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).double() / 8))
    layer = _layer(inv_freq)
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None].clone()
    rows = []
    real = shifted_positions.attention_with_lse

    def spy(query, key, value, mask_, scaling, is_causal=False):
        rows.append(query.shape[2])
        return real(query, key, value, mask_, scaling, is_causal=is_causal)

    monkeypatch.setattr(shifted_positions, "attention_with_lse", spy)
    monkeypatch.setattr(shifted_positions, "SCORE_BLOCK_ELEMENTS", 2 * length * 6)
    monkeypatch.setattr(shifted_positions, "MASKED_QUERY_BLOCK", 4)
    unmasked = string_split(q, k, v, None, 0, layer, 8 ** -0.5, block=64)
    assert max(rows) > 6  # one block: as asked (at most S)
    for tensors, given in (((q, k, v), mask), ((q.double(), k.double(), v.double()), None)):
        rows.clear()
        bounded = string_split(*tensors, given, 0, layer, 8 ** -0.5, block=64)
        assert max(rows) == 6  # 2 heads x 70 keys x 6 rows: the cap
        torch.testing.assert_close(bounded.float(), unmasked, atol=1e-5, rtol=1e-5)


def dataclass_replace(layer, **changes):
    import dataclasses

    return dataclasses.replace(layer, **changes)


# --------------------------------------------------------------------------------------------------
# The patched model
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_patched_model_matches_the_reference_construction(implementation):
    ids = _ids(110)
    reference = _reference_logits(_model(), ids)
    broken = _reference_logits(_model(), ids, drop_local=True)  # shift by -S instead of -S + w
    model = _model(implementation)
    unpatched = logits_of(model, ids)
    hf_posext.patch(model, "string", factor=2, shifted_offset=SHIFT, local_value=LOCAL)
    patched = logits_of(model, ids)
    assert_close_guarding(patched, reference, broken, atol=1e-5, rtol=1e-5)  # measured: 3.6e3 x the tolerance (kernels: 1.2e4 x)
    assert_close_guarding(patched, reference, unpatched, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_cached_decode_matches_the_reference_and_the_full_recompute(implementation):
    model = _model(implementation)
    hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL)
    assert model.config._attn_implementation == shifted_positions.IMPLEMENTATIONS[implementation]
    ids = _ids(130)
    full = logits_of(model, ids)
    torch.testing.assert_close(full, _reference_logits(_model(), ids), atol=1e-5, rtol=1e-5)
    for prefix, step in ((50, 1), (10, 1), (30, 25), (97, 3)):  # one token at a time; chunks past the decode limit
        torch.testing.assert_close(_cached_logits(model, ids, prefix, step), full, atol=1e-5, rtol=1e-5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids[:, :70], use_cache=True, **kwargs)
        uncached = model.generate(ids[:, :70], use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_paper_defaults_and_identity_below_the_shift():
    model = _model("sdpa")
    short = _ids(21)  # S = int(0.33 * 64) = 21: every distance of 21 tokens is below it
    before = logits_of(model, short)
    hf_posext.patch(model, "string")  # no factor: STRING's home is inside the window
    report = hf_posext.describe(model)
    assert (report.method, report.factor, report.current_window) == ("string", 1.0, WINDOW)
    assert report.params["shifted_offset"] == 21 and report.params["local_value"] == 10  # min(128, S // 2) on 64 tokens
    assert torch.equal(logits_of(model, short), before)  # transformers' own SDPA function runs
    with torch.no_grad():
        assert torch.equal(model.generate(short, max_new_tokens=1, do_sample=False, pad_token_id=0)[:, :21], short)
    longer = _ids(60)
    assert (logits_of(model, longer) - logits_of(_model(), longer)).abs().max() > 0.1
    assert "string" in hf_posext.available_methods()


def test_attention_factor_scales_q_and_k_as_the_reference_code():
    ids = _ids(90)
    model = _model("sdpa")
    hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL, attention_factor=REFERENCE_ATTENTION_FACTOR)
    expected = _reference_logits(_model(), ids, factor=REFERENCE_ATTENTION_FACTOR)
    assert_close_guarding(logits_of(model, ids), expected, _reference_logits(_model(), ids), atol=1e-5, rtol=1e-5)


def test_left_padded_batch_matches_single_rows():
    model = _model("sdpa")
    hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL)
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
    before_dict = dict(model.config.__dict__)
    before_json = json.loads(model.config.to_json_string())
    hf_posext.patch(model, "string", factor=4)
    assert model.config.max_position_embeddings == 256
    hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL)  # replaces, never compounds
    hf_posext.unpatch(model)
    assert model.config.__dict__ == before_dict
    assert json.loads(model.config.to_json_string()) == before_json
    assert torch.equal(logits_of(model, ids), before_logits)
    assert not any(hasattr(m, "_hf_posext_string") for m in model.modules())


def test_save_and_load_round_trip(tmp_path):
    model = _model("sdpa")
    hf_posext.patch(model, "string", factor=2, shifted_offset=SHIFT, local_value=LOCAL)
    ids = _ids(120)
    expected = logits_of(model, ids)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hf_posext"]["method"] == "string" and saved["max_position_embeddings"] == 128
    assert "_hf_posext_string" not in json.dumps(saved)
    loaded = hf_posext.load(tmp_path)
    report = hf_posext.describe(loaded)
    assert (report.method, report.params["shifted_offset"], report.params["local_value"]) == ("string", SHIFT, LOCAL)
    assert_close_guarding(logits_of(loaded, ids), expected, logits_of(_model(), ids), atol=1e-5, rtol=1e-5)
    hf_posext.unpatch(loaded)
    assert loaded.config.max_position_embeddings == WINDOW


@pytest.mark.parametrize("edit, message", [
    (lambda params: params.update(shifted_offset=WINDOW), r"config.json: field 'hf_posext'.params: shifted_offset=64 must be smaller"),
    (lambda params: params.update(shifted_offset=30, local_value=40), r"field 'hf_posext'.params: local_value=40 must be smaller"),
    (lambda params: params.pop("local_value"), r"field 'hf_posext'.params has no 'local_value'"),
    (lambda params: params.update(shifted_offset="24"), r"field 'hf_posext'.params: shifted_offset must be an integer >= 1, got '24'"),
], ids=["offset-beyond-window", "local-above-offset", "missing-field", "text"])
def test_an_impossible_saved_record_is_refused_naming_the_file_and_field_before_the_weights_load(tmp_path, monkeypatch, edit, message):
    from hf_posext.core.errors import RecordError

    model = _model("sdpa")
    hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config["hf_posext"]["params"])
    (tmp_path / "config.json").write_text(json.dumps(config))

    def weights_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the record was checked")

    monkeypatch.setattr(shifted_positions.registration, "load_unpatched", weights_load)
    with pytest.raises(RecordError, match=message) as error:
        hf_posext.load(tmp_path)
    assert "\n" not in str(error.value) and "{" not in str(error.value)  # the field is named, the record not dumped


def test_sizes_that_need_no_model_are_refused_where_the_request_is_parsed():
    """lm-eval's model args (and the CLI) refuse w >= S before the harness builds a model, as DCA's sizes are."""
    from hf_posext.core.request import ScalingRequest

    with pytest.raises(ValueError, match="local_value=8 must be smaller than shifted_offset=8"):
        ScalingRequest.from_model_args({"posext_method": "string", "posext_shifted_offset": "8", "posext_local_value": "8"})
    assert ScalingRequest.from_model_args({"posext_method": "string", "posext_shifted_offset": "9",
                                           "posext_local_value": "8"})[0].params_dict == {"local_value": 8, "shifted_offset": 9}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shifted_offset": 64}, "must be smaller than the model's original window"),
        ({"shifted_offset": 24, "local_value": 24}, "must be smaller than shifted_offset"),
        ({"shifted_offset": 8, "local_value": 30}, "must be smaller than shifted_offset"),
        ({"local_value": -1}, "local_value must be an integer >= 0"),
        ({"shifted_offset": 0}, "shifted_offset must be an integer >= 1"),
        ({"shifted_offset": 20.5}, "shifted_offset must be an integer"),
        ({"attention_factor": 0}, "attention_factor must be a positive number"),
        ({"shifted_ofset": 20}, "Did you mean 'shifted_offset'"),
        ({"factor": 0.5}, "factor"),
    ],
)
def test_bad_input_is_one_clear_error_and_leaves_the_model_untouched(kwargs, message):
    model = _model("sdpa")
    hf_posext.patch(model, "dca", factor=2, chunk_size=24, local_window=4)  # a previous patch must survive too
    before = dict(model.config.__dict__)
    with pytest.raises(ValueError, match=message) as error:
        hf_posext.patch(model, "string", **kwargs)
    assert "\n" not in str(error.value)
    assert model.config.__dict__ == before
    assert not shifted_positions.is_patched(model) and hf_posext.describe(model).method == "dca"


def test_composes_with_a_static_rope_scaling_in_the_models_own_config():
    """A model whose config carries YaRN (as loaded from a checkpoint saved that way): STRING shifts
    positions on YaRN's frequencies, and YaRN's attention factor stays in q and k."""
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW, "rope_theta": 10000.0}
    yarn = _model("sdpa", rope_parameters=rope, max_position_embeddings=2 * WINDOW)
    ids = _ids(120)
    unpatched = logits_of(yarn, ids)
    hf_posext.patch(yarn, "string", shifted_offset=SHIFT, local_value=LOCAL)
    reference = _reference_logits(_model("sdpa", rope_parameters=rope, max_position_embeddings=2 * WINDOW), ids)
    assert_close_guarding(logits_of(yarn, ids), reference, unpatched, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW, "rope_theta": 10000.0},
    # llama3 (Llama 3.1's type): the declared window is not original x factor there (8192 x 8 = 65536, not 131072)
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": WINDOW // 2, "rope_theta": 10000.0},
], ids=["yarn", "llama3"])
def test_defaults_follow_the_window_a_scaled_config_declares(rope):
    """The reference takes L = config.max_position_embeddings (131072 for Llama 3.1, whose llama3 scaling
    starts from 8192): on a model whose config carries a static scaling, S = int(0.33 L) of that window,
    and an S between the pre-scaling window and L is taken, not refused."""
    declared = 2 * WINDOW  # 128 tokens; the pre-scaling window is 64 (yarn) or 32 (llama3)
    model = _model("sdpa", rope_parameters=rope, max_position_embeddings=declared)
    ids = _ids(120)
    unpatched = logits_of(model, ids)
    hf_posext.patch(model, "string")
    report = hf_posext.describe(model)
    assert report.params["shifted_offset"] == int(0.33 * declared) == 42 and report.params["local_value"] == 21
    assert report.current_window == declared
    fresh = _model("sdpa", rope_parameters=rope, max_position_embeddings=declared)
    assert_close_guarding(logits_of(model, ids), _reference_logits(fresh, ids, shift=42, local=21), unpatched, atol=1e-5, rtol=1e-5)
    hf_posext.patch(model, "string", shifted_offset=100, local_value=8)  # >= the pre-scaling window, < L
    assert hf_posext.describe(model).params["shifted_offset"] == 100
    with pytest.raises(ValueError, match="shifted_offset=128 must be smaller"):
        hf_posext.patch(model, "string", shifted_offset=declared)


def test_string_on_a_saved_yarn_model_composes_and_replacing_yarn_is_said(tmp_path):
    """A model fine-tuned with yarn and saved: loaded with stock from_pretrained its config carries yarn and
    STRING runs on yarn's frequencies, silently; patched over hf_posext's own yarn (hf_posext.load) it replaces
    yarn, runs on the original frequencies, and says so."""
    from transformers import AutoModelForCausalLM

    model = _model("sdpa")
    hf_posext.patch(model, "yarn", factor=2)
    model.save_pretrained(tmp_path)
    ids = _ids(120)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path)
    stock.set_attn_implementation("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_posext.patch(stock, "string")
    assert hf_posext.describe(stock).params["shifted_offset"] == int(0.33 * 2 * WINDOW)  # L: the window yarn declares
    loaded = hf_posext.load(tmp_path)
    loaded.set_attn_implementation("sdpa")
    with pytest.warns(UserWarning, match=r"string replaced the yarn x2 frequency scaling: it runs on the model's original rotary"):
        hf_posext.patch(loaded, "string", shifted_offset=42, local_value=21)
    assert (logits_of(stock, ids) - logits_of(loaded, ids)).abs().max() > 0.1  # yarn's frequencies against the original ones


def test_gradients_flow_through_the_explicit_path():
    model = _model("sdpa")
    hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL)
    ids = _ids(70)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item()) and model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["gemma3", "gpt_neox", "gptj", "qwen2"])
def test_other_families_sdpa_eager_and_cache_agree(family):
    """Partial rotary (gpt_neox), interleaved pairs and a fixed sin/cos table (gptj), sliding layers left
    plain (gemma3): the fused path, the explicit path and the cache agree."""
    ids = _ids(90)
    outputs = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model(family, initializer_range=0.1)
        model.set_attn_implementation(implementation)
        unpatched = logits_of(model, ids[:, :60])  # GPT-J's own sin/cos table stops at 64
        hf_posext.patch(model, "string", shifted_offset=SHIFT, local_value=LOCAL)
        outputs[implementation] = full = logits_of(model, ids)
        assert (full[:, :60] - unpatched).abs().max() > 1e-3
        torch.testing.assert_close(_cached_logits(model, ids, 60, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["sdpa"], outputs["eager"], atol=1e-5, rtol=1e-5)
