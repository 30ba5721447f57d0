"""`hf-posext train` and recipes/finetune.py: registration, config printing, errors as exit code 2."""

from __future__ import annotations

import json

import yaml

from tests.training_helpers import TINY_RECIPE

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
    recipe = REPO / "recipes" / "configs" / "qwen3-8b" / "32k_to_128k_yarn_lora_ulysses_8gpu.yaml"
    assert "pip install 'hf-posext[deepspeed]'" in recipe.read_text().split("\nmodel:")[0]  # where the launch is named
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(recipe), f"output.dir={out}"]) == 2
    assert "needs DeepSpeed: pip install 'hf-posext[deepspeed]'" in capsys.readouterr().err
    assert not out.exists()
