"""hf_posext.models: the embedded model's tokenizer takes its special tokens from its GGUF file."""

from __future__ import annotations

import pytest

from hf_posext.models import align_special_tokens, gguf_special_token_ids


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    # as transformers 5.17 builds SmolLM2's from its GGUF: the end-of-sequence token wrong, no padding token
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_start|>",
                                   unk_token="<|endoftext|>")


def _gguf(path, **ids):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{name}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_special_tokens_are_set_as_the_gguf_file_declares_them(tmp_path):
    path = _gguf(tmp_path / "m.gguf", bos_token_id=1, eos_token_id=2, unknown_token_id=0, padding_token_id=2)
    ids = gguf_special_token_ids(path)
    assert ids == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    tokenizer = _tokenizer()
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", None)
    changed = align_special_tokens(tokenizer, ids)
    assert changed == {"eos_token": ("<|im_start|>", "<|im_end|>"), "pad_token": (None, "<|im_end|>")}
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 2, 1)
    assert align_special_tokens(tokenizer, ids) == {}  # already as declared: nothing changes


def test_a_file_naming_only_some_tokens_sets_only_those_and_an_id_past_the_vocabulary_is_refused(tmp_path):
    assert gguf_special_token_ids(_gguf(tmp_path / "eos.gguf", eos_token_id=2)) == {"eos_token": 2}
    tokenizer = _tokenizer()
    with pytest.raises(ValueError, match="token id 9 as its eos_token, outside the tokenizer's 5 tokens"):
        align_special_tokens(tokenizer, {"pad_token": 2, "eos_token": 9})
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", None)  # nothing set
