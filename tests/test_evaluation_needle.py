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
        out_dir=tmp_path, model_name="tiny", max_new_tokens=4,
    )
    assert len(store.cells) == 2 * 2 * 2
    plots = {p.name for p in write_plots([store.data], tmp_path)}
    # --factor omitted: yarn's factor is the longest length over the window, 400 / 256
    assert {"needle.png", "needle-heatmap-x1.5625.png"} <= plots  # none and yarn side by side in one figure
    assert (tmp_path / "needle-heatmap-x1.5625.png").stat().st_size > 1000
