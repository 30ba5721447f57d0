"""Packed training sequences: tokenize documents, cut them into equal-length sequences, serve resumable batches.

Documents come from :mod:`hf_posext.text_sources` (local ``.txt``/``.jsonl``/``.parquet`` files or folders, a
``datasets`` name, or ``builtin:python-docs``). They are tokenized, joined with the end-of-sequence token
and cut into sequences of ``data.sequence_length`` tokens (the remainder is dropped), so every training
token is real text and every sample has the same length.

The order of sequences is a pure function of ``(seed, global sample counter)``: epoch ``e`` visits the
sequences in ``randperm(N)`` drawn from a generator seeded by ``(seed, e)``, and PoSE position ids of a
sample come from a generator seeded by ``(seed, e, index)``. A run resumed at optimizer step ``k``
therefore sees exactly the batches an uninterrupted run sees, on any number of processes, with nothing to
store but ``k``.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_posext.text_sources import encode_text
from hf_posext.training.pose import pose_position_ids, sample_generator
from hf_posext.training.retrieval_data import RetrievalRecords, retrieval_records_for

__all__ = ["tokenize_and_pack", "PackedSequences", "collate_sequences", "load_packed_sequences", "NoDataError"]

logger = logging.getLogger(__name__)


class NoDataError(ValueError):
    """The data source yields too little text to fill one training sequence."""


def tokenize_and_pack(
    documents, tokenizer: Any, sequence_length: int, max_tokens: int | None = None, progress: bool = False
) -> torch.Tensor:
    """Tokenize ``documents`` and pack them into sequences of ``sequence_length`` tokens.

    Args:
        documents: an iterable of strings.
        tokenizer: a transformers tokenizer (its ``eos_token_id`` separates documents, when it has one).
        sequence_length: tokens per sequence.
        max_tokens: stop after this many tokens (None: all).
        progress: show a tqdm bar over documents.

    Returns:
        LongTensor [num_sequences, sequence_length].

    Raises:
        NoDataError: fewer than ``sequence_length`` tokens in total.
    """
    from tqdm.auto import tqdm

    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chunks: list[torch.Tensor] = []
    total = 0
    for document in tqdm(documents, desc="tokenizing", unit="doc", disable=not progress):
        ids = encode_text(tokenizer, document) + separator
        if max_tokens is not None:
            ids = ids[: max_tokens - total]
        chunks.append(torch.tensor(ids, dtype=torch.long))
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if total < sequence_length:
        raise NoDataError(
            f"The training text holds {total} tokens, fewer than one sequence of {sequence_length}: add text to "
            "data.source, or lower data.sequence_length."
        )
    stream = torch.cat(chunks)
    count = stream.numel() // sequence_length
    return stream[: count * sequence_length].view(count, sequence_length)


@dataclass
class PackedSequences:
    """Fixed-length token sequences and the rule that turns a global sample counter into a batch.

    Attributes:
        sequences: LongTensor [N, W] (W = ``data.sequence_length``).
        seed: seeds the epoch permutations and PoSE draws.
        pose_target_length: PoSE target T (None: plain positions 0..W-1).
        pose_chunks: PoSE chunks per sample.
        pose_far_fraction: share of the PoSE samples whose last chunk ends at T - 1 (``far`` in
            :func:`~hf_posext.training.pose.pose_position_ids`), each deciding with its own seeded draw.
        retrieval: turns a sample into a retrieval sample (None: never); see
            :mod:`hf_posext.training.retrieval_data`.
        retrieval_fraction: share of the samples that ``retrieval`` turns (each sample decides with its own
            seeded draw, so the choice resumes like everything else).
    """

    sequences: torch.Tensor
    seed: int = 0
    pose_target_length: int | None = None
    pose_chunks: int = 2
    pose_far_fraction: float = 0.0
    retrieval: RetrievalRecords | None = None
    retrieval_fraction: float = 1.0

    def __post_init__(self) -> None:
        self._permutations: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def sequence_length(self) -> int:
        """Tokens per sample, W."""
        return self.sequences.shape[1]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._permutations = {epoch: torch.randperm(len(self), generator=generator)}
        return self._permutations[epoch]

    def sample(self, counter: int) -> dict[str, torch.Tensor]:
        """The ``counter``-th sample of the infinite shuffled stream (epoch = counter // N)."""
        epoch, offset = divmod(counter, len(self))
        index = int(self._permutation(epoch)[offset])
        input_ids = self.sequences[index]
        if self.pose_target_length is None:
            position_ids = torch.arange(self.sequence_length, dtype=torch.long)
        else:
            # The far draw has its own stream (salted seed) and is skipped at fraction 0, so runs without it keep
            # their PoSE draws bit for bit.
            far = self.pose_far_fraction > 0 and float(
                torch.rand(1, generator=sample_generator(self.seed + FAR_SEED_SALT, epoch, index))) < self.pose_far_fraction
            position_ids = pose_position_ids(
                self.sequence_length, self.pose_target_length, self.pose_chunks, sample_generator(self.seed, epoch, index),
                far=far,
            )
        sample = {"input_ids": input_ids, "position_ids": position_ids}
        if self.retrieval is not None:
            # Its own stream of draws (salted seed), so that turning retrieval on leaves the PoSE draws as they were.
            generator = sample_generator(self.seed + RETRIEVAL_SEED_SALT, epoch, index)
            if float(torch.rand(1, generator=generator)) < self.retrieval_fraction:
                sample["input_ids"], sample["labels"] = self.retrieval.apply(input_ids, generator)
        return sample

    def batch(self, micro_batch: int, rank: int, num_processes: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The batch of process ``rank`` for global micro-batch ``micro_batch``.

        Micro-batch m holds samples ``[m * P * B, (m + 1) * P * B)`` of the stream; process r takes the
        r-th slice of B, collated by :func:`collate_sequences`.
        """
        first = (micro_batch * num_processes + rank) * batch_size
        return collate_sequences([self.sample(first + j) for j in range(batch_size)])


#: Added to the run's seed for the retrieval draws of a sample.
RETRIEVAL_SEED_SALT = 7_777_777
#: Added to the run's seed for the PoSE far draw of a sample.
FAR_SEED_SALT = 3_333_331


def collate_sequences(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a batch: input_ids, position_ids, labels (a sample's own ``labels``, else its
    input_ids) and an all-ones attention_mask.

    The mask is always given: without one, transformers reads position ids that skip (PoSE) as
    boundaries between packed sequences and would block attention across PoSE chunks.
    """
    input_ids = torch.stack([s["input_ids"] for s in samples])
    return {
        "input_ids": input_ids,
        "position_ids": torch.stack([s["position_ids"] for s in samples]),
        "attention_mask": torch.ones_like(input_ids),
        "labels": torch.stack([s["labels"] if "labels" in s else s["input_ids"] for s in samples]).clone(),
    }


def load_packed_sequences(data_config: Any, tokenizer: Any, seed: int, pose_target_length: int | None,
                          progress: bool = False) -> PackedSequences:
    """Read ``data_config.source`` through :mod:`hf_posext.text_sources`, tokenize, pack, and wrap for training.

    Args:
        data_config: a :class:`~hf_posext.training.config.DataSection`.
        tokenizer: the model's tokenizer.
        seed: the run's seed.
        pose_target_length: PoSE target (None when PoSE is off).
        progress: tqdm bar while tokenizing.

    Raises:
        FileNotFoundError: a path that does not exist.
        NoDataError: not enough text for one sequence.
    """
    from hf_posext.text_sources import TEXT_SUFFIXES, iter_documents

    source = Path(str(data_config.source)).expanduser()
    if data_config.exclude:
        if not source.is_dir():
            raise ValueError(f"data.exclude applies to a source folder, but data.source={data_config.source!r} is not one.")
        files = sorted(
            p for p in source.rglob("*")
            if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
            and not any(fnmatch.fnmatch(p.name, pattern) for pattern in data_config.exclude)
        )
        if not files:
            raise NoDataError(f"data.exclude={data_config.exclude} leaves no file to train on in {source}.")
        logger.info("training on %d files of %s (excluded: %s)", len(files), source, ", ".join(data_config.exclude))
        documents = (d for f in files for d in iter_documents(f, text_field=data_config.text_field))
    else:
        documents = iter_documents(data_config.source, text_field=data_config.text_field, split=data_config.split)

    def limited():
        count = 0
        for document in documents:
            if not document.strip():
                continue
            yield document
            count += 1
            if data_config.max_documents is not None and count >= data_config.max_documents:
                return

    sequences = tokenize_and_pack(limited(), tokenizer, data_config.sequence_length, data_config.max_tokens,
                                  progress=progress)
    logger.info("packed %d sequences of %d tokens from %s", sequences.shape[0], sequences.shape[1], data_config.source)
    return PackedSequences(sequences, seed=seed, pose_target_length=pose_target_length, pose_chunks=data_config.pose_chunks,
                           pose_far_fraction=data_config.pose_far_fraction, retrieval=retrieval_records_for(data_config, tokenizer),
                           retrieval_fraction=data_config.retrieval_fraction)
