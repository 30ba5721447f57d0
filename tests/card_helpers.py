"""Shared by the suite's tests (tests/test_card_*.py): a character tokenizer, a tiny model saved with it, RULER cells."""

from __future__ import annotations

import math
import string

import pytest

from hf_posext.card.stats import score_summary


LENGTH = 2048  # characters = tokens with the character tokenizer; ruler_vt loops forever at 1024 (its few-shot example fills it)


def char_tokenizer():
    """Every printable ASCII character one token (100 ids, inside the tiny models' 128): offline, no hub."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from hf_posext.models import tiny_model

    folder = tmp_path_factory.mktemp("tiny_card")
    tiny_model("llama", max_position_embeddings=LENGTH).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


KEY = {"task": "niah_single_1", "length": 4096, "seed": 0}


def ruler_cell(row: str, index: int, scores: dict[int, float], key: dict | None = None, task: str = "niah_single_1") -> dict:
    return {"task": task, "kind": "ruler", "row": row, "row_index": index, "length": 4096, "base": index == 0,
            "in_window": True, "sample_key": key or KEY, "scores": {str(i): v for i, v in scores.items()},
            **score_summary(list(scores.values()))}


def perplexity_results(data: str, windows: dict[str, list[tuple[float, int]]], length: int = 4096) -> dict:
    """A perplexity results file's data: per method a cell at ``length`` holding its windows' ``(nll_sum, tokens)``."""
    cells = {}
    for method, units in windows.items():
        nll, tokens = sum(n for n, _ in units), sum(t for _, t in units)
        cells[f"{method}|factor=4|length={length}"] = {
            "method": method, "factor": 4.0, "length": length, "nll": nll / tokens, "ppl": math.exp(nll / tokens), "tokens": tokens, "windows": len(units),
            "units": [{"nll_sum": n, "tokens": t, "seconds": 1.0} for n, t in units],
            "unit_keys": [["ppl", length, 0, i * length] for i in range(len(units))]}
    return {"task": "perplexity", "config": {"task": "perplexity", "model": "m", "data": data, "max_windows": 8, "dtype": "float32"},
            "cells": cells}
