"""One writer per results folder (``hf_posext.core.locks``), and the commands that hold it: a second card run, or a
second evaluation of the same task and model, into a folder another run is writing is refused in one line naming
that run, before anything loads, and nothing of the first run's folder changes. A killed holder releases the
folder."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hf_posext.core.locks import LOCK_NAME, FolderBusyError, hold_folder, hold_folder_on_main, lock_name

pytest.importorskip("fcntl")

TINY = str(Path(__file__).parent / "data" / "training" / "tiny-llama")


def hold_in_another_process(folder: Path, part: str | None = None) -> subprocess.Popen:
    """Another process holding ``folder`` (or its ``part``) until killed."""
    script = ("import sys, time\nfrom hf_posext.core.locks import hold_folder\n"
              "with hold_folder(sys.argv[1], part=sys.argv[2] or None):\n    print('held', flush=True)\n    time.sleep(600)\n")
    process = subprocess.Popen([sys.executable, "-c", script, str(folder), part or ""], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / "held"``, killed at the end."""
    folder = tmp_path / "held"
    process = hold_in_another_process(folder)
    yield folder, process
    if process.poll() is None:
        process.kill()
    process.wait()


def test_a_second_writer_is_refused_naming_the_first(holder):
    folder, process = holder
    with pytest.raises(FolderBusyError) as refused:
        with hold_folder(folder, "--out", "the suite"):
            raise AssertionError("entered a folder another process holds")
    message = str(refused.value)
    assert f"pid {process.pid} on " in message and "since " in message and "-c" in message, message
    assert "wait for it to finish, or give another --out for the suite" in message and "\n" not in message
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


def test_parts_of_a_folder_are_held_apart(tmp_path):
    with hold_folder(tmp_path / "out", part="passkey m"):
        with hold_folder(tmp_path / "out", part="needle m"):  # another part: goes on
            with pytest.raises(FolderBusyError, match="another passkey m run"):
                with hold_folder(tmp_path / "out", part="passkey m"):
                    pass
    assert lock_name("a/b c") != lock_name("a b/c") and lock_name("a/b c").startswith(".hf-posext-a-b-c-")
    assert not (tmp_path / "out").exists()


def test_on_main_every_process_raises_the_main_processs_refusal(holder):
    folder, process = holder
    shared: list[str] = []

    def share(refusal: str) -> list[str]:  # two processes: what the main one found, then this one's
        shared.append(refusal)
        return [shared[0], refusal]

    for main in (True, False):  # the main process finds the folder held; the other learns it from the gather
        with contextlib.ExitStack() as stack, pytest.raises(FolderBusyError, match=f"pid {process.pid} on "):
            hold_folder_on_main(stack, folder, "output.dir", "the run", main=main, share=share)
    assert shared[0] and shared[1] == ""  # only the main process tried the lock
    with contextlib.ExitStack() as stack:  # free folder: the main process holds it until the stack closes
        hold_folder_on_main(stack, folder.parent / "free", "--out", "the suite", main=True, share=lambda r: [r])
        assert (folder.parent / "free" / LOCK_NAME).exists()
    assert not (folder.parent / "free").exists()


def test_eval_of_a_task_and_model_another_run_is_writing_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """Each task and model writes files of its own: a passkey run beside a perplexity run into one folder is fine, a
    second passkey run of the same model is refused."""
    from hf_posext.cli import main
    import hf_posext.evaluation.loading as loading

    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "kept.json").write_text("{}")
    process = hold_in_another_process(folder, f"passkey {TINY}")
    try:
        def no_loading(*args, **kwargs):
            raise AssertionError("the model was loaded for a task and model another run is writing")

        monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
        argv = ["eval", "passkey", "--model", TINY, "--methods", "none", "--lengths", "320", "--depths", "0.5", "--trials", "1",
                "--no-generate", "--out", str(folder), "--no-progress"]
        assert main(argv) == 2
        error = capsys.readouterr().err.strip()
        assert f"is being written by another passkey {TINY} run (pid {process.pid} " in error, error
        assert len(error.splitlines()) == 1
        assert sorted(p.name for p in folder.iterdir()) == sorted([lock_name(f"passkey {TINY}"), "kept.json"])
        # another task of the same model goes on beside it (it reaches the loading, stubbed here)
        assert main(["eval", "perplexity", "--model", TINY, "--methods", "none", "--lengths", "64", "--out", str(folder),
                     "--no-progress"]) == 1
        assert "the model was loaded" in capsys.readouterr().err
    finally:
        process.kill()
        process.wait()


def test_card_into_a_held_folder_is_refused_before_loading(holder, capsys, monkeypatch):
    from hf_posext.cli import main
    import hf_posext.card.run as card

    folder, process = holder

    def no_rows(*args, **kwargs):
        raise AssertionError("the card went on into a folder another run holds")

    monkeypatch.setattr(card, "card_model_rows", no_rows)
    code = main(["eval", "suite", "--models", TINY, "--methods", "none", "--tasks", "perplexity", "--lengths", "64",
                 "--trials", "1", "--out", str(folder), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and f"(pid {process.pid} " in error and "another --out for the suite" in error, error
    assert [p.name for p in folder.iterdir()] == [LOCK_NAME]


def test_a_card_and_an_eval_writing_one_tasks_folder_refuse_each_other_before_loading(tmp_path, capsys, monkeypatch):
    """The card writes its perplexity, passkey and needle results into OUT/tasks, where an ``eval passkey --out
    OUT/tasks`` of the same model writes the same files: the card holds those parts of OUT/tasks as the eval does, so
    that whichever starts second is refused (before, both ran and one run's cells were lost)."""
    from hf_posext.cli import main
    import hf_posext.evaluation.loading as loading
    import hf_posext.card.run as card

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded for results another run is writing")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
    out = tmp_path / "card"
    card_argv = ["eval", "suite", "--models", TINY, "--methods", "none", "--tasks", "passkey", "--lengths", "320",
                 "--trials", "1", "--out", str(out), "--no-progress"]
    eval_argv = ["eval", "passkey", "--model", TINY, "--methods", "none", "--lengths", "320", "--depths", "0.5",
                 "--trials", "1", "--no-generate", "--out", str(out / "tasks"), "--no-progress"]
    process = hold_in_another_process(out / "tasks", f"passkey {TINY}")  # an eval of the card's task and model
    try:
        monkeypatch.setattr(card, "card_model_rows", lambda *a, **k: pytest.fail("the card went on"))
        assert main(card_argv) == 2
        error = capsys.readouterr().err.strip()
        assert f"is being written by another passkey {TINY} run (pid {process.pid} " in error, error
        assert len(error.splitlines()) == 1
    finally:
        process.kill()
        process.wait()
    refusals = []

    def eval_beside(*args, **kwargs):  # while the card holds its folder, an eval of its task and model starts
        refusals.append((main(eval_argv), capsys.readouterr().err.strip()))
        return 0

    monkeypatch.setattr(card, "run_in_folder", eval_beside)
    assert main(card_argv) == 0
    ((code, error),) = refusals
    assert code == 2 and f"is being written by another passkey {TINY} run (pid {os.getpid()} " in error, error
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["tasks"], left  # the folder the killed holder made; no lock file left behind
