"""Every ``*ForCausalLM`` class of the installed transformers, tiny, patched with every applicable method.

One test per class (:func:`hf_posext.family_sweep.sweep.sweep_class`): 0 crashes, 0 skips and 0 refusals other
than those listed, with their one-line reason, in ``hf_posext/family_sweep/known.py``; a listed crash (a backend
bug still open) is an xfail that names it. A class that a new transformers release adds is not listed, so
anything but ``ok`` on it fails here. Each class's row of ``docs/families.md`` must be the one the sweep renders
(regenerate it with ``python bench/family_sweep.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hf_posext.family_sweep import known
from hf_posext.family_sweep.matrix import render_row, rows_of_page
from hf_posext.family_sweep.sweep import CRASH, OK, REFUSED, FamilyResult, MethodOutcome, sweep_class
from hf_posext.family_sweep.tiny import causal_lm_classes

DOCS = Path(__file__).resolve().parents[1] / "docs" / "families.md"
CLASSES = causal_lm_classes()


@pytest.fixture(autouse=True)
def _quiet_single_thread():
    """Tiny models gain nothing from a second thread, and waiting threads burn CPU on a loaded machine (701 s of
    CPU for the whole module with 2 threads, against 82 s for the same sweep with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("class_name", CLASSES)
def test_family(class_name):
    result = sweep_class(class_name)
    found = known.problems(result)
    row = rows_of_page(DOCS.read_text()).get(render_row(result).split("|")[1].strip())
    if row != render_row(result):
        found.append(f"docs/families.md's row of {class_name} is not the sweep's: run python bench/family_sweep.py "
                     f"(docs: {row!r}; sweep: {render_row(result)!r})")
    assert not found, "\n".join(found)
    crashes = [m for m in result.methods if m.outcome == CRASH]
    if crashes:
        pytest.xfail("listed backend failures: " + "; ".join(f"{m.method}: {m.reason}" for m in crashes))


def test_docs_list_every_class_once():
    rows = rows_of_page(DOCS.read_text())
    names = {name.removesuffix("ForCausalLM") for name in CLASSES}
    assert set(rows) == names, (f"docs/families.md lists {sorted(set(rows) - names)} that transformers does not export, "
                                f"and misses {sorted(names - set(rows))}: run python bench/family_sweep.py")


def test_known_table_names_installed_classes():
    stale = sorted({name for name, _ in known.KNOWN} - set(CLASSES))
    assert not stale, f"family_sweep/known.py lists classes the installed transformers lacks: {stale}"


def _result(*outcomes: MethodOutcome, built: bool = True, reason: str = "") -> FamilyResult:
    return FamilyResult("NewFamilyForCausalLM", kind="rope", built=built, reason=reason, methods=list(outcomes))


@pytest.mark.parametrize("result", [
    _result(MethodOutcome("yarn", CRASH, "RuntimeError: Tensors must have same number of dimensions")),
    _result(MethodOutcome("yarn", REFUSED, "UnsupportedModelError: no rotary module")),
    _result(built=False, reason="TinyModelError: the tiny config does not build"),
], ids=["crash", "refusal", "skip"])
def test_an_unlisted_new_family_fails(result):
    """A family that no entry names (a new transformers release) is reported, whatever it does but ok."""
    assert known.problems(result)


def test_one_cause_refusing_every_attention_level_method_is_named_once_on_the_page():
    """Each refusal starts with its method's label and its stored line is cut at a fixed length, so the four lines of
    one cause differ; the page still gives the cause (once), not a bare list of methods."""
    why = ("its attention holds XIndexer, a sparse-attention indexer that picks the keys by their rotary positions, "
           "which {label} does not remap (it would pick them at positions past the window)")
    labels = {"self-extend": "Self-Extend", "dca": "Dual Chunk Attention", "string": "STRING", "yarn+string": "STRING"}
    outcomes = [MethodOutcome(method, REFUSED, f"UnsupportedModelError: {label} cannot be applied to NewFamilyForCausalLM: "
                              f"{why.format(label=label)}"[:240]) for method, label in labels.items()]
    cell = render_row(_result(*outcomes)).split("|")[5]
    assert cell.strip() == ("refused: self-extend, dca, string, yarn+string (its attention holds XIndexer, a sparse-attention "
                            "indexer that picks the keys by their rotary positions, which the method does not remap)")


def test_a_listed_entry_that_passes_is_stale(monkeypatch):
    monkeypatch.setitem(known.KNOWN, ("NewFamilyForCausalLM", "yarn"), known.Expected(known.REFUSED, "no rotary module"))
    assert "now passes" in known.problems(_result(MethodOutcome("yarn", OK)))[0]
    assert not known.problems(_result(MethodOutcome("yarn", REFUSED, "UnsupportedModelError: no rotary module here")))
    assert "another reason" in known.problems(_result(MethodOutcome("yarn", REFUSED, "ValueError: other")))[0]


def test_a_wrong_scaling_fails_the_sweep(monkeypatch):
    """A broken method (linear dividing by 1.05 s) is caught: parity with transformers fails, and the class's
    result is no longer the listed one."""
    import dataclasses

    from hf_posext.methods import METHODS

    linear = METHODS["rope"]["linear"]
    monkeypatch.setitem(METHODS["rope"], "linear", dataclasses.replace(
        linear, compute=lambda rope, original_length, factor, seq_len, params: (rope.inv_freq() / (factor * 1.05), 1.0)))
    result = sweep_class("LlamaForCausalLM", methods=["linear"])
    assert result.methods[0].outcome == CRASH
    assert "differs from transformers' own rope_parameters scaling" in result.methods[0].reason
    assert known.problems(result)


def test_the_readme_quotes_the_committed_sweeps_totals():
    """The front door's family figures are the last committed sweep's (bench/results/family_sweep/sweep.json)."""
    import json
    import re

    root = Path(__file__).resolve().parents[1]
    totals = json.loads((root / "bench" / "results" / "family_sweep" / "sweep.json").read_text())["totals"]
    found = re.search(r"(\d+) of (\d+) built, (\d+) \(class, method\) pairs taken, (\d+)\s+refused in one line, none failing",
                      (root / "README.md").read_text())
    assert found, "README.md no longer states the family sweep's totals"
    assert tuple(map(int, found.groups())) == (totals["built"], totals["classes"], totals["ok"], totals["refused"])
    assert totals["crash"] == 0


def test_the_sweep_script_refuses_a_class_name_transformers_does_not_have(tmp_path, capsys):
    """A typo in --classes is named in one line (it used to be swept as an unbuildable class with a recipe hint)."""
    from tests.bench_helpers import load_bench_script

    sweep = load_bench_script("family_sweep")
    out = tmp_path / "sweep.json"
    assert sweep.main(["--classes", "LlamaForCausalLM,LamaForCausalLM", "--no-docs", "--out", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("--classes: LamaForCausalLM is not a *ForCausalLM class of transformers")
