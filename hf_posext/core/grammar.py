"""The one text spelling of a scaling request, taken by every entry point.

Grammar (``:`` separates the method from each setting, so the text survives lists separated by commas,
lm-eval's ``key=value,key=value`` model arguments, YAML and the shell without quoting)::

    REQUEST  := METHOD ( ":" NAME "=" VALUE )*
    METHOD   := a registered method, or FREQUENCY "+" ATTENTION (a composition)
    NAME     := factor | target_length | original_max_position_embeddings | a method parameter
                (in a composition, a parameter both parts declare is qualified: string.local_value)
    VALUE    := a number, true/false, none, a JSON list ([1.0,1.2]) or text

Examples: ``none``, ``yarn:factor=4``, ``linear:target_length=32768``, ``yarn:factor=4:beta_fast=16``,
``yarn+string:factor=4:string.local_value=128``.

Where it is taken: ``hf-posext patch/describe --method``, ``hf-posext eval --methods`` (several, separated by
commas), the report card's model rows (``--models "base=smollm2-135m@none;yarn:factor=4"``),
``hf-posext lm-eval-compare --methods``, a recipe's ``scaling:`` (a mapping or this text) and lm-eval's model
argument ``posext=yarn:factor=4``.
"""

from __future__ import annotations

import json
from typing import Any

from hf_posext.core.request import SETTING_SEPARATOR, SIZE_FIELDS, ScalingRequest, format_request, parse_value

__all__ = ["SETTING_SEPARATOR", "MODEL_ARGUMENT", "parse_request", "format_request", "split_top_level", "looks_like_request_text"]

#: Between the method and each ``name=value`` setting.
#: The lm-eval model argument that holds a whole request (``posext=yarn:factor=4``).
MODEL_ARGUMENT = "posext"
EXAMPLE = "yarn:factor=4 (or yarn+string:factor=4:string.local_value=128)"


def split_top_level(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside brackets, so that a JSON list value keeps its commas.

    Raises:
        ValueError: unbalanced brackets.
    """
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{text!r} closes a bracket it never opened; write lists as [1.0,1.2].")
        elif char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise ValueError(f"{text!r} leaves a bracket open; write lists as [1.0,1.2].")
    parts.append(text[start:])
    return parts


def looks_like_request_text(text: str) -> bool:
    """True when ``text`` carries settings in the request grammar (``yarn:factor=4``), not a bare method name."""
    return SETTING_SEPARATOR in text


def parse_request(text: str, where: str = "scaling request") -> ScalingRequest:
    """``"yarn:factor=4:beta_fast=16"`` -> the validated :class:`ScalingRequest`.

    Args:
        text: a request in the grammar of this module.
        where: its name in error messages (``"--methods"``, ``"recipe scaling"``).

    Raises:
        ValueError: no method, a setting without ``name=value``, a setting given twice, or any error of
            :class:`ScalingRequest` (unknown method or parameter, a bad factor); the message shows the
            grammar's example.
    """
    if not isinstance(text, str):
        raise ValueError(f"{where} must be text such as {EXAMPLE}, got {type(text).__name__}.")
    items = split_top_level(text.strip(), SETTING_SEPARATOR)
    method = items[0].strip()
    if not method:
        raise ValueError(f"{where} {text!r} names no method; write e.g. {EXAMPLE}.")
    sizes: dict[str, Any] = {}
    params: dict[str, Any] = {}
    for item in items[1:]:
        name, equals, value = item.partition("=")
        name = name.strip()
        if not equals or not name:
            raise ValueError(
                f"{where} {text!r}: {item!r} is not NAME=VALUE; write e.g. {method}:factor={item.strip() or 4} "
                f"(settings follow the method, each after a ':')."
            )
        target = sizes if name in SIZE_FIELDS else params
        if name in sizes or name in params:
            raise ValueError(f"{where} {text!r} gives {name!r} twice; give it once.")
        target[name] = parse_value(value.strip())
    try:
        return ScalingRequest(method, *(sizes.get(name) for name in SIZE_FIELDS), params=tuple(params.items()))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} {text!r}: {error}") from error


