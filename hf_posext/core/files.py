"""Writing files and folders whole or not at all: one atomic write, one staged folder, one refusal of a non-empty output.

A fixed temporary name (``results.json.tmp``) is shared by every writer of the file: when two write at once, the
first's rename takes the second's temporary away and the second stops on ``[Errno 2]``. A temporary named by
:func:`tempfile.mkstemp` in the same folder belongs to one write only. It is given the mode a plain ``open`` would
(``0o666`` less the umask), so a file written atomically reads like one written directly.

A folder (a merged model, an exported model, a converted adapter) is written into a staged folder beside its
destination and moved there in one rename (:func:`staged_folder`): a reader sees the old folder or the new one,
never a mix, and a failure leaves the destination as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hf_posext.core.paths import replace_folder

__all__ = ["atomic_path", "write_text_atomic", "write_json_atomic", "staged_folder", "refuse_non_empty_folder"]


def _plain_mode(directory: bool = False) -> int:
    """The mode ``open``/``mkdir`` would give under the current umask (read without changing it for long)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that takes a path (``safetensors.torch.save_file``); when the
    block succeeds it is renamed onto ``path``, and on an error it is removed and ``path`` is left as it was.

    Example:
        >>> with atomic_path(folder / "adapter_model.safetensors") as staged:
        ...     save_file(weights, str(staged))
    """
    path = Path(path)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    staged = Path(name)
    try:
        yield staged
        os.chmod(staged, _plain_mode())
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, *, newline: str | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file of its own in the same folder and a rename.

    Args:
        path: the file to write (its folder must exist).
        text: the whole content.
        newline: as for :func:`open` (``""`` for CSV).
    """
    with atomic_path(path) as staged:
        with open(staged, "w", encoding="utf-8", newline=newline) as file:
            file.write(text)


def write_json_atomic(path: str | os.PathLike, data: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      final_newline: bool = False) -> None:
    """Write ``data`` as JSON (values JSON cannot hold as their ``str``) to ``path`` (:func:`write_text_atomic`)."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=str)
    write_text_atomic(path, text + ("\n" if final_newline else ""))


@contextmanager
def staged_folder(out: str | os.PathLike, *, merge: bool = False) -> Iterator[Path]:
    """A new folder beside ``out`` to write into; when the block succeeds it becomes ``out``.

    Args:
        out: the destination folder (its parent is created).
        merge: move each top-level entry into ``out`` (each by an atomic rename), keeping ``out``'s other files,
            instead of replacing ``out`` whole in one rename.

    The staged folder and its files are given the modes a folder made by hand would have. On an error it is
    removed and ``out`` is left as it was.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield staged
        os.chmod(staged, _plain_mode(directory=True))
        for path in staged.rglob("*"):
            if not path.is_symlink():
                os.chmod(path, _plain_mode(directory=path.is_dir()))
        if merge:
            out.mkdir(parents=True, exist_ok=True)
            for entry in staged.iterdir():
                os.replace(entry, out / entry.name)
        else:
            replace_folder(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def refuse_non_empty_folder(out: str | os.PathLike, *, overwrite: bool = False, fix: str = "pass --overwrite") -> None:
    """Refuse to write over an existing non-empty ``out`` (or a file there) unless ``overwrite`` is set.

    Raises:
        FileExistsError: ``{out} exists and is not empty: choose a new folder or {fix}.``
    """
    out = Path(out)
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: choose a new folder or {fix}.")
