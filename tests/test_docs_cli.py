"""docs/cli.md is generated from the argparse tree (scripts/cli_reference.py) and in sync with it; every subcommand
has an example there, and every example parses. To bring docs/cli.md up to date: ``python scripts/cli_reference.py``.
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

from hf_posext.cli.main import SUBCOMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]


def _reference():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCE = _reference()


def test_docs_cli_md_is_generated_and_in_sync():
    current = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == REFERENCE.render(), "docs/cli.md is out of date: run python scripts/cli_reference.py"


def test_every_subcommand_has_a_section_and_an_example():
    assert list(REFERENCE.EXAMPLES) == list(SUBCOMMANDS)
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in SUBCOMMANDS:
        assert f"## `hf-posext {name}`" in text
        assert all(example.startswith(f"hf-posext {name}") for example in REFERENCE.EXAMPLES[name])


@pytest.mark.parametrize("example", [e for examples in REFERENCE.EXAMPLES.values() for e in examples])
def test_every_example_parses(example):
    argv = shlex.split(example.split("#")[0])[1:]
    if "--help" in argv:
        argv.remove("--help")
        parser = build_parser()
        choices = parser._subparsers._group_actions[0].choices
        for word in argv:
            assert word in choices, f"{example}: no subcommand {word}"
            choices = getattr(choices[word], "_subparsers", None)
            choices = choices._group_actions[0].choices if choices else {}
        return
    args, extra = build_parser().parse_known_args(argv)
    assert not extra or getattr(args, "accepts_extra", False), f"{example}: unrecognized {extra}"


def test_the_eval_help_names_its_four_tasks():
    help_text = SUBCOMMANDS["eval"][0]
    for task in ("perplexity", "passkey", "needle", "suite"):
        assert task in help_text
