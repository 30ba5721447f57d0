"""Warnings that point at the user's line, however deep in hf-posext they are raised.

A fixed ``stacklevel`` is right for one call path only: ``hf_posext.patch(model, "self-extend", window=8)``
reaches the renamed-parameter warning through the API, the request and the method registry, while
``ScalingRequest(...)`` reaches it two frames sooner. :func:`warn_at_caller` counts the frames instead.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

__all__ = ["warn_at_caller"]

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _inside_package(filename: str) -> bool:
    # "<string>" frames are the __init__ that dataclasses generate for our own classes.
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(_PACKAGE_DIR)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside the ``hf_posext`` package.

    The frame is the user's script, test or notebook cell that called into hf-posext (or, when every frame is
    inside the package, the outermost one), so ``-W error::FutureWarning`` filters and the printed
    ``file:line`` name the line to change.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and _inside_package(frame.f_code.co_filename):
        if frame.f_back is None:
            break
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
