"""training/checkpoints.py: which checkpoint folder a run resumes from."""

from __future__ import annotations

from hf_posext.training.checkpoints import CHECKSUMS_FILE, find_latest_checkpoint


def test_latest_checkpoint_is_any_folder_by_default_and_a_finished_one_when_asked(tmp_path):
    for step in (2, 4, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / CHECKSUMS_FILE).write_text("{}")
    (tmp_path / "checkpoint-4" / CHECKSUMS_FILE).write_text("{}")  # checkpoint-10: its save did not finish
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-20").write_text("a file, not a checkpoint")
    assert find_latest_checkpoint(tmp_path).name == "checkpoint-10"  # by step, not by name: 10 > 4 > 2
    assert find_latest_checkpoint(tmp_path, complete=True).name == "checkpoint-4"
    assert find_latest_checkpoint(tmp_path / "missing") is None
    assert find_latest_checkpoint(tmp_path / "checkpoint-2") is None
