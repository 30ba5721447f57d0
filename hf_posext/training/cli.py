"""``hf-posext train``: run a fine-tuning recipe (also the body of ``recipes/finetune.py``).

    hf-posext train --config recipes/configs/tiny/lora_pose.yaml train.max_steps=20
    accelerate launch --num_processes 2 recipes/finetune.py --config CONFIG [key=value ...] [--resume [DIR]]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hf_posext.core.errors import run_reporting_errors


__all__ = ["add_train_arguments", "run_train", "main"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-posext train`` / ``recipes/finetune.py``."""
    parser.add_argument("--config", help="recipe YAML (recipes/configs/...); optional with --resume DIR")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.max_steps=10")
    parser.add_argument(
        "--resume", nargs="?", const=True, default=None, metavar="DIR",
        help="continue from the latest checkpoint in output.dir, or from DIR (a run folder or a checkpoint)",
    )
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run in output.dir and start over")
    parser.add_argument("--stop-at-step", type=int, help="stop after this step without the final save (time-boxed runs)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # argparse matches a positional once: overrides after a flag that follows earlier overrides
    # (`a=1 --no-progress b=2`) come back as extra arguments, which _overrides() takes in.
    parser.set_defaults(accepts_extra=True)


def run_train(args: argparse.Namespace) -> int:
    """Run ``hf-posext train`` with parsed ``args``; returns the exit code (2 on bad input)."""
    try:
        return _run_train(args)
    except (FileExistsError, ImportError) as error:  # hf_posext.cli reports ValueError/FileNotFoundError itself
        print(f"hf-posext train: error: {error}", file=sys.stderr)
        return 2


def _run_train(args: argparse.Namespace) -> int:
    from hf_posext.training.config import load_config
    from hf_posext.training.trainer import load_run_config, train

    overrides = _overrides(args)
    resume = args.resume
    if isinstance(resume, str) and "=" in resume and not Path(resume).exists():
        overrides.append(resume)  # `--resume key=value`: the flag took an override as its value
        resume = True
    if args.config is None:
        if not isinstance(resume, str):
            raise ValueError("--config is required (or --resume DIR to continue a run with the config saved in it).")
        config = load_run_config(resume)
        if overrides:
            from hf_posext.training.config import apply_overrides, config_from_dict

            config = config_from_dict(apply_overrides(config.to_dict(), overrides)).validate()
    else:
        config = load_config(args.config, overrides)
    if args.print_config:
        print(config.to_yaml())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = train(config, resume=resume, overwrite=args.overwrite, stop_at_step=args.stop_at_step, progress=args.progress)
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(json.dumps(result.__dict__, indent=2))
    return 0


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides wherever they stood on the command line (before, between or after flags).

    Raises:
        ValueError: an argument that is neither a known flag nor a ``key=value`` override.
    """
    extra = list(getattr(args, "extra", None) or [])
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (overrides are key=value, e.g. train.max_steps=10; "
                         "see --help for the flags)")
    return [*(args.overrides or []), *extra]


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``recipes/finetune.py`` (same arguments as ``hf-posext train``)."""
    parser = argparse.ArgumentParser(prog="finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.extra = extra
    return run_reporting_errors("finetune", lambda: run_train(args))

