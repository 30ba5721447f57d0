"""Text sources for evaluation: local files and folders, Hugging Face datasets, and built-in offline text.

A *source* is one of:

* a local ``.txt`` file (one document: the whole file), ``.jsonl`` file (one document per line, read
  from a text field), ``.parquet`` file (one document per row of a text column; needs ``pyarrow``), or a
  folder holding such files (searched recursively, in sorted path order);
* a Hugging Face ``datasets`` name, optionally ``name:config`` (e.g. ``pg19`` or
  ``wikitext:wikitext-103-raw-v1``), streamed so only the documents needed are read (needs the
  ``datasets`` package and network access);
* ``builtin:python-docs``: the docstrings of the installed Python standard library, concatenated
  into one long English document. Every Python installation has them, so the demo and the default
  needle haystack work offline on a fresh clone without shipping anyone's prose in this repository.

Files are read as UTF-8 with ``errors="replace"``: one bad byte never aborts an evaluation. A source that is
not text is another matter (random or compressed bytes, a UTF-16 or Latin-1 file read as UTF-8): its
perplexity would be a number about noise. Every document of at least :data:`MIN_JUDGED_CHARACTERS`
characters is judged by the share of its characters that are not text (U+FFFD, which replaces each
undecodable byte, and control characters other than tab, newline, vertical tab, form feed and carriage
return): above :data:`NOT_TEXT_REFUSED` it is refused with a ``ValueError`` naming the file and the share,
above :data:`NOT_TEXT_WARNED` a warning says how much (once per file). Shorter documents of a source (and the
short files of a folder) are judged together, so a source cut into many tiny pieces of noise is refused as a whole.
:func:`check_text_source` applies the refusal to the first :data:`HEAD_BYTES` of each local file before a model
is loaded.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import inspect
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = [
    "TEXT_SUFFIXES",
    "BUILTIN_SOURCES",
    "load_documents",
    "iter_documents",
    "check_text_source",
    "not_text_share",
    "NOT_TEXT_REFUSED",
    "NOT_TEXT_WARNED",
    "python_docs_text",
    "split_sentences",
    "encode_text",
    "BOOKS_FOLDER",
    "PERPLEXITY_BOOK",
    "HAYSTACK_BOOK",
    "HELD_APART_BOOKS",
    "HELD_APART",
    "expand_held_apart",
    "check_exclusions",
    "held_apart_books_read",
]

#: File suffixes read from local paths.
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: Built-in offline sources (name -> description).
BUILTIN_SOURCES = {
    "builtin:python-docs": "docstrings of the installed Python standard library, one long document",
}
_TEXT_FIELDS = ("text", "content", "document", "body")

#: The public-domain books shipped in the repository (data/README.md says what they are and where they come
#: from), as recipes name the folder: relative to the repository root, where ``hf-posext train`` is run.
BOOKS_FOLDER = "data/books"
#: The book of :data:`BOOKS_FOLDER` that perplexity evaluations read (held apart from training).
PERPLEXITY_BOOK = "austen-emma.txt"
#: The book of :data:`BOOKS_FOLDER` that needle-in-a-haystack evaluations hide the needle in (held apart too).
HAYSTACK_BOOK = "melville-moby_dick.txt"
#: The books that training never reads, so that evaluations score text the model has not seen. This is the one
#: place they are named: recipes say ``data.exclude: [held-apart]`` (:data:`HELD_APART`) and the evaluation
#: scripts read :data:`PERPLEXITY_BOOK` and :data:`HAYSTACK_BOOK`.
HELD_APART_BOOKS = (PERPLEXITY_BOOK, HAYSTACK_BOOK)
#: In a list of file-name patterns to exclude (a recipe's ``data.exclude``), the entry that stands for
#: :data:`HELD_APART_BOOKS`.
HELD_APART = "held-apart"

#: A document with a larger share of characters that are not text is refused (random bytes decode to about
#: 55 % U+FFFD and control characters, a UTF-16 English file read as UTF-8 to 50 %; prose to 0 %).
NOT_TEXT_REFUSED = 0.25
#: A document with a larger share is read, with a warning that says how much (Latin-1 French read as UTF-8:
#: a few per cent).
NOT_TEXT_WARNED = 0.01
#: Documents shorter than this are too short to judge.
MIN_JUDGED_CHARACTERS = 64
#: How much of each local file :func:`check_text_source` reads to refuse a file that is not text.
HEAD_BYTES = 1 << 16
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")

# Standard library modules whose docstrings form the built-in text, in this fixed order. Listed
# explicitly (not discovered) so the text is the same on every machine with the same Python version.
_PYTHON_DOC_MODULES = (
    "builtins", "os", "os.path", "sys", "re", "json", "collections", "itertools", "functools", "pathlib",
    "argparse", "logging", "subprocess", "threading", "multiprocessing", "asyncio", "socket", "ssl", "email",
    "http.client", "http.server", "urllib.request", "urllib.parse", "xml.etree.ElementTree", "csv",
    "sqlite3", "datetime", "calendar", "time", "decimal", "fractions", "random", "statistics", "math",
    "string", "textwrap", "difflib", "unicodedata", "codecs", "io", "shutil", "tempfile", "glob",
    "fnmatch", "zipfile", "tarfile", "gzip", "bz2", "lzma", "zlib", "hashlib", "hmac", "secrets", "base64",
    "binascii", "struct", "copy", "pickle", "shelve", "dbm", "configparser", "tomllib", "typing",
    "dataclasses", "enum", "abc", "contextlib", "inspect", "ast", "dis", "tokenize", "traceback",
    "warnings", "weakref", "gc", "heapq", "bisect", "array", "queue", "sched", "selectors", "signal",
    "unittest", "doctest", "pdb", "profile", "timeit", "trace", "pydoc", "platform", "locale", "gettext",
    "operator", "numbers", "cmath", "ipaddress", "mimetypes", "smtplib", "imaplib", "ftplib", "uuid",
    "webbrowser", "wsgiref", "html", "html.parser", "xml.dom.minidom", "pprint", "reprlib", "graphlib",
    "concurrent.futures", "importlib", "pkgutil", "zipimport", "runpy", "types", "codeop", "code",
)


def expand_held_apart(patterns: Iterable[str]) -> list[str]:
    """``patterns`` with each :data:`HELD_APART` entry replaced by the file names of :data:`HELD_APART_BOOKS`.

    Args:
        patterns: file-name patterns (fnmatch), e.g. a recipe's ``data.exclude``.

    Returns:
        A new list, in order, each name once.

    Example:
        >>> expand_held_apart(["held-apart", "notes-*.txt"])
        ['austen-emma.txt', 'melville-moby_dick.txt', 'notes-*.txt']
    """
    expanded: list[str] = []
    for pattern in patterns:
        for name in (HELD_APART_BOOKS if pattern == HELD_APART else (pattern,)):
            if name not in expanded:
                expanded.append(name)
    return expanded


def check_exclusions(source: str | os.PathLike, exclude: Iterable[str]) -> None:
    """Refuse exclusions that would leave out less than the user meant (run before loading a model).

    A pattern that matches no file of the folder is a typo (``held_apart``, ``austen-emma`` without ``.txt``) that
    would leave the file in the training text: it is refused, naming the closest name. The names
    :func:`expand_held_apart` gives for :data:`HELD_APART` are exempt (a folder without those books). Exclusions of
    a source that is not a folder, or of every file of one, are refused too.

    Args:
        source: as for :func:`iter_documents`.
        exclude: file-name patterns (fnmatch); :data:`HELD_APART` stands for the held-apart books.

    Raises:
        ValueError: the pattern, the folder and the fix, in one line.
    """
    exclude = expand_held_apart(exclude)
    if not exclude:
        return
    path = Path(str(source)).expanduser()
    if not path.exists() and _looks_like_path(str(source)) and not str(source).startswith("builtin:"):
        return  # a missing source: check_text_source names it as missing, which is the fix the user needs first
    if not path.is_dir():
        raise ValueError(f"data.exclude={exclude} applies to the files of a folder, but data.source={str(source)!r} is "
                         "not a folder; drop data.exclude, or give the folder as data.source.")
    names = sorted({file.name for file in _text_files(path)})
    for pattern in exclude:
        if pattern in HELD_APART_BOOKS or any(fnmatch.fnmatch(name, pattern) for name in names):
            continue
        close = difflib.get_close_matches(pattern, [HELD_APART, *names], n=1, cutoff=0.0)
        raise ValueError(f"data.exclude: {pattern!r} matches no file of {path}, so it leaves nothing out (did you mean "
                         f"{close[0]!r}?); write a file name or fnmatch pattern of that folder, or {HELD_APART!r} for the "
                         "books evaluations score.")
    if names and all(any(fnmatch.fnmatch(name, pattern) for pattern in exclude) for name in names):
        raise ValueError(f"data.exclude={exclude} leaves no file to read in {path}; exclude fewer files.")


def held_apart_books_read(source: str | os.PathLike, exclude: Iterable[str]) -> list[str]:
    """The :data:`HELD_APART_BOOKS` (by file name) that reading ``source`` without ``exclude`` would read: training
    on them makes the perplexity and needle evaluations score text the model has seen.

    Args:
        source: as for :func:`iter_documents`.
        exclude: file-name patterns (fnmatch); :data:`HELD_APART` stands for the held-apart books.

    Returns:
        The books' names, in :data:`HELD_APART_BOOKS` order; empty for a built-in or hub source.
    """
    exclude = expand_held_apart(exclude)
    path = Path(str(source)).expanduser()
    if path.is_dir():
        names = {file.name for file in _text_files(path)
                 if not any(fnmatch.fnmatch(file.name, pattern) for pattern in exclude)}
    elif path.is_file():
        names = {path.name}
    else:
        names = set()
    return [name for name in HELD_APART_BOOKS if name in names]


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def not_text_share(text: str) -> float:
    """The share of ``text``'s characters that are not text: U+FFFD (an undecodable byte) and control
    characters other than tab, newline, vertical tab, form feed and carriage return (0.0 for empty text)."""
    if not text:
        return 0.0
    return (len(text) - len(_NOT_TEXT.sub("", text))) / len(text)


def _refusal(share: float, where: str) -> ValueError:
    return ValueError(
        f"{share:.0%} of {where} is not UTF-8 text (undecodable bytes or control characters): it is not a text "
        "source. Convert it to UTF-8 text (e.g. iconv -t utf-8), or leave it out of the source."
    )


class _ShortPieces:
    """Pieces too short to judge alone, judged together: many tiny pieces of noise are still noise."""

    def __init__(self, what: str) -> None:
        self.what = what  # e.g. "documents of data.jsonl", "files of the folder data"
        self.count = self.characters = self.not_text = 0

    def add(self, text: str) -> None:
        self.count += 1
        self.characters += len(text)
        self.not_text += len(text) - len(_NOT_TEXT.sub("", text))

    def check(self) -> None:
        """Refuse the pool if it is long enough to judge and mostly not text."""
        if self.characters >= MIN_JUDGED_CHARACTERS and self.not_text / self.characters > NOT_TEXT_REFUSED:
            raise _refusal(
                self.not_text / self.characters,
                f"the {self.count} {self.what} shorter than {MIN_JUDGED_CHARACTERS} characters each (judged together)",
            )


def _judged(documents: Iterable[tuple[str, str]], source: str, several: bool = True) -> Iterator[str]:
    """The texts of ``(where, text)`` pairs, refusing one that is mostly not text and warning (once) about noise;
    documents too short to judge alone are judged together."""
    warned = False
    short = _ShortPieces(f"documents of {source}")
    for where, document in documents:
        if document and len(document) < MIN_JUDGED_CHARACTERS:
            short.add(document)
            short.check()  # as read: a streamed source is refused before much of it is used
        elif len(document) >= MIN_JUDGED_CHARACTERS:
            share = not_text_share(document)
            if share > NOT_TEXT_REFUSED:
                raise _refusal(share, where)
            if share > NOT_TEXT_WARNED and not warned:
                warned = True
                warnings.warn(
                    f"{share:.1%} of {where} is not UTF-8 text (undecodable bytes or control characters); it is read, "
                    f"but scores on it include that noise. Convert {source} to UTF-8 text or clean it"
                    + (" (later documents of it are not reported)." if several else "."),
                    stacklevel=2,
                )
        yield document


def _jsonl_documents(path: Path, text_field: str | None) -> Iterator[tuple[str, str]]:
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} is not valid JSON ({error.msg}); a .jsonl file holds one JSON object per line.") from error
            where = f"{path}:{line_number}"
            yield where, (record if isinstance(record, str) else _field(record, text_field, where))


def _field(record: dict, text_field: str | None, where: str) -> str:
    names = (text_field,) if text_field else _TEXT_FIELDS
    for name in names:
        if isinstance(record, dict) and isinstance(record.get(name), str):
            return record[name]
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(
        f"{where} has no text field {' or '.join(map(repr, names))} (found {keys}); "
        "name the field with text_field= (--text-field on the command line)."
    )


def _parquet_documents(path: Path, text_field: str | None) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise ImportError(f"Reading {path} needs pyarrow: pip install pyarrow (or pip install 'hf-posext[eval]').") from error
    table = parquet.read_table(path)
    names = (text_field,) if text_field else _TEXT_FIELDS
    column = next((name for name in names if name in table.column_names), None)
    if column is None:
        raise ValueError(
            f"{path} has no text column {' or '.join(map(repr, names))} (columns: {table.column_names}); "
            "name it with text_field= (--text-field)."
        )
    for row, value in enumerate(table.column(column).to_pylist()):
        if isinstance(value, str):
            yield f"{path} row {row}", value


def _file_documents(path: Path, text_field: str | None) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield from _judged([(str(path), _read_text(path))], str(path), several=False)
    elif suffix == ".jsonl":
        yield from _judged(_jsonl_documents(path, text_field), str(path))
    elif suffix == ".parquet":
        yield from _judged(_parquet_documents(path, text_field), str(path))
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(TEXT_SUFFIXES)}.")


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith((".", "/", "~"))
        or source == BOOKS_FOLDER or source.startswith(BOOKS_FOLDER + "/")  # the repository's books, never a dataset
        or os.sep in source and not re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", source)
        or source.lower().endswith(TEXT_SUFFIXES)
    )


def _dataset_documents(source: str, split: str, text_field: str | None) -> Iterator[str]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"{source!r} is not a local file or folder, so it was taken as a Hugging Face dataset name, "
            "which needs the datasets package: pip install datasets. For local text pass a .txt/.jsonl/.parquet "
            "file or a folder."
        ) from error
    name, _, config_name = source.partition(":")
    dataset = datasets.load_dataset(name, config_name or None, split=split, streaming=True)
    rows = ((f"dataset {source} row {index}", _field(record, text_field, f"dataset {source} row {index}"))
            for index, record in enumerate(dataset))
    yield from _judged(rows, f"dataset {source}")


def iter_documents(source: str | os.PathLike, *, text_field: str | None = None, split: str = "test") -> Iterator[str]:
    """Yield the documents of ``source`` (see the module docstring for what a source is).

    Args:
        source: a local file or folder, a dataset name (``name`` or ``name:config``), or a built-in name.
        text_field: the JSON field / parquet column / dataset column holding the text; default: the
            first of ``text``, ``content``, ``document``, ``body`` present.
        split: the dataset split (dataset names only).

    Raises:
        FileNotFoundError: ``source`` looks like a path but does not exist.
        ValueError: a folder without readable files, an unknown built-in, a record without text.
    """
    text = str(source)
    check_text_source(text)
    if text.startswith("builtin:"):
        yield python_docs_text()
        return
    path = Path(text).expanduser()
    if path.is_dir():
        for file in _text_files(path):
            yield from _file_documents(file, text_field)
        return
    if path.is_file():
        yield from _file_documents(path, text_field)
        return
    yield from _dataset_documents(text, split, text_field)


def _text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def check_text_source(source: str | os.PathLike, exclude: Iterable[str] = ()) -> None:
    """Refuse a text source that cannot be read, reading only the head of its files (run before loading a model).

    Args:
        source: as for :func:`iter_documents`.
        exclude: file-name patterns (fnmatch) of a folder's files that will not be read (not judged here).

    Raises:
        FileNotFoundError: ``source`` looks like a path but does not exist.
        ValueError: an unknown built-in, a folder without text files, a file of another type, a file whose
            first :data:`HEAD_BYTES` are mostly not text (the share and the file named).
    """
    text = str(source)
    path = Path(text).expanduser()
    if not text.startswith("builtin:") and not path.exists() and _looks_like_path(text):
        where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        raise FileNotFoundError(
            f"Text source {text!r} does not exist{where}. Pass an existing .txt/.jsonl/.parquet file or folder "
            f"(the repository ships books in {BOOKS_FOLDER}: run from the repository root), a Hugging Face "
            f"dataset name (e.g. emozilla/pg19), or one of {', '.join(BUILTIN_SOURCES)}."
        )
    check_exclusions(source, exclude)  # after the source itself: a missing folder is named as missing
    if text.startswith("builtin:"):
        if text not in BUILTIN_SOURCES:
            raise ValueError(f"Unknown built-in text {text!r}; available: {', '.join(BUILTIN_SOURCES)}.")
        return
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise ValueError(f"The folder {path} holds no {'/'.join(TEXT_SUFFIXES)} files to read text from.")
        short = _ShortPieces(f"files of the folder {path}")
        for file in files:
            if not any(fnmatch.fnmatch(file.name, pattern) for pattern in exclude):
                _check_head(file, short)
        short.check()
    elif path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; expected one of {', '.join(TEXT_SUFFIXES)}.")
        _check_head(path)


def _check_head(path: Path, short: _ShortPieces | None = None) -> None:
    """Refuse a .txt or .jsonl file whose first :data:`HEAD_BYTES` are mostly not text (parquet is binary); a file
    too short to judge alone goes to the folder's pool ``short``, judged together with the other short files."""
    if path.suffix.lower() not in (".txt", ".jsonl"):
        return
    with path.open("rb") as handle:
        raw = handle.read(HEAD_BYTES)
    head = raw.decode("utf-8", errors="replace")
    if short is not None and head and len(head) < MIN_JUDGED_CHARACTERS:
        short.add(head)
    elif len(head) >= MIN_JUDGED_CHARACTERS and not_text_share(head) > NOT_TEXT_REFUSED:
        where = str(path) if len(raw) < HEAD_BYTES else f"the first {HEAD_BYTES // 1024} KiB of {path}"
        raise _refusal(not_text_share(head), where)


def load_documents(
    source: str | os.PathLike,
    *,
    text_field: str | None = None,
    split: str = "test",
    max_documents: int | None = None,
) -> list[str]:
    """The non-empty documents of ``source`` as a list (at most ``max_documents``).

    Raises:
        ValueError: the source yields no non-empty document (and the errors of :func:`iter_documents`).
    """
    documents: list[str] = []
    for document in iter_documents(source, text_field=text_field, split=split):
        if document.strip():
            documents.append(document)
        if max_documents is not None and len(documents) >= max_documents:
            break
    if not documents:
        raise ValueError(f"The text source {str(source)!r} holds no non-empty document.")
    return documents


def _clean_docstring(text: str) -> str:
    # Drop signature lines and doctest/code lines: keep prose paragraphs, joined into sentences.
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.splitlines()]
        if any(line.startswith((">>>", "...", "$ ")) for line in lines):
            continue
        joined = " ".join(line for line in lines if line)
        if len(joined) < 40 or not re.search(r"[.!?]$", joined) or re.match(r"^[\w.]+\(.*\)", joined):
            continue
        paragraphs.append(joined)
    return "\n\n".join(paragraphs)


_PYTHON_DOCS_CACHE: str | None = None


def python_docs_text() -> str:
    """Prose from the docstrings of the installed Python standard library, as one long document.

    Module, class and function docstrings of a fixed list of stdlib modules, in a fixed order, keeping
    only prose paragraphs (no signatures or doctests), each docstring once. About 400k characters on
    CPython 3.11 (roughly 90k tokens for a 49k-vocabulary BPE tokenizer). The text depends on the
    Python version only; it is read from the running interpreter, never stored in this repository.
    """
    global _PYTHON_DOCS_CACHE
    if _PYTHON_DOCS_CACHE is not None:
        return _PYTHON_DOCS_CACHE
    seen: set[str] = set()
    parts: list[str] = []

    def add(doc: str | None) -> None:
        if not doc:
            return
        cleaned = _clean_docstring(inspect.cleandoc(doc))
        if cleaned and cleaned not in seen:
            seen.add(cleaned)
            parts.append(cleaned)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in _PYTHON_DOC_MODULES:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # a module missing from this build (e.g. no sqlite3) is skipped
                continue
            add(module.__doc__)
            for name in sorted(vars(module)):
                if name.startswith("_"):
                    continue
                member = vars(module)[name]
                if getattr(member, "__module__", module_name) != module_name and module_name != "builtins":
                    continue
                if inspect.isclass(member) or inspect.isroutine(member):
                    add(getattr(member, "__doc__", None))
                    if inspect.isclass(member):
                        for attribute in sorted(vars(member)):
                            if not attribute.startswith("_"):
                                add(getattr(vars(member)[attribute], "__doc__", None))
    _PYTHON_DOCS_CACHE = "\n\n".join(parts)
    return _PYTHON_DOCS_CACHE


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences at ``.``, ``!`` or ``?`` followed by white space (each keeps its end)."""
    sentences = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        piece = text[start:end].strip()
        if piece:
            sentences.append(piece)
        start = end
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a whole document, without special tokens.

    Unlike ``tokenizer.encode(text)``, this does not log transformers' "Token indices sequence length is
    longer than the specified maximum sequence length" for a book longer than the model's window: a
    document is meant to be longer, and is cut into windows or sequences after this. A tokenizer whose
    ``encode`` takes no ``verbose`` flag is called without it.

    Args:
        tokenizer: a transformers tokenizer, or any object with ``encode(text, add_special_tokens=False)``.
        text: the document.
    """
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
    except TypeError:
        return list(tokenizer.encode(text, add_special_tokens=False))
