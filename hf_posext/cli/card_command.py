"""``hf-posext eval suite`` (and its deprecated old name ``eval card``): the arguments, and the
:class:`~hf_posext.card.settings.CardSettings` they build. No ``argparse.Namespace`` goes below this module.

Example:
    hf-posext eval suite --models smollm2-135m --methods none,yarn --lengths 2048,8192 --tasks passkey,ruler --trials 2
"""

from __future__ import annotations

import argparse

from hf_posext.card.settings import DEFAULT_OUT, DEFAULT_TASKS, CardSettings
from hf_posext.models import embedded_names
from hf_posext.user_warnings import warn_at_caller

__all__ = ["HELP", "OLD_NAME_HELP", "add_arguments", "settings_from_arguments", "run"]

HELP = ("the suite: perplexity, passkey, needle, RULER and chat endings, models x methods x lengths, in one report "
        "(card.md, card.html)")
#: The command's former name, kept for a while: it runs the suite with one deprecation line.
OLD_NAME_HELP = "deprecated: the old name of eval suite"
_DEFAULT_TRIALS = 20
_DEFAULT_DATA = "builtin:python-docs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-posext eval suite``, named as its sibling eval commands name theirs."""
    parser.add_argument("--models", required=True,
                        help="comma-separated [LABEL=]MODEL[+ADAPTER][@REQUEST;...] (REQUEST: docs/request-grammar.md, e.g. yarn:factor=4): hub name, folder, " f"{embedded_names()}; the first, "
                             "when it has no adapter and no scaling saved in its config, is the base model, and its unscaled row "
                             "the reference of 'beyond the base model' (e.g. smollm2-135m,fine-tuned=runs/r/merged@as-saved;string:factor=1); "
                             "a MODEL+ADAPTER row runs at its adapter's scaling only: @as-saved, or the scaling it was trained with")
    parser.add_argument("--methods", default="none",
                        help="comma-separated requests applied to every model (e.g. none,yarn:factor=4); none = unscaled, as-saved = the model's own saved "
                             "scaling (default: %(default)s)")
    parser.add_argument("--factor", type=float, help="factor for every method but none/as-saved (default: longest length / window)")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE", help="deprecated: write the parameter in the request, yarn:beta_fast=16")
    parser.add_argument("--lengths", required=True, help="comma-separated lengths in tokens, e.g. 2048,4096 or 4k,16k")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help="perplexity, passkey, needle, ruler (RULER's six offline tasks, and its seven that need a download where "
                             "their data can be fetched; the others are listed as skipped), RULER task names, or ending (short "
                             "chat-formatted instructions: does each answer end with the end-of-turn token?) (default: %(default)s)")
    parser.add_argument("--trials", type=int, help=f"samples per task and length (passkey/needle: trials over the depths; "
                        f"perplexity: segments, at most 8) (default: {_DEFAULT_TRIALS})")
    parser.add_argument("--samples", dest="old_samples", type=int, metavar="N", help="deprecated: the old name of --trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RULER samples and the passkeys (default: %(default)s)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results folder; an existing suite folder is added to (default: %(default)s)")
    parser.add_argument("--sample-cache", help="folder of cached RULER samples (default: OUT/ruler-samples)")
    parser.add_argument("--budget", choices=("short", "full"), default="short",
                        help="short: generate each RULER sample with a short budget first and again with the task's full budget "
                             "only when that could change its score (same scores, less time); full: lm-eval's budgets (default: %(default)s)")
    parser.add_argument("--max-length", type=int, help="the harness's max_length (default: each row's scaled window)")
    parser.add_argument("--skip-over-window", action="store_true",
                        help="list (row, length) cells whose prompt does not fit the row's window as skipped instead of refusing the run")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16 or auto: perplexity in float32, passkey, needle and RULER in bfloat16 on a "
                             "CPU with native bfloat16, else float32 (default: %(default)s)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: this process's accelerator, else cpu)")
    parser.add_argument("--data", help=f"perplexity text: .txt/.jsonl/.parquet file or folder, a datasets name[:config], or "
                        f"builtin:python-docs (default: {_DEFAULT_DATA})")
    parser.add_argument("--ppl-data", dest="old_data", metavar="TEXT", help="deprecated: the old name of --data")
    parser.add_argument("--haystack", default="builtin:python-docs", help="needle haystack text (default: %(default)s)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _renamed(args: argparse.Namespace, old: str, new: str, old_dest: str, new_dest: str, default):
    """The value of an option renamed from ``old`` to ``new``: the old name still works, with one deprecation line."""
    old_value, new_value = getattr(args, old_dest), getattr(args, new_dest)
    if old_value is None:
        return default if new_value is None else new_value
    if new_value is not None:
        raise ValueError(f"give {new} only ({old} is its old name), not both.")
    warn_at_caller(f"{old} is deprecated and will be removed: write {new} {old_value}.", FutureWarning)
    return old_value


def settings_from_arguments(args: argparse.Namespace) -> CardSettings:
    """The :class:`~hf_posext.card.settings.CardSettings` of parsed arguments.

    Raises:
        ValueError: a bad ``--models``, ``--lengths``, ``--tasks``, ``--param`` or any setting
            :class:`~hf_posext.card.settings.CardSettings` refuses.
    """
    from hf_posext.card.spec import parse_model_specs, parse_tasks
    from hf_posext.core.request import parse_param_items
    from hf_posext.evaluation.arguments import parse_lengths

    models = parse_model_specs(args.models)
    lengths = parse_lengths(args.lengths)
    tasks = parse_tasks(args.tasks)
    return CardSettings(
        models=tuple(models), lengths=tuple(lengths), tasks=tuple(tasks), methods=args.methods, factor=args.factor,
        params=parse_param_items(args.param), trials=_renamed(args, "--samples", "--trials", "old_samples", "trials", _DEFAULT_TRIALS),
        seed=args.seed, out=args.out, sample_cache=args.sample_cache, budget=args.budget, max_length=args.max_length,
        skip_over_window=args.skip_over_window, dtype=args.dtype, device=args.device,
        data=_renamed(args, "--ppl-data", "--data", "old_data", "data", _DEFAULT_DATA), haystack=args.haystack,
        progress=args.progress)


def run(args: argparse.Namespace) -> int:
    """Run ``hf-posext eval suite`` (or its old name, ``eval card``, with one deprecation line)."""
    from hf_posext.card.run import run_card

    if getattr(args, "task", None) == "card":
        warn_at_caller("hf-posext eval card is deprecated and will be removed: write hf-posext eval suite (same flags; "
                       "--trials and --data for --samples and --ppl-data).", FutureWarning)
    return run_card(settings_from_arguments(args))
