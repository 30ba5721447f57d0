"""``hf-posext adapter convert|verify``: the argparse edge of :mod:`hf_posext.adapters`.

It reads the command line and calls the typed library functions (:func:`~hf_posext.adapters.convert_adapter`,
:func:`~hf_posext.adapters.verify_adapter_files`); a refusal is reported by the CLI in one line (exit 2 or 1).

Example:
    hf-posext adapter verify runs/NAME/adapter
    hf-posext adapter convert runs/NAME/adapter runs/NAME/adapter-v2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_posext.adapters import (
    ADAPTER_RECORD, MANIFEST_FILE, check_adapter, check_convert_destination, convert_adapter, read_adapter_record,
    verify_adapter_files,
)
from hf_posext.user_warnings import warn_at_caller

__all__ = ["add_arguments", "run", "run_model_card"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hf-posext adapter`` arguments to ``parser``."""
    sub = parser.add_subparsers(dest="adapter_command", required=True)
    convert = sub.add_parser("convert", help="rewrite an adapter folder in the current format (PEFT modules_to_save, "
                                             "hub id, base weights fingerprint, manifest)")
    convert.add_argument("source", help="the adapter folder (runs/NAME/adapter)")
    convert.add_argument("out", nargs="?", help="the new folder (default: convert SOURCE in place)")
    convert.add_argument("--model", help="the base model (default: the one the adapter records)")
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    verify = sub.add_parser("verify", help="check an adapter folder's files against its manifest")
    verify.add_argument("source", help="the adapter folder")


def run_model_card(folder: Path) -> str | None:
    """A regenerated model card for an adapter inside a run folder (``RUN/adapter`` beside ``RUN/train_config.yaml``),
    keeping the measurements written under the old card's "## Measured"; None outside a run folder."""
    from hf_posext.training.model_card import adapter_model_card, measured_section

    run = folder.resolve().parent
    if not (run / "train_config.yaml").is_file():
        return None
    from hf_posext.training.config import load_config

    try:
        config = load_config(run / "train_config.yaml")
    except (ValueError, FileNotFoundError) as error:  # a recipe of an older schema: keep the folder's card
        warn_at_caller(f"{run / 'train_config.yaml'} cannot be read ({' '.join(str(error).split())[:120]}), so the model "
                       f"card of {folder} is kept as it is")
        return None
    record = json.loads((folder / ADAPTER_RECORD).read_text())
    old = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    return adapter_model_card(config, record, run / "log.jsonl", measured=measured_section(old))


def run(args: argparse.Namespace) -> int:
    """Run ``hf-posext adapter convert|verify``: 0 on success (errors are reported by the CLI, exit 2 or 1)."""
    source = Path(args.source)
    if args.adapter_command == "verify":
        has_manifest = verify_adapter_files(source)
        read_adapter_record(source)
        print(f"{source}: every file matches {MANIFEST_FILE}" if has_manifest else f"{source}: readable (no {MANIFEST_FILE})")
        return 0
    check_convert_destination(source, Path(args.out) if args.out else source)
    check_adapter(source, args.model or read_adapter_record(source).base_model)  # before the base model loads
    card = run_model_card(source)
    out = convert_adapter(source, args.out, base_model=args.model, model_card=card, overwrite=args.overwrite)
    print(f"wrote {out} (PEFT modules_to_save, {MANIFEST_FILE}; load it with hf_posext.adapters.load_adapted_model "
          "or stock PeftModel.from_pretrained on the patched base)")
    return 0
