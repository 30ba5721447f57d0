"""``hf-posext eval suite``, the command: named apart from a Hugging Face model card (``eval card`` kept as a
deprecated alias), flags named as its sibling eval commands name theirs, a typed ``CardSettings`` below the command
line, and ``card.json`` parsed once a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_posext.card.settings import DEFAULT_OUT, CardSettings
from hf_posext.card.spec import parse_model_specs
from hf_posext.cli.main import build_parser

TINY_RUN = ["--models", "tiny", "--methods", "none", "--tasks", "passkey", "--lengths", "400", "--no-progress"]


def test_the_suite_is_listed_under_eval_and_its_old_name_is_not():
    parser = build_parser()
    eval_help = parser._subparsers._group_actions[0].choices["eval"].format_help()
    listed = [line.split()[0] for line in eval_help.split("options:")[0].splitlines() if line[:4] == "    " and line[4:5].strip()]
    assert "{perplexity,passkey,needle,suite}" in eval_help and listed == ["perplexity", "passkey", "needle", "suite"]
    args = parser.parse_args(["eval", "card", "--models", "m", "--lengths", "1k"])  # the old name still parses
    assert args.task == "card"


def test_flags_match_the_sibling_eval_commands():
    from hf_posext.cli.card_command import settings_from_arguments

    args = build_parser().parse_args(["eval", "suite", "--models", "base=m", "--lengths", "1k,2k"])
    settings = settings_from_arguments(args)
    assert settings.trials == 20 and settings.data == "builtin:python-docs" and settings.device is None
    assert settings.out == Path(DEFAULT_OUT) and str(settings.out).startswith("results/")
    args = build_parser().parse_args(["eval", "suite", "--models", "m", "--lengths", "1k", "--trials", "3", "--data", "x.txt"])
    assert (settings_from_arguments(args).trials, settings_from_arguments(args).data) == (3, "x.txt")


def test_the_old_flag_names_work_with_one_deprecation_line_each():
    from hf_posext.cli.card_command import settings_from_arguments

    args = build_parser().parse_args(["eval", "suite", "--models", "m", "--lengths", "1k", "--samples", "3", "--ppl-data", "x.txt"])
    with pytest.warns(FutureWarning) as caught:
        settings = settings_from_arguments(args)
    assert (settings.trials, settings.data) == (3, "x.txt")
    assert [str(w.message) for w in caught] == ["--samples is deprecated and will be removed: write --trials 3.",
                                                "--ppl-data is deprecated and will be removed: write --data x.txt."]
    both = build_parser().parse_args(["eval", "suite", "--models", "m", "--lengths", "1k", "--samples", "3", "--trials", "4"])
    with pytest.raises(ValueError, match="give --trials only"):
        settings_from_arguments(both)


def test_settings_refuse_what_cannot_run():
    specs = parse_model_specs("m")
    with pytest.raises(ValueError, match="--trials must be a positive number"):
        CardSettings(specs, (1024,), trials=0)
    with pytest.raises(ValueError, match="--budget"):
        CardSettings(specs, (1024,), budget="long")
    assert CardSettings(specs, [1024], out="x").out == Path("x")  # typed, whatever it was given as


def test_one_suite_run_parses_card_json_once(tmp_path, monkeypatch, capsys):
    """A run into a folder that holds a card reads that card once (its cells kept, its rows' order, its seed checked),
    and ``report`` reads it once; the old name runs the same suite with one deprecation line."""
    from hf_posext.card import folder as card_folder
    from hf_posext.cli import main

    out = tmp_path / "suite"
    with pytest.warns(FutureWarning, match="write hf-posext eval suite"):
        assert main(["eval", "card", *TINY_RUN, "--samples", "2", "--out", str(out)]) == 0
    reads: list[Path] = []
    parses: list[Path] = []
    read_text, read_card_file = Path.read_text, card_folder.read_card_file

    def counted_read(self, *args, **kwargs):
        if self.name == "card.json":
            reads.append(self)
        return read_text(self, *args, **kwargs)

    def counted_parse(folder):
        parses.append(folder)
        return read_card_file(folder)

    monkeypatch.setattr(Path, "read_text", counted_read)
    monkeypatch.setattr(card_folder, "read_card_file", counted_parse)
    assert main(["eval", "suite", *TINY_RUN, "--trials", "2", "--lengths", "400,800", "--out", str(out)]) == 0
    assert (reads, parses) == ([out / "card.json"], [out])
    reads.clear(), parses.clear()
    assert main(["report", str(out)]) == 0
    assert (reads, parses) == ([out / "card.json"], [out])
    assert "| passkey | tiny, unscaled |" in capsys.readouterr().out
