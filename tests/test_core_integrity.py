"""core/integrity.py: one manifest rule for every folder that carries ``checksums.json``, one stable digest, one
weights fingerprint."""

from __future__ import annotations

import json

import pytest
import torch

from hf_posext.core.errors import DamagedFileError
from hf_posext.core.integrity import (
    MANIFEST_FILE, json_digest, manifest_files, stable_digest, verify_manifest, weights_fingerprint, write_manifest,
)


def _folder(root):
    folder = root / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"\x00" * 8)
    (folder / "sub" / "state.pt").write_bytes(b"\x01" * 4)
    return folder


def test_the_manifest_rule_exempts_only_the_top_level_manifest_and_its_temporaries(tmp_path):
    """The one rule (a checkpoint's and an adapter's alike): a ``checksums.json`` below the top is an ordinary file,
    listed and checked; only the manifest itself, and a temporary of its atomic write, are left out."""
    folder = _folder(tmp_path)
    (folder / "sub" / MANIFEST_FILE).write_text("{}")
    (folder / f".{MANIFEST_FILE}.abc123.tmp").write_text("half")
    write_manifest(folder)
    assert manifest_files(folder) == sorted(["weights.bin", "sub/state.pt", f"sub/{MANIFEST_FILE}"])
    assert sorted(json.loads((folder / MANIFEST_FILE).read_text())["files"]) == manifest_files(folder)
    verify_manifest(folder)
    (folder / "sub" / MANIFEST_FILE).write_text('{"edited": true}')
    with pytest.raises(DamagedFileError, match=f"sub/{MANIFEST_FILE} does not match its sha256"):
        verify_manifest(folder)


def test_a_nested_manifest_added_after_the_manifest_was_written_is_refused(tmp_path):
    folder = _folder(tmp_path)
    write_manifest(folder)
    (folder / "sub" / MANIFEST_FILE).write_text("{}")
    with pytest.raises(ValueError, match=f"The run holds sub/{MANIFEST_FILE}, which {MANIFEST_FILE} does not list; "
                                         "remove it, or start again."):
        verify_manifest(folder, name="The run", fix="start again", error=ValueError)


@pytest.mark.parametrize("damage,expected", [
    (lambda folder: (folder / "weights.bin").unlink(), "is missing weights.bin"),
    (lambda folder: (folder / "weights.bin").write_bytes(b"edited"), "weights.bin does not match its sha256"),
    (lambda folder: (folder / MANIFEST_FILE).write_text('{"files": '), "checksums.json is unreadable"),
    (lambda folder: (folder / MANIFEST_FILE).write_text("[]"), "checksums.json is unreadable"),
])
def test_a_damaged_folder_is_refused_naming_the_file(tmp_path, damage, expected):
    folder = _folder(tmp_path)
    write_manifest(folder)
    damage(folder)
    with pytest.raises(DamagedFileError, match=expected):
        verify_manifest(folder)


def test_the_stable_digest_ignores_key_order_and_keeps_older_keys():
    assert stable_digest({"b": 1, "a": [1, 2]}) == stable_digest({"a": [1, 2], "b": 1})
    assert len(stable_digest({"a": 1})) == 16 and len(stable_digest({"a": 1}, length=8, algorithm="sha1")) == 8
    # a key written before the shared helper: sha1 of the sorted JSON, 8 hex digits
    import hashlib
    assert stable_digest({"x": 1}, length=8, algorithm="sha1") == hashlib.sha1(b'{"x": 1}').hexdigest()[:8]
    assert json_digest({"t": (1, 2)}) == json_digest({"t": [1, 2]})  # as it reads back from a JSON file


def test_the_weights_fingerprint_of_a_cast_equals_that_of_the_model_loaded_in_that_dtype():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    assert weights_fingerprint(model, torch.bfloat16) == weights_fingerprint(model.to(torch.bfloat16))
