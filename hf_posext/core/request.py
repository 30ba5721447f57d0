"""The scaling request: one :class:`ScalingRequest` and one parser for every way to write it.

A request is what a user asks for (method, factor or target length, parameters); it is validated
without a model. The four spellings all end in :meth:`ScalingRequest.from_mapping`:

* Python: ``ScalingRequest.from_kwargs("yarn", 4, beta_fast=32)`` (what ``hf_posext.patch`` takes);
* CLI: ``--method yarn --factor 4 --param beta_fast=32`` -> :meth:`ScalingRequest.from_cli`;
* YAML: a ``scaling:`` section ``{method: yarn, factor: 4, params: {beta_fast: 32}}``;
* lm-eval model args: ``posext_method=yarn,posext_factor=4,posext_beta_fast=32`` ->
  :meth:`ScalingRequest.from_model_args`.

Text values go through one coercer, :func:`parse_value`.

Two types, on purpose: a :class:`ScalingRequest` is what the user asked for and may leave things open
(a factor or a target length, no window, parameters left to their defaults); a :class:`ScalingConfig`
is that request *resolved against a model*: the model's kind of position, its pre-training window L
and a concrete factor s, with every parameter filled in. Only a backend makes one (it alone reads the
model), and it is what the backend builds its numbers from and what the saved record holds.
``SelfExtendSettings`` (:mod:`hf_posext.backends.attention.self_extend`) is the same thing for Self-Extend:
the request resolved to a group size, a neighbor window and L.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from hf_posext.core.record import make_record
from hf_posext.methods import COMPOSITION_SEPARATOR, Method, check_method_name, get_method, kinds_of, split_composition

__all__ = [
    "ScalingRequest", "ScalingConfig", "resolve_factor", "parse_value", "parse_param_items", "plain_number", "MODEL_ARGS_PREFIX",
    "SETTING_SEPARATOR", "SIZE_FIELDS", "format_request",
]

#: Separates the method from its settings, and the settings from each other, in a request's text.
SETTING_SEPARATOR = ":"
#: The settings that size a request (every other setting is a method parameter).
SIZE_FIELDS = ("factor", "target_length", "original_max_position_embeddings")

#: Prefix of the lm-eval model arguments that make up a request (``posext_method=yarn``).
MODEL_ARGS_PREFIX = "posext_"
#: The request's own field names where they start an argument name in a message ("factor=0.5 is ...").
_FIELD_NAMES = re.compile(r"(?<![\w'])(?:factor|target_length|original_max_position_embeddings)(?==| must)")


def parse_value(value: Any) -> Any:
    """Read a text value the way the CLI, YAML overrides and lm-eval model args mean it.

    JSON when it parses (``4`` -> 4, ``[1, 2]`` -> list), ``true``/``false`` (any case) -> bool,
    ``none``/``null`` -> None, anything else stays text. Non-text values are returned as they are.
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_param_items(items: list[str] | None) -> dict[str, Any]:
    """``["beta_fast=32", "factors=f.json"]`` -> ``{"beta_fast": 32, "factors": "f.json"}``.

    Raises:
        ValueError: an item without ``=`` or without a name.
    """
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param expects key=value, got {item!r} (e.g. --param beta_fast=32).")
        params[key.strip()] = parse_value(value)
    return params


def plain_number(value: Any) -> Any:
    """``value`` as a Python number when it is a numeric scalar of another library, else unchanged.

    A NumPy scalar (``np.float32(2)``), a 0-dimensional NumPy array or torch tensor (``torch.tensor(2.0)``)
    becomes its ``.item()``; anything else (a multi-element tensor, text, None) is returned as it is, for the
    caller's check to refuse. A boolean scalar stays a bool, which the checks refuse as a size.
    """
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def _check_factor(factor: Any, name: str = "factor") -> float | None:
    if factor is None:
        return None
    factor = plain_number(factor)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ValueError(f"{name} must be a finite number >= 1, got {factor!r}.")
    if factor < 1:
        raise ValueError(
            f"{name}={factor} is below 1: scaling extends the window, it cannot shrink it. "
            f"Use {name} >= 1 ({name}=1 leaves the model unchanged)."
        )
    return float(factor)


def _check_length(value: Any, name: str) -> int | None:
    if value is None:
        return None
    value = plain_number(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


def _declared_params(method: str) -> set[str]:
    """Every parameter name some kind of ``method`` declares, renamed (old) names included."""
    names: set[str] = set()
    for kind in kinds_of(method):
        spec = get_method(method, kind)
        names.update(f.name for f in dataclasses.fields(spec.params_cls))
        names.update(old for old, _ in spec.renamed_params)
    return names


def _size_params(method: str) -> list[str]:
    """The parameters that size ``method`` by themselves (Self-Extend's ``group_size``), over its kinds."""
    return [name for kind in kinds_of(method) for name in get_method(method, kind).size_params]


def _split_composed_params(method: str, params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A composition's parameters, each under the part that declares it: ``{"yarn": {...}, "string": {...}}``.

    A name may be qualified by its part (``string.attention_factor``); an unqualified one goes to the one part
    that declares it.

    Raises:
        ValueError: a name both parts declare, given unqualified (the message says how to qualify it); a
            name neither declares; a qualifier that is not a part.
    """
    parts = split_composition(method)
    assert parts is not None
    split: dict[str, dict[str, Any]] = {part: {} for part in parts}
    for key, value in params.items():
        part, dot, name = str(key).partition(".")
        if dot:
            if part not in split:
                raise ValueError(f"Parameter {key!r} names part {part!r}, which {method!r} does not have; qualify it with "
                                 f"{' or '.join(repr(p + '.') for p in parts)}.")
            if name in SIZE_FIELDS:
                raise ValueError(
                    f"{key!r}: a composition has one size, its frequency part's: write {name}=... unqualified (it sizes "
                    f"{parts[0]!r}); {parts[1]!r} is sized on the window {parts[0]!r} gives"
                    + (f", and by its own {' / '.join(_size_params(parts[1]))}." if _size_params(parts[1]) else ".")
                )
        else:
            name = part
            owners = [p for p in parts if name in _declared_params(p)]
            if len(owners) == 2:
                raise ValueError(
                    f"Parameter {name!r} is declared by both {parts[0]!r} and {parts[1]!r} in {method!r}: say which part it "
                    f"is for, {parts[0]}.{name}= or {parts[1]}.{name}= (CLI: --param {parts[1]}.{name}=VALUE; lm-eval: "
                    f"posext_{parts[1]}.{name}=VALUE)."
                )
            if not owners:
                known = sorted(_declared_params(parts[0]) | _declared_params(parts[1]))
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"Neither part of {method!r} has a parameter {name!r}.{hint} Their parameters are: "
                                 f"{', '.join(known) or 'none'}.")
            part = owners[0]
        if name in split[part]:
            raise ValueError(f"Parameter {name!r} of {part!r} is given twice in {method!r}; give it once.")
        split[part][name] = value
    return split


def _canonical_params(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with renamed parameters under their current names (the first kind that has ``method`` decides).

    A composition's parameters come back qualified by their part (``string.shifted_offset``)."""
    if split_composition(method) is not None:
        return {f"{part}.{name}": value for part, values in _split_composed_params(method, params).items()
                for name, value in _canonical_params(part, values).items()}
    kinds = kinds_of(method)
    return get_method(method, kinds[0]).canonical_params(params) if kinds else dict(params)


def _check_params(method: str, params: dict[str, Any]) -> None:
    """Accept ``params`` if some kind that has ``method`` accepts them; else raise that kind's error."""
    if split_composition(method) is not None:
        for part, values in _split_composed_params(method, params).items():
            _check_params(part, values)
        return
    errors = []
    for kind in kinds_of(method):
        try:
            get_method(method, kind).parse_params(dict(params))
            return
        except (TypeError, ValueError) as error:
            errors.append(error)
    raise ValueError(str(errors[0])) from errors[0]


@dataclass(frozen=True)
class ScalingRequest:
    """A validated request to scale a model's positions (no model needed to check it).

    Attributes:
        method: a registered method name of any kind (normalised: ``dynamic_ntk`` -> ``dynamic-ntk``).
        factor: scale s >= 1, or None (then ``target_length``, a size parameter, or chosen later).
        target_length: the window to reach, or None.
        original_max_position_embeddings: override of the pre-training window read from the config.
        params: the method's parameters as sorted ``(name, value)`` pairs (hashable).

    Raises:
        ValueError: unknown method (with "did you mean"), unknown or bad parameter, a factor that is
            not a finite number >= 1, a non-positive length, both factor and target_length.
    """

    method: str
    factor: float | None = None
    target_length: int | None = None
    original_max_position_embeddings: int | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        method = check_method_name(self.method)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "factor", _check_factor(self.factor))
        object.__setattr__(self, "target_length", _check_length(self.target_length, "target_length"))
        object.__setattr__(self, "original_max_position_embeddings",
                           _check_length(self.original_max_position_embeddings, "original_max_position_embeddings"))
        if self.factor is not None and self.target_length is not None:
            raise ValueError(
                f"Give exactly one of factor= or target_length=, not both; got factor={self.factor!r}, target_length={self.target_length!r}."
            )
        params = dict(self.params.items() if isinstance(self.params, Mapping) else self.params)
        params = {key: plain_number(value) for key, value in params.items()}  # np.int64(40) -> 40, as factor takes it
        params = _canonical_params(method, params)
        _check_params(method, params)
        object.__setattr__(self, "params", tuple(sorted(params.items(), key=lambda item: item[0])))

    # ---- parsers -----------------------------------------------------------------------------------

    @classmethod
    def from_kwargs(
        cls,
        method: str,
        factor: float | None = None,
        *,
        target_length: int | None = None,
        original_max_position_embeddings: int | None = None,
        **params: Any,
    ) -> "ScalingRequest":
        """The request ``hf_posext.patch(model, method, factor, ..., **params)`` makes."""
        return cls(method, factor, target_length, original_max_position_embeddings, tuple(params.items()))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], where: str = "scaling") -> "ScalingRequest":
        """From a mapping with ``method``, ``factor``, ``target_length``, ``original_max_position_embeddings``
        and ``params`` (a YAML section, a saved record); text values are read with :func:`parse_value`.

        Args:
            mapping: the section.
            where: its name in error messages (``"scaling"``, ``"config.json: hf_posext"``).

        Raises:
            ValueError: no ``method``, an unknown key, or any error of :class:`ScalingRequest`.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{where} must be a mapping with method, factor, ..., got {type(mapping).__name__}.")
        known = ("method", "params", *SIZE_FIELDS)
        unknown = [k for k in mapping if k not in known]
        if unknown:
            raise ValueError(f"{where} has no field {unknown[0]!r}; its fields are: {', '.join(known)}.")
        if mapping.get("method") is None:
            raise ValueError(f"{where}.method is missing: name a method (e.g. method: yarn; `hf-posext methods` lists them).")
        params = mapping.get("params") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"{where}.params must be a mapping of method parameters, got {params!r}.")
        try:
            return cls(
                str(mapping["method"]),
                *(parse_value(mapping.get(name)) for name in SIZE_FIELDS),
                params=tuple((str(k), parse_value(v)) for k, v in params.items()),
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error

    @classmethod
    def from_cli(
        cls,
        method: str,
        factor: float | None = None,
        target_length: int | None = None,
        param_items: list[str] | None = None,
        original_max_position_embeddings: int | None = None,
    ) -> "ScalingRequest":
        """From ``--method M --factor F | --target-length T --param k=v ... --original-max-position-embeddings L``."""
        return cls.from_mapping(
            {"method": method, "factor": factor, "target_length": target_length,
             "original_max_position_embeddings": original_max_position_embeddings,
             "params": parse_param_items(param_items)},
            where="command line",
        )

    @classmethod
    def from_model_args(cls, model_args: Mapping[str, Any], *, sized: bool = True) -> tuple["ScalingRequest | None", dict[str, Any]]:
        """Split lm-eval model arguments into a request (``posext_*`` keys) and the rest; with ``sized=False`` a
        request without a factor is returned as it is (an adapter then gives it its factor).

        ``posext_method``, ``posext_factor``, ``posext_target_length`` and
        ``posext_original_max_position_embeddings`` are the request's fields; every other
        ``posext_<name>`` is a method parameter. The harness reads the text ``none`` as None:
        ``posext_method=none`` is the baseline method.

        Returns:
            (the request, or None when no ``posext_*`` argument is given; the remaining arguments).

        Raises:
            ValueError: ``posext_*`` arguments without ``posext_method``, or any request error.
        """
        section: dict[str, Any] = {}
        params: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for key, value in model_args.items():
            if not key.startswith(MODEL_ARGS_PREFIX):
                rest[key] = value
                continue
            name = key[len(MODEL_ARGS_PREFIX):]
            if not name:
                raise ValueError(f"Model argument {key!r} names no parameter: use {MODEL_ARGS_PREFIX}<name>=<value>.")
            if name == "method":
                section["method"] = "none" if value is None else value
            elif name in SIZE_FIELDS:
                section[name] = value
            else:
                params[name] = value
        if "method" not in section:
            given = [MODEL_ARGS_PREFIX + k for k in (*section, *params)]
            if given:
                raise ValueError(
                    f"{', '.join(given)} given without {MODEL_ARGS_PREFIX}method. Add {MODEL_ARGS_PREFIX}method=<name> "
                    f"(e.g. {MODEL_ARGS_PREFIX}method=yarn; `hf-posext methods` lists them)."
                )
            return None, rest
        try:
            request = cls(
                str(section["method"]), *(parse_value(section.get(name)) for name in SIZE_FIELDS),
                params=tuple((k, parse_value(v)) for k, v in params.items()),
            )
        except (TypeError, ValueError) as error:
            message = _FIELD_NAMES.sub(lambda match: MODEL_ARGS_PREFIX + match.group(0), str(error))
            raise ValueError(f"{message} (method parameters are given as {MODEL_ARGS_PREFIX}<name>=<value>)") from error
        return (request.require_size(prefix=MODEL_ARGS_PREFIX) if sized else request), rest

    # ---- views -------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The method's name (what evaluation code calls it)."""
        return self.method

    @property
    def params_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def is_composed(self) -> bool:
        """True for a composition such as ``yarn+string`` (a frequency scaling with an attention-level method)."""
        return split_composition(self.method) is not None

    @property
    def parts(self) -> tuple["ScalingRequest", "ScalingRequest"] | None:
        """``(frequency part, attention part)`` of a composition, None for one method.

        The frequency part carries ``factor``, ``target_length`` and ``original_max_position_embeddings``; the
        attention part only its parameters: it is sized on the window the frequency part gives.
        """
        names = split_composition(self.method)
        if names is None:
            return None
        split = _split_composed_params(self.method, self.params_dict)
        frequency = ScalingRequest(names[0], self.factor, self.target_length, self.original_max_position_embeddings,
                                   tuple(split[names[0]].items()))
        return frequency, ScalingRequest(names[1], params=tuple(split[names[1]].items()))

    @property
    def label(self) -> str:
        """``yarn`` or ``yarn(beta_fast=16)``: the name of this request in tables and result cells."""
        return self.method + ("" if not self.params else "(" + ",".join(f"{k}={v}" for k, v in self.params) + ")")

    def sized_parts(self) -> tuple["ScalingRequest", "ScalingRequest"]:
        """:attr:`parts` of a sized composition, the attention part sized too: by its own size parameter
        (Self-Extend's ``group_size``), by its method's default (STRING's 1), or else at factor 1 on the window the
        frequency part gives (DCA, whose factor only declares a window: here the frequency part's).

        Raises:
            ValueError: the attention part has a size parameter of its own and it is not given (the message
                names the parameter and the whole request to write).
        """
        frequency, attention = self.parts
        if attention.sizes_itself():
            return frequency, attention
        defaults = {get_method(attention.method, kind).default_factor for kind in kinds_of(attention.method)}
        sizing = _size_params(attention.method)
        if sizing:
            example = dataclasses.replace(self, params=tuple(sorted((*self.params, (sizing[0], 4)))))
            raise ValueError(
                f"{self.method}: the factor sizes {frequency.method}; {attention.method} is sized on the window "
                f"{frequency.method} gives by its own {' / '.join(sizing)}, which is missing: add it, e.g. "
                f"{format_request(example)} (Python: patch(model, {self.method!r}, ..., {sizing[0]}=4))."
            )
        factor = defaults.pop() if len(defaults) == 1 and None not in defaults else 1.0
        return frequency, dataclasses.replace(attention, factor=factor)

    def sizes_itself(self) -> bool:
        """True when a parameter sizes the extension (e.g. Self-Extend's ``group_size``); a composition is
        sized by its frequency part."""
        if self.is_composed:
            return self.parts[0].sizes_itself()
        return any(
            name in dict(self.params) and dict(self.params)[name] is not None
            for kind in kinds_of(self.method)
            for name in get_method(self.method, kind).size_params
        )

    def require_size(self, prefix: str = "") -> "ScalingRequest":
        """This request with ``factor=1`` for ``none``; raise unless a size is given.

        Raises:
            ValueError: neither factor nor target_length (nor a size parameter) is given.
        """
        if self.factor is not None or self.target_length is not None or self.sizes_itself():
            if self.is_composed:
                self.sized_parts()  # the attention part can be sized too, or the message says by what
            return self
        if self.method == "none":
            return dataclasses.replace(self, factor=1.0)
        if self.is_composed:
            frequency = self.parts[0].method
            raise ValueError(
                f"{prefix}method={self.method} needs the size of its frequency part ({frequency}): exactly one of "
                f"{prefix}factor (e.g. {prefix}factor=4) or {prefix}target_length (e.g. {prefix}target_length=32768); "
                f"the attention part is sized on the window {frequency} gives."
            )
        defaults = {get_method(self.method, kind).default_factor for kind in kinds_of(self.method)}
        if len(defaults) == 1 and None not in defaults:  # a method at home inside the window (STRING)
            return dataclasses.replace(self, factor=defaults.pop())
        sizing = [prefix + name for kind in kinds_of(self.method) for name in get_method(self.method, kind).size_params]
        raise ValueError(
            f"{prefix}method={self.method} needs its size: exactly one of {prefix}factor (e.g. {prefix}factor=2) or "
            f"{prefix}target_length (e.g. {prefix}target_length=16384)" + (f", or {' / '.join(sizing)}." if sizing else ".")
        )

    def patch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``hf_posext.patch(model, **request.patch_kwargs())``."""
        return {
            "method": self.method, "factor": self.factor, "target_length": self.target_length,
            "original_max_position_embeddings": self.original_max_position_embeddings, **self.params_dict,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (recorded in evaluation results)."""
        return {
            "method": self.method, "factor": self.factor, "target_length": self.target_length,
            "original_max_position_embeddings": self.original_max_position_embeddings, "params": self.params_dict,
        }


def resolve_factor(factor: float | None, target_length: int | None, original_length: int) -> float:
    """Return the scale factor from exactly one of ``factor`` and ``target_length``.

    Raises:
        ValueError: both or neither given, a factor below 1 or not finite, a target shorter than the
            original window.
    """
    factor, target_length = plain_number(factor), plain_number(target_length)
    if (factor is None) == (target_length is None):
        raise ValueError(
            "Give exactly one of factor= (e.g. factor=4) or target_length= (e.g. target_length="
            f"{4 * original_length}); got factor={factor!r}, target_length={target_length!r}."
        )
    if target_length is not None:
        if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length <= 0:
            raise ValueError(f"target_length must be a positive integer, got {target_length!r}.")
        if target_length < original_length:
            raise ValueError(
                f"target_length={target_length} is shorter than the model's original window "
                f"({original_length} tokens); scaling only extends. Use target_length >= {original_length}."
            )
        return target_length / original_length
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise ValueError(f"factor must be a finite number >= 1, got {factor!r}.")
    if factor < 1:
        raise ValueError(
            f"factor={factor} is below 1: scaling extends the window, it cannot shrink it. "
            "Use factor >= 1 (factor=1 leaves the model unchanged)."
        )
    return float(factor)


@dataclass
class ScalingConfig:
    """A :class:`ScalingRequest` resolved against a model (see the module docstring): concrete L and s.

    Attributes:
        method: registered method name (``hf_posext.available_methods()``).
        factor: scale s >= 1; the patched window is ``original_max_position_embeddings * factor``.
        original_max_position_embeddings: the window the model was pre-trained with (L).
        params: the method's keyword parameters, with defaults filled in.
        kind: the model's kind of position (``"rope"``, ``"learned"``, ``"sinusoidal"``, ``"alibi"``, ...).
    """

    method: str
    factor: float
    original_max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)
    kind: str = "rope"

    def __post_init__(self) -> None:
        spec = get_method(self.method, self.kind)
        self.method = spec.name
        self.factor = resolve_factor(self.factor, None, self.original_max_position_embeddings)
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"original_max_position_embeddings must be positive, got {self.original_max_position_embeddings}."
            )
        parsed = spec.parse_params(dict(self.params))
        self.params = dataclasses.asdict(parsed)
        self._parsed = parsed

    @property
    def spec(self) -> Method:
        return get_method(self.method, self.kind)

    @property
    def parsed_params(self) -> Any:
        """The method's parameter dataclass instance."""
        return self._parsed

    @property
    def target_length(self) -> int:
        """The window after scaling: round(L * s)."""
        return int(round(self.original_max_position_embeddings * self.factor))

    @property
    def is_identity(self) -> bool:
        return self.factor == 1 and self.spec.identity_at_one

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (stored in ``config.json`` under ``hf_posext``)."""
        return make_record(self.kind, self.method, self.factor, self.original_max_position_embeddings, self.params)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScalingConfig":
        return cls(
            method=data["method"],
            factor=data["factor"],
            original_max_position_embeddings=data["original_max_position_embeddings"],
            params=dict(data.get("params", {})),
            kind=data.get("kind", "rope"),
        )


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def format_request(request: ScalingRequest) -> str:
    """The text of ``request`` in the request grammar (``METHOD:NAME=VALUE:...``); :func:`hf_posext.core.grammar.parse_request` reads it back to an equal request."""
    settings = [(name, getattr(request, name)) for name in SIZE_FIELDS if getattr(request, name) is not None]
    if request.method == "none" and settings == [("factor", 1.0)]:
        return "none"  # the baseline needs no size
    settings += list(request.params)
    return SETTING_SEPARATOR.join([request.method, *(f"{name}={_format_value(value)}" for name, value in settings)])
