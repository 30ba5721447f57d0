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


def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers."""
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.fixture
def token_ids():
    """A deterministic batch of token ids longer than the tiny models' window (64)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, 128, (2, 150), generator=generator)


def model_bypassing_the_attention_registry():
    """A tiny RoPE model whose attention modules never ask transformers' attention-function registry: each keeps
    a config of its own pinned to eager, so ``set_attn_implementation`` does not reach them (as Falcon's attention
    did before transformers 5.25). Attention-level methods must refuse it; built here so that the refusal stays
    tested whichever families a transformers release routes through the registry."""
    import copy

    from hf_posext.models import tiny_model

    model = tiny_model("llama")
    for layer in model.model.layers:
        pinned = copy.copy(model.config)
        pinned._attn_implementation = "eager"
        layer.self_attn.config = pinned
    return model


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
