"""Sequence parallelism through OUR recipe path (recipe -> train() -> PosextTrainer), on 2 gloo CPU processes
launched with the shipped recipes/accelerate/deepspeed_ulysses_cpu_2proc.yaml: DeepSpeed Ulysses sp_size=2,
ZeRO-3, the tiny Llama at 256 tokens with PoSE position ids (spanning 1024 positions), the chunked loss.

* LoRA (with trained embeddings/norms, so the tied output head is trained too) and full fine-tuning: the loss
  and every gradient of an optimizer step of 2 micro-batches equal the 1-process run to float32 noise
  (GRADIENT_TOLERANCE). Full: the 1st step. LoRA: the 2nd (LoRA's B starts at zero, so every A gradient of the
  1st step is zero); the 1st optimizer step then also ran under ZeRO-3 on both sides. 4 processes (data
  parallel x sequence parallel) equal 1 process too.
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
# 2 optimizer steps of 2 micro-batches of one 256-token sequence; PoSE ids span [0, 1024); 48-token loss chunks.
COMPARE = ["finetune.dropout=0", "train.batch_size=1", "train.gradient_accumulation_steps=2",
           "train.max_grad_norm=null", "train.warmup_steps=0", "data.sequence_length=256", "scaling.factor=16",
           "output.checkpoint_every=0", "output.save_merged=false", "train.loss_chunk_size=48"]
# Float32 noise between 1 and 2 (or 4) processes measured up to 1.1e-6 relative on a gradient and ~1e-7 on the loss
# (docs/training.md); the effects guarded (a gradient off by sp_size, a rank's own shard loss in place of the
# group's, another sample order) are relative errors of order 1. ~100x room for other machines, 1e4x below them.
GRADIENT_TOLERANCE = 1e-4
LOSS_TOLERANCE = 1e-5


def _env():
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
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
    assert abs(got["loss"] - expected["loss"]) <= LOSS_TOLERANCE * abs(expected["loss"])
    assert set(got["grads"]) == set(expected["grads"]) and len(expected["grads"]) >= 10
    worst = {name: _relative(got["grads"][name], grad) for name, grad in expected["grads"].items()}
    print(f"{mode}: loss {got['loss']!r} vs {expected['loss']!r}, worst gradient {max(worst.values()):.2e} "
          f"({max(worst, key=worst.get)})")
    assert max(worst.values()) < GRADIENT_TOLERANCE, sorted(worst.items(), key=lambda item: -item[1])[:5]


@pytest.mark.multiprocess
def test_data_parallel_x_sequence_parallel_equals_one_process(tmp_path):
    """4 processes at sp_size=2: 2 sequence-parallel groups, data parallel over the groups. With accelerate told
    the data-parallel size (dp_shard_size=2) DeepSpeed accepts the batch (without it: `train_batch_size ... 2 !=
    1 * 2 * 2.0`) and the step's 4 sequences (one per process, each sharded over its group) give the gradients of
    1 process accumulating the same 4 sequences. The driver mends torch's gloo all-gather backward for a second
    group (on CPU the engine refuses this launch; GPUs use NCCL's reduce-scatter instead)."""
    pytest.importorskip("deepspeed")
    overrides = ["finetune.mode=lora", "train.max_steps=2", *COMPARE]
    _run([sys.executable, str(DRIVER), tmp_path / "one.pt", tmp_path / "one", *overrides,
          "train.gradient_accumulation_steps=4"])
    four = _launch_two(DRIVER, "--fix-gloo-subgroups", tmp_path / "sp.pt", tmp_path / "sp", *overrides, *SP)
    four[four.index("--config_file") + 2:four.index("--config_file") + 2] = ["--num_processes", "4"]
    _run(four)
    expected, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "sp.pt")
    assert (expected["steps"], got["steps"]) == (4, 2)  # micro-batches of the recorded step: 4 sequences either way
    assert abs(got["loss"] - expected["loss"]) <= LOSS_TOLERANCE * abs(expected["loss"])
    assert set(got["grads"]) == set(expected["grads"]) and len(expected["grads"]) >= 10
    worst = {name: _relative(got["grads"][name], grad) for name, grad in expected["grads"].items()}
    print(f"dp2 x sp2: loss {got['loss']!r} vs {expected['loss']!r}, worst gradient {max(worst.values()):.2e}")
    assert max(worst.values()) < GRADIENT_TOLERANCE, sorted(worst.items(), key=lambda item: -item[1])[:5]


def test_data_parallel_size_reaches_accelerate():
    """accelerate sets DeepSpeed's train_batch_size to micro x accumulation x data_parallel_size, which DeepSpeed
    checks against processes / sp_size: the ParallelismConfig must carry processes / sp_size."""
    from hf_posext.training.config import ParallelismSection
    from hf_posext.training.parallel import accelerate_parallelism_config

    request = ParallelismSection(sp_backend="deepspeed", sp_size=2)
    for processes, groups in ((2, 1), (4, 2), (16, 8)):
        config = accelerate_parallelism_config(request, num_processes=processes)
        assert (config.sp_size, config.data_parallel_size, config.total_size) == (2, groups, processes)


RESUME = ["train.max_steps=8", "train.batch_size=1", "train.gradient_accumulation_steps=1", "train.warmup_steps=1",
          "data.sequence_length=256", "scaling.factor=16", "output.checkpoint_every=2", "output.save_merged=false",
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


# --------------------------------------------------------------------------------------------------
# Bad input through the recipe path: one line, before any training starts, no output folder left
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, environ, message", [
    (["data.sequence_length=256", *SP], {"WORLD_SIZE": "3"}, "does not divide the 3 launched processes"),
    (["data.sequence_length=250", "parallelism.sp_backend=deepspeed", "parallelism.sp_size=4"], {"WORLD_SIZE": "4"},
     "does not divide the sequence length 250"),
    (["parallelism.cp_backend=torch", "parallelism.cp_size=2"], {"WORLD_SIZE": "2"}, "only on CUDA"),
    (["model.attn_implementation=eager", *SP], {"WORLD_SIZE": "2"}, "cannot shard attn_implementation='eager'"),
    (["model.attn_implementation=flex_attention", "data.pose=false", *SP], {"WORLD_SIZE": "2"}, "cannot shard"),
    ([*SP], {"WORLD_SIZE": "2", "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,zero3_init_flag"}, "sets zero_stage"),
    ([*SP], {"WORLD_SIZE": "2", "ACCELERATE_CONFIG_DS_FIELDS": "mixed_precision"}, "sets mixed_precision"),
    # data parallel x sequence parallel runs only on GPUs (torch's gloo all-gather backward fails in a 2nd group)
    (["data.sequence_length=256", *SP], {"WORLD_SIZE": "4"}, "2 sequence-parallel groups, which train only on GPUs"),
    # `accelerate launch --use_deepspeed --zero_stage 2`: the recipe's ZeRO-3 would silently win
    ([*SP], {"WORLD_SIZE": "2", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "sets DeepSpeed ZeRO stage 2 .* drop --zero_stage"),
    ([*SP], {"WORLD_SIZE": "2", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "--offload_optimizer_device=cpu"),
    ([*SP], {"WORLD_SIZE": "2", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, "--gradient_accumulation_steps=4"),
    ([], {"WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"},
     "parallelism_config sp_size=2 but the recipe has parallelism.sp_size=1"),
])
def test_bad_parallelism_is_refused_before_anything_starts(tmp_path, monkeypatch, overrides, environ, message):
    from hf_posext.training.config import ConfigError
    from hf_posext.training.trainer import train

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message) as error:
        train(tiny_config(out, *overrides), progress=False)
    assert "\n" not in str(error.value)
    assert not out.exists()


def test_deepspeed_command_line_that_agrees_with_the_recipe_passes():
    """--zero_stage 3 and offload 'none' say what the recipe does: accepted."""
    from hf_posext.training.config import ParallelismSection
    from hf_posext.training.parallel import check_launch_environment

    agreeing = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
                "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", "ACCELERATE_USE_DEEPSPEED": "true"}
    check_launch_environment(ParallelismSection(sp_backend="deepspeed", sp_size=2), agreeing)
    # without sequence parallelism the launch's own DeepSpeed settings are the run's: nothing to refuse
    check_launch_environment(ParallelismSection(), {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})


@pytest.mark.multiprocess
def test_a_refused_launch_prints_its_line_once(tmp_path):
    """`accelerate launch --zero_stage 2` beside the recipe's ZeRO-3 (which would win silently) on 2 processes:
    refused before anything is written, the line printed by local rank 0 only, and torch elastic's report (which
    a failed launch always prints) gives the refusal as its root cause."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    command = _launch_two(REPO / "recipes" / "finetune.py", "--config", TINY_RECIPE, f"model.name={TINY_MODEL}",
                          f"data.source={TINY_CORPUS}", f"output.dir={out}", "data.sequence_length=256", *SP,
                          "--no-progress")
    command[command.index("--config_file") + 2:command.index("--config_file") + 2] = ["--zero_stage", "2"]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    line = "finetune: error: accelerate launch sets DeepSpeed ZeRO stage 2"
    assert done.returncode != 0 and not out.exists(), output[-3000:]
    printed = [text for text in output.splitlines() if text.startswith(line)]
    assert len(printed) == 1, output[-3000:]  # once, by local rank 0 (it was once per rank)
    # the root cause is the refusal; no other rank failed with an exit code of its own (one still starting when
    # rank 0 left is stopped by the launcher and listed with SIGTERM: a race on a loaded machine)
    assert f"traceback : {line}" in output and output.count("exitcode  : 2 ") == 1, output[-3000:]
    assert "To enable traceback see" not in output


def test_sp_without_deepspeed_installed_is_refused(tmp_path, monkeypatch):
    import importlib.util

    from hf_posext.training.config import ConfigError
    from hf_posext.training.trainer import train

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"needs DeepSpeed: pip install 'hf-posext\[deepspeed\]'") as error:
        train(tiny_config(out, *SP), progress=False)
    assert "\n" not in str(error.value) and not out.exists()


@pytest.mark.parametrize("overrides, message", [
    ([*SP, "parallelism.zero_stage=2"], "only ZeRO stage 3 gives the right gradients"),  # the x2 trap
    (["parallelism.sp_backend=deepspeeed"], "Did you mean 'deepspeed'"),
    (["parallelism.cp_backend=troch"], "Did you mean 'torch'"),
    (["parallelism.sp_size=2"], "needs parallelism.sp_backend=deepspeed"),
    ([*SP, "parallelism.cp_backend=torch", "parallelism.cp_size=2"], "cannot both be > 1"),
    (["parallelism.sp_size=0"], "parallelism.sp_size must be >= 1"),
])
def test_parallelism_section_is_validated_with_the_recipe(tmp_path, overrides, message):
    from hf_posext.training.config import ConfigError

    with pytest.raises(ConfigError, match=message) as error:
        tiny_config(tmp_path / "run", *overrides)
    assert "\n" not in str(error.value)


def test_unknown_parallelism_key_suggests_the_closest():
    from hf_posext.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="Did you mean 'parallelism.sp_size'"):
        load_config(TINY_RECIPE, ["parallelism.sp_sise=2"])


def test_model_heads_must_divide_sp_size():
    from hf_posext.training.parallel import validate_sp_heads

    validate_sp_heads(2, 4, 2)
    validate_sp_heads(4, 4, 2)  # 2 key-value heads replicated over 4 ranks
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        validate_sp_heads(8, 4, 2)
    with pytest.raises(ValueError, match="3 key-value heads"):
        validate_sp_heads(2, 6, 3)


def test_recipe_maps_parallelism_onto_training_arguments(tmp_path, monkeypatch):
    """sp_size=2 gives the Trainer accelerate's ParallelismConfig (Ulysses, the model's attention) and a ZeRO-3
    DeepSpeed config without train_batch_size (which fails under SP); sp_size=1 gives neither."""
    pytest.importorskip("deepspeed")
    from hf_posext.training.parallel import deepspeed_config
    from hf_posext.training.trainer import parallelism_arguments

    config = tiny_config(tmp_path / "run", *SP)
    arguments = parallelism_arguments(config)
    parallelism = arguments["parallelism_config"]
    assert (parallelism.sp_size, parallelism.sp_backend, parallelism.sp_handler.sp_attn_implementation) == (2, "deepspeed", "sdpa")
    assert arguments["deepspeed"]["zero_optimization"]["stage"] == 3 and "train_batch_size" not in arguments["deepspeed"]
    assert arguments["ignore_data_skip"] is True
    assert parallelism_arguments(tiny_config(tmp_path / "run")) == {}
    assert deepspeed_config(config.parallelism)["zero_allow_untested_optimizer"] is True


def test_checkpoints_written_before_the_parallelism_section_still_resume(tmp_path):
    """A saved config without a `parallelism` section counts as its defaults; another sp_size is a difference."""
    from hf_posext.training.config import config_differences

    current = tiny_config(tmp_path / "run").to_dict()
    older = {k: v for k, v in current.items() if k != "parallelism"}
    assert config_differences(older, current) == []
    assert config_differences(older, tiny_config(tmp_path / "run", *SP).to_dict()) == [
        "parallelism.sp_backend: 'none' -> 'deepspeed'", "parallelism.sp_size: 1 -> 2"]
