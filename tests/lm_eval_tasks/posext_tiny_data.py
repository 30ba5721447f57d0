"""Loader for the tiny test tasks: reads posext_tiny.jsonl next to this file (no hub, no network)."""

import json
from pathlib import Path

import datasets

DATA_FILE = Path(__file__).with_name("posext_tiny.jsonl")


def load_docs(**metadata):
    """Return the harness's ``custom_dataset`` form: {"test": Dataset}; task metadata is ignored."""
    with DATA_FILE.open(encoding="utf-8") as handle:
        docs = [json.loads(line) for line in handle if line.strip()]
    return {"test": datasets.Dataset.from_list(docs)}
