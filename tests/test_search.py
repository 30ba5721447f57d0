"""LongRoPE-style factor search on a tiny random model: improves on its starting points, JSON round trip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_posext
from hf_posext.models import tiny_model
from hf_posext.search import initial_factors, make_monotone, rescale_factors, search_factors
from tests.conftest import logits_of

ROOT = Path(__file__).resolve().parents[1]


def _calibration(length: int = 128, rows: int = 2) -> torch.Tensor:
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(7))


def test_initial_points_are_pi_yarn_and_ntk():
    starts = initial_factors(10000.0, 8, 64, 2.0)
    assert set(starts) == {"pi", "yarn", "ntk"}
    torch.testing.assert_close(starts["pi"], torch.full((4,), 2.0, dtype=torch.float64))
    assert float(starts["yarn"][0]) == pytest.approx(1.0) and float(starts["yarn"][-1]) == pytest.approx(2.0)
    for values in starts.values():
        assert bool((values[1:] >= values[:-1] - 1e-12).all())


def test_monotone_projection():
    projected = make_monotone(torch.tensor([0.5, 3.0, 2.0, 9.0]), max_factor=4.0)
    assert projected.tolist() == [1.0, 3.0, 3.0, 4.0]


def test_search_beats_its_initial_point_and_the_json_patches_longrope(tmp_path):
    # Window 64, rotary dim 8 (4 factors). Larger random weights than the default make the loss depend on
    # the positions (with the default init every candidate scores ln(128) to 5 digits).
    model = tiny_model("llama", initializer_range=0.5)
    path = tmp_path / "factors.json"
    result = search_factors(model, 128, _calibration(), segments=2, population=6, generations=3, parents=2,
                            seed=0, output=path, progress=False)
    assert "_hf_posext_state" not in model.__dict__  # left unpatched
    assert result.evaluations >= 6 + 3 * 4 - 3  # duplicates are never re-evaluated
    # Better than the best of PI, YaRN and NTK by far more than float noise (measured: 8.109 vs PI's 8.220).
    assert result.best_nll < result.initial_best_nll - 0.05
    assert [h["best_nll"] for h in result.history] == sorted((h["best_nll"] for h in result.history), reverse=True)
    factors = torch.tensor(result.long_factor)
    assert bool((factors[1:] >= factors[:-1]).all()) and float(factors.min()) >= 1.0
    assert float(factors.max()) <= result.settings["max_factor"]
    saved = json.loads(path.read_text())
    assert saved["long_factor"] == result.long_factor and saved["method"] == "longrope"
    # The file patches longrope; the fitness it reports is reproduced by the patched model.
    from hf_posext.lm.scoring import chunked_nll

    hf_posext.patch(model, "longrope", factor=result.factor, factors=str(path))
    with torch.no_grad():
        nll, scored = chunked_nll(model, _calibration())
    assert float(nll.sum()) / (scored * 2) == pytest.approx(result.best_nll, rel=1e-6)
    from_list = logits_of(model, _calibration()[:1])
    hf_posext.patch(model, "longrope", factor=result.factor, long_factor=result.long_factor)
    torch.testing.assert_close(logits_of(model, _calibration()[:1]), from_list, atol=0, rtol=0)


def test_time_budget_stops_early():
    model = tiny_model("llama")
    result = search_factors(model, 128, _calibration(rows=1), population=4, generations=50, parents=2,
                            time_budget_s=0.0, progress=False)
    assert result.history[-1].get("stopped") == "time budget"
    assert result.evaluations == 4


def test_text_calibration_with_a_tokenizer():
    from hf_posext.evaluation.loading import AsciiTokenizer

    model = tiny_model("llama")
    text = ["Plain words for a calibration text, repeated. " * 10]
    result = search_factors(model, 96, text, tokenizer=AsciiTokenizer(), population=3, generations=1, parents=1,
                            progress=False)
    assert result.settings["windows"] == 1 and len(result.long_factor) == 4


def test_the_old_name_windows_still_sets_the_calibration_segments():
    model = tiny_model("llama")
    settings = dict(population=2, generations=0, parents=1, progress=False)
    with pytest.warns(FutureWarning, match="windows= is now called segments=") as caught:
        old = search_factors(model, 128, _calibration(), windows=2, **settings)
    assert {w.filename for w in caught if w.category is FutureWarning} == {__file__}  # points at the caller's line
    new = search_factors(model, 128, _calibration(), segments=2, **settings)
    assert old.settings["windows"] == new.settings["windows"] == 2 and old.best_nll == new.best_nll
    with pytest.raises(ValueError, match="Give segments= only"):
        search_factors(model, 128, _calibration(), segments=2, windows=2, **settings)


def test_rescale_factors_maps_unscaled_to_one_and_pi_to_the_new_scale(tmp_path):
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"long_factor": [1.0, 1.5, 2.0, 3.0], "factor": 2.0, "original_max_position_embeddings": 64}))
    carried = rescale_factors(str(path), 4.0, dim=8, original_length=64)
    torch.testing.assert_close(carried, torch.tensor([1.0, 2.25, 4.0, 9.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="rotary dimension 16 needs 8"):
        rescale_factors(str(path), 4.0, dim=16)
    with pytest.raises(ValueError, match="64-token window, this model's is 32"):
        rescale_factors(str(path), 4.0, original_length=32)
    with pytest.raises(ValueError, match="no file"):
        rescale_factors(str(tmp_path / "missing.json"), 4.0)
    with pytest.raises(ValueError, match="'long_factor' and 'factor'"):
        rescale_factors({"long_factor": [1.0]}, 4.0)


def test_a_search_seeded_from_an_earlier_scale_starts_from_its_carried_factors():
    model = tiny_model("llama", initializer_range=0.5)
    at_two = search_factors(model, 128, _calibration(), segments=2, population=4, generations=1, parents=2,
                            seed=0, progress=False)
    at_four = search_factors(model, 256, _calibration(256), segments=2, population=4, generations=0, parents=2,
                             seed=0, progress=False, start_from=at_two)
    assert set(at_four.initial_nll) == {"pi", "yarn", "ntk", "start_from"}
    # The carried start is scored: patching it by hand reproduces its fitness.
    from hf_posext.lm.scoring import chunked_nll

    carried = make_monotone(rescale_factors(at_two, 4.0), at_four.settings["max_factor"])
    hf_posext.patch(model, "longrope", factor=4.0, long_factor=carried.tolist())
    with torch.no_grad():
        nll, scored = chunked_nll(model, _calibration(256))
    hf_posext.unpatch(model)
    assert float(nll.sum()) / (scored * 2) == pytest.approx(at_four.initial_nll["start_from"], rel=1e-6)
    assert at_four.best_nll <= min(at_four.initial_nll.values())


def test_a_stopped_search_resumes_without_evaluating_anything_twice(tmp_path, monkeypatch):
    import hf_posext.lm.scoring as scoring  # search scores through hf_posext.lm

    model = tiny_model("llama", initializer_range=0.5)
    path = tmp_path / "search.json"
    settings = dict(segments=2, population=4, parents=2, seed=0, progress=False, output=path)
    real_nll, calls = scoring.chunked_nll, []

    def crashing_nll(*args, **kwargs):
        calls.append(1)
        if len(calls) > 4 * 2 + 2 * 2:  # generation 0 (4 candidates x 2 segments) and generation 1 finish
            raise RuntimeError("simulated crash")
        return real_nll(*args, **kwargs)

    monkeypatch.setattr(scoring, "chunked_nll", crashing_nll)
    with pytest.raises(RuntimeError, match="simulated crash"):
        search_factors(model, 128, _calibration(), generations=3, **settings)
    assert "_hf_posext_state" not in model.__dict__
    saved = hf_posext.search.SearchResult.load(path)  # checkpointed after generation 1
    assert [h["generation"] for h in saved.history] == [0, 1] and len(saved.candidates) == 6

    monkeypatch.setattr(scoring, "chunked_nll", real_nll)
    calls.clear()
    monkeypatch.setattr(scoring, "chunked_nll", lambda *a, **k: (calls.append(1), real_nll(*a, **k))[1])
    resumed = search_factors(model, 128, _calibration(), generations=2, resume=path, **settings)
    assert len(calls) == 2 * 2 * 2  # only the 2 new generations' 2 children, 2 segments each
    assert [h["generation"] for h in resumed.history] == [0, 1, 2, 3]
    assert resumed.candidates[:6] == saved.candidates and resumed.evaluations == len(resumed.candidates) == 10
    assert resumed.initial_nll == saved.initial_nll and resumed.best_nll <= saved.best_nll
    assert resumed.seconds >= saved.seconds and resumed.settings["resumed_from"] == str(path)


def test_resume_refuses_another_search(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "search.json"
    search_factors(model, 128, _calibration(), population=3, generations=0, parents=1, progress=False, output=path)
    with pytest.raises(ValueError, match="target_length 128 \\(now 256\\)"):
        search_factors(model, 256, _calibration(256), population=3, generations=0, parents=1, progress=False, resume=path)
    with pytest.raises(ValueError, match="other calibration segments"):
        search_factors(model, 128, _calibration().flip(-1), population=3, generations=0, parents=1, progress=False, resume=path)
    with pytest.raises(ValueError, match="search result: no file"):
        search_factors(model, 128, _calibration(), progress=False, resume=tmp_path / "missing.json")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_length": 64}, "inside the original window"),
        ({"population": 3, "parents": 3}, "parents"),
        ({"mutation_rate": 2.0}, "mutation_rate"),
        ({"max_factor": 1.5}, "at least the scale"),
        ({"data": "some text"}, "tokenizer"),
        ({"data": torch.zeros(1, 50, dtype=torch.long)}, "128 tokens"),
        ({"start_from": {"long_factor": [1.0, 2.0], "factor": 2.0}}, "needs 4"),
        ({"start_from": {"long_factor": [1.0] * 4, "factor": 2.0}, "resume": "x.json"}, "not both"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs, message):
    model = tiny_model("llama")
    arguments = {"target_length": 128, "data": _calibration(), "progress": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        search_factors(model, **arguments)


def test_patched_model_is_refused():
    model = tiny_model("llama")
    hf_posext.patch(model, "yarn", factor=2)
    with pytest.raises(ValueError, match="unpatch"):
        search_factors(model, 128, _calibration(), progress=False)


@pytest.mark.multiprocess
def test_two_processes_find_what_one_finds(tmp_path):
    launcher = shutil.which("torchrun")
    if launcher is None:
        pytest.skip("torchrun not installed")
    args = ["--model", "tiny", "--target-length", "128", "--data", str(tmp_path / "text.txt"), "--segments", "1",
            "--population", "4", "--generations", "1", "--parents", "2", "--no-progress"]
    (tmp_path / "text.txt").write_text("Ordinary words make a calibration text for the search test. " * 20)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "bench" / "longrope_search.py")
    for processes, command in ((1, [sys.executable, script]), (2, [launcher, "--nproc_per_node", "2", script])):
        result = subprocess.run(command + args + ["--out", str(tmp_path / f"p{processes}.json")], capture_output=True,
                                text=True, timeout=600, cwd=ROOT, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"p{n}.json").read_text()) for n in (1, 2))
    assert one["long_factor"] == two["long_factor"]
    assert one["best_nll"] == pytest.approx(two["best_nll"], rel=1e-9)
    assert two["settings"]["processes"] == 2
