"""The practice data's varied wording: each question's wording is drawn independently of its record's.

A question asks about its own record (the same name and attribute), in a wording drawn apart from the
record's wording: over many samples every (record form, question form) pair occurs, and the question's
form equals its record's about as often as chance (1 in 4), not always.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from hf_posext.training.retrieval_data import VARIED_QUESTIONS, VARIED_RECORDS, RetrievalRecords

ENCODE = lambda text: [ord(c) for c in text]  # noqa: E731 - one token per character


def _pattern(form: str) -> re.Pattern:
    text = re.escape(form)
    for field, group in (("name", r"(?P<name>[A-Z][a-z]+ [A-Z][a-z]+)"), ("attribute", r"(?P<attribute>[a-z]+ [a-z]+)"),
                         ("code", r"(?P<code>\d+)")):
        escaped = re.escape("{" + field + "}")
        text = text.replace(escaped, group, 1).replace(escaped, f"(?P={field})")
    return re.compile(text)


RECORD_PATTERNS = [_pattern(form) for form in VARIED_RECORDS]
QUESTION_PATTERNS = [_pattern(form) for form in VARIED_QUESTIONS]


def _parse(text: str, patterns) -> dict[str, tuple[int, str]]:
    """name -> (form index, attribute) of every occurrence of one of ``patterns``."""
    found: dict[str, tuple[int, str]] = {}
    for index, pattern in enumerate(patterns):
        for match in pattern.finditer(text):
            found[match.group("name")] = (index, match.group("attribute"))
    return found


def test_each_questions_wording_is_drawn_apart_from_its_records():
    records = RetrievalRecords(ENCODE, records=3, wording="varied")
    pairs: Counter = Counter()
    for seed in range(150):
        ids, _labels = records.apply(torch.full((1500,), ord("~")), torch.Generator().manual_seed(seed))
        text = "".join(map(chr, ids.tolist()))
        split = text.rindex("~") + 1  # the records sit in the filler ("~"), the questions after it
        stated, asked = _parse(text[:split], RECORD_PATTERNS), _parse(text[split:], QUESTION_PATTERNS)
        assert len(stated) == 3 and sorted(asked) == sorted(stated)
        for name, (question_form, attribute) in asked.items():
            record_form, record_attribute = stated[name]
            assert attribute == record_attribute  # the question asks what its record states
            pairs[record_form, question_form] += 1
    total = sum(pairs.values())
    assert len(pairs) == len(VARIED_RECORDS) * len(VARIED_QUESTIONS)  # every combination occurs
    same = sum(count for (record_form, question_form), count in pairs.items() if record_form == question_form)
    assert 0.15 < same / total < 0.35, (same, total)  # chance is 1/4 (450 questions: sd 0.02)


def test_records_may_take_exactly_half_of_the_sequence():
    """``check_fits`` and ``apply`` allow records and questions of exactly half the window, not one token more."""
    from hf_posext.training.retrieval_data import FIRST_NAMES, SURNAMES

    for wording in ("fixed", "varied"):
        records = RetrievalRecords(ENCODE, records=2, wording=wording)
        most = records.most_tokens()
        records.check_fits(2 * most)
        with pytest.raises(ValueError, match="more than half"):
            records.check_fits(2 * most - 1)
        wide = 4000
        ids, _ = records.apply(torch.full((wide,), ord("~")), torch.Generator().manual_seed(5))
        inserted = wide - int((ids == ord("~")).sum())
        ids, _ = records.apply(torch.full((2 * inserted,), ord("~")), torch.Generator().manual_seed(5))
        assert ids.numel() == 2 * inserted
        with pytest.raises(ValueError, match="more than half"):
            records.apply(torch.full((2 * inserted - 1,), ord("~")), torch.Generator().manual_seed(5))
    assert len(set(FIRST_NAMES)) * len(set(SURNAMES)) == 24 * 24  # 576 distinct names to draw a sample's records from
    with pytest.raises(ValueError, match="at most 576 distinct retrieval records"):
        RetrievalRecords(ENCODE, records=577).apply(torch.full((60000,), ord("~")), torch.Generator().manual_seed(0))
