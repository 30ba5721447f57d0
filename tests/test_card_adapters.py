"""A suite row ``MODEL+ADAPTER`` is evaluated only at the scaling its adapter was trained with: another factor,
``none``, or ``--methods`` that differ are refused in one line, with the fix in the ``--models`` spelling, before any
model loads; ``@as-saved`` and the trained scaling itself run."""

from __future__ import annotations

import pytest

from hf_posext.cli import main
from tests.training_helpers import TINY_CORPUS, TINY_MODEL, one_thread, tiny_config  # noqa: F401 (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    """A tiny adapter trained with yarn x4 (window 64 -> 256) on the tiny test model."""
    from hf_posext.training.trainer import train

    out = tmp_path_factory.mktemp("card-adapter") / "run"
    train(tiny_config(out, "train.max_steps=2"), progress=False)
    return str(out / "adapter")


def _suite(entry: str, out, *extra: str) -> int:
    return main(["eval", "suite", "--models", entry, "--lengths", "64", "--tasks", "perplexity", "--trials", "1",
                 "--data", str(TINY_CORPUS), "--out", str(out), "--no-progress", *extra])


@pytest.mark.parametrize("asked, extra, names", [
    ("@yarn:factor=8", (), "not yarn x8"),
    ("@none", (), "not none x1"),
    ("", (), "its requests from --methods none"),  # --methods left at its default: none
    ("", ("--methods", "yarn", "--factor", "2"), "not yarn x2"),
    ("@dynamic-ntk:factor=4", (), "not dynamic-ntk x4"),
])
def test_an_adapter_row_at_another_scaling_is_refused_before_any_model_loads(adapter, tmp_path, capsys, monkeypatch,
                                                                             asked, extra, names):
    from hf_posext.evaluation import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the adapter row was checked")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
    out = tmp_path / "suite"
    entry = f"tuned={TINY_MODEL}+{adapter}"
    assert _suite(entry + asked, out, *extra) != 0
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "trained with yarn x4" in error and names in error, error
    # the fix in the suite's own spelling, each a --models entry that runs
    assert f"write {entry}@yarn:factor=4 (or {entry}@as-saved" in error, error
    assert "--factor 4" not in error and "evaluate it" not in error and not out.exists()  # eval's fix replaced


def test_an_adapter_row_for_another_base_model_names_the_entry_to_write(adapter, tmp_path, capsys):
    assert _suite(f"smollm2-135m+{adapter}@as-saved", tmp_path / "suite") != 0
    error = capsys.readouterr().err.strip()
    assert "was trained on base model" in error and f"write the entry {TINY_MODEL}+{adapter}" in error, error
    assert "--model " not in error


@pytest.mark.parametrize("asked", ["@as-saved", "@yarn:factor=4"])
def test_an_adapter_row_at_its_trained_scaling_runs(adapter, tmp_path, capsys, asked):
    import json

    out = tmp_path / "suite"
    assert _suite(f"{TINY_MODEL}+{adapter}{asked}", out) == 0
    (row,) = json.loads((out / "card.json").read_text())["settings"]["rows"]
    assert (row["report"]["method"], row["report"]["factor"]) == ("yarn", 4.0)
