"""Packed training sequences: whole sequences of data.sequence_length tokens, and batches that are a pure
function of the step and split across processes."""

from __future__ import annotations

import pytest
import torch

from hf_posext.training.packing import NoDataError, PackedSequences, tokenize_and_pack


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def encode(self, text, add_special_tokens=False):
        return [1 + (ord(c) % 100) for c in text]


def test_packing_fills_whole_sequences_and_errors_on_too_little_text():
    tokenizer = _CharTokenizer()
    sequences = tokenize_and_pack(["abcdefg", "hijk"], tokenizer, sequence_length=4)
    # 7 + eos + 4 + eos = 13 tokens: three full sequences, the last token dropped
    stream = tokenizer("abcdefg")["input_ids"] + [0] + tokenizer("hijk")["input_ids"]
    assert sequences.shape == (3, 4) and sequences.flatten().tolist() == stream[:12]
    assert tokenize_and_pack(["abcdefg", "hijk"], tokenizer, sequence_length=4, max_tokens=9).shape == (2, 4)
    with pytest.raises(NoDataError, match="fewer than one sequence"):
        tokenize_and_pack(["ab"], _CharTokenizer(), sequence_length=16)


def test_batches_are_a_function_of_the_step_and_split_across_processes():
    sequences = torch.arange(40 * 8).view(40, 8)
    data = PackedSequences(sequences, seed=3, pose_target_length=64)
    single = data.batch(micro_batch=5, rank=0, num_processes=1, batch_size=4)
    again = PackedSequences(sequences, seed=3, pose_target_length=64).batch(5, 0, 1, 4)
    for key in single:
        assert torch.equal(single[key], again[key])
    # two processes with 2 samples each see exactly the 4 samples one process sees
    rank0, rank1 = data.batch(5, 0, 2, 2), data.batch(5, 1, 2, 2)
    assert torch.equal(torch.cat([rank0["input_ids"], rank1["input_ids"]]), single["input_ids"])
    assert torch.equal(torch.cat([rank0["position_ids"], rank1["position_ids"]]), single["position_ids"])
    assert bool((single["attention_mask"] == 1).all()) and torch.equal(single["labels"], single["input_ids"])
    # one epoch visits every sequence once
    seen = torch.cat([data.batch(m, 0, 1, 4)["input_ids"][:, 0] for m in range(10)])
    assert sorted((seen // 8).tolist()) == list(range(40))
