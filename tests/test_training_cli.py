"""`hf-posext train` and recipes/finetune.py: registration, config printing, errors as exit code 2."""

from __future__ import annotations

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
