"""Layer 6: the ``hf-posext`` command (the table of subcommands is in :mod:`hf_posext.cli.main`)."""

from hf_posext.cli.main import SUBCOMMANDS, build_parser, main, parse_method_params

__all__ = ["main", "build_parser", "SUBCOMMANDS", "parse_method_params"]
