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

Harder practice, with the varied wording (``tasks``, ``values``, ``chat``), in the ways the long-context papers
made retrieval practice transfer (Xiong et al. 2024 above; Hsieh et al. 2024, "RULER", for what a single lookup
does not test): each question is one of :data:`TASKS`, drawn per question,

* ``lookup``: one record, asked for (as above);
* ``distractors``: the record and two that share its wording: the same person's other attribute, and another
  person of the same first name with the same attribute;
* ``several_values``: two or three records of one person and attribute, asked for together, in the order they
  were given (a list answer: ``4410, 5120 and 77.``);
* ``chain``: a record that names another person (``Ada Whitlock uses the same badge number as Hugo Engel.``)
  and that person's record; the question asks for the first person's value (two hops);
* ``most_often``: aggregation. Three or four people each do one thing (:data:`ACTIVITIES`) a different number of
  times, one to six, each time in a record of its own scattered through the text (``Later, Vera Varga fed the
  cat.``); the question asks who did it most often (``Vera Varga.``), or which three did it most often, most often
  first (``Vera Varga, Hugo Engel and Ada Whitlock.``). A sample asks at most one: once drawn, the kind leaves
  the draw for the sample's other questions (its records take many tokens).

Its codes have 3 to 6 digits, never the 7 of RULER's needles. ``values="digits_and_words"`` makes each fact's
value either such a code or a two-word phrase
(:data:`VALUE_ADJECTIVES` x :data:`VALUE_NOUNS`, with :data:`WORD_ATTRIBUTES`), drawn per fact, so that
an answer is not always a number. ``chat`` (a share of the samples, with ``chat_template``) writes a sample
as a conversation in the model's own chat template: the book text with its records is the first user turn,
each question a user turn, each answer an assistant turn trained on up to and including the end-of-turn
token, so that the fine-tune keeps ending its answers where an instruct model ends them
(:mod:`hf_posext.evaluation.ending` measures that). The rest of a sample is unchanged: book text kept in the
mix (``data.retrieval_fraction``), PoSE positions, answers-only labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["RECORD", "QUESTION", "ATTRIBUTES", "VARIED_RECORDS", "VARIED_QUESTIONS", "WORDINGS", "FIRST_NAMES", "SURNAMES",
           "TASKS", "VALUES", "WORD_ATTRIBUTES", "VALUE_ADJECTIVES", "VALUE_NOUNS", "SEVERAL_RECORDS", "SEVERAL_QUESTIONS",
           "CHAIN_RECORDS", "CHAT_QUESTIONS", "CHAT_SEVERAL_QUESTIONS", "ACTIVITIES", "ACTIVITY_RECORDS",
           "MOST_OFTEN_QUESTIONS", "TOP_THREE_QUESTIONS", "CHAT_MOST_OFTEN_QUESTIONS", "CHAT_TOP_THREE_QUESTIONS",
           "MOST_OFTEN_PEOPLE", "MOST_OFTEN_TIMES", "RetrievalRecords", "retrieval_records_for"]

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
#: The kinds of question a sample's facts are asked in (drawn per question; see the module docstring).
TASKS = ("lookup", "distractors", "several_values", "chain", "most_often")
#: ``digits``: every value is a code (3 to 6 digits in the harder practice); ``digits_and_words``: a code or a two-word
#: phrase, drawn per fact.
VALUES = ("digits", "digits_and_words")
#: The attributes of a two-word value.
WORD_ATTRIBUTES = ("password", "code word", "call sign", "house name")
VALUE_ADJECTIVES = ("amber", "brisk", "copper", "dusty", "silent", "woollen", "crooked", "velvet", "hollow", "frosty",
                    "golden", "rusty", "narrow", "quiet", "scarlet", "gentle")
VALUE_NOUNS = ("lantern", "kettle", "harbour", "meadow", "violin", "compass", "orchard", "ladder", "teapot", "glacier",
               "chimney", "saddle", "pebble", "thimble", "barrel", "willow")
#: ``several_values``: one of a person's values of one attribute (each is stated in its own record).
SEVERAL_RECORDS = (
    " One {attribute} held by {name} is {code}.",
    " {name} holds, among others, the {attribute} {code}.",
)
#: ``several_values``: the question (the answer lists the values in the order they were stated).
SEVERAL_QUESTIONS = (
    "\nQuestion: Which {attribute}s does {name} hold, in the order given? Answer:",
    "\nList every {attribute} held by {name}, in the order they appeared:",
)
#: ``chain``: the record that points from one person to another.
CHAIN_RECORDS = (
    " {name} uses the same {attribute} as {other}.",
    " The {attribute} of {name} is whatever {other}'s is.",
)
#: ``chat``: a question in a user turn (the answer is the assistant's turn).
CHAT_QUESTIONS = (
    "What is the {attribute} of {name}?",
    "Which {attribute} was {name} given?",
    "Tell me the {attribute} of {name}, as stated in the text.",
)
CHAT_SEVERAL_QUESTIONS = ("Which {attribute}s does {name} hold, in the order given?",)
#: ``most_often``: what the people of the question do, in the past tense.
ACTIVITIES = ("rang the bell", "fed the cat", "locked the gate", "watered the garden", "called the office",
              "signed the guest book", "swept the porch", "borrowed the ladder", "mended the fence", "lit the stove")
#: ``most_often``: one time that a person did the activity (each time its own record, its wording drawn).
ACTIVITY_RECORDS = (" {name} {activity}.", " Later, {name} {activity}.", " That day {name} {activity}.")
#: ``most_often``: the one-person question (answer: the name) and the three-person one (answer: three names, most
#: often first), in plain text and in a chat turn.
MOST_OFTEN_QUESTIONS = ("\nQuestion: Who {activity} most often? Answer:",
                        "\nOf everyone in the text, who {activity} the most times? It was")
TOP_THREE_QUESTIONS = ("\nQuestion: Which three people {activity} most often, most often first? Answer:",)
CHAT_MOST_OFTEN_QUESTIONS = ("Who {activity} most often in the text?",)
CHAT_TOP_THREE_QUESTIONS = ("Which three people {activity} most often in the text, most often first?",)
#: ``most_often``: how many people share an activity, and the most times one of them does it (each a different
#: number of times, from 1 up).
MOST_OFTEN_PEOPLE = (3, 4)
MOST_OFTEN_TIMES = 6
#: Stand-ins for the context and the answers while a conversation goes through the chat template (private-use
#: characters: no template or text has them).
_CONTEXT_MARK, _ANSWER_MARK = "\ue000", "\ue001"
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
        tasks: the kinds of question (:data:`TASKS`), drawn per question; anything but ``("lookup",)`` needs
            ``wording="varied"``.
        values: :data:`VALUES`; ``"digits_and_words"`` needs ``wording="varied"``.
        chat: the share of samples written as a conversation in ``chat_template`` (0: none).
        chat_template: messages (``[{"role", "content"}]``) -> the text of the conversation in the model's chat
            template (``tokenizer.apply_chat_template(messages, tokenize=False)``); needed when ``chat`` > 0.
        end_of_turn: the ids that may end an assistant turn; the first token after an answer must be one of them.
    """

    encode: Callable[[str], list[int]]
    records: int
    labels: str = "answers"
    wording: str = "fixed"
    tasks: tuple[str, ...] = ("lookup",)
    values: str = "digits"
    chat: float = 0.0
    chat_template: Callable[[list[dict[str, str]]], str] | None = None
    end_of_turn: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.wording not in WORDINGS:
            raise ValueError(f"wording={self.wording!r} is not one of {', '.join(WORDINGS)}.")
        unknown = [task for task in self.tasks if task not in TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"tasks={list(self.tasks)!r}: each must be one of {', '.join(TASKS)} (at least one).")
        if self.values not in VALUES:
            raise ValueError(f"values={self.values!r} is not one of {', '.join(VALUES)}.")
        if not 0 <= self.chat <= 1:
            raise ValueError(f"chat={self.chat!r} must be a share in [0, 1].")
        if self.composite and self.wording != "varied":
            raise ValueError("retrieval tasks other than lookup, word values and chat samples are drawn in the varied "
                             "wording: set data.retrieval_wording=varied.")
        if self.chat and self.chat_template is None:
            raise ValueError("chat samples need the tokenizer's chat template, and this tokenizer has none: set "
                             "data.retrieval_chat=0 or use a tokenizer with a chat template.")
        if self.chat:
            self._check_template()

    @property
    def composite(self) -> bool:
        """Whether samples are drawn by :meth:`_apply_composite` (the harder practice of the module docstring)."""
        return tuple(self.tasks) != ("lookup",) or self.values != "digits" or self.chat > 0

    def most_tokens(self) -> int:
        """The most tokens the records and questions of one sample can take (every name and wording, 7-digit codes)."""
        code = "9" * 7
        names = [f"{first} {last}" for first in FIRST_NAMES for last in SURNAMES]
        if self.composite:
            return self._composite_most_tokens(names)
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
        if self.composite:
            return self._apply_composite(input_ids, generator)
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
        pieces = self._hide(input_ids, record_ids, inserted, generator)
        train_context = self.labels == "all"
        labels = list(pieces) if train_context else [IGNORED] * len(pieces)
        for question, answer in questions:
            pieces += question + answer
            labels += (question if train_context else [IGNORED] * len(question)) + answer
        return torch.tensor(pieces, dtype=torch.long), torch.tensor(labels, dtype=torch.long)

    def _hide(self, input_ids: torch.Tensor, record_ids: list[list[int]], inserted: int,
              generator: torch.Generator) -> list[int]:
        """The sample's book text, cut by the ``inserted`` tokens that records, questions and answers take, with the
        records at drawn offsets in the first half of what remains, in increasing order.

        Raises:
            ValueError: ``inserted`` is more than half of the sequence.
        """
        window = input_ids.numel()
        if 2 * inserted > window:
            raise ValueError(
                f"{self.records} retrieval records and their questions take {inserted} tokens, more than half of the "
                f"{window}-token training sequence: lower data.retrieval_records or raise data.sequence_length."
            )
        text = input_ids[: window - inserted].tolist()
        offsets = sorted(int(x) for x in torch.randint(0, len(text) // 2 + 1, (len(record_ids),), generator=generator))
        pieces: list[int] = []
        previous = 0
        for offset, ids in zip(offsets, record_ids):
            pieces += text[previous:offset] + ids
            previous = offset
        return pieces + text[previous:]

    # -- the harder practice (tasks, values, chat) -------------------------------------------------------------

    def _check_template(self) -> None:
        """Raise ValueError unless the chat template keeps the stand-ins and ends an answer with an end-of-turn id."""
        pieces = self._render([(_CONTEXT_MARK, "x")], ["y"])
        if pieces is None:
            raise ValueError("the chat template drops or reorders the turns' text, so a chat sample cannot be built from "
                             "it: set data.retrieval_chat=0.")
        after = self.encode(pieces[2])
        if not after or after[0] not in self.end_of_turn:
            raise ValueError("the chat template does not end an assistant turn with an end-of-turn token this tokenizer "
                             "knows, so a chat sample would not practise ending: set data.retrieval_chat=0.")

    def _render(self, questions: list[tuple[str, str]], answers: list[str]) -> list[str] | None:
        """The conversation's text around the context and the answers: ``[before context, context to first answer,
        after answer 1, ...]``, or None when the template loses a stand-in. ``questions``: ``(context mark or "",
        question)`` per turn."""
        assert self.chat_template is not None
        messages = []
        for (context, question), _ in zip(questions, answers):
            content = f"{context}\n\n{question}" if context else question
            messages += [{"role": "user", "content": content}, {"role": "assistant", "content": _ANSWER_MARK}]
        text = self.chat_template(messages)
        if text.count(_CONTEXT_MARK) != 1 or text.count(_ANSWER_MARK) != len(answers):
            return None
        before, rest = text.split(_CONTEXT_MARK)
        return [before, *rest.split(_ANSWER_MARK)]

    def _composite_most_tokens(self, names: list[str]) -> int:
        """A bound on the tokens the records, questions, answers and chat turns of one composite sample take: each
        piece's longest wording with the longest name and value, for the kind of question that takes the most."""
        longest = lambda texts: max(len(self.encode(text)) for text in texts)  # noqa: E731
        name = max(names, key=lambda n: len(self.encode(n)))
        values = ["9" * 7] + ([f"{a} {n}" for a in VALUE_ADJECTIVES for n in VALUE_NOUNS] if self.values != "digits" else [])
        value = max(values, key=lambda v: len(self.encode(v)))
        attributes = ATTRIBUTES + (WORD_ATTRIBUTES if self.values != "digits" else ())
        fill = dict(name=name, other=name, code=value)
        forms = lambda group: [form.format(attribute=a, **fill) for form in group for a in attributes]  # noqa: E731
        slack = 2  # a name or value may split into other tokens beside another wording's words
        record, several_record, chain = (longest(forms(group)) + slack for group in (VARIED_RECORDS, SEVERAL_RECORDS, CHAIN_RECORDS))
        question = longest(forms(VARIED_QUESTIONS + CHAT_QUESTIONS)) + slack
        several_question = longest(forms(SEVERAL_QUESTIONS + CHAT_SEVERAL_QUESTIONS)) + slack
        one, three = (len(self.encode(text)) + slack for text in (f" {value}.", f" {value}, {value} and {value}."))
        activity = lambda group: longest(form.format(name=name, activity=a) for form in group for a in ACTIVITIES) + slack  # noqa: E731
        times = sum(range(MOST_OFTEN_TIMES - MOST_OFTEN_PEOPLE[1] + 1, MOST_OFTEN_TIMES + 1))  # the most records of one question
        names_answer = len(self.encode(f" {name}, {name} and {name}.")) + slack
        cost = {"lookup": record + question + one, "distractors": 3 * record + question + one,
                "several_values": 3 * several_record + several_question + three, "chain": record + chain + question + one,
                "most_often": times * activity(ACTIVITY_RECORDS) + activity(MOST_OFTEN_QUESTIONS + TOP_THREE_QUESTIONS
                              + CHAT_MOST_OFTEN_QUESTIONS + CHAT_TOP_THREE_QUESTIONS) + names_answer}
        others = [cost[task] for task in self.tasks if task != "most_often"]
        if "most_often" in self.tasks:  # at most one most_often question a sample
            most = cost["most_often"] + (self.records - 1) * max(others or [cost["lookup"]])
        else:
            most = self.records * max(others)
        if self.chat:
            turns = self._render([(_CONTEXT_MARK, "")] + [("", "")] * (self.records - 1), ["."] * self.records)
            assert turns is not None  # checked in __post_init__
            most += sum(len(self.encode(piece)) + slack for piece in turns)
        return most

    def _apply_composite(self, input_ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`apply` for the harder practice: facts drawn per question kind, records placed in the first half
        of the book text, then the questions (plain text, or turns of the chat template)."""
        chat = self.chat > 0 and float(torch.rand((), generator=generator)) < self.chat
        names = _NameDraw(generator)
        records: list[str] = []
        lists: list[list[int]] = []  # the indices in ``records`` of each several_values question's records
        asked: list[tuple[str, str]] = []  # (question text, answer text)
        tasks = list(self.tasks)
        for _ in range(self.records):
            task = tasks[_draw_index(len(tasks), generator)]
            if task == "most_often":  # once a sample: its records take many tokens
                tasks = [t for t in tasks if t != "most_often"] or ["lookup"]
                records_of, asked_of = _most_often(names, ACTIVITIES[_draw_index(len(ACTIVITIES), generator)], chat, generator)
                records += records_of
                asked.append(asked_of)
                continue
            words = self.values != "digits" and bool(_draw_index(2, generator))
            attributes = WORD_ATTRIBUTES if words else ATTRIBUTES
            attribute = attributes[_draw_index(len(attributes), generator)]
            name = names.next()
            value = _draw_value(words, generator)
            several = task == "several_values"
            if several:
                values = [value] + [_draw_value(words, generator) for _ in range(_draw_index(2, generator) + 1)]
                lists.append(list(range(len(records), len(records) + len(values))))
                records += [SEVERAL_RECORDS[_draw_index(len(SEVERAL_RECORDS), generator)].format(name=name, attribute=attribute, code=v)
                            for v in values]
                answer = ", ".join(values[:-1]) + f" and {values[-1]}."
            else:
                holder = names.next() if task == "chain" else name
                records.append(_varied_record(holder, attribute, value, generator))
                answer = f"{value}."
                if task == "chain":
                    records.append(CHAIN_RECORDS[_draw_index(len(CHAIN_RECORDS), generator)].format(
                        name=name, attribute=attribute, other=holder))
                elif task == "distractors":
                    others = [a for a in attributes if a != attribute]
                    records.append(_varied_record(name, others[_draw_index(len(others), generator)],
                                                  _draw_value(words, generator), generator))
                    records.append(_varied_record(names.next(same_first_name_as=name), attribute,
                                                  _draw_value(words, generator), generator))
            if chat:
                group = CHAT_SEVERAL_QUESTIONS if several else CHAT_QUESTIONS
            else:
                group = SEVERAL_QUESTIONS if several else VARIED_QUESTIONS
            question = group[_draw_index(len(group), generator)].format(name=name, attribute=attribute)
            asked.append((question, answer if chat else f" {answer}"))
        asked = [asked[i] for i in torch.randperm(len(asked), generator=generator).tolist()]
        # The records in a drawn order, except that a list's records keep theirs (its answer lists them so).
        keys = torch.rand(len(records), generator=generator)
        for indices in lists:
            keys[indices] = keys[indices].sort().values
        record_ids = [self.encode(records[i]) for i in keys.argsort().tolist()]
        if chat:
            turns = self._render([(_CONTEXT_MARK, asked[0][0])] + [("", q) for q, _ in asked[1:]], [a for _, a in asked])
            assert turns is not None  # checked in __post_init__
            prefix, segments = self.encode(turns[0]), [self.encode(piece) for piece in turns[1:]]
        else:
            prefix, segments = [], [self.encode(q) for q, _ in asked]
        answers = [self.encode(a) for _, a in asked]
        inserted = len(prefix) + sum(map(len, record_ids)) + sum(map(len, segments)) + sum(map(len, answers))
        pieces = prefix + self._hide(input_ids, record_ids, inserted, generator)
        train_context = self.labels == "all"
        labels = list(pieces) if train_context else [IGNORED] * len(pieces)
        if chat:  # question turn, answer, then the next turn, whose first token (the end of the answer's turn) is trained
            pieces += segments[0]
            labels += segments[0] if train_context else [IGNORED] * len(segments[0])
            for answer, after in zip(answers, segments[1:]):
                pieces += answer + after
                labels += answer + (after if train_context else after[:1] + [IGNORED] * (len(after) - 1))
        else:
            for question, answer in zip(segments, answers):
                pieces += question + answer
                labels += (question if train_context else [IGNORED] * len(question)) + answer
        return torch.tensor(pieces, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def _most_often(names: "_NameDraw", activity: str, chat: bool, generator: torch.Generator) -> tuple[list[str], tuple[str, str]]:
    """One ``most_often`` question: the records of 3 or 4 people doing ``activity`` a different number of times
    each (1 to :data:`MOST_OFTEN_TIMES`), and ``(question, answer)``: who did it most often, or the three who did
    it most often, most often first (the answer's leading space only in plain text, as for the other kinds)."""
    low, high = MOST_OFTEN_PEOPLE
    people = low + _draw_index(high - low + 1, generator)
    times = sorted((torch.randperm(MOST_OFTEN_TIMES, generator=generator)[:people] + 1).tolist(), reverse=True)
    ranked = [names.next() for _ in times]  # most often first
    records = [ACTIVITY_RECORDS[_draw_index(len(ACTIVITY_RECORDS), generator)].format(name=name, activity=activity)
               for name, count in zip(ranked, times) for _ in range(count)]
    three = bool(_draw_index(2, generator))
    if chat:
        group = CHAT_TOP_THREE_QUESTIONS if three else CHAT_MOST_OFTEN_QUESTIONS
    else:
        group = TOP_THREE_QUESTIONS if three else MOST_OFTEN_QUESTIONS
    question = group[_draw_index(len(group), generator)].format(activity=activity)
    answer = f"{ranked[0]}, {ranked[1]} and {ranked[2]}." if three else f"{ranked[0]}."
    return records, (question, answer if chat else f" {answer}")


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


def _draw_index(choices: int, generator: torch.Generator) -> int:
    """One index in [0, choices)."""
    return int(torch.randint(0, choices, (1,), generator=generator))


def _draw_value(words: bool, generator: torch.Generator) -> str:
    """A two-word phrase, or a code of 3 to 6 digits (no leading zero; never 7, the value format of RULER's needles)."""
    if words:
        return f"{VALUE_ADJECTIVES[_draw_index(len(VALUE_ADJECTIVES), generator)]} {VALUE_NOUNS[_draw_index(len(VALUE_NOUNS), generator)]}"
    digits = _draw_index(4, generator) + 3
    return str(int(torch.randint(10 ** (digits - 1), 10**digits, (1,), generator=generator)))


def _varied_record(name: str, attribute: str, value: str, generator: torch.Generator) -> str:
    """One record in a wording of :data:`VARIED_RECORDS`, drawn."""
    return VARIED_RECORDS[_draw_index(len(VARIED_RECORDS), generator)].format(name=name, attribute=attribute, code=value)


class _NameDraw:
    """Distinct people's names for one sample, in a drawn order; one may share another's first name."""

    def __init__(self, generator: torch.Generator) -> None:
        self._order = torch.randperm(len(FIRST_NAMES) * len(SURNAMES), generator=generator).tolist()
        self._used: set[int] = set()

    def next(self, same_first_name_as: str | None = None) -> str:
        first = FIRST_NAMES.index(same_first_name_as.split()[0]) if same_first_name_as else None
        for index in self._order:
            if index not in self._used and (first is None or index // len(SURNAMES) == first):
                self._used.add(index)
                return f"{FIRST_NAMES[index // len(SURNAMES)]} {SURNAMES[index % len(SURNAMES)]}"
        raise ValueError("more retrieval records per sample than there are names to draw: lower data.retrieval_records.")


def retrieval_records_for(data_config: Any, tokenizer: Any) -> RetrievalRecords | None:
    """The :class:`RetrievalRecords` that ``data_config`` asks for (None when ``data.retrieval_records`` is 0)."""
    if not data_config.retrieval_records:
        return None
    from hf_posext.evaluation.ending import end_token_ids
    from hf_posext.text_sources import encode_text

    chat = float(getattr(data_config, "retrieval_chat", 0.0))
    template = None
    if chat and getattr(tokenizer, "chat_template", None):
        template = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False)  # noqa: E731
    return RetrievalRecords(lambda text: encode_text(tokenizer, text), data_config.retrieval_records,
                            data_config.retrieval_labels, data_config.retrieval_wording,
                            tuple(getattr(data_config, "retrieval_tasks", ("lookup",))),
                            getattr(data_config, "retrieval_values", "digits"), chat, template,
                            frozenset(end_token_ids(tokenizer)))
