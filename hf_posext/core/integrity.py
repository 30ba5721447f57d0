"""Digests that tell content from an edit of it: of a file, of a folder (its manifest), of a value, of a model's weights.

- :func:`stable_digest`: a truncated hash of a value as sorted JSON, the key of a cache or record; :func:`json_digest`
  is the one a JSON file carries of its own content, checked when it is read back (a hand edit that keeps the file's
  key or name is caught).
- :func:`write_manifest` / :func:`verify_manifest`: ``checksums.json``, the sha256 of every other file of a folder
  (a checkpoint, an adapter), written last. One rule for which files it covers (:func:`manifest_files`): every file
  under the folder but the manifest itself at the top level (and its temporaries); a file named ``checksums.json``
  in a subfolder is an ordinary file, listed and checked like any other, so nothing below the top escapes it.
- :func:`weights_fingerprint`: a sha256 over every element of every parameter of a model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hf_posext.core.errors import DamagedFileError
from hf_posext.core.files import write_json_atomic

if TYPE_CHECKING:
    import torch

__all__ = [
    "stable_digest", "json_digest", "file_sha256", "MANIFEST_FILE", "manifest_files", "write_manifest",
    "verify_manifest", "FULL_WEIGHTS_PREFIX", "weights_fingerprint",
]

#: The manifest file of a folder: ``{"algorithm": "sha256", "files": {relative path: hex sha256}}``.
MANIFEST_FILE = "checksums.json"
#: Prefix of :func:`weights_fingerprint` (every element hashed).
FULL_WEIGHTS_PREFIX = "sha256-all:"


def stable_digest(value: Any, *, length: int | None = 16, algorithm: str = "sha256") -> str:
    """A hex digest of ``value`` as JSON with sorted keys (values JSON cannot hold as their ``str``), truncated.

    Args:
        value: what to digest.
        length: how many hex digits to keep (None: all).
        algorithm: a :func:`hashlib.new` name (keys stored by older releases keep the one they were made with).
    """
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.new(algorithm, text.encode()).hexdigest()[:length]


def json_digest(value: Any) -> str:
    """A short SHA-256 digest of ``value`` as canonical JSON (sorted keys; what it reads back as from a JSON file)."""
    return stable_digest(json.loads(json.dumps(value, default=str)))


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_files(folder: str | os.PathLike) -> list[str]:
    """Every file under ``folder`` the manifest covers, by relative path: all but the manifest itself at the top level
    and its temporaries (``.checksums.json.*``); a ``checksums.json`` in a subfolder is covered like any file."""
    folder = Path(folder)
    return sorted(
        str(path.relative_to(folder)) for path in folder.rglob("*")
        if path.is_file() and not (path.parent == folder
                                   and (path.name == MANIFEST_FILE or path.name.startswith(f".{MANIFEST_FILE}")))
    )


def write_manifest(folder: str | os.PathLike) -> Path:
    """Write ``folder/checksums.json``, the sha256 of every file :func:`manifest_files` lists, atomically.

    Returns:
        The manifest's path.
    """
    folder = Path(folder)
    sums = {name: file_sha256(folder / name) for name in manifest_files(folder)}
    path = folder / MANIFEST_FILE
    write_json_atomic(path, {"algorithm": "sha256", "files": sums})
    return path


def _listed_sums(folder: Path, name: str, fix: str, error: Callable[[str], Exception]) -> dict[str, str]:
    manifest = folder / MANIFEST_FILE
    try:
        listed = json.loads(manifest.read_text(encoding="utf-8")).get("files")
    except (UnicodeDecodeError, ValueError, AttributeError) as problem:
        detail = str(problem).splitlines()[0] if str(problem) else type(problem).__name__
        raise error(f"{name}: {manifest} is unreadable ({detail}); {fix}.") from None
    if not isinstance(listed, dict):
        raise error(f"{name}: {manifest} is unreadable (no files object); {fix}.")
    return listed


def verify_manifest(folder: str | os.PathLike, *, name: str | None = None, fix: str = "restore the folder",
                    error: Callable[[str], Exception] = DamagedFileError) -> None:
    """Refuse a folder whose files are not those its manifest lists: a listed file missing or with another sha256,
    or a file :func:`manifest_files` finds that the manifest does not list.

    Args:
        folder: a folder holding :data:`MANIFEST_FILE` (its absence is the caller's to judge).
        name: how a message names the folder (``The adapter runs/a/adapter``, ``Checkpoint OUT/checkpoint-4``).
        fix: what a message tells the user to do (``resume from another checkpoint``).
        error: the exception type raised, given the one-line message.

    Raises:
        ``error``: the manifest is unreadable, or names the first bad file.
    """
    folder = Path(folder)
    name = name or str(folder)
    listed = _listed_sums(folder, name, fix, error)
    for relative in sorted(listed):
        path = folder / relative
        if not path.is_file():
            raise error(f"{name} is missing {relative} (listed in {MANIFEST_FILE}); {fix}.")
        if file_sha256(path) != listed[relative]:
            raise error(f"{name}: {path} does not match its sha256 in {MANIFEST_FILE} (corrupt, truncated or edited); "
                        f"{fix}.")
    unlisted = sorted(set(manifest_files(folder)) - set(listed))
    if unlisted:
        raise error(f"{name} holds {unlisted[0]}, which {MANIFEST_FILE} does not list; remove it, or {fix}.")


def weights_fingerprint(model: Any, dtype: torch.dtype | None = None) -> str:
    """``sha256-all:`` + a sha256 over the model's parameters: names, shapes, dtypes and every byte of every value.

    A change of any one element changes it. Each parameter is copied to the CPU in turn (peak extra memory:
    the largest parameter). Cost on a SmolLM2-135M-shaped model (134.5M parameters) on a shared 2-core CPU
    at load average 9.7: 0.77 s in float32, 0.37 s in bfloat16 (``bench/weights_fingerprint_cost.py``).
    Computed on the unpatched model (a learned position table rescaled by a method is a parameter too).
    Parameters on the meta device (offloaded) count by name, shape and dtype alone.

    Args:
        model: anything with ``named_parameters()``.
        dtype: hash the floating-point parameters cast to this dtype, one at a time (what loading the same files
            in it gives); None: as they are.
    """
    import torch

    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        if dtype is not None and parameter.is_floating_point():
            parameter = parameter.detach().to(dtype)
        digest.update(f"{name}|{tuple(parameter.shape)}|{parameter.dtype}|".encode())
        if parameter.device.type == "meta" or parameter.numel() == 0:
            continue
        data = parameter.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        digest.update(data.numpy())
    return FULL_WEIGHTS_PREFIX + digest.hexdigest()
