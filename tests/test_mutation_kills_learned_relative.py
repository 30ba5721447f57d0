"""Learned tables and T5 relative bias on the paths their main tests leave out (found by bench/mutation.py)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import hf_posext
from hf_posext.backends.relative import UnsupportedModelError, find_bias_sites
from hf_posext.methods.learned import interpolation_grid, unchanged_table
from tests.test_relative import logits, tiny_t5


def test_grid_positions_past_the_last_row_take_the_last_row_with_weight_zero():
    """A grid longer than L*s (here 10 rows for 4 * 2): x = p / 2 passes row 3 = L - 1 from p = 6 on."""
    lower, upper, weight = interpolation_grid(10, 4, Fraction(2))
    assert lower.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    assert upper.tolist() == [1, 1, 2, 2, 3, 3, 3, 3, 3, 3]
    assert weight.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # x = 3.5 at p = 7: past the end


def test_none_keeps_a_table_of_its_own_length_whatever_its_width():
    table = torch.randn(10, 4)
    kept = unchanged_table(table, 10, Fraction(1))
    assert torch.equal(kept, table) and kept.data_ptr() != table.data_ptr()
    with pytest.raises(ValueError, match="it has 10 rows"):
        unchanged_table(table, 4, Fraction(1))  # the width is not the length


def test_describe_reports_factor_one_unpatched_and_a_static_scaling_patched():
    model = tiny_t5()
    report = hf_posext.describe(model)
    assert (report.method, report.factor, report.dynamic) == ("none", 1.0, False)
    hf_posext.patch(model, "linear", 2)
    report = hf_posext.describe(model)
    assert (report.method, report.factor, report.dynamic) == ("linear", 2.0, False)


def test_patching_again_replaces_the_scaling_instead_of_stacking_it():
    model, fresh = tiny_t5(), tiny_t5()
    hf_posext.patch(model, "linear", 2)
    hf_posext.patch(model, "linear", 4)
    hf_posext.patch(fresh, "linear", 4)
    stacked = tiny_t5()
    hf_posext.patch(stacked, "linear", 8)  # what a wrapper around the previous wrapper would compute
    assert torch.equal(logits(model), logits(fresh))
    assert not torch.allclose(logits(fresh), logits(stacked), atol=1e-3)


def test_a_failed_repatch_keeps_the_previous_scaling():
    model, reference = tiny_t5(), tiny_t5()
    hf_posext.patch(model, "linear", 2)
    hf_posext.patch(reference, "linear", 2)
    site = find_bias_sites(model)[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("no bias here")

    site.module.compute_bias = broken  # the probe of the new scaling fails on this site
    with pytest.raises(UnsupportedModelError, match="computing its relative bias failed"):
        hf_posext.patch(model, "linear", 4)
    del site.module.compute_bias
    assert hf_posext.describe(model).factor == 2.0
    assert torch.equal(logits(model), logits(reference))
    assert not torch.allclose(logits(model), logits(tiny_t5()), atol=1e-3)  # and it is not the unpatched model


def test_describe_notes_the_bucket_layout():
    notes = hf_posext.describe(tiny_t5()).notes
    assert notes[0] == ("2 bias table(s), 32 buckets: exact up to distance 8 (encoder) / 16 (decoder), logarithmic "
                        "up to 64, one shared bucket beyond")


def test_linear_table_interpolates_whenever_the_factor_is_not_one():
    """The identity shortcut is for factor 1 at the same length only: factor 2 at the same length compresses,
    factor 1 at another length pads with the last row."""
    from hf_posext.methods.learned import linear_table

    table = torch.arange(8.0).reshape(4, 2)
    squeezed = linear_table(table, 4, Fraction(2))
    assert squeezed.tolist() == [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]  # rows 0, 0.5, 1, 1.5
    padded = linear_table(table, 6, Fraction(1))
    assert padded.tolist() == table.tolist() + [[6.0, 7.0], [6.0, 7.0]]


def test_only_models_with_bias_tables_are_relative_and_the_record_has_the_new_window():
    from hf_posext.backends.relative import RelativeBackend
    from hf_posext.models import tiny_model

    assert RelativeBackend().detect(tiny_model("llama")) is None
    model = tiny_t5()
    assert RelativeBackend().detect(model) == "relative"
    hf_posext.patch(model, "linear", 2)
    assert RelativeBackend().detect(model) == "relative"
    assert model.config.hf_posext["current_window"] == 128  # 64 x 2


def test_sinusoid_positions_are_divided_by_the_factor():
    from hf_posext.methods.learned import linear_positions

    assert linear_positions(6, Fraction(2)).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert linear_positions(4, Fraction(1)).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert linear_positions(4, Fraction(4, 3)).tolist() == [0.0, 0.75, 1.5, 2.25]


def test_a_table_past_two_to_the_twenty_rows_is_refused_before_it_is_built():
    from tests.test_absolute import WINDOW, build

    model = build("gpt2")  # WINDOW positions: factor 2^20 // WINDOW + 1 asks for more than 2^20 rows
    assert WINDOW == 32
    with pytest.raises(ValueError, match=r"needs 1048608 rows in the table at 'transformer\.wpe', above hf_posext's "
                                         r"limit of 1048576 \(2\^20\)\. Use a smaller factor \(at most 32768 for this model\)\.$"):
        hf_posext.patch(model, "linear", 32769)
    assert hf_posext.describe(model).factor == 1.0
