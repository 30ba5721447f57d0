"""``hf-posext lm-eval <lm_eval arguments>``: the harness's CLI with the ``hf-posext`` model registered.

Every argument after ``lm-eval`` goes to the harness unchanged (see :mod:`hf_posext.lm_eval`). The
harness is imported only when the subcommand runs, so ``hf-posext`` works without lm-eval installed.
"""

from __future__ import annotations

import argparse

from hf_posext.cli import SUBCOMMANDS

__all__ = ["add_arguments", "run"]

_HELP = "run lm-evaluation-harness (any task) on a scaled model: --model hf-posext"
_EPILOG = """\
All arguments are lm-eval's own (`lm-eval run --help`); hf-posext adds the model `hf-posext` with
model args posext_method=, posext_factor= | posext_target_length=, posext_<method parameter>=.

example:
  hf-posext lm-eval run --model hf-posext --device cpu --limit 10 \\
    --model_args pretrained=smollm2-135m,posext_method=yarn,posext_factor=2,dtype=float32 \\
    --tasks niah_single_1 --metadata '{"max_seq_lengths": [16384]}'
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything is passed through to the harness (``args.extra``)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.set_defaults(accepts_extra=True)


def run(args: argparse.Namespace) -> int:
    """Hand ``args.extra`` to the harness's CLI with ``hf-posext`` registered."""
    from hf_posext.lm_eval import main

    return main(list(args.extra))


SUBCOMMANDS.setdefault("lm-eval", (_HELP, add_arguments, run))
