"""The tiny recipe on 2 CPU processes (gloo, via `accelerate launch`) gives the weights one process gets
with the same global batch (kill-and-resume is tested single-process in test_training_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.training_helpers import REPO, TINY_CORPUS, TINY_MODEL, TINY_RECIPE, checkpoint_weights, max_difference, tiny_config

from hf_posext.training.trainer import train

pytestmark = pytest.mark.multiprocess

COMMON = ["finetune.dropout=0", "train.max_steps=4", "output.checkpoint_every=2", "output.save_merged=false"]


def _launch(out, *extra):
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
        "--main_process_port", "0", str(REPO / "recipes/finetune.py"), "--config", str(TINY_RECIPE),
        f"model.name={TINY_MODEL}", f"data.source={TINY_CORPUS}", f"output.dir={out}", "train.batch_size=1",
        *COMMON, "--no-progress", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    out = tmp_path / "two"
    _launch(out)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    run = json.loads((out / "checkpoint-2" / "posext_run.json").read_text())
    assert run["num_processes"] == 2 and run["samples_per_step"] == 2 * 2 * 1  # processes x accumulation x batch
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    checksums = json.loads((out / "checkpoint-2" / "checksums.json").read_text())["files"]
    assert "rng_state_1.pth" in checksums  # the second process's RNG state is written before the checksums

    # one process, 2 windows per micro-batch: the same global batches as 2 processes x 1 window
    single = tmp_path / "one"
    train(tiny_config(single, "train.batch_size=2", *COMMON), progress=False)
    a = checkpoint_weights(out / "checkpoint-4")
    b = checkpoint_weights(single / "checkpoint-4")
    losses = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    single_losses = [json.loads(line)["loss"] for line in (single / "log.jsonl").read_text().splitlines()]
    loss_error = max(abs(x - y) for x, y in zip(losses, single_losses))
    print(f"2 processes vs 1: weights differ by {max_difference(a, b):.2e}, losses by {loss_error:.2e}")
    assert max_difference(a, b) < 1e-5
    assert losses == pytest.approx(single_losses, abs=1e-5)


def test_two_processes_refuse_a_run_folder_another_run_holds_and_both_leave(tmp_path):
    """The main process holds output.dir; the refusal reaches the other process too (no rank waits for a partner that
    left), in one line, before any model loads."""
    from hf_posext.core.locks import LOCK_NAME, hold_folder

    out = tmp_path / "held"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
        "--main_process_port", "0", str(REPO / "recipes/finetune.py"), "--config", str(TINY_RECIPE),
        f"model.name={TINY_MODEL}", f"data.source={TINY_CORPUS}", f"output.dir={out}", "train.batch_size=1", *COMMON,
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with hold_folder(out, "output.dir", "the run"):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode != 0
        assert f"is being written by another run (pid {os.getpid()} " in done.stderr, done.stderr[-3000:]
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]
    assert not out.exists()
