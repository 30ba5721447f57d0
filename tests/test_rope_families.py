"""The RoPE families that need a rule of their own, each on a tiny instance of its installed transformers class.

Every family here is patched, run past its window, unpatched to the bit, saved and loaded back, and where
transformers scales the family itself, compared with the model transformers builds from the same rope dict.
The rules (:mod:`hf_posext.backends.rope.layouts`, ``identify``, ``rules``, ``attention_scale``) each get a
test on the family that needs them.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import transformers

import hf_posext
from hf_posext.backends.rope.rules import kept_rope_keys, layers_without_rope, scaled_layer_types
from hf_posext.backends.rope.sites import find_rotary_sites
from hf_posext.core.request import ScalingConfig
from tests.conftest import assert_close_guarding, logits_of, transformers_major

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="these families ship with transformers 5")

WINDOW = 64
COMMON = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.2,  # large weights: attention, and so a rescaled RoPE, moves the logits well above float noise
)
MLA = dict(
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None, head_dim=8,
    n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
)
GPTJ = dict(n_embd=64, n_head=4, rotary_dim=8, n_positions=WINDOW, n_layer=2)

#: class -> the config fields its tiny instance needs beyond COMMON (what each family's rule is tested on).
FAMILIES = {
    "Qwen3_5ForCausalLM": dict(layer_types=["linear_attention", "full_attention"]),  # multimodal rows, hybrid
    "Qwen3_5MoeForCausalLM": dict(layer_types=["linear_attention", "full_attention"]),
    "Mistral4ForCausalLM": {},  # llama_4_scaling_beta kept
    "Ministral3ForCausalLM": {},
    "GraniteSWAForCausalLM": dict(layer_rope_theta=[10000.0, 0, 50000.0], num_hidden_layers=3, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention", "full_attention"]),
    "GraniteMoeSWAForCausalLM": {},  # rotary_emb.config read by the model
    "Gemma4ForCausalLM": {},  # proportional partial rotary on the global layers
    "Gemma4UnifiedForCausalLM": {},
    "Lfm3ForCausalLM": dict(num_hidden_layers=4),  # proportional, convolution layers
    "Llama4ForCausalLM": dict(no_rope_layers=[1, 0]),  # complex layout, NoPE layers
    "GptOssForCausalLM": {},  # half layout, yarn truncate=False
    "CohereForCausalLM": {},  # interleaved layout
    "Cohere2ForCausalLM": {},
    "Cohere2MoeForCausalLM": {},
    "DeepseekV2ForCausalLM": MLA,  # complex layout, MLA softmax scale
    "DeepseekV3ForCausalLM": MLA,
    "DeepseekV4ForCausalLM": {},  # several rotary modules, main / compress rope labels
    "MiMoV2FlashForCausalLM": {},
    "ErgoForCausalLM": {},  # rotary_emb.rope_type read by the model
    "GPTJForCausalLM": GPTJ,  # interleaved sin/cos table
    "CodeGenForCausalLM": dict(GPTJ, n_ctx=WINDOW),
}


def tiny(name: str, **overrides):
    """A tiny random instance of transformers' class ``name`` (seeded: two calls give the same weights)."""
    cls = getattr(transformers, name)
    fields = {**COMMON, **FAMILIES.get(name, {}), **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return cls(cls.config_class(**fields)).eval()


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_patches_runs_past_its_window_unpatches_and_reloads(name, tmp_path):
    model = tiny(name)
    short, long = _ids(WINDOW // 2), _ids(2 * WINDOW, seed=1)
    before, config_before = logits_of(model, short), _config_of(model)
    hf_posext.patch(model, "yarn", factor=2)
    patched = logits_of(model, long)
    assert torch.isfinite(patched).all()
    assert not torch.equal(logits_of(model, short), before)  # the patch did something inside the window too
    hf_posext.unpatch(model)
    assert torch.equal(logits_of(model, short), before)
    assert _config_of(model) == config_before
    hf_posext.patch(model, "yarn", factor=2).save_pretrained(tmp_path)
    # Not to the bit: some families' stock save/load already differs by float noise (Mistral 4's grouped experts).
    assert_close_guarding(logits_of(hf_posext.load(tmp_path), long), patched, _unpatched_past_window(name, long), atol=5e-5, rtol=5e-5)


def _unpatched_past_window(name: str, ids: torch.Tensor) -> torch.Tensor:
    """The unpatched model's logits on ``ids``; a sin/cos table that stops at the window (GPT-J) is extended."""
    try:
        return logits_of(tiny(name), ids)
    except IndexError:
        return logits_of(hf_posext.patch(tiny(name), "none", factor=1, original_max_position_embeddings=ids.shape[1]), ids)


def _config_of(model) -> dict:
    return model.config.to_dict()


def _stock_twin(model, name: str, **fields):
    """The model transformers builds from the patched config (hf_posext's record left out), same weights."""
    config = copy.deepcopy(model.config)
    config.__dict__.pop("hf_posext", None)
    twin = getattr(transformers, name)(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_stock_loadable_patches_equal_the_model_transformers_builds(name):
    """Where hf_posext writes transformers' own rope dict, transformers' model from it gives the same logits."""
    model = hf_posext.patch(tiny(name), "linear", factor=2)
    if not hf_posext.describe(model).stock_loadable:
        pytest.skip(f"{name}: transformers has no rope dict for this patch")
    long = _ids(2 * WINDOW, seed=2)
    unpatched = logits_of(tiny(name), long)
    assert_close_guarding(logits_of(_stock_twin(model, name), long), logits_of(model, long), unpatched, atol=1e-5, rtol=1e-5)


def _built_with(name: str, rope_parameters, model, **fields):
    twin = tiny(name, rope_parameters=rope_parameters, **fields)
    twin.load_state_dict(model.state_dict())
    return twin


def test_gemma4_linear_equals_transformers_proportional_factor():
    """Gemma 4's own recipe: linear on the global layers is the proportional type's ``factor``."""
    model = tiny("Gemma4ForCausalLM")
    long = _ids(2 * WINDOW, seed=3)
    unpatched = logits_of(model, long)
    rope = copy.deepcopy(model.config.rope_parameters)
    rope["full_attention"]["factor"] = 2.0
    hf_posext.patch(model, "linear", factor=2)
    written = model.config.rope_parameters["full_attention"]
    assert hf_posext.describe(model).stock_loadable and (written["rope_type"], written["factor"]) == ("proportional", 2.0)
    site = find_rotary_sites(tiny("Gemma4ForCausalLM"))[0]
    assert site.scaled_layer_types == ("full_attention",) and site.rotated["full_attention"] == site.dims["full_attention"] // 8
    assert_close_guarding(logits_of(model, long), logits_of(_built_with("Gemma4ForCausalLM", rope, model), long), unpatched, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "layout"), [
    ("CohereForCausalLM", "cos_sin_interleaved"), ("GptOssForCausalLM", "cos_sin_half"),
    ("Llama4ForCausalLM", "complex"), ("DeepseekV2ForCausalLM", "complex"), ("GPTJForCausalLM", "sin_cos_half"),
    ("LlamaForCausalLM", "cos_sin"),
])
def test_the_probe_finds_each_family_layout(name, layout):
    assert {site.layout for site in find_rotary_sites(tiny(name))} == {layout}


@pytest.mark.parametrize(("name", "rope"), [
    ("Cohere2ForCausalLM", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW, "rope_theta": 10000.0}),
    ("Llama4ForCausalLM", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW, "rope_theta": 500000.0}),
    ("GptOssForCausalLM", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW, "rope_theta": 150000.0,
                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
    # one rotary module per base, each scaled from its own base (the model keys them by their config's theta)
    ("GraniteSWAForCausalLM", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW, "rope_theta": 10000.0}),
])
def test_yarn_equals_transformers_yarn_on_interleaved_half_complex_and_per_base_modules(name, rope):
    model = tiny(name)
    long = _ids(2 * WINDOW, seed=4)
    unpatched = logits_of(model, long)
    params = {k: rope[k] for k in ("beta_fast", "beta_slow", "truncate") if k in rope}
    hf_posext.patch(model, "yarn", factor=2, original_max_position_embeddings=WINDOW, **params)
    twin = _built_with(name, rope, model, max_position_embeddings=2 * WINDOW)
    assert_close_guarding(logits_of(model, long), logits_of(twin, long), unpatched, atol=1e-5, rtol=1e-5)


def test_gpt_oss_rescaled_with_yarn_keeps_its_own_truncate_false():
    """Re-scaling with the method the model already uses keeps the model's parameters unless the call sets them."""
    model = tiny("GptOssForCausalLM")
    assert find_rotary_sites(model)[0].current[None].params.get("truncate") is False
    hf_posext.patch(model, "yarn", factor=4)
    assert hf_posext.describe(model).params["truncate"] is False
    kept = model.model.rotary_emb.frequencies(None)[0]
    hf_posext.patch(model, "yarn", factor=4, truncate=True)
    assert (kept - model.model.rotary_emb.frequencies(None)[0]).abs().max() > 1e-4


def test_proportional_pairs_that_do_not_rotate_stay_zero_under_every_method():
    model = tiny("Gemma4ForCausalLM")
    pairs = find_rotary_sites(model)[0].rotated["full_attention"]
    for method in ("yarn", "ntk", "llama3", "dynamic-yarn"):
        hf_posext.patch(model, method, factor=4)
        inv_freq, _ = model.model.rotary_emb.frequencies(4 * WINDOW, "full_attention")
        assert torch.all(inv_freq[pairs:] == 0) and torch.all(inv_freq[:pairs] > 0), method


def test_mla_softmax_scale_follows_yarn_mscale_all_dim_as_transformers():
    """DeepSeek's MLA folds mscale(s, mscale_all_dim)^2 into the softmax scale: the patch moves it too."""
    model = tiny("DeepseekV2ForCausalLM")
    long = _ids(2 * WINDOW, seed=5)
    unpatched, scale = logits_of(model, long), model.model.layers[0].self_attn.scaling
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": WINDOW,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    hf_posext.patch(model, "yarn", factor=4, mscale=1.0, mscale_all_dim=1.0)
    twin = _built_with("DeepseekV2ForCausalLM", rope, model, max_position_embeddings=4 * WINDOW)
    assert model.model.layers[0].self_attn.scaling == twin.model.layers[0].self_attn.scaling != scale
    assert_close_guarding(logits_of(model, long), logits_of(twin, long), unpatched, atol=1e-5, rtol=1e-5)
    hf_posext.unpatch(model)
    assert model.model.layers[0].self_attn.scaling == scale


@pytest.mark.parametrize("method", ["yarn", "linear"])
def test_mistral4_and_ministral3_keep_llama_4_scaling_beta(method):
    model = tiny("Ministral3ForCausalLM")
    beta = model.config.rope_parameters["llama_4_scaling_beta"]
    hf_posext.patch(model, method, factor=2)
    assert model.config.rope_parameters["llama_4_scaling_beta"] == beta
    assert model.config.rope_parameters["original_max_position_embeddings"]
    assert torch.isfinite(logits_of(model, _ids(2 * WINDOW))).all()


def test_multimodal_position_rows_equal_transformers_on_3d_position_ids():
    """Qwen3.5's rotary module takes (temporal, height, width) rows; each pair follows its own row."""
    model = tiny("Qwen3_5ForCausalLM")
    site = find_rotary_sites(model)[0]
    pairs = site.dims[None] // 2
    assert site.position_rows is not None and set(site.position_rows.tolist()) == {0, 1, 2} and len(site.position_rows) == pairs
    rope = {**model.config.rope_parameters, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": WINDOW}
    stock = tiny("Qwen3_5ForCausalLM", rope_parameters=rope).model.rotary_emb
    hf_posext.patch(model, "yarn", factor=2)
    rows = torch.stack([torch.arange(40), torch.arange(40) * 2 + 1, torch.arange(40) * 3 + 5])[:, None, :]
    x = torch.zeros(1, 40, 1)
    ours, theirs = model.model.rotary_emb(x, rows), stock(x, rows)
    plain = model.model.rotary_emb(x, rows[0])  # what ignoring the rows would give
    for mine, stock_out, wrong in zip(ours, theirs, plain):
        assert_close_guarding(mine, stock_out, wrong, atol=1e-6, rtol=1e-6)


def test_describe_names_the_layers_without_rope_and_the_proportional_pairs():
    notes = " ".join(hf_posext.describe(hf_posext.patch(tiny("Llama4ForCausalLM"), "yarn", factor=2)).notes)
    assert "layers without RoPE left untouched: 1" in notes
    notes = " ".join(hf_posext.describe(hf_posext.patch(tiny("Gemma4ForCausalLM"), "yarn", factor=2)).notes)
    assert "scaled layer types: full_attention" in notes and "proportional partial rotary" in notes


def test_rules_on_their_own():
    none, yarn = ScalingConfig("none", 1.0, 64), ScalingConfig("yarn", 16.0, 64)
    assert scaled_layer_types({"main": none, "compress": yarn}) == ("compress",)
    assert scaled_layer_types({"sliding_attention": none, "full_attention": none}) == ("full_attention",)
    assert scaled_layer_types({"local_attention": none, "compressed": none}) == ("compressed",)
    assert scaled_layer_types({None: none}) == (None,)
    assert layers_without_rope(type("C", (), {"no_rope_layers": [1, 0, 1, 0]})()) == [1, 3]
    assert layers_without_rope(type("C", (), {"layer_rope_theta": [1e4, 0.0]})()) == [1]
    assert layers_without_rope(type("C", (), {"layer_types": ["linear_attention", "full_attention"]})()) == [0]
    base = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1}
    assert kept_rope_keys(base, {"rope_type": "linear", "factor": 2.0}) == {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 8}
    assert kept_rope_keys({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, {"rope_type": "linear"}) == {}


def test_models_reading_rotary_attributes_keep_working():
    for name in ("ErgoForCausalLM", "GraniteSWAForCausalLM", "Lfm3ForCausalLM"):
        model = hf_posext.patch(tiny(name), "ntk", factor=2)
        assert torch.isfinite(logits_of(model, _ids(2 * WINDOW))).all(), name


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic-ntk", "yarn", "dynamic-yarn", "llama3", "theta", "longrope"])
def test_loading_a_patched_folder_logs_no_missing_validation_function(method, tmp_path):
    """hf_posext writes only transformers' own rope types into rope_parameters (its methods without one stay in
    config.hf_posext), so transformers' config validation finds a validator for every folder it saves."""
    params = {"theta": {"base": 1e6}, "longrope": {"long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]}}.get(method, {})
    hf_posext.patch(tiny("LlamaForCausalLM"), method, factor=2, **params).save_pretrained(tmp_path)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        hf_posext.load(tmp_path)
        transformers.AutoConfig.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "Missing validation function" in r.getMessage()]
