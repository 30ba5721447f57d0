"""The scaling request on the command line: ``--method yarn:factor=4`` (the request grammar), shared by
``hf-posext patch`` and ``hf-posext inspect``.

The older spelling ``--method yarn --factor 4 --param beta_fast=16`` still works for one release and prints
one deprecation line naming the new form.
"""

from __future__ import annotations

import argparse

from hf_posext.core.grammar import format_request, looks_like_request_text, parse_request
from hf_posext.core.request import ScalingRequest
from hf_posext.user_warnings import warn_at_caller

__all__ = ["add_scaling_arguments", "request_from_arguments"]

_OLD_FLAGS = (("factor", "--factor"), ("target_length", "--target-length"), ("param", "--param"),
              ("original_max_position_embeddings", "--original-max-position-embeddings"))


def add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--method REQUEST`` and the deprecated ``--factor / --target-length / --param / --original-...`` flags."""
    parser.add_argument("--method", required=True, metavar="REQUEST",
                        help="scaling request: METHOD:NAME=VALUE:..., e.g. yarn:factor=4, linear:target_length=32768, "
                             "yarn+string:factor=4:string.local_value=128 (`hf-posext methods` lists the methods)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--factor", type=float, help="deprecated: write yarn:factor=4")
    group.add_argument("--target-length", type=int, help="deprecated: write yarn:target_length=32768")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE", help="deprecated: write yarn:factor=4:beta_fast=16")
    parser.add_argument("--original-max-position-embeddings", type=int,
                        help="deprecated: write yarn:factor=4:original_max_position_embeddings=2048")


def request_from_arguments(args: argparse.Namespace) -> ScalingRequest:
    """The sized request the command line asks for.

    Raises:
        ValueError: a setting given both in ``--method`` and as a flag, no size, or any request error.
    """
    flags = [flag for name, flag in _OLD_FLAGS if getattr(args, name, None) is not None]
    if looks_like_request_text(args.method):
        if flags:
            raise ValueError(f"--method {args.method!r} carries its settings: leave out {', '.join(flags)} "
                             "(give each setting once).")
        return parse_request(args.method, where="--method").require_size()
    request = ScalingRequest.from_cli(args.method, args.factor, args.target_length, args.param,
                                      args.original_max_position_embeddings)
    if flags:
        verb = "is" if len(flags) == 1 else "are"
        warn_at_caller(f"{', '.join(flags)} {verb} deprecated and will be removed: write --method {format_request(request)}.",
                       FutureWarning)
    return request.require_size()
