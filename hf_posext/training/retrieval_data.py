"""Synthetic key-value records mixed into training text: practice at finding a fact far back.

A retrieval sample is a packed training sequence (book text) with R short records hidden in its first half::

    ... The locker code of Ada Whitlock is 40719. ...

and, at its end, one question per record (in another order) followed by the answer::

    Question: What is the locker code of Ada Whitlock? Answer: 40719.

The sample keeps its length W: as many book tokens are dropped from its end as the records and questions
take. Under PoSE (:mod:`hf_posext.training.pose`) a record and its question lie anywhere from a few to
about T tokens apart in position, so a W-token sample practises retrieval over the whole target window T
at the cost of W tokens. With ``labels="answers"`` only the answer tokens are trained on (the book text is
context); with ``"all"`` every token is.

The idea of fine-tuning on synthetic key-value retrieval to improve retrieval in long real text is Xiong
et al. 2024, "From Artificial Needles to Real Haystacks: Improving Retrieval Capabilities in LLMs by
Finetuning on Synthetic Data" (arXiv:2406.19292). The wording, names and code lengths here are chosen to
be unlike the passkey and needle prompts of :mod:`hf_posext.evaluation`, so that those evaluations measure
transfer, not a memorised format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["RECORD", "QUESTION", "FIRST_NAMES", "SURNAMES", "RetrievalRecords", "retrieval_records_for"]

RECORD = " The locker code of {name} is {code}."
QUESTION = "\nQuestion: What is the locker code of {name}? Answer:"
FIRST_NAMES = ("Ada", "Bruno", "Clara", "Dmitri", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kaveh",
               "Lotte", "Marek", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Stefan", "Tamar", "Umar",
               "Vera", "Wendel", "Yusuf")
SURNAMES = ("Whitlock", "Okafor", "Lindqvist", "Marchetti", "Brennan", "Castell", "Dufresne", "Engel",
            "Halloran", "Ivanova", "Jaramillo", "Kowalczyk", "Lacroix", "Moreau", "Nakamura", "Oyelaran",
            "Petrov", "Quist", "Rasmussen", "Sorensen", "Tanaka", "Underhill", "Varga", "Weston")
#: Label value ignored by the loss (transformers' convention).
IGNORED = -100


@dataclass(frozen=True)
class RetrievalRecords:
    """Turns a packed token sequence into a retrieval sample (see the module docstring).

    Attributes:
        encode: text -> token ids without special tokens.
        records: R, records (and questions) per sample, >= 1.
        labels: ``"answers"`` (loss on the answer tokens only) or ``"all"``.
    """

    encode: Callable[[str], list[int]]
    records: int
    labels: str = "answers"

    def most_tokens(self) -> int:
        """The most tokens the records and questions of one sample can take (longest name, 7-digit codes)."""
        code = "9" * 7
        per_record = max(len(self.encode(RECORD.format(name=name, code=code))) + len(self.encode(QUESTION.format(name=name)))
                         for name in (f"{first} {last}" for first in FIRST_NAMES for last in SURNAMES))
        return self.records * (per_record + len(self.encode(f" {code}.")))

    def check_fits(self, window: int) -> None:
        """Raise ValueError when the records of a sample could take more than half of a ``window``-token sequence."""
        most = self.most_tokens()
        if 2 * most > window:
            raise ValueError(
                f"{self.records} retrieval records and their questions take up to {most} tokens, more than half of the "
                f"{window}-token training sequence: lower data.retrieval_records or raise data.sequence_length."
            )

    def apply(self, input_ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` of the retrieval sample made from ``input_ids`` (LongTensor [W]).

        Raises:
            ValueError: the records and questions do not fit in half of the sequence (:meth:`check_fits`
                says so before training).
        """
        window = input_ids.numel()
        pairs = _draw_pairs(self.records, generator)
        record_ids = [self.encode(RECORD.format(name=name, code=code)) for name, code in pairs]
        order = torch.randperm(len(pairs), generator=generator).tolist()
        questions = [(self.encode(QUESTION.format(name=pairs[i][0])), self.encode(f" {pairs[i][1]}.")) for i in order]
        inserted = sum(map(len, record_ids)) + sum(len(q) + len(a) for q, a in questions)
        if 2 * inserted > window:
            raise ValueError(
                f"{self.records} retrieval records and their questions take {inserted} tokens, more than half of the "
                f"{window}-token training sequence: lower data.retrieval_records or raise data.sequence_length."
            )
        text = input_ids[: window - inserted].tolist()
        # Record offsets in the first half of the remaining text, in increasing order.
        offsets = sorted(int(x) for x in torch.randint(0, len(text) // 2 + 1, (len(record_ids),), generator=generator))
        pieces: list[int] = []
        previous = 0
        for offset, ids in zip(offsets, record_ids):
            pieces += text[previous:offset] + ids
            previous = offset
        pieces += text[previous:]
        train_context = self.labels == "all"
        labels = list(pieces) if train_context else [IGNORED] * len(pieces)
        for question, answer in questions:
            pieces += question + answer
            labels += (question if train_context else [IGNORED] * len(question)) + answer
        return torch.tensor(pieces, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def _draw_pairs(count: int, generator: torch.Generator) -> list[tuple[str, str]]:
    """``count`` distinct names, each with a code of 4 to 7 digits (no leading zero)."""
    combos = len(FIRST_NAMES) * len(SURNAMES)
    if count > combos:
        raise ValueError(f"at most {combos} distinct retrieval records per sample, asked for {count}.")
    chosen = torch.randperm(combos, generator=generator)[:count].tolist()
    pairs = []
    for index in chosen:
        name = f"{FIRST_NAMES[index // len(SURNAMES)]} {SURNAMES[index % len(SURNAMES)]}"
        digits = int(torch.randint(4, 8, (1,), generator=generator))
        code = int(torch.randint(10 ** (digits - 1), 10**digits, (1,), generator=generator))
        pairs.append((name, str(code)))
    return pairs


def retrieval_records_for(data_config: Any, tokenizer: Any) -> RetrievalRecords | None:
    """The :class:`RetrievalRecords` that ``data_config`` asks for (None when ``data.retrieval_records`` is 0)."""
    if not data_config.retrieval_records:
        return None
    from hf_posext.text_sources import encode_text

    return RetrievalRecords(lambda text: encode_text(tokenizer, text), data_config.retrieval_records,
                            data_config.retrieval_labels)
