"""Run lm-evaluation-harness's own command line with the ``hf-posext`` model registered.

``python -m hf_posext.integrations.lm_eval <lm_eval arguments>``, ``accelerate launch -m hf_posext.integrations.lm_eval ...`` and
``hf-posext lm-eval ...`` take exactly the arguments of the harness's ``lm-eval`` command; this module
only imports the registration (:mod:`hf_posext.integrations.lm_eval.model`), maps embedded model names
(``pretrained=smollm2-135m``) to their local folder so that tasks which load the tokenizer by name
(RULER's synthetic data) find it offline, and hands over to the harness's own entry point.

Example:
    python -m hf_posext.integrations.lm_eval run --model hf-posext \\
        --model_args pretrained=smollm2-135m,posext=yarn:factor=2,dtype=float32 \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths": [16384]}' --limit 10 --device cpu
"""

from __future__ import annotations

import re
import sys

__all__ = ["main", "resolve_embedded_names", "import_harness", "MIN_LM_EVAL_VERSION"]

#: The oldest harness release whose CLI (``lm_eval.__main__.cli_evaluate``) this was tested with.
MIN_LM_EVAL_VERSION = "0.4.13"

_MODEL_NAME_KEYS = ("pretrained", "tokenizer")


def resolve_embedded_names(argv: list[str]) -> list[str]:
    """Replace ``pretrained=<embedded>`` / ``tokenizer=<embedded>`` in harness arguments by local paths.

    The harness hands ``--model_args`` to tasks as metadata, and RULER loads its tokenizer with
    ``AutoTokenizer.from_pretrained(pretrained)``: an embedded name such as ``smollm2-135m`` must be a
    folder by then. Both ``key=value,key=value`` and JSON forms are handled; other text is untouched.

    Args:
        argv: the arguments after the program name.

    Returns:
        A new list with embedded names replaced (building the embedded model once if needed).
    """
    from hf_posext.models import EMBEDDED_MODELS, resolve_model_path

    names = "|".join(re.escape(name) for name in EMBEDDED_MODELS)
    keys = "|".join(_MODEL_NAME_KEYS)
    plain = re.compile(rf"(?<![\w.-])({keys})=({names})(?=,|\s|$)", re.IGNORECASE)
    quoted = re.compile(rf"(\"(?:{keys})\"\s*:\s*\")({names})(\")", re.IGNORECASE)
    resolved = []
    for argument in argv:
        argument = plain.sub(lambda m: f"{m.group(1)}={resolve_model_path(m.group(2))}", argument)
        argument = quoted.sub(lambda m: f"{m.group(1)}{resolve_model_path(m.group(2))}{m.group(3)}", argument)
        resolved.append(argument)
    return resolved


def import_harness():
    """The harness module and its CLI entry point, or a one-line SystemExit saying how to install it."""
    try:
        import lm_eval
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise SystemExit(
            "lm-evaluation-harness is not installed: pip install 'hf-posext[lm-eval]' "
            f"(or pip install 'lm-eval[ruler]>={MIN_LM_EVAL_VERSION}'). ({error})"
        ) from error
    return lm_eval, cli_evaluate


def main(argv: list[str] | None = None) -> int:
    """Run the harness's CLI with ``hf-posext`` registered.

    Args:
        argv: harness arguments (default: ``sys.argv[1:]``), e.g. ``["run", "--model", "hf-posext", ...]``.

    Returns:
        0 when the harness finished (it exits by itself on errors).
    """
    _, cli_evaluate = import_harness()
    import hf_posext.integrations.lm_eval.model  # noqa: F401  (registers "hf-posext")

    arguments = resolve_embedded_names(list(sys.argv[1:] if argv is None else argv))
    saved_argv = sys.argv
    # The harness parses sys.argv itself (and inserts "run" when no subcommand is given).
    sys.argv = ["lm-eval", *arguments]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved_argv
    return 0
