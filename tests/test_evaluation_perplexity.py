"""Perplexity: chunked loss parity, windows, the side-by-side grid, resume, warnings."""

import copy
import json
import math
import warnings

import pytest
import torch

import hf_posext
from hf_posext.evaluation import perplexity
from hf_posext.evaluation.arguments import MethodRequest, parse_methods
from hf_posext.evaluation.fingerprints import rope_frequencies, same_frequencies
from hf_posext.evaluation.loading import AsciiTokenizer
from hf_posext.models import tiny_model

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).strip()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_chunked_nll_matches_the_full_logits_loss(model, chunk_size):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 48))
    nll, scored = perplexity.chunked_nll(model, ids, chunk_size)
    assert scored == 47
    for row in range(2):
        reference = model(ids[row : row + 1], labels=ids[row : row + 1]).loss.double() * 47
        torch.testing.assert_close(nll[row], reference, rtol=1e-5, atol=1e-5)


def test_chunked_nll_rejects_bad_shapes(model):
    with pytest.raises(ValueError, match="batch, tokens>=2"):
        perplexity.chunked_nll(model, torch.tensor([1, 2, 3]))


def test_segments_skip_short_documents_and_start_with_bos():
    docs = [list(range(10)), list(range(3)), list(range(25))]
    segments, skipped = perplexity.make_segments(docs, 8, bos_id=None)
    assert skipped == 1
    assert [(d, s) for d, s, _ in segments] == [(0, 0), (2, 0), (2, 8), (2, 16)]
    segments, _ = perplexity.make_segments(docs, 8, max_segments=2, bos_id=99)
    assert segments[0][2] == [99] + list(range(7)) and len(segments) == 2
    assert perplexity.make_windows(docs, 8, max_windows=2, bos_id=99) == (segments, skipped)  # the former name
    with pytest.raises(ValueError, match="longest has 25"):
        perplexity.make_segments(docs, 64)


def test_bos_auto_follows_the_tokenizer():
    assert perplexity.uses_bos(AsciiTokenizer(), "auto") is None
    with pytest.raises(ValueError, match="no BOS"):
        perplexity.uses_bos(AsciiTokenizer(), "yes")


def test_concatenate_joins_documents():
    class Tok(AsciiTokenizer):
        eos_token_id = 3

    joined = perplexity.tokenize_documents(Tok(), ["ab", "cd"], concatenate=True)
    assert joined == [[97, 98, 3, 99, 100]]


def _run(model, tmp_path, methods="none,yarn,dynamic-yarn", lengths=(32, 64, 128), **kwargs):
    return perplexity.evaluate_perplexity(
        model, AsciiTokenizer(), data=[TEXT, "short"], methods=parse_methods(methods), lengths=lengths,
        out_dir=tmp_path, model_name="tiny", max_segments=2, **kwargs,
    )


def test_side_by_side_grid_factor_reuse_and_records(model, tmp_path):
    with pytest.warns(UserWarning, match="supports 64 tokens; evaluating 128"):
        store = _run(model, tmp_path)
    cells = store.cells
    assert len(cells) == 9
    none = {c["length"]: c for c in cells.values() if c["method"] == "none"}
    yarn = {c["length"]: c for c in cells.values() if c["method"] == "yarn"}
    dynamic = {c["length"]: c for c in cells.values() if c["method"] == "dynamic-yarn"}
    # factor omitted: longest length / window = 128 / 64
    assert yarn[32]["factor"] == 2.0 and none[32]["factor"] == 1.0
    assert none[128]["beyond_window"] and not yarn[128]["beyond_window"]
    for length in (32, 64, 128):
        assert none[length]["tokens"] == 2 * (length - 1)
        assert none[length]["skipped_documents"] == 1
        assert math.isclose(none[length]["ppl"], math.exp(none[length]["nll"]))
    # dynamic YaRN is the unpatched model inside the window and static YaRN x2 at 2x the window
    assert dynamic[64]["nll"] == none[64]["nll"] and dynamic[64]["reused_from"] == ["none x1"]
    assert dynamic[128]["nll"] == yarn[128]["nll"] and dynamic[128]["reused_from"] == ["yarn x2"]
    assert yarn[32]["nll"] != none[32]["nll"]
    saved = json.loads(store.path.read_text())
    assert saved["config"]["model"] == "tiny" and "torch" in saved["versions"]
    assert store.path.with_suffix(".csv").read_text().count("\n") == 10


def test_reuse_can_be_switched_off_and_gives_the_same_numbers(model, tmp_path):
    store = _run(model, tmp_path / "a", methods="none,dynamic-yarn", lengths=(64,), reuse_identical=False)
    records = {c["method"]: c for c in store.cells.values()}
    assert "reused_from" not in records["dynamic-yarn"]
    assert records["dynamic-yarn"]["nll"] == pytest.approx(records["none"]["nll"], abs=1e-6)


def test_rerun_resumes_and_overwrite_recomputes(model, tmp_path, monkeypatch):
    _run(model, tmp_path, methods="none", lengths=(32,), factor=2.0)
    calls = []
    original = perplexity.chunked_nll
    monkeypatch.setattr(perplexity, "chunked_nll", lambda *a, **k: calls.append(1) or original(*a, **k))
    store = _run(model, tmp_path, methods="none,linear", lengths=(32,), factor=2.0)
    assert len(calls) == 2  # only linear's two windows: none was read back
    assert len(store.cells) == 2 and len(store.data["runs"]) == 2
    # Provenance: each run keeps its versions, each cell the run that computed it.
    assert [cell["run"] for cell in store.cells.values()] == [0, 1]
    assert all(run["versions"]["torch"] == torch.__version__ for run in store.data["runs"])
    calls.clear()
    _run(model, tmp_path, methods="none,linear", lengths=(32,), factor=2.0, overwrite=True)
    assert len(calls) == 4


def test_a_rewritten_factors_file_recomputes_its_cells(model, tmp_path, monkeypatch):
    factors = tmp_path / "factors.json"
    factors.write_text(json.dumps({"long_factor": [1.0, 1.5, 2.0, 2.0]}))
    methods = parse_methods("longrope", {"factors": str(factors)})
    first = perplexity.evaluate_perplexity(model, AsciiTokenizer(), data=[TEXT], methods=methods, lengths=(128,),
                                           factor=2.0, out_dir=tmp_path, model_name="tiny", max_segments=1)
    (before,) = first.cells.values()
    calls = []
    original = perplexity.chunked_nll
    monkeypatch.setattr(perplexity, "chunked_nll", lambda *a, **k: calls.append(1) or original(*a, **k))
    # Same factors, more keys (a search checkpoint adds its candidates): still the same cell.
    factors.write_text(json.dumps({"long_factor": [1.0, 1.5, 2.0, 2.0], "candidates": []}))
    perplexity.evaluate_perplexity(model, AsciiTokenizer(), data=[TEXT], methods=methods, lengths=(128,),
                                   factor=2.0, out_dir=tmp_path, model_name="tiny", max_segments=1)
    assert calls == []
    # Other factors under the same path: the stored cell is stale and is recomputed, with a warning.
    factors.write_text(json.dumps({"long_factor": [1.0, 1.0, 1.0, 4.0]}))
    with pytest.warns(UserWarning, match="another rotary embedding"):
        again = perplexity.evaluate_perplexity(model, AsciiTokenizer(), data=[TEXT], methods=methods, lengths=(128,),
                                               factor=2.0, out_dir=tmp_path, model_name="tiny", max_segments=1)
    (after,) = again.cells.values()
    assert len(calls) == 1 and len(again.cells) == 1
    assert after["nll"] != before["nll"] and after["rope_fingerprint"] != before["rope_fingerprint"]
    assert not same_frequencies(after["rope_frequencies"], before["rope_frequencies"])


def test_cells_from_another_machine_are_not_stale(model, tmp_path, monkeypatch):
    # Another machine (a GPU, other CPU instructions) rounds cos/sin differently: its fingerprint differs
    # and its frequencies agree to float32 rounding. Neither makes the stored cell stale.
    store = _run(model, tmp_path, methods="yarn", lengths=(64,), factor=2.0)
    path = store.path
    data = json.loads(path.read_text())
    (cell,) = data["cells"].values()
    cell["rope_fingerprint"] = "computed-elsewhere"
    cell["rope_frequencies"][0]["inv_freq"] = [v * (1 + 2 ** -24) for v in cell["rope_frequencies"][0]["inv_freq"]]
    path.write_text(json.dumps(data))
    calls = []
    original = perplexity.chunked_nll
    monkeypatch.setattr(perplexity, "chunked_nll", lambda *a, **k: calls.append(1) or original(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "another rotary embedding" warning either
        _run(model, tmp_path, methods="yarn", lengths=(64,), factor=2.0)
    assert calls == []
    # Records written before frequencies were kept are trusted by their label, as before.
    del cell["rope_frequencies"]
    path.write_text(json.dumps(data))
    _run(model, tmp_path, methods="yarn", lengths=(64,), factor=2.0)
    assert calls == []


def test_rope_frequencies_tell_methods_apart_and_match_dynamic_equivalents(model):
    none = rope_frequencies(model, 128)
    with_yarn = rope_frequencies(hf_posext.patch(copy.deepcopy(model), "yarn", factor=2), 128)
    dynamic = rope_frequencies(hf_posext.patch(copy.deepcopy(model), "dynamic-yarn", factor=2), 128)
    inside = rope_frequencies(hf_posext.patch(copy.deepcopy(model), "dynamic-yarn", factor=2), 32)
    assert not same_frequencies(none, with_yarn)
    assert same_frequencies(dynamic, with_yarn)  # dynamic YaRN at L*s is static YaRN xs
    assert same_frequencies(inside, rope_frequencies(model, 32))  # and the original model inside L
    json.dumps(with_yarn)  # stored as JSON


def test_unknown_method_and_model_is_left_unpatched(model, tmp_path):
    with pytest.raises(ValueError, match="Unknown method 'yran'"):
        parse_methods("none,yran")
    _run(model, tmp_path, methods="yarn", lengths=(32,))
    assert hf_posext.describe(model).method == "none"
    assert MethodRequest("yarn").label == "yarn"


def test_max_tokens_reads_the_same_leading_tokens_at_every_length(model, tmp_path):
    documents = [" ".join(f"word{i}" for i in range(400))]
    store = perplexity.evaluate_perplexity(
        model, AsciiTokenizer(), data=documents, methods=parse_methods("none"), lengths=(16, 32, 64), factor=2.0,
        out_dir=tmp_path, model_name="tiny", max_segments=3, max_tokens=64, bos="no",
    )
    segments = {c["length"]: c["windows"] for c in store.cells.values()}  # the record keeps its key "windows"
    assert segments == {16: 3, 32: 2, 64: 1}  # 64 // 16 = 4, capped by max_segments=3; 64 // 32 = 2; one of 64
    with pytest.warns(FutureWarning, match="max_windows= is now called max_segments=") as caught:  # the old name, same file
        again = perplexity.evaluate_perplexity(
            model, AsciiTokenizer(), data=documents, methods=parse_methods("none"), lengths=(16, 32, 64), factor=2.0,
            out_dir=tmp_path, model_name="tiny", max_windows=3, max_tokens=64, bos="no",
        )
    assert again.path == store.path and again.cells == store.cells
    assert {w.filename for w in caught if w.category is FutureWarning} == {__file__}  # points at the caller's line
    assert json.loads(store.path.read_text())["config"]["max_tokens"] == 64
    with pytest.raises(ValueError, match="max_tokens must be a positive"):
        perplexity.evaluate_perplexity(model, AsciiTokenizer(), data=documents, methods=parse_methods("none"),
                                       lengths=(16,), out_dir=tmp_path, max_tokens=0)


def test_chunked_nll_builds_no_autograd_graph():
    """Scoring runs without gradients: a graph over a 16k-token window once took the demo past 24 GB."""
    from hf_posext.lm.scoring import chunked_nll
    from hf_posext.models import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.is_grad_enabled()
    nll, scored = chunked_nll(model, ids, chunk_size=16)
    assert scored == 39 and not nll.requires_grad
