"""Digests that tell a file's content from an edit of it: a cache or record that carries the digest of its content,
written with it, is checked against it when read (a hand edit that keeps the file's key or name is caught)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["json_digest"]


def json_digest(value: Any) -> str:
    """A short SHA-256 digest of ``value`` as canonical JSON (sorted keys; what it reads back as from a JSON file)."""
    text = json.dumps(json.loads(json.dumps(value, default=str)), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
