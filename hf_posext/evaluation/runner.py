"""Former home of the evaluation machinery, kept so that existing imports keep working.

The machinery now lives one concern per module:

- :mod:`hf_posext.evaluation.loading`: :func:`load_model_and_tokenizer`, :class:`AsciiTokenizer`;
- :mod:`hf_posext.evaluation.arguments`: :func:`parse_methods`, :func:`parse_lengths`, :func:`parse_floats`;
- :mod:`hf_posext.evaluation.fingerprints`: :func:`rope_frequencies`, :func:`same_frequencies`;
- :mod:`hf_posext.evaluation.store`: :class:`ResultStore`, :func:`versions`;
- :mod:`hf_posext.evaluation.grid`: :func:`run_grid` and its cells and units;
- :mod:`hf_posext.lm.distributed` and :mod:`hf_posext.lm.scoring`: processes and scoring.

New code imports from those modules (or from :mod:`hf_posext.evaluation`).
"""

from hf_posext.evaluation.arguments import MethodRequest, parse_floats, parse_lengths, parse_methods
from hf_posext.evaluation.fingerprints import rope_fingerprint, rope_frequencies, same_frequencies
from hf_posext.evaluation.grid import Cell, Unit, apply_method, resolve_factor_for, run_grid
from hf_posext.evaluation.loading import AsciiTokenizer, load_model_and_tokenizer
from hf_posext.evaluation.store import ResultStore, versions
from hf_posext.lm.distributed import Distributed
from hf_posext.lm.scoring import base_model, head_logits

__all__ = [
    "AsciiTokenizer",
    "Distributed",
    "MethodRequest",
    "ResultStore",
    "Unit",
    "Cell",
    "load_model_and_tokenizer",
    "parse_methods",
    "parse_lengths",
    "parse_floats",
    "resolve_factor_for",
    "apply_method",
    "run_grid",
    "rope_fingerprint",
    "rope_frequencies",
    "same_frequencies",
    "base_model",
    "head_logits",
    "versions",
]
