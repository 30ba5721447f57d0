"""Needle in a haystack: haystack sources, insertion at sentence boundaries, errors, heatmaps."""

import pytest

from hf_posext.evaluation import needle
from hf_posext.evaluation.report import write_plots
from hf_posext.evaluation.arguments import parse_methods
from hf_posext.evaluation.loading import AsciiTokenizer
from hf_posext.models import tiny_model

TOKENIZER = AsciiTokenizer()
SENTENCES = " ".join(f"Sentence number {i} talks about the weather." for i in range(60))


def test_haystack_from_a_folder_and_empty_haystacks(tmp_path):
    (tmp_path / "a.txt").write_text(SENTENCES)
    hay = needle.Haystack(TOKENIZER, tmp_path)
    assert len(hay.sentences) == 60
    empty = tmp_path / "empty.txt"
    empty.write_text("   ")
    with pytest.raises(ValueError, match="holds no non-empty document"):
        needle.Haystack(TOKENIZER, empty)
    with pytest.raises(ValueError, match="haystack .* is empty"):
        needle.Haystack(TOKENIZER, ["   \n "])


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_needle_sits_at_a_sentence_boundary(depth):
    hay = needle.Haystack(TOKENIZER, [SENTENCES])
    prompt, answer, info = needle.build_needle_prompt(TOKENIZER, hay, 1200, depth, "amber", "1234567")
    text = TOKENIZER.decode(prompt)
    assert len(prompt) == 1200
    sentence = needle.NEEDLE.format(key="amber", value="1234567")
    position = text.index(sentence)
    before = text[:position].rstrip()
    assert before == "" or before.endswith(".")
    assert abs(position / 1200 - depth) < 0.2
    assert text.endswith(needle.QUESTION.format(key="amber"))
    assert TOKENIZER.decode(answer) == " 1234567"
    assert not info["haystack_cycled"]


def test_short_haystack_cycles_and_says_so():
    hay = needle.Haystack(TOKENIZER, ["Only one sentence here."])
    prompt, _, info = needle.build_needle_prompt(TOKENIZER, hay, 400, 0.5, "cedar", "7654321")
    assert len(prompt) == 400 and info["haystack_cycled"]


def test_needle_grid_and_heatmap(tmp_path):
    model = tiny_model("llama", max_position_embeddings=256)
    store = needle.evaluate_needle(
        model, TOKENIZER, haystack=[SENTENCES], methods=parse_methods("none,yarn"), lengths=[300, 400], depths=[0.0, 1.0],
        out_dir=tmp_path, model_name="tiny", max_new_tokens=4, trials=1,
    )
    assert len(store.cells) == 2 * 2 * 2
    plots = {p.name for p in write_plots([store.data], tmp_path)}
    # --factor omitted: yarn's factor is the longest length over the window, 400 / 256
    assert {"needle.png", "needle-heatmap-x1.5625.png"} <= plots  # none and yarn side by side in one figure
    assert (tmp_path / "needle-heatmap-x1.5625.png").stat().st_size > 1000


def test_each_trial_reads_its_own_stretch_of_haystack(tmp_path, monkeypatch):
    # Trials of one cell differ in their text, not only in their key and number: each starts the haystack
    # at its own seeded sentence (the same for every method); --same-haystack keeps the old single start.
    prompts = []
    real = needle.score_retrieval_grouped

    def recording(model, tokenizer, batch, **kwargs):
        prompts.extend(tuple(b[0]) for b in batch)
        return real(model, tokenizer, batch, **kwargs)

    monkeypatch.setattr(needle, "score_retrieval_grouped", recording)
    model = tiny_model("llama", max_position_embeddings=256)
    common = dict(haystack=[SENTENCES], methods=parse_methods("none"), lengths=[300], depths=[0.5], trials=4,
                  model_name="tiny", max_new_tokens=4, generate=False, progress=False)
    store = needle.evaluate_needle(model, TOKENIZER, out_dir=tmp_path / "varied", **common)
    varied = list(prompts)
    starts = [needle.draw_haystack_start(0, 300, 0.5, t, 60) for t in range(4)]
    assert len(set(starts)) > 1
    for prompt, start in zip(varied, starts):
        assert TOKENIZER.decode(list(prompt)).lstrip().startswith(f"Sentence number {start} talks")
    assert store.data["config"]["haystack_start"] == "per-trial"
    prompts.clear()
    same = needle.evaluate_needle(model, TOKENIZER, out_dir=tmp_path / "same", vary_haystack=False, **common)
    assert all(TOKENIZER.decode(list(p)).startswith("Sentence number 0 talks") for p in prompts)
    assert "haystack_start" not in same.data["config"]  # older results files keep their name and cells


def test_too_short_a_length_is_refused_before_the_model_loads_with_a_length_that_works(monkeypatch, capsys, tmp_path):
    # Was: the needle suggested no length at all, after the model loaded
    import re

    from hf_posext.cli import main
    from hf_posext.evaluation import loading

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_model)
    argv = ["eval", "needle", "--model", "tiny", "--methods", "none", "--depths", "0,1", "--trials", "3", "--out", str(tmp_path)]
    assert main(argv + ["--lengths", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Length 64 is too short for a needle prompt" in err
    suggested = int(re.search(r"use a length of at least (\d+)", err).group(1))
    tokenizer = AsciiTokenizer()
    needle.check_needle_lengths(tokenizer, [suggested], [0.0, 1.0], 3, 0, 12)
    hay = needle.Haystack(tokenizer, ["One sentence here. Another one there."])
    for depth in (0.0, 1.0):
        for trial in range(3):
            key, value = needle.draw_needle(0, suggested, depth, trial)
            prompt, _answer, _info = needle.build_needle_prompt(tokenizer, hay, suggested - 12, depth, key, value)
            assert len(prompt) + 12 == suggested
    with pytest.raises(ValueError, match=r"Length 64 is too short for a needle prompt: .*use a length of at least \d+"):
        needle.evaluate_needle(tiny_model("llama"), tokenizer, haystack=tmp_path / "missing", methods=parse_methods("none"),
                               lengths=[64], out_dir=tmp_path / "api")  # before the haystack is read or a file written
    assert not (tmp_path / "api").exists()
