"""Shared helpers for the tests/test_training_*.py modules (the tiny recipe, paths, weight comparison)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPE = REPO / "recipes" / "configs" / "tiny" / "ci-stage1-cpu.yaml"
TINY_MODEL = REPO / "tests" / "data" / "training" / "tiny-llama"
TINY_CORPUS = REPO / "tests" / "data" / "training" / "corpus"


def tiny_config(output_dir: Path, *overrides: str):
    """The tiny recipe with absolute asset paths, writing to ``output_dir``, plus ``overrides``."""
    from hf_posext.training.config import load_config

    return load_config(
        TINY_RECIPE,
        [f"model.name={TINY_MODEL}", f"data.source={TINY_CORPUS}", f"output.dir={output_dir}", *overrides],
    )


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread: on a shared, loaded 2-core machine two threads made the tiny
    recipe 40x slower (0.056 s vs 2.3 s per step). Import this fixture into a test module to apply it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in a checkpoint or output folder, keyed ``file:name``."""
    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update({f"{path.name}:{k}": v for k, v in load_safetensors(path).items()})
    assert tensors, f"no weights in {folder}"
    return tensors


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return all(torch.equal(a[k], b[k]) for k in a)


def exit_without_teardown(code: int) -> None:
    """Leave once every rank is done, skipping C++ static destructors (the training CLI's own way out of a
    sequence-parallel run: :func:`hf_posext.training.cli.leave_without_teardown`)."""
    from hf_posext.training.cli import leave_without_teardown

    leave_without_teardown(code)
