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
    # counting, then the question again or another made-up one on later lines: still counting (missed before 2026-12-05)
    assert responses.response_class(" 1. 2. 3. 4. 5.\n\nWhat is the first and last letter of the three") == "counting"
    assert responses.response_class(" 1. 2. 3. 4.\nThe three most frequently appeared words are: 1. 2. 3.") == "counting"
    assert responses.response_class("\n1. tijnuo\n2. 3. 4. 5.") == "one word"  # its first line names a word
    assert responses.response_class("") == "empty" and responses.response_class("\n\nThe") == "one word"
    assert responses.response_class(" 1. tothot ... tothot ... tothot") == "one word"
    assert responses.response_class(" 1. uxihtk 2. jwkmne 3. tothot") == "several words"


def test_a_response_that_only_says_the_prompt_again_is_told_apart_given_the_prompt():
    responses = load_bench_script("ruler_responses")
    prompt = ("... tothot ... jvzrja\nQuestion: What are the three most frequently appeared words in the above coded text?\n"
              "Answer: According to the coded text above, the three most frequently appeared words are:")
    echo = "\n\nThe three most frequently appeared words are:\n\nThe three most frequently appeared words are:\n\nThe three most freque"
    assert responses.repeats_prompt("The three most frequently appeared words in the above coded text are", prompt)
    assert responses.repeats_prompt("The three most freque", prompt)  # cut off by the budget
    assert not responses.repeats_prompt("The answer is: 3", prompt) and not responses.repeats_prompt("tothot", prompt)
    assert responses.response_class(echo, prompt) == "prompt repeated"
    assert responses.response_class(echo) == "several words"  # without the prompt: the words it says
    assert responses.response_class("\n1. tijnuo\n2. tijnuo\nThe three most frequently appeared words are:", prompt) == "one word"
    assert responses.response_class("", prompt) == "empty"


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
    (tmp_path / "card" / "part" / "card.json").write_text(json.dumps({"cells": [
        {"row": "fine-tuned, yarn ×4 + string", "source": "elsewhere/part/ruler/ruler_fwe-32768-x.jsonl"}]}))
    [item] = responses.summarize(tmp_path / "card", "ruler_fwe")
    assert item["row"] == "fine-tuned, yarn ×4 + string"  # the card's label, not the one the file started under
    assert item["classes"] == {"counting": 1, "empty": 0, "prompt repeated": 0, "one word": 1, "several words": 1}
    assert item["mean"] == round(1 / 3, 4) and item["mean_without_counting"] == 0.5 and item["counting_docs"] == [0]
    assert responses.main(["--folder", str(tmp_path / "card"), "--out", str(tmp_path / "out")]) == 0
    assert "| fine-tuned, yarn ×4 + string | 32768 | float32 | 3 | 0.33 | 1 | 0 | 0 | 1 | 1 | 0.50 |" in (tmp_path / "out" / "ruler_fwe.md").read_text()
    assert responses.main(["--folder", str(tmp_path / "card"), "--task", "ruler_vt", "--out", "-"]) == 1


def test_a_needle_answer_is_read_against_its_samples_text(tmp_path):
    responses = load_bench_script("ruler_responses")
    doc = {"input": "The value for ab-cd is: 1234567. The value for ef-gh is: 7654321. What is the value for ab-cd?",
           "outputs": ["1234567"]}
    assert responses.needle_class(": 1234567.", 1.0, doc) == "right"
    assert responses.needle_class(": 7654321.", 0.0, doc) == "another key's value"
    assert responses.needle_class(": 7654320.", 0.0, doc) == "not in the text"
    assert responses.needle_class(": the value", 0.0, doc) == "no value"
    uuid_doc = {"input": "id 7f411fed-1e70-4799-b3a1-d1c2ad4ab155 and 62584ab3-6877-4bab-85c1-42624d849ec5",
                "outputs": ["7f411fed-1e70-4799-b3a1-d1c2ad4ab155"]}
    assert responses.needle_class(" 62584ab3-6877-4bab-85c1-42624d849ec5", 0.0, uuid_doc) == "another key's value"

    card, key = tmp_path / "card", {"task": "niah_multikey_2", "length": 2048, "seed": 0, "tokenizer": "8fd158b1639fb0cb"}
    (card / "part" / "ruler").mkdir(parents=True)
    (card / "ruler-samples").mkdir()
    (card / "ruler-samples" / "niah_multikey_2-2048-seed0-8fd158b1-0000000000.json").write_text(
        json.dumps({"key": {**key, "seed": 1}, "docs": []}))  # another seed's samples: never read for this file
    (card / "ruler-samples" / "niah_multikey_2-2048-seed0-8fd158b1-1111111111.json").write_text(json.dumps({"key": key, "docs": [doc]}))
    header = {"row": "base", "task": "niah_multikey_2", "length": 2048, "dtype": "float32", "sample_key": key}
    (card / "part" / "ruler" / "niah_multikey_2-2048-x.jsonl").write_text(
        json.dumps(header) + "\n" + json.dumps({"doc_id": 0, "score": 0.0, "response": ": 7654321."}) + "\n"
        + json.dumps({"doc_id": 1, "score": 0.0, "response": ": 7654321."}) + "\n")  # its text is not in the cache
    [item] = responses.summarize(card, "niah_multikey_2", card / "ruler-samples")
    assert item["classes"] == {"right": 0, "another key's value": 1, "not in the text": 0, "no value": 0, "unread": 1}
    assert responses.main(["--folder", str(card), "--task", "niah_multikey_2", "--out", str(tmp_path / "out")]) == 0
    assert "| base | 2048 | float32 | 2 | 0.00 | 0 | 1 | 0 | 0 | 1 |" in (tmp_path / "out" / "niah_multikey_2.md").read_text()


def test_a_word_tasks_prompt_comes_from_the_cards_sample_cache(tmp_path):
    responses = load_bench_script("ruler_responses")
    card, key = tmp_path / "card", {"task": "ruler_fwe", "length": 2048, "seed": 0, "tokenizer": "8fd158b1639fb0cb"}
    (card / "part" / "ruler").mkdir(parents=True)
    (card / "ruler-samples").mkdir()
    doc = {"input": "ab ab cd\nQuestion: What are the three most frequently appeared words in the above coded text?",
           "gen_prefix": "Answer: the three most frequently appeared words are:", "outputs": ["ab", "cd", "ef"]}
    (card / "ruler-samples" / "ruler_fwe-2048-seed0-8fd158b1-1111111111.json").write_text(json.dumps({"key": key, "docs": [doc]}))
    header = {"row": "tuned", "task": "ruler_fwe", "length": 2048, "dtype": "float32", "sample_key": key}
    echo = {"score": 0.0, "response": "\nThe three most frequently appeared words are:\nThe three most frequently"}
    (card / "part" / "ruler" / "ruler_fwe-2048-x.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [header, {"doc_id": 0, **echo}, {"doc_id": 1, **echo}]) + "\n")  # doc 1: not cached
    [item] = responses.summarize(card, "ruler_fwe", card / "ruler-samples")
    assert item["classes"]["prompt repeated"] == 1 and item["classes"]["several words"] == 1


def test_two_rows_on_the_same_samples_are_paired_on_who_counts(tmp_path):
    responses = load_bench_script("ruler_responses")
    folder = tmp_path / "card" / "part" / "ruler"
    folder.mkdir(parents=True)
    key = {"task": "ruler_fwe", "length": 32768, "seed": 0, "tokenizer": "8fd158b1639fb0cb"}
    counting, word = " 1. 2. 3. 4. 5.", " 1. tothot"
    rows = {"headline": [counting] * 9 + [counting, word], "harder": [word] * 9 + [counting, counting],
            "other samples": [counting] * 11}
    for name, answers in rows.items():
        header = {"row": name, "task": "ruler_fwe", "length": 32768, "dtype": "float32",
                  "sample_key": {**key, "seed": 1} if name == "other samples" else key}
        records = [{"doc_id": i, "score": 0.0, "response": answer} for i, answer in enumerate(answers)]
        (folder / f"ruler_fwe-32768-{name}.jsonl").write_text("\n".join(json.dumps(r) for r in [header, *records]) + "\n")
    items = responses.summarize(tmp_path / "card", "ruler_fwe")
    [pair] = responses.paired_counting(items)  # "other samples" has another seed: never paired
    assert (pair["first"], pair["second"]) == ("harder", "headline")
    assert (pair["only_first"], pair["only_second"], pair["both"], pair["samples"]) == (1, 9, 1, 11)
    assert 0.02 < pair["p"] < 0.03  # exact sign test: 2 * 10 / 2**10 = 0.0215
    assert responses.main(["--folder", str(tmp_path / "card"), "--out", str(tmp_path / "out")]) == 0
    assert "| harder | headline | 32768 | float32 | 11 | 1 | 9 | 1 | 0.021 |" in (tmp_path / "out" / "ruler_fwe.md").read_text()
    assert json.loads((tmp_path / "out" / "ruler_fwe.json").read_text())["pairs"] == [pair]
