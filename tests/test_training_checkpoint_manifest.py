"""A checkpoint's manifest (``checksums.json``) is the whole folder: a file it does not list is refused.

Wherever the file is (top level, a subfolder), whatever its name (one that extends a listed name, a dot
file, one named ``checksums.json`` itself below the top level) and even when empty.
"""

from __future__ import annotations

import json

import pytest

from hf_posext.training.checkpoints import CHECKSUMS_FILE, CheckpointError, verify_checkpoint, verify_for_resume, write_checksums


def _checkpoint(root, step: int = 4):
    folder = root / f"checkpoint-{step}"
    (folder / "rng").mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    (folder / "rng" / "rng_state_0.pth").write_bytes(b"\x01" * 16)
    write_checksums(folder)
    return folder


def test_an_intact_checkpoint_passes_and_lists_every_file(tmp_path):
    folder = _checkpoint(tmp_path)
    verify_checkpoint(folder)
    listed = json.loads((folder / CHECKSUMS_FILE).read_text())["files"]
    assert sorted(listed) == ["model.safetensors", "rng/rng_state_0.pth", "trainer_state.json"]


@pytest.mark.parametrize("extra", [
    "optimizer.pt",
    "model.safetensors.bak",        # extends a listed name
    "rng/rng_state_1.pth",          # in a subfolder
    ".hidden",                      # a dot file
    "rng/checksums.json",           # named like the manifest, but not the manifest
    "deep/er/file.bin",
])
@pytest.mark.parametrize("empty", [False, True])
def test_a_file_the_manifest_does_not_list_is_refused_naming_it(tmp_path, extra, empty):
    folder = _checkpoint(tmp_path)
    path = folder / extra
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"" if empty else b"unlisted bytes")
    with pytest.raises(CheckpointError, match=f"holds {extra}, which {CHECKSUMS_FILE} does not list"):
        verify_checkpoint(folder)
    with pytest.raises(CheckpointError, match="does not list.*No older checkpoint"):
        verify_for_resume(folder)


def test_the_unlisted_file_refusal_points_to_an_older_intact_checkpoint(tmp_path):
    older = _checkpoint(tmp_path, 2)
    newer = _checkpoint(tmp_path, 4)
    (newer / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=f"holds stray.bin.*{older.name} is intact"):
        verify_for_resume(newer)


def test_a_manifest_rewritten_after_the_file_was_added_lists_it(tmp_path):
    folder = _checkpoint(tmp_path)
    (folder / "rng" / "checksums.json").write_text("{}")
    write_checksums(folder)
    assert "rng/checksums.json" in json.loads((folder / CHECKSUMS_FILE).read_text())["files"]
    verify_checkpoint(folder)


def test_the_older_intact_checkpoint_may_be_the_step_just_before(tmp_path):
    """Steps 3 and 4 (saved every step): with 4 damaged, 3 is the way on; 4 itself never is."""
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3)
    newest = _checkpoint(tmp_path, 4)
    (newest / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="The older checkpoint-3 is intact"):
        verify_for_resume(newest)
