"""Per-dimension wavelength tables, plot, and the ``hf-posext inspect`` command (tiny models, no weights)."""

from __future__ import annotations

import json
import math

import pytest

from hf_posext.cli import main
from hf_posext.models import tiny_model
from hf_posext.wavelengths import format_table, model_wavelength_table, plot_wavelengths, wavelength_table

# SmolLM2-135M's rotary embedding: base 1e5, head dim 64, window 8192 (no weights needed).
SMOLLM2 = dict(theta=1e5, rotary_dim=64, original_length=8192)


def test_linear_interpolates_every_dimension():
    table = wavelength_table(**SMOLLM2, method="linear", factor=4)
    assert table.counts() == {"extrapolated": 0, "blended": 0, "interpolated": 32}
    for row in table.dimensions:
        assert row.stretch == pytest.approx(4.0)
        assert row.original_wavelength == pytest.approx(2 * math.pi * 1e5 ** (2 * row.index / 64))
    assert table.target_window == 32768


def test_yarn_regimes_follow_rotations_in_the_window():
    table = wavelength_table(**SMOLLM2, method="yarn", factor=4)
    for row in table.dimensions:
        if row.rotations_in_window > 40:  # well above beta_fast = 32 turns: kept
            assert row.regime == "extrapolated" and row.stretch == pytest.approx(1.0)
        if row.rotations_in_window < 1:  # below beta_slow = 1 turn: divided by s
            assert row.regime == "interpolated" and row.stretch == pytest.approx(4.0)
            assert row.beyond_window
    # Counts checked by hand against the ramp bounds floor(10.5) = 10 and ceil(19.9) = 20 of YaRN's formula.
    assert table.counts() == {"extrapolated": 11, "blended": 9, "interpolated": 12}
    assert table.attention_factor == pytest.approx(0.1 * math.log(4) + 1)


def test_ntk_spreads_the_stretch_geometrically():
    table = wavelength_table(**SMOLLM2, method="ntk", factor=4)
    assert table.dimensions[0].regime == "extrapolated"
    # b' = b * s^(d/(d-2)) divides the last frequency, theta_(d/2-1) = b^(-(d-2)/d), by exactly s.
    assert table.dimensions[-1].stretch == pytest.approx(4.0, rel=1e-6)
    stretches = [row.stretch for row in table.dimensions]
    assert stretches == sorted(stretches)
    assert table.counts()["blended"] == 30


def test_dynamic_method_is_shown_at_the_target_length_and_self_extend_is_refused():
    table = wavelength_table(**SMOLLM2, method="dynamic-yarn", target_length=16384)
    assert table.factor == 2 and "16384" in table.note
    assert table.counts()["interpolated"] > 0
    with pytest.raises(ValueError, match="does not change RoPE frequencies"):
        wavelength_table(**SMOLLM2, method="self-extend", factor=2)
    with pytest.raises(ValueError, match="Unknown method"):
        wavelength_table(**SMOLLM2, method="yarnn", factor=2)


@pytest.mark.parametrize("family, dim", [("llama", 8), ("gpt_neox", 2), ("gemma3", 8)])
def test_model_table_reads_base_dim_and_window(family, dim):
    table = model_wavelength_table(tiny_model(family), "linear", 2)
    assert table.rotary_dim == dim and table.original_window == 64 and len(table.dimensions) == dim // 2
    text = format_table(table)
    assert "linear x2" in text and "interpolated" in text


def test_a_model_with_unscaled_layer_types_says_which_layers_the_table_shows():
    """Gemma 3 scales only its global layers: the table is theirs, and the sliding layers' own base is named."""
    gemma3 = format_table(model_wavelength_table(tiny_model("gemma3"), "yarn", 2))
    assert "note: shown for the full_attention layers, the ones scaled; sliding_attention (base 10000) keep their positions" in gemma3
    assert "note:" not in format_table(model_wavelength_table(tiny_model("llama"), "yarn", 2))


def test_plot_writes_a_png(tmp_path):
    table = wavelength_table(**SMOLLM2, method="llama3", factor=8)
    path = plot_wavelengths(table, tmp_path / "sub" / "llama3.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_inspect_command_prints_table_json_and_plot(tmp_path, capsys):
    png = tmp_path / "yarn.png"
    assert main(["inspect", "tiny", "--method", "yarn", "--factor", "4", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "yarn x4" in out and "regime" in out and png.exists()
    assert main(["inspect", "tiny:llama:128", "--method", "longrope", "--factor", "2",
                 "--param", "long_factor=[1,1.5,2,3]", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["original_window"] == 128 and [round(d["stretch"], 6) for d in data["dimensions"]] == [1, 1.5, 2, 3]
    assert data["counts"] == {"extrapolated": 1, "blended": 1, "interpolated": 2}


def test_inspect_command_reports_bad_input(capsys):
    assert main(["inspect", "tiny", "--method", "self-extend", "--factor", "2"]) == 2
    assert "does not change RoPE frequencies" in capsys.readouterr().err
