"""Absolute positions: learned tables, sinusoidal encodings, ALiBi (hf_posext.backends.absolute.surgery, methods/learned.py).

Every model is a tiny random one built here (window 32); nothing is downloaded.
"""

from __future__ import annotations

import os
import warnings
from fractions import Fraction

import pytest
import torch
import transformers

import hf_posext
from hf_posext.backends.absolute import surgery as absolute
from hf_posext.methods import get_method
from hf_posext.methods.learned import MAX_TABLE_ROWS, exact_factor, interpolation_grid, linear_table

WINDOW = 32
VOCAB = 96
_IDS = dict(bos_token_id=0, eos_token_id=2, pad_token_id=1)

#: family -> (config class, config kwargs, auto class)
FAMILIES = {
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=WINDOW), "AutoModelForCausalLM"),
    "opt": ("OPTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                              max_position_embeddings=WINDOW, word_embed_proj_dim=32), "AutoModelForCausalLM"),
    "gpt_neo": ("GPTNeoConfig", dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=WINDOW,
                                     attention_types=[[["global", "local"], 1]], window_size=8), "AutoModelForCausalLM"),
    "biogpt": ("BioGptConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    max_position_embeddings=WINDOW), "AutoModelForCausalLM"),
    "bert": ("BertConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=WINDOW), "AutoModelForMaskedLM"),
    # RoBERTa's positions start at padding_idx + 1 = 2: 34 rows hold a 32-token window.
    "roberta": ("RobertaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=WINDOW + 2), "AutoModelForMaskedLM"),
    "xglm": ("XGLMConfig", dict(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64, max_position_embeddings=WINDOW),
             "AutoModelForCausalLM"),
    "bloom": ("BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4), "AutoModelForCausalLM"),
    "mpt": ("MptConfig", dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=WINDOW, expansion_ratio=2), "AutoModelForCausalLM"),
}
LEARNED = ["gpt2", "opt", "gpt_neo", "biogpt", "bert", "roberta"]
DECODERS = ["gpt2", "opt", "gpt_neo", "biogpt", "xglm", "mpt", "bloom"]
#: (table path, offset) of each learned family.
TABLES = {
    "gpt2": ("transformer.wpe", 0), "opt": ("model.decoder.embed_positions", 2), "gpt_neo": ("transformer.wpe", 0),
    "biogpt": ("biogpt.embed_positions", 2), "bert": ("bert.embeddings.position_embeddings", 0),
    "roberta": ("roberta.embeddings.position_embeddings", 2),
}


def build(family: str, seed: int = 0):
    config_name, kwargs, auto_name = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **_IDS, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, auto_name).from_config(config, attn_implementation="eager")
    model.eval()
    # Random init leaves tables near zero noise; give them visible structure so that checks are meaningful.
    if family in TABLES:
        with torch.no_grad():
            table = model.get_submodule(TABLES[family][0]).weight
            table.normal_(0, 1.0)
    return model


def tokens(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)  # never the padding id 1


def table_of(model, family):
    return model.get_submodule(TABLES[family][0]).weight


def snapshot(model):
    """Everything unpatch must restore: state dict (incl. buffers), config dict, table Parameter object."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return state, buffers, model.config.to_dict()


def assert_same(model, snap, ignore=()):
    state, buffers, config = snap
    now = model.state_dict()
    assert now.keys() == state.keys()
    for key, value in state.items():
        assert now[key].shape == value.shape and torch.equal(now[key], value), key
    named = dict(model.named_buffers())
    assert named.keys() == buffers.keys()
    for key, value in buffers.items():
        assert named[key].shape == value.shape and torch.equal(named[key], value), key
    now_config = {k: v for k, v in model.config.to_dict().items() if k not in ignore}
    assert now_config == {k: v for k, v in config.items() if k not in ignore}


def forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def quiet_patch(model, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_posext.patch(model, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# The methods (pure functions)
# --------------------------------------------------------------------------------------------------


def test_linear_table_rows_exact_at_multiples_of_s_and_interpolated_between():
    table = torch.randn(10, 6)
    new = linear_table(table, 40, Fraction(4))
    assert new.shape == (40, 6) and new.dtype == table.dtype
    assert torch.equal(new[::4], table)
    # p = 4k + 2 is half-way between rows k and k+1
    expected = ((table[:-1].double() + table[1:].double()) / 2).float()
    torch.testing.assert_close(new[2:-4:4], expected[:-1] if expected.shape[0] > 9 else expected[: new[2:-4:4].shape[0]])
    # the last s-1 positions are past row L-1: they take row L-1
    assert torch.equal(new[-3:], table[-1].expand(3, -1))


def test_linear_table_non_integer_factor_uses_exact_fractions():
    table = torch.randn(20, 3, dtype=torch.bfloat16)
    factor = exact_factor(1.1)
    assert factor == Fraction(11, 10)
    new = linear_table(table, 22, factor)
    assert torch.equal(new[[0, 11]], table[[0, 10]])  # p = 11 = 10 * 1.1 exactly
    assert exact_factor(None, 48, 32) == Fraction(3, 2)
    lower, upper, weight = interpolation_grid(48, 32, Fraction(3, 2))
    assert torch.equal(lower[::3], torch.arange(0, 32, 2)) and not weight[::3].any()


def test_linear_table_factor_one_is_identity_to_the_bit():
    table = torch.randn(16, 8)
    assert torch.equal(linear_table(table, 16, Fraction(1)), table)


def test_aliases_live_in_the_registry_not_in_a_backend():
    from hf_posext.methods import register_alias, resolve_method

    method, notes = resolve_method("Linear", "alibi")
    assert (method.name, method.kind) == ("none", "alibi") and "changes no number" in notes[0]
    assert resolve_method("linear", "learned") == (get_method("linear", "learned"), [])
    with pytest.raises(ValueError, match="no alibi method has that name"):
        register_alias("pi", "alibi", "yarn", "never")
    with pytest.raises(ValueError, match="already a learned method"):
        register_alias("linear", "learned", "none", "would hide linear")


def test_registry_kinds_and_rope_only_method_message():
    assert get_method("linear", "learned").kind == "learned"
    assert get_method("linear", "sinusoidal").kind == "sinusoidal"
    assert get_method("none", "alibi").kind == "alibi"
    listed = hf_posext.available_methods("learned")
    assert set(listed) >= {"linear", "none"}
    with pytest.raises(ValueError, match="rope position encodings.*Methods valid here: linear, none"):
        get_method("yarn", "learned")


# --------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_detect_finds_each_family_with_its_kind(family):
    model = build(family)
    assert absolute.detect(model)
    positions = absolute.find_absolute_positions(model)
    expected = "learned" if family in LEARNED else ("sinusoidal" if family == "xglm" else "alibi")
    assert positions.kind == expected
    if family in TABLES:
        path, offset = TABLES[family]
        assert [(t.path, t.offset, t.window) for t in positions.tables] == [(path, offset, WINDOW)]
    report = hf_posext.describe(model)
    assert report.kind == expected and report.method == "none" and report.factor == 1.0
    if family != "bloom":
        assert report.original_window == report.current_window == WINDOW


def test_detect_is_false_for_rope_models():
    from hf_posext.models import tiny_model

    assert not absolute.detect(tiny_model("llama"))
    assert not absolute.detect(tiny_model("gptj"))  # sin/cos table, but rotary: not ours


# --------------------------------------------------------------------------------------------------
# Learned tables
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", LEARNED)
def test_learned_linear_rows_exact_forward_at_new_window_and_unpatch(family):
    model = build(family)
    path, offset = TABLES[family]
    before = snapshot(model)
    original_table = table_of(model, family)
    long_ids = tokens(4 * WINDOW)
    with pytest.raises((IndexError, RuntimeError)):
        forward(model, long_ids)  # the reason for this module: past the window there is no row

    hf_posext.patch(model, "linear", factor=4)
    new_table = table_of(model, family)
    assert new_table.shape[0] == offset + 4 * WINDOW
    assert torch.equal(new_table[:offset], original_table[:offset])
    assert torch.equal(new_table[offset::4], original_table[offset:])
    assert model.get_submodule(path).num_embeddings == offset + 4 * WINDOW
    window_field = "n_positions" if family == "gpt2" else "max_position_embeddings"
    assert getattr(model.config, window_field) == before[2][window_field] + 3 * WINDOW
    assert model.config.hf_posext["kind"] == "learned" and model.config.hf_posext["method"] == "linear"
    report = hf_posext.describe(model)
    assert (report.kind, report.method, report.factor, report.original_window, report.current_window) == (
        "learned", "linear", 4.0, WINDOW, 4 * WINDOW)
    assert report.stock_loadable

    logits = forward(model, long_ids)
    assert logits.shape == (1, 4 * WINDOW, VOCAB) and torch.isfinite(logits).all()

    hf_posext.unpatch(model)
    assert table_of(model, family) is original_table
    assert_same(model, before)
    assert not absolute.is_patched(model)


def test_gpt_neo_masks_follow_the_window_and_keep_the_local_band():
    model = build("gpt_neo")
    quiet_patch(model, "linear", factor=2)
    global_mask = model.transformer.h[0].attn.attention.bias
    local_mask = model.transformer.h[1].attn.attention.bias
    assert global_mask.shape[-1] == local_mask.shape[-1] == 2 * WINDOW
    assert torch.equal(global_mask[0, 0], torch.ones(2 * WINDOW, 2 * WINDOW, dtype=torch.bool).tril())
    assert int(local_mask[0, 0, -1].sum()) == 8  # window_size kept


def test_factor_one_is_identity_to_the_bit():
    for family in ("gpt2", "roberta"):
        model = build(family)
        ids = tokens(WINDOW)
        expected = forward(model, ids)
        hf_posext.patch(model, "linear", factor=1)
        assert torch.equal(forward(model, ids), expected)
        assert torch.equal(table_of(model, family), build(family).get_submodule(TABLES[family][0]).weight)


def test_patched_inside_old_window_matches_at_multiples_only_through_the_table():
    # Inside the old window a patched model sees interpolated rows; at factor s position k*s uses row k.
    model = build("gpt2")
    original = table_of(model, "gpt2").detach().clone()
    hf_posext.patch(model, "linear", target_length=3 * WINDOW)
    assert torch.equal(table_of(model, "gpt2")[::3], original)
    assert hf_posext.describe(model).factor == 3.0


def test_patching_twice_replaces_and_non_integer_factor():
    model = build("opt")
    before = snapshot(model)
    original = table_of(model, "opt").detach().clone()
    hf_posext.patch(model, "linear", factor=2)
    hf_posext.patch(model, "linear", factor=1.5)
    table = table_of(model, "opt")
    assert table.shape[0] == 2 + 48
    assert torch.equal(table[2::3], original[2::2])  # p = 3k <-> original row 2k (s = 3/2)
    direct = build("opt")
    hf_posext.patch(direct, "linear", factor=1.5)
    assert torch.equal(table, table_of(direct, "opt"))
    assert model.config.hf_posext["factor"] == 1.5
    hf_posext.unpatch(model)
    assert_same(model, before)


def test_tokenizer_model_max_length_follows_and_is_restored():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), model_max_length=WINDOW
    )
    model = build("gpt2")
    hf_posext.patch(model, "linear", factor=4, tokenizer=tokenizer)
    assert tokenizer.model_max_length == 4 * WINDOW
    hf_posext.patch(model, "linear", factor=2)  # the tokenizer of the previous patch follows
    assert tokenizer.model_max_length == 2 * WINDOW
    hf_posext.patch(model, "linear", factor=3, tokenizer=tokenizer)  # passed again: still restored to the original
    assert tokenizer.model_max_length == 3 * WINDOW
    hf_posext.unpatch(model)
    assert tokenizer.model_max_length == WINDOW


@pytest.mark.parametrize("family", DECODERS)
def test_generate_past_the_old_window(family):
    model = build(family)
    prompt = tokens(WINDOW - 4)
    quiet_patch(model, "linear", factor=2)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=1, eos_token_id=None)
    out = model.generate(prompt, **kwargs)
    assert out.shape[1] == WINDOW - 4 + 20 > WINDOW
    if family in ("gpt2", "xglm"):
        # The KV cache reads the same positions as a full forward: cached and uncached generation agree.
        assert torch.equal(out, model.generate(prompt, use_cache=False, **kwargs))


# --------------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "opt", "roberta"])
def test_save_load_stock_and_hf_posext_then_unpatch_to_the_bit(family, tmp_path):
    model = build(family)
    before = snapshot(model)
    hf_posext.patch(model, "linear", factor=2)
    with torch.no_grad():  # a fine-tuned table must survive the round trip, not be recomputed
        table_of(model, family)[-1].add_(1.0)
    ids = tokens(2 * WINDOW)
    expected = forward(model, ids)
    model.save_pretrained(tmp_path)
    assert (tmp_path / absolute.SIDECAR_NAME).exists()

    cls = type(model)
    stock = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(forward(stock, ids), expected)
    assert table_of(stock, family).shape[0] == TABLES[family][1] + 2 * WINDOW
    assert "saved by hf_posext" in " ".join(hf_posext.describe(stock).notes)
    with pytest.raises(ValueError, match="hf_posext.load"):
        hf_posext.patch(stock, "linear", factor=4)  # would compound: refused

    loaded = hf_posext.load(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is cls and absolute.is_patched(loaded)
    report = hf_posext.describe(loaded)
    assert (report.method, report.factor, report.current_window) == ("linear", 2.0, 2 * WINDOW)
    assert torch.equal(forward(loaded, ids), expected)
    hf_posext.unpatch(loaded)
    # Bit for bit the model before patching (the config differs only in what any load records).
    assert_same(loaded, before, ignore=("_name_or_path", "architectures", "dtype"))


def test_load_without_sidecar_keeps_the_model_but_refuses_unpatch(tmp_path):
    model = build("gpt2")
    hf_posext.patch(model, "linear", factor=2)
    model.save_pretrained(tmp_path)
    os.remove(tmp_path / absolute.SIDECAR_NAME)
    loaded = hf_posext.load(tmp_path)
    assert torch.equal(table_of(loaded, "gpt2"), table_of(model, "gpt2"))
    with pytest.raises(ValueError, match=absolute.SIDECAR_NAME):
        hf_posext.unpatch(loaded)


# --------------------------------------------------------------------------------------------------
# Sinusoidal (XGLM)
# --------------------------------------------------------------------------------------------------


def test_sinusoid_table_reproduces_transformers():
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    reference = XGLMSinusoidalPositionalEmbedding.get_embedding(50, 32)
    assert torch.equal(absolute.sinusoid_table(torch.arange(50, dtype=torch.float64), 32), reference)


def test_xglm_linear_evaluates_at_p_over_s_and_regrows_scaled(tmp_path):
    model = build("xglm")
    before = snapshot(model)
    module = model.model.embed_positions
    original = module.weights.detach().clone()
    ids = tokens(3 * WINDOW)
    hf_posext.patch(model, "linear", factor=4)
    table = module.weights
    assert table.shape[0] >= 2 + 4 * WINDOW
    assert torch.equal(table[2::4][: WINDOW], original[2 : 2 + WINDOW])  # rows 2 + 4k: position k (offset 2)
    assert torch.equal(table[:2], original[:2])
    # p = 4k + 2 is position k + 1/2 exactly
    half = absolute.sinusoid_table(torch.tensor([2 + 0.5, 2 + 1.5], dtype=torch.float64), 32)
    assert torch.equal(table[[4, 8]], half)
    assert model.config.max_position_embeddings == 4 * WINDOW
    assert model.model.max_target_positions == 4 * WINDOW
    forward(model, tokens(6 * WINDOW))  # past the new window XGLM regrows its table: still scaled
    assert module.weights.shape[0] >= 2 + 6 * WINDOW
    assert torch.equal(module.weights[2 + 4 * WINDOW :: 4][:8], absolute.sinusoid_table(torch.arange(WINDOW, WINDOW + 8, dtype=torch.float64) + 2, 32))
    report = hf_posext.describe(model)
    assert (report.kind, report.method, report.current_window, report.stock_loadable) == ("sinusoidal", "linear", 4 * WINDOW, False)

    expected = forward(model, ids)
    model.save_pretrained(tmp_path)
    loaded = hf_posext.load(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(forward(loaded, ids), expected)
    hf_posext.unpatch(model)
    assert_same(model, before, ignore=("architectures", "dtype"))  # save_pretrained itself records these
    assert torch.equal(model.model.embed_positions.weights, original)


def test_xglm_factor_one_identity_and_none_lifts_the_limit():
    model = build("xglm")
    ids = tokens(WINDOW)
    expected = forward(model, ids)
    hf_posext.patch(model, "linear", factor=1)
    assert torch.equal(forward(model, ids), expected)
    hf_posext.patch(model, "none", factor=4)
    assert model.config.max_position_embeddings == 4 * WINDOW
    assert torch.equal(forward(model, ids), expected)


# --------------------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------------------


def test_mpt_patch_only_lifts_the_limit_and_says_so():
    model = build("mpt")
    before = snapshot(model)
    ids = tokens(WINDOW)
    expected = forward(model, ids)
    with pytest.raises(Exception):
        forward(model, tokens(2 * WINDOW))  # MPT's ALiBi tensor is sized by max_seq_len
    report = hf_posext.describe(model)
    assert report.kind == "alibi" and any("needs no scaling" in note for note in report.notes)
    with pytest.warns(UserWarning, match="ALiBi, which needs no scaling.*lifted the length limit"):
        hf_posext.patch(model, "none", factor=4)
    assert model.config.max_seq_len == 4 * WINDOW
    assert torch.isfinite(forward(model, tokens(4 * WINDOW))).all()
    assert torch.allclose(forward(model, ids), expected, atol=1e-5)  # ALiBi numbers are unchanged
    with pytest.warns(UserWarning, match="'linear' changes no number"):
        hf_posext.patch(model, "linear", factor=2)
    assert hf_posext.describe(model).method == "none"
    hf_posext.unpatch(model)
    assert_same(model, before)


def test_bloom_has_no_limit_and_patch_changes_nothing():
    model = build("bloom")
    before = snapshot(model)
    assert any("no length limit" in note for note in hf_posext.describe(model).notes)
    with pytest.warns(UserWarning, match="changed nothing"):
        hf_posext.patch(model, "none", factor=4)
    assert not absolute.is_patched(model)
    assert_same(model, before)


# --------------------------------------------------------------------------------------------------
# Bad input: clear errors, model untouched
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("yarn",), dict(factor=4), ValueError, "applies to rope.*Methods valid here: linear, none"),
        (("linear",), dict(factor=MAX_TABLE_ROWS), ValueError, "2\\^20"),
        (("linear",), dict(factor=0.5), ValueError, "below 1"),
        (("linear",), dict(factor=2, target_length=64), ValueError, "exactly one"),
        (("linear",), dict(), ValueError, "exactly one"),
        (("linear",), dict(factor=2, beta_fast=3), ValueError, "no parameter 'beta_fast'"),
        (("none",), dict(factor=2), ValueError, "cannot extend a learned position table"),
        (("linear",), dict(factor=2, original_max_position_embeddings=4 * WINDOW), ValueError, "at most 32"),
        (("linear",), dict(factor=2, tokenizer=object()), TypeError, "model_max_length"),
        ((3,), dict(factor=2), TypeError, "must be a name"),
    ],
)
def test_bad_input_errors_leave_the_model_unchanged(args, kwargs, error, match):
    model = build("gpt2")
    before = snapshot(model)
    with pytest.raises(error, match=match):
        hf_posext.patch(model, *args, **kwargs)
    assert_same(model, before)
    assert not absolute.is_patched(model)


def test_huge_gpt_neo_mask_is_refused_before_allocating():
    model = build("gpt_neo")
    with pytest.raises(ValueError, match="causal mask"):
        hf_posext.patch(model, "linear", factor=4096)
    assert not absolute.is_patched(model)


def test_failed_repatch_keeps_the_previous_patch():
    model = build("gpt2")
    hf_posext.patch(model, "linear", factor=2)
    patched = snapshot(model)
    with pytest.raises(ValueError):
        hf_posext.patch(model, "linear", factor=MAX_TABLE_ROWS)
    assert_same(model, patched)
    with pytest.raises(ValueError, match="not patched"):
        hf_posext.unpatch(build("gpt2"))


def test_falcon_with_alibi_is_alibi_despite_its_unused_rotary_module():
    def falcon(alibi):
        config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           alibi=alibi, new_decoder_architecture=False, multi_query=True,
                                           max_position_embeddings=WINDOW, **_IDS)
        return transformers.AutoModelForCausalLM.from_config(config)

    assert hf_posext.describe(falcon(True)).kind == "alibi"
    assert not absolute.detect(falcon(False))  # Falcon with RoPE stays with the rotary patcher
