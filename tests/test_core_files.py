"""core/files.py: one atomic write, one staged folder, one refusal of a non-empty output folder."""

from __future__ import annotations

import os
import stat

import pytest

from hf_posext.core.files import atomic_path, refuse_non_empty_folder, staged_folder, write_json_atomic, write_text_atomic


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_atomic_write_replaces_the_file_whole_with_a_plain_mode(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")
    write_json_atomic(path, {"b": 1, "a": 2}, sort_keys=True, final_newline=True)
    assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'
    assert list(tmp_path.iterdir()) == [path]
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert _mode(path) == _mode(plain)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as staged:
            staged.write_text("half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]
    write_text_atomic(path, "new")
    assert path.read_text() == "new"


def test_a_staged_folder_replaces_its_destination_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("stale")
    with pytest.raises(RuntimeError):
        with staged_folder(out) as staged:
            (staged / "config.json").write_text("{}")
            raise RuntimeError("save failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "stale.txt").is_file()
    with staged_folder(out) as staged:
        (staged / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with staged_folder(out, merge=True) as staged:
        (staged / "tokenizer.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json"]


def test_a_non_empty_output_folder_is_refused_unless_overwrite(tmp_path):
    refuse_non_empty_folder(tmp_path / "new")
    refuse_non_empty_folder(tmp_path)  # empty
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=f"{tmp_path} exists and is not empty: choose a new folder or pass --overwrite."):
        refuse_non_empty_folder(tmp_path)
    refuse_non_empty_folder(tmp_path, overwrite=True)
