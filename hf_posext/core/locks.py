"""One writer per results folder.

A card, an evaluation grid or a training run goes on for hours and resumes from what its folder holds. Two runs
writing the same folder at once would each keep the cells they read at their start, and the later writer's files
would drop the other's newer cells without a word (two trainings would mix their checkpoints). A run therefore
holds a lock on its folder while it writes; a second run is refused in one line that names the first (process,
machine, start time, command) and the fix.

The lock is ``fcntl.flock`` on a file in the folder: the operating system releases it when the process ends,
however it ends, so a killed run never leaves a stale lock behind. Where ``fcntl`` does not exist (Windows) the
folder is not locked. ``flock`` locks are not shared between machines on some network file systems (older NFS):
there, two machines can still write one folder.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import shlex
import socket
import sys
import weakref
from pathlib import Path
from typing import IO, Callable, Iterator

__all__ = ["FolderBusyError", "LOCK_NAME", "FileWriterLock", "hold_folder", "hold_folder_on_main", "hold_parts", "folder_holder",
           "lock_name", "lock_file_writer"]

#: The lock file a writing run holds in its folder while it runs (its line says who holds it).
LOCK_NAME = ".hf-posext.lock"

try:
    import fcntl
except ImportError:  # Windows: no flock; folders are not locked there
    fcntl = None  # type: ignore[assignment]


class FolderBusyError(ValueError):
    """Another running process holds the folder's lock (the message names it and the fix)."""


def lock_name(part: str | None = None) -> str:
    """The lock file's name: :data:`LOCK_NAME` for the whole folder, one per ``part`` otherwise."""
    if part is None:
        return LOCK_NAME
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", part).strip("-.")[:80]
    digest = hashlib.sha1(part.encode()).hexdigest()[:8]  # two parts that slug alike keep two locks
    return f".hf-posext-{slug}-{digest}.lock"


def folder_holder(folder: str | os.PathLike, part: str | None = None) -> str:
    """What the lock file in ``folder`` says about the run that holds (or last held) it; ``""`` if nothing."""
    try:
        return (Path(folder) / lock_name(part)).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _holder_line() -> str:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    command = " ".join(shlex.quote(part) for part in sys.argv)[:300]
    return f"pid {os.getpid()} on {socket.gethostname()} since {started}: {command}"


@contextlib.contextmanager
def hold_folder(folder: str | os.PathLike, option: str = "--out", what: str = "the results",
                part: str | None = None) -> Iterator[Path]:
    """Hold ``folder``'s lock for the block: refuse at once if another process holds it.

    The folder is created if needed, and removed again if this call created it and the block left it empty (a
    run refused by a later check). The lock file is removed when the block ends.

    Args:
        folder: the folder the run writes.
        option: how the user gave it, named in the message.
        what: what the folder holds, for the message.
        part: lock only this part of the folder (e.g. ``"passkey smollm2-135m"``: the files of one task and
            model), so that runs writing other parts may run beside it; None locks the whole folder.

    Raises:
        FolderBusyError: another process holds the lock: the message names it and says to wait or give
            another folder.
    """
    folder = Path(folder).expanduser()
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / lock_name(part)
    if fcntl is None:
        yield folder
        return
    handle = _locked(path)
    if handle is None:
        holder = folder_holder(folder, part) or "another process"
        written = f"{option} {folder} is being written by another run" if part is None else \
            f"{option} {folder} is being written by another {part} run"
        raise FolderBusyError(f"{written} ({holder}); wait for it to finish, or give another {option} for {what}.")
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(_holder_line() + "\n")
        handle.flush()
        yield folder
    finally:
        # removed while still held: a run that opened it before can no longer lock it (_locked checks the
        # file it locked is the one at the path), so a finished run leaves no lock file behind
        path.unlink(missing_ok=True)
        handle.close()  # releases the lock
        if created:  # a run refused by a later check leaves no empty folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()


@contextlib.contextmanager
def hold_parts(folder: str | os.PathLike, parts: list[str], option: str = "--out",
               what: str = "the results") -> Iterator[Path]:
    """Hold the lock of each of ``parts`` of ``folder`` (:func:`hold_folder`) for the block: a run that writes the
    files of several tasks and models (the card's ``OUT/tasks``) holds the very parts that a run of one of them
    (``eval TASK --out OUT/tasks``) holds, so that either is refused while the other writes.

    Raises:
        FolderBusyError: another process holds one of the parts (the locks taken before it are released).
    """
    with contextlib.ExitStack() as stack:
        for part in dict.fromkeys(parts):
            stack.enter_context(hold_folder(folder, option, what, part=part))
        yield Path(folder).expanduser()


def hold_folder_on_main(stack: contextlib.ExitStack, folder: str | os.PathLike, option: str, what: str, *, main: bool,
                        share: Callable[[str], list[str]], part: str | None = None) -> None:
    """Hold ``folder``'s lock (:func:`hold_folder`) in the main process until ``stack`` closes; with several
    processes, every one raises the same one line when another run holds it, so that none waits at a barrier for
    a process that already stopped.

    Args:
        stack: holds the lock until it closes.
        folder, option, what, part: as for :func:`hold_folder`.
        main: whether this is the process that takes the lock.
        share: every process's refusal from this process's (``""`` when none): an all-gather over the processes,
            or ``lambda refusal: [refusal]`` for one process.

    Raises:
        FolderBusyError: another run holds the lock (in every process).
    """
    refusal = ""
    if main:
        try:
            stack.enter_context(hold_folder(folder, option, what, part=part))
        except FolderBusyError as error:
            refusal = str(error)
    refusal = next((text for text in share(refusal) if text), "")
    if refusal:
        raise FolderBusyError(refusal)


class FileWriterLock:
    """The lock one writer of a file holds (:func:`lock_file_writer`) until :meth:`release` (or until it is
    garbage-collected, or its process ends)."""

    def __init__(self, path: Path, handle: IO[str] | None) -> None:
        self.path = path
        self._handle = handle
        self._finalizer = weakref.finalize(self, _release, path, handle)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Give the lock up (its lock file removed); again: nothing."""
        self._finalizer()


def _release(path: Path, handle: IO[str] | None) -> None:
    if handle is None:
        return
    path.unlink(missing_ok=True)  # while still held, as hold_folder does
    handle.close()


def lock_file_writer(path: str | os.PathLike, option: str = "--out", what: str = "the results") -> FileWriterLock:
    """Take the writer's lock of the file ``path`` (a lock file beside it): one writer of a file at a time, in any
    process. ``flock`` locks are per open file, so a second writer is refused even in the same process.

    Raises:
        FolderBusyError: another writer holds it; the message names the file, the holder and the fix.
    """
    path = Path(path).expanduser()
    lock = path.parent / lock_name(f"file {path.name}")
    if fcntl is None:
        return FileWriterLock(lock, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = _locked(lock)
    if handle is None:
        holder = folder_holder(path.parent, f"file {path.name}") or "another process"
        raise FolderBusyError(f"{path} is being written by another run ({holder}); two writers of one results file would "
                              f"lose each other's cells: wait for it to finish, or give another {option} for {what}.")
    handle.seek(0)
    handle.truncate()
    handle.write(_holder_line() + "\n")
    handle.flush()
    return FileWriterLock(lock, handle)


def _locked(path: Path) -> IO[str] | None:
    """``path`` opened and locked by this process, or None when another process holds it."""
    for _ in range(10):
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()  # locked a file its holder had just removed: lock the one at the path now
    raise OSError(f"could not lock {path}: it keeps being replaced")
