"""The ``hf-posext`` command.

Subcommands:
    methods                       list the scaling methods
    describe MODEL                family, method, factor, windows of a model (hub name, path, smollm2-135m)
    patch MODEL --method M ...    patch and save a model (+ tokenizer) to --out
    demo                          the main job on the embedded default model

Other subcommands (evaluation, reports, training) register themselves through ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

__all__ = ["main", "SUBCOMMANDS", "parse_method_params"]

#: name -> (help, add_arguments(parser), run(args) -> exit code). Modules add their own entries.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def parse_method_params(items: list[str] | None) -> dict[str, Any]:
    """Parse ``--param key=value`` items; values are read as JSON when they parse, else kept as text."""
    params: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--param expects key=value, got {item!r} (e.g. --param beta_fast=32).")
        key, value = item.split("=", 1)
        try:
            params[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            params[key.strip()] = value
    return params


def _add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, help="scaling method (see `hf-posext methods`)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--factor", type=float, help="scale factor s >= 1")
    group.add_argument("--target-length", type=int, help="window to reach (factor = target / original window)")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE", help="method parameter, repeatable")
    parser.add_argument("--original-max-position-embeddings", type=int, help="override the original window")


def _run_methods(args: argparse.Namespace) -> int:
    from hf_posext import available_methods

    methods = available_methods()
    width = max(map(len, methods))
    for name, summary in methods.items():
        print(f"{name:<{width}}  {summary}")
    return 0


def _run_describe(args: argparse.Namespace) -> int:
    import hf_posext
    from hf_posext.models import load_model

    model = hf_posext.load(args.model) if args.hf_posext_load else load_model(args.model)
    report = hf_posext.describe(model)
    print(json.dumps(report.to_dict(), indent=2, default=str) if args.json else report)
    return 0


def _run_patch(args: argparse.Namespace) -> int:
    import hf_posext
    from hf_posext.models import load_model, load_tokenizer

    model = load_model(args.model)
    hf_posext.patch(
        model, args.method, args.factor, target_length=args.target_length,
        original_max_position_embeddings=args.original_max_position_embeddings, **parse_method_params(args.param),
    )
    model.save_pretrained(args.out)
    try:
        load_tokenizer(args.model).save_pretrained(args.out)
    except Exception as error:  # a model folder without a tokenizer is still a valid output
        print(f"note: no tokenizer saved ({error})", file=sys.stderr)
    print(hf_posext.describe(model))
    print(f"saved to {args.out} (load with hf_posext.load({args.out!r}))")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from hf_posext.demo import run_demo

    return run_demo(quick=args.quick, out_dir=args.out)


def _builtin_subcommands() -> None:
    def describe_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="hub name, local folder or smollm2-135m")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--no-hf-posext-load", dest="hf_posext_load", action="store_false",
                       help="load with plain from_pretrained (ignore a saved hf_posext scaling)")

    def patch_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="hub name, local folder or smollm2-135m")
        _add_scaling_arguments(p)
        p.add_argument("--out", required=True, help="folder to save the patched model to")

    def demo_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--quick", action="store_true", help="shorter lengths (a smoke run)")
        p.add_argument("--out", help="results folder (default: results/demo, or results/demo-quick with --quick)")

    SUBCOMMANDS.setdefault("methods", ("list the scaling methods", lambda p: None, _run_methods))
    SUBCOMMANDS.setdefault("describe", ("describe a model's position scaling", describe_args, _run_describe))
    SUBCOMMANDS.setdefault("patch", ("patch a model and save it", patch_args, _run_patch))
    SUBCOMMANDS.setdefault("demo", ("run the main job on smollm2-135m", demo_args, _run_demo))


def _plugin_subcommands() -> None:
    # Optional modules contribute subcommands; a missing optional dependency only hides them.
    import importlib

    for module in ("hf_posext.evaluation.cli", "hf_posext.training.cli", "hf_posext.lm_eval_cli", "hf_posext.inspect_cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("hf_posext"):
                raise


def build_parser() -> argparse.ArgumentParser:
    _builtin_subcommands()
    _plugin_subcommands()
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
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"hf-posext {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run through the importable module so subcommands that plugins registered into
    # `hf_posext.cli.SUBCOMMANDS` are seen (under `python -m`, this file is `__main__`, a second copy).
    from hf_posext.cli import main as _main

    sys.exit(_main())
