"""The training loop end to end on the tiny recipe: outputs, loading, kill-and-resume, clipping, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.training_helpers import TINY_MODEL, load_safetensors, max_difference, tiny_config

import hf_posext
from hf_posext.training.config import ConfigError
from hf_posext.training.trainer import find_latest_checkpoint, lr_multiplier, train


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, one_thread):
    """One uninterrupted 12-step run of the tiny recipe (shared by several tests)."""
    out = tmp_path_factory.mktemp("runs") / "full"
    result = train(tiny_config(out), progress=False)
    return out, result


def test_tiny_recipe_end_to_end_writes_every_output(finished_run):
    out, result = finished_run
    assert result.finished and result.step == 12
    for name in ("train_config.yaml", "log.jsonl", "scaling.json", "train_result.json",
                 "adapter/adapter_model.safetensors", "adapter/trainable_extras.safetensors", "merged/config.json"):
        assert (out / name).exists(), name
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-00000004", "step-00000008", "step-00000012"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert all(r["tokens_per_second"] > 0 and r["lr"] > 0 for r in log)
    # warmup 2 steps then cosine: lr rises, peaks, decays
    assert log[0]["lr"] < log[1]["lr"] and log[-1]["lr"] < log[1]["lr"]
    # the model learns the synthetic ledger text: loss drops over 12 steps
    assert log[-1]["loss"] < log[0]["loss"] - 0.3
    scaling = json.loads((out / "scaling.json").read_text())
    assert scaling["method"] == "yarn" and scaling["current_window"] == 256


def test_merged_model_loads_with_hf_posext_and_stock_and_matches_adapter(finished_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_posext.training.lora import EXTRAS_FILE

    out, _ = finished_run
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    merged = hf_posext.load(out / "merged").eval()
    report = hf_posext.describe(merged)
    assert (report.method, report.factor, report.current_window) == ("yarn", 4.0, 256)
    stock = AutoModelForCausalLM.from_pretrained(out / "merged").eval()  # yarn is known to transformers

    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    hf_posext.patch(base, "yarn", 4)
    with torch.no_grad():
        base_logits = base(ids).logits
    adapted = PeftModel.from_pretrained(base, out / "adapter")
    parameters = dict(adapted.get_base_model().named_parameters())
    with torch.no_grad():
        for name, value in load_safetensors(out / "adapter" / EXTRAS_FILE).items():
            parameters[name].copy_(value)
        adapter_logits = adapted.eval()(ids).logits
        merged_logits = merged(ids).logits
        stock_logits = stock(ids).logits
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(stock_logits, merged_logits, atol=1e-5, rtol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-2  # training changed the model


def test_kill_and_resume_ends_with_the_same_weights(finished_run, tmp_path):
    full_out, _ = finished_run
    out = tmp_path / "interrupted"
    stopped = train(tiny_config(out), stop_at_step=6, progress=False)
    assert not stopped.finished and stopped.step == 6
    assert not (out / "adapter").exists()  # no final save on interruption
    assert find_latest_checkpoint(out).name == "step-00000004"  # steps 5-6 are lost, as in a crash
    resumed = train(tiny_config(out), resume=True, progress=False)
    assert resumed.finished and resumed.resumed_from.endswith("step-00000004")
    full = load_safetensors(full_out / "checkpoints" / "step-00000012" / "trainable.safetensors")
    again = load_safetensors(out / "checkpoints" / "step-00000012" / "trainable.safetensors")
    assert max_difference(full, again) <= 1e-6
    assert max_difference(load_safetensors(full_out / "adapter" / "adapter_model.safetensors"),
                          load_safetensors(out / "adapter" / "adapter_model.safetensors")) <= 1e-6
    # the log holds each step once, the resumed steps replacing the lost ones
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    full_log = [json.loads(line) for line in (full_out / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log] == pytest.approx([r["loss"] for r in full_log], abs=1e-6)


def test_resume_from_an_earlier_checkpoint_keeps_the_later_ones(finished_run, tmp_path):
    full_out, _ = finished_run
    out = tmp_path / "copy"
    shutil.copytree(full_out, out)
    original = load_safetensors(out / "checkpoints" / "step-00000008" / "trainable.safetensors")
    train(tiny_config(out, "train.max_steps=12"), resume=out / "checkpoints" / "step-00000004", stop_at_step=8, progress=False)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "step-00000008.superseded-1" in names and "step-00000008" in names  # nothing overwritten
    kept = load_safetensors(out / "checkpoints" / "step-00000008.superseded-1" / "trainable.safetensors")
    assert max_difference(kept, original) == 0.0


def test_gradient_clipping_really_clips(tmp_path):
    from accelerate import Accelerator

    from hf_posext.training.trainer import clip_gradients

    model = torch.nn.Linear(4, 4)
    (model(torch.randn(8, 4)) * 100).sum().backward()
    parameters = list(model.parameters())
    before = clip_gradients(Accelerator(cpu=True), parameters, max_norm=0.5)
    after = torch.stack([p.grad.norm() for p in parameters]).norm()
    assert before > 10 and float(after) == pytest.approx(0.5, rel=1e-5)


def test_lr_schedule_warmup_then_decay_to_floor():
    values = [lr_multiplier(s, 10, 2, "cosine", 0.1) for s in range(10)]
    assert values[:2] == [0.5, 1.0] and values[2] == 1.0
    assert all(a >= b for a, b in zip(values[2:], values[3:])) and values[-1] > 0.1
    assert lr_multiplier(10, 10, 2, "linear", 0.0) == 0.0
    assert lr_multiplier(7, 10, 2, "constant") == 1.0


def test_existing_output_folder_needs_overwrite(finished_run, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        train(tiny_config(out, "train.max_steps=1", "train.warmup_steps=0"), progress=False)
    with pytest.raises(FileExistsError, match="not a training run folder"):
        train(tiny_config(out, "train.max_steps=1", "train.warmup_steps=0"), overwrite=True, progress=False)
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_a_previous_run(tmp_path):
    out = tmp_path / "run"
    train(tiny_config(out, "train.max_steps=2", "train.warmup_steps=0", "output.checkpoint_every=1", "output.keep_last=1",
                      "output.save_merged=false"), progress=False)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]  # keep_last=1
    with pytest.raises(FileExistsError):
        train(tiny_config(out, "train.max_steps=2", "train.warmup_steps=0"), progress=False)
    result = train(tiny_config(out, "train.max_steps=2", "train.warmup_steps=0", "output.checkpoint_every=0", "output.save_merged=false"),
                   overwrite=True, progress=False)
    assert result.step == 2 and not (out / "checkpoints").exists()


def test_resume_with_a_different_config_is_refused(finished_run, tmp_path):
    full_out, _ = finished_run
    with pytest.raises(ConfigError, match=r"different config.*train\.learning_rate"):
        train(tiny_config(full_out, "train.learning_rate=0.1"), resume=True, progress=False)
    # output keys may change
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(tiny_config(tmp_path / "empty"), resume=True, progress=False)


def test_missing_data_and_lora_target_errors(tmp_path):
    from hf_posext.training.lora import LoraTargetError

    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny_config(tmp_path / "a", f"data.source={tmp_path}/no_such_books/"), progress=False)
    with pytest.raises(LoraTargetError, match=r"'q_projj' \(did you mean 'q_proj'\?\)"):
        train(tiny_config(tmp_path / "b", "finetune.target_modules=[q_projj, v_proj]"), progress=False)
    with pytest.raises(ConfigError, match=r"data.window \(32\) is longer than data.pose_target_length \(16\)"):
        train(tiny_config(tmp_path / "c", "data.pose_target_length=16"), progress=False)
    with pytest.raises(ConfigError, match="longer than the scaled window"):
        train(tiny_config(tmp_path / "d", "data.pose=false", "data.window=300"), progress=False)


def test_trackers_must_be_installed_when_asked(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(ImportError, match="pip install tensorboard"):
        train(tiny_config(tmp_path / "tb", "output.report_to=[tensorboard]"), progress=False)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_chunked_loss_trains_like_the_plain_loss(tmp_path, mode):
    """Same per-step losses and grad norms (1e-5 relative) with the chunked loss as with model(**batch).loss."""
    logs = {}
    for loss in ("plain", "chunked"):
        out = tmp_path / loss
        train(tiny_config(out, f"train.loss={loss}", "train.loss_chunk_size=13", "train.max_steps=3",
                          f"finetune.mode={mode}", "output.checkpoint_every=0"), progress=False)
        logs[loss] = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(logs["plain"]) == len(logs["chunked"]) == 3
    for plain, chunked in zip(logs["plain"], logs["chunked"]):
        for key in ("loss", "grad_norm"):
            assert abs(chunked[key] - plain[key]) <= 1e-5 * abs(plain[key]), (key, plain[key], chunked[key])
