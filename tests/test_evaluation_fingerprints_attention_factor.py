"""A change of attention factor alone marks a stored cell stale.

Two attention factors can change while every inverse frequency stays the same: YaRN's (cos and sin, hence
q and k, multiplied by it) and STRING's (q and k multiplied by it). A request that names another factor is
another cell (its label differs); what must be caught is the same request computing another factor (a
change in the method's code or defaults): the stored cell is then stale and recomputed.
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_posext.backends.attention import shifted_positions
from hf_posext.evaluation import fingerprints, perplexity
from hf_posext.methods.registry import METHODS, get_method
from hf_posext.evaluation.runner import AsciiTokenizer, parse_methods
from hf_posext.models import tiny_model

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).strip()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, initializer_range=0.1)


def _run(model, out, method, params):
    return perplexity.evaluate_perplexity(
        model, AsciiTokenizer(), data=[TEXT], methods=parse_methods(method, params), lengths=(128,),
        out_dir=out, model_name="tiny", max_segments=1, progress=False,
    )


def _cells(store, method):
    return [cell for cell in store.cells.values() if cell["method"] == method]


def _count_forwards(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = perplexity.chunked_nll
    monkeypatch.setattr(perplexity, "chunked_nll", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_a_yarn_attention_factor_changed_in_the_code_alone_marks_the_cell_stale(model, tmp_path, monkeypatch):
    """A scaling whose inverse frequencies are unchanged but whose attention factor moves by 1e-4 (a change
    in the method's code, not in its request or label) is recomputed."""
    (before,) = _cells(_run(model, tmp_path, "yarn", {}), "yarn")
    calls = _count_forwards(monkeypatch)
    spec = get_method("yarn")
    moved = lambda *a, **k: (lambda inv_freq, attention: (inv_freq, attention * (1 + 1e-4)))(*spec.compute(*a, **k))
    monkeypatch.setitem(METHODS["rope"], "yarn", dataclasses.replace(spec, compute=moved))
    with pytest.warns(UserWarning, match="another rotary embedding"):
        (after,) = _cells(_run(model, tmp_path, "yarn", {}), "yarn")
    assert calls == [1] and after["nll"] != before["nll"]


def test_a_string_attention_factor_changed_in_the_code_alone_marks_the_cell_stale(model, tmp_path, monkeypatch):
    """STRING's attention factor enters no frequency: it is kept with the attention function's settings."""
    params = {"shifted_offset": 24, "local_value": 6}
    (before,) = _cells(_run(model, tmp_path, "string", params), "string")
    calls = _count_forwards(monkeypatch)
    real = shifted_positions.resolve_settings
    monkeypatch.setattr(shifted_positions, "resolve_settings", lambda *a: real(*a[:5], 1.2))  # another default
    (after,) = _cells(_run(model, tmp_path, "string", params), "string")
    assert calls == [1] and after["nll"] != before["nll"]
    assert after["attention_function"]["params"]["attention_factor"] == 1.2


def test_same_frequencies_compares_the_attention_factor():
    entry = {"module": "model.rotary_emb", "layer_type": None, "inv_freq": [1.0, 0.1, 0.01], "attention": 1.1386}
    assert fingerprints.same_frequencies([entry], [dict(entry)])
    assert fingerprints.same_frequencies([entry], [dict(entry, attention=1.1386 * (1 + 1e-8))])  # inside rtol
    assert not fingerprints.same_frequencies([entry], [dict(entry, attention=1.1386 * (1 + 1e-4))])
    assert not fingerprints.same_frequencies([entry], [dict(entry, attention=1.0)])
    assert not fingerprints.same_frequencies([entry], [dict(entry, attention="tensor(1.1)")])
    assert fingerprints.function_fingerprint([entry], None) != fingerprints.function_fingerprint([dict(entry, attention=1.0)], None)
