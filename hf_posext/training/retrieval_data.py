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

``wording="varied"`` draws each record's wording and each question's wording separately, from several of each
(:data:`VARIED_RECORDS`, :data:`VARIED_QUESTIONS`) and with one of several attributes (:data:`ATTRIBUTES`), so
that the model practises finding a fact by what it says rather than by one string repeated: a record may read
``Marek Quist's badge number is 5120.`` and its question ``What is the badge number of Marek Quist? The
badge number of Marek Quist is``. Two of the question forms end in a statement to complete, as the needle
prompt of :mod:`hf_posext.evaluation.needle` does; none uses its words ("special magic number", "mentioned in
the provided text") or the passkey's ("pass key"), and the keys are people's names, never the needle's key
words. ``wording="fixed"`` (the default) keeps the one wording above, draw for draw as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["RECORD", "QUESTION", "ATTRIBUTES", "VARIED_RECORDS", "VARIED_QUESTIONS", "WORDINGS", "FIRST_NAMES", "SURNAMES",
           "RetrievalRecords", "retrieval_records_for"]

RECORD = " The locker code of {name} is {code}."
QUESTION = "\nQuestion: What is the locker code of {name}? Answer:"
#: ``wording="varied"``: the attribute a record states, drawn per record.
ATTRIBUTES = ("locker code", "badge number", "account number", "room number", "ticket number", "parcel number",
              "door code", "member number")
#: ``wording="varied"``: a record's wording, drawn per record.
VARIED_RECORDS = (
    " The {attribute} of {name} is {code}.",
    " {name}'s {attribute} is {code}.",
    " For the files: {name} was given {attribute} {code}.",
    " Note that the {attribute} assigned to {name} is {code}.",
)
#: ``wording="varied"``: a question's wording, drawn per question, independently of its record's.
VARIED_QUESTIONS = (
    "\nQuestion: What is the {attribute} of {name}? Answer:",
    "\nWhat is the {attribute} of {name}? The {attribute} of {name} is",
    "\nQ: Which {attribute} was {name} given?\nA:",
    "\nEarlier in this text, the {attribute} of {name} was stated. It is",
)
WORDINGS = ("fixed", "varied")
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
        wording: ``"fixed"`` (one record and question wording) or ``"varied"`` (drawn per record and question
            from :data:`VARIED_RECORDS`, :data:`VARIED_QUESTIONS` and :data:`ATTRIBUTES`).
    """

    encode: Callable[[str], list[int]]
    records: int
    labels: str = "answers"
    wording: str = "fixed"

    def __post_init__(self) -> None:
        if self.wording not in WORDINGS:
            raise ValueError(f"wording={self.wording!r} is not one of {', '.join(WORDINGS)}.")

    def most_tokens(self) -> int:
        """The most tokens the records and questions of one sample can take (every name and wording, 7-digit codes)."""
        code = "9" * 7
        names = [f"{first} {last}" for first in FIRST_NAMES for last in SURNAMES]
        if self.wording == "fixed":
            record_forms, question_forms = [(RECORD, "")], [(QUESTION, "")]
        else:
            record_forms = [(form, attribute) for form in VARIED_RECORDS for attribute in ATTRIBUTES]
            question_forms = [(form, attribute) for form in VARIED_QUESTIONS for attribute in ATTRIBUTES]
        longest_record = max(len(self.encode(form.format(name=name, code=code, attribute=attribute)))
                             for form, attribute in record_forms for name in names)
        longest_question = max(len(self.encode(form.format(name=name, attribute=attribute)))
                               for form, attribute in question_forms for name in names)
        return self.records * (longest_record + longest_question + len(self.encode(f" {code}.")))

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
        order = torch.randperm(len(pairs), generator=generator).tolist()
        if self.wording == "fixed":  # no further draws: the fixed wording's samples are those of earlier versions
            record_texts = [RECORD.format(name=name, code=code) for name, code in pairs]
            question_texts = [QUESTION.format(name=pairs[i][0]) for i in order]
        else:
            attributes = [ATTRIBUTES[i] for i in _draw_indices(len(ATTRIBUTES), len(pairs), generator)]
            record_forms = _draw_indices(len(VARIED_RECORDS), len(pairs), generator)
            question_forms = _draw_indices(len(VARIED_QUESTIONS), len(pairs), generator)
            record_texts = [VARIED_RECORDS[form].format(name=name, code=code, attribute=attribute)
                            for (name, code), attribute, form in zip(pairs, attributes, record_forms)]
            question_texts = [VARIED_QUESTIONS[question_forms[k]].format(name=pairs[i][0], attribute=attributes[i])
                              for k, i in enumerate(order)]
        record_ids = [self.encode(text) for text in record_texts]
        questions = [(self.encode(text), self.encode(f" {pairs[i][1]}.")) for text, i in zip(question_texts, order)]
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


def _draw_indices(choices: int, count: int, generator: torch.Generator) -> list[int]:
    """``count`` indices in [0, choices), drawn with replacement."""
    return torch.randint(0, choices, (count,), generator=generator).tolist()


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
                            data_config.retrieval_labels, data_config.retrieval_wording)
