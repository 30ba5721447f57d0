"""``hf-posext eval {perplexity,passkey,needle}`` and ``hf-posext report``; also behind eval/*.py (``eval suite``:
:mod:`hf_posext.cli.card_command`).

Examples:
    hf-posext eval perplexity --model smollm2-135m --methods none,yarn,dynamic-yarn --lengths 4096,8192,16384 --data books/
    accelerate launch --num_processes 2 eval/passkey.py --model smollm2-135m --methods none,yarn --lengths 8192,16384
    hf-posext report results/
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from hf_posext.core.errors import run_reporting_errors
from hf_posext.core.files import check_output_folder
from hf_posext.core.request import parse_param_items
from hf_posext.models import embedded_names

__all__ = ["TASKS", "add_task_arguments", "check_task_arguments", "run_task", "main_task"]

TASKS = ("perplexity", "passkey", "needle")


#: The methods ``hf-posext eval`` compares when ``--methods`` is not given (and no ``--adapter`` names its own).
DEFAULT_METHODS = "none,yarn,dynamic-yarn"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help=f"hub name, local folder, {embedded_names()}, or tiny[:FAMILY[:WINDOW]] (a random test model)")
    parser.add_argument("--adapter", metavar="DIR",
                        help="a LoRA adapter folder written by hf-posext train (runs/NAME/adapter), applied to --model and merged; "
                             "refused unless --model and the methods are the base and scaling it was trained with")
    parser.add_argument("--methods", help="comma-separated scaling requests, e.g. none,yarn:factor=4:beta_fast=16 "
                        f"(docs/request-grammar.md); none = unpatched (default: {DEFAULT_METHODS}; with --adapter, the "
                        "scaling the adapter was trained with, e.g. yarn:factor=4)")
    parser.add_argument("--factor", type=float, help="scale factor for every method (default: longest length / original window)")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE", help="deprecated: write the parameter in the request, yarn:beta_fast=16")
    parser.add_argument("--lengths", required=True, help="comma-separated lengths in tokens, e.g. 4096,8192,16384 or 4k,8k")
    parser.add_argument("--out", default="results", help="results folder (default: %(default)s)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16 or auto: float32, but bfloat16 for passkey and needle on a CPU with native "
                             "bfloat16 (AVX-512 BF16 / AMX; 0.41x the time, same answers: docs/evaluation.md) (default: %(default)s)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: this process's accelerator, else cpu)")
    parser.add_argument("--device-map", help="e.g. auto: spread a model too big for one device (one process only)")
    parser.add_argument("--attn-implementation", help="eager, sdpa, flash_attention_2 (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=1, help="segments/prompts per forward pass (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="recompute cells already in the results file")
    parser.add_argument("--no-reuse", dest="reuse_identical", action="store_false",
                        help="recompute even where two methods compute the same function at a length")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _retrieval(parser: argparse.ArgumentParser, trials: int, max_new: int) -> None:
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="positions 0 (start) .. 1 (end) (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=trials,
                        help="prompts per (length, depth), each with its own seeded number (default: %(default)s; 10 x 5 depths = "
                             "50 per length; raising it later computes only the new trials)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the hidden numbers (default: %(default)s)")
    parser.add_argument("--no-generate", dest="generate", action="store_false", help="teacher-forced score only (one forward per prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new, help="greedy decoding steps (default: %(default)s)")


def add_task_arguments(parser: argparse.ArgumentParser, task: str) -> None:
    """Add the arguments of evaluation ``task`` to ``parser``."""
    _common(parser)
    if task == "perplexity":
        parser.add_argument("--data", default="builtin:python-docs",
                            help="text: .txt/.jsonl/.parquet file or folder, a datasets name[:config], or builtin:python-docs (default)")
        parser.add_argument("--text-field", help="JSON field / column holding the text (default: text, content, document, body)")
        parser.add_argument("--split", default="test", help="dataset split for a datasets name (default: %(default)s)")
        parser.add_argument("--max-segments", "--max-windows", dest="max_segments", type=int, default=8,
                            help="segments of each length scored (default: %(default)s; --max-windows is the old name)")
        parser.add_argument("--max-tokens", type=int,
                            help="at most max(1, N // length) segments per length, so every length reads the same first N tokens")
        parser.add_argument("--bos", choices=("auto", "yes", "no"), default="auto", help="start segments with BOS (default: when the tokenizer adds it)")
        parser.add_argument("--concatenate", action="store_true", help="join documents (EOS-separated) before cutting segments")
        parser.add_argument("--chunk-size", type=int, default=2048, help="positions per output-head chunk (default: %(default)s)")
    elif task == "passkey":
        _retrieval(parser, trials=10, max_new=10)
    elif task == "needle":
        parser.add_argument("--haystack", default="builtin:python-docs", help="text folder/file/dataset for the haystack (default: %(default)s)")
        parser.add_argument("--text-field", help="JSON field / column holding the text")
        parser.add_argument("--same-haystack", dest="vary_haystack", action="store_false",
                            help="every trial reads the haystack from its first sentence (default: each trial from its own seeded sentence)")
        _retrieval(parser, trials=10, max_new=12)
    else:
        raise ValueError(f"Unknown evaluation task {task!r}; one of {', '.join(TASKS)}.")


def _at_least_one(args: argparse.Namespace, option: str, what: str, dest: str | None = None) -> None:
    value = getattr(args, dest or option.lstrip("-").replace("-", "_"), None)
    if value is not None and value < 1:
        raise ValueError(f"{option} must be a positive number of {what}, got {value}.")


def check_task_arguments(task: str, args: argparse.Namespace) -> None:
    """Refuse bad evaluation arguments before any model is loaded or file written (one-line errors).

    Raises:
        ValueError: a bad number, factor, depth, device or ``--out``.
        FileNotFoundError: a text source that looks like a path but does not exist.
    """
    import math

    from hf_posext.text_sources import check_text_source
    from hf_posext.evaluation.loading import check_device_name
    from hf_posext.evaluation.runner import parse_floats

    _at_least_one(args, "--batch-size", "windows or prompts")
    _at_least_one(args, "--chunk-size", "tokens")
    _at_least_one(args, "--max-segments", "segments")
    _at_least_one(args, "--max-tokens", "tokens")
    _at_least_one(args, "--trials", "prompts")
    _at_least_one(args, "--max-new-tokens", "tokens")
    if args.factor is not None and not (math.isfinite(args.factor) and args.factor >= 1):
        raise ValueError(f"--factor must be a finite number >= 1, got {args.factor}; leave it out to use longest length / window.")
    if getattr(args, "depths", None) is not None:
        parse_floats(args.depths, "depth")
    for option in ("data", "haystack"):
        if getattr(args, option, None):
            check_text_source(getattr(args, option))
    if args.device:
        check_device_name(args.device)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file; give a folder for the results (new or existing).")
    check_output_folder(args.out, "--out", "the results")


def _requested_methods(args: argparse.Namespace) -> str:
    """``--methods`` as given; else the scaling ``--adapter`` was trained with (``yarn:factor=4``), else
    :data:`DEFAULT_METHODS`."""
    if getattr(args, "methods", None) is not None:
        return args.methods
    adapter = getattr(args, "adapter", None)
    if adapter:
        from hf_posext.adapters import read_adapter_record
        from hf_posext.core.request import ScalingRequest, format_request

        record = read_adapter_record(adapter)  # its parameters too (a yarn adapter trained at beta_fast=16)
        return format_request(ScalingRequest.from_kwargs(record.method, record.factor, **record.params))
    return DEFAULT_METHODS


def run_task(task: str, args: argparse.Namespace) -> int:
    """Run evaluation ``task`` with parsed ``args``; prints a summary table and writes plots."""
    from hf_posext.evaluation.loading import transformers_progress_bars

    with transformers_progress_bars(args.progress):
        return _run_task(task, args)


def _run_task(task: str, args: argparse.Namespace) -> int:
    from hf_posext.evaluation.arguments import parse_lengths, parse_methods
    from hf_posext.lm.distributed import Distributed

    started = time.time()
    methods = parse_methods(_requested_methods(args), parse_param_items(args.param))
    lengths = parse_lengths(args.lengths)
    check_task_arguments(task, args)
    dist = Distributed()
    if args.device_map and dist.world_size > 1:
        raise ValueError("--device-map spreads one model over devices: run it in one process (not under accelerate launch with several).")
    device = None if args.device_map else (args.device or dist.default_device())
    adapter = getattr(args, "adapter", None)
    if adapter:
        from hf_posext.adapters import check_adapter

        for method in methods:  # every method, before anything loads
            record = check_adapter(adapter, args.model, method.method, method.factor if method.factor is not None else args.factor,
                                   method.params_dict)
        if args.factor is None:  # not longest length / window: the factor the adapter was trained with
            args.factor = record.factor
    if task != "perplexity":
        _check_prompt_lengths(task, args, lengths)
    # one run of a task and model writes a results folder at a time (the main process holds it for every process);
    # other tasks or models may run beside it: each writes files of its own
    from hf_posext.evaluation.store import results_part

    with held_by_main(dist, args.out, results_part(task, f"{args.model}+{adapter}" if adapter else args.model)):
        return _run_task_holding_folder(task, args, methods, lengths, dist, device, adapter, started)


@contextlib.contextmanager
def held_by_main(dist: Any, out: str, part: str | None = None) -> Iterator[None]:
    """Hold ``out``'s lock (or its ``part``'s) in the main process; every process raises the same one line if
    another run holds it."""
    from hf_posext.core.locks import hold_folder_on_main

    with contextlib.ExitStack() as stack:
        hold_folder_on_main(stack, out, "--out", "the results", main=dist.is_main, part=part,
                            share=lambda refusal: dist.gather([refusal] if refusal else []))
        yield


def _run_task_holding_folder(task: str, args: argparse.Namespace, methods: Any, lengths: list[int], dist: Any, device: Any,
                             adapter: str | None, started: float) -> int:
    """:func:`_run_task` once its arguments are checked and its folder is held."""
    from hf_posext.evaluation import needle, passkey, perplexity
    from hf_posext.evaluation.report import markdown_tables, write_plots
    from hf_posext.evaluation.arguments import parse_floats
    from hf_posext.evaluation.loading import dtype_line, load_model_and_tokenizer, resolve_dtype

    dtype, why = resolve_dtype(args.dtype, task, device)
    if dist.is_main:
        print(dtype_line(dtype, why), file=sys.stderr)
    args.dtype = dtype  # the dtype run, and the one the results are keyed by
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=device, device_map=args.device_map,
                                                attn_implementation=args.attn_implementation, adapter=adapter)
    model_name = f"{args.model}+{adapter}" if adapter else args.model
    common: dict[str, Any] = dict(
        methods=methods, lengths=lengths, factor=args.factor, out_dir=args.out, model_name=model_name, batch_size=args.batch_size,
        overwrite=args.overwrite, reuse_identical=args.reuse_identical, dist=dist, extra_config={"dtype": args.dtype},
        progress=args.progress,
    )
    if task == "perplexity":
        store = perplexity.evaluate_perplexity(
            model, tokenizer, data=args.data, max_segments=args.max_segments, max_tokens=args.max_tokens, bos=args.bos, concatenate=args.concatenate,
            text_field=args.text_field, split=args.split, chunk_size=args.chunk_size, **common,
        )
    else:
        retrieval = dict(depths=parse_floats(args.depths, "depth"), trials=args.trials, seed=args.seed, generate=args.generate,
                         max_new_tokens=args.max_new_tokens)
        if task == "passkey":
            store = passkey.evaluate_passkey(model, tokenizer, **retrieval, **common)
        else:
            store = needle.evaluate_needle(model, tokenizer, haystack=args.haystack, text_field=args.text_field,
                                           vary_haystack=args.vary_haystack, **retrieval, **common)
    if dist.is_main:
        print(markdown_tables([store.data]))
        # Plots cover every results file in the folder (other models and tasks included), so an
        # evaluation never replaces a plot with one showing only its own cells.
        plots = write_plots(_folder_runs(args.out, store.data), args.out)
        print(f"\nresults: {store.path} (+ .csv); plots: {', '.join(str(p) for p in plots)}; {time.time() - started:.0f} s")
    return 0


def _check_prompt_lengths(task: str, args: argparse.Namespace, lengths: list[int]) -> None:
    """Refuse a length too short for the task's prompts before the weights load (only the tokenizer is read)."""
    from hf_posext.evaluation.arguments import parse_floats
    from hf_posext.evaluation.loading import AsciiTokenizer, is_tiny_model_name
    from hf_posext.evaluation.needle import check_needle_lengths
    from hf_posext.evaluation.passkey import check_passkey_lengths
    from hf_posext.models import load_tokenizer

    tokenizer = AsciiTokenizer() if is_tiny_model_name(args.model) else load_tokenizer(args.model)
    check = check_passkey_lengths if task == "passkey" else check_needle_lengths
    check(tokenizer, lengths, parse_floats(args.depths, "depth"), args.trials, args.seed, args.max_new_tokens)


def _folder_runs(folder: str, current: dict[str, Any]) -> list[dict[str, Any]]:
    """Every results file in ``folder`` (this run's is written by now); just this run if none can be read."""
    from hf_posext.evaluation.report import load_results
    from hf_posext.evaluation.results_files import ResultsFileError

    try:
        return load_results(folder)
    except ResultsFileError as error:  # named, not silently left out of the plots
        print(f"warning: plots cover only this run: {error}", file=sys.stderr)
        return [current]
    except (FileNotFoundError, ValueError):
        return [current]


def main_task(task: str, argv: list[str] | None = None) -> int:
    """Entry point of ``eval/<task>.py``: parse arguments and run (an error prints one line; exit 2 usage, 1 runtime)."""
    parser = argparse.ArgumentParser(prog=f"eval/{task}.py", description=f"{task} evaluation, scaling methods side by side")
    add_task_arguments(parser, task)
    args = parser.parse_args(argv)
    return run_reporting_errors(task, lambda: run_task(task, args))


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    from hf_posext.cli import card_command

    # "card", the suite's old name, parses but is not listed
    sub = parser.add_subparsers(dest="task", required=True, metavar="{" + ",".join([*TASKS, "suite"]) + "}")
    for task in TASKS:
        add_task_arguments(sub.add_parser(task, help=f"{task} evaluation"), task)
    card_command.add_arguments(sub.add_parser("suite", help=card_command.HELP, description=card_command.HELP))
    card_command.add_arguments(sub.add_parser("card", description=card_command.OLD_NAME_HELP))


def run_eval(args: argparse.Namespace) -> int:
    if args.task in ("suite", "card"):
        from hf_posext.cli import card_command

        return card_command.run(args)
    return run_task(args.task, args)


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", nargs="+",
                        help="a results folder written by hf-posext eval / eval/*.py, or the --out folder of hf-posext eval "
                             "suite (its card is written again from card.json and its sample files); several card folders "
                             "with --out: one card combining them")
    parser.add_argument("--out", help="where to write report.md and the plots (default: the results folder)")
    parser.add_argument("--compare", nargs=2, action="append", default=[], metavar=("FIRST", "SECOND"),
                        help="add a table of the passkey and needle trials that only one of two series found, with the "
                             "exact sign test; series names as the report's tables show them (repeatable)")


def _run_report(args: argparse.Namespace) -> int:
    from hf_posext.evaluation.report import write_report

    folders = list(args.folder)
    if len(folders) > 1:
        return _combine_cards(args, folders)
    args.folder = folders[0]
    if (Path(args.folder) / "card.json").is_file():
        return _rewrite_card(args)
    markdown, plots = write_report(args.folder, args.out, [tuple(pair) for pair in args.compare])
    print(markdown)
    print("\nplots: " + ", ".join(str(p) for p in plots))
    print(f"HTML report (self-contained, opens offline): {Path(args.out or args.folder) / 'report.html'}")
    return 0


def _rewrite_card(args: argparse.Namespace) -> int:
    from hf_posext.card.folder import rewrite_card

    if args.compare:
        raise ValueError(f"--compare: {args.folder} is a suite's card, which compares its rows on the same RULER samples "
                         f"itself; for passkey and needle run hf-posext report {Path(args.folder) / 'tasks'} --compare A B.")
    paths = rewrite_card(args.folder, args.out)
    print(paths["markdown"].read_text(encoding="utf-8").rstrip("\n"))  # the card.md just written
    print(f"\ncard: {paths['html']} (+ {paths['json'].name}, {paths['markdown'].name}, plots)")
    return 0


def _combine_cards(args: argparse.Namespace, folders: list[str]) -> int:
    from hf_posext.card.folder import CARD_FILE, combine_cards

    not_cards = [f for f in folders if not (Path(f) / CARD_FILE).is_file()]
    if not_cards:
        raise ValueError(f"{not_cards[0]} holds no card.json: several folders are combined only as suite cards "
                         "(the --out folders of hf-posext eval suite); pass one results folder at a time otherwise.")
    if not args.out:
        raise ValueError("several card folders: pass --out FOLDER for the combined card (not one of them).")
    if args.compare:
        raise ValueError("--compare applies to a passkey and needle results folder, not to combined suite cards.")
    paths = combine_cards(folders, args.out)
    print(paths["markdown"].read_text(encoding="utf-8").rstrip("\n"))  # the card.md just written
    print(f"\ncard: {paths['html']} (+ {paths['json'].name}, {paths['markdown'].name}, plots), combined from {len(folders)} cards")
    return 0


# The report command's functions, under the names the command table uses.
add_report_arguments = _add_report_arguments
run_report = _run_report
