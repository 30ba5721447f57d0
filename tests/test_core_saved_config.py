"""A saved tokenizer's ``model_max_length``: one helper saves a tokenizer object with it, one edits saved files."""

from __future__ import annotations

import json

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_posext.core.saved_config import save_tokenizer_with_max_length, set_tokenizer_max_length


def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", model_max_length=64)


def test_a_tokenizer_is_saved_with_the_served_length_and_keeps_it(tmp_path):
    tokenizer = _tokenizer()
    save_tokenizer_with_max_length(tokenizer, tmp_path, 256)
    assert tokenizer.model_max_length == 256
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] == 256
    assert AutoTokenizer.from_pretrained(tmp_path).model_max_length == 256


def test_saved_tokenizer_files_are_edited_only_where_the_length_differs(tmp_path):
    assert set_tokenizer_max_length(tmp_path, 256) is False  # no tokenizer files: nothing to edit
    _tokenizer().save_pretrained(tmp_path)
    assert set_tokenizer_max_length(tmp_path, 256) is True
    assert set_tokenizer_max_length(tmp_path, 256) is False
    assert AutoTokenizer.from_pretrained(tmp_path).model_max_length == 256
