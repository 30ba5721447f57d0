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


def _checkpoint(run, step: int, intact: bool = True):
    import json

    from hf_posext.training.checkpoints import write_checksums

    folder = run / f"checkpoint-{step}"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 4)
    write_checksums(folder)
    if not intact:
        (folder / "weights.bin").write_bytes(b"damaged")
    return folder


def test_the_older_intact_checkpoint_is_older_not_newer(tmp_path):
    from hf_posext.training.checkpoints import older_intact_checkpoint

    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3, intact=False)
    damaged = _checkpoint(tmp_path, 4, intact=False)
    _checkpoint(tmp_path, 6)  # newer and intact: not an "older" checkpoint
    (tmp_path / "logs").mkdir()  # not a checkpoint folder
    assert older_intact_checkpoint(damaged).name == "checkpoint-2"
    assert older_intact_checkpoint(tmp_path / "checkpoint-2") is None
