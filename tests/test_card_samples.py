"""The suite's samples on disk: the RULER sample cache and its key, per-sample results files, resumed and refused."""

from __future__ import annotations

import json

import pytest

from hf_posext.core.errors import DamagedFileError
from hf_posext.card.samples import SampleCache, SampleResults, SampleResultsError, sample_cache_key, tokenizer_hash
from tests.card_helpers import char_tokenizer


def test_cache_key_follows_the_tokenizer_not_its_files(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(tmp_path / "a")
    tokenizer.model_max_length = 99999  # what hf-posext patch writes beside a scaled model
    tokenizer.save_pretrained(tmp_path / "b")
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(tmp_path / "a"), AutoTokenizer.from_pretrained(tmp_path / "b")
    assert tokenizer_hash(a) == tokenizer_hash(b)
    other = char_tokenizer()
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
    data.pop("digest")  # a cache written before digests is read as it is, with one line saying it is not checked
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"has no digest \(written before digests, or removed by hand\), so an edit of its "
                                         r"docs cannot be detected; delete it to generate the samples again with one\.$"):
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


def test_sample_cache_names_and_tokenizer_hashes_keep_their_values(tmp_path):
    """Earlier runs' sample caches are found by these values: pinned from the release that wrote them."""
    class Vocabulary:  # a tokenizer without a backend: hashed by its vocabulary (no library version in the value)
        bos_token, eos_token = "<s>", "</s>"

        def get_vocab(self):
            return {"<s>": 0, "</s>": 1, "a": 2}

    key = {"task": "niah_single_1", "task_version": "1", "tokenizer": "abcdef0123456789", "length": 4096, "seed": 0,
           "lm_eval": "0.4.9"}
    assert SampleCache(tmp_path).path(key).name == "niah_single_1-4096-seed0-abcdef01-f7bbe56ea7.json"
    assert tokenizer_hash(Vocabulary()) == "aaa0d0ba04f742c9"
