"""The one table of outcomes other than ``ok``: every refusal, every known crash, every class that is not built.

Keyed by ``(class name, method)``; the method ``"*"`` covers every method of that class, ``"attention"`` its
attention-level methods and their composition (:data:`ATTENTION_GROUP`). Each entry holds the
expected outcome and a piece of the one-line reason that must appear in what the sweep saw, so a reworded or
new failure shows up as a difference, and an entry that starts to pass shows up as stale. A family that a new
transformers release adds starts with no entry: anything but ``ok`` fails until it is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sweep's result type, for annotations only
    from hf_posext.family_sweep.sweep import FamilyResult

__all__ = ["ATTENTION_GROUP", "Expected", "KNOWN", "expected_outcome", "problems", "REFUSED", "XFAIL", "SKIPPED"]

REFUSED, XFAIL, SKIPPED = "refused", "xfail", "skipped"
#: The methods an ``"attention"`` entry covers.
ATTENTION_GROUP = ("self-extend", "dca", "string", "yarn+string")


@dataclass(frozen=True)
class Expected:
    """A listed outcome.

    Attributes:
        outcome: ``refused`` (``patch`` says no, in one line), ``xfail`` (a crash after a successful patch, or a
            wrong result: a backend bug still open) or ``skipped`` (no tiny instance can run here).
        reason: a piece of the one-line error that the sweep must see (and the matrix shows).
    """

    outcome: str
    reason: str


#: (class name, method or "*") -> what the sweep is expected to see there.
KNOWN: dict[tuple[str, str], Expected] = {
}


def expected_outcome(class_name: str, method: str) -> Expected | None:
    """The listed outcome of ``method`` on ``class_name``: its own entry, else its group's, else the class's ``"*"``."""
    group = KNOWN.get((class_name, "attention")) if method in ATTENTION_GROUP else None
    return KNOWN.get((class_name, method)) or group or KNOWN.get((class_name, "*"))


def problems(result: "FamilyResult") -> list[str]:
    """Every difference between a class's sweep and :data:`KNOWN`, one line each (empty: as expected).

    A skip, refusal or crash must be listed with a reason found in what the sweep saw; a listed entry that now
    passes is stale and must be removed.
    """
    name = result.class_name
    if not result.built:
        expected = KNOWN.get((name, "*"))
        if expected is None or expected.outcome != SKIPPED:
            return [f"{name} was not built ({result.reason}): give it a recipe in family_sweep/recipes.py, or list it "
                    f"as skipped in family_sweep/known.py with the reason"]
        return [] if expected.reason in result.reason else [f"{name}: skipped for another reason than listed: {result.reason}"]
    found = []
    for outcome in result.methods:
        expected = expected_outcome(name, outcome.method)
        seen = {"ok": None, "refused": REFUSED, "crash": XFAIL}[outcome.outcome]
        where = f"{name} / {outcome.method}"
        if seen is None and expected is not None and expected.outcome != SKIPPED:
            found.append(f"{where} is listed as {expected.outcome} ({expected.reason!r}) but now passes: remove it from KNOWN")
        elif seen is not None and (expected is None or expected.outcome != seen):
            found.append(f"{where}: {outcome.outcome}, not listed as such in family_sweep/known.py: {outcome.reason}")
        elif seen is not None and expected.reason not in outcome.reason:
            found.append(f"{where}: {outcome.outcome} for another reason than listed ({expected.reason!r}): {outcome.reason}")
    return found
