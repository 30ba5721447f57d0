"""patch / unpatch / describe / save-load on tiny random models of every supported family."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_posext
from hf_posext.backends.rope.sites import UnsupportedModelError, find_rotary_sites
from hf_posext.methods import available_methods
from hf_posext.models import TINY_FAMILIES, tiny_model
from tests.conftest import assert_close_guarding, logits_of, transformers_major

LONGROPE = {"long_factor": [1.0, 2.0, 3.0, 4.0]}
# Parameters each method needs at factor 1 to be the identity (theta: the model's own base).
IDENTITY_PARAMS = {"theta": {"base": 10000.0}, "longrope": {"long_factor": [1.0] * 4}}
STATIC_METHODS = ["linear", "ntk", "yarn", "llama3", "theta", "none"]
DYNAMIC_METHODS = ["dynamic-ntk", "dynamic-yarn", "longrope"]


def _families():
    families = list(TINY_FAMILIES)
    if transformers_major() < 5:
        families.remove("gptj")  # 4.x GPT-J keeps per-layer sin/cos tables inside attention (see test below)
    return families


def _config_dict(model):
    return json.loads(model.config.to_json_string())


@pytest.mark.parametrize("family", _families())
def test_every_family_patches_runs_long_and_unpatches_to_the_bit(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    long_ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    before, config_before = logits_of(model, ids), _config_dict(model)
    hf_posext.patch(model, "yarn", factor=4)
    report = hf_posext.describe(model)
    assert (report.method, report.factor, report.original_window, report.current_window) == ("yarn", 4.0, 64, 256)
    patched_long = logits_of(model, long_ids)
    assert patched_long.shape == (1, 200, 128) and torch.isfinite(patched_long).all()
    assert not torch.equal(logits_of(model, ids), before)
    hf_posext.unpatch(model)
    assert torch.equal(logits_of(model, ids), before)
    assert _config_dict(model) == config_before


@pytest.mark.parametrize("method", STATIC_METHODS)
def test_factor_one_is_the_identity_to_the_bit(method, token_ids):
    model = tiny_model("llama")
    before = logits_of(model, token_ids)
    hf_posext.patch(model, method, factor=1, **IDENTITY_PARAMS.get(method, {}))
    assert torch.equal(logits_of(model, token_ids), before)


@pytest.mark.parametrize("method", ["dynamic-ntk", "dynamic-yarn"])  # longrope scales attention at every length
def test_dynamic_methods_are_the_identity_inside_the_window(method):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    before = logits_of(model, ids)
    hf_posext.patch(model, method, factor=4)
    assert torch.equal(logits_of(model, ids), before)


def test_every_registered_rope_method_round_trips(tmp_path, token_ids):
    """Parametrised over the registry, so a new method is covered the day it is added."""
    for method in available_methods("rope"):
        model = tiny_model("llama")
        before = logits_of(model, token_ids)
        params = {"theta": {"base": 5e5}, "longrope": LONGROPE}.get(method, {})
        hf_posext.patch(model, method, factor=2.5, **params)
        patched = logits_of(model, token_ids)
        out = tmp_path / method
        model.save_pretrained(out)
        reloaded = hf_posext.load(out, attn_implementation="eager").eval()
        torch.testing.assert_close(logits_of(reloaded, token_ids), patched, rtol=1e-5, atol=1e-5)
        assert hf_posext.describe(reloaded).method == method
        hf_posext.unpatch(model)
        assert torch.equal(logits_of(model, token_ids), before)


def test_patching_twice_replaces_never_compounds(token_ids):
    once = hf_posext.patch(tiny_model("llama"), "linear", factor=4)
    twice = tiny_model("llama")
    original_config = _config_dict(twice)
    hf_posext.patch(twice, "yarn", factor=2)
    hf_posext.patch(twice, "linear", factor=4)
    assert torch.equal(logits_of(twice, token_ids), logits_of(once, token_ids))
    rope_config = twice.config.rope_parameters if transformers_major() >= 5 else twice.config.rope_scaling
    assert (rope_config["rope_type"], rope_config["factor"]) == ("linear", 4.0)
    hf_posext.unpatch(twice)
    assert _config_dict(twice) == original_config


def test_none_needs_no_factor_and_undoes_a_scaling(token_ids):
    model = tiny_model("llama")
    before = logits_of(model, token_ids)
    hf_posext.patch(model, "yarn", factor=4)
    hf_posext.patch(model, "none")
    report = hf_posext.describe(model)
    assert (report.method, report.factor, report.current_window) == ("none", 1.0, 64)
    assert torch.equal(logits_of(model, token_ids), before)
    with pytest.raises(ValueError, match="factor"):
        hf_posext.patch(model, "yarn")  # every other method still needs a factor or a target length


def test_target_length_sets_the_factor():
    model = hf_posext.patch(tiny_model("llama"), "linear", target_length=320)
    report = hf_posext.describe(model)
    assert report.factor == 5.0 and report.current_window == 320


STOCK_METHODS = ["linear", "yarn", "llama3", "longrope", "ntk", "dynamic-ntk"]


@pytest.fixture(scope="module")
def stock_reloads(tmp_path_factory):
    """method -> (our patched logits, stock transformers' logits for the saved folder, stock_loadable).

    Every folder is loaded by one fresh interpreter that never imports hf_posext (one start-up of torch
    and transformers instead of one per method).
    """
    root = tmp_path_factory.mktemp("stock")
    ids = torch.randint(3, 128, (2, 150), generator=torch.Generator().manual_seed(1234))  # as conftest.token_ids
    torch.save(ids, root / "ids.pt")
    expected, loadable = {}, {}
    for method in STOCK_METHODS:
        model = tiny_model("llama")
        hf_posext.patch(model, method, factor=3, **(LONGROPE if method == "longrope" else {}))
        loadable[method] = hf_posext.describe(model).stock_loadable
        model.save_pretrained(root / method)
        expected[method] = logits_of(model, ids)
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM;"
        f"ids = torch.load({str(root / 'ids.pt')!r})\n"
        f"for name in {STOCK_METHODS!r}:\n"
        f"    m = AutoModelForCausalLM.from_pretrained({str(root)!r} + '/' + name, attn_implementation='eager').eval()\n"
        f"    torch.save(m(ids).logits.detach(), {str(root)!r} + '/' + name + '.pt')\n"
        "assert 'hf_posext' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    return {m: (expected[m], torch.load(root / f"{m}.pt"), loadable[m]) for m in STOCK_METHODS}


@pytest.mark.parametrize("method", STOCK_METHODS)
def test_stock_from_pretrained_reproduces_without_hf_posext(method, stock_reloads):
    ours, stock, stock_loadable = stock_reloads[method]
    assert stock_loadable
    torch.testing.assert_close(stock, ours, rtol=1e-5, atol=1e-5)


def test_method_unknown_to_transformers_loads_unscaled_in_stock_and_exactly_with_hf_posext(tmp_path):
    model = tiny_model("llama")
    inside = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(3))
    long_ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(4))
    original_inside = logits_of(model, inside)
    hf_posext.patch(model, "dynamic-yarn", factor=4)
    assert hf_posext.describe(model).stock_loadable is False
    model.save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert torch.equal(logits_of(stock, inside), original_inside)  # dynamic: identity inside the window
    ours = hf_posext.load(tmp_path, attn_implementation="eager").eval()
    torch.testing.assert_close(logits_of(ours, long_ids), logits_of(model, long_ids), rtol=1e-5, atol=1e-5)


def test_patch_on_a_stock_loaded_saved_model_scales_from_the_pretraining_values(tmp_path, token_ids):
    fresh = hf_posext.patch(tiny_model("llama"), "ntk", factor=2)
    saved = tiny_model("llama")
    hf_posext.patch(saved, "ntk", factor=4)
    saved.save_pretrained(tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    hf_posext.patch(stock, "ntk", factor=2)  # must not compound with the saved x4
    torch.testing.assert_close(logits_of(stock, token_ids), logits_of(fresh, token_ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", DYNAMIC_METHODS)
def test_dynamic_methods_keep_the_kv_cache_consistent(method):
    """Cached generation past the window equals a full no-cache recompute at every step (to 1e-5).

    The model depends on position (init range 0.1): a cache rotated at each step's own length (what
    hf_posext's fixed length around ``generate`` prevents) moves the logits >= 100x the tolerance.
    """
    model = tiny_model("llama", initializer_range=0.1)
    hf_posext.patch(model, method, factor=4, **(LONGROPE if method == "longrope" else {}))
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    new_tokens = 60  # 40 + 60 = 100 > window 64: the scale changes during generation
    out = model.generate(
        prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    steps = torch.stack(out.logits, dim=1)  # [1, new_tokens, vocab]
    # One forward over the final sequence, as a user would recompute it (its length = prompt + new tokens).
    full = logits_of(model, out.sequences, use_cache=False)[:, prompt.shape[1] - 1 : -1]
    # The failure guarded (transformers #25104): a cache whose keys were rotated at each step's length.
    with torch.no_grad():
        out_step = model(prompt, use_cache=True)
        cache, stepwise = out_step.past_key_values, [out_step.logits[:, -1]]
        for t in range(prompt.shape[1], out.sequences.shape[1] - 1):
            out_step = model(out.sequences[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out_step.past_key_values
            stepwise.append(out_step.logits[:, -1])
    assert_close_guarding(steps, full, torch.stack(stepwise, dim=1), rtol=1e-5, atol=1e-5)


def test_fixed_length_context_for_hand_driven_caches():
    model = hf_posext.patch(tiny_model("llama", initializer_range=0.1), "dynamic-ntk", factor=2)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    full = logits_of(model, ids)
    with torch.no_grad():  # without the context: the first 50 keys are cached at the frequencies of length 64
        first = model(ids[:, :50], use_cache=True)
        second = model(ids[:, 50:], past_key_values=first.past_key_values, use_cache=True)
    unfixed = torch.cat([first.logits, second.logits], dim=1)
    with hf_posext.fixed_length(model, 100), torch.no_grad():
        first = model(ids[:, :50], use_cache=True)
        second = model(ids[:, 50:], past_key_values=first.past_key_values, use_cache=True)
    assert_close_guarding(torch.cat([first.logits, second.logits], dim=1), full, unfixed, rtol=1e-5, atol=1e-5)


def test_gemma3_scales_only_full_attention_layers():
    model = tiny_model("gemma3")
    hf_posext.patch(model, "linear", factor=2)
    if transformers_major() >= 5:  # one module with per-layer-type frequencies
        module = model.model.rotary_emb
        assert module.entries["full_attention"].scaling.method == "linear"
        assert module.entries["sliding_attention"].scaling.method == "none"
        assert any("full_attention" in note for note in hf_posext.describe(model).notes)
    else:  # 4.x: a second module (rope_local_base_freq) for the sliding-window layers
        assert model.model.rotary_emb.entries[None].scaling.method == "linear"
        assert model.model.rotary_emb_local.entries[None].scaling.method == "none"


@pytest.mark.skipif(transformers_major() < 5, reason="GPT-J's shared rotary module exists from transformers 5")
def test_gptj_runs_past_its_fixed_table():
    model = tiny_model("gptj")
    long_ids = torch.randint(3, 128, (1, 150))
    with pytest.raises(Exception):
        logits_of(model, long_ids)  # the original table has n_positions=64 rows
    hf_posext.patch(model, "linear", factor=4)
    assert torch.isfinite(logits_of(model, long_ids)).all()


@pytest.mark.skipif(transformers_major() >= 5, reason="transformers 4.x GPT-J layout")
def test_gptj_on_transformers_4_fails_loudly():
    with pytest.raises(UnsupportedModelError):
        hf_posext.patch(tiny_model("gptj"), "linear", factor=2)


def test_a_rotary_module_that_does_not_match_its_config_fails_loudly():
    model = tiny_model("llama")
    original_forward = model.model.rotary_emb.forward

    def skewed(x, position_ids, *args, **kwargs):  # e.g. a release that changed the output convention
        cos, sin = original_forward(x, position_ids, *args, **kwargs)
        return cos * 0.5, sin

    model.model.rotary_emb.forward = skewed
    with pytest.raises(UnsupportedModelError, match="does not produce what its config describes"):
        hf_posext.patch(model, "yarn", factor=2)


# --------------------------------------------------------------------------------------------------
# Bad input: a clear error and the model left untouched.
# --------------------------------------------------------------------------------------------------


class _NotATransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16)
        self.linear = torch.nn.Linear(4, 4)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("wavelet",), {"factor": 2}, ValueError, "Unknown method 'wavelet'.*Known methods: dca, dynamic-ntk"),
        (("yran",), {"factor": 2}, ValueError, "Did you mean 'yarn'"),
        (("yarn",), {"factor": 0.5}, ValueError, "factor=0.5 is below 1"),
        (("yarn",), {"factor": 2, "target_length": 128}, ValueError, "exactly one of factor"),
        (("yarn",), {}, ValueError, "exactly one of factor"),
        (("yarn",), {"target_length": 32}, ValueError, "shorter than the model's original window"),
        (("yarn",), {"factor": 2, "beta_fats": 32}, ValueError, "Did you mean 'beta_fast'"),
        (("yarn",), {"factor": 2, "beta_fast": 1, "beta_slow": 2}, ValueError, "beta_fast"),
        (("theta",), {"factor": 2}, ValueError, "needs the new base"),
        (("longrope",), {"factor": 2}, ValueError, "needs per-dimension factors"),
        (("longrope",), {"factor": 2, "long_factor": [1, 2]}, ValueError, "needs 4 values"),
        (("yarn",), {"factor": float("nan")}, ValueError, "finite"),
    ],
)
def test_bad_input_is_a_clear_error_and_leaves_the_model_untouched(args, kwargs, error, message, token_ids):
    model = tiny_model("llama")
    before, config_before = logits_of(model, token_ids), _config_dict(model)
    with pytest.raises(error, match=message):
        hf_posext.patch(model, *args, **kwargs)
    assert torch.equal(logits_of(model, token_ids), before)
    assert _config_dict(model) == config_before


def test_bad_input_on_a_patched_model_keeps_the_previous_patch(token_ids):
    model = hf_posext.patch(tiny_model("llama"), "linear", factor=2)
    before = logits_of(model, token_ids)
    with pytest.raises(ValueError):
        hf_posext.patch(model, "linear", factor=0.1)
    assert torch.equal(logits_of(model, token_ids), before)
    assert hf_posext.describe(model).factor == 2.0


def test_non_model_objects_and_models_without_positions():
    with pytest.raises(TypeError, match="Expected a transformers model"):
        hf_posext.patch("meta-llama/Llama-2-7b-hf", "yarn", factor=2)
    with pytest.raises(TypeError):
        hf_posext.describe(object())
    with pytest.raises(UnsupportedModelError, match="No rotary"):
        hf_posext.patch(_NotATransformer(), "yarn", factor=2)
    with pytest.raises(ValueError, match="not patched"):
        hf_posext.unpatch(tiny_model("llama"))


def test_describe_an_unpatched_and_a_natively_scaled_model():
    report = hf_posext.describe(tiny_model("llama"))
    assert (report.method, report.factor, report.current_window) == ("none", 1.0, 64)
    assert "family:" in str(report) and report.to_dict()["family"] == "llama"
    rope = {"rope_type": "linear", "factor": 2.0}
    overrides = {"rope_parameters": {**rope, "rope_theta": 10000.0}} if transformers_major() >= 5 else {"rope_scaling": rope}
    # A linear config keeps the pre-training window in max_position_embeddings (lmsys/vicuna-13b-v1.5-16k:
    # 4096 with linear x4); vLLM and SGLang multiply it by the factor too (docs/serving.md).
    native = tiny_model("llama", max_position_embeddings=64, **overrides)
    report = hf_posext.describe(native)
    assert (report.method, report.factor, report.original_window, report.current_window) == ("linear", 2.0, 64, 128)


def test_find_rotary_sites_reports_partial_rotary_dims():
    site = find_rotary_sites(tiny_model("gpt_neox"))[0]
    assert site.dims == {None: 2}  # head_dim 8 x rotary_pct 0.25
    site = find_rotary_sites(tiny_model("stablelm"))[0]
    assert site.dims == {None: 4}


def test_deepcopy_and_device_moves_keep_the_patch(token_ids):
    model = hf_posext.patch(tiny_model("llama"), "yarn", factor=2)
    clone = copy.deepcopy(model).to("cpu")
    torch.testing.assert_close(logits_of(clone, token_ids), logits_of(model, token_ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_cast_to_half_precision_is_patched_and_restored(dtype, token_ids):
    # model.to(dtype) rounds transformers' inv_freq buffer too; identification must still recognise it.
    inside = token_ids[:, :60]  # inside the 64-token window
    exact_frequencies = tiny_model("llama", initializer_range=0.1).model.rotary_emb.inv_freq.clone()
    model = tiny_model("llama", initializer_range=0.1).to(dtype)
    before = logits_of(model, inside)
    # The original model with float32 frequencies (the ones hf_posext keeps), all else in half precision.
    reference_model = tiny_model("llama", initializer_range=0.1).to(dtype)
    reference_model.model.rotary_emb.inv_freq = exact_frequencies
    reference = logits_of(reference_model, inside)
    with pytest.warns(UserWarning, match="stored in torch"):
        hf_posext.patch(model, "dynamic-yarn", factor=4)
    (buffer,) = [b for name, b in model.named_buffers() if "inv_freq" in name]
    assert buffer.dtype == torch.float32
    # Inside the window dynamic-yarn is the original model, to the bit, given the same frequencies;
    # a scaling applied inside the window (static yarn x4) moves the logits by about 0.47.
    dynamic = logits_of(model, inside)
    hf_posext.patch(model, "yarn", factor=4)
    static = logits_of(model, inside)
    assert_close_guarding(dynamic.float(), reference.float(), static, atol=1e-3, rtol=0)
    assert torch.equal(dynamic, reference)
    hf_posext.unpatch(model)
    assert torch.equal(logits_of(model, inside), before)
    assert model.model.rotary_emb.inv_freq.dtype == dtype


def test_casting_a_patched_model_keeps_the_frequency_tables_float32():
    model = hf_posext.patch(tiny_model("llama"), "yarn", factor=4)
    (exact,) = [b.clone() for name, b in model.named_buffers() if "inv_freq" in name]
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.float()):
        cast(model)
        (buffer,) = [b for name, b in model.named_buffers() if "inv_freq" in name]
        assert buffer.dtype == torch.float32 and torch.equal(buffer, exact)
    # The rotary output is the float32 table rounded once, at the end, to the activations' dtype.
    positions = torch.arange(4000)[None]
    cos16, _ = model.model.rotary_emb(torch.zeros(1, 1, dtype=torch.float16), positions)
    cos32, _ = model.model.rotary_emb(torch.zeros(1, 1), positions)
    assert torch.equal(cos16, cos32.half())
