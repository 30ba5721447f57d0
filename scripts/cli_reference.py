"""Write docs/cli.md from the argparse tree of ``hf-posext``: every subcommand, its flags and an example.

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 if docs/cli.md is out of date (tests/test_docs_cli.py)

The flags and help texts come from ``hf_posext.cli.main.build_parser()``; the examples are :data:`EXAMPLES` below
(each must parse: the test checks it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "cli.md"
WIDTH = 100

#: One example for each subcommand, in the order of ``SUBCOMMANDS`` (run from the repository root).
EXAMPLES: dict[str, list[str]] = {
    "methods": ["hf-posext methods"],
    "describe": ["hf-posext describe smollm2-135m"],
    "patch": ["hf-posext patch smollm2-135m --method yarn:factor=4 --out runs/yarn4"],
    "demo": ["hf-posext demo --quick"],
    "eval": [
        "hf-posext eval perplexity --model smollm2-135m --methods none,yarn --lengths 4096,8192,16384 --data builtin:python-docs",
        "hf-posext eval passkey --model smollm2-135m --methods none,yarn --lengths 8192,16384 --trials 1",
        "hf-posext eval needle --model smollm2-135m --methods yarn --lengths 16384 --trials 1",
        "hf-posext eval suite --models smollm2-135m --methods none,yarn --lengths 2048,8192 --tasks passkey,ruler --trials 2",
    ],
    "report": ["hf-posext report results/"],
    "train": ["hf-posext train --config recipes/configs/tiny/ci-stage1-cpu.yaml --overwrite"],
    "lm-eval": ["hf-posext lm-eval run --model hf-posext --model_args pretrained=smollm2-135m,dtype=float32 "
                "--tasks niah_single_1 --limit 10 --device cpu"],
    "lm-eval-compare": ["hf-posext lm-eval-compare --help"],
    "export": ["hf-posext export runs/yarn4 --for vllm --out runs/yarn4-vllm"],
    "adapter": ["hf-posext adapter verify bench/results/finetune_retrieval_cpu/run-retrieval-aggregation/adapter"],
    "inspect": ["hf-posext inspect smollm2-135m --method yarn:factor=4"],
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subcommand_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or action.dest.upper()
                name += " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
        else:
            name = action.metavar if isinstance(action.metavar, str) else action.dest
        help_text = " ".join((action.help or "").split())
        try:
            help_text = help_text % {"default": action.default, "prog": parser.prog}
        except (KeyError, TypeError, ValueError):
            pass
        if action.required and action.option_strings:
            help_text += " (required)"
        rows.append(f"| `{name}` | {help_text.replace('|', '&#124;')} |")
    return rows


def _section(parser: argparse.ArgumentParser, name: str, summary: str, level: int,
             example: list[str] | None = None) -> list[str]:
    lines = [f"{'#' * level} `hf-posext {name}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    rows = _flag_rows(parser)
    if rows:
        lines += ["| argument | what it is |", "|---|---|", *rows, ""]
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    if example:
        lines += ["Example:", "", "```bash", *example, "```", ""]
    helps = _subcommand_help(parser)
    for child_name, child in _subparsers(parser).items():
        if child_name in helps:  # a subcommand kept under an old name only (eval card) is not listed
            lines += _section(child, f"{name} {child_name}", helps[child_name], level + 1)
    return lines


def render() -> str:
    """docs/cli.md as it should be, from the installed argparse tree and :data:`EXAMPLES`."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse wraps usage lines to the terminal: fix it
    try:
        from hf_posext.cli.main import SUBCOMMANDS, build_parser

        parser = build_parser()
        commands = _subparsers(parser)
        lines = [
            "# Command-line reference",
            "",
            "<!-- Generated by `python scripts/cli_reference.py` from the argparse tree; do not edit by hand. -->",
            "",
            f"`hf-posext` has {len(SUBCOMMANDS)} subcommands. Anywhere a model is taken, a hub name, a local folder or "
            "an embedded name (`smollm2-135m-instruct`, or its alias `smollm2-135m`; `gemma3-270m`: [install.md](install.md#the-embedded-models)) works. "
            "Errors are one line that names the fix ([errors.md](errors.md)).",
            "",
            "| command | what it does |",
            "|---|---|",
            *[f"| [`{name}`](#hf-posext-{name}) | {help_text} |" for name, (help_text, _, _) in SUBCOMMANDS.items()],
            "",
        ]
        for name, (help_text, _, _) in SUBCOMMANDS.items():
            lines += _section(commands[name], name, help_text, 2, EXAMPLES[name])
        return "\n".join(lines).rstrip("\n") + "\n"
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/cli.md from hf-posext's argparse tree.")
    parser.add_argument("--check", action="store_true", help="only check that docs/cli.md is up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print("docs/cli.md is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
