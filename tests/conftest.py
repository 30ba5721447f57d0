"""Shared fixtures: tiny random models (no hub), deterministic inputs, quiet transformers logs."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


@pytest.fixture
def token_ids():
    """A deterministic batch of token ids longer than the tiny models' window (64)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, 128, (2, 150), generator=generator)


def logits_of(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits
