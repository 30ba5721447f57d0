"""hf-posext: extend the context window of pretrained transformers models in one call.

>>> import hf_posext
>>> hf_posext.patch(model, "yarn", factor=4)
>>> print(hf_posext.describe(model))
>>> hf_posext.unpatch(model)
"""

from hf_posext.api import describe, fixed_length, load, patch, unpatch
from hf_posext.core.errors import RecordError, UnsupportedModelError
from hf_posext.core.record import ScalingReport
from hf_posext.core.request import ScalingConfig, ScalingRequest
from hf_posext.core.version import VERSION
from hf_posext.methods import available_methods
from hf_posext.search import SearchResult, search_factors

__version__ = VERSION

__all__ = [
    "available_methods",
    "patch",
    "unpatch",
    "describe",
    "load",
    "fixed_length",
    "search_factors",
    "SearchResult",
    "ScalingConfig",
    "ScalingRequest",
    "RecordError",
    "ScalingReport",
    "UnsupportedModelError",
    "__version__",
]
