"""Layer 1: every scaling method of every kind, as pure functions of numbers, in one registry.

Kinds: ``rope`` (:mod:`.rope`), ``learned`` / ``sinusoidal`` / ``alibi`` (:mod:`.learned`),
``attention`` (:mod:`.attention`: Self-Extend; :mod:`.dual_chunk`: Dual Chunk Attention;
:mod:`.shifted_positions`: STRING) and ``relative`` (:mod:`.relative`: T5 bias).
Importing this package registers all of them.
"""

# Registration order is the order kinds are listed in: rope, absolute kinds, attention, relative.
from hf_posext.methods import rope  # noqa: F401, I001
from hf_posext.methods import learned  # noqa: F401
from hf_posext.methods import attention  # noqa: F401
from hf_posext.methods import dual_chunk  # noqa: F401
from hf_posext.methods import shifted_positions  # noqa: F401
from hf_posext.methods import relative  # noqa: F401
from hf_posext.methods.registry import (
    BASELINE,
    COMPOSITION_SEPARATOR,
    METHODS,
    Method,
    available_methods,
    check_method_name,
    get_method,
    kinds_of,
    register_alias,
    register_method,
    resolve_method,
    split_composition,
)

__all__ = ["Method", "register_method", "register_alias", "get_method", "resolve_method", "available_methods", "kinds_of",
           "check_method_name", "split_composition", "COMPOSITION_SEPARATOR", "METHODS", "BASELINE"]
