"""The Trainer-based engine end to end on the tiny recipe: outputs, loading, kill-and-resume, checkpoint
integrity, schedule mapping, errors (and no output folder left by bad input)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.training_helpers import TINY_MODEL, bitwise_equal, checkpoint_weights, max_difference, tiny_config

import hf_posext
from hf_posext.training.config import ConfigError
from hf_posext.training.checkpoints import CheckpointError
from hf_posext.training.trainer import find_latest_checkpoint, train, training_arguments


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
                 "adapter/adapter_model.safetensors", "adapter/checksums.json", "merged/config.json"):
        assert (out / name).exists(), name
    steps = sorted(p.name for p in out.glob("checkpoint-*"))
    assert steps == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    for step in steps:
        assert {"checksums.json", "posext_run.json", "trainer_state.json", "adapter_model.safetensors",
                "trainable_extras.safetensors", "optimizer.pt"} <= {p.name for p in (out / step).iterdir()}
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert all(r["tokens_per_second"] > 0 for r in log) and all(r["lr"] > 0 for r in log[1:])
    assert log[0]["lr"] == 0.0  # the Trainer's warmup starts from 0
    # warmup 2 steps then cosine: lr rises, peaks, decays
    assert log[0]["lr"] < log[1]["lr"] and log[-1]["lr"] < log[1]["lr"]
    # the model learns the synthetic ledger text: loss drops over 12 steps
    assert log[-1]["loss"] < log[0]["loss"] - 0.3
    scaling = json.loads((out / "scaling.json").read_text())
    assert scaling["method"] == "yarn" and scaling["current_window"] == 256
    # vLLM caps its length at the tokenizer's model_max_length (docs/serving.md)
    assert json.loads((out / "merged" / "tokenizer_config.json").read_text())["model_max_length"] == 256


def test_merged_model_loads_with_hf_posext_and_stock_and_matches_adapter(finished_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

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
    adapted = PeftModel.from_pretrained(base, out / "adapter")  # stock PEFT: LoRA + the trained norms/embeddings
    with torch.no_grad():
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
    assert find_latest_checkpoint(out).name == "checkpoint-4"  # steps 5-6 are lost, as in a crash
    resumed = train(tiny_config(out), resume=True, progress=False)
    assert resumed.finished and resumed.resumed_from.endswith("checkpoint-4")
    # bitwise on CPU: adapter and the trained embeddings/norms, in the checkpoint and the final save
    assert bitwise_equal(checkpoint_weights(full_out / "checkpoint-12"), checkpoint_weights(out / "checkpoint-12"))
    assert bitwise_equal(checkpoint_weights(full_out / "adapter"), checkpoint_weights(out / "adapter"))
    # and the run really trained the extras (the comparison above is not between untouched weights)
    start = checkpoint_weights(full_out / "checkpoint-4")
    assert not bitwise_equal(start, checkpoint_weights(full_out / "checkpoint-12"))
    # the log holds each step once, the resumed steps replacing the lost ones
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    full_log = [json.loads(line) for line in (full_out / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in log] == pytest.approx([r["loss"] for r in full_log], abs=1e-6)


def test_resume_from_an_earlier_checkpoint_keeps_the_later_ones(finished_run, tmp_path):
    full_out, _ = finished_run
    out = tmp_path / "copy"
    shutil.copytree(full_out, out)
    original = checkpoint_weights(out / "checkpoint-8")
    train(tiny_config(out, "train.max_steps=12"), resume=out / "checkpoint-4", stop_at_step=8, progress=False)
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-8.superseded-1" in names and "checkpoint-8" in names  # nothing overwritten
    assert bitwise_equal(checkpoint_weights(out / "checkpoint-8.superseded-1"), original)


def test_recipe_maps_onto_training_arguments_and_the_schedule(tmp_path):
    from transformers import get_scheduler

    config = tiny_config(tmp_path / "args", "train.max_steps=10", "train.warmup_steps=2", "train.min_lr_ratio=0.1",
                         "train.max_grad_norm=0.5", "output.checkpoint_every=3", "output.keep_last=2")
    args = training_arguments(config, tmp_path / "args", progress=False)
    assert (args.max_steps, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (10, 2, 2)
    assert (args.max_grad_norm, args.save_steps, args.save_total_limit, args.seed) == (0.5, 3, 2, 0)
    assert (args.adam_beta1, args.adam_beta2, args.learning_rate) == (0.9, 0.95, 5e-3)
    assert args.use_cpu and not args.bf16 and args.report_to == []
    assert not (tmp_path / "args").exists()  # building the arguments writes nothing
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                              num_training_steps=args.max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    values = []
    for _ in range(11):
        values.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert values[:3] == pytest.approx([0.0, 0.5, 1.0])  # linear warmup
    assert all(a >= b for a, b in zip(values[2:], values[3:]))  # then cosine decay ...
    assert values[-1] == pytest.approx(0.1)  # ... to the floor
    no_clip = training_arguments(tiny_config(tmp_path / "n", "train.max_grad_norm=null"), tmp_path / "n", progress=False)
    assert no_clip.max_grad_norm == 0.0  # the Trainer's "no clipping"
    with pytest.raises(ConfigError, match="linear"):
        training_arguments(tiny_config(tmp_path / "l", "train.lr_schedule=linear", "train.min_lr_ratio=0.1"), tmp_path / "l")


def _copy_checkpoint(finished_run, tmp_path, step=4):
    full_out, _ = finished_run
    out = tmp_path / "copy"
    out.mkdir()
    shutil.copy(full_out / "train_config.yaml", out / "train_config.yaml")
    shutil.copytree(full_out / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out, out / f"checkpoint-{step}"


def test_resume_refuses_a_checkpoint_with_flipped_bytes(finished_run, tmp_path):
    out, checkpoint = _copy_checkpoint(finished_run, tmp_path)
    weights = checkpoint / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors does not match its sha256"):
        train(tiny_config(out), resume=True, progress=False)
    assert not (out / "log.jsonl").exists() and sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "train_config.yaml"]


def test_resume_refuses_an_edited_global_step_and_missing_checksums(finished_run, tmp_path):
    from hf_posext.training.checkpoints import write_checksums

    out, checkpoint = _copy_checkpoint(finished_run, tmp_path)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["global_step"] = 8
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"trainer_state\.json does not match its sha256"):
        train(tiny_config(out), resume=True, progress=False)
    write_checksums(checkpoint)  # even with matching checksums, the step must agree with the folder
    with pytest.raises(CheckpointError, match=r"global_step=8, but the folder name says step 4"):
        train(tiny_config(out), resume=True, progress=False)
    (checkpoint / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no checksums\.json: its save did not finish"):
        train(tiny_config(out), resume=checkpoint, progress=False)
    # --resume without a path skips an unfinished save (a run killed while saving) for the previous complete one
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        train(tiny_config(out), resume=True, progress=False)
    shutil.copytree(finished_run[0] / "checkpoint-8", out / "checkpoint-8")
    (out / "checkpoint-8" / "checksums.json").unlink()
    shutil.copytree(finished_run[0] / "checkpoint-4", out / "checkpoint-2")  # any complete earlier one
    shutil.rmtree(out / "checkpoint-4")
    with pytest.raises(CheckpointError, match=r"checkpoint-2.*global_step=4, but the folder name says step 2"):
        train(tiny_config(out), resume=True, progress=False)


def _fake_checkpoint(folder, step):
    from hf_posext.training.checkpoints import write_checksums

    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(step, step + 16)))
    write_checksums(folder)
    return folder


def test_a_damaged_newest_checkpoint_names_the_older_intact_one_and_its_command(tmp_path):
    # Was: a truncated checksums.json stopped --resume without saying checkpoint-4 was still good
    from hf_posext.training.checkpoints import verify_for_resume

    run = tmp_path / "run"
    intact = _fake_checkpoint(run / "checkpoint-4", 4)
    damaged_older = _fake_checkpoint(run / "checkpoint-6", 6)
    (damaged_older / "adapter_model.safetensors").write_bytes(b"edited")
    newest = _fake_checkpoint(run / "checkpoint-8", 8)
    sums = newest / "checksums.json"
    sums.write_bytes(sums.read_bytes()[:20])  # cut short, as by a full disk
    with pytest.raises(CheckpointError) as caught:
        verify_for_resume(newest)
    message = str(caught.value)
    assert "checkpoint-8/checksums.json is unreadable" in message and "\n" not in message
    assert message.endswith(f"The older checkpoint-4 is intact: resume from it with `hf-posext train --resume {intact}`.")
    shutil.rmtree(intact)
    with pytest.raises(CheckpointError, match=rf"No older checkpoint in {run} is intact either\.$"):
        verify_for_resume(newest)


def test_resume_from_a_damaged_newest_checkpoint_says_how_to_resume_from_the_older_one(finished_run, tmp_path):
    out, older = _copy_checkpoint(finished_run, tmp_path)
    shutil.copytree(finished_run[0] / "checkpoint-8", out / "checkpoint-8")
    sums = out / "checkpoint-8" / "checksums.json"
    sums.write_bytes(sums.read_bytes()[:30])
    with pytest.raises(CheckpointError, match=rf"The older checkpoint-4 is intact: resume from it with `hf-posext train --resume {older}`"):
        train(tiny_config(out), resume=True, progress=False)
    assert not (out / "log.jsonl").exists()


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
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # keep_last=1
    with pytest.raises(FileExistsError):
        train(tiny_config(out, "train.max_steps=2", "train.warmup_steps=0"), progress=False)
    result = train(tiny_config(out, "train.max_steps=2", "train.warmup_steps=0", "output.checkpoint_every=0", "output.save_merged=false"),
                   overwrite=True, progress=False)
    assert result.step == 2 and not list(out.glob("checkpoint-*"))


def test_resume_with_a_different_config_is_refused(finished_run, tmp_path):
    full_out, _ = finished_run
    with pytest.raises(ConfigError, match=r"different config.*train\.learning_rate"):
        train(tiny_config(full_out, "train.learning_rate=0.1"), resume=True, progress=False)
    # output keys may change
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(tiny_config(tmp_path / "empty"), resume=True, progress=False)


def _spell_sequence_length_as_window(run_folder):
    """Make ``run_folder`` look written before ``data.sequence_length`` was renamed from ``data.window``:
    its ``train_config.yaml`` and every checkpoint's run record use the former key (checksums rewritten)."""
    import yaml

    from hf_posext.training.checkpoints import RUN_FILE, write_checksums

    def former(config: dict) -> dict:
        config["data"] = {("window" if k == "sequence_length" else k): v for k, v in config["data"].items()}
        return config

    saved = run_folder / "train_config.yaml"
    saved.write_text(yaml.safe_dump(former(yaml.safe_load(saved.read_text())), sort_keys=False))
    for checkpoint in run_folder.glob("checkpoint-*"):
        record = json.loads((checkpoint / RUN_FILE).read_text())
        record["config"] = former(record["config"])
        (checkpoint / RUN_FILE).write_text(json.dumps(record))
        write_checksums(checkpoint)


def test_a_run_folder_saved_with_the_former_data_window_key_still_resumes(finished_run, tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.trainer import load_run_config

    full_out, _ = finished_run
    out = tmp_path / "before_the_rename"
    shutil.copytree(full_out, out)
    _spell_sequence_length_as_window(out)
    assert "window: 32" in (out / "train_config.yaml").read_text()
    with pytest.warns(FutureWarning, match="data.window is now called data.sequence_length"):
        assert load_run_config(out).data.sequence_length == 32
    with pytest.warns(FutureWarning, match="data.window is now called data.sequence_length"):
        config = load_config(out / "train_config.yaml", [f"output.dir={out}"])
    resumed = train(config, resume=out / "checkpoint-8", stop_at_step=9, progress=False)
    assert resumed.resumed_from.endswith("checkpoint-8") and resumed.step == 9
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    full_log = [json.loads(line) for line in (full_out / "log.jsonl").read_text().splitlines()]
    assert log[8]["step"] == 9 and log[8]["loss"] == pytest.approx(full_log[8]["loss"], abs=1e-6)


def test_missing_data_and_lora_target_errors(tmp_path):
    from hf_posext.training.lora import LoraTargetError

    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny_config(tmp_path / "a", f"data.source={tmp_path}/no_such_books/"), progress=False)
    with pytest.raises(LoraTargetError, match=r"'q_projj' \(did you mean 'q_proj'\?\)"):
        train(tiny_config(tmp_path / "b", "finetune.target_modules=[q_projj, v_proj]"), progress=False)
    with pytest.raises(ConfigError, match=r"data.sequence_length \(32\) is longer than data.pose_target_length \(16\)"):
        train(tiny_config(tmp_path / "c", "data.pose_target_length=16"), progress=False)
    with pytest.raises(ConfigError, match="longer than the scaled window"):
        train(tiny_config(tmp_path / "d", "data.pose=false", "data.sequence_length=300"), progress=False)
    assert not list(tmp_path.iterdir())  # bad input leaves no output folder (and no train_config.yaml) behind


def test_trackers_must_be_installed_when_asked(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(ImportError, match="pip install tensorboard"):
        train(tiny_config(tmp_path / "tb", "output.report_to=[tensorboard]"), progress=False)


def test_full_finetuning_kill_and_resume_is_bitwise(tmp_path):
    common = ["finetune.mode=full", "train.max_steps=4", "train.warmup_steps=0", "output.checkpoint_every=2",
              "output.save_merged=false", "train.learning_rate=1e-3"]
    full = train(tiny_config(tmp_path / "full", *common), progress=False)
    assert full.finished and (tmp_path / "full" / "merged" / "model.safetensors").is_file()
    out = tmp_path / "interrupted"
    train(tiny_config(out, *common), stop_at_step=3, progress=False)
    assert find_latest_checkpoint(out).name == "checkpoint-2"
    train(tiny_config(out, *common), resume=True, progress=False)
    final, again = checkpoint_weights(tmp_path / "full" / "checkpoint-4"), checkpoint_weights(out / "checkpoint-4")
    assert bitwise_equal(final, again)
    assert not bitwise_equal(checkpoint_weights(tmp_path / "full" / "checkpoint-2"), final)  # every weight file trained


def test_resume_with_another_number_of_processes_is_refused(finished_run, tmp_path):
    from hf_posext.training.checkpoints import write_checksums

    out, checkpoint = _copy_checkpoint(finished_run, tmp_path)
    run = json.loads((checkpoint / "posext_run.json").read_text())
    run["num_processes"] = 2
    (checkpoint / "posext_run.json").write_text(json.dumps(run))
    write_checksums(checkpoint)
    with pytest.raises(ConfigError, match=r"written by a run with 2 processes; resume it with the same number \(now 1\)"):
        train(tiny_config(out), resume=True, progress=False)

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


def test_a_run_folder_another_run_is_writing_is_refused_before_anything_loads(finished_run, tmp_path, monkeypatch):
    """A job started again while the first still runs: with --resume it would mix its checkpoints into the first's,
    with --overwrite delete them. The run holding the folder is named; nothing loads, nothing in the folder changes."""
    import shutil

    import hf_posext.training.trainer as trainer_module
    from hf_posext.core.locks import LOCK_NAME, FolderBusyError, hold_folder

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded for a run folder another run holds")

    monkeypatch.setattr(trainer_module, "load_base_model", no_loading)
    full_out, _ = finished_run
    out = tmp_path / "run"
    shutil.copytree(full_out, out)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with hold_folder(out, "output.dir", "the run"):
        for kwargs in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(FolderBusyError, match=r"output\.dir .* is being written by another run \(pid \d+ on .*"
                                                      r"give another output\.dir for the run"):
                train(tiny_config(out), progress=False, **kwargs)
        with pytest.raises(FolderBusyError):  # a new run into a folder another new run has just taken
            with hold_folder(tmp_path / "new"):
                train(tiny_config(tmp_path / "new"), progress=False)
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == sorted([*before, LOCK_NAME])
    assert not (out / LOCK_NAME).exists() and not (tmp_path / "new").exists()
