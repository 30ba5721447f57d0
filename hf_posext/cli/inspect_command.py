"""``hf-posext inspect MODEL --method M --factor s [--plot out.png]``: per-dimension RoPE wavelengths.

Prints, for every RoPE dimension pair of MODEL, the original and scaled wavelength against the
original window and whether the method extrapolates, interpolates or blends it (see
:mod:`hf_posext.wavelengths`); ``--plot`` also draws it. Only the config is needed: weights are
not loaded (hub names, local folders and ``smollm2-135m`` work; ``tiny[:FAMILY[:WINDOW]]`` is a test model).

Examples:
    hf-posext inspect smollm2-135m --method yarn --factor 4 --plot yarn.png
    hf-posext inspect smollm2-135m --method longrope --factor 2 --param factors=search.json --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hf_posext.cli.scaling_arguments import add_scaling_arguments, request_from_arguments
from hf_posext.models import embedded_names

__all__ = ["load_rotary_model", "add_arguments", "run"]


def load_rotary_model(name: str) -> Any:
    """A model whose rotary module can be read, without loading weights where possible.

    Weights stay on the meta device (``accelerate.init_empty_weights``); buffers, which hold the
    rotary frequencies, are real. ``tiny[:FAMILY[:WINDOW]]`` builds the tiny random test model.
    """
    if name == "tiny" or name.startswith("tiny:"):
        from hf_posext.evaluation.loading import load_model_and_tokenizer

        return load_model_and_tokenizer(name)[0]
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_posext.models import resolve_model_path

    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.config._name_or_path = name
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"hub name, local folder, {embedded_names()}, or tiny[:FAMILY[:WINDOW]]")
    add_scaling_arguments(parser)
    parser.add_argument("--plot", metavar="PNG", help="also draw the wavelengths to this PNG file")
    parser.add_argument("--json", action="store_true", help="print the table as JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from hf_posext.wavelengths import format_table, model_wavelength_table, plot_wavelengths

    request = request_from_arguments(args)
    model = load_rotary_model(args.model)
    table = model_wavelength_table(
        model, request.method, request.factor, target_length=request.target_length,
        original_max_position_embeddings=request.original_max_position_embeddings, name=args.model, **request.params_dict,
    )
    print(json.dumps(table.to_dict(), indent=2) if args.json else format_table(table))
    if args.plot:
        path = plot_wavelengths(table, args.plot)
        if not args.json:
            print(f"plot: {path}")
    return 0

