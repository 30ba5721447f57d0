"""T5-style relative position bias (backends/relative.py) on tiny random T5 / mT5 / UMT5 models."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_posext
from hf_posext.backends.relative import find_bias_sites

NUM_BUCKETS, MAX_DISTANCE = 32, 64


def tiny_t5(family: str = "t5", seed: int = 0):
    """A tiny random encoder-decoder whose bias tables are large and random (the model depends on position)."""
    config_class, model_class = {
        "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration),
        "mt5": (transformers.MT5Config, transformers.MT5ForConditionalGeneration),
        "umt5": (transformers.UMT5Config, transformers.UMT5ForConditionalGeneration),
    }[family]
    config = config_class(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=NUM_BUCKETS, relative_attention_max_distance=MAX_DISTANCE,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for site in find_bias_sites(model):
            site.module.relative_attention_bias.weight.normal_(0.0, 3.0)
    return model


def logits(model, length: int = 160):
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 128, (1, length), generator=generator)
    decoder_ids = torch.randint(2, 128, (1, length // 2), generator=generator)
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=decoder_ids).logits


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(model.config.to_dict())


def assert_same_state(model, before):
    tensors, config = before
    after = model.state_dict()
    assert after.keys() == tensors.keys() and all(torch.equal(after[k], tensors[k]) for k in tensors)
    assert model.config.to_dict() == config


@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_sites_are_found_by_structure_in_encoder_and_decoder(family):
    paths = [site.path for site in find_bias_sites(tiny_t5(family))]
    assert any(p.startswith("encoder.") for p in paths) and any(p.startswith("decoder.") for p in paths)
    report = hf_posext.describe(tiny_t5(family))
    assert (report.kind, report.method, report.original_window) == ("relative", "none", MAX_DISTANCE)


@pytest.mark.parametrize("method", ["linear", "none"])
def test_factor_one_is_the_identity_to_the_bit_and_unpatch_restores_everything(method):
    model = tiny_t5()
    before, reference = state(model), logits(model)
    hf_posext.patch(model, method, factor=1)
    assert torch.equal(logits(model), reference)
    hf_posext.patch(model, "linear", factor=4)
    assert not torch.allclose(logits(model), reference, atol=1e-3)  # the patch does change the model...
    hf_posext.unpatch(model)
    assert torch.equal(logits(model), reference)  # ...and unpatch puts every bit back
    assert_same_state(model, before)
    assert all("_relative_position_bucket" not in site.module.__dict__ for site in find_bias_sites(model))


@pytest.mark.parametrize("family", ["t5", "umt5"])
@pytest.mark.parametrize("scale", [2, 3])
def test_linear_bias_at_distance_s_times_d_equals_the_original_bias_at_d(family, scale):
    model = tiny_t5(family)
    length = scale * 2 * MAX_DISTANCE
    sites = find_bias_sites(model)
    original = [site.module.compute_bias(length, length) for site in sites]
    hf_posext.patch(model, "linear", factor=scale)
    scaled = [site.module.compute_bias(length, length) for site in sites]
    query = length // 2
    checked = 0
    for before, after in zip(original, scaled):
        for d in range(-query // scale, (length - query) // scale):
            # key = query + s*d after scaling sees the bucket of distance d before scaling
            assert torch.equal(after[0, :, query, query + scale * d], before[0, :, query, query + d])
            checked += 1
        # and the patch is not a no-op: at distance -1 the scaled bias is the one of distance 0
        assert not torch.equal(after[0, :, query, query - 1], before[0, :, query, query - 1])
    assert checked == 2 * len(sites) * MAX_DISTANCE  # every distance in [-max_distance, max_distance)


def test_save_and_load_round_trip_and_stock_loading_is_explained(tmp_path):
    model = tiny_t5()
    reference = logits(model)
    hf_posext.patch(model, "linear", factor=2)
    patched = logits(model)
    model.save_pretrained(tmp_path)
    loaded = hf_posext.load(tmp_path)
    assert torch.equal(logits(loaded), patched)
    assert hf_posext.describe(loaded).method == "linear" and hf_posext.describe(loaded).factor == 2
    report = hf_posext.describe(model)
    assert report.stock_loadable is False and any("stock from_pretrained loads this model unscaled" in n for n in report.notes)
    stock = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert torch.equal(logits(stock), reference)  # unscaled, as describe says
    assert any("hf_posext.load" in note for note in hf_posext.describe(stock).notes)
    hf_posext.unpatch(loaded)
    assert torch.equal(logits(loaded), reference)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("yarn",), {"factor": 2}, "applies to rope position encodings, but this model uses relative ones"),
        (("linear",), {"factor": 0.5}, "below 1"),
        (("linear",), {"target_length": 32}, "shorter than the model's original window"),
        (("self-extend",), {"group_size": 4}, "applies to attention position encodings"),
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(args, kwargs, message):
    model = tiny_t5()
    hf_posext.patch(model, "linear", factor=2)
    before, reference = state(model), logits(model)
    with pytest.raises(ValueError, match=message):
        hf_posext.patch(model, *args, **kwargs)
    assert torch.equal(logits(model), reference)
    assert_same_state(model, before)
    assert hf_posext.describe(model).factor == 2


def test_a_bias_that_bypasses_the_bucketing_fails_loudly():
    model = tiny_t5()
    site = find_bias_sites(model)[0]
    site.module.compute_bias = lambda q, k, device=None, past_seen_tokens=0: torch.zeros(1, 4, q, k)
    with pytest.raises(ValueError, match="does not call _relative_position_bucket"):
        hf_posext.patch(model, "linear", factor=2)
    assert not any("_relative_position_bucket" in s.module.__dict__ for s in find_bias_sites(model))


def test_the_cli_patches_describes_and_refuses_on_t5(tmp_path, capsys):
    from hf_posext.cli import main

    tiny_t5().save_pretrained(tmp_path / "t5")
    assert main(["patch", str(tmp_path / "t5"), "--method", "linear", "--factor", "2", "--out", str(tmp_path / "x2")]) == 0
    assert main(["describe", str(tmp_path / "x2"), "--json"]) == 0
    assert '"kind": "relative"' in capsys.readouterr().out
    assert main(["patch", str(tmp_path / "t5"), "--method", "yarn", "--factor", "2", "--out", str(tmp_path / "bad")]) == 2
    assert "Methods valid here: linear, none" in capsys.readouterr().err and not (tmp_path / "bad").exists()
