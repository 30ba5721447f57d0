"""Evaluation arguments: the methods, lengths and fractions a grid runs over, parsed and validated."""

from __future__ import annotations

import math
from typing import Any, Sequence

from hf_posext.core.grammar import looks_like_request_text, parse_request, split_top_level
from hf_posext.core.request import ScalingRequest
from hf_posext.methods import check_method_name
from hf_posext.user_warnings import warn_at_caller

__all__ = ["MethodRequest", "parse_methods", "parse_lengths", "parse_floats"]


def MethodRequest(name: str, factor: float | None = None, params: tuple[tuple[str, Any], ...] = ()) -> ScalingRequest:  # noqa: N802
    """A method to evaluate: a :class:`ScalingRequest` whose factor may be left to the grid (None: chosen
    from the lengths). Kept under this name for the evaluation code that builds requests by hand."""
    return ScalingRequest(name, factor, params=params)


def parse_methods(text: str | Sequence[str], params: dict[str, Any] | None = None) -> list[ScalingRequest]:
    """``"none,yarn:factor=4,dynamic-yarn"`` -> scaling requests; each is validated.

    Args:
        text: comma-separated requests in the request grammar (:mod:`hf_posext.core.grammar`): a bare method
            name (any kind: ``self-extend`` too) or a method with its settings (``yarn:factor=4:beta_fast=16``).
        params: method parameters given to every bare method but ``none`` (the old ``--param`` spelling,
            deprecated: write them in the request, ``yarn:beta_fast=16``).

    Raises:
        ValueError: an empty list, an unknown method (with the known ones), a parameter a method lacks.
    """
    items = split_top_level(text, ",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in items if n.strip()]
    if not names:
        raise ValueError("No method given: pass e.g. --methods none,yarn,dynamic-yarn.")
    if params:
        example = ",".join(f"{n}:" + ":".join(f"{k}={v}" for k, v in params.items()) for n in names if n != "none")
        warn_at_caller(f"--param is deprecated and will be removed: write the settings in the request, --methods {example}.",
                       FutureWarning)
    requests = []
    for name in names:
        if looks_like_request_text(name):
            if params:
                raise ValueError(f"--methods {name!r} carries its own settings: leave out --param (give each setting once).")
            requests.append(parse_request(name, where="--methods"))
            continue
        method = check_method_name(name)
        method_params = tuple((params or {}).items()) if method != "none" else ()
        requests.append(ScalingRequest(method, params=method_params))
    return requests


def parse_lengths(text: str | Sequence[int]) -> list[int]:
    """``"2048,4096"`` (or ``"4k,8k"``) -> sorted unique positive ints."""
    items = text.split(",") if isinstance(text, str) else list(text)
    lengths = []
    for item in items:
        item = str(item).strip().lower()
        if not item:
            continue
        multiplier = 1024 if item.endswith("k") else 1
        try:
            number = float(item.rstrip("k")) * multiplier
            if not math.isfinite(number) or number != int(number):
                raise ValueError(item)
            value = int(number)
        except ValueError as error:
            raise ValueError(f"Bad length {item!r}: lengths are whole token counts such as 4096 or 4k.") from error
        if value < 2:
            raise ValueError(f"Length {value} is too short: a length is a number of tokens >= 2.")
        lengths.append(value)
    if not lengths:
        raise ValueError("No length given: pass e.g. --lengths 2048,4096,8192.")
    return sorted(set(lengths))


def parse_floats(text: str | Sequence[float], name: str, low: float = 0.0, high: float = 1.0) -> list[float]:
    """``"0,0.5,1"`` -> floats within [low, high]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    values = []
    for item in items:
        if str(item).strip() == "":
            continue
        try:
            value = float(item)
        except ValueError as error:
            raise ValueError(f"Bad {name} {item!r}: expected numbers such as 0,0.5,1.") from error
        if not low <= value <= high:
            raise ValueError(f"{name} {value} is outside [{low}, {high}].")
        values.append(value)
    if not values:
        raise ValueError(f"No {name} given.")
    return values
