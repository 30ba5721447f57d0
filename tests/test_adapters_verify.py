"""An adapter folder's manifest follows the one rule of core/integrity (the checkpoints' too): only the top-level
``checksums.json`` is exempt; one in a subfolder is an ordinary file, listed and checked (adapters used to skip it
at any depth, so a file of that name below the top escaped the manifest)."""

from __future__ import annotations

import json

import pytest

from hf_posext.adapters import ADAPTER_CONFIG, MANIFEST_FILE, AdapterFileError, finish_adapter_folder, verify_adapter_files


def _adapter(tmp_path):
    folder = tmp_path / "adapter"
    (folder / "extra").mkdir(parents=True)
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    return folder


def test_a_checksums_file_added_in_a_subfolder_is_refused_as_unlisted(tmp_path):
    folder = _adapter(tmp_path)
    finish_adapter_folder(folder)
    (folder / "extra" / MANIFEST_FILE).write_text("{}")
    with pytest.raises(AdapterFileError, match=f"holds extra/{MANIFEST_FILE}, which {MANIFEST_FILE} does not list"):
        verify_adapter_files(folder)


def test_a_listed_checksums_file_in_a_subfolder_is_checked_like_any_file(tmp_path):
    folder = _adapter(tmp_path)
    (folder / "extra" / MANIFEST_FILE).write_text("{}")
    finish_adapter_folder(folder)
    assert f"extra/{MANIFEST_FILE}" in json.loads((folder / MANIFEST_FILE).read_text())["files"]
    (folder / "extra" / MANIFEST_FILE).write_text('{"edited": 1}')
    with pytest.raises(AdapterFileError, match=f"extra/{MANIFEST_FILE} does not match its sha256 in {MANIFEST_FILE}"):
        verify_adapter_files(folder)
