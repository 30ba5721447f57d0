"""The books evaluations score are held apart from training: an exclusion that leaves out nothing, or every file, is
refused before anything loads, and a run that trains on a held-apart book says so and records it."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.training_helpers import TINY_CORPUS, tiny_config

from hf_posext.text_sources import HELD_APART_BOOKS, PERPLEXITY_BOOK
from hf_posext.training.config import ConfigError
from hf_posext.training.trainer import train


@pytest.fixture
def books(tmp_path):
    """The tiny corpus, plus one file under the name of each held-apart book."""
    folder = tmp_path / "books"
    shutil.copytree(TINY_CORPUS, folder)
    for index, name in enumerate(HELD_APART_BOOKS):
        shutil.copy(folder / f"ledger_{index}.txt", folder / name)
    return folder


@pytest.fixture
def no_loading(monkeypatch):
    import hf_posext.models as models
    import hf_posext.training.trainer as trainer_module

    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the exclusion was checked")

    monkeypatch.setattr(trainer_module, "load_base_model", refuse)
    monkeypatch.setattr(models, "load_tokenizer", refuse)


@pytest.mark.parametrize("pattern, closest", [("held_apart", "held-apart"), ("austen-emma", "austen-emma.txt")])
def test_an_exclusion_that_leaves_out_nothing_is_refused_before_loading(books, tmp_path, no_loading, pattern, closest):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        train(tiny_config(out, f"data.source={books}", f"data.exclude=[{pattern}]"), progress=False)
    message = str(refused.value)
    assert message.startswith(f"data.exclude: {pattern!r} matches no file") and f"did you mean {closest!r}" in message
    assert not out.exists()


def test_an_exclusion_of_every_file_is_refused_before_loading(books, tmp_path, no_loading):
    with pytest.raises(ConfigError, match=r"^data.exclude=\['\*.txt'\] leaves no file to read in "):
        train(tiny_config(tmp_path / "run", f"data.source={books}", "data.exclude=['*.txt']"), progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_on_a_held_apart_book_says_so_and_records_it(books, tmp_path):
    out = tmp_path / "run"
    config = tiny_config(out, f"data.source={books}", f"data.exclude=[{HELD_APART_BOOKS[1]}]", "train.max_steps=2",
                         "output.checkpoint_every=2", "output.save_merged=false")
    with pytest.warns(UserWarning, match=rf"^data: the training text includes the held-apart evaluation book "
                                         rf"{PERPLEXITY_BOOK}") as warned:
        result = train(config, progress=False)
    assert len([w for w in warned if "held-apart" in str(w.message)]) == 1
    assert "\n" not in str(warned[0].message)
    assert result.held_apart_read == [PERPLEXITY_BOOK]
    assert json.loads((out / "train_result.json").read_text())["held_apart_read"] == [PERPLEXITY_BOOK]
    assert json.loads((out / "checkpoint-2" / "posext_run.json").read_text())["held_apart_read"] == [PERPLEXITY_BOOK]
