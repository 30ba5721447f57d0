"""``hf-posext export DIR --for TARGET --out OUT``: a saved model re-configured for a serving runtime.

The argparse edge of :func:`hf_posext.export.export`: it reads the command line and calls the typed library
function; a refusal (:class:`~hf_posext.export.ExportError`) is one line on stderr and exit status 2.

Example:
    hf-posext export runs/yarn4 --for vllm --out runs/yarn4-vllm
"""

from __future__ import annotations

import argparse
import sys

from hf_posext.export import TARGETS, ExportError, export

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hf-posext export`` arguments to ``parser``."""
    parser.add_argument("model", help="a folder saved by hf_posext (save_pretrained of a patched model)")
    parser.add_argument("--for", dest="target", required=True, choices=TARGETS, help="the runtime that will serve it")
    parser.add_argument("--out", required=True, help="the new folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")


def run(args: argparse.Namespace) -> int:
    """Run ``hf-posext export``: 0 on success, 2 with a one-line error when it refuses."""
    try:
        out = export(args.model, args.target, args.out, overwrite=args.overwrite)
    except ExportError as error:
        print(f"hf-posext export: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out} for {args.target}")
    return 0
