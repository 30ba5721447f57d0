"""One atomic write: a file is replaced whole or not at all, through a temporary file of its own.

A fixed temporary name (``results.json.tmp``) is shared by every writer of the file: when two write at once, the
first's rename takes the second's temporary away and the second stops on ``[Errno 2]``. A temporary named by
:func:`tempfile.mkstemp` in the same folder belongs to one write only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | os.PathLike, text: str, *, newline: str | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file of its own in the same folder and a rename.

    Args:
        path: the file to write (its folder must exist).
        text: the whole content.
        newline: as for :func:`open` (``""`` for CSV).
    """
    path = Path(path)
    handle, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline=newline) as file:
            file.write(text)
        os.replace(staged, path)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise
