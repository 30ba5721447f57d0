"""Passkey: prompt format and exact length, seeded keys, cached scoring equals generate and one forward."""

import pytest
import torch

import hf_posext
from hf_posext.evaluation import passkey
from hf_posext.evaluation.retrieval import first_integer, score_retrieval
from hf_posext.evaluation.arguments import parse_methods
from hf_posext.evaluation.loading import AsciiTokenizer
from hf_posext.models import tiny_model

TOKENIZER = AsciiTokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, max_position_embeddings=256)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_has_the_landmark_format_and_exact_length(depth):
    prompt, answer = passkey.build_passkey_prompt(TOKENIZER, 700, depth, "48213")
    text = TOKENIZER.decode(prompt)
    assert len(prompt) == 700
    assert text.startswith(passkey.TASK_DESCRIPTION)
    assert text.endswith("What is the pass key? The pass key is")
    assert "The pass key is 48213. Remember it. 48213 is the pass key." in text
    assert passkey.FILLER.strip() in text
    assert TOKENIZER.decode(answer) == " 48213"


def test_depth_moves_the_passkey():
    positions = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        text = TOKENIZER.decode(passkey.build_passkey_prompt(TOKENIZER, 2000, depth, "11111")[0])
        positions.append(text.index("The pass key is 11111"))
    assert positions == sorted(positions) and positions[0] < 200 and positions[-1] > 1500


def test_too_short_a_length_fails_clearly():
    with pytest.raises(ValueError, match="no room"):
        passkey.build_passkey_prompt(TOKENIZER, 100, 0.5, "12345")


def test_too_short_a_length_is_refused_before_the_model_loads_with_a_length_that_works(monkeypatch, capsys, tmp_path):
    # Was: refused only after the model loaded, and the suggested minimum (prompt tokens, not the cell's
    # length: the generated tokens were left out) was itself refused
    import re

    from hf_posext.cli import main
    from hf_posext.evaluation import loading

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_model)
    argv = ["eval", "passkey", "--model", "tiny", "--methods", "none", "--depths", "0,1", "--trials", "2", "--out", str(tmp_path)]
    assert main(argv + ["--lengths", "40"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Length 40 is too short for a passkey prompt" in err
    suggested = int(re.search(r"use a length of at least (\d+)", err).group(1))
    passkey.check_passkey_lengths(TOKENIZER, [suggested], [0.0, 1.0], 2, 0, 10)  # the suggestion fits, generated tokens included
    for depth in (0.0, 1.0):
        prompt, _answer = passkey.build_passkey_prompt(TOKENIZER, suggested - 10, depth, "12345")
        assert len(prompt) + 10 == suggested
    with pytest.raises(ValueError, match=rf"Length {suggested - 1} is too short .*at least {suggested}"):
        passkey.check_passkey_lengths(TOKENIZER, [suggested - 1], [0.0, 1.0], 2, 0, 10)
    with pytest.raises(ValueError, match="Length 40 is too short for a passkey prompt"):  # the API checks before any file
        passkey.evaluate_passkey(tiny_model("llama"), TOKENIZER, methods=parse_methods("none"), lengths=[40, 4096],
                                 out_dir=tmp_path / "api")
    assert not (tmp_path / "api").exists()


def test_the_shortest_fitting_length_follows_what_each_length_needs():
    # hidden values are drawn per length, so each length needs a little more or less; the suggestion must fit its own
    needs = {100: 120, 120: 123, 123: 122}
    assert passkey.shortest_fitting_length(lambda n: needs.get(n, 110), 100) == 123
    assert passkey.shortest_fitting_length(lambda n: 90, 100) == 100


def test_passkeys_are_seeded():
    assert passkey.draw_passkey(0, 4096, 0.5, 0) == passkey.draw_passkey(0, 4096, 0.5, 0)
    keys = {passkey.draw_passkey(0, 4096, 0.5, t) for t in range(20)}
    assert len(keys) > 15 and all(len(k) == 5 for k in keys)
    assert passkey.draw_passkey(1, 4096, 0.5, 0) != passkey.draw_passkey(0, 4096, 0.5, 0)


def test_first_integer():
    assert first_integer(" 48213. Remember") == "48213"
    assert first_integer("no digits") is None


@pytest.mark.parametrize("method", ["none", "yarn", "dynamic-yarn"])
def test_cached_scoring_matches_generate_and_one_forward(model, method):
    hf_posext.patch(model, method, 2.0 if method != "none" else 1.0)
    try:
        prompt, answer = passkey.build_passkey_prompt(TOKENIZER, 340, 0.5, "48213")
        with_generation = score_retrieval(model, TOKENIZER, [prompt], [answer], ["48213"], max_new_tokens=8)[0]
        teacher_only = score_retrieval(model, TOKENIZER, [prompt], [answer], ["48213"], max_new_tokens=8, generate=False)[0]
        assert with_generation["answer_token_accuracy"] == teacher_only["answer_token_accuracy"]
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert with_generation["generated"] == TOKENIZER.decode(reference.tolist())
    finally:
        hf_posext.unpatch(model)


def test_teacher_forced_score_counts_argmax_tokens(model):
    prompt, _ = passkey.build_passkey_prompt(TOKENIZER, 340, 0.5, "48213")
    # Use the model's own greedy continuation as the "answer": every token is then the argmax.
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):].tolist()
    result = score_retrieval(model, TOKENIZER, [prompt], [greedy], ["0"], max_new_tokens=4)[0]
    assert result["teacher_forced"] and result["answer_token_accuracy"] == 1.0
    shifted = [(t + 1) % 128 for t in greedy]
    result = score_retrieval(model, TOKENIZER, [prompt], [shifted], ["0"], max_new_tokens=4)[0]
    assert not result["teacher_forced"] and result["answer_token_accuracy"] == 0.0


def test_evaluate_passkey_grid(model, tmp_path):
    store = passkey.evaluate_passkey(
        model, TOKENIZER, methods=parse_methods("none,yarn"), lengths=[350, 512], depths=[0.0, 1.0], trials=2,
        out_dir=tmp_path, model_name="tiny", max_new_tokens=6, batch_size=2,
    )
    assert len(store.cells) == 2 * 2 * 2
    record = next(c for c in store.cells.values() if c["method"] == "yarn" and c["length"] == 512 and c["depth"] == 1.0)
    assert record["factor"] == 2.0 and record["trials"] == 2
    assert set(record) >= {"greedy_accuracy", "teacher_forced_accuracy", "answer_token_accuracy"}
    keys = {u["passkey"] for c in store.cells.values() if c["length"] == 512 and c["depth"] == 1.0 for u in c["units"]}
    assert len(keys) == 2  # both methods saw the same two passkeys


def test_more_trials_later_computes_only_the_new_trials(tmp_path, monkeypatch):
    # A CPU run with 2 trials per depth, resumed with 5: the stored 2 are kept (same seeds, same prompts),
    # only 3 new prompts per cell are scored, and the cell then reports 5 trials with its counts.
    from hf_posext.evaluation import retrieval

    scored = []
    real = passkey.score_retrieval_grouped

    def counting(model, tokenizer, batch, **kwargs):
        scored.extend(b[2] for b in batch)
        return real(model, tokenizer, batch, **kwargs)

    monkeypatch.setattr(passkey, "score_retrieval_grouped", counting)
    tiny = tiny_model("llama", seed=0, max_position_embeddings=256)
    common = dict(methods=parse_methods("none"), lengths=[400], depths=(0.0, 1.0), out_dir=tmp_path, progress=False, generate=False)
    first = passkey.evaluate_passkey(tiny, TOKENIZER, trials=2, **common)
    assert len(scored) == 4
    early = {k: dict(v) for k, v in first.cells.items()}
    scored.clear()
    second = passkey.evaluate_passkey(tiny, TOKENIZER, trials=5, **common)
    assert sorted(scored) == sorted(passkey.draw_passkey(0, 400, d, t) for d in (0.0, 1.0) for t in (2, 3, 4))
    for cell_id, record in second.cells.items():
        assert record["trials"] == 5 and record["unit_keys"][:2] == early[cell_id]["unit_keys"]
        assert record["units"][:2] == early[cell_id]["units"]  # the stored trials, not recomputed
        assert record["teacher_forced_correct"] == sum(bool(u["teacher_forced"]) for u in record["units"])
    scored.clear()
    passkey.evaluate_passkey(tiny, TOKENIZER, trials=3, **common)  # fewer than stored: complete, nothing scored
    assert scored == []


def test_a_stored_cell_without_unit_keys_and_fewer_trials_is_recomputed(tmp_path, monkeypatch):
    # Results written before unit keys were kept cannot be matched trial by trial: asked for more trials,
    # the whole cell is recomputed (before this, a 1-trial cell silently stood in for a 10-trial request).
    import json

    tiny = tiny_model("llama", seed=0, max_position_embeddings=256)
    common = dict(methods=parse_methods("none"), lengths=[400], depths=(0.5,), out_dir=tmp_path, progress=False, generate=False)
    store = passkey.evaluate_passkey(tiny, TOKENIZER, trials=1, **common)
    data = json.loads(store.path.read_text())
    for record in data["cells"].values():
        del record["unit_keys"]
    store.path.write_text(json.dumps(data))
    again = passkey.evaluate_passkey(tiny, TOKENIZER, trials=3, **common)
    assert [r["trials"] for r in again.cells.values()] == [3]
