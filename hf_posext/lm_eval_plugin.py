"""Deprecated name of :mod:`hf_posext.integrations.lm_eval.model` (importing either registers ``hf-posext``).

Importing it warns (``FutureWarning``); import ``hf_posext.integrations.lm_eval.model`` instead.
"""

import warnings

from hf_posext.integrations.lm_eval.model import MODEL_NAME, POSEXT_PREFIX, PosextHFLM, parse_posext_args

__all__ = ["MODEL_NAME", "POSEXT_PREFIX", "parse_posext_args", "PosextHFLM"]

warnings.warn("hf_posext.lm_eval_plugin is now hf_posext.integrations.lm_eval.model; the old name will be removed",
              FutureWarning, stacklevel=2)
