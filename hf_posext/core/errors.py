"""Errors every layer may raise, and how the command line reports them (one line, exit 2 or 1).

The rules (docs/errors.md): arguments are validated before a model is loaded or a file written; an
error names the thing and the fix on one line; the CLI prints it without a traceback and exits 2 for
usage errors (a bad argument, a missing path) or 1 for runtime errors (a file that exists but cannot be
used, a failure while running).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

__all__ = [
    "UnsupportedModelError",
    "RecordError",
    "check_model",
    "DamagedFileError",
    "exit_code_for",
    "one_line_message",
    "USAGE_EXIT_CODE",
    "RUNTIME_EXIT_CODE",
    "show_traceback",
    "run_reporting_errors",
]

#: Exit code of a usage error: a bad argument, option value or path the user gave.
USAGE_EXIT_CODE = 2
#: Exit code of a runtime error: a damaged file, a failure while loading or computing.
RUNTIME_EXIT_CODE = 1

#: Set this environment variable to 1 to see the traceback the CLI otherwise replaces by one line.
TRACEBACK_VARIABLE = "HF_POSEXT_TRACEBACK"


class UnsupportedModelError(ValueError):
    """The model has no positional encoding hf_posext recognises (the message says what was found)."""


class DamagedFileError(ValueError):
    """A file that exists cannot be used (truncated, corrupt, edited): the message names it.

    Subclasses name the kind of file (a saved record, a results file, a checkpoint). The CLI reports
    these as runtime errors (exit 1): the arguments were right, the data on disk is not.
    """


class RecordError(DamagedFileError):
    """A saved ``hf_posext`` record in a config is malformed (the message names the file and the field)."""


def check_model(model: Any) -> None:
    """Refuse what is not a transformers model (TypeError), or one whose weights are on the meta device (ValueError)."""
    from torch import nn

    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"Expected a transformers model (an nn.Module with a .config), got {type(model).__name__}. "
            "Load one with AutoModelForCausalLM.from_pretrained(...) or hf_posext.models.load_model(...)."
        )
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_meta:  # a meta model would fail half-way, deep in a probe or a table copy
            raise ValueError(
                f"the model's {name} is on the meta device (no data: built under init_empty_weights or "
                "torch.device('meta')); hf_posext finds and patches positions by running them, so load real "
                "weights first (from_pretrained, or to_empty() then load_state_dict)"
            )


_USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)


def exit_code_for(error: BaseException) -> int:
    """The CLI exit code for ``error``: 1 for a damaged file or a runtime failure, 2 for a usage error."""
    if isinstance(error, DamagedFileError):
        return RUNTIME_EXIT_CODE
    if isinstance(error, _USAGE_ERRORS):
        return USAGE_EXIT_CODE
    return RUNTIME_EXIT_CODE


def one_line_message(error: BaseException) -> str:
    """``error``'s message on one line; an unexpected kind of error is prefixed by its type name."""
    text = " ".join(str(error).split()) or "(no message)"
    if isinstance(error, (ValueError, TypeError, OSError)):
        return text
    return f"{type(error).__name__}: {text}"


def show_traceback() -> bool:
    """Whether the user asked for full tracebacks (``HF_POSEXT_TRACEBACK=1``)."""
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")


def run_reporting_errors(prog: str, run: Callable[[], "int | None"]) -> int:
    """Call ``run``; an exception becomes one line on stderr and exit code 2 (usage) or 1 (runtime).

    The line is ``{prog}: error: {message}`` (see :func:`exit_code_for`, :func:`one_line_message`);
    ``HF_POSEXT_TRACEBACK=1`` re-raises instead.
    """
    try:
        return int(run() or 0)
    except Exception as error:
        if show_traceback():
            raise
        print(f"{prog}: error: {one_line_message(error)}", file=sys.stderr)
        return exit_code_for(error)
