"""A saved record checked against what it sits in: the config's RoPE fields, and the digest it was saved with.

``config.hf_posext`` is what :func:`hf_posext.load` rebuilds the model from, so a record edited by hand (a factor of
4 where the saved ``rope_parameters`` say 2, an ``original_config`` window of 4096 for a 128-window model) would load,
and later unpatch to, a model other than the one saved. Two checks, both before any weight loads:

- the record against the config's RoPE dict, where transformers' ``rope_type`` is the record's method (the saved
  factor and pre-training window must be the record's), naming both values;
- the record's content against its digest (:data:`hf_posext.core.record.DIGEST_FIELD`), which catches an edit of
  any field. Records saved before digests have none: they are read as before, with one warning line saying that
  their content is not checked (a digest removed by hand reads the same).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from hf_posext.core.errors import RecordError
from hf_posext.core.record import CONFIG_KEY, DIGEST_FIELD, FREQUENCY_FIELD, record_digest, text_config
from hf_posext.core.saved_config import flat_rope_parameters
from hf_posext.methods.transformers import method_for_rope_type

__all__ = ["check_record_matches_config", "check_record_digest"]

_FIX = f"re-save the model with hf_posext, or remove {CONFIG_KEY!r} from config.json to load it unscaled"


def _rope_records(record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(field name, record)`` of the RoPE records in ``record``: itself, or a composition's frequency part."""
    if record.get("kind") == "rope":
        return [(repr(CONFIG_KEY), record)]
    frequency = record.get(FREQUENCY_FIELD)
    return [(f"{CONFIG_KEY!r}.{FREQUENCY_FIELD}", frequency)] if isinstance(frequency, dict) else []


def check_record_matches_config(record: dict[str, Any], config: Any, source: str) -> None:
    """Refuse a RoPE record whose factor or window the config's own ``rope_parameters`` contradict.

    Only a flat RoPE dict whose ``rope_type`` is the record's method is compared (a per-layer-type dict, or a
    method transformers does not have, holds nothing to compare).

    Args:
        record: a validated record (``config.hf_posext``).
        config: the loaded config it came from.
        source: the file, named in the error.

    Raises:
        RecordError: the field, both values and the fix, in one line.
    """
    text = text_config(config)
    params = flat_rope_parameters({"rope_parameters": getattr(text, "rope_parameters", None),
                                   "rope_scaling": getattr(text, "rope_scaling", None)})
    if params is None:
        return
    rope_type = params.get("rope_type", params.get("type"))
    stock = method_for_rope_type(str(rope_type))
    for field, rope in _rope_records(record):
        if stock is None or stock[0] != rope.get("method") or rope.get("stock_loadable") is False:
            continue
        saved = params.get("factor")
        if isinstance(saved, (int, float)) and not math.isclose(float(saved), float(rope["factor"]), rel_tol=1e-6):
            raise RecordError(
                f"{source}: field {field}.factor is {rope['factor']:g}, but the config's rope_parameters (rope_type "
                f"{rope_type!r}) say factor {float(saved):g}: the record and the config disagree, so one was edited; {_FIX}."
            )
        window = params.get("original_max_position_embeddings")
        if isinstance(window, int) and window != rope["original_max_position_embeddings"]:
            raise RecordError(
                f"{source}: field {field}.original_max_position_embeddings is {rope['original_max_position_embeddings']}, "
                f"but the config's rope_parameters say {window}: the record and the config disagree, so one was edited; {_FIX}."
            )


def check_record_digest(record: dict[str, Any], source: str) -> None:
    """Refuse a record (or a composition's frequency part) whose content no longer matches its saved digest.

    Raises:
        RecordError: the field and the fix, in one line.
    """
    if record and record.get(DIGEST_FIELD) is None:
        warnings.warn(f"{source}: field {CONFIG_KEY!r} has no {DIGEST_FIELD} (saved by a release before digests, or "
                      "removed by hand), so a hand edit of it cannot be detected; re-save the model with hf_posext to "
                      "seal it.", stacklevel=3)
    frequency = record.get(FREQUENCY_FIELD)
    for field, part in ((repr(CONFIG_KEY), record), (f"{CONFIG_KEY!r}.{FREQUENCY_FIELD}", frequency)):
        if not isinstance(part, dict) or part.get(DIGEST_FIELD) is None:
            continue
        if part[DIGEST_FIELD] != record_digest(part):
            raise RecordError(
                f"{source}: field {field} was edited after hf_posext saved it (its content no longer matches its "
                f"{DIGEST_FIELD} {part[DIGEST_FIELD]!r}; a factor, window or original_config changed by hand would load "
                f"and unpatch to another model than the one saved); {_FIX}."
            )
