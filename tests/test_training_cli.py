"""`hf-posext train` and recipes/finetune.py: registration, config printing, errors as exit code 2."""

from __future__ import annotations

import json
import re

import yaml

from tests.training_helpers import REPO, TINY_RECIPE, one_thread  # noqa: F401 (one_thread: autouse fixture)

from hf_posext import cli


def test_train_subcommand_is_registered():
    cli.build_parser()
    assert "train" in cli.SUBCOMMANDS


def test_print_config_applies_overrides(capsys):
    assert cli.main(["train", "--config", str(TINY_RECIPE), "--print-config", "finetune.rank=2", "train.max_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["finetune"]["rank"] == 2 and printed["train"]["max_steps"] == 7


def test_bad_input_exits_2_with_the_fix(capsys, tmp_path):
    assert cli.main(["train", "--config", str(TINY_RECIPE), "train.max_stepz=3"]) == 2
    assert "Did you mean 'train.max_steps'" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x.txt").write_text("x")
    assert cli.main(["train", "--config", str(TINY_RECIPE), f"output.dir={busy}"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["train"]) == 2
    assert "--config is required" in capsys.readouterr().err


def test_finetune_script_main_parses_resume_followed_by_an_override(capsys):
    from hf_posext.training.cli import main

    assert main(["--config", str(TINY_RECIPE), "--print-config", "--resume", "train.max_steps=5"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["max_steps"] == 5


def test_overrides_are_accepted_before_between_and_after_flags(capsys):
    """`a=1 --no-progress b=2`: argparse matches the positional once, so the second group used to be refused."""
    from hf_posext.training.cli import main

    arguments = ["--config", str(TINY_RECIPE), "--print-config", "finetune.rank=2", "--no-progress",
                 "train.max_steps=7", "--overwrite", "data.sequence_length=64"]
    for run in (lambda: cli.main(["train", *arguments]), lambda: main(arguments)):
        assert run() == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert (printed["finetune"]["rank"], printed["train"]["max_steps"], printed["data"]["sequence_length"]) == (2, 7, 64)


def test_an_unknown_flag_among_overrides_is_refused(capsys):
    assert cli.main(["train", "--config", str(TINY_RECIPE), "--print-config", "train.max_steps=7", "--no-progess"]) == 2
    assert "unrecognized arguments: --no-progess" in capsys.readouterr().err


def test_a_launched_refusal_is_printed_by_local_rank_0_only(capsys, tmp_path, monkeypatch):
    """Under accelerate launch/torchrun every process reaches the same refusal: one line, not one per process,
    and torch elastic's failure report names it (its error file) instead of 'To enable traceback see ...'."""
    from hf_posext.training.cli import launched_local_rank, main

    assert launched_local_rank({"LOCAL_RANK": "0"}) is None  # one process: not a multi-process launch
    arguments = ["--config", str(TINY_RECIPE), "parallelism.sp_backend=deepspeed", "parallelism.sp_size=2",
                 "parallelism.zero_stage=2"]
    codes = {}
    for rank in (0, 1):
        error_file = tmp_path / f"error-{rank}.json"
        for name, value in {"WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "RANK": str(rank),
                            "TORCHELASTIC_ERROR_FILE": str(error_file)}.items():
            monkeypatch.setenv(name, value)
        codes[rank] = main(arguments)
        printed = capsys.readouterr().err
        assert ("only ZeRO stage 3" in printed) == (rank == 0) and printed.count("\n") == (rank == 0)
        recorded = json.loads(error_file.read_text())["message"]
        assert recorded.startswith("finetune: error: ") and "only ZeRO stage 3" in recorded
    assert codes == {0: 2, 1: 0}  # rank 1's failure would only repeat rank 0's in the launcher's report


def test_train_without_deepspeed_names_the_install_line(capsys, tmp_path, monkeypatch):
    """The documented Ulysses recipe, DeepSpeed absent: `hf-posext train` names the install line before anything
    is loaded (accelerate launch itself would stop with accelerate's ImportError before the recipe is read)."""
    import importlib.util

    from tests.training_helpers import REPO

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    recipe = REPO / "recipes" / "configs" / "qwen3-8b" / "128k-stage1-books-8gpu.yaml"
    assert "pip install 'hf-posext[deepspeed]'" in recipe.read_text().split("\nmodel:")[0]  # where the launch is named
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(recipe), f"output.dir={out}"]) == 2
    assert "needs DeepSpeed: pip install 'hf-posext[deepspeed]'" in capsys.readouterr().err
    assert not out.exists()


TINY_STAGE2 = REPO / "recipes" / "configs" / "tiny" / "ci-stage2-lookups-cpu.yaml"
SMOLLM2_STAGE1 = REPO / "recipes" / "configs" / "smollm2-135m" / "32k-stage1-books-cpu.yaml"
SMOLLM2_STAGE2 = REPO / "recipes" / "configs" / "smollm2-135m" / "32k-stage2-lookups-cpu.yaml"


def test_the_tiny_two_stage_recipe_runs_end_to_end_and_stage_2_waits_for_stage_1(capsys, tmp_path, monkeypatch):
    """Stage 2 names stage 1's recipe: refused (with the command) until stage 1 has run, then continues its adapter."""
    monkeypatch.chdir(REPO)  # the recipes name their model and text relative to the repository root
    stage1 = tmp_path / "stage1.yaml"  # the tiny stage 1, writing into tmp_path
    stage1.write_text(TINY_RECIPE.read_text().replace("dir: runs/tiny-ci-stage1-cpu", f"dir: {tmp_path / 'run1'}"))
    stage2 = ["train", "--config", str(TINY_STAGE2), f"finetune.init_adapter={stage1}", f"output.dir={tmp_path / 'run2'}",
              "--no-progress"]
    assert cli.main(stage2) == 2
    error = capsys.readouterr().err
    assert f"the previous stage has not been run: {stage1} writes its adapter to {tmp_path / 'run1' / 'adapter'}" in error
    assert f"Run `hf-posext train --config {stage1}` first" in error and error.count("\n") == 1
    assert not (tmp_path / "run2").exists()

    assert cli.main(["train", "--config", str(stage1), "--no-progress"]) == 0
    # --no-progress: no bar at all, transformers' own (writing the model's shards) included
    assert not re.search(r"\d+/\d+ \[\d\d:\d\d", capsys.readouterr().err)
    assert cli.main(stage2) == 0
    capsys.readouterr()
    saved = yaml.safe_load((tmp_path / "run2" / "train_config.yaml").read_text())
    assert saved["finetune"]["init_adapter"] == str(tmp_path / "run1" / "adapter")  # the adapter continued, by its folder
    assert saved["data"]["retrieval_fraction"] == 0.5 and saved["train"]["loss_average"] == "sequences"
    card = (tmp_path / "run2" / "adapter" / "README.md").read_text()
    assert "**Started from:** the adapter `run1/adapter`" in card
    steps = [json.loads(line)["step"] for line in (tmp_path / "run2" / "log.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 7))


def test_an_old_recipe_name_runs_the_renamed_recipe_with_one_line(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    old = "recipes/configs/smollm2-135m/8k_to_32k_stage2_retrieval_cpu.yaml"
    assert cli.main(["train", "--config", old, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"hf-posext train: {old} is now recipes/configs/smollm2-135m/32k-stage2-lookups-cpu.yaml "
                            "(the old name works for one release)\n")
    assert yaml.safe_load(captured.out)["output"]["dir"] == "runs/smollm2-135m-32k-stage2-lookups-cpu"


def test_printing_stage_2_shows_the_adapter_stage_1_writes_without_needing_it(capsys):
    assert cli.main(["train", "--config", str(SMOLLM2_STAGE2), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["finetune"]["init_adapter"] == "runs/smollm2-135m-32k-stage1-books-cpu/adapter"
    assert printed["data"]["exclude"] == ["austen-emma.txt", "melville-moby_dick.txt"]


def test_a_missing_data_source_is_refused_with_the_fix_before_anything_loads(capsys, tmp_path, monkeypatch):
    import hf_posext.models

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded before the data source was checked")

    monkeypatch.setattr(hf_posext.models, "load_tokenizer", no_loading)
    monkeypatch.setattr(hf_posext.models, "load_model", no_loading, raising=False)
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(SMOLLM2_STAGE1), "data.source=no/such/books", f"output.dir={out}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    error = "\n".join(lines)  # the refusal, in one line (the dtype line comes only once every check has passed)
    assert len(lines) == 1 and "data.source: Text source 'no/such/books' does not exist" in error
    assert "the repository ships books in data/books: run from the repository root" in error and "pg19" in error
    monkeypatch.chdir(tmp_path)  # the recipe's own data/books, from outside the repository
    assert cli.main(["train", "--config", str(SMOLLM2_STAGE1), f"output.dir={out}"]) == 2
    assert f"a relative path is read from the current directory, {tmp_path}" in capsys.readouterr().err
    assert not out.exists()


def test_stop_at_step_is_documented_as_the_first_steps_of_the_recipes_schedule(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--stop-at-step N" in shown and "stop after step N without the final save: the recipe's first N steps" in shown
