"""Stored Self-Extend cells are fingerprinted by what defines their function.

Before, a Self-Extend cell carried no frequencies and was trusted by its label forever: a change of the
attention kernel (or of the model's RoPE under it) would not recompute it. Now a cell records the rotary
frequencies under the method and ``attention_function`` (method, settings, hash of the kernel's code).
"""

import json

import pytest
import torch

from hf_posext.evaluation import fingerprints, perplexity
from hf_posext.evaluation.runner import AsciiTokenizer, parse_methods
from hf_posext.models import tiny_model

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).strip()
SELF_EXTEND = {"group_size": 4, "neighbor_window": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, initializer_range=0.1)


def _run(model, out, methods="self-extend", params=SELF_EXTEND):
    return perplexity.evaluate_perplexity(
        model, AsciiTokenizer(), data=[TEXT], methods=parse_methods(methods, params), lengths=(128,),
        out_dir=out, model_name="tiny", max_segments=1, progress=False,
    )


def _count_forwards(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = perplexity.chunked_nll
    monkeypatch.setattr(perplexity, "chunked_nll", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_a_self_extend_cell_records_its_settings_kernel_and_frequencies(model, tmp_path):
    (cell,) = _run(model, tmp_path).cells.values()
    assert cell["attention_function"]["method"] == "self-extend"
    assert cell["attention_function"]["params"] == SELF_EXTEND
    assert len(cell["attention_function"]["kernel_sha256"]) == 64
    assert cell["rope_frequencies"]  # the model's own RoPE under the grouped positions
    saved = json.loads(next(tmp_path.glob("perplexity-*.json")).read_text())
    assert saved["cells"][next(iter(saved["cells"]))]["attention_function"] == cell["attention_function"]


def _edited_sources(monkeypatch, edit):
    """Make the attention package's files read as ``edit({name: bytes})`` returns them."""
    real = fingerprints._kernel_package_sources
    monkeypatch.setattr(fingerprints, "_kernel_package_sources", lambda model: edit(dict(real(model))))


def test_a_changed_kernel_recomputes_the_cell_and_the_same_kernel_does_not(model, tmp_path, monkeypatch):
    _run(model, tmp_path)
    calls = _count_forwards(monkeypatch)
    _run(model, tmp_path)
    assert calls == []  # same settings, same code: read back
    # the kernel's code changed: one statement more in one file of the package
    _edited_sources(monkeypatch, lambda files: {**files, "kernels.py": files["kernels.py"] + b"\nEDITED = 1\n"})
    with pytest.warns(UserWarning, match="attention kernel"):
        (cell,) = _run(model, tmp_path).cells.values()
    assert calls == [1]
    assert cell["attention_function"] == fingerprints.attention_function(_patched(model))  # the edited code's hashes


def _patched(model):
    import copy

    from hf_posext import patch

    return patch(copy.deepcopy(model), "self-extend", **SELF_EXTEND)


def _rewrap_docstrings_and_comment(files):
    """A docstring reworded and rewrapped, a comment added, blank lines: the code itself is the same."""
    source = files["kernels.py"].decode()
    start = source.index('"""') + 3
    source = source[:start] + "Reworded,\n    and wrapped anew. " + source[start:]
    return {**files, "kernels.py": ("# a comment\n\n" + source + "\n\n# another\n").encode()}


def test_a_docstring_or_comment_edit_keeps_the_cells(model, tmp_path, monkeypatch):
    """A rewrapped docstring in the attention package once recomputed 12 STRING trials (about 90 minutes)."""
    (before,) = _run(model, tmp_path).cells.values()
    calls = _count_forwards(monkeypatch)
    _edited_sources(monkeypatch, _rewrap_docstrings_and_comment)
    edited = fingerprints.attention_function(_patched(model))
    assert edited["kernel_sha256"] != before["attention_function"]["kernel_sha256"]  # the files did change
    assert edited["kernel_code_sha256"] == before["attention_function"]["kernel_code_sha256"]
    (after,) = _run(model, tmp_path).cells.values()
    assert calls == [] and after == before


def test_cells_without_the_code_hash_are_checked_by_their_source_hash(model, tmp_path, monkeypatch):
    """Cells written before ``kernel_code_sha256`` was kept: the same files read them back, an edit recomputes."""
    _run(model, tmp_path)
    path = next(tmp_path.glob("perplexity-*.json"))
    saved = json.loads(path.read_text())
    for cell in saved["cells"].values():
        del cell["attention_function"]["kernel_code_sha256"]  # as the older release wrote it
    path.write_text(json.dumps(saved))
    calls = _count_forwards(monkeypatch)
    _run(model, tmp_path)
    assert calls == []
    _edited_sources(monkeypatch, _rewrap_docstrings_and_comment)  # no code hash to prove the code the same
    with pytest.warns(UserWarning, match="attention kernel"):
        _run(model, tmp_path)
    assert calls == [1]


@pytest.mark.parametrize("stored, same", [
    ({"kernel_sha256": "a", "kernel_code_sha256": "c"}, True),
    ({"kernel_sha256": "a"}, True),
    ({"kernel_sha256": "b", "kernel_code_sha256": "c"}, True),  # other files, same code (a docstring edit)
    ({"kernel_sha256": "a", "kernel_code_sha256": "d"}, True),  # same files, another Python's ast.dump
    ({"kernel_sha256": "b", "kernel_code_sha256": "d"}, False),
    ({"kernel_sha256": "b"}, False),
    ({"kernel_sha256": None, "kernel_code_sha256": None}, False),
])
def test_same_attention_function_needs_equal_settings_and_equal_files_or_code(stored, same):
    current = {"method": "string", "params": {"w": 1}, "kernel_sha256": "a", "kernel_code_sha256": "c"}
    assert fingerprints.same_attention_function({"method": "string", "params": {"w": 1}, **stored}, current) is same
    assert not fingerprints.same_attention_function({**current, "params": {"w": 2}}, current)
    assert not fingerprints.same_attention_function({**current, "method": "dca"}, current)


def test_the_code_hash_sees_a_changed_constant_and_not_a_docstring():
    files = {"k.py": b'def f(x):\n    """Twice."""\n    return 2 * x\n'}
    assert fingerprints.kernel_code_hash(files) == fingerprints.kernel_code_hash(
        {"k.py": b'def f(x):\n    """Twice x,\n    reworded."""\n\n    return 2 * x  # doubled\n'})
    assert fingerprints.kernel_code_hash(files) != fingerprints.kernel_code_hash(
        {"k.py": b'def f(x):\n    """Twice."""\n    return 3 * x\n'})
    assert fingerprints.kernel_code_hash(files) != fingerprints.kernel_code_hash({"j.py": files["k.py"]})  # renamed
    assert fingerprints.kernel_code_hash({"k.py": b"def f(:\n"}) is None


@pytest.mark.parametrize("sibling", ["kernels.py", "registration.py", "dual_chunk.py"])
def test_the_kernel_hash_covers_the_modules_the_kernel_imports_its_math_from(model, monkeypatch, sibling):
    """An edit to the shared kernels or registration (not the method's own file) changes the hash too."""
    import pathlib

    patched = _patched(model)
    before = fingerprints.attention_function(patched)
    real_read_bytes = pathlib.Path.read_bytes

    def edited(path):
        return real_read_bytes(path) + (b"\nEDITED = 1\n" if path.name == sibling else b"")

    monkeypatch.setattr(pathlib.Path, "read_bytes", edited)
    after = fingerprints.attention_function(patched)
    assert after["kernel_sha256"] != before["kernel_sha256"]
    assert after["kernel_code_sha256"] != before["kernel_code_sha256"]


def test_a_changed_rope_under_self_extend_recomputes_the_cell(model, tmp_path, monkeypatch):
    (before,) = _run(model, tmp_path).cells.values()
    calls = _count_forwards(monkeypatch)
    other = tiny_model("llama", seed=0, initializer_range=0.1, rope_theta=500.0)  # same weights, other RoPE base
    with pytest.warns(UserWarning, match="another rotary embedding"):
        (after,) = _run(other, tmp_path).cells.values()
    assert calls == [1] and after["nll"] != before["nll"]


def test_self_extend_is_not_reused_for_the_unpatched_model(model, tmp_path):
    # the grid reuses a unit between methods with the same fingerprint; Self-Extend keeps the model's
    # rotary frequencies, so its fingerprint must include the attention settings to stay apart from none
    store = _run(model, tmp_path, methods="none,self-extend")
    records = {c["method"]: c for c in store.cells.values()}
    assert "reused_from" not in records["self-extend"]
    assert records["self-extend"]["rope_fingerprint"] != records["none"]["rope_fingerprint"]
    assert records["self-extend"]["nll"] != records["none"]["nll"]


@pytest.mark.parametrize("samples", [fingerprints.WEIGHT_SAMPLES_PER_PARAMETER, 16])  # 16: the strided path
@pytest.mark.parametrize("fingerprint", ["weights_fingerprint", "sampled_weights_fingerprint"])
def test_weights_fingerprint_is_stable_and_sees_a_small_change_in_a_large_parameter(model, monkeypatch, samples,
                                                                                    fingerprint):
    import copy

    monkeypatch.setattr(fingerprints, "WEIGHT_SAMPLES_PER_PARAMETER", samples)
    function = getattr(fingerprints, fingerprint)

    assert function(model) == function(copy.deepcopy(model))
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[0].self_attn.q_proj.weight.add_(1e-3)  # every element, as a fine-tune moves them
    assert function(tuned) != function(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_fingerprint_sees_one_element_the_sampled_hash_skips(dtype):
    # Was: a stored cell was reused after weights changed where the sampled hash did not look
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(512, 512)).to(dtype)  # 262,144 elements: stride 4 when sampled
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited[0].weight.view(-1)[1] += 1.0  # element 1 sits between samples 0 and 4
    assert fingerprints.sampled_weights_fingerprint(edited) == fingerprints.sampled_weights_fingerprint(model)
    assert fingerprints.weights_fingerprint(edited) != fingerprints.weights_fingerprint(model)
    assert fingerprints.weights_fingerprint(model).startswith(fingerprints.FULL_WEIGHTS_PREFIX)
    assert fingerprints.weights_fingerprint(model) == fingerprints.weights_fingerprint(copy.deepcopy(model))


def test_a_change_between_the_samples_recomputes_a_stored_cell(model, tmp_path, monkeypatch):
    import copy

    monkeypatch.setattr(fingerprints, "WEIGHT_SAMPLES_PER_PARAMETER", 16)  # tiny parameters: make the sampling stride
    (before,) = _run(model, tmp_path, methods="yarn", params={}).cells.values()
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.model.layers[0].self_attn.q_proj.weight.view(-1)[1] += 0.5  # between the strided samples
    assert fingerprints.sampled_weights_fingerprint(edited) == fingerprints.sampled_weights_fingerprint(model)
    calls = _count_forwards(monkeypatch)
    with pytest.warns(UserWarning, match="model weights"):
        (after,) = _run(edited, tmp_path, methods="yarn", params={}).cells.values()
    assert calls == [1] and after["nll"] != before["nll"]


def test_cells_with_the_older_sampled_weights_hash_are_checked_by_it(model, tmp_path, monkeypatch):
    """Results written before every element was hashed stay readable: same weights reuse them, others recompute."""
    _run(model, tmp_path, methods="yarn", params={})
    path = next(tmp_path.glob("perplexity-*.json"))
    saved = json.loads(path.read_text())
    for cell in saved["cells"].values():
        cell["model_weights"] = fingerprints.sampled_weights_fingerprint(model)  # as an older release wrote it
    path.write_text(json.dumps(saved))
    calls = _count_forwards(monkeypatch)
    _run(model, tmp_path, methods="yarn", params={})
    assert calls == []
    with pytest.warns(UserWarning, match="model weights"):
        (after,) = _run(tiny_model("llama", seed=1, initializer_range=0.1), tmp_path, methods="yarn", params={}).cells.values()
    assert calls == [1] and fingerprints.is_full_weights_fingerprint(after["model_weights"])


def test_a_model_retrained_into_the_same_name_recomputes_its_cells_and_the_same_weights_do_not(model, tmp_path,
                                                                                                monkeypatch):
    """Results files are keyed by the model's name: the weights recorded in each cell catch a retrained model."""
    (before,) = _run(model, tmp_path, methods="yarn", params={}).cells.values()
    assert before["model_weights"] == fingerprints.weights_fingerprint(model)
    calls = _count_forwards(monkeypatch)
    _run(model, tmp_path, methods="yarn", params={})
    assert calls == []  # same weights: read back
    retrained = tiny_model("llama", seed=1, initializer_range=0.1)  # same name "tiny", other weights
    with pytest.warns(UserWarning, match="model weights"):
        (after,) = _run(retrained, tmp_path, methods="yarn", params={}).cells.values()
    assert calls == [1] and after["nll"] != before["nll"]
    assert after["model_weights"] == fingerprints.weights_fingerprint(retrained)


def test_cells_stored_before_weights_were_recorded_are_trusted(model, tmp_path, monkeypatch):
    _run(model, tmp_path, methods="yarn", params={})
    path = next(tmp_path.glob("perplexity-*.json"))
    saved = json.loads(path.read_text())
    for cell in saved["cells"].values():
        del cell["model_weights"]
    path.write_text(json.dumps(saved))
    calls = _count_forwards(monkeypatch)
    _run(tiny_model("llama", seed=1, initializer_range=0.1), tmp_path, methods="yarn", params={})
    assert calls == []


def test_only_a_model_without_known_positions_goes_unfingerprinted(model, monkeypatch):
    """A model hf-posext does not recognise has nothing to pin down (None); any other failure of ``describe`` is a
    bug and is raised: swallowing it would store cells with no fingerprint, trusted after any later change."""
    from hf_posext.core.errors import UnsupportedModelError

    def unsupported(_model):
        raise UnsupportedModelError("no positions")

    def broken(_model):
        raise RuntimeError("a bug in describe")

    monkeypatch.setattr(fingerprints, "describe", unsupported)
    assert fingerprints.rope_frequencies(model, 128) is None
    assert fingerprints.attention_function(model) is None
    monkeypatch.setattr(fingerprints, "describe", broken)
    with pytest.raises(RuntimeError, match="a bug in describe"):
        fingerprints.rope_frequencies(model, 128)
    with pytest.raises(RuntimeError, match="a bug in describe"):
        fingerprints.attention_function(model)
