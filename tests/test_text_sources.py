"""Text sources: local files and folders, built-in text, errors."""

import json
from pathlib import Path

import pytest

from hf_posext import text_sources


def test_txt_file_is_one_document_and_bad_bytes_are_replaced(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(b"First line.\nSecond \xff line.\n")
    documents = text_sources.load_documents(path)
    assert len(documents) == 1
    assert documents[0].startswith("First line.")
    assert "\ufffd" in documents[0]


def test_jsonl_reads_default_and_named_fields(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"text": "alpha"}, {"text": "beta"}, {"content": "gamma"}]) + "\n\n")
    assert text_sources.load_documents(path) == ["alpha", "beta", "gamma"]
    named = tmp_path / "named.jsonl"
    named.write_text(json.dumps({"body_text": "delta", "text": "ignored"}) + "\n")
    assert text_sources.load_documents(named, text_field="body_text") == ["delta"]


def test_jsonl_without_text_field_names_the_problem(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"title": "x"}) + "\n")
    with pytest.raises(ValueError, match="no text field"):
        text_sources.load_documents(path)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:1"):
        text_sources.load_documents(broken)


def test_folder_is_read_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "notes.md").write_text("ignored")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n")
    assert text_sources.load_documents(tmp_path) == ["first", "second", "third"]
    assert text_sources.load_documents(tmp_path, max_documents=2) == ["first", "second"]


def test_parquet_column(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    path = tmp_path / "docs.parquet"
    parquet.write_table(pyarrow.table({"text": ["one", "two"], "id": [1, 2]}), path)
    assert text_sources.load_documents(path) == ["one", "two"]
    with pytest.raises(ValueError, match="no text column"):
        text_sources.load_documents(path, text_field="missing")


def test_missing_path_and_empty_sources_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text_sources.load_documents(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text_sources.load_documents("./no/such/folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no"):
        text_sources.load_documents(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n")
    with pytest.raises(ValueError, match="no non-empty document"):
        text_sources.load_documents(blank)
    with pytest.raises(ValueError, match="Unknown built-in"):
        text_sources.load_documents("builtin:nothing")


def test_dataset_name_streams_through_datasets(monkeypatch):
    import sys
    import types

    calls = []

    def load_dataset(name, config_name, split, streaming):
        calls.append((name, config_name, split, streaming))
        return iter([{"text": "row one"}, {"text": ""}, {"text": "row two"}, {"text": "row three"}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert text_sources.load_documents("wikitext:wikitext-103-raw-v1", max_documents=2) == ["row one", "row two"]
    assert calls == [("wikitext", "wikitext-103-raw-v1", "test", True)]


def test_dataset_name_without_datasets_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        text_sources.load_documents("some-org/some-dataset")


def test_builtin_python_docs_is_long_prose_and_deterministic():
    text = text_sources.python_docs_text()
    assert len(text) > 200_000
    assert text == text_sources.load_documents("builtin:python-docs")[0]
    assert ">>>" not in text
    assert len(text_sources.split_sentences(text)) > 2000


def test_split_sentences_keeps_the_end_marks():
    assert text_sources.split_sentences("One. Two! Three? Four") == ["One.", "Two!", "Three?", "Four"]
    assert text_sources.split_sentences('He said "Go." Then left.') == ['He said "Go."', "Then left."]
    assert text_sources.split_sentences("") == []


def test_encode_text_gives_the_ids_without_the_too_long_warning(capfd):
    """A book is longer than the model's window on purpose: no "Token indices sequence length is longer"
    line (transformers logs it to stderr once per tokenizer, so each check uses a fresh one)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    def fresh():
        tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parent / "data" / "training" / "tiny-llama")
        tokenizer.model_max_length = 8
        return tokenizer

    text = "hello world " * 20
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # the suite runs at "error" (conftest)
    try:
        capfd.readouterr()
        ids = text_sources.encode_text(fresh(), text)
        assert "Token indices sequence length" not in capfd.readouterr().err
        assert ids == fresh().encode(text, add_special_tokens=False) and len(ids) > 8
        assert "Token indices sequence length" in capfd.readouterr().err  # what the plain call logs
    finally:
        hf_logging.set_verbosity(verbosity)


def test_encode_text_takes_a_tokenizer_without_the_verbose_flag():
    class Minimal:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    assert text_sources.encode_text(Minimal(), "ab") == [97, 98]


# ------------------------------------------------------------------ sources that are not text


def _random_bytes(size: int) -> bytes:
    import random

    return random.Random(0).randbytes(size)


def test_a_file_of_random_bytes_is_refused_with_its_share(tmp_path):
    # random bytes decode to U+FFFD and control characters: a perplexity of it is a number about noise
    path = tmp_path / "noise.txt"
    path.write_bytes(_random_bytes(4000))
    share = text_sources.not_text_share(path.read_bytes().decode("utf-8", errors="replace"))
    assert 0.45 < share < 0.65  # measured: 55 % on 200 kB of os.urandom
    with pytest.raises(ValueError, match=rf"^{share:.0%} of {path} is not UTF-8 text .*Convert it to UTF-8 text"):
        text_sources.check_text_source(path)  # before any model: only the head of the file is read
    with pytest.raises(ValueError, match=rf"^{share:.0%} of {path} is not UTF-8 text"):
        text_sources.load_documents(path)


def test_noise_after_a_clean_head_is_refused_when_the_document_is_read(tmp_path):
    path = tmp_path / "tail.txt"
    path.write_bytes(b"A clean opening sentence. " * 3000 + _random_bytes(400_000))  # head: 78 kB of prose
    text_sources.check_text_source(path)
    with pytest.raises(ValueError, match=rf"of {path} is not UTF-8 text"):
        text_sources.load_documents(path)


def test_a_folder_names_the_file_that_is_not_text(tmp_path):
    (tmp_path / "a.txt").write_text("Plain prose here. " * 20)
    (tmp_path / "b.txt").write_bytes("Plain prose here. ".encode("utf-16") * 20)  # UTF-16: half NUL bytes
    with pytest.raises(ValueError, match=r"of .*b\.txt is not UTF-8 text"):
        text_sources.check_text_source(tmp_path)
    text_sources.check_text_source(tmp_path, exclude=["b.*"])  # a file left out is not judged
    with pytest.raises(ValueError, match=r"of .*b\.txt is not UTF-8 text"):
        text_sources.load_documents(tmp_path)


def test_a_jsonl_document_that_is_not_text_is_named_by_its_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    noise = _random_bytes(300).decode("utf-8", errors="replace")
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["Fine words. " * 10, noise]) + "\n")
    text_sources.check_text_source(path)  # the JSON escapes the noise: the raw head is text
    with pytest.raises(ValueError, match=rf"of {path}:2 is not UTF-8 text"):
        text_sources.load_documents(path)


def test_some_undecodable_bytes_are_read_with_a_warning_that_says_how_much(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(("Un café au lait, très naïf. " * 40).encode("latin-1"))  # 3 of 28 characters are not UTF-8
    with pytest.warns(UserWarning, match=rf"^10\.7% of {path} is not UTF-8 text .*it is read"):
        documents = text_sources.load_documents(path)
    assert documents[0].count("\ufffd") == 120
    text_sources.check_text_source(path)
    clean = tmp_path / "clean.txt"
    clean.write_bytes(("Un café au lait, très naïf. " * 40).encode("utf-8") + b"\xff")  # one bad byte: no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text_sources.load_documents(clean)


def test_many_tiny_files_of_random_bytes_are_judged_together(tmp_path):
    # each file is under the minimum size a document is judged at; the source as a whole is noise
    noise = _random_bytes(40 * 50)
    for index in range(50):
        (tmp_path / f"part{index:03}.txt").write_bytes(noise[40 * index:40 * (index + 1)])
    assert all(len(p.read_text(errors="replace")) < text_sources.MIN_JUDGED_CHARACTERS for p in tmp_path.iterdir())
    message = rf"^\d+% of the 50 files of the folder {tmp_path} shorter than 64 characters each \(judged together\) is not UTF-8 text"
    with pytest.raises(ValueError, match=message):
        text_sources.check_text_source(tmp_path)  # before any model
    with pytest.raises(ValueError, match=message):
        text_sources.load_documents(tmp_path)
    (tmp_path / "prose.txt").write_text("Plain prose here. " * 20)
    text_sources.check_text_source(tmp_path, exclude=["part*"])  # the noise left out is not judged
    jsonl = tmp_path.parent / "tiny.jsonl"  # short records: each too short, the JSON escapes hide the noise from the head
    jsonl.write_text("\n".join(json.dumps({"text": noise[i:i + 30].decode("utf-8", errors="replace")}) for i in range(0, 600, 30)))
    text_sources.check_text_source(jsonl)
    with pytest.raises(ValueError, match=rf"of the \d+ documents of {jsonl} shorter than 64 characters each \(judged together\)"):
        text_sources.load_documents(jsonl)


def test_many_tiny_files_of_prose_are_read(tmp_path):
    for index in range(50):
        (tmp_path / f"line{index:03}.txt").write_text(f"Sentence number {index} is short.")
    text_sources.check_text_source(tmp_path)
    assert len(text_sources.load_documents(tmp_path)) == 50


REPO = Path(__file__).resolve().parent.parent


def test_expand_held_apart_replaces_the_entry_by_the_evaluation_books_once_each():
    assert text_sources.expand_held_apart(["a*.txt", "held-apart", "austen-emma.txt", "held-apart"]) == [
        "a*.txt", "austen-emma.txt", "melville-moby_dick.txt"]
    assert text_sources.expand_held_apart(["held-apart-not"]) == ["held-apart-not"]  # only the whole entry
    assert text_sources.expand_held_apart([]) == []


def test_the_repository_ships_its_books_and_its_evaluation_books_are_among_them():
    books = REPO / text_sources.BOOKS_FOLDER
    names = sorted(p.name for p in books.glob("*.txt"))
    assert len(names) == 10 and set(text_sources.HELD_APART_BOOKS) <= set(names)
    assert (REPO / "data" / "README.md").is_file()
    text_sources.check_text_source(books)  # every book is UTF-8 text
    assert (books / text_sources.HAYSTACK_BOOK).read_bytes().count(b"\r\n") > 1000  # kept byte for byte (CRLF)


def test_a_missing_relative_source_names_the_current_directory_and_the_shipped_books(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        text_sources.check_text_source("./my/books")
    message = str(caught.value)
    assert f"(a relative path is read from the current directory, {tmp_path})" in message and "\n" not in message
    assert "ships books in data/books: run from the repository root" in message and "pg19" in message
    # the repository's folder is a path even though it reads like a dataset name (owner/name)
    with pytest.raises(FileNotFoundError, match="'data/books' does not exist"):
        text_sources.check_text_source(text_sources.BOOKS_FOLDER)
    with pytest.raises(FileNotFoundError) as caught:
        text_sources.check_text_source(tmp_path / "nope")
    assert "current directory" not in str(caught.value)  # an absolute path needs no hint


def _books(folder: Path) -> Path:
    """A folder with the held-apart books' names and two others (a few lines of prose each)."""
    folder.mkdir()
    for name in (*text_sources.HELD_APART_BOOKS, "austen-persuasion.txt", "whitman-leaves.txt"):
        (folder / name).write_text(f"Prose of {name}. " * 40)
    return folder


@pytest.mark.parametrize("pattern, closest", [("held_apart", "held-apart"), ("austen-emma", "austen-emma.txt"),
                                               ("whitman-leave.txt", "whitman-leaves.txt")])
def test_an_exclusion_that_matches_nothing_is_refused_naming_the_closest_name(tmp_path, pattern, closest):
    books = _books(tmp_path / "books")
    with pytest.raises(ValueError) as refused:
        text_sources.check_text_source(books, exclude=[pattern])
    message = str(refused.value)
    assert f"{pattern!r} matches no file" in message and f"did you mean {closest!r}" in message, message
    assert "\n" not in message
    text_sources.check_text_source(books, exclude=["held-apart", "whitman-*"])  # every pattern matches a file


def test_the_held_apart_entry_is_no_refusal_where_a_folder_lacks_the_books(tmp_path):
    (tmp_path / "mine.txt").write_text("Plain prose here. " * 20)
    text_sources.check_text_source(tmp_path, exclude=text_sources.expand_held_apart(["held-apart"]))


def test_an_exclusion_of_every_file_or_of_a_source_that_is_no_folder_is_refused(tmp_path):
    books = _books(tmp_path / "books")
    with pytest.raises(ValueError, match=r"^data.exclude=\['\*.txt'\] leaves no file to read in "):
        text_sources.check_text_source(books, exclude=["*.txt"])
    with pytest.raises(ValueError, match="applies to the files of a folder"):
        text_sources.check_text_source(books / "whitman-leaves.txt", exclude=["x.txt"])


def test_the_held_apart_books_a_source_would_read_are_named(tmp_path):
    books = _books(tmp_path / "books")
    assert text_sources.held_apart_books_read(books, []) == list(text_sources.HELD_APART_BOOKS)
    assert text_sources.held_apart_books_read(books, ["austen-emma.txt"]) == [text_sources.HAYSTACK_BOOK]
    assert text_sources.held_apart_books_read(books, text_sources.expand_held_apart(["held-apart"])) == []
    assert text_sources.held_apart_books_read(books / "austen-emma.txt", []) == ["austen-emma.txt"]
    assert text_sources.held_apart_books_read("builtin:python-docs", []) == []
