"""The saving helpers every backend shares (hf_posext/backends/saving.py): tokenizer lengths and save_pretrained."""

from __future__ import annotations

import copy
import types

import pytest
from torch import nn

from hf_posext.backends.saving import (
    check_tokenizer,
    install_save_pretrained,
    remove_save_pretrained,
    restore_tokenizer_lengths,
    set_tokenizer_lengths,
)


def _tokenizer(length: int = 128):
    return types.SimpleNamespace(model_max_length=length)


def test_a_new_tokenizer_takes_the_length_and_unpatch_restores_it():
    tokenizer = _tokenizer(128)
    kept = set_tokenizer_lengths([], tokenizer, 512)
    assert tokenizer.model_max_length == 512 and kept == [(tokenizer, 128)]
    restore_tokenizer_lengths(kept)
    assert tokenizer.model_max_length == 128


def test_patching_again_keeps_the_pre_patch_length():
    tokenizer, other = _tokenizer(128), _tokenizer(64)
    kept = set_tokenizer_lengths([], tokenizer, 512)
    # No tokenizer given: the previous patch's follows the new window.
    kept = set_tokenizer_lengths(kept, None, 1024)
    assert tokenizer.model_max_length == 1024 and kept == [(tokenizer, 128)]
    # The same tokenizer again: its length to restore is still the pre-patch one.
    kept = set_tokenizer_lengths(kept, tokenizer, 256)
    assert kept == [(tokenizer, 128)] and tokenizer.model_max_length == 256
    # Another tokenizer replaces it; the first gets its own length back.
    kept = set_tokenizer_lengths(kept, other, 2048)
    assert tokenizer.model_max_length == 128 and other.model_max_length == 2048 and kept == [(other, 64)]


def test_a_tokenizer_without_an_int_length_is_refused():
    check_tokenizer(None)
    check_tokenizer(_tokenizer())
    with pytest.raises(TypeError, match="must be a transformers tokenizer.*got str"):
        check_tokenizer("gpt2")


class _Saver(nn.Module):
    def save_pretrained(self, save_directory, is_main_process=True):
        self.saved = save_directory
        return "stock"


def test_save_pretrained_runs_the_stock_save_then_the_backend_addition(tmp_path):
    model, calls = _Saver(), []
    install_save_pretrained(model, lambda m, folder: calls.append((m, folder)))
    assert model.save_pretrained(tmp_path) == "stock"
    assert model.saved == tmp_path and calls == [(model, str(tmp_path))]
    model.save_pretrained(tmp_path, is_main_process=False)
    assert len(calls) == 1  # the addition runs on the main process only
    copied = copy.deepcopy(model)
    copied.save_pretrained(tmp_path)
    assert calls[-1][0] is copied  # a copy saves itself, not the original
    remove_save_pretrained(model)
    model.save_pretrained(tmp_path)
    assert len(calls) == 2 and "save_pretrained" not in model.__dict__
