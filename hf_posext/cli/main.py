"""The ``hf-posext`` command: one explicit table of subcommands (:data:`SUBCOMMANDS`).

Subcommands:
    methods                       list the scaling methods of every kind
    describe MODEL                family, method, factor, windows of a model (hub name, path, smollm2-135m)
    patch MODEL --method M ...    patch and save a model (+ tokenizer) to --out
    demo                          the main job on the embedded default model
    eval TASK ...                 perplexity / passkey / needle grids, or the suite (hf_posext.evaluation.cli)
    report FOLDER                 tables and plots from a results folder, or a card written again (hf_posext.evaluation.cli)
    train --config ...            fine-tuning recipes (hf_posext.training.cli)
    lm-eval, lm-eval-compare      lm-evaluation-harness (hf_posext.integrations.lm_eval.cli)
    inspect MODEL --method M      per-dimension RoPE wavelengths (hf_posext.cli.inspect_command)
    export DIR --for T --out D    a saved model re-configured for vllm / sglang / llama.cpp (hf_posext.cli.export_command)
    adapter convert|verify DIR    rewrite an adapter in the current format / check its files (hf_posext.cli.adapter_command)

Each command module only defines ``add_arguments(parser)`` and ``run(args) -> exit code``; this table
is the one place that names them (nothing registers itself on import).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from hf_posext.api import describe, load, patch
from hf_posext.cli import adapter_command, export_command, inspect_command
from hf_posext.cli.scaling_arguments import add_scaling_arguments, request_from_arguments
from hf_posext.core.errors import run_reporting_errors
from hf_posext.core.files import check_output_folder, staged_folder
from hf_posext.core.request import parse_param_items
from hf_posext.core.saved_config import save_tokenizer_with_max_length
from hf_posext.evaluation import cli as evaluation_cli
from hf_posext.integrations.lm_eval import cli as lm_eval_cli
from hf_posext.methods import available_methods, get_method
from hf_posext.models import embedded_names
from hf_posext.training import cli as training_cli

__all__ = ["main", "build_parser", "SUBCOMMANDS", "parse_method_params"]

def parse_method_params(items: list[str] | None) -> dict[str, Any]:
    """Parse ``--param key=value`` items (:func:`hf_posext.core.request.parse_param_items`); exits on a malformed item."""
    try:
        return parse_param_items(items)
    except ValueError as error:
        raise SystemExit(str(error)) from error


def _run_methods(args: argparse.Namespace) -> int:
    methods = available_methods()
    width = max(map(len, methods))
    for name, summary in methods.items():
        print(f"{name:<{width}}  {summary}")
    frequency = ", ".join(name for name in available_methods("rope") if name != "none" and not get_method(name).dynamic)
    attention = ", ".join(available_methods("attention"))
    print(f"\nCompose one frequency scaling ({frequency}) with one attention-level method ({attention}) by joining "
          "them with '+': --method yarn+string:factor=4 (the factor sizes the frequency part; the attention part is "
          "sized on the window it gives; a parameter both declare is written string.attention_factor=...).")
    return 0


def _run_describe(args: argparse.Namespace) -> int:
    from hf_posext.models import load_model

    model = load(args.model) if args.hf_posext_load else load_model(args.model)
    report = describe(model)
    print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else report)
    return 0


def _run_patch(args: argparse.Namespace) -> int:
    request = request_from_arguments(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file; give a folder to save the model in (new or existing)")
    check_output_folder(args.out, "--out", "the model")
    tokenizer = _tokenizer_to_save(args.model)  # a damaged tokenizer fails here, before the model loads
    model = load(args.model)  # any architecture; a saved scaling comes back and is then replaced
    patch(model, **request.patch_kwargs())
    with staged_folder(args.out, merge=True) as staging:  # nothing lands in --out unless every file was written
        model.save_pretrained(staging)
        if tokenizer is not None:  # model_max_length = the new window: serving runtimes cap the length there
            save_tokenizer_with_max_length(tokenizer, staging, describe(model).current_window)
    print(describe(model))
    if tokenizer is None:
        print(f"note: {args.model} has no tokenizer files, so none was saved beside the model", file=sys.stderr)
    print(f"saved to {args.out} (load with hf_posext.load({args.out!r}))")
    return 0


def _tokenizer_to_save(name: str) -> Any:
    """The tokenizer of model ``name``, or None for a local folder that has no tokenizer files (a model
    saved without one is still a valid model to patch).

    Raises:
        DamagedFileError: the folder's tokenizer files exist but cannot be loaded (names them).
    """
    from hf_posext.core.loading import tokenizer_files
    from hf_posext.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(name)
    if os.path.isdir(path) and not tokenizer_files(path):
        return None
    return load_tokenizer(name)


def _run_demo(args: argparse.Namespace) -> int:
    from hf_posext.demo import run_demo

    return run_demo(quick=args.quick, out_dir=args.out)


def _describe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"hub name, local folder, {embedded_names()}")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-hf-posext-load", dest="hf_posext_load", action="store_false",
                   help="load with plain from_pretrained (ignore a saved hf_posext scaling)")


def _patch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"hub name, local folder, {embedded_names()}")
    add_scaling_arguments(p)
    p.add_argument("--out", required=True, help="folder to save the patched model to")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="shorter lengths (a smoke run)")
    p.add_argument("--out", help="results folder (default: results/demo, or results/demo-quick with --quick)")


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]

#: Every subcommand: name -> (help, add_arguments(parser), run(args) -> exit code).
SUBCOMMANDS: dict[str, Command] = {
    "methods": ("list the scaling methods", lambda p: None, _run_methods),
    "describe": ("describe a model's position scaling", _describe_arguments, _run_describe),
    "patch": ("patch a model and save it", _patch_arguments, _run_patch),
    "demo": ("run the main job on smollm2-135m", _demo_arguments, _run_demo),
    "eval": ("evaluate methods side by side: perplexity, passkey, needle, or suite (all three, RULER and chat endings in one report)", evaluation_cli.add_eval_arguments, evaluation_cli.run_eval),
    "report": ("markdown tables and plots from a results folder; on an eval suite folder, its card written again", evaluation_cli.add_report_arguments, evaluation_cli.run_report),
    "train": ("fine-tune a model (LoRA/full, PoSE) from a recipe config", training_cli.add_train_arguments, training_cli.run_train),
    "lm-eval": (lm_eval_cli.HELP, lm_eval_cli.add_arguments, lm_eval_cli.run),
    "lm-eval-compare": ("compare scaling methods on lm-eval tasks (tasks built once)", lm_eval_cli.add_compare_arguments, lm_eval_cli.run_compare),
    "export": ("copy a saved model with a config that vLLM, SGLang or llama.cpp serves like transformers",
               export_command.add_arguments, export_command.run),
    "adapter": ("convert an adapter folder to PEFT's format with checksums, or verify its files",
                adapter_command.add_arguments, adapter_command.run),
    "inspect": ("per-dimension RoPE wavelengths of a model under a scaling method (table, --plot PNG)", inspect_command.add_arguments, inspect_command.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-posext", description="Extend the context window of transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return run_reporting_errors(f"hf-posext {args.command}", lambda: args.run(args))



if __name__ == "__main__":
    sys.exit(main())
