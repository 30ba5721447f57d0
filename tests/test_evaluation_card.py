"""``hf-posext eval card``: the RULER sample cache and its key, per-sample resume, the length-budget refusal,
a corrupt results file, the short generation budget, labels, paired comparisons, writing a card again from its
folder (``hf-posext report CARD``), and the card end to end on a tiny model."""

from __future__ import annotations

import json
import math
import re
import string
from pathlib import Path

import pytest

from hf_posext.core.errors import DamagedFileError
from hf_posext.evaluation.card import (
    relabelled_rows,
    CardFileError, SampleCache, SampleResults, SampleResultsError, base_reference, beyond_base, card_figure, sample_counts_text, combined_row_order, check_length_budget, combine_cards, earlier_card, method_text,
    first_budget, is_base_row, markdown_card, perplexity_cell_fields, needs_full_budget, unmarked_note, paired_comparisons, parse_model_specs, read_sample_records, rewrite_card, row_label,
    ruler_cell_fields, sample_cache_key, score_summary, tokenizer_hash, write_card,
)

LENGTH = 2048  # characters = tokens with the character tokenizer; ruler_vt loops forever at 1024 (its few-shot example fills it)


def _char_tokenizer():
    """Every printable ASCII character one token (100 ids, inside the tiny models' 128): offline, no hub."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from hf_posext.models import tiny_model

    folder = tmp_path_factory.mktemp("tiny_card")
    tiny_model("llama", max_position_embeddings=LENGTH).save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    return str(folder)


# ------------------------------------------------------------------ pure parts


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
    from types import SimpleNamespace

    from hf_posext import load, patch
    from hf_posext.integrations.lm_eval.card import card_model_rows

    merged = tmp_path / "merged"
    model = load(tiny_folder)
    patch(model, "yarn", factor=2)
    model.save_pretrained(merged)
    _char_tokenizer().save_pretrained(merged)
    args = SimpleNamespace(param=[], factor=None, methods="none")
    rows = card_model_rows(parse_model_specs(f"tuned={merged}@as-saved;none,base={tiny_folder}@none"), args, [LENGTH])
    assert [(r.label, r.base) for r in rows] == [("tuned, yarn ×2", False), ("tuned, unscaled", False), ("base, unscaled", False)]
    rows = card_model_rows(parse_model_specs(f"base={tiny_folder}@as-saved;yarn:factor=2,tuned={merged}@as-saved"), args, [LENGTH])
    assert [(r.label, r.base) for r in rows] == [("base, unscaled", True), ("base, yarn ×2", False), ("tuned, yarn ×2", False)]


def test_cache_key_follows_the_tokenizer_not_its_files(tmp_path):
    tokenizer = _char_tokenizer()
    tokenizer.save_pretrained(tmp_path / "a")
    tokenizer.model_max_length = 99999  # what hf-posext patch writes beside a scaled model
    tokenizer.save_pretrained(tmp_path / "b")
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(tmp_path / "a"), AutoTokenizer.from_pretrained(tmp_path / "b")
    assert tokenizer_hash(a) == tokenizer_hash(b)
    other = _char_tokenizer()
    other.add_tokens(["<extra>"])
    assert tokenizer_hash(other) != tokenizer_hash(a)
    key = sample_cache_key("niah_single_1", 1.0, tokenizer_hash(a), 1024, 0, "0.4.13")
    cache = SampleCache(tmp_path / "cache")
    docs = [{"input": "x", "outputs": ["1"]}, {"input": "y", "outputs": ["2"]}]
    cache.put(key, docs)
    assert cache.get(key, 1) == docs[:1] and cache.get(key, 3) is None
    for changed in ({"seed": 1}, {"length": 2048}, {"task_version": "2.0"}, {"tokenizer": tokenizer_hash(other)}):
        assert cache.get({**key, **changed}, 1) is None, changed


def test_a_sample_cache_edited_under_its_key_is_refused_by_its_digest(tmp_path):
    key = sample_cache_key("niah_single_1", 1.0, "tok", 1024, 0, "0.4.13")
    cache = SampleCache(tmp_path / "cache")
    path = cache.put(key, [{"input": "The code is 1234.", "outputs": ["1234"]}, {"input": "y", "outputs": ["2"]}])
    data = json.loads(path.read_text())
    data["docs"][0]["input"] = "The code is 9999."  # the prompt edited, its key kept
    path.write_text(json.dumps(data))
    with pytest.raises(DamagedFileError) as refused:
        cache.get(key, 1)
    message = str(refused.value)
    assert f"RULER sample cache {path}" in message and "do not match their digest" in message, message
    assert "delete it to generate the samples again" in message and "\n" not in message
    data.pop("digest")  # a cache written before digests is read as it is
    path.write_text(json.dumps(data))
    assert cache.get(key, 1)[0]["input"] == "The code is 9999."


def test_sample_results_resume_and_a_cut_off_last_line(tmp_path):
    header = {"row": "r", "task": "t", "length": 8}
    path = tmp_path / "cell.jsonl"
    results = SampleResults(path, header)
    for i in range(3):
        results.add({"doc_id": i, "score": float(i % 2), "response": "x"})
    path.write_bytes(path.read_bytes() + b'{"doc_id": 3, "sco')  # killed while writing sample 3
    again = SampleResults(path, header)
    assert sorted(again.records) == [0, 1, 2]
    again.add({"doc_id": 3, "score": 1.0, "response": "y"})
    assert sorted(SampleResults(path, header).records) == [0, 1, 2, 3]


def test_a_corrupt_results_file_is_named_never_reused(tmp_path):
    header = {"row": "r", "task": "t", "length": 8}
    path = tmp_path / "cell.jsonl"
    results = SampleResults(path, header)
    results.add({"doc_id": 0, "score": 1.0, "response": "x"})
    results.add({"doc_id": 1, "score": 0.0, "response": "x"})
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with pytest.raises(SampleResultsError, match=r"cell\.jsonl line 2 is not a JSON record"):
        SampleResults(path, header)
    path.write_text("\n".join([lines[0], json.dumps({"doc_id": 0, "score": 7, "response": "x"})]) + "\n")
    with pytest.raises(SampleResultsError, match="line 2 has score 7"):
        SampleResults(path, header)
    path.write_text("\n".join(lines) + "\n")
    # refused in one line that names what differs, not two whole headers
    with pytest.raises(SampleResultsError, match=r"another cell's samples \(length is \d+ in the file, 16 in this run\)") as refused:
        SampleResults(path, {**header, "length": 16})
    assert len(str(refused.value).splitlines()) == 1 and "move the file away" in str(refused.value)
    with pytest.raises(SampleResultsError, match=r"another cell's samples \(dtype is in this run only\)"):
        SampleResults(path, {**header, "dtype": "bfloat16"})
    keyed = tmp_path / "keyed.jsonl"
    SampleResults(keyed, {**header, "sample_key": {"tokenizer": "cdedcae4", "seed": 0}}).add({"doc_id": 0, "score": 1.0, "response": "x"})
    with pytest.raises(SampleResultsError, match=r"\(sample_key.tokenizer is 'cdedcae4' in the file, 'a3e28c52' in this run\)"):
        SampleResults(keyed, {**header, "sample_key": {"tokenizer": "a3e28c52", "seed": 0}})
    # the row's label only presents the cell: a file written under another label is the same cell
    assert sorted(SampleResults(path, {**header, "row": "r, renamed"}).records) == [0, 1]


def test_an_attention_method_on_a_saved_scaling_is_labelled_with_both():
    from hf_posext.integrations.lm_eval.card import Row

    (spec,) = parse_model_specs("fine-tuned=runs/m")
    saved = {"kind": "rope", "method": "yarn", "factor": 4.0}
    string = {"kind": "attention", "method": "string", "factor": 1.0}
    assert Row(0, spec, None, string, False, saved=saved).label == "fine-tuned, yarn ×4 + string"
    assert Row(0, spec, None, string, False, saved={"kind": "rope", "method": "none", "factor": 1.0}).label == "fine-tuned, string ×1"
    assert Row(0, spec, None, saved, False, saved=saved).label == "fine-tuned, yarn ×4"


def test_over_budget_lengths_are_refused_in_one_line():
    assert check_length_budget("r", "t", 4096, 4000, 96, 4096, 4096) is None
    harness = check_length_budget("r", "niah_single_1", 4096, 4000, 128, 8192, 4096)
    assert "max_length 4096" in harness and "\n" not in harness
    window = check_length_budget("base, unscaled", "niah_single_1", 16384, 16250, 128, 8192, 16384)
    assert "window 8192" in window and "\n" not in window


def test_short_budget_is_escalated_exactly_when_it_could_change_the_score():
    assert not needs_full_budget(1.0, 24, 24, 128)  # already right: a longer output only adds text
    assert not needs_full_budget(0.0, 9, 24, 128)  # stopped before the budget: the full one stops there too
    assert needs_full_budget(0.0, 24, 24, 128) and needs_full_budget(0.5, 24, 24, 128)
    assert not needs_full_budget(0.0, 128, 128, 128)


def test_a_cell_starts_with_the_full_budget_once_generating_again_costs_more_than_the_short_one_saves():
    """Short first while generating again is rare or cheap (a short prompt); the full budget at once where one more
    prefill of a long prompt costs more than the decode steps the short budget saves (measured on 2 CPU cores at
    32768 tokens: 560 s of prefill against 19 s for 128 steps)."""
    def record(prefill, step, escalated, tokens=24):
        return {"timing": {"prefill_s": prefill, "generate_s": step * (tokens - 1)}, "generated_tokens": tokens,
                "escalated": escalated}

    assert first_budget([], 24, 128) == 24  # nothing measured yet
    assert first_budget([record(560.0, 0.15, True)], 24, 128) == 128
    # one success only: still (0 + 1) / (1 + 2) = 1/3 expected again, and 1/3 of 579 s is far above 15.6 s saved
    assert first_budget([record(560.0, 0.15, False)], 24, 128) == 128
    short_prompt = [record(1.0, 0.05, False), record(1.0, 0.05, False), record(1.0, 0.05, True)]
    assert first_budget(short_prompt, 24, 128) == 24  # 0.4 x 7.4 s < 5.2 s saved
    assert first_budget(short_prompt + [record(1.0, 0.05, True)] * 7, 24, 128) == 128  # 0.75 x 7.4 s > 5.2 s
    assert first_budget([record(560.0, 0.15, True)], 128, 128) == 128 and first_budget([], 200, 128) == 128


def test_scores_intervals_and_beyond_the_base_model():
    assert score_summary([1, 0, 1])["text"].startswith("2/3 [")
    mixed = score_summary([0.5, 1.0, 0.0, 0.5])
    assert mixed["mean"] == 0.5 and mixed["low"] < 0.5 < mixed["high"]
    cells = [{"task": "a", "kind": "ruler", "base": True, "in_window": True, "mean": 0.1},
             {"task": "a", "kind": "ruler", "base": True, "in_window": False, "mean": 0.9},
             {"task": "b", "kind": "ruler", "base": True, "in_window": True, "mean": 0.25},
             {"task": "a", "kind": "ruler", "base": False, "in_window": True, "mean": 1.0}]
    assert beyond_base(cells) == {"a": True, "b": False}
    # a task no base row ran inside its window is neither: the card says so in one line, never silently
    unknown = cells + [{"task": "c", "kind": "ruler", "base": False, "in_window": True, "mean": 0.9}]
    assert beyond_base(unknown) == {"a": True, "b": False, "c": None}
    assert unmarked_note(beyond_base(cells)) == ""
    assert unmarked_note(beyond_base(unknown)).startswith("Not marked as counting or beyond the base model: c (no base row")
    table = [{**cell, "row": f"r{index}", "row_index": index, "length": 2048, "text": "0.5"} for index, cell in enumerate(unknown)]
    assert unmarked_note(beyond_base(unknown)) in markdown_card(table)


KEY = {"task": "niah_single_1", "length": 4096, "seed": 0}


def _cell(row: str, index: int, scores: dict[int, float], key: dict | None = None, task: str = "niah_single_1") -> dict:
    return {"task": task, "kind": "ruler", "row": row, "row_index": index, "length": 4096, "base": index == 0,
            "in_window": True, "sample_key": key or KEY, "scores": {str(i): v for i, v in scores.items()},
            **score_summary(list(scores.values()))}


def test_a_task_plot_draws_the_base_models_best_in_window_score_and_every_points_interval():
    """The dashed reference is the base row's best score inside its window (a score past the window, or another
    row's, never sets it; for perplexity the lowest); a row with a single point still shows its interval."""
    from hf_posext.evaluation.plots import layout_problems

    def cell(row, index, length, scores, base=False, in_window=True):
        return {**_cell(row, index, dict(enumerate(scores))), "length": length, "base": base, "in_window": in_window}

    cells = [cell("base", 0, 2048, [1, 0, 1, 0], base=True), cell("base", 0, 4096, [1, 1, 1, 0], base=True),
             cell("base", 0, 16384, [1, 1, 1, 1], base=True, in_window=False), cell("yarn", 1, 16384, [1, 1, 1, 1]),
             cell("tuned", 2, 32768, [1, 1, 0, 1])]
    assert base_reference(cells) == (0.75, 4096)
    assert base_reference(cells[3:]) is None
    figure = card_figure("niah_single_1", cells, beyond=False)
    axis = figure.axes[0]
    (reference,) = [line for line in axis.get_lines() if line.get_label().startswith("base, best inside its window")]
    assert list(reference.get_ydata()) == [0.75, 0.75] and "(0.75 at 4k)" in reference.get_label()
    bars = [c for c in axis.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 3  # one per row, the single-point rows included
    tuned_low, tuned_high = cells[4]["low"], cells[4]["high"]
    segment = bars[2].lines[2][0].get_segments()[0]
    assert [round(y, 6) for _, y in segment] == [round(tuned_low, 6), round(tuned_high, 6)]
    assert layout_problems(figure) == []
    # n in the legend, by length where it differs (never "n=4/8", which reads as 4 of 8)
    assert [line.get_label() for line in axis.get_lines() if "(n=" in line.get_label()] == ["base (n=4)", "yarn (n=4)", "tuned (n=4)"]
    points = [{"n": 20, "length": 2048}, {"n": 20, "length": 16384}, {"n": 10, "length": 32768}]
    assert sample_counts_text(points) == "n=20 at 2k-16k, 10 at 32k"
    assert sample_counts_text(points[1:]) == "n=20 at 16k, 10 at 32k" and sample_counts_text(points[:2]) == "n=20"
    # labels too long for two legend columns (the combined SmolLM2 card's): one column, nothing clipped
    long = [{**c, "row": f"fine-tuned with a long practice name, yarn ×4 + string {c['row']}"} for c in cells]
    wide = card_figure("niah_single_1", long, beyond=False)
    def columns(drawn):  # legend columns: distinct left edges of its texts
        renderer = drawn.canvas.get_renderer()
        return len({round(t.get_window_extent(renderer).x0) for t in drawn.legends[0].get_texts()})

    assert layout_problems(wide) == [] and columns(wide) == 1
    assert columns(figure) == 2  # short labels keep two
    ppl = [{**c, "task": "perplexity", "low": None, "high": None, "mean": m} for c, m in zip(cells[:3], (30.0, 25.8, 20.0))]
    assert base_reference(ppl) == (25.8, 4096)


def test_paired_comparisons_count_the_samples_each_row_won():
    """Only samples both rows scored count; the row with the higher total is written first; ties enter
    neither side of the sign test; another sample key is never paired."""
    yarn = _cell("yarn", 0, {0: 1, 1: 1, 2: 0, 3: 0, 4: 0, 5: 1, 6: 0, 7: 0, 8: 0})
    tuned = _cell("tuned", 1, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 9: 0})  # doc 8 / 9: one row only
    other = _cell("other samples", 2, {i: 0 for i in range(9)}, key={**KEY, "seed": 1})
    (pair,) = paired_comparisons([yarn, tuned, other])
    assert (pair["first"], pair["second"]) == ("tuned", "yarn")
    assert (pair["higher"], pair["lower"], pair["equal"], pair["n"]) == (5, 0, 3, 8)
    assert pair["p"] == 2 / 2**5 and pair["text"] == "5:0 of 8 (p = 0.062)"
    # fractional scores (ruler_fwe: the share of 3 words found) compare as numbers
    a = _cell("a", 0, {0: 2 / 3, 1: 1 / 3, 2: 1.0}, task="ruler_fwe")
    b = _cell("b", 1, {0: 1 / 3, 1: 1 / 3, 2: 0.0}, task="ruler_fwe")
    (fwe,) = paired_comparisons([a, b])
    assert (fwe["first"], fwe["higher"], fwe["lower"], fwe["equal"]) == ("a", 2, 0, 1)
    # cells without per-sample scores (a card.json from before they were kept) are not compared
    assert paired_comparisons([{k: v for k, v in yarn.items() if k != "scores"}, tuned]) == []



def test_passkey_and_needle_rows_are_paired_trial_by_trial():
    """Passkey and needle cells carry each trial's outcome ("DEPTH/TRIAL"), and pair like RULER samples; trials of
    another seed never pair."""
    from hf_posext.integrations.lm_eval.card import trial_scores

    units = [{"greedy": True}, {"greedy": False}, {"greedy": None}]
    keys = [["needle", 4096, 0.5, 0], ["needle", 4096, 0.5, 1], ["needle", 4096, 0.5, 2]]
    assert trial_scores([{"unit_keys": keys, "units": units}, {"trials": 4}]) == {"0.5/0": 1.0, "0.5/1": 0.0}
    key = {"task": "needle", "length": 16384, "seed": 0, "depths": [0.0, 1.0], "trials": 2}
    tuned = {**_cell("tuned", 1, {}), "kind": "needle", "task": "needle", "sample_key": key,
             "scores": {"0/0": 1.0, "0/1": 1.0, "1/0": 1.0, "1/1": 1.0}}
    yarn = {**tuned, "row": "yarn", "row_index": 0, "scores": {"0/0": 0.0, "0/1": 1.0, "1/0": 0.0, "1/1": 0.0}}
    other = {**yarn, "row": "other seed", "row_index": 2, "sample_key": {**key, "seed": 1}}
    (pair,) = paired_comparisons([yarn, tuned, other])
    assert (pair["task"], pair["first"], pair["second"], pair["higher"], pair["lower"], pair["n"]) == ("needle", "tuned", "yarn", 3, 0, 4)


def _perplexity_results(data: str, windows: dict[str, list[tuple[float, int]]], length: int = 4096) -> dict:
    """A perplexity results file's data: per method a cell at ``length`` holding its windows' ``(nll_sum, tokens)``."""
    cells = {}
    for method, units in windows.items():
        nll, tokens = sum(n for n, _ in units), sum(t for _, t in units)
        cells[f"{method}|factor=4|length={length}"] = {
            "method": method, "factor": 4.0, "length": length, "nll": nll / tokens, "ppl": math.exp(nll / tokens), "tokens": tokens, "windows": len(units),
            "units": [{"nll_sum": n, "tokens": t, "seconds": 1.0} for n, t in units],
            "unit_keys": [["ppl", length, 0, i * length] for i in range(len(units))]}
    return {"task": "perplexity", "config": {"task": "perplexity", "model": "m", "data": data, "max_windows": 8, "dtype": "float32"},
            "cells": cells}


def test_perplexity_rows_are_paired_window_by_window_the_lower_loss_counting_as_better():
    """Each window's mean loss is kept; on the same windows of the same text the row with the lower loss wins
    that window (a sign flip would write the worse row first and count its windows); another text never pairs."""
    results = _perplexity_results("books/emma.txt", {"yarn": [(3.1 * 100, 100), (3.0 * 100, 100), (2.9 * 100, 100)],
                                                   "tuned": [(2.8 * 100, 100), (2.7 * 100, 100), (2.9 * 100, 100)]})
    yarn = perplexity_cell_fields(results, 4096, "yarn|factor=4|length=4096")
    assert yarn["scores"] == pytest.approx({"0/0": 3.1, "0/4096": 3.0, "0/8192": 2.9})
    assert yarn["sample_key"] == {"task": "perplexity", "length": 4096, "data": "books/emma.txt", "dtype": "float32", "max_windows": 8}
    tuned_ppl = results["cells"]["tuned|factor=4|length=4096"]["ppl"]
    # a card written before cells kept their id finds its cell by the perplexity it shows
    assert perplexity_cell_fields(results, 4096, ppl=tuned_ppl)["scores"] == pytest.approx({"0/0": 2.8, "0/4096": 2.7, "0/8192": 2.9})
    assert perplexity_cell_fields(results, 4096, ppl=99.0) == {} and perplexity_cell_fields(results, 2048, "yarn|factor=4|length=4096") == {}
    cell = lambda row, index, fields: {"task": "perplexity", "kind": "perplexity", "row": row, "row_index": index, "length": 4096, **fields}  # noqa: E731
    tuned = perplexity_cell_fields(results, 4096, "tuned|factor=4|length=4096")
    other = {**tuned, "sample_key": {**tuned["sample_key"], "data": "books/other.txt"}}
    (pair,) = paired_comparisons([cell("yarn", 0, yarn), cell("tuned", 1, tuned), cell("other text", 2, other)])
    assert (pair["task"], pair["first"], pair["second"]) == ("perplexity", "tuned", "yarn")
    assert (pair["higher"], pair["lower"], pair["equal"], pair["text"]) == (2, 0, 1, "2:0 of 3 (p = 0.5)")
    assert "for perplexity a lower loss" in markdown_card([{**cell("yarn", 0, yarn), "n": 3, "mean": 20.0, "low": None, "high": None,
                                                           "text": "20.00"}, {**cell("tuned", 1, tuned), "n": 3, "mean": 16.0,
                                                           "low": None, "high": None, "text": "16.00"}])


def test_a_card_written_before_perplexity_windows_were_kept_gains_their_paired_row(tmp_path):
    """``hf-posext report CARD`` reads a perplexity cell's windows from its results file (only read); a damaged
    results file is named."""
    from hf_posext.evaluation.results_files import ResultsFileError

    folder = tmp_path / "card"
    results = _perplexity_results("books/emma.txt", {"yarn": [(300.0, 100), (310.0, 100)], "tuned": [(280.0, 100), (290.0, 100)]})
    source = folder / "tasks" / "perplexity-m-0.json"
    source.parent.mkdir(parents=True)
    source.write_text(json.dumps(results))
    cells = [{"task": "perplexity", "kind": "perplexity", "row": method, "row_index": index, "length": 4096, "n": 2,
              "mean": results["cells"][f"{method}|factor=4|length=4096"]["ppl"], "low": None, "high": None, "text": "x",
              "source": f"elsewhere/{source.name}"} for index, method in enumerate(("yarn", "tuned"))]
    write_card(folder, cells, [], {"samples": 4, "partial": False})
    before = source.read_bytes()
    source.write_text('{"cells": ')
    with pytest.raises(ResultsFileError, match=re.escape(str(source))):
        rewrite_card(folder)
    source.write_bytes(before)
    card = json.loads(rewrite_card(folder)["json"].read_text())
    (pair,) = card["paired"]
    assert (pair["task"], pair["first"], pair["higher"], pair["lower"]) == ("perplexity", "tuned", 2, 0)
    assert source.read_bytes() == before and card["cells"][0]["scores"] == pytest.approx({"0/0": 3.0, "0/4096": 3.1})


def _sample_file(path: Path, scores: list[float], cut_tail: bool = False, **header) -> None:
    lines = [json.dumps({"record_version": 1, "row": "r", "task": "niah_single_1", "length": 4096, **header})]
    lines += [json.dumps({"doc_id": i, "score": v, "response": " 1", "timing": {"prefill_s": 1.0, "generate_s": 0.5,
                                                                                 "harness_s": 0.0, "total_s": 1.5}})
              for i, v in enumerate(scores)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + ("\n" + '{"doc_id": 9, "sco' if cut_tail else "\n"))


def test_a_card_is_written_again_from_its_folder_without_touching_its_samples(tmp_path):
    """``hf-posext report CARD``: every RULER cell is read again from its sample file (a card.json written
    before per-sample scores were kept gains the paired table; a cell shows the samples its file holds), and a
    file a run is still appending to (a cut-off last line) is read, never rewritten."""
    from hf_posext.cli import main

    folder = tmp_path / "card"
    first, second = folder / "ruler" / "first.jsonl", folder / "ruler" / "second.jsonl"
    _sample_file(first, [1, 1, 1, 1])
    _sample_file(second, [0, 1, 0, 1], cut_tail=True)
    cells = []
    for index, path in enumerate((first, second)):
        cell = {**_cell(f"row {index}", index, {0: 1.0}), "source": f"somewhere/else/{path.name}"}  # moved since
        del cell["scores"]
        cells.append(cell)
    write_card(folder, cells, [], {"samples": 4, "partial": False})
    assert json.loads((folder / "card.json").read_text())["paired"] == []
    before = {p: p.read_bytes() for p in (first, second)}

    assert main(["report", str(folder)]) == 0
    card = json.loads((folder / "card.json").read_text())
    assert [c["n"] for c in card["cells"]] == [4, 4] and card["cells"][1]["text"].startswith("2/4")
    (pair,) = card["paired"]
    assert (pair["first"], pair["higher"], pair["lower"]) == ("row 0", 2, 0)
    assert "Paired samples" in (folder / "card.html").read_text() and "2:0 of 4" in (folder / "card.md").read_text()
    assert {p: p.read_bytes() for p in before} == before
    assert read_sample_records(second).keys() == {0, 1, 2, 3}
    assert ruler_cell_fields(read_sample_records(first), 2)["n"] == 2  # only the card's first --samples


def _one_run_card(folder: Path, rows: list[tuple[str, int, list[float]]], dtype: str) -> None:
    """A card folder as one run writes it: per (row, length) a sample file and its cell."""
    cells = []
    for index, (row, length, scores) in enumerate(rows):
        path = folder / "ruler" / f"{row}-{length}.jsonl"
        _sample_file(path, scores, row=row, length=length, dtype=dtype)
        cells.append({**_cell(row, index, dict(enumerate(scores))), "length": length, "source": str(path)})
    labels = list(dict.fromkeys(row for row, _, _ in rows))
    settings = {"samples": 4, "dtypes": {"niah_single_1": dtype}, "lengths": sorted({n for _, n, _ in rows}),
                "rows": [{"label": label, "model": "m", "report": {"current_window": 65536}} for label in labels],
                "device": "cpu", "partial": False}
    write_card(folder, cells, [], settings)


def test_a_combined_card_lists_the_base_row_then_its_training_free_rows_then_the_fine_tunes(tmp_path):
    """Row order in a combined card follows what a row is (the base model unscaled, its training-free methods, other
    models), never which part first holds a cell of it: a part that lists a fine-tune first, with a cell on the
    first task, does not move it above the base model's rows."""
    rows = {"tuned": {"model": "runs/tuned", "base": False}, "base": {"model": "orig", "base": True},
            "yarn": {"model": "orig", "base": False}, "other": {"model": "runs/other", "base": False}}

    def part(folder: Path, listed: list[str], cells: list[tuple[str, int]]) -> None:
        written = []
        for row, length in cells:
            path = folder / "ruler" / f"{row}-{length}.jsonl"
            _sample_file(path, [1, 0, 1, 1], row=row, length=length, dtype="float32")
            written.append({**_cell(row, listed.index(row), {0: 1, 1: 0, 2: 1, 3: 1}), "length": length,
                            "base": rows[row]["base"], "source": str(path)})
        settings = {"samples": 4, "dtypes": {"niah_single_1": "float32"}, "lengths": sorted({n for _, n in cells}),
                    "rows": [{"label": row, **rows[row], "report": {"current_window": 65536}} for row in listed],
                    "device": "cpu", "partial": False}
        write_card(folder, written, [], settings)

    first, second = tmp_path / "first", tmp_path / "second"
    part(first, ["tuned", "base", "yarn"], [("tuned", 16384), ("base", 2048)])
    part(second, ["other", "yarn"], [("other", 16384), ("yarn", 16384)])
    combined = json.loads(combine_cards([first, second], tmp_path / "combined")["json"].read_text())
    assert sorted({(c["row_index"], c["row"]) for c in combined["cells"]}) == [
        (0, "base"), (1, "yarn"), (2, "tuned"), (3, "other")]
    assert combined_row_order([([], {"rows": [{"label": "b", "model": "m"}, {"label": "a", "model": "m", "base": True}]}),
                               ([{"row": "c", "row_index": 0}], {})]) == {"a": 0, "b": 1, "c": 2}
    # a base row and another row that both name no model are not one model: the other is not the base's method
    assert combined_row_order([([], {"rows": [{"label": "m", "model": "m"}, {"label": "x"}, {"label": "a", "base": True}]})]) == {
        "a": 0, "m": 1, "x": 2}


def test_cards_of_several_runs_combine_into_one_and_again_after_a_run_goes_on(tmp_path):
    """``hf-posext report A B --out C``: one table over both runs' lengths, rows matched by label (their order
    by what a row is, then first appearance: combined_row_order), each cell with its run's dtype, pairs where one run ran both rows; C's card.json
    names A and B relative to C, so ``hf-posext report C`` combines them again once A has more samples."""
    from hf_posext.cli import main

    short, long = tmp_path / "runs" / "short", tmp_path / "runs" / "long"
    _one_run_card(short, [("base", 2048, [1, 1, 1, 1]), ("tuned", 2048, [1, 1, 1, 0])], "bfloat16")
    _one_run_card(long, [("tuned", 32768, [1, 1, 0]), ("yarn", 32768, [0, 0, 0, 1])], "float32")
    out = tmp_path / "combined"
    assert main(["report", str(short), str(long), "--out", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    got = {(c["row"], c["length"]): (c["row_index"], c["dtype"], c["n"]) for c in card["cells"]}
    assert got == {("base", 2048): (0, "bfloat16", 4), ("tuned", 2048): (1, "bfloat16", 4),
                   ("tuned", 32768): (1, "float32", 3), ("yarn", 32768): (2, "float32", 4)}
    assert card["settings"]["combined_from"] == [str(Path("..") / "runs" / "short"), str(Path("..") / "runs" / "long")]
    assert [(p["first"], p["second"], p["length"], p["higher"], p["lower"]) for p in card["paired"]] == [
        ("base", "tuned", 2048, 1, 0), ("tuned", "yarn", 32768, 2, 0)]
    page = (out / "card.html").read_text()
    assert "Combined from" in page and "niah_single_1 float32" in page and "card-niah_single_1.png" not in page
    assert "32k" in (out / "card.md").read_text() and (out / "card-niah_single_1.png").is_file()
    assert json.loads((short / "card.json").read_text())["settings"].get("combined_from") is None  # sources untouched

    _sample_file(long / "ruler" / "tuned-32768.jsonl", [1, 1, 0, 0], row="tuned", length=32768, dtype="float32")
    assert main(["report", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    assert {(c["row"], c["length"]): c["n"] for c in card["cells"]}[("tuned", 32768)] == 4
    assert [(p["higher"], p["lower"]) for p in card["paired"] if p["length"] == 32768] == [(2, 1)]


def test_combining_cards_refuses_overlapping_or_ambiguous_input_before_writing(tmp_path, capsys):
    """The same cell in two folders, --out among the folders or missing, a combined card as a source, a folder
    that is not a card: one line naming the problem, and nothing written."""
    from hf_posext.cli import main

    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    _one_run_card(first, [("tuned", 2048, [1, 1, 1, 1])], "float32")
    _one_run_card(second, [("tuned", 2048, [0, 0, 0, 0])], "float32")
    _one_run_card(third, [("tuned", 8192, [1, 0, 1, 0])], "float32")
    out = tmp_path / "combined"
    with pytest.raises(ValueError, match=r"tuned: niah_single_1 at 2048 is in both .*first and .*second"):
        combine_cards([first, second], out)
    assert not out.exists()
    with pytest.raises(ValueError, match="one of the folders combined"):
        combine_cards([first, third], third)
    with pytest.raises(ValueError, match="two or more"):
        combine_cards([first], out)
    combine_cards([first, third], out)
    with pytest.raises(ValueError, match="is a combined card"):
        combine_cards([out, second], tmp_path / "again")
    assert not (tmp_path / "again").exists()
    before = (out / "card.json").read_bytes()
    for argv, message in ((["report", str(first), str(third)], "pass --out FOLDER"),
                          (["report", str(first), str(tmp_path), "--out", str(out)], "holds no card.json")):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert (out / "card.json").read_bytes() == before


def test_rows_keep_the_earlier_cards_order_and_new_rows_follow_their_neighbour():
    from hf_posext.evaluation.card import in_row_order, merged_row_order

    assert merged_row_order([], ["b", "a"]) == {"b": 0, "a": 1}  # a first run: its own order
    assert merged_row_order(["base", "yarn", "ntk", "tuned"], ["yarn", "tuned"]) == {"base": 0, "yarn": 1, "ntk": 2, "tuned": 3}
    assert merged_row_order(["base", "yarn"], ["yarn", "new", "base"]) == {"base": 0, "yarn": 1, "new": 2}
    assert merged_row_order(["base", "yarn"], ["new"]) == {"new": 0, "base": 1, "yarn": 2}
    cells = [{"row": "yarn", "row_index": 0}, {"row": "base", "row_index": 1}, {"row": "other", "row_index": 2}]
    placed, settings = in_row_order(cells, {"rows": [{"label": "yarn"}, {"label": "base"}], "x": 1}, {"base": 0, "yarn": 1})
    assert [(c["row"], c["row_index"]) for c in placed] == [("yarn", 1), ("base", 0), ("other", 4)]
    assert [r["label"] for r in settings["rows"]] == ["base", "yarn"] and settings["x"] == 1


def test_a_run_into_a_card_folder_keeps_the_earlier_cells_it_does_not_cover(tmp_path):
    """A second run into the same --out with other tasks, rows or lengths keeps the first run's cells on the card
    (each with its own samples and dtype, its row after the new run's rows), drops those it covers; a damaged
    card.json or a combined card in the folder is refused by name."""
    folder = tmp_path / "card"
    _one_run_card(folder, [("base", 2048, [1, 1, 1, 1]), ("yarn", 2048, [0, 1, 0, 1]), ("yarn", 8192, [1, 0, 0, 0])], "bfloat16")
    settings = json.loads((folder / "card.json").read_text())["settings"]
    write_card(folder, json.loads((folder / "card.json").read_text())["cells"],
               [{"what": "base: niah_single_1 at 8192", "reason": "over its window"}, {"what": "niah_single_2", "reason": "download"}],
               settings)
    cells, skipped, rows = earlier_card(folder, ["tuned", "yarn"], {("niah_single_1", "yarn", 8192), ("niah_single_1", "base", 8192)})
    assert [(c["row"], c["length"], c["row_index"], c["samples"], c["dtype"], c["n"]) for c in cells] == [
        ("base", 2048, 2, 4, "bfloat16", 4), ("yarn", 2048, 1, 4, "bfloat16", 4)]
    assert skipped == [{"what": "niah_single_2", "reason": "download"}] and [r["label"] for r in rows] == ["base"]
    # the ending row is covered at any length
    assert earlier_card(folder, ["yarn"], {("niah_single_1", "yarn", None)})[0][0]["row"] == "base"
    assert earlier_card(tmp_path / "empty", ["yarn"], set()) == ([], [], [])

    # a carried cell keeps its own sample count when written again, under a run that asked for fewer
    write_card(folder, cells, [], {**settings, "samples": 2})
    again = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert {(c["row"], c["length"]): c["n"] for c in again} == {
        ("base", 2048): 4, ("yarn", 2048): 4, ("yarn", 8192): 2}  # the last: found as this run's cell, its first 2

    (folder / "card.json").write_text('{"settings": ')
    with pytest.raises(CardFileError, match="card.json is not a card"):
        earlier_card(folder, ["yarn"], set())
    other = tmp_path / "other"
    _one_run_card(other, [("tuned", 4096, [1, 0, 1, 1])], "float32")
    _one_run_card(folder, [("base", 2048, [1, 1, 1, 1])], "float32")
    combine_cards([folder, other], tmp_path / "combined")
    with pytest.raises(ValueError, match="holds a combined card"):
        earlier_card(tmp_path / "combined", ["yarn"], set())


def test_an_earlier_runs_unfinished_cell_is_kept_like_a_finished_one(tmp_path):
    """A run stopped part-way through a cell leaves a sample file that card.json shows as unfinished; a later run
    into the folder keeps that cell (with the samples it has) whether or not it covers it, so that its partial
    cards never show fewer cells than the folder holds."""
    folder = tmp_path / "card"
    _one_run_card(folder, [("base", 2048, [1, 1, 1, 1]), ("yarn", 2048, [0, 1, 0, 1])], "float32")
    _sample_file(folder / "ruler" / "yarn-32768.jsonl", [1, 0], row="yarn", length=32768, dtype="float32")
    rewrite_card(folder)
    cells = earlier_card(folder, ["yarn"], set())[0]
    assert sorted((c["row"], c["length"], c["n"], bool(c.get("running")), c["row_index"]) for c in cells) == [
        ("base", 2048, 4, False, 1), ("yarn", 2048, 4, False, 0), ("yarn", 32768, 2, True, 0)]
    assert sorted((c["row"], c["length"]) for c in earlier_card(folder, ["yarn"], {("niah_single_1", "yarn", 32768)})[0]) == [
        ("base", 2048), ("yarn", 2048)]


def test_an_unfinished_cell_of_a_task_the_last_run_did_not_name_stays_on_the_card_written_again(tmp_path):
    """A run with other tasks into a folder (its settings name only its own tasks' dtypes) keeps an earlier run's
    unfinished cell on its card; written again (``hf-posext report``, a combined card), that cell keeps its dtype
    and its own sample count instead of dropping off."""
    folder = tmp_path / "card"
    ruler = folder / "ruler"
    _sample_file(ruler / "mine.jsonl", [1, 0, 1, 1], task="niah_multikey_2", row="yarn", length=8192, dtype="float32")
    _sample_file(ruler / "earlier.jsonl", [1, 1], row="yarn", length=8192, dtype="float32")
    rows = [{"label": "yarn", "model": "m", "report": {"method": "yarn", "current_window": 16384}}]
    settings = {"samples": 4, "rows": rows, "dtypes": {"niah_multikey_2": "float32"}, "models": ["m"]}
    mine = {**_cell("yarn", 0, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}, task="niah_multikey_2"), "length": 8192,
            "source": str(ruler / "mine.jsonl"), "dtype": "float32"}
    earlier = {**_cell("yarn", 0, {0: 1.0, 1: 1.0}), "length": 8192, "source": str(ruler / "earlier.jsonl"),
               "dtype": "float32", "samples": 20, "running": True, "text": "2/2 [0.34, 1.00], 2 of 20 so far"}
    write_card(folder, [mine, earlier], [], settings)
    for _ in range(2):  # written again, then again from what that wrote
        cells = {c["task"]: c for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]}
        assert sorted(cells) == ["niah_multikey_2", "niah_single_1"]
        kept = cells["niah_single_1"]
        assert (kept["n"], kept["samples"], kept["dtype"], kept["running"]) == (2, 20, "float32", True)
        assert kept["text"].endswith("2 of 20 so far")
    # another dtype's file of that cell is still not this card's
    _sample_file(ruler / "earlier.jsonl", [1, 1], row="yarn", length=8192, dtype="bfloat16")
    assert [c["task"] for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]] == ["niah_multikey_2"]


def test_a_relabelled_row_finds_its_sample_files_by_model_method_dtype_and_device(tmp_path):
    """The label is only the readable part of a sample file's name: a row whose label changed resumes the file of
    the same model, method, dtype and device; another dtype, or two such files (ambiguous), start a new one."""
    from hf_posext.core.request import ScalingRequest
    from hf_posext.integrations.lm_eval.card import Row

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


def test_a_cell_still_running_is_shown_with_the_samples_it_has(tmp_path):
    """A sample file that card.json does not list yet (the cell a run is computing) shows on the card written
    again, marked unfinished, when it is one of the card's rows in the card's dtype; others are left out."""
    folder = tmp_path / "card"
    ruler = folder / "ruler"
    _sample_file(ruler / "done.jsonl", [1, 1, 0, 1])
    _sample_file(ruler / "running.jsonl", [1, 0], cut_tail=True, row="yarn", length=8192, dtype="float32")
    _sample_file(ruler / "other-dtype.jsonl", [0, 0], row="yarn", length=8192, dtype="bfloat16")
    _sample_file(ruler / "other-row.jsonl", [0, 0], row="not on this card", length=8192, dtype="float32")
    rows = [{"label": "base", "model": "m", "report": {"method": "none", "current_window": 4096}},
            {"label": "yarn", "model": "m", "report": {"method": "yarn", "current_window": 16384}}]
    settings = {"samples": 4, "rows": rows, "dtypes": {"niah_single_1": "float32"}, "models": ["m"]}
    write_card(folder, [{**_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], settings)
    cells = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert [(c["row"], c["length"], c["n"]) for c in cells] == [("base", 4096, 4), ("yarn", 8192, 2)]
    running = cells[1]
    assert running["running"] and running["text"].endswith("2 of 4 so far") and running["row_index"] == 1 and running["k"] == 1
    assert running["in_window"] and not running["base"]
    assert "2 of 4 so far" in (folder / "card.md").read_text()
    # a card of a run asked for "--tasks ruler" named its dtype once, as "ruler" (cards before each task was named)
    write_card(folder, [{**_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [],
               {**settings, "dtypes": {"ruler": "float32"}})
    assert [(c["row"], c["n"]) for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]] == [("base", 4), ("yarn", 2)]
    # a file written under the row's older label is found by its model and scaling (not by the label), and shown
    # under the row's label today; a header that matches two rows, or none, is not this card's
    old_report = {"method": "yarn", "factor": 4.0, "current_window": 16384, "original_window": 4096}
    _sample_file(ruler / "old-label.jsonl", [1, 1, 1], row="tuned, x1", length=16384, dtype="float32", model="m", report=old_report)
    _sample_file(ruler / "unknown.jsonl", [1, 1], row="gone", length=16384, dtype="float32", model="m",
                 report={**old_report, "factor": 2.0})
    renamed = [rows[0], {"label": "yarn", "model": "m", "report": {**old_report, "extra": "not in a header"}}]
    write_card(folder, [{**_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], {**settings, "rows": renamed})
    cells = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert [(c["row"], c["length"], c["n"]) for c in cells] == [("base", 4096, 4), ("yarn", 8192, 2), ("yarn", 16384, 3)]
    twice = [*renamed, {"label": "yarn again", "model": "m", "report": old_report}]
    write_card(folder, [{**_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], {**settings, "rows": twice})
    assert [(c["row"], c["length"]) for c in json.loads(rewrite_card(folder)["json"].read_text())["cells"]] == [
        ("base", 4096), ("yarn", 8192)]
    for path in (ruler / "old-label.jsonl", ruler / "unknown.jsonl"):
        path.unlink()
    write_card(folder, [{**_cell("base", 0, {0: 1.0}), "source": str(ruler / "done.jsonl")}], [], settings)
    # written again once the cell has all its samples: no longer marked
    _sample_file(ruler / "running.jsonl", [1, 0, 1, 1], row="yarn", length=8192, dtype="float32")
    cells = json.loads(rewrite_card(folder)["json"].read_text())["cells"]
    assert [(c["row"], c["n"], c.get("running")) for c in cells] == [("base", 4, None), ("yarn", 4, None)]
    assert "so far" not in (folder / "card.md").read_text()


def test_a_damaged_card_or_a_missing_sample_file_is_named(tmp_path, capsys):
    from hf_posext.cli import main

    folder = tmp_path / "card"
    folder.mkdir()
    (folder / "card.json").write_text('{"cells": [')
    with pytest.raises(CardFileError, match="card.json is not a card"):
        rewrite_card(folder)
    write_card(folder, [{**_cell("r", 0, {0: 1.0}), "source": "gone.jsonl"}], [], {"samples": 1})
    with pytest.raises(FileNotFoundError, match="gone.jsonl"):
        rewrite_card(folder)
    _sample_file(folder / "ruler" / "gone.jsonl", [1])
    (folder / "ruler" / "gone.jsonl").write_text((folder / "ruler" / "gone.jsonl").read_text() + '{"doc_id": 1}\n')
    with pytest.raises(SampleResultsError, match="line 3 lacks its 'score'"):
        rewrite_card(folder)
    assert main(["report", str(folder), "--compare", "a", "b"]) == 2
    assert "compares its rows on the same RULER samples itself" in capsys.readouterr().err


# ------------------------------------------------------------------ with lm-eval on the tiny model


def test_a_ruler_dataset_draws_only_the_samples_asked_for():
    """lm-eval's RULER datasets call their generator with num_samples=500 (minutes at 32768 tokens); the card
    replaces it in the globals the dataset function calls (its own copy of the module), for that call only,
    and refuses a dataset that calls no known generator instead of silently drawing 500."""
    pytest.importorskip("lm_eval")
    from hf_posext.integrations.lm_eval.card import limit_ruler_samples

    drawn = []
    scope = {"sys_kwext": lambda tokenizer=None, num_samples=500: drawn.append(num_samples) or list(range(num_samples))}
    exec("def fwe_download(**kwargs):\n    return sys_kwext(tokenizer=kwargs.get('tokenizer'), num_samples=500)", scope)
    original = scope["sys_kwext"]
    assert limit_ruler_samples(scope["fwe_download"], 3)(tokenizer="t") == [0, 1, 2] and drawn == [3]
    assert scope["sys_kwext"] is original  # restored after the call
    exec("def plain(**kwargs):\n    return []", scope)
    del scope["sys_kwext"]
    with pytest.raises(RuntimeError, match="calls none of lm-eval's RULER generators"):
        limit_ruler_samples(scope["plain"], 3)


def test_ruler_samples_are_the_first_n_of_a_longer_draw(tiny_folder, tmp_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from transformers import AutoTokenizer

    from hf_posext.integrations.lm_eval.card import ruler_docs

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    three, key = ruler_docs("niah_single_1", tiny_folder, tokenizer, LENGTH, 3, 0, SampleCache(tmp_path / "a"))
    five, _ = ruler_docs("niah_single_1", tiny_folder, tokenizer, LENGTH, 5, 0, SampleCache(tmp_path / "b"))
    assert three == five[:3] and len({d["input"] for d in five}) == 5
    other, _ = ruler_docs("niah_single_1", tiny_folder, tokenizer, LENGTH, 3, 1, SampleCache(tmp_path / "c"))
    assert other != three  # the seed matters, so the key must hold it
    assert key["tokenizer"] == tokenizer_hash(tokenizer) and key["length"] == LENGTH


#: Generate one RULER sample set in a fresh interpreter, the first generation of that process (or after another).
_GENERATE_FIRST = """
import json, sys
from transformers import AutoTokenizer
from hf_posext.evaluation.card import SampleCache
from hf_posext.integrations.lm_eval.card import ruler_docs
from hf_posext.integrations.lm_eval.launcher import import_harness
import_harness()
folder, cache, before = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(folder)
if before:
    ruler_docs(before, folder, tokenizer, {length}, 1, 0, SampleCache(cache + "-before"))
docs, _ = ruler_docs("ruler_fwe", folder, tokenizer, {length}, 2, 0, SampleCache(cache))  # draws from `random`
print(json.dumps(docs))
"""


def test_ruler_samples_do_not_depend_on_what_the_process_generated_before(tiny_folder, tmp_path):
    """The first import of lm-eval's RULER generator modules draws from ``random``: seeded before it, a
    process's first sample set differed from every later one (found when extending a cached set of 10 to 20,
    which the cache then refused). Each set is generated in a fresh interpreter, first or after another task."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    import subprocess
    import sys

    script = _GENERATE_FIRST.format(length=LENGTH)
    runs = []
    for before in ("", "niah_single_1"):
        done = subprocess.run([sys.executable, "-c", script, tiny_folder, str(tmp_path / f"cache-{before}"), before],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and len(runs[0]) == 2


def test_card_end_to_end_on_the_tiny_model(tiny_folder, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    import requests

    from hf_posext.cli import main
    from hf_posext.evaluation.loading import evaluation_dtype

    # offline, as CI is (HF_HUB_OFFLINE=1 stops the essays; SQuAD comes through requests, stopped here)
    monkeypatch.setattr(requests, "get", lambda *a, **k: (_ for _ in ()).throw(requests.ConnectionError("offline")))

    out = tmp_path / "card"
    # ruler_vt is left out here: lm-eval's variable-tracking generator does not finish with a character-level
    # tokenizer at CI lengths (vt_utils keeps drawing noise); it runs on real tokenizers in bench/card_smollm2.sh
    tasks = "niah_single_1,niah_multikey_2,niah_multikey_3,ruler_cwe,ruler_fwe"
    argv = ["eval", "card", "--models", f"base={tiny_folder}", "--methods", "none,yarn", "--factor", "2",
            "--lengths", str(LENGTH), "--tasks", f"perplexity,passkey,{tasks},niah_single_2,ruler_qa_squad", "--samples", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    rows = {c["row"] for c in card["cells"]}
    assert rows == {"base, unscaled", "base, yarn ×2"}
    ruler = [c for c in card["cells"] if c["kind"] == "ruler"]
    assert {c["task"] for c in ruler} == set(tasks.split(","))
    assert all(c["n"] == 2 and c["sample_key"]["length"] == LENGTH for c in ruler)
    # same samples for every row: one key per task
    assert all(len({json.dumps(c["sample_key"], sort_keys=True) for c in ruler if c["task"] == t}) == 1 for t in {c["task"] for c in ruler})
    assert {s["what"] for s in card["skipped"]} >= {"ruler_qa_squad", "niah_single_2"}
    assert (out / "card-niah_single_1.png").exists() and "beyond the base model" in (out / "card.html").read_text()
    record = json.loads((out / "ruler").glob("ruler_fwe-*.jsonl").__next__().read_text().splitlines()[1])
    assert set(record["timing"]) == {"prefill_s", "generate_s", "harness_s", "total_s"} and record["prompt_tokens"] <= LENGTH
    # --no-progress: the log has one line a RULER sample (row, task, score, time) and one a passkey cell
    log = capsys.readouterr().err
    sample_lines = re.findall(rf"^ruler_fwe @ {LENGTH}, base, yarn ×2: sample (\d) scored [01]\.\d\d in \d+ s \((\d) of 2 to run\)$",
                              log, flags=re.M)
    assert sorted(sample_lines) == [("0", "1"), ("1", "2")]
    assert len(re.findall(r"^passkey .* @ \d+, depth [\d.]+: \d+/\d+ found \(greedy\), \d+ s$", log, flags=re.M)) >= 2
    # and no progress bar, lm-eval's own (building requests, generating RULER samples) included (`2/2 [00:00<00:00, ...]`)
    assert not re.search(r"\d+/\d+ \[\d\d:\d\d", log), sorted({m.split("|")[0] for m in re.findall(r"[^\r\n]*\d+/\d+ \[\d\d:\d\d", log)})

    # a second run recomputes nothing: every sample file is left as it was
    files = {p: p.read_bytes() for p in (out / "ruler").glob("*.jsonl")}
    assert main(argv) == 0
    assert " scored " not in capsys.readouterr().err  # nothing ran, nothing logged
    assert {p: p.read_bytes() for p in files} == files
    assert card["settings"]["partial"] is False
    # a run stopped before it reaches the cells it covers leaves them on its partial card (the earlier run's
    # samples, marked unfinished), and a card written again from the folder finds every one
    import hf_posext.integrations.lm_eval.card as lm_eval_card

    seen: list[dict] = []

    def stop(*args, **kwargs):
        seen.append(json.loads((out / "card.json").read_text()))
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval_card, "run_ruler_cell", stop)
        with pytest.raises(KeyboardInterrupt):
            main(argv)
    key = lambda cells: sorted((c["task"], c["row"], c["length"], c["n"]) for c in cells if c["kind"] == "ruler")  # noqa: E731
    assert key(seen[0]["cells"]) == key(card["cells"]) and seen[0]["settings"]["partial"] is True
    assert all(c.get("running") for c in seen[0]["cells"] if c["kind"] == "ruler")
    assert key(json.loads(rewrite_card(out)["json"].read_text())["cells"]) == key(card["cells"])
    assert set(tasks.split(",")) <= set(seen[0]["settings"]["dtypes"])
    assert main(argv) == 0 and json.loads((out / "card.json").read_text())["cells"] == card["cells"]
    # every pair of rows compared on the same samples, task by task, passkey trial by trial (2 samples -> one
    # trial at each of 5 depths) and perplexity window by window (2 samples -> 2 windows; the lower loss wins)
    assert {p["task"] for p in card["paired"]} == {*tasks.split(","), "passkey", "perplexity"}
    assert all(p["n"] == (5 if p["task"] == "passkey" else 2) for p in card["paired"])
    passkey_cells = [c for c in card["cells"] if c["kind"] == "passkey"]
    assert all(len(c["scores"]) == c["n"] == 5 and sum(c["scores"].values()) == c["k"] for c in passkey_cells)
    ppl_cells = [{**c, "scores": {k: -v for k, v in c["scores"].items()}} for c in card["cells"] if c["kind"] == "perplexity"]
    assert len(ppl_cells) == 2 and all(len(c["scores"]) == c["n"] == 2 for c in ppl_cells)
    assert all(math.isclose(math.log(c["mean"]), -sum(c["scores"].values()) / 2, rel_tol=1e-6) for c in ppl_cells)  # equal windows
    for pair in card["paired"]:
        first, second = (c["scores"] for name in (pair["first"], pair["second"])
                         for c in [*ruler, *passkey_cells, *ppl_cells] if c["task"] == pair["task"] and c["row"] == name)
        assert pair["higher"] == sum(first[i] > second[i] for i in first) and pair["lower"] == sum(first[i] < second[i] for i in first)

    # the full budget scores every sample exactly as the short one did (and is refused past the window)
    full = tmp_path / "full"
    assert main([*argv[:-3], "--out", str(full), "--sample-cache", str(out / "ruler-samples"), "--budget", "full", "--no-progress",
                 "--tasks", tasks]) == 0
    scores = lambda folder: {(c["task"], c["row"]): c["mean"] for c in json.loads((folder / "card.json").read_text())["cells"]
                             if c["kind"] == "ruler"}
    assert scores(full) == scores(out)

    # a run with fewer rows resumes the rows it still has (sample files are named by the row, not its place),
    # and another dtype never reads float32's samples
    yarn_only = [*argv[:4], "--methods", "yarn", *argv[6:]]
    assert main(yarn_only) == 0
    assert {p: p.read_bytes() for p in files} == files and len(list((out / "ruler").glob("*.jsonl"))) == len(files)
    # ... and the card it writes keeps the unscaled row's cells of the first run, read again from their files
    kept = json.loads((out / "card.json").read_text())
    assert sorted((c["task"], c["row"], c["n"]) for c in kept["cells"]) == sorted((c["task"], c["row"], c["n"]) for c in card["cells"])
    # ... with its rows where they were: a run of some rows does not reorder the card (nor flip its pairs)
    assert {c["row_index"] for c in kept["cells"] if c["row"] == "base, unscaled"} == {0}
    assert {c["row_index"] for c in kept["cells"] if c["row"] == "base, yarn ×2"} == {1}
    assert [r["label"] for r in kept["settings"]["rows"]] == ["base, unscaled", "base, yarn ×2"]
    assert [(p["first"], p["second"]) for p in kept["paired"]] == [(p["first"], p["second"]) for p in card["paired"]]
    # a row given another label resumes the files written under the old one (nothing computed again), and the card
    # shows their cells once, under the new label
    renamed = [*yarn_only[:3], f"renamed={tiny_folder}", *yarn_only[4:]]
    assert main(renamed) == 0
    assert {p: p.read_bytes() for p in files} == files and len(list((out / "ruler").glob("*.jsonl"))) == len(files)
    again = json.loads((out / "card.json").read_text())
    assert sorted((c["task"], c["row"], c["n"]) for c in again["cells"] if c["kind"] == "ruler" and "yarn" in c["row"]) == sorted(
        (c["task"], "renamed, yarn ×2", c["n"]) for c in card["cells"] if c["kind"] == "ruler" and c["row"] == "base, yarn ×2")
    assert "base, yarn ×2" not in {r["label"] for r in again["settings"]["rows"]}
    assert json.loads(rewrite_card(out)["json"].read_text())["cells"] == again["cells"]
    assert main(yarn_only) == 0  # and back
    ruler_dtype = evaluation_dtype("auto", "ruler", "cpu")  # --dtype auto: bfloat16 on a CPU that has it natively
    assert all(f"yarn-x2-{ruler_dtype}-" in p.name or f"none-x1-{ruler_dtype}-" in p.name for p in files)
    other = "float32" if ruler_dtype == "bfloat16" else "bfloat16"
    assert main([*yarn_only[:-3], "--out", str(out), "--no-progress", "--tasks", "niah_single_1", "--dtype", other]) == 0
    assert len(list((out / "ruler").glob(f"niah_single_1-*-{other}-*.jsonl"))) == 1


def test_a_length_past_the_window_is_refused_before_any_model_runs(tiny_folder, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from hf_posext.cli import main

    out = tmp_path / "card"
    code = main(["eval", "card", "--models", tiny_folder, "--methods", "none", "--lengths", str(2 * LENGTH),
                 "--tasks", "niah_single_1", "--samples", "1", "--out", str(out), "--no-progress"])
    assert code != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "niah_single_1" in error and str(2 * LENGTH) in error and "error:" in error, error
    assert not (out / "ruler").exists() and not (out / "card.json").exists()


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "float8"], "Unknown dtype 'float8'; use auto"),
    (["--dtype", "int8"], "Unknown dtype 'int8'; use auto"),
    (["--methods", "yarn", "--factor", "0.5"], "factor=0.5 is below 1"),
    (["--methods", "nosuch"], "Unknown method 'nosuch'"),
    (["--methods", "yarn", "--param", "nosuch=1"], "nosuch"),
    (["--device", "gpu0"], "--device gpu0 is not a device name"),
    (["--tasks", "needle", "--haystack", "no/such/book.txt"], "'no/such/book.txt' does not exist"),
    (["--tasks", "perplexity", "--ppl-data", "no/such/book.txt"], "'no/such/book.txt' does not exist"),
    (["--sample-cache", "A_FILE"], "--sample-cache A_FILE is a file"),
    (["--out", "A_FILE"], "--out A_FILE is a file"),
])
def test_bad_card_arguments_are_refused_in_one_line_before_any_model_loads(tiny_folder, tmp_path, capsys, monkeypatch, extra, message):
    """One line naming the value, and nothing loaded or written (the models load before the samples are drawn)."""
    from hf_posext.evaluation import loading
    from hf_posext.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
    monkeypatch.chdir(tmp_path)
    Path("A_FILE").write_text("not a folder")
    out = tmp_path / "card"
    code = main(["eval", "card", "--models", f"{tiny_folder}", "--lengths", str(LENGTH), "--tasks", "niah_single_1",
                 "--samples", "1", "--out", str(out), "--no-progress", *extra])
    error = capsys.readouterr().err.strip()
    assert code != 0 and message in error and "error:" in error and len(error.splitlines()) == 1, error
    assert not out.exists()
    # the same model spec given per row (METHOD:FACTOR after @) is checked the same way
    if extra[0] == "--methods" and "--param" not in extra:
        spec = f"{tiny_folder}@{extra[1]}" + (f":{extra[3]}" if len(extra) > 2 else "")
        assert main(["eval", "card", "--models", spec, "--lengths", str(LENGTH), "--tasks", "niah_single_1", "--out", str(out)]) != 0
        assert message in capsys.readouterr().err and not out.exists()


def test_skip_over_window_lists_the_cells_past_a_rows_window(tiny_folder, tmp_path):
    """With --skip-over-window a length past the unscaled row's window (the harness's max_length defaults to
    it) is listed as skipped with its reason, and the run goes on with the rows that fit."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from hf_posext.cli import main

    out = tmp_path / "card"
    assert main(["eval", "card", "--models", f"base={tiny_folder}@none;yarn:factor=2", "--lengths", str(2 * LENGTH), "--tasks", "niah_single_1",
                 "--samples", "1", "--out", str(out), "--skip-over-window", "--no-progress"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert [c["row"] for c in card["cells"]] == ["base, yarn ×2"]
    (skipped,) = [s for s in card["skipped"] if s["what"].startswith("base, unscaled")]
    assert f"window {LENGTH}" in skipped["reason"], skipped



def test_a_cell_past_a_rows_window_is_refused_before_any_sample_is_written(tiny_folder, tmp_path, capsys):
    """The RULER samples are drawn before the length budgets are checked: a refused run wrote them into a new --out
    (or the --sample-cache). They are kept back until every cell is known to fit."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from hf_posext.cli import main

    out, cache = tmp_path / "card", tmp_path / "cache"
    for extra in ([], ["--sample-cache", str(cache)], ["--max-length", str(LENGTH // 2)]):
        length = str(2 * LENGTH) if "--max-length" not in extra else str(LENGTH)
        code = main(["eval", "card", "--models", f"base={tiny_folder}@none", "--lengths", length, "--tasks", "niah_single_1",
                     "--samples", "1", "--out", str(out), "--no-progress", *extra])
        error = capsys.readouterr().err.strip()
        assert code != 0 and "niah_single_1 at" in error and len(error.splitlines()) == 1, error
        assert not out.exists() and not cache.exists(), extra


def test_no_progress_leaves_a_card_log_without_loading_bars_or_lm_evals_metadata_note(tiny_folder, tmp_path):
    """A card's log is read by people: with --no-progress it held transformers' "Loading weights" bars at every
    model load, and lm-eval's advice to pass lengths with --metadata at every RULER task it built (the card passes
    them itself). Both are gone; the log still says what the card wrote."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    import os
    import subprocess
    import sys

    out = tmp_path / "card"
    done = subprocess.run([sys.executable, "-m", "hf_posext.cli", "eval", "card", "--models", f"base={tiny_folder}@none",
                           "--lengths", str(LENGTH), "--tasks", "passkey,niah_single_1", "--samples", "1", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "Loading weights" not in log and "--metadata" not in log, log[-3000:]
    assert (out / "card.html").exists() and "card.html" in log


def test_a_tiny_test_model_is_refused_for_ruler_in_one_line(tmp_path, capsys):
    """The tiny test models keep their tokenizer in memory only; lm-eval draws RULER samples from a saved one, so
    the card names the fix instead of the hub's repo-id error."""
    pytest.importorskip("lm_eval")
    from hf_posext.cli import main

    out = tmp_path / "card"
    code = main(["eval", "card", "--models", "tiny:llama:1024", "--lengths", "512", "--tasks", "ruler_fwe",
                 "--samples", "1", "--out", str(out), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code != 0 and "tiny:llama:1024" in error and "save_pretrained(DIR)" in error and len(error.splitlines()) == 1, error
    assert not out.exists()


# ------------------------------------------------------------------ where a sample's time goes


def test_the_forward_timer_waits_for_the_device_around_each_forward(monkeypatch):
    """On CUDA a forward returns with its kernels queued: each timed call starts and ends with a synchronization,
    so that a prefill's work is not counted in the first decode step (the H200 card's yarn rows read 0.033 s of
    prefill at 32768 without them). Here the device is a recorded stand-in."""
    import torch

    import hf_posext.integrations.lm_eval.card as lm_card

    events: list[str] = []
    monkeypatch.setattr(lm_card, "device_synchronizer", lambda model: lambda: events.append("sync"))
    model = torch.nn.Embedding(10, 2)
    model.register_forward_hook(lambda *args: events.append("forward"))
    timer = lm_card.ForwardTimer(model)
    model(torch.zeros(1, 3, dtype=torch.long))  # a prefill of 3 tokens, then one decode step
    model(torch.zeros(1, 1, dtype=torch.long))
    timer.remove()
    assert events == ["sync", "forward", "sync", "sync", "forward", "sync"]
    assert [tokens for tokens, _ in timer.calls] == [3, 1]


def test_the_synchronizer_waits_for_every_cuda_device_a_model_holds(monkeypatch):
    import torch

    from hf_posext.integrations.lm_eval.card import device_synchronizer

    class Spread:
        def parameters(self):
            return iter([type("P", (), {"device": torch.device(name)})() for name in ("cuda:1", "cpu", "cuda:0", "cuda:1")])

    waited: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(str(device)))
    device_synchronizer(Spread())()
    assert waited == ["cuda:0", "cuda:1"]
    device_synchronizer(torch.nn.Linear(2, 2))()  # a CPU model waits for nothing
    assert waited == ["cuda:0", "cuda:1"]


# ------------------------------------------------------------------ RULER tasks that need a download


@pytest.fixture
def fresh_downloads():
    """Forget what this process fetched (or failed to) for the download tasks, before and after the test."""
    pytest.importorskip("lm_eval")
    import hf_posext.integrations.lm_eval.card as lm_card
    from hf_posext.integrations.lm_eval.launcher import import_harness

    import_harness()
    lm_card.forget_downloads()
    yield lm_card
    lm_card.forget_downloads()


def test_a_download_task_that_cannot_fetch_is_skipped_with_the_reason(fresh_downloads, monkeypatch):
    import requests

    lm_card = fresh_downloads
    # the tests run with HF_HUB_OFFLINE=1 (conftest): datasets refuses the essays at once, from its own check
    reason = lm_card.download_problem("niah_multikey_1")
    assert reason.startswith("needs a download (essay haystack: downloads baber/paul_graham_essays), which failed here (")
    assert "Offline" in reason and reason.endswith("it runs where that can be fetched") and "\n" not in reason
    assert lm_card.download_problem("niah_single_3") == reason.replace("niah_multikey_1", "niah_single_3")  # one source, tried once

    def no_network(*args, **kwargs):
        raise requests.ConnectionError("Failed to resolve 'rajpurkar.github.io'")

    monkeypatch.setattr(requests, "get", no_network)
    assert "ConnectionError: Failed to resolve 'rajpurkar.github.io'" in lm_card.download_problem("ruler_qa_squad")
    # HotpotQA comes from the hub through requests, which would not honour HF_HUB_OFFLINE: not tried at all
    monkeypatch.setattr(requests, "get", lambda *a, **k: pytest.fail("fetched from the hub with HF_HUB_OFFLINE set"))
    assert "(HF_HUB_OFFLINE is set)" in lm_card.download_problem("ruler_qa_hotpot")


def test_the_essay_tasks_also_need_nltks_sentence_data(fresh_downloads, monkeypatch):
    import datasets
    import nltk

    lm_card = fresh_downloads
    monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **k: {"text": ["An essay. Of two sentences."]})

    def missing(resource, *args, **kwargs):
        raise LookupError(f"Resource {resource} not found")

    monkeypatch.setattr(nltk.data, "find", missing)
    reason = lm_card.download_problem("niah_single_2")
    assert "punkt_tab" in reason and "python -m nltk.downloader punkt_tab" in reason, reason


def test_a_download_task_whose_data_can_be_fetched_runs_on_the_card(fresh_downloads, tiny_folder, tmp_path, monkeypatch):
    """Where SQuAD can be fetched (here: a stand-in for its server), ruler_qa_squad runs like the offline tasks, on
    samples drawn from that copy, fetched once; the essay task that cannot fetch is listed as skipped."""
    import requests

    from hf_posext.cli import main

    paragraphs = [{"context": f"Paragraph {i} says that the city of Town{i} was founded by person{i}. " * 3,
                   "qas": [{"question": f"Who founded Town{i}?", "answers": [{"text": f"person{i}"}], "is_impossible": False}]}
                  for i in range(60)]
    fetched = []

    class Response:
        def raise_for_status(self):
            pass

        def json(self):
            return {"data": [{"paragraphs": paragraphs}]}

    def server(url, *args, **kwargs):
        fetched.append(url)
        if "SQuAD" not in url:
            raise requests.ConnectionError("no network")
        return Response()

    monkeypatch.setattr(requests, "get", server)
    out = tmp_path / "card"
    argv = ["eval", "card", "--models", f"base={tiny_folder}", "--methods", "none", "--lengths", str(LENGTH),
            "--tasks", "ruler_qa_squad,niah_single_2", "--samples", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    assert [(c["task"], c["n"]) for c in card["cells"]] == [("ruler_qa_squad", 2)]
    assert len(fetched) == 1 and "SQuAD" in fetched[0]  # fetched once: the samples were drawn from the copy checked
    (samples,) = (out / "ruler-samples").glob("ruler_qa_squad-*.json")
    assert "was founded by person" in json.loads(samples.read_text())["docs"][0]["input"]
    assert [s["what"] for s in card["skipped"]] == ["niah_single_2"]
    assert "Offline" in card["skipped"][0]["reason"]


def test_importing_the_ruler_generators_drops_nltks_punkt_noise_and_keeps_the_rest(tmp_path):
    """lm-eval's niah generator module tries to download punkt_tab on import and then prints "Downloaded punkt_tab on
    rank 0" whether it could or not (offline: four nltk error lines and that false line in every card log). Run in a
    fresh interpreter, where the module is imported for the first time, with punkt_tab missing and the download
    failing, as offline."""
    pytest.importorskip("lm_eval")
    import subprocess
    import sys

    script = """
import sys
import nltk
def missing(resource, *args, **kwargs):
    raise LookupError(resource)
def failing(info_or_id=None, quiet=False, print_error_to=sys.stderr, **kwargs):
    print("[nltk_data] Error loading", info_or_id, file=print_error_to)
    return False
nltk.data.find, nltk.download = missing, failing
from hf_posext.integrations.lm_eval.launcher import import_harness
import_harness()
from hf_posext.integrations.lm_eval.card import import_ruler_generators
import_ruler_generators()
assert "lm_eval.tasks.ruler.prepare_niah" in sys.modules and nltk.download is failing
print("imported")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "imported"
    assert "punkt" not in done.stdout + done.stderr and "[nltk_data]" not in done.stderr, done.stdout + done.stderr


def test_a_card_stopped_after_some_rows_tasks_keeps_them_on_its_card(tiny_folder, tmp_path, monkeypatch):
    """Perplexity, passkey and needle at 16384 take hours on a CPU: the card is written after each row's task, so a
    run stopped later (a session's end) leaves a card with the cells it finished, marked partial, for the combined
    card to show; before, its card was written only at the very end."""
    from hf_posext.cli import main
    from hf_posext.evaluation import passkey

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(passkey, "evaluate_passkey", stopped)
    out = tmp_path / "card"
    argv = ["eval", "card", "--models", f"base={tiny_folder}@none;yarn:factor=2", "--lengths", "256", "--tasks", "perplexity,passkey",
            "--samples", "1", "--ppl-data", "builtin:python-docs", "--dtype", "float32", "--out", str(out), "--no-progress"]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    card = json.loads((out / "card.json").read_text())
    assert [(c["task"], c["row"]) for c in card["cells"]] == [("perplexity", "base, unscaled")]
    assert card["settings"]["partial"] is True
