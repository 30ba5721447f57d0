"""Checks of the folders a command will write to: kept as an import path of :mod:`hf_posext.core.files`, where they
live beside the atomic write and the staged folder."""

from __future__ import annotations

from hf_posext.core.files import check_output_folder, replace_folder

__all__ = ["check_output_folder", "replace_folder"]
