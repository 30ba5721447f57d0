"""Perplexity at several context lengths, methods side by side (protocol: docs/evaluation.md).

For each length n, the text is cut into non-overlapping *segments* of n tokens, document by document
(segments never cross documents; a document shorter than one segment is skipped and counted). With a
BOS token (``bos="auto"`` uses one when the tokenizer adds it by itself), a segment is BOS + n-1 text
tokens. Every token of a segment except the first is predicted from all the tokens before it in the
segment, so a segment scores n-1 tokens; the result is the token-weighted mean NLL over the segments and
its exponential, the perplexity. ("Window" is kept for the model's context window; segments were
called windows before, and ``max_windows=`` / ``make_windows`` still work. Results files keep their
``max_windows`` and ``windows`` keys, so earlier results are found and read as before.) The loss is computed from the final hidden states in chunks, so the
[tokens x vocabulary] logits never exist at once (at 16384 tokens and a 49k vocabulary they would take
3.2 GB in float32); a chunk shrinks with the vocabulary (:func:`hf_posext.lm.chunked_loss.chunk_for_vocabulary`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import torch

from hf_posext.core.deprecation import renamed_keyword
from hf_posext.core.request import ScalingRequest
from hf_posext.text_sources import encode_text, load_documents
from hf_posext.evaluation.grid import Cell, Unit, run_grid
from hf_posext.evaluation.store import ResultStore
from hf_posext.lm.distributed import Distributed
from hf_posext.lm.scoring import base_model, chunked_nll

__all__ = ["chunked_nll", "tokenize_documents", "make_segments", "make_windows", "evaluate_perplexity", "uses_bos"]


def uses_bos(tokenizer: Any, bos: str = "auto") -> int | None:
    """The BOS id to start segments with: ``"yes"``/``"no"``, or ``"auto"`` = when the tokenizer adds one itself."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos == "no":
        return None
    if bos == "yes":
        if bos_id is None:
            raise ValueError("bos='yes' but the tokenizer has no BOS token; use bos='auto' or 'no'.")
        return int(bos_id)
    if bos != "auto":
        raise ValueError(f"bos must be 'auto', 'yes' or 'no', got {bos!r}.")
    if bos_id is None:
        return None
    try:
        with_special = tokenizer.encode("a", add_special_tokens=True)
    except TypeError:
        return None
    return int(bos_id) if with_special and with_special[0] == bos_id else None


def tokenize_documents(tokenizer: Any, documents: Sequence[str], concatenate: bool = False) -> list[list[int]]:
    """Token ids of each document (no special tokens); ``concatenate`` joins them, EOS-separated, into one."""
    token_docs = [encode_text(tokenizer, document) for document in documents]
    if concatenate and len(token_docs) > 1:
        separator = [] if getattr(tokenizer, "eos_token_id", None) is None else [int(tokenizer.eos_token_id)]
        joined: list[int] = []
        for index, ids in enumerate(token_docs):
            joined.extend(ids if index == 0 else separator + ids)
        token_docs = [joined]
    return token_docs


def make_segments(
    token_docs: Sequence[Sequence[int]], length: int, max_segments: int | None = None, bos_id: int | None = None
) -> tuple[list[tuple[int, int, list[int]]], int]:
    """Non-overlapping segments of ``length`` tokens (BOS + ``length-1`` text tokens with a BOS).

    Returns:
        ``(segments, skipped)``: ``(document index, start token, ids)`` triples in document order (at most
        ``max_segments``), and the number of documents shorter than one segment.

    Raises:
        ValueError: no document is long enough for one segment.
    """
    text_tokens = length - (1 if bos_id is not None else 0)
    segments: list[tuple[int, int, list[int]]] = []
    skipped = 0
    for doc_index, ids in enumerate(token_docs):
        if len(ids) < text_tokens:
            skipped += 1
            continue
        for start in range(0, len(ids) - text_tokens + 1, text_tokens):
            if max_segments is not None and len(segments) >= max_segments:
                break
            segment = list(ids[start : start + text_tokens])
            segments.append((doc_index, start, ([bos_id] if bos_id is not None else []) + segment))
    if not segments:
        longest = max((len(ids) for ids in token_docs), default=0)
        raise ValueError(
            f"No document has the {text_tokens} tokens a {length}-token segment needs (the longest has {longest}, "
            f"{skipped} skipped). Use shorter --lengths, longer documents, or --concatenate to join documents."
        )
    return segments, skipped


def make_windows(
    token_docs: Sequence[Sequence[int]], length: int, max_windows: int | None = None, bos_id: int | None = None
) -> tuple[list[tuple[int, int, list[int]]], int]:
    """The former name of :func:`make_segments` (same arguments, ``max_windows`` for ``max_segments``)."""
    return make_segments(token_docs, length, max_windows, bos_id)


def evaluate_perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    data: str | os.PathLike | Sequence[str],
    methods: Sequence[ScalingRequest],
    lengths: Sequence[int],
    factor: float | None = None,
    out_dir: str | os.PathLike = "results",
    model_name: str = "model",
    max_segments: int = 8,
    max_tokens: int | None = None,
    bos: str = "auto",
    concatenate: bool = False,
    text_field: str | None = None,
    split: str = "test",
    chunk_size: int = 2048,
    batch_size: int = 1,
    overwrite: bool = False,
    reuse_identical: bool = True,
    dist: Distributed | None = None,
    progress: bool = True,
    extra_config: dict[str, Any] | None = None,
    max_windows: int | None = None,
) -> ResultStore:
    """Perplexity of ``model`` under each method at each length; records go to ``out_dir``.

    Args:
        model: the loaded (unpatched) model.
        tokenizer: its tokenizer.
        data: a text source (see :mod:`hf_posext.text_sources`) or a list of document strings.
        methods: methods to compare (``none`` = unpatched).
        lengths: segment lengths in tokens.
        factor: scale factor for every method (None: longest length / original window).
        out_dir: results folder.
        model_name: how the model is named in the results.
        max_segments: segments per length (the first ones, in document order).
        max_tokens: if given, at most ``max(1, max_tokens // length)`` segments per length (still capped
            by ``max_segments``), so every length reads the same leading tokens: 4 segments of 4096 and
            one of 16384 cover the same 16384 tokens.
        bos: ``"auto"``, ``"yes"`` or ``"no"`` (see :func:`uses_bos`).
        concatenate: join all documents into one (EOS between them) before cutting segments.
        text_field: the text field/column of .jsonl/.parquet/dataset sources.
        split: the dataset split of a dataset name.
        chunk_size: at most this many positions per output-head chunk; fewer with a large vocabulary, so that a
            chunk holds at most :data:`~hf_posext.lm.chunked_loss.LOGITS_BUDGET` logits (384 positions for
            Gemma 3's 262,144 words). Sliding-window layers are computed banded on a CPU (same numbers).
        batch_size: segments per forward pass.
        overwrite: recompute cells already in the results file.
        reuse_identical: reuse results between methods that compute the same function at a length.
        dist: process group (None: detected from the environment).
        progress: show progress bars (``--no-progress`` turns them off).
        extra_config: more entries for the run config (e.g. the dtype), part of the results file key.
        max_windows: the old name of ``max_segments`` (a FutureWarning).

    Returns:
        The :class:`ResultStore` with one record per (method, length): ``nll``, ``ppl``, ``tokens``,
        ``windows`` (the number of segments), ``skipped_documents``.
    """
    max_segments = renamed_keyword("max_windows", max_windows, "max_segments", max_segments, 8)
    dist = dist or Distributed()
    documents = [str(d) for d in data] if isinstance(data, (list, tuple)) else load_documents(data, text_field=text_field, split=split)
    token_docs = tokenize_documents(tokenizer, documents, concatenate)
    bos_id = uses_bos(tokenizer, bos)
    source = "<in-memory documents>" if isinstance(data, (list, tuple)) else str(data)
    run_config = _run_config(model_name=model_name, source=source, max_segments=max_segments, bos=bos_id is not None,
                             concatenate=concatenate, text_field=text_field, max_tokens=max_tokens, extra_config=extra_config)
    store = ResultStore(out_dir, "perplexity", run_config, overwrite=overwrite, write=dist.is_main)
    return run_grid(
        model=model, methods=methods, lengths=lengths, factor=factor,
        plan=_segment_plan(token_docs, bos_id, max_segments, max_tokens), evaluate=_segment_scorer(model, chunk_size),
        aggregate=_perplexity, store=store, dist=dist, batch_size=batch_size, reuse_identical=reuse_identical,
        progress=progress, description="perplexity ", unit_name="window",
    )


def _run_config(*, model_name: str, source: str, max_segments: int, bos: bool, concatenate: bool,
                text_field: str | None, max_tokens: int | None, extra_config: dict[str, Any] | None) -> dict[str, Any]:
    """The run config that keys the results file (its ``max_windows`` key is ``max_segments``, as in older files).

    Raises:
        ValueError: ``max_tokens`` is below 1.
    """
    run_config = {
        "task": "perplexity", "model": model_name, "data": source, "max_windows": max_segments, "bos": bos,
        "concatenate": concatenate, "text_field": text_field, **(extra_config or {}),
    }
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens}")
        run_config["max_tokens"] = max_tokens  # only when set: keeps the results-file key of older runs
    return run_config


def _segment_plan(token_docs: list[list[int]], bos_id: int | None, max_segments: int,
                  max_tokens: int | None) -> Callable[[int], list[Cell]]:
    """The grid's plan: at a length, one cell of the first segments (``max_segments``, fewer under ``max_tokens``)."""

    def plan(length: int) -> list[Cell]:
        count = max_segments if max_tokens is None else min(max_segments, max(1, max_tokens // length))
        segments, skipped = make_segments(token_docs, length, count, bos_id)
        units = [Unit(("ppl", length, doc, start), ids) for doc, start, ids in segments]
        return [Cell({}, units, {"skipped_documents": skipped, "documents": len(token_docs)})]

    return plan


def _segment_scorer(model: torch.nn.Module, chunk_size: int) -> Callable[[list[list[int]]], list[dict[str, Any]]]:
    """The grid's evaluate: the summed NLL and the scored tokens of each segment of a batch."""
    device = next(base_model(model).parameters()).device

    def evaluate(batch: list[list[int]]) -> list[dict[str, Any]]:
        ids = torch.tensor(batch, dtype=torch.long, device=device)
        nll, scored = chunked_nll(model, ids, chunk_size)
        return [{"nll_sum": float(value), "tokens": scored} for value in nll]

    return evaluate


def _perplexity(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The grid's aggregate: the token-weighted mean NLL of a cell's segments and its exponential."""
    tokens = sum(r["tokens"] for r in results)
    nll = sum(r["nll_sum"] for r in results) / tokens
    return {"nll": nll, "ppl": math.exp(min(nll, 700.0)), "tokens": tokens, "windows": len(results)}
