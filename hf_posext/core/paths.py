"""Checks of the folders a command will write to, made before anything is loaded or written."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["check_output_folder", "replace_folder"]


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
