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


def assert_close_guarding(actual, expected, wrong, *, atol: float, rtol: float, margin: float = 100.0) -> None:
    """``assert_close(actual, expected)``, and proof that the comparison can fail.

    ``wrong`` is what the failure the test guards against would give (e.g. the unpatched model, or
    frequencies chosen for another length). It must differ from ``expected`` by at least ``margin``
    times the tolerance, else the test could pass on a broken implementation.
    """
    import torch

    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    tolerance = atol + rtol * expected.abs().max().item()
    effect = (wrong.float() - expected.float()).abs().max().item()
    assert effect >= margin * tolerance, (
        f"the effect this test guards ({effect:.3g}) is not {margin:g}x its tolerance ({tolerance:.3g}): it could not fail"
    )
