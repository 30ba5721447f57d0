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
    "split_composition",
    "COMPOSITION_SEPARATOR",
    "METHODS",
    "BASELINE",
]

#: The name every kind gives its unscaled baseline: the model's own positions, factor 1.
BASELINE = "none"
#: Joins a frequency scaling and an attention-level method into one composed name (``"yarn+string"``).
COMPOSITION_SEPARATOR = "+"
#: The kind of a composition's frequency part, and of its attention part.
FREQUENCY_KIND, ATTENTION_KIND = "rope", "attention"


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


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _refuse_request_text(name: str) -> None:
    """Refuse a whole request (``yarn:factor=4``) given where a method name is taken, naming both ways to write it."""
    if ":" not in name:
        return
    method = name.split(":", 1)[0].strip()
    raise ValueError(
        f"{name!r} is a whole request (method:settings), but a method name is taken here: write the method alone "
        f"({method!r}) with its settings as arguments (patch(model, {method!r}, factor=4)), or give the whole request "
        f"where one is taken (--method {name}, posext={name}, a recipe's scaling: {name})."
    )


def split_composition(name: str) -> tuple[str, str] | None:
    """``(frequency method, attention method)`` of a composed name such as ``"yarn+string"``; None for one method.

    A composition stacks one frequency scaling (a ``rope`` method: it changes the rotary frequencies) and one
    attention-level method (``self-extend``, ``dca``, ``string``: it changes which positions attention sees),
    in either order of writing; the frequency part runs first and sets the window the attention part is sized
    on. Anything else stacked is refused.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown part (with the closest known name), two frequency scalings, two attention
            methods, ``none`` as a part, or more than two parts; the message says what to write instead.
    """
    if not isinstance(name, str):
        raise TypeError(f"The method must be a name (str), got {type(name).__name__}.")
    _refuse_request_text(name)
    key = _normalise(name)
    if COMPOSITION_SEPARATOR not in key:
        return None
    parts = [part.strip() for part in key.split(COMPOSITION_SEPARATOR)]
    if sum(1 for part in parts if part) < 2:
        return None  # 'yarn+' is one (unknown) name, not a composition: check_method_name says "did you mean"
    if any(not part for part in parts):
        raise ValueError(f"Method {name!r} has an empty part: write one frequency scaling and one attention-level method, "
                         "e.g. 'yarn+string'.")
    for part in parts:
        if not kinds_of(part):
            try:
                check_method_name(part)  # the unknown-method error, with its "did you mean"
            except ValueError as error:
                raise ValueError(f"In {name!r}: {error}") from None
    if len(parts) > 2:
        raise ValueError(f"Method {name!r} stacks {len(parts)} methods: a composition is one frequency scaling and one "
                         "attention-level method, e.g. 'yarn+string'.")
    if BASELINE in parts:
        other = next(part for part in parts if part != BASELINE)
        raise ValueError(f"Method {name!r}: {BASELINE!r} adds nothing to a composition; write {other!r} alone.")
    frequency = [part for part in parts if FREQUENCY_KIND in kinds_of(part)]
    attention = [part for part in parts if ATTENTION_KIND in kinds_of(part)]
    if len(frequency) == 2:
        raise ValueError(
            f"Method {name!r} stacks two frequency scalings ({frequency[0]!r} and {frequency[1]!r}): they would compound. "
            f"Pick one, and stack at most an attention-level method on it ({', '.join(sorted(METHODS[ATTENTION_KIND]))}), "
            f"e.g. '{frequency[0]}+string'."
        )
    if len(attention) == 2:
        raise ValueError(
            f"Method {name!r} stacks two attention-level methods ({attention[0]!r} and {attention[1]!r}): each replaces the "
            f"model's attention function. Pick one, on at most one frequency scaling, e.g. 'yarn+{attention[0]}'."
        )
    if len(frequency) != 1 or len(attention) != 1:
        odd = next(part for part in parts if part not in frequency and part not in attention)
        raise ValueError(
            f"Method {name!r}: {odd!r} is a {'/'.join(kinds_of(odd))} method; a composition is one RoPE frequency scaling "
            "and one attention-level method, e.g. 'yarn+string'."
        )
    if get_method(frequency[0], FREQUENCY_KIND).dynamic:
        raise ValueError(
            f"Method {name!r}: {frequency[0]!r} is dynamic (its frequencies change with the sequence length), so "
            f"{attention[0]!r} could not re-rotate cached keys consistently; stack it on a static scaling, e.g. "
            f"'{frequency[0].removeprefix('dynamic-') if frequency[0].startswith('dynamic-') else 'yarn'}+{attention[0]}'."
        )
    return frequency[0], attention[0]


def check_method_name(name: str) -> str:
    """The normalised name of a method registered for some kind, or of a composition (``"yarn+string"``,
    frequency part first: ``"string+yarn"`` becomes ``"yarn+string"``; see :func:`split_composition`).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: no kind has it (with the closest known name and the full list), or a composition that
            cannot be stacked.
    """
    if not isinstance(name, str):
        raise TypeError(f"The method must be a name (str), got {type(name).__name__}.")
    key = _normalise(name)
    if kinds_of(key):
        return key
    _refuse_request_text(name)
    composition = split_composition(key)
    if composition is not None:
        return COMPOSITION_SEPARATOR.join(composition)
    parts = [part.strip() for part in key.split(",") if part.strip()]
    if len(parts) > 1 and all(kinds_of(part) for part in parts):
        raise ValueError(
            f"Methods are not listed with commas in one call ({name!r}): patch applies one method, and patching again "
            f"replaces it. To stack an attention-level method on a frequency scaling, join them with '+' (e.g. "
            f"'yarn+string'); otherwise pick one of {', '.join(repr(p) for p in parts)}."
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

    Composition: one frequency scaling and one attention-level method may be stacked in one call by joining
    their names with ``+`` (``hf_posext.patch(model, "yarn+string", factor=4)``): the frequency part takes
    ``factor`` / ``target_length``, the attention part is sized on the window the frequency part gives
    (STRING's S = 0.33 of the scaled window), and each method parameter goes to the part that declares it
    (a name both declare is written ``string.attention_factor=...``). Compositions are not listed here;
    every pair of a ``rope`` and an ``attention`` method is one (:func:`split_composition`).

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
