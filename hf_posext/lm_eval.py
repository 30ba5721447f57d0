"""Deprecated name of :mod:`hf_posext.integrations.lm_eval` (``python -m hf_posext.lm_eval``, old imports).

Importing it warns (``FutureWarning``); use ``hf-posext lm-eval`` or ``python -m hf_posext.integrations.lm_eval``.
"""

import sys
import warnings

from hf_posext.integrations.lm_eval.compare import compare_methods, format_comparison, parse_method_spec
from hf_posext.integrations.lm_eval.launcher import MIN_LM_EVAL_VERSION, import_harness, main, resolve_embedded_names

__all__ = ["main", "resolve_embedded_names", "import_harness", "parse_method_spec", "compare_methods", "format_comparison",
           "MIN_LM_EVAL_VERSION"]

warnings.warn("hf_posext.lm_eval is now hf_posext.integrations.lm_eval (command: hf-posext lm-eval); the old name "
              "will be removed", FutureWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(main())
