"""The suite's rows: labels that read like a sentence, the base row, a row's identity across runs and labels."""

from __future__ import annotations

import pytest

from hf_posext.card.spec import is_base_row, method_text, parse_model_specs, relabelled_rows, row_label
from tests.card_helpers import LENGTH, char_tokenizer, tiny_folder  # noqa: F401 (a fixture)


def test_row_labels_read_like_a_sentence_and_name_a_saved_scaling():
    assert row_label("fine-tuned", {"method": "yarn+string", "factor": 4.0}) == "fine-tuned, yarn ×4 + string"
    assert method_text({"method": "none", "factor": 1.0}) == "unscaled"
    # a parameter the run asked for tells two rows of one method apart
    assert row_label("fine-tuned", {"method": "yarn+string", "factor": 4.0}, {"shifted_offset": 16384}) == (
        "fine-tuned, yarn ×4 + string (shifted_offset 16384)")
    assert row_label("base", {"method": "yarn", "factor": 4.0}, {"beta_fast": 16.0, "beta_slow": 2}) == (
        "base, yarn ×4 (beta_fast 16, beta_slow 2)")
    # a model whose scaling lives in its config is described by that scaling, never "x1"
    assert method_text({"method": "yarn", "factor": 4.0}) == "yarn ×4"
    specs = parse_model_specs("smollm2-135m,tuned=runs/r/merged,smollm2-135m+runs/r/adapter")
    assert [(s.name, s.model, s.adapter) for s in specs] == [
        ("smollm2-135m", "smollm2-135m", None), ("tuned", "runs/r/merged", None), ("fine-tuned", "smollm2-135m", "runs/r/adapter")]
    with pytest.raises(ValueError, match="two rows the name"):
        parse_model_specs("a=x,a=y")


def test_the_base_row_is_the_first_model_as_published_and_unscaled():
    """The reference of "beyond the base model" and of the plots' dashed line: a fine-tune whose config holds its
    yarn x4 is never the base, also listed first and as saved (its 32768 window would pass for the original's)."""
    plain, merged = {"kind": "rope", "method": "none"}, {"kind": "rope", "method": "yarn", "factor": 4.0}
    base, tuned = parse_model_specs("base=smollm2-135m,tuned=runs/merged")
    assert is_base_row(0, base, None, plain) and is_base_row(0, base, "none", plain)
    assert not is_base_row(0, base, "yarn", plain)  # a scaled row of the base model
    assert not is_base_row(1, base, None, plain)  # only the first model
    assert not is_base_row(0, tuned, None, merged) and not is_base_row(0, tuned, "none", merged)
    (adapter,) = parse_model_specs("smollm2-135m+runs/r/adapter")
    assert not is_base_row(0, adapter, None, plain)


def test_a_card_of_a_merged_fine_tune_as_saved_has_no_base_row(tiny_folder, tmp_path):
    """Through the card's rows, on a tiny model saved with yarn x2 in its config (as a merged fine-tune is)."""
    from hf_posext import load, patch
    from hf_posext.card.rows import card_model_rows

    merged = tmp_path / "merged"
    model = load(tiny_folder)
    patch(model, "yarn", factor=2)
    model.save_pretrained(merged)
    char_tokenizer().save_pretrained(merged)
    rows = card_model_rows(parse_model_specs(f"tuned={merged}@as-saved;none,base={tiny_folder}@none"), [LENGTH])
    assert [(r.label, r.base) for r in rows] == [("tuned, yarn ×2", False), ("tuned, unscaled", False), ("base, unscaled", False)]
    rows = card_model_rows(parse_model_specs(f"base={tiny_folder}@as-saved;yarn:factor=2,tuned={merged}@as-saved"), [LENGTH])
    assert [(r.label, r.base) for r in rows] == [("base, unscaled", True), ("base, yarn ×2", False), ("tuned, yarn ×2", False)]


def test_an_attention_method_on_a_saved_scaling_is_labelled_with_both():
    from hf_posext.card.spec import Row

    (spec,) = parse_model_specs("fine-tuned=runs/m")
    saved = {"kind": "rope", "method": "yarn", "factor": 4.0}
    string = {"kind": "attention", "method": "string", "factor": 1.0}
    assert Row(0, spec, None, string, False, saved=saved).label == "fine-tuned, yarn ×4 + string"
    assert Row(0, spec, None, string, False, saved={"kind": "rope", "method": "none", "factor": 1.0}).label == "fine-tuned, string ×1"
    assert Row(0, spec, None, saved, False, saved=saved).label == "fine-tuned, yarn ×4"


def test_a_relabelled_row_finds_its_sample_files_by_model_method_dtype_and_device(tmp_path):
    """The label is only the readable part of a sample file's name: a row whose label changed resumes the file of
    the same model, method, dtype and device; another dtype, or two such files (ambiguous), start a new one."""
    from hf_posext.core.request import ScalingRequest
    from hf_posext.card.spec import Row

    def row(label, factor=4.0):
        spec = parse_model_specs(f"{label}=some/model")[0]
        return Row(0, spec, ScalingRequest("yarn", factor), {"method": "yarn", "factor": factor}, base=False)

    folder = tmp_path / "ruler"
    folder.mkdir()
    old = row("old name").sample_path(folder, "ruler_fwe", 4096, "float32", "cpu")
    assert "old-name" in old.name and not old.exists()
    old.write_text("")
    assert row("new name").sample_path(folder, "ruler_fwe", 4096, "float32", "cpu") == old
    for other in (row("new name").sample_path(folder, "ruler_fwe", 4096, "bfloat16", "cpu"),
                  row("new name", 2.0).sample_path(folder, "ruler_fwe", 4096, "float32", "cpu"),
                  row("new name").sample_path(folder, "ruler_fwe", 8192, "float32", "cpu"),
                  row("new name").sample_path(folder, "niah_single_1", 4096, "float32", "cpu")):
        assert other != old and "new-name" in other.name
    (folder / old.name.replace("old-name", "older-name")).write_text("")
    assert "new-name" in row("new name").sample_path(folder, "ruler_fwe", 4096, "float32", "cpu").name


def test_a_row_measured_again_under_another_label_is_relabelled_but_not_one_with_other_method_parameters():
    """A run into a card folder takes over an earlier row it measures again under a new label (its cells are the
    run's now); a row of the same model and method with another parameter (STRING's shifted offset) is a row of
    its own, and the earlier row stays on the card beside it."""
    report = {"method": "string", "factor": 1.0, "current_window": 32768, "original_window": 32768,
              "params": {"shifted_offset": 24576, "local_value": 128}}
    earlier = [{"label": "fine-tuned", "model": "m", "report": report},
               {"label": "yarn", "model": "base", "report": {"method": "yarn", "factor": 4.0}}]
    assert relabelled_rows(earlier, [{"label": "tuned, string", "model": "m", "report": dict(report)}]) == {"fine-tuned": "tuned, string"}
    offset = {**report, "params": {**report["params"], "shifted_offset": 16384}}
    assert relabelled_rows(earlier, [{"label": "fine-tuned S 16384", "model": "m", "report": offset}]) == {}
    assert relabelled_rows(earlier, [{"label": "fine-tuned", "model": "m", "report": report}]) == {}  # the same label
    assert relabelled_rows(earlier, [{"label": "other model", "model": "n", "report": report}]) == {}
