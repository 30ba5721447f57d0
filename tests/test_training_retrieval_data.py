"""Synthetic retrieval samples (hf_posext.training.retrieval_data) and continuing a saved adapter
(finetune.init_adapter): the sample's layout and labels, its place in the resumable stream, the config
checks, and a tiny end-to-end run."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)
from tests.training_helpers import TINY_MODEL, load_safetensors, tiny_config

import hf_posext
from hf_posext.models import load_model

from hf_posext.training.config import ConfigError, TrainConfig, config_differences, load_config
from hf_posext.training.packing import PackedSequences, collate_sequences
from hf_posext.training.retrieval_data import (ATTRIBUTES, IGNORED, VARIED_QUESTIONS, VARIED_RECORDS,
                                               RetrievalRecords)


def chars(text: str) -> list[int]:
    """A character-level 'tokenizer' (ids >= 1000 so that they never equal the filler's ids)."""
    return [1000 + ord(c) for c in text]


def text_of(ids) -> str:
    return "".join(chr(i - 1000) if i >= 1000 else "_" for i in ids)


FILLER = torch.arange(1000, dtype=torch.long) % 500  # ids < 1000: shows as "_"


def test_a_retrieval_sample_keeps_its_length_and_asks_for_every_record_with_its_own_code():
    records = RetrievalRecords(chars, records=3)
    input_ids, labels = records.apply(FILLER, torch.Generator().manual_seed(0))
    assert input_ids.shape == labels.shape == FILLER.shape
    text = text_of(input_ids.tolist())
    stored = dict(re.findall(r"The locker code of (\w+ \w+) is (\d+)\.", text))
    asked = re.findall(r"Question: What is the locker code of (\w+ \w+)\? Answer: (\d+)\.", text)
    assert len(stored) == 3 and sorted(name for name, _ in asked) == sorted(stored)
    assert all(stored[name] == code for name, code in asked)
    # Every record sits in the first half of the sample (20 draws of 3), the questions close it.
    for seed in range(20):
        drawn = text_of(records.apply(FILLER, torch.Generator().manual_seed(seed))[0].tolist())
        starts = [m.start() for m in re.finditer("The locker code of", drawn)]
        assert len(starts) == 3 and max(starts) < len(drawn) // 2, (seed, starts)
    assert text.rstrip(".0123456789 ").endswith("Answer:")
    # Trained on: exactly the answers (" CODE."), in the order asked.
    trained = text_of(labels[labels != IGNORED].tolist())
    assert trained == "".join(f" {code}." for _, code in asked)
    # Each answer token is labelled at its own position (the model shifts labels itself).
    kept = labels != IGNORED
    assert torch.equal(labels[kept], input_ids[kept])
    # The book text that remains is the sample's beginning, in order.
    filler = input_ids[input_ids < 1000]
    assert torch.equal(filler, FILLER[: filler.numel()])


def test_the_fixed_wording_draws_the_samples_of_earlier_versions():
    """The committed stage-2 runs resume on these draws: the varied wording must not add a draw to the fixed one."""
    input_ids, _ = RetrievalRecords(chars, records=3).apply(FILLER, torch.Generator().manual_seed(0))
    with_filler = text_of(input_ids.tolist())
    assert [m.start() for m in re.finditer(" The locker code", with_filler)] == [47, 96, 375]  # where the records sit
    assert with_filler.index("\nQuestion") == 796
    text = with_filler.replace("_", "")
    assert text == (" The locker code of Bruno Tanaka is 4279657. The locker code of Tamar Ivanova is 83545. The locker code"
                    " of Rosa Underhill is 958816.\nQuestion: What is the locker code of Bruno Tanaka? Answer: 4279657.\n"
                    "Question: What is the locker code of Tamar Ivanova? Answer: 83545.\nQuestion: What is the locker code"
                    " of Rosa Underhill? Answer: 958816.")


def form_pattern(form: str) -> str:
    """A regex for one wording: {name} -> (?P<name>...), {attribute} -> (?P<attribute>...), {code} -> (?P<code>...);
    a field met again must repeat what it matched first."""
    pattern = re.escape(form)
    for field, group in (("name", r"(?P<name>[A-Z]\w+ [A-Z]\w+)"), ("attribute", r"(?P<attribute>[a-z]+ [a-z]+)"),
                         ("code", r"(?P<code>\d+)")):
        pattern = pattern.replace(re.escape("{" + field + "}"), group, 1).replace(re.escape("{" + field + "}"), f"(?P={field})")
    return pattern


def test_a_varied_sample_states_each_record_once_and_asks_for_it_in_some_wording_with_its_own_code():
    records = RetrievalRecords(chars, records=4, wording="varied")
    long_filler = torch.arange(2000, dtype=torch.long) % 500
    seen_records, seen_questions, seen_attributes = set(), set(), set()
    for seed in range(40):
        input_ids, labels = records.apply(long_filler, torch.Generator().manual_seed(seed))
        assert input_ids.shape == labels.shape == long_filler.shape
        text = text_of(input_ids.tolist()).replace("_", "")
        stated, asked = text.split("\n", 1)[0], "\n" + text.split("\n", 1)[1]
        facts = {}
        for index, form in enumerate(VARIED_RECORDS):
            for match in re.finditer(form_pattern(form), stated):
                facts[match["name"]] = (match["attribute"], match["code"])
                seen_records.add(index)
        assert len(facts) == 4, (seed, stated)
        answers = []
        for index, form in enumerate(VARIED_QUESTIONS):
            for match in re.finditer(form_pattern(form) + r" (?P<answer>\d+)\.", asked):
                assert facts[match["name"]] == (match["attribute"], match["answer"]), (seed, match.group(0))
                answers.append((match.start(), match["answer"]))
                seen_questions.add(index)
                seen_attributes.add(match["attribute"])
        assert len(answers) == 4, (seed, asked)
        # Trained on exactly the answers, in the order asked.
        assert text_of(labels[labels != IGNORED].tolist()) == "".join(f" {code}." for _, code in sorted(answers))
        for banned in ("special magic number", "mentioned in the provided text", "pass key"):  # the evaluations' words
            assert banned not in text
    assert seen_records == set(range(len(VARIED_RECORDS))) and seen_questions == set(range(len(VARIED_QUESTIONS)))
    assert seen_attributes == set(ATTRIBUTES)


def test_the_varied_wording_bounds_its_own_longest_sample_and_an_unknown_wording_is_refused():
    varied, fixed = RetrievalRecords(chars, records=3, wording="varied"), RetrievalRecords(chars, records=3)
    long_filler = torch.arange(4000, dtype=torch.long) % 500
    inserted = [int((varied.apply(long_filler, torch.Generator().manual_seed(seed))[0] >= 1000).sum()) for seed in range(200)]
    assert max(inserted) <= varied.most_tokens()
    assert max(inserted) > fixed.most_tokens()  # the fixed wording's bound would let a varied sample overflow
    with pytest.raises(ValueError, match="wording='vary' is not one of fixed, varied"):
        RetrievalRecords(chars, records=1, wording="vary")


def test_labels_all_trains_on_every_token_and_oversized_records_are_refused():
    input_ids, labels = RetrievalRecords(chars, records=2, labels="all").apply(FILLER, torch.Generator().manual_seed(1))
    assert torch.equal(labels, input_ids)
    with pytest.raises(ValueError, match="more than half of the 1000-token training sequence: lower data.retrieval_records"):
        RetrievalRecords(chars, records=5).apply(FILLER, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="take up to 610 tokens, more than half of the 1000-token training sequence"):
        RetrievalRecords(chars, records=5).check_fits(1000)
    RetrievalRecords(chars, records=3).check_fits(1000)


def test_the_stream_with_retrieval_is_reproducible_keeps_the_pose_draws_and_turns_about_the_fraction():
    sequences = FILLER.repeat(40, 1)
    plain = PackedSequences(sequences, seed=3, pose_target_length=4096)
    mixed = PackedSequences(sequences, seed=3, pose_target_length=4096, retrieval=RetrievalRecords(chars, 2),
                            retrieval_fraction=0.5)
    turned = 0
    for counter in range(40):
        a, b, again = plain.sample(counter), mixed.sample(counter), mixed.sample(counter)
        assert torch.equal(a["position_ids"], b["position_ids"])  # PoSE draws unchanged by retrieval
        assert torch.equal(b["input_ids"], again["input_ids"])  # a pure function of the counter (resumable)
        if "labels" in b:
            turned += 1
            assert not torch.equal(b["input_ids"], a["input_ids"])
        else:
            assert torch.equal(b["input_ids"], a["input_ids"])
    assert 10 <= turned <= 30, turned
    batch = collate_sequences([mixed.sample(c) for c in range(4)])
    for row, counter in enumerate(range(4)):
        sample = mixed.sample(counter)
        assert torch.equal(batch["labels"][row], sample.get("labels", sample["input_ids"]))


@pytest.mark.parametrize("override, message", [
    ("data.retrieval_records=-1", "data.retrieval_records must be an int >= 0"),
    ("data.retrieval_fraction=0", r"data.retrieval_fraction must be in \(0, 1\]"),
    ("data.retrieval_labels=answer", "data.retrieval_labels='answer' is not one of answers, all. Did you mean 'answers'"),
    ("data.retrieval_wording=vary", "data.retrieval_wording='vary' is not one of fixed, varied. Did you mean 'varied'"),
    ("finetune.mode=full", "finetune.init_adapter needs finetune.mode=lora"),
])
def test_bad_retrieval_and_init_adapter_settings_are_named(tmp_path, override, message):
    overrides = [override] + (["finetune.init_adapter=somewhere"] if override.startswith("finetune") else [])
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path / "run", *overrides).validate()


def test_a_key_added_after_a_checkpoint_was_written_counts_as_its_default():
    saved = TrainConfig().to_dict()
    del saved["data"]["retrieval_records"], saved["finetune"]["init_adapter"]
    assert config_differences(saved, TrainConfig().to_dict()) == []
    current = TrainConfig().to_dict()
    current["data"]["retrieval_records"] = 4
    assert config_differences(saved, current) == ["data.retrieval_records: 0 -> 4"]


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory, one_thread):
    """A finished 12-step tiny run, with retrieval samples (sequences of 256 tokens, one record each)."""
    from hf_posext.training.trainer import train

    out = tmp_path_factory.mktemp("runs") / "retrieval"
    result = train(tiny_config(out, "data.sequence_length=256", "data.retrieval_records=1", "data.retrieval_fraction=0.5"),
                   progress=False)
    assert result.finished
    return out


def test_a_tiny_run_with_retrieval_samples_trains_on_fewer_tokens_and_finishes(tiny_adapter):
    log = [json.loads(line) for line in (tiny_adapter / "log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log if "loss" in row]
    assert len(losses) == 12 and all(loss == loss for loss in losses)  # no NaN from answer-only batches
    assert (tiny_adapter / "adapter" / "adapter_model.safetensors").is_file()


def test_init_adapter_starts_from_the_saved_weights(tiny_adapter, tmp_path):
    from hf_posext.training.lora import setup_trainable

    def patched():
        model = load_model(str(TINY_MODEL))
        hf_posext.patch(model, "yarn", 4)
        return model

    config = tiny_config(tmp_path / "next", f"finetune.init_adapter={tiny_adapter / 'adapter'}").validate()
    model = setup_trainable(patched(), config.finetune)
    from hf_posext.adapters import saved_extra_names

    weights = load_safetensors(tiny_adapter / "adapter" / "adapter_model.safetensors")
    saved = {k: v for k, v in weights.items() if "lora_" in k}  # the trained norms/embeddings are PEFT modules_to_save
    extras = {n: weights["base_model.model." + n] for n in saved_extra_names(tiny_adapter / "adapter")}
    assert extras
    parameters = dict(model.named_parameters())
    trainable = {name for name, p in parameters.items() if p.requires_grad}
    lora = {name: p for name, p in parameters.items() if "lora_" in name}
    assert lora and all(p.requires_grad for p in lora.values())
    assert len(saved) == len(lora)
    for name, value in saved.items():  # PEFT saves without the adapter name
        live = next(p for n, p in lora.items() if n.replace(".default", "").endswith(name.split("base_model.model.", 1)[1]))
        assert torch.equal(live.detach(), value)
    base = dict(model.get_base_model().named_parameters())
    for name, value in extras.items():
        assert torch.equal(base[name].detach(), value) and base[name].requires_grad
    assert trainable == set(lora) | {n for n, p in parameters.items() if p.requires_grad and "lora_" not in n}
    # A fresh LoRA starts elsewhere (B = 0): the test would see a copy that did not happen.
    fresh = setup_trainable(patched(), tiny_config(tmp_path / "x").finetune)
    assert any(not torch.equal(p, 0 * p) for n, p in model.named_parameters() if "lora_B" in n)
    assert all(torch.equal(p, 0 * p) for n, p in fresh.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("override, message", [
    ("finetune.rank=8", "finetune.rank: adapter 4, recipe 8"),
    ("scaling.factor=2", "trained with yarn x4"),
    ("finetune.train_norms=false", r"the adapter holds them, the recipe does not train them \(finetune.train_norms"),
    ("data.retrieval_records=3", "data.retrieval_records: 3 retrieval records and their questions take up to"),
])
def test_init_adapter_that_this_recipe_cannot_continue_is_refused_before_anything_is_written(tiny_adapter, tmp_path,
                                                                                            override, message):
    from hf_posext.training.trainer import train

    out = tmp_path / "next"
    overrides = [f"finetune.init_adapter={tiny_adapter / 'adapter'}", override]
    if override == "finetune.train_norms=false":
        overrides.append("finetune.train_embeddings=false")
    with pytest.raises(ConfigError, match=message):
        train(tiny_config(out, *overrides), progress=False)
    assert not out.exists()


def test_init_adapter_continues_training_to_a_new_adapter(tiny_adapter, tmp_path):
    from hf_posext.training.trainer import train

    out = tmp_path / "next"
    result = train(tiny_config(out, f"finetune.init_adapter={tiny_adapter / 'adapter'}", "train.max_steps=2",
                               "data.sequence_length=256", "data.retrieval_records=1"), progress=False)
    assert result.finished
    before = load_safetensors(tiny_adapter / "adapter" / "adapter_model.safetensors")
    after = load_safetensors(out / "adapter" / "adapter_model.safetensors")
    assert sorted(before) == sorted(after)
    assert max(float((before[k] - after[k]).abs().max()) for k in before) > 1e-4  # it trained on from there
    record = json.loads((out / "adapter" / "posext_adapter.json").read_text())
    assert record["method"] == "yarn" and float(record["factor"]) == 4.0
    assert load_config(out / "train_config.yaml").finetune.init_adapter == str(tiny_adapter / "adapter")
    card = (out / "adapter" / "README.md").read_text()
    assert "- **Started from:** the adapter `retrieval/adapter`" in card and str(tiny_adapter) not in card  # no machine path
    assert ("- **Retrieval samples:** every sample hides 1 synthetic key-value records and asks for them at the end "
            "(`hf_posext.training.retrieval_data`), trained on their answers only (the loss below is over answer tokens).") in card


def test_loss_average_sequences_weighs_a_retrieval_sample_as_much_as_a_book_sample(tmp_path):
    """train.loss_average=sequences: the first logged loss is the mean over the step's four samples of each
    sample's own mean loss, computed here independently on the starting model; the token mean is far from it."""
    from hf_posext.models import load_tokenizer
    from hf_posext.training.packing import load_packed_sequences
    from hf_posext.training.trainer import train

    overrides = ("data.sequence_length=256", "data.retrieval_records=1", "data.retrieval_fraction=0.5",
                 "finetune.dropout=0", "train.max_steps=1", "train.warmup_steps=0", "output.checkpoint_every=0", "output.save_merged=false")
    logged = {}
    for average in ("sequences", "tokens"):
        out = tmp_path / average
        train(tiny_config(out, *overrides, f"train.loss_average={average}"), progress=False)
        logged[average] = json.loads((out / "log.jsonl").read_text().splitlines()[0])["loss"]

    config = tiny_config(tmp_path / "x", *overrides)
    model = load_model(str(TINY_MODEL), dtype=torch.float32, attn_implementation="sdpa")
    hf_posext.patch(model, "yarn", factor=4)
    tokenizer = load_tokenizer(str(TINY_MODEL))
    data = load_packed_sequences(config.data, tokenizer, config.train.seed, hf_posext.describe(model).current_window)
    samples = [collate_sequences([data.sample(counter)]) for counter in range(4)]  # batch 2 x accumulation 2
    assert 0 < sum("labels" in data.sample(c) for c in range(4)) < 4, "the step should mix both kinds of sample"
    with torch.no_grad():
        losses = [model(**sample).loss for sample in samples]
        counts = [int((sample["labels"][:, 1:] != IGNORED).sum()) for sample in samples]
    sequence_mean = float(sum(losses) / 4)
    token_mean = float(sum(loss * n for loss, n in zip(losses, counts)) / sum(counts))
    assert logged["sequences"] == pytest.approx(sequence_mean, rel=1e-5)
    assert logged["tokens"] == pytest.approx(token_mean, rel=1e-5)
    assert abs(sequence_mean - token_mean) > 100 * 1e-5 * sequence_mean


def test_loss_average_sequences_is_refused_under_sequence_parallelism(tmp_path):
    with pytest.raises(ConfigError, match="train.loss_average=sequences under sequence or context parallelism"):
        tiny_config(tmp_path / "run", "train.loss_average=sequences", "parallelism.sp_backend=deepspeed",
                    "parallelism.sp_size=2").validate()
    with pytest.raises(ConfigError, match="train.loss_average='sequence' is not one of tokens, sequences"):
        tiny_config(tmp_path / "run", "train.loss_average=sequence").validate()


def test_the_model_card_names_the_sequence_average(tmp_path):
    from hf_posext.training.model_card import adapter_model_card

    record = {"base_model": "tiny", "method": "yarn", "factor": 4.0, "original_window": 64, "current_window": 256}
    cards = {average: adapter_model_card(tiny_config(tmp_path / "run", f"train.loss_average={average}").validate(),
                                         record, tmp_path / "no-log.jsonl")
             for average in ("tokens", "sequences")}
    assert "averaged over sequences (each sample weighs the same, `train.loss_average: sequences`)" in cards["sequences"]
    assert "averaged over sequences" not in cards["tokens"]


#: RULER's templates and key words (lm-eval's ruler tasks: niah "special magic {type}", vt "VAR X = ...", cwe/fwe
#: "most common words" / "coded text"), and the passkey and needle prompts of hf_posext.evaluation.
EVALUATION_WORDS = ("special magic", "magic number", "mentioned in the provided text", "VAR ", "variable", "most common",
                    "frequently", "coded text", "uuid", "pass key", "passkey", "Remember it", "grass is green")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.mark.parametrize("wording", ["fixed", "varied", "harder", "harder-chat", "most-often", "most-often-chat"])
def test_the_practice_data_never_uses_ruler_or_the_evaluation_prompts(wording):
    """The fine-tune must be measured on tasks it never practised: no RULER template, key word or UUID value, and
    neither the passkey nor the needle prompt nor a chat-ending instruction of the card, in any wording of any sample;
    the harder practice's codes are never 7 digits long (RULER's needle values)."""
    from hf_posext.evaluation import ending, needle, passkey

    if wording.startswith(("harder", "most-often")):
        tasks = {"tasks": ALL_TASKS + ("most_often",)} if wording.startswith("most-often") else {}
        chat = {"chat": 0.5, "chat_template": chat_template} if wording.endswith("chat") else {}
        records = harder(records=6, **tasks, **chat)
    else:
        records = RetrievalRecords(chars, records=8, wording=wording)
    evaluation_prompts = (needle.NEEDLE.split("{")[0], needle.QUESTION.split("{")[0], passkey.QUESTION,
                          passkey.passkey_line(12345).split("12345")[0], passkey.FILLER[:40], *ending.INSTRUCTIONS)
    long_filler = torch.arange(8000 if wording.startswith("most-often") else 4000, dtype=torch.long) % 500  # characters
    for seed in range(30):
        input_ids, _ = records.apply(long_filler, torch.Generator().manual_seed(seed))
        text = text_of(input_ids.tolist()).replace("_", "")
        assert "Question" in text or "?" in text or "It is" in text  # the sample is really there
        lowered = text.lower()
        for word in EVALUATION_WORDS:
            assert word.lower() not in lowered, (wording, seed, word)
        for prompt in evaluation_prompts:
            assert prompt.strip() and prompt.strip() not in text, (wording, seed, prompt)
        assert not UUID.search(lowered), (wording, seed)
        if wording.startswith(("harder", "most-often")):
            assert not re.search(r"(?<!\d)\d{7}(?!\d)", text), (wording, seed)


# -- the harder practice: distractors, several values, chains, word values, chat samples -------------------------

ALL_TASKS = ("lookup", "distractors", "several_values", "chain")


def chat_template(messages):
    """A ChatML-like template (as SmolLM2's): <s> and </s> stand for the turn tokens, 'E' (id 1000 + ord) ends a turn."""
    return "".join(f"<{m['role']}>\n{m['content']}E\n" for m in messages)


def harder(records=4, **kwargs):
    kwargs = {"tasks": ALL_TASKS, "values": "digits_and_words", **kwargs}
    return RetrievalRecords(chars, records=records, wording="varied", end_of_turn=frozenset({1000 + ord("E")}), **kwargs)


def harder_pattern(form: str) -> str:
    """A regex for one wording of the harder practice: its attribute one of the known ones, its value a code or a
    two-word phrase, ``{other}`` a second name."""
    from hf_posext.training.retrieval_data import WORD_ATTRIBUTES

    pattern = re.escape(form)
    attribute = "|".join(sorted(ATTRIBUTES + WORD_ATTRIBUTES, key=len, reverse=True))
    for field, group in (("name", r"(?P<name>[A-Z]\w+ [A-Z]\w+)"), ("attribute", f"(?P<attribute>{attribute})"),
                         ("code", r"(?P<code>\d+|[a-z]+ [a-z]+)"), ("other", r"(?P<other>[A-Z]\w+ [A-Z]\w+)")):
        pattern = pattern.replace(re.escape("{" + field + "}"), group, 1).replace(re.escape("{" + field + "}"), f"(?P={field})")
    return pattern


def facts_of(stated: str) -> tuple[dict, dict, dict]:
    """(values of (name, attribute), [values] of (name, attribute) in order, who a name points to) from the records."""
    from hf_posext.training.retrieval_data import CHAIN_RECORDS, SEVERAL_RECORDS

    single, several, points = {}, {}, {}
    for group, into in ((VARIED_RECORDS, single), (SEVERAL_RECORDS, several)):
        for form in group:
            for m in re.finditer(harder_pattern(form), stated):
                into.setdefault((m["name"], m["attribute"]), []).append((m.start(), m["code"]))
    for form in CHAIN_RECORDS:
        for m in re.finditer(harder_pattern(form), stated):
            points[(m["name"], m["attribute"])] = m["other"]
    in_order = lambda found: {key: [v for _, v in sorted(values)] for key, values in found.items()}  # noqa: E731
    return in_order(single), in_order(several), points


def test_form_pattern_reads_the_harder_records():
    from hf_posext.training.retrieval_data import CHAIN_RECORDS

    assert "{other}" in CHAIN_RECORDS[0]
    single, several, points = facts_of(" Ada Weston uses the same call sign as Hugo Engel. Hugo Engel's call sign is amber kettle."
                                       " One room number held by Vera Varga is 4410.")
    assert points == {("Ada Weston", "call sign"): "Hugo Engel"} and single == {("Hugo Engel", "call sign"): ["amber kettle"]}
    assert several == {("Vera Varga", "room number"): ["4410"]}


def test_every_kind_of_harder_question_is_answered_from_its_own_records():
    """Each answer follows from the records: a lookup's (and a distractor's) from the one record of that name and
    attribute, a list from the person's values in the order stated, a chain's from the record it points to; and
    the distractors really share the wording (the same person's other attribute, a namesake's same attribute)."""
    from hf_posext.training.retrieval_data import SEVERAL_QUESTIONS, WORD_ATTRIBUTES

    records = harder()
    long_filler = torch.arange(3000, dtype=torch.long) % 500
    seen = {"list": 0, "chain": 0, "word": 0, "digits": 0, "namesake": 0}
    for seed in range(60):
        input_ids, labels = records.apply(long_filler, torch.Generator().manual_seed(seed))
        assert input_ids.shape == labels.shape == long_filler.shape
        text = text_of(input_ids.tolist()).replace("_", "")
        stated, asked = text.split("\n", 1)[0], "\n" + text.split("\n", 1)[1]
        single, several, points = facts_of(stated)
        answers = []
        for form in VARIED_QUESTIONS + SEVERAL_QUESTIONS:
            listed = form in SEVERAL_QUESTIONS
            for m in re.finditer(harder_pattern(form) + r" (?P<answer>[^\n]+)\.", asked):
                key = (m["name"], m["attribute"])
                if listed:
                    values = several[key]
                    assert m["answer"] == ", ".join(values[:-1]) + f" and {values[-1]}", (seed, m.group(0))
                    seen["list"] += 1
                elif key in points:
                    assert [m["answer"]] == single[(points[key], key[1])], (seed, m.group(0))
                    seen["chain"] += 1
                else:
                    assert [m["answer"]] == single[key], (seed, m.group(0))  # exactly one record of that name and attribute
                seen["word" if " " in m["answer"] or m["attribute"] in WORD_ATTRIBUTES else "digits"] += 1
                answers.append((m.start(), f" {m['answer']}."))
        assert len(answers) == 4, (seed, asked)
        assert text_of(labels[labels != IGNORED].tolist()) == "".join(a for _, a in sorted(answers))
        names = [name for name, _ in single]
        seen["namesake"] += sum(1 for n in set(names) for o in set(names) if n != o and n.split()[0] == o.split()[0])
    assert all(count >= 5 for count in seen.values()), seen


def test_a_chat_sample_trains_each_answer_up_to_the_end_of_its_turn_and_nothing_of_the_template():
    records = harder(chat=1.0, chat_template=chat_template)
    long_filler = torch.arange(3000, dtype=torch.long) % 500
    for seed in range(20):
        input_ids, labels = records.apply(long_filler, torch.Generator().manual_seed(seed))
        assert input_ids.shape == labels.shape == long_filler.shape
        text = text_of(input_ids.tolist())
        assert text.startswith("<user>\n") and text.endswith("E\n")
        assert text.count("<assistant>\n") == 4 and text.count("<user>\n") == 4
        turns = re.findall(r"<assistant>\n([^\n]*?)E\n", text)
        assert len(turns) == 4 and all(t.endswith(".") for t in turns)
        # trained on: each assistant turn and the 'E' that ends it, nothing else
        assert text_of(labels[labels != IGNORED].tolist()) == "".join(f"{t}E" for t in turns)
        kept = labels != IGNORED
        assert torch.equal(labels[kept], input_ids[kept])
    mixed = harder(chat=0.5, chat_template=chat_template)
    chats = sum(text_of(mixed.apply(long_filler, torch.Generator().manual_seed(s))[0].tolist()).startswith("<user>")
                for s in range(100))
    assert 30 < chats < 70


def most_often_answers(text: str) -> list[tuple[str, list[str], str]]:
    """(activity, the names ranked by how often the records say they did it, the answer) of each most_often
    question of a sample's text, plain or chat; the counts must all differ."""
    from hf_posext.training.retrieval_data import (ACTIVITIES, ACTIVITY_RECORDS, CHAT_MOST_OFTEN_QUESTIONS,
                                                   CHAT_TOP_THREE_QUESTIONS, MOST_OFTEN_QUESTIONS, TOP_THREE_QUESTIONS)

    found = []
    name = r"[A-Z]\w+ [A-Z]\w+"
    answer = r"(?:\n<assistant>\n| )(?P<answer>[^\n]*?)\.(?:E|\n|$)"
    for form in MOST_OFTEN_QUESTIONS + TOP_THREE_QUESTIONS + CHAT_MOST_OFTEN_QUESTIONS + CHAT_TOP_THREE_QUESTIONS:
        chat_form = form in CHAT_MOST_OFTEN_QUESTIONS + CHAT_TOP_THREE_QUESTIONS
        for activity in ACTIVITIES:
            asked = re.escape(form.format(activity=activity)) + ("E" if chat_form else "") + answer
            for m in re.finditer(asked, text):
                counts: dict[str, int] = {}
                # one alternation, scanned left to right: " That day Ada Weston ..." is one record, not also " Ada Weston ..."
                pattern = "|".join(re.escape(record).replace(re.escape("{name}"), f"(?P<name{i}>{name})").replace(
                    re.escape("{activity}"), re.escape(activity)) for i, record in enumerate(ACTIVITY_RECORDS))
                for r in re.finditer(pattern, text[: m.start()]):
                    who = next(v for k, v in r.groupdict().items() if v)
                    counts[who] = counts.get(who, 0) + 1
                assert len(set(counts.values())) == len(counts) >= 3, counts  # no ties
                found.append((activity, sorted(counts, key=counts.get, reverse=True), m["answer"]))
    return found


@pytest.mark.parametrize("chat", [False, True])
def test_a_most_often_question_is_answered_from_how_often_its_records_say_each_person_did_it(chat):
    """Aggregation: the answer is the person the records name most often for the activity (or the three, most often
    first), and a sample asks at most one such question."""
    extra = {"chat": 1.0, "chat_template": chat_template} if chat else {}
    records = harder(records=5, tasks=ALL_TASKS + ("most_often",), **extra)
    long_filler = torch.arange(6000, dtype=torch.long) % 500
    seen = {"one": 0, "three": 0, "none": 0}
    for seed in range(60):
        input_ids, labels = records.apply(long_filler, torch.Generator().manual_seed(seed))
        assert input_ids.shape == labels.shape == long_filler.shape
        text = text_of(input_ids.tolist()).replace("_", "")
        questions = most_often_answers(text)
        assert len(questions) <= 1, (seed, questions)
        for _, ranked, answer in questions:
            three = "," in answer
            assert answer == (f"{ranked[0]}, {ranked[1]} and {ranked[2]}" if three else ranked[0]), (seed, ranked, answer)
            assert answer + "." in text_of(labels[labels != IGNORED].tolist())
            seen["three" if three else "one"] += 1
        seen["none"] += not questions
    assert all(count >= 5 for count in seen.values()), seen


def test_the_harder_practice_bounds_its_longest_sample():
    long_filler = torch.arange(6000, dtype=torch.long) % 500
    for kwargs in ({}, {"chat": 0.5, "chat_template": chat_template}, {"tasks": ("several_values",)},
                   {"tasks": ("most_often",)}, {"tasks": ALL_TASKS + ("most_often",), "chat": 0.5, "chat_template": chat_template}):
        records = harder(records=3, **kwargs)
        inserted = [int((records.apply(long_filler, torch.Generator().manual_seed(s))[0] >= 1000).sum()) for s in range(150)]
        assert max(inserted) <= records.most_tokens(), kwargs
    assert harder(records=3, tasks=("several_values",)).most_tokens() > harder(records=3, tasks=("lookup",)).most_tokens()


def test_the_lookup_only_varied_practice_draws_the_samples_of_the_committed_run():
    """tasks=('lookup',), digits and no chat stay the committed stage 2's draws (the composite path adds draws)."""
    plain = RetrievalRecords(chars, records=3, wording="varied")
    same = RetrievalRecords(chars, records=3, wording="varied", tasks=("lookup",), values="digits", chat=0.0)
    for seed in range(5):
        a, b = (r.apply(FILLER, torch.Generator().manual_seed(seed))[0] for r in (plain, same))
        assert torch.equal(a, b)
    assert not same.composite and harder().composite


@pytest.mark.parametrize("kwargs, message", [
    ({"tasks": ("lookup", "chains")}, r"tasks=\['lookup', 'chains'\]: each must be one of lookup, distractors"),
    ({"values": "words"}, "values='words' is not one of digits, digits_and_words"),
    ({"chat": 0.5}, "chat samples need the tokenizer's chat template"),
    ({"chat": 0.5, "chat_template": lambda messages: "no turns kept"}, "drops or reorders the turns' text"),
    ({"chat": 0.5, "chat_template": lambda messages: "".join(m["content"] + "\n" for m in messages)},
     "does not end an assistant turn with an end-of-turn token"),
])
def test_bad_harder_practice_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        harder(**kwargs)
    with pytest.raises(ValueError, match="set data.retrieval_wording=varied"):
        RetrievalRecords(chars, records=2, tasks=ALL_TASKS)


@pytest.mark.parametrize("override, message", [
    ("data.retrieval_tasks=[lookup,chains]", "data.retrieval_tasks='chains' is not one of lookup, distractors, several_values, chain"),
    ("data.retrieval_values=word", "data.retrieval_values='word' is not one of digits, digits_and_words"),
    ("data.retrieval_chat=2", r"data.retrieval_chat must be a share in \[0, 1\]"),
])
def test_bad_harder_practice_settings_are_named(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path / "run", "data.retrieval_records=2", "data.retrieval_wording=varied", override).validate()
    with pytest.raises(ConfigError, match="drawn in the varied wording: set data.retrieval_wording=varied"):
        tiny_config(tmp_path / "run", "data.retrieval_records=2", "data.retrieval_values=digits_and_words").validate()
    with pytest.raises(ConfigError, match="need data.retrieval_records > 0|needs data.retrieval_records > 0"):
        tiny_config(tmp_path / "run", "data.retrieval_wording=varied", "data.retrieval_chat=0.5").validate()


def test_chat_samples_with_a_tokenizer_without_a_chat_template_are_refused_before_the_run_folder_is_touched(tmp_path):
    from hf_posext.training.trainer import train

    out = tmp_path / "run"
    out.mkdir()
    (out / "kept.txt").write_text("an earlier run's file")
    config = tiny_config(out, "data.sequence_length=256", "data.retrieval_records=1", "data.retrieval_wording=varied",
                         "data.retrieval_chat=0.5")
    with pytest.raises(ConfigError, match="data.retrieval_chat: chat samples need the tokenizer's chat template"):
        train(config, overwrite=True, progress=False)
    assert (out / "kept.txt").read_text() == "an earlier run's file"


def test_a_tiny_run_with_the_harder_practice_finishes_and_its_model_card_says_what_it_practised(tmp_path):
    from hf_posext.training.trainer import train

    out = tmp_path / "run"
    config = tiny_config(out, "data.sequence_length=2048", "scaling.factor=64", "data.retrieval_records=1", "data.retrieval_wording=varied",
                         "data.retrieval_tasks=[distractors,several_values,chain,most_often]", "data.retrieval_values=digits_and_words",
                         "train.max_steps=3")
    assert train(config, progress=False).finished
    card = (out / "adapter" / "README.md").read_text()
    assert "questions drawn from distractors, several values, chain, most often (`data.retrieval_tasks`)" in card
    assert "values codes or two-word phrases" in card
