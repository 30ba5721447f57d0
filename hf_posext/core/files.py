"""Writing files and folders whole or not at all: one atomic write, one staged folder, one refusal of a non-empty output.

A fixed temporary name (``results.json.tmp``) is shared by every writer of the file: when two write at once, the
first's rename takes the second's temporary away and the second stops on ``[Errno 2]``. A temporary named by
:func:`tempfile.mkstemp` in the same folder belongs to one write only. It is given the mode a plain ``open`` would
(``0o666`` less the umask), so a file written atomically reads like one written directly.

A folder (a merged model, an exported model, a converted adapter) is written into a staged folder beside its
destination and moved there in one rename (:func:`staged_folder`): a reader sees the old folder or the new one,
never a mix, and a failure leaves the destination as it was. Where a command writes is checked before anything is
loaded or written (:func:`check_output_folder`, :func:`refuse_non_empty_folder`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "atomic_path", "write_text_atomic", "write_json_atomic", "check_output_folder", "refuse_non_empty_folder",
    "replace_folder", "staged_folder",
]


def _umask() -> int:
    """The process's umask: read from ``/proc`` where there is one (setting it to read it would, for an instant, let
    another thread create a file any user may write), else set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


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
        os.chmod(staged, 0o666 & ~_umask())  # the mode open() gives; mkstemp gives 0o600
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


def replace_folder(staged: str | os.PathLike, out: str | os.PathLike) -> None:
    """Put the finished folder ``staged`` at ``out`` in one rename, replacing a folder there (a reader sees the old
    folder or the new one, never a mix); ``staged`` must sit on the same file system (beside ``out``)."""
    staged, out = Path(staged), Path(out)
    if out.exists():
        trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, trash / "old")
        os.replace(staged, out)
        shutil.rmtree(trash)
    else:
        os.replace(staged, out)


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
        umask = _umask()
        os.chmod(staged, 0o777 & ~umask)
        for path in staged.rglob("*"):
            if not path.is_symlink():
                os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if merge:
            out.mkdir(parents=True, exist_ok=True)
            for entry in staged.iterdir():
                os.replace(entry, out / entry.name)
        else:
            replace_folder(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def check_output_folder(path: str | os.PathLike, option: str = "--out", what: str = "the output") -> None:
    """Refuse an output folder that cannot be created or written into as a folder.

    Args:
        path: the folder a command will write (it may not exist yet).
        option: how the user gave it (``--out``, ``output.dir``), named in the message.
        what: what goes there, for the message (``the results``, ``the model``).

    Raises:
        ValueError: ``path`` is a file, or a folder above it is a file (so it cannot be created).
    """
    path = Path(path).expanduser()
    if path.is_file():
        raise ValueError(f"{option} {path} is a file; give a folder for {what} (new or existing).")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"{option} {path} cannot be created: {parent} is a file, not a folder. Give an {option} "
                    f"path under a folder (or move {parent} away)."
                )
            return


def refuse_non_empty_folder(out: str | os.PathLike, *, overwrite: bool = False, fix: str = "pass --overwrite") -> None:
    """Refuse to write over an existing non-empty ``out`` (or a file there) unless ``overwrite`` is set.

    Raises:
        FileExistsError: ``{out} exists and is not empty: choose a new folder or {fix}.``
    """
    out = Path(out)
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: choose a new folder or {fix}.")
