"""One writer per results folder (``hf_posext.core.locks``), and the commands that hold it: a second card or
evaluation run into a folder another run is writing is refused in one line naming that run, before anything
loads, and nothing of the first run's folder changes. A killed holder releases the folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hf_posext.core.locks import LOCK_NAME, FolderBusyError, hold_folder

pytest.importorskip("fcntl")

TINY = str(Path(__file__).parent / "data" / "training" / "tiny-llama")


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / "held"`` (started by ``hf-posext``-like argv), killed at the end."""
    folder = tmp_path / "held"
    script = ("import sys, time\nfrom hf_posext.core.locks import hold_folder\n"
              "with hold_folder(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n")
    process = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield folder, process
    if process.poll() is None:
        process.kill()
    process.wait()


def test_a_second_writer_is_refused_naming_the_first(holder):
    folder, process = holder
    with pytest.raises(FolderBusyError) as refused:
        with hold_folder(folder, "--out", "the card"):
            raise AssertionError("entered a folder another process holds")
    message = str(refused.value)
    assert f"pid {process.pid} on " in message and "since " in message and "-c" in message, message
    assert "wait for it to finish, or give another --out for the card" in message and "\n" not in message
    assert (folder / LOCK_NAME).exists()  # the refused run did not remove the holder's lock file


def test_a_killed_holder_releases_the_folder(holder):
    folder, process = holder
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    with hold_folder(folder) as held:  # the operating system released the lock with the process
        assert held == folder
        assert f"pid {os.getpid()} " in (folder / LOCK_NAME).read_text()
    assert not (folder / LOCK_NAME).exists()


def test_a_finished_run_leaves_its_folder_as_it_wrote_it(tmp_path):
    out = tmp_path / "out"
    with hold_folder(out):
        (out / "results.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    with hold_folder(out):  # and the next run takes it
        pass
    # a run refused inside the block leaves no folder it created
    with pytest.raises(ValueError, match="refused"):
        with hold_folder(tmp_path / "new" / "card"):
            raise ValueError("refused by a later check")
    assert not (tmp_path / "new" / "card").exists()


def test_the_same_process_cannot_hold_a_folder_twice(tmp_path):
    # two runs in one process (a notebook calling the card twice from threads) are refused like two processes
    with hold_folder(tmp_path / "out"):
        with pytest.raises(FolderBusyError):
            with hold_folder(tmp_path / "out"):
                pass


def test_eval_into_a_held_folder_is_refused_before_loading(holder, capsys, monkeypatch):
    from hf_posext.cli import main
    import hf_posext.evaluation.loading as loading

    folder, process = holder
    (folder / "kept.json").write_text("{}")

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded into a folder another run holds")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
    argv = ["eval", "passkey", "--model", TINY, "--methods", "none", "--lengths", "320", "--depths", "0.5", "--trials", "1",
            "--no-generate", "--out", str(folder), "--no-progress"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert f"is being written by another run (pid {process.pid} " in error and len(error.splitlines()) == 1, error
    assert sorted(p.name for p in folder.iterdir()) == sorted([LOCK_NAME, "kept.json"])


def test_card_into_a_held_folder_is_refused_before_loading(holder, capsys, monkeypatch):
    from hf_posext.cli import main
    import hf_posext.integrations.lm_eval.card as card

    folder, process = holder

    def no_rows(*args, **kwargs):
        raise AssertionError("the card went on into a folder another run holds")

    monkeypatch.setattr(card, "_rows", no_rows)
    code = main(["eval", "card", "--models", TINY, "--methods", "none", "--tasks", "perplexity", "--lengths", "64",
                 "--samples", "1", "--out", str(folder), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and f"(pid {process.pid} " in error and "another --out for the card" in error, error
    assert [p.name for p in folder.iterdir()] == [LOCK_NAME]
