"""lm-evaluation-harness subcommands; the harness is imported only when one runs.

* ``hf-posext lm-eval <lm_eval arguments>``: the harness's own CLI with the ``hf-posext`` model
  registered; every argument goes to the harness unchanged (see :mod:`hf_posext.integrations.lm_eval.launcher`).
* ``hf-posext lm-eval-compare MODEL --methods none yarn:factor=2 ... --tasks ...``: one model under
  several methods on the same tasks (built once), printed as a table (:func:`hf_posext.integrations.lm_eval.compare.compare_methods`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from hf_posext.models import embedded_names

__all__ = ["add_arguments", "run", "add_compare_arguments", "run_compare", "compare_dtype"]

HELP = "run lm-evaluation-harness (any task) on a scaled model: --model hf-posext"
_EPILOG = """\
All arguments are lm-eval's own (`lm-eval run --help`); hf-posext adds the model `hf-posext` with
model arg posext=REQUEST, e.g. posext=yarn:factor=4:beta_fast=16 (docs: the request grammar).

example:
  hf-posext lm-eval run --model hf-posext --device cpu --limit 10 \\
    --model_args pretrained=smollm2-135m,posext=yarn:factor=2,dtype=float32 \\
    --tasks niah_single_1 --metadata '{"max_seq_lengths": [16384]}'
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything is passed through to the harness (``args.extra``)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.set_defaults(accepts_extra=True)


def run(args: argparse.Namespace) -> int:
    """Hand ``args.extra`` to the harness's CLI with ``hf-posext`` registered."""
    from hf_posext.integrations.lm_eval.launcher import main

    return main(list(args.extra))


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-posext lm-eval-compare``."""
    parser.add_argument("model", help=f"hub name, local folder, {embedded_names()}")
    parser.add_argument("--methods", nargs="+", required=True, metavar="SPEC",
                        help="scaling requests (docs/request-grammar.md), e.g. none yarn:factor=2 dynamic-yarn:factor=2:beta_fast=16")
    parser.add_argument("--tasks", nargs="+", required=True, help="harness task names, e.g. niah_single_1 ruler_vt")
    parser.add_argument("--seq-lengths", nargs="+", type=int, help="RULER lengths (metadata max_seq_lengths)")
    parser.add_argument("--limit", type=float, help="samples per task")
    parser.add_argument("--max-length", type=int,
                        help="context limit for every method (default: each model's scaled window; set it so an "
                             "unscaled baseline is not truncated to its own window)")
    parser.add_argument("--model-args", default="", help="extra hf model args, e.g. dtype=float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", default="1")
    parser.add_argument("--include-path", help="folder of extra task YAMLs")
    parser.add_argument("--out", help="JSON file for the rows, the scaling reports and the settings")
    chat = parser.add_argument_group("chat formatting (passed to the harness as its own options)")
    chat.add_argument("--apply_chat_template", nargs="?", const=True, default=False, metavar="TEMPLATE",
                      help="apply the tokenizer's chat template (optionally a named one) to every prompt")
    chat.add_argument("--fewshot_as_multiturn", nargs="?", const=True, default=None, type=_parse_bool, metavar="BOOL",
                      help="few-shot examples as chat turns (default: on with --apply_chat_template)")
    chat.add_argument("--system_instruction", metavar="TEXT", help="a system message before every prompt")


def _parse_bool(text: str) -> bool:
    """``true``/``1``/``yes`` or ``false``/``0``/``no`` (any case)."""
    value = text.strip().lower()
    if value not in ("true", "1", "yes", "false", "0", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in ("true", "1", "yes")


def run_compare(args: argparse.Namespace) -> int:
    """Run :func:`hf_posext.integrations.lm_eval.compare.compare_methods` and print its table."""
    from hf_posext.integrations.lm_eval.compare import compare_methods, format_comparison
    from hf_posext.integrations.lm_eval.launcher import import_harness

    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise ValueError("--fewshot_as_multiturn needs --apply_chat_template (few-shot turns are chat messages).")

    import_harness()  # a clear message when lm-eval is missing
    from lm_eval.utils import simple_parse_args_string
    from hf_posext.evaluation.loading import dtype_line

    print(dtype_line(*compare_dtype(simple_parse_args_string(args.model_args), args.model)), file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    limit = None if args.limit is None else (int(args.limit) if float(args.limit).is_integer() else args.limit)
    batch_size = int(args.batch_size) if str(args.batch_size).isdigit() else args.batch_size
    rows = compare_methods(
        args.model, args.methods, args.tasks, max_seq_lengths=args.seq_lengths, limit=limit,
        max_length=args.max_length, model_args=simple_parse_args_string(args.model_args), device=args.device,
        batch_size=batch_size, include_path=args.include_path, output_path=args.out,
        apply_chat_template=args.apply_chat_template, fewshot_as_multiturn=args.fewshot_as_multiturn,
        system_instruction=args.system_instruction,
    )
    print(format_comparison(rows))
    return 0


def compare_dtype(model_args: dict, pretrained: str) -> tuple[str, str]:
    """The dtype ``lm-eval-compare`` loads ``pretrained`` in, and why, in words (it prints them first).

    ``--model-args dtype=X`` is taken as given; without it the harness loads the checkpoint's own dtype (its
    ``config.json``), read here where the folder is local or embedded (``smollm2-135m``: float32).
    """
    import json
    from pathlib import Path

    from hf_posext.models import resolve_model_path

    given = model_args.get("dtype")
    if given not in (None, "", "auto"):
        return str(given), f"--model-args dtype={given}, as given"
    config = Path(resolve_model_path(pretrained)).expanduser() / "config.json"
    saved = None
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        saved = data.get("dtype") or data.get("torch_dtype")
    why = "no dtype in --model-args: lm-eval loads the checkpoint's own dtype, from its config.json; " \
          "pass --model-args dtype=float32 to choose one"
    return str(saved) if saved else "the checkpoint's own", why
