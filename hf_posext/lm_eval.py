"""Kept for ``python -m hf_posext.lm_eval`` and old imports; the code is in :mod:`hf_posext.integrations.lm_eval`."""

import sys

from hf_posext.integrations.lm_eval.compare import compare_methods, format_comparison, parse_method_spec
from hf_posext.integrations.lm_eval.launcher import MIN_LM_EVAL_VERSION, import_harness, main, resolve_embedded_names

__all__ = ["main", "resolve_embedded_names", "import_harness", "parse_method_spec", "compare_methods", "format_comparison",
           "MIN_LM_EVAL_VERSION"]

if __name__ == "__main__":
    sys.exit(main())
