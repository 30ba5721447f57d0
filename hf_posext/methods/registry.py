"""Registry of position-scaling methods of every kind.

Each method registers itself once, by name and kind (``rope``, ``learned``, ``sinusoidal``, ``alibi``,
``attention``, ``relative``), with a parameter dataclass (validated in ``__post_init__``) and a pure
function that computes numbers from numbers. A method never touches a model: a backend
(:mod:`hf_posext.backends`) does the surgery. ``hf_posext.methods`` imports every method module, so
importing it is enough to see every method.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable

from hf_posext.methods.transformers import rope_type_for
from hf_posext.user_warnings import warn_at_caller

__all__ = [
    "Method",
    "register_method",
    "register_alias",
    "get_method",
    "resolve_method",
    "available_methods",
    "kinds_of",
    "check_method_name",
    "METHODS",
    "BASELINE",
]

#: The name every kind gives its unscaled baseline: the model's own positions, factor 1.
BASELINE = "none"


@dataclass(frozen=True)
class Method:
    """One registered scaling method.

    Attributes:
        name: the name users pass to ``hf_posext.patch`` (e.g. ``"yarn"``).
        summary: one line for ``available_methods()``: what it does and where it comes from.
        kind: ``"rope"``, ``"learned"``, ``"sinusoidal"``, ``"alibi"``, ``"attention"`` or ``"relative"``.
        params_cls: dataclass of the method's keyword parameters with the papers' defaults.
        compute: the pure function (see the method modules for its signature).
        dynamic: True when the frequencies depend on the current sequence length.
        size_params: parameters that size the extension by themselves (Self-Extend's ``group_size``):
            with one of them, neither ``factor`` nor ``target_length`` is needed.
        identity_at_one: ``factor=1`` gives the unscaled model exactly (static methods).
        renamed_params: ``(old name, new name)`` pairs: a parameter renamed since it was first published;
            the old name is still accepted, with a ``FutureWarning``.
        default_factor: the factor used when neither ``factor`` nor ``target_length`` is given (STRING: 1,
            its home is inside the window); None: a size is required.
    """

    name: str
    summary: str
    kind: str
    params_cls: type
    compute: Callable[..., Any]
    dynamic: bool = False
    size_params: tuple[str, ...] = ()
    identity_at_one: bool = False
    renamed_params: tuple[tuple[str, str], ...] = ()
    default_factor: float | None = None

    @property
    def transformers_type(self) -> str | None:
        """The ``rope_type`` transformers uses for the same rule, if any (:mod:`hf_posext.methods.transformers`)."""
        return rope_type_for(self.name) if self.kind == "rope" else None

    @property
    def baseline(self) -> bool:
        """Whether this is the kind's unscaled baseline (:data:`BASELINE`): it changes no number."""
        return self.name == BASELINE

    def canonical_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with every renamed parameter under its current name (a ``FutureWarning`` for each old one).

        Raises:
            ValueError: both the old and the new name of a parameter are given.
        """
        params = dict(params)
        for old, new in self.renamed_params:
            if old not in params:
                continue
            if new in params:
                raise ValueError(f"Method {self.name!r}: give {new}= only ({old}= is its old name), not both.")
            warn_at_caller(f"Method {self.name!r}: parameter {old!r} is now called {new!r}; the old name will be removed.",
                           FutureWarning)
            params[new] = params.pop(old)
        return params

    def parse_params(self, params: dict[str, Any]) -> Any:
        """Validate keyword parameters and return the method's parameter dataclass.

        Renamed parameters are accepted under their old name (see :meth:`canonical_params`).

        Raises:
            ValueError: an unknown parameter name (with the closest known one) or a bad value.
        """
        params = self.canonical_params(params)
        known = [f.name for f in dataclasses.fields(self.params_cls)]
        for key in params:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                allowed = ", ".join(known) if known else "none"
                raise ValueError(
                    f"Method {self.name!r} has no parameter {key!r}.{hint} Its parameters are: {allowed}."
                )
        return self.params_cls(**params)


# kind -> name -> Method. The same name may exist for several kinds ("linear" for RoPE and for learned
# tables); the model being patched decides the kind.
METHODS: dict[str, dict[str, Method]] = {}

# kind -> alias -> (the registered method it stands for, the note a backend reports when it is used).
ALIASES: dict[str, dict[str, tuple[str, str]]] = {}


def register_method(
    name: str,
    summary: str,
    kind: str,
    params_cls: type,
    dynamic: bool = False,
    size_params: tuple[str, ...] = (),
    identity_at_one: bool = False,
    renamed_params: tuple[tuple[str, str], ...] = (),
    default_factor: float | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``compute`` under ``name`` (see :class:`Method`)."""

    def decorator(compute: Callable[..., Any]) -> Callable[..., Any]:
        registry = METHODS.setdefault(kind, {})
        if name in registry:
            raise ValueError(f"A {kind} method named {name!r} is already registered.")
        registry[name] = Method(name, summary, kind, params_cls, compute, dynamic, size_params, identity_at_one, renamed_params,
                                default_factor)
        return compute

    return decorator


def register_alias(alias: str, kind: str, method: str, note: str) -> None:
    """Accept ``alias`` for ``kind`` as the registered ``method``, reporting ``note`` when it is used.

    For a name users reasonably pass that means another method on this kind of position (``linear`` on
    an ALiBi model changes no number: it is ``none`` there).
    """
    if method not in METHODS.get(kind, {}):
        raise ValueError(f"Cannot alias {alias!r} to {method!r}: no {kind} method has that name.")
    if alias in METHODS[kind]:
        raise ValueError(f"{alias!r} is already a {kind} method; an alias cannot hide it.")
    ALIASES.setdefault(kind, {})[alias] = (method, note)


def resolve_method(name: str, kind: str) -> tuple[Method, list[str]]:
    """The method ``name`` stands for on ``kind`` (following an alias) and the notes to report.

    Raises:
        TypeError, ValueError: as :func:`get_method`.
    """
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if isinstance(key, str) and key in ALIASES.get(kind, {}):
        method, note = ALIASES[kind][key]
        return METHODS[kind][method], [note]
    return get_method(name, kind), []


def get_method(name: str, kind: str = "rope") -> Method:
    """Return the registered method ``name`` of ``kind``.

    Args:
        name: method name, e.g. ``"yarn"``. Underscores are accepted for dashes (``dynamic_ntk``).
        kind: ``"rope"`` (rotary models) or ``"learned"`` (absolute position tables).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: unknown method (the message lists the ones valid for ``kind``).
    """
    if not isinstance(name, str):
        raise TypeError(f"The method must be a name (str), got {type(name).__name__}.")
    key = name.strip().lower().replace("_", "-")
    registry = METHODS.get(kind, {})
    if key in registry:
        return registry[key]
    valid = ", ".join(sorted(registry)) or "none"
    other = [k for k, methods in METHODS.items() if k != kind and key in methods]
    if other:
        raise ValueError(
            f"Method {name!r} applies to {other[0]} position encodings, but this model uses {kind} ones. "
            f"Methods valid here: {valid}."
        )
    close = difflib.get_close_matches(key, list(registry), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown method {name!r}.{hint} Known {kind} methods: {valid}.")


def kinds_of(name: str) -> list[str]:
    """The kinds that have a method called ``name`` (normalised like :func:`get_method`), in registry order."""
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    return [kind for kind, methods in METHODS.items() if key in methods]


def check_method_name(name: str) -> str:
    """The normalised name of a method registered for some kind.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: no kind has it (with the closest known name and the full list).
    """
    if not isinstance(name, str):
        raise TypeError(f"The method must be a name (str), got {type(name).__name__}.")
    key = name.strip().lower().replace("_", "-")
    if kinds_of(key):
        return key
    parts = [part.strip() for part in key.replace(",", "+").split("+") if part.strip()]
    if len(parts) > 1 and all(kinds_of(part) for part in parts):
        raise ValueError(
            f"Methods cannot be combined in one call ({name!r}): patch applies one method, and patching again "
            f"replaces it. Attention-level methods (self-extend, dca, string) run on the model's own rotary frequencies; "
            f"pick one of {', '.join(repr(p) for p in parts)}."
        )
    known = sorted({n for methods in METHODS.values() for n in methods})
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown method {name!r}.{hint} Known methods: {', '.join(known)} (see `hf-posext methods`).")


def available_methods(kind: str | None = None) -> dict[str, str]:
    """Map each registered method name to its one-line description.

    Args:
        kind: ``"rope"``, ``"learned"``, ``"sinusoidal"``, ``"alibi"``, ``"attention"`` or ``"relative"``
            to list only those; by default every method of every kind: RoPE methods by their name, a
            name that only one other kind has (``self-extend``) by its name too, and names that several
            kinds share as ``"name (kind)"``.

    Example:
        >>> import hf_posext
        >>> hf_posext.available_methods()["linear"]
        'Position interpolation: divide every frequency by s (Chen et al. 2023)'
    """
    if kind is not None:
        return {n: m.summary for n, m in sorted(METHODS.get(kind, {}).items())}
    listed = {n: m.summary for n, m in sorted(METHODS.get("rope", {}).items())}
    for other_kind, methods in METHODS.items():
        if other_kind == "rope":
            continue
        for n, m in sorted(methods.items()):
            listed[n if len(kinds_of(n)) == 1 else f"{n} ({other_kind})"] = m.summary
    return listed
