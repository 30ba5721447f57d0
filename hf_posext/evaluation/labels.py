"""Short, distinct names for what a report shows: methods, series (method x factor), models."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["short_label", "series_name", "model_name", "format_length", "depths_note"]

_PATH_VALUE = re.compile(r"=([^,()=]*[/\\][^,()=]*)")


def short_label(label: str) -> str:
    """A method label with every file-path parameter shortened to its file name.

    ``longrope(factors=bench/results/longrope_search/search_smollm2-135m_16384.json)`` becomes
    ``longrope(factors=search_smollm2-135m_16384.json)``.
    """
    return _PATH_VALUE.sub(lambda match: "=" + re.split(r"[/\\]", match.group(1).rstrip("/\\"))[-1], label)


def series_name(record: dict[str, Any], with_model: bool = True) -> str:
    """``label xFACTOR`` (``none`` alone; a composition ``yarn x4 + string``), prefixed by ``model: `` when the
    record is tagged with one."""
    label = short_label(record.get("label") or record["method"])
    frequency, plus, rest = label.partition("+")
    if plus and "+" in str(record["method"]):  # a composition: the factor is its frequency part's
        name = f"{frequency} x{record['factor']:g} + {rest}"
    else:
        name = label if record["method"] == "none" else f"{label} x{record['factor']:g}"
    model = record.get("_model") if with_model else None
    return f"{model}: {name}" if model else name


def model_name(model: Any) -> str:
    """A short, still distinct name for a model: the last two parts of a path, else the name as given."""
    parts = [part for part in str(model).replace("\\", "/").split("/") if part not in ("", ".")]
    return "/".join(parts[-2:]) if len(parts) > 2 else str(model)


def format_length(tokens: int) -> str:
    """``16384`` -> ``16k``; lengths that are not a multiple of 1024 stay as they are."""
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def depths_note(group: list[dict[str, Any]], all_depths: list[float], metric: str) -> str:
    """``"depth 0 only"`` when ``group`` (a plot panel, a table cell) holds fewer of the depths with a
    ``metric`` than ``all_depths`` (the figure's or table's), else ``""``.

    A rate pooled over depth 0 alone reads like one pooled over every depth unless it says so.
    """
    depths = sorted({float(r["depth"]) for r in group if "depth" in r and r.get(metric) is not None})
    if not depths or depths == list(all_depths):
        return ""
    return f"depth{'s' if len(depths) > 1 else ''} {', '.join(f'{d:g}' for d in depths)} only"
