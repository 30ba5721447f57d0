"""``hf-posext train``: run a fine-tuning recipe (also the body of ``recipes/finetune.py``).

    hf-posext train --config recipes/configs/tiny/ci-stage1-cpu.yaml train.max_steps=20
    accelerate launch --num_processes 2 recipes/finetune.py --config CONFIG [key=value ...] [--resume [DIR]]

A two-stage recipe is two recipes: the second names the first in ``finetune.init_adapter`` and continues the
adapter its run wrote (``hf-posext train`` refuses it, naming the command, until the first has been run).
``--stop-at-step N`` runs the first N steps of a recipe exactly as the full run takes them (same learning-rate
schedule, same samples); ``train.max_steps=N`` would make a shorter run, with its own schedule.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping

from hf_posext.core.errors import USAGE_EXIT_CODE, exit_code_for, one_line_message, run_reporting_errors, show_traceback
from hf_posext.core.files import write_json_atomic

__all__ = ["add_train_arguments", "run_train", "main", "launched_local_rank", "report_launched_error", "leave_without_teardown"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-posext train`` / ``recipes/finetune.py``."""
    parser.add_argument("--config", help="recipe YAML (recipes/configs/...); optional with --resume DIR")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.max_steps=10")
    parser.add_argument(
        "--resume", nargs="?", const=True, default=None, metavar="DIR",
        help="continue from the latest checkpoint in output.dir, or from DIR (a run folder or a checkpoint)",
    )
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run in output.dir and start over")
    parser.add_argument("--stop-at-step", type=int, metavar="N",
                        help="stop after step N without the final save: the recipe's first N steps, on its own "
                             "learning-rate schedule (time-boxed runs; --resume continues)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # argparse matches a positional once: overrides after a flag that follows earlier overrides
    # (`a=1 --no-progress b=2`) come back as extra arguments, which _overrides() takes in.
    parser.set_defaults(accepts_extra=True)


def run_train(args: argparse.Namespace) -> int:
    """Run ``hf-posext train`` with parsed ``args``; returns the exit code (2 on bad input).

    Under a launcher (``accelerate launch``, ``torchrun``: ``LOCAL_RANK`` is set) a refusal is reported by
    :func:`report_launched_error`: once, not once per process.
    """
    prog = getattr(args, "prog_name", "hf-posext train")
    try:
        return _run_train(args)
    except Exception as error:
        local_rank = launched_local_rank()
        if local_rank is not None and not show_traceback():
            return report_launched_error(prog, error, local_rank)
        if not isinstance(error, (FileExistsError, ImportError)):
            raise  # hf_posext.cli reports ValueError/FileNotFoundError itself
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE


def launched_local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its machine when a launcher started several (``LOCAL_RANK``), else None."""
    environ = os.environ if environ is None else environ
    if int(environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    value = environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


def report_launched_error(prog: str, error: BaseException, local_rank: int) -> int:
    """Report a refused run of a launched process once per launch; returns the process's exit code.

    Local rank 0 prints the one line. Every rank writes it to torch elastic's error file
    (``TORCHELASTIC_ERROR_FILE``), so the failure report that ``accelerate launch``/``torchrun`` prints
    for any process that exits non-zero names the refusal instead of "To enable traceback see ...". That
    report cannot be avoided for a failed launch (torch elastic raises ``ChildFailedError`` for it), but a
    refusal made before the processes first talk to one another (the recipe and launch checks) depends only
    on the recipe and the environment, which every process shares, so the other local ranks leave with
    exit code 0: the report then lists one failure, not one per process. A failure after that point
    (where processes may differ) keeps its exit code on every rank.
    """
    import torch.distributed

    message = f"{prog}: error: {one_line_message(error)}"
    code = USAGE_EXIT_CODE if isinstance(error, (FileExistsError, ImportError)) else exit_code_for(error)
    _write_elastic_error_file(message)
    communicating = torch.distributed.is_available() and torch.distributed.is_initialized()
    if local_rank == 0:
        print(message, file=sys.stderr)
        if not communicating:
            _wait_for_local_ranks()
        return code
    return code if communicating else 0


def _wait_for_local_ranks(timeout: float = 10.0, grace: float = 0.5) -> None:
    """Give the other local ranks, refusing the same way, time to leave first (briefly, by their error files).

    The launcher stops the processes still running once one fails and lists each as a SIGTERM failure; a
    rank still importing when rank 0 refused would add one. torch elastic gives each local rank its error
    file in a folder named by the rank (``.../attempt_N/<local_rank>/error.json``); elsewhere nothing waits.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    folder = Path(path).parent
    if not path or folder.name != "0" or ranks <= 1:
        return
    others = [folder.parent / str(rank) / Path(path).name for rank in range(1, ranks)]
    deadline = time.monotonic() + timeout
    while not all(other.is_file() for other in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(grace)  # from writing its error file to leaving, a rank only returns


def _write_elastic_error_file(message: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        write_json_atomic(path, {"message": message, "timestamp": int(time.time())}, indent=None)
    except OSError:
        pass  # the report then says "To enable traceback see ..."; local rank 0 printed the line anyway


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
    else:  # a previous stage named by finetune.init_adapter must have been run, unless only printing
        config = load_config(_current_recipe_name(args.config), overrides, require_previous_stage=not args.print_config)
    if args.print_config:
        print(config.to_yaml())
        return 0
    from hf_posext.evaluation.loading import dtype_line, transformers_progress_bars
    from hf_posext.training.arguments import training_dtype

    def announce() -> None:  # the dtype, once every check has passed (a refusal stays one line), before the model loads
        if launched_local_rank() in (None, 0):
            print(dtype_line(*training_dtype(config)), file=sys.stderr)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with transformers_progress_bars(args.progress):  # --no-progress: transformers' own bars (loading, saving) too
        result = train(config, resume=resume, overwrite=args.overwrite, stop_at_step=args.stop_at_step,
                       progress=args.progress, announce=announce)
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(json.dumps(result.__dict__, indent=2))
    if config.parallelism.sequence_parallel and launched_local_rank() is not None:
        leave_without_teardown(0)
    return 0


def _current_recipe_name(config: str) -> str:
    """``config``, or the new name of a renamed recipe (with one line on stderr naming it)."""
    from hf_posext.training.recipe_names import renamed_recipe

    new = renamed_recipe(config)
    if new is None:
        return config
    print(f"hf-posext train: {config} is now {new} (the old name works for one release)", file=sys.stderr)
    return new


def leave_without_teardown(code: int) -> None:
    """End a finished sequence-parallel process once every rank is here, skipping C++ static destructors.

    At interpreter exit a thread of DeepSpeed's shared-memory communication op can abort one rank ("terminate
    called without an active exception", SIGABRT) after the run has finished and written everything: the
    launcher then reports a failed run that did not fail (seen twice in this project's CI, under load). Everything is
    written and flushed by then; only the process's teardown is skipped.
    """
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    args.prog_name = "finetune"
    return run_reporting_errors("finetune", lambda: run_train(args))

