"""Sequence parallelism through OUR recipe path (recipe -> train() -> PosextTrainer), on 2 gloo CPU processes
launched with the shipped recipes/accelerate/deepspeed_ulysses_cpu_2proc.yaml: DeepSpeed Ulysses sp_size=2,
ZeRO-3, the tiny Llama at 256 tokens with PoSE position ids (spanning 1024 positions), the chunked loss.

* LoRA (with trained embeddings/norms, so the tied output head is trained too) and full fine-tuning: the loss
  and every gradient of an optimizer step of 2 micro-batches equal the 1-process run to 1e-6. Full: the 1st
  step. LoRA: the 2nd (LoRA's B starts at zero, so every A gradient of the 1st step is zero); the 1st
  optimizer step then also ran under ZeRO-3 on both sides.
* kill -9 mid-run and --resume with sp_size=2 end with the weights of an uninterrupted sp_size=2 run, bitwise,
  and the DeepSpeed checkpoint's files (both ranks) are covered by checksums.json.
* Bad parallelism input is refused through the recipe path in one line, before an output folder exists.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.training_helpers import REPO, TINY_CORPUS, TINY_MODEL, TINY_RECIPE, bitwise_equal, checkpoint_weights, tiny_config

DRIVER = REPO / "tests" / "sp_recipe_driver.py"
ACCELERATE_CONFIG = REPO / "recipes" / "accelerate" / "deepspeed_ulysses_cpu_2proc.yaml"
SP = ["parallelism.sp_backend=deepspeed", "parallelism.sp_size=2"]
# 2 optimizer steps of 2 micro-batches of one 256-token window; PoSE ids span [0, 1024); 48-token loss chunks.
COMPARE = ["finetune.dropout=0", "train.batch_size=1", "train.gradient_accumulation_steps=2",
           "train.max_grad_norm=null", "train.warmup_steps=0", "data.window=256", "scaling.factor=16",
           "output.checkpoint_every=0", "output.save_merged=false", "train.loss_chunk_size=48"]
TOLERANCE = 1e-6


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch_two(script, *arguments):
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
            "--main_process_port", str(_free_port()), str(script), *map(str, arguments)]


def _run(command):
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _relative(got, expected):
    scale = float(expected.abs().max())
    assert scale > 0, "a reference gradient is all zeros: the comparison would be vacuous"
    return float((got.reshape(expected.shape) - expected).abs().max()) / scale


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, steps", [("lora", 2), ("full", 1)])
def test_recipe_with_sp_size_2_equals_one_process(tmp_path, mode, steps):
    pytest.importorskip("deepspeed")
    overrides = [f"finetune.mode={mode}", f"train.max_steps={steps}", *COMPARE]
    _run([sys.executable, str(DRIVER), tmp_path / "one.pt", tmp_path / "one", *overrides])
    _run(_launch_two(DRIVER, tmp_path / "sp.pt", tmp_path / "sp", *overrides, *SP))
    expected, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "sp.pt")
    assert expected["steps"] == got["steps"] == 2  # micro-batches of the recorded step
    assert abs(got["loss"] - expected["loss"]) <= TOLERANCE * abs(expected["loss"])
    assert set(got["grads"]) == set(expected["grads"]) and len(expected["grads"]) >= 10
    worst = {name: _relative(got["grads"][name], grad) for name, grad in expected["grads"].items()}
    print(f"{mode}: loss {got['loss']!r} vs {expected['loss']!r}, worst gradient {max(worst.values()):.2e} "
          f"({max(worst, key=worst.get)})")
    assert max(worst.values()) < TOLERANCE, sorted(worst.items(), key=lambda item: -item[1])[:5]


RESUME = ["train.max_steps=8", "train.batch_size=1", "train.gradient_accumulation_steps=1", "train.warmup_steps=1",
          "data.window=256", "scaling.factor=16", "output.checkpoint_every=2", "output.save_merged=false",
          "train.loss_chunk_size=64", *SP]  # LoRA dropout 0.1 stays on: the RNG states must be restored too


def _finetune(out, *extra):
    return _launch_two(REPO / "recipes" / "finetune.py", "--config", TINY_RECIPE, f"model.name={TINY_MODEL}",
                       f"data.source={TINY_CORPUS}", f"output.dir={out}", *RESUME, "--no-progress", *extra)


def _kill_minus_9(process):
    """SIGKILL the launcher and both ranks (torch's elastic agent starts each rank in a session of its own)."""
    import psutil

    family = psutil.Process(process.pid).children(recursive=True)
    os.kill(process.pid, signal.SIGKILL)
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()
    psutil.wait_procs(family, timeout=30)


@pytest.mark.multiprocess
def test_sp_size_2_kill_minus_9_and_resume_is_bitwise(tmp_path):
    pytest.importorskip("deepspeed")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _run(_finetune(whole))
    assert json.loads((whole / "train_result.json").read_text())["step"] == 8

    process = subprocess.Popen(_finetune(killed), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    try:
        while not (killed / "checkpoint-2" / "checksums.json").exists():
            assert process.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.05)
    finally:
        _kill_minus_9(process)
    assert not (killed / "train_result.json").exists(), "the run finished before the kill: nothing was tested"

    assert not (killed / "checkpoint-8").exists(), sorted(p.name for p in killed.iterdir())
    checksums = json.loads((killed / "checkpoint-2" / "checksums.json").read_text())["files"]
    assert any("global_step2" in name and "zero_pp_rank_1" in name for name in checksums), sorted(checksums)
    resumed = _run(_finetune(killed, "--resume")).stdout
    resumed_from = re.search(r'"resumed_from": "[^"]*checkpoint-(\d+)"', resumed)
    assert resumed_from and int(resumed_from.group(1)) < 8, resumed[-2000:]
    final = sorted(whole.glob("checkpoint-*"))
    assert [p.name for p in final] == [p.name for p in sorted(killed.glob("checkpoint-*"))]
    assert bitwise_equal(checkpoint_weights(killed / "checkpoint-8"), checkpoint_weights(whole / "checkpoint-8"))
    assert bitwise_equal(checkpoint_weights(killed / "adapter"), checkpoint_weights(whole / "adapter"))
