"""bench/ruler_responses.py: each RULER response in one class (a model counting "1. 2. 3." instead of answering,
no word, one word, several), per sample file, with the mean score of the samples that are not counting."""

from __future__ import annotations

import json

from tests.bench_helpers import load_bench_script


def test_each_response_falls_in_one_class():
    responses = load_bench_script("ruler_responses")
    assert responses.response_class(" 1. 2. 3. 4. 5. 6. 7. 8. 9. 10. 11. 12. 13. 14. 15") == "counting"
    assert responses.response_class(" 1. 1. 2. 3. 4. 5.") == "counting"
    assert responses.response_class(" 1. 2.") == "empty"  # too short to call a loop
    assert responses.response_class("") == "empty" and responses.response_class("\n\nThe") == "one word"
    assert responses.response_class(" 1. tothot ... tothot ... tothot") == "one word"
    assert responses.response_class(" 1. uxihtk 2. jwkmne 3. tothot") == "several words"


def test_a_folder_of_sample_files_is_summarized_per_file(tmp_path):
    responses = load_bench_script("ruler_responses")
    folder = tmp_path / "card" / "part" / "ruler"
    folder.mkdir(parents=True)
    header = {"record_version": 1, "row": "fine-tuned", "task": "ruler_fwe", "length": 32768, "dtype": "float32", "device": "cpu"}
    samples = [{"doc_id": 0, "score": 0.0, "response": " 1. 2. 3. 4. 5."},
               {"doc_id": 1, "score": 2 / 3, "response": " 1. ab cde 2. fgh"},
               {"doc_id": 2, "score": 1 / 3, "response": " 1. fgh fgh"}]
    (folder / "ruler_fwe-32768-x.jsonl").write_text("\n".join(json.dumps(r) for r in [header, *samples]) + "\n{\"doc_id\": 3, \"sc")
    (folder / "niah_single_1-32768-x.jsonl").write_text(json.dumps({**header, "task": "niah_single_1"}) + "\n")
    [item] = responses.summarize(tmp_path / "card", "ruler_fwe")
    assert (item["row"], item["length"], item["samples"]) == ("fine-tuned", 32768, 3)  # the cut-off last line is not read
    assert item["classes"] == {"counting": 1, "empty": 0, "one word": 1, "several words": 1}
    assert item["mean"] == round(1 / 3, 4) and item["mean_without_counting"] == 0.5 and item["counting_docs"] == [0]
    assert responses.main(["--folder", str(tmp_path / "card"), "--out", str(tmp_path / "out")]) == 0
    assert "| fine-tuned | 32768 | float32 | 3 | 0.33 | 1 | 0 | 1 | 1 | 0.50 |" in (tmp_path / "out" / "ruler_fwe.md").read_text()
    assert responses.main(["--folder", str(tmp_path / "card"), "--task", "ruler_vt", "--out", "-"]) == 1
