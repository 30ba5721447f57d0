"""``hf-posext eval suite`` end to end on a tiny model: every task, resumed, relabelled and refused in one line
before anything loads; a run stopped part-way keeps what it finished."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from hf_posext.card.folder import rewrite_card
from tests.card_helpers import LENGTH, tiny_folder  # noqa: F401 (a fixture)


def test_card_end_to_end_on_the_tiny_model(tiny_folder, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    import requests

    from hf_posext.cli import main
    from hf_posext.evaluation.loading import evaluation_dtype

    # offline, as CI is (HF_HUB_OFFLINE=1 stops the essays; SQuAD comes through requests, stopped here)
    monkeypatch.setattr(requests, "get", lambda *a, **k: (_ for _ in ()).throw(requests.ConnectionError("offline")))

    out = tmp_path / "card"
    # ruler_vt is left out here: lm-eval's variable-tracking generator does not finish with a character-level
    # tokenizer at CI lengths (vt_utils keeps drawing noise); it runs on real tokenizers in bench/card_smollm2.sh
    tasks = "niah_single_1,niah_multikey_2,niah_multikey_3,ruler_cwe,ruler_fwe"
    argv = ["eval", "suite", "--models", f"base={tiny_folder}", "--methods", "none,yarn", "--factor", "2",
            "--lengths", str(LENGTH), "--tasks", f"perplexity,passkey,{tasks},niah_single_2,ruler_qa_squad", "--trials", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    card = json.loads((out / "card.json").read_text())
    rows = {c["row"] for c in card["cells"]}
    assert rows == {"base, unscaled", "base, yarn ×2"}
    ruler = [c for c in card["cells"] if c["kind"] == "ruler"]
    assert {c["task"] for c in ruler} == set(tasks.split(","))
    assert all(c["n"] == 2 and c["sample_key"]["length"] == LENGTH for c in ruler)
    # same samples for every row: one key per task
    assert all(len({json.dumps(c["sample_key"], sort_keys=True) for c in ruler if c["task"] == t}) == 1 for t in {c["task"] for c in ruler})
    assert {s["what"] for s in card["skipped"]} >= {"ruler_qa_squad", "niah_single_2"}
    assert (out / "card-niah_single_1.png").exists() and "beyond the base model" in (out / "card.html").read_text()
    record = json.loads((out / "ruler").glob("ruler_fwe-*.jsonl").__next__().read_text().splitlines()[1])
    assert set(record["timing"]) == {"prefill_s", "generate_s", "harness_s", "total_s"} and record["prompt_tokens"] <= LENGTH
    # --no-progress: the log has one line a RULER sample (row, task, score, time) and one a passkey cell
    log = capsys.readouterr().err
    sample_lines = re.findall(rf"^ruler_fwe @ {LENGTH}, base, yarn ×2: sample (\d) scored [01]\.\d\d in \d+ s \((\d) of 2 to run\)$",
                              log, flags=re.M)
    assert sorted(sample_lines) == [("0", "1"), ("1", "2")]
    assert len(re.findall(r"^passkey .* @ \d+, depth [\d.]+: \d+/\d+ found \(greedy\), \d+ s$", log, flags=re.M)) >= 2
    # and no progress bar, lm-eval's own (building requests, generating RULER samples) included (`2/2 [00:00<00:00, ...]`)
    assert not re.search(r"\d+/\d+ \[\d\d:\d\d", log), sorted({m.split("|")[0] for m in re.findall(r"[^\r\n]*\d+/\d+ \[\d\d:\d\d", log)})

    # a second run recomputes nothing: every sample file is left as it was
    files = {p: p.read_bytes() for p in (out / "ruler").glob("*.jsonl")}
    plots = {p: p.stat().st_mtime_ns for t in tasks.split(",") for p in [out / f"card-{t}.png"]}
    import hf_posext.integrations.lm_eval.model as harness

    with pytest.MonkeyPatch.context() as patch:  # ... and loads no model for a RULER cell whose samples are all there
        patch.setattr(harness, "PosextHFLM", lambda *a, **k: pytest.fail("a finished RULER cell loaded its model"))
        assert main(argv) == 0
    assert " scored " not in capsys.readouterr().err  # nothing ran, nothing logged
    assert {p: p.read_bytes() for p in files} == files
    # the RULER plots show what they showed: none is drawn again (a cell marked unfinished draws as it did)
    assert {p: p.stat().st_mtime_ns for p in plots} == plots
    assert card["settings"]["partial"] is False
    # a run stopped before it reaches the cells it covers leaves them on its partial card (the earlier run's
    # samples, marked unfinished), and a card written again from the folder finds every one
    import hf_posext.integrations.lm_eval.ruler as lm_eval_card

    seen: list[dict] = []

    def stop(*args, **kwargs):
        seen.append(json.loads((out / "card.json").read_text()))
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval_card, "run_ruler_plans", stop)
        with pytest.raises(KeyboardInterrupt):
            main(argv)
    key = lambda cells: sorted((c["task"], c["row"], c["length"], c["n"]) for c in cells if c["kind"] == "ruler")  # noqa: E731
    assert key(seen[0]["cells"]) == key(card["cells"]) and seen[0]["settings"]["partial"] is True
    assert all(c.get("running") for c in seen[0]["cells"] if c["kind"] == "ruler")
    assert key(json.loads(rewrite_card(out)["json"].read_text())["cells"]) == key(card["cells"])
    assert set(tasks.split(",")) <= set(seen[0]["settings"]["dtypes"])
    assert main(argv) == 0 and json.loads((out / "card.json").read_text())["cells"] == card["cells"]
    # every pair of rows compared on the same samples, task by task, passkey trial by trial (2 samples -> one
    # trial at each of 5 depths) and perplexity window by window (2 samples -> 2 windows; the lower loss wins)
    assert {p["task"] for p in card["paired"]} == {*tasks.split(","), "passkey", "perplexity"}
    assert all(p["n"] == (5 if p["task"] == "passkey" else 2) for p in card["paired"])
    passkey_cells = [c for c in card["cells"] if c["kind"] == "passkey"]
    assert all(len(c["scores"]) == c["n"] == 5 and sum(c["scores"].values()) == c["k"] for c in passkey_cells)
    ppl_cells = [{**c, "scores": {k: -v for k, v in c["scores"].items()}} for c in card["cells"] if c["kind"] == "perplexity"]
    assert len(ppl_cells) == 2 and all(len(c["scores"]) == c["n"] == 2 for c in ppl_cells)
    assert all(math.isclose(math.log(c["mean"]), -sum(c["scores"].values()) / 2, rel_tol=1e-6) for c in ppl_cells)  # equal windows
    for pair in card["paired"]:
        first, second = (c["scores"] for name in (pair["first"], pair["second"])
                         for c in [*ruler, *passkey_cells, *ppl_cells] if c["task"] == pair["task"] and c["row"] == name)
        assert pair["higher"] == sum(first[i] > second[i] for i in first) and pair["lower"] == sum(first[i] < second[i] for i in first)

    # the full budget scores every sample exactly as the short one did (and is refused past the window)
    full = tmp_path / "full"
    assert main([*argv[:-3], "--out", str(full), "--sample-cache", str(out / "ruler-samples"), "--budget", "full", "--no-progress",
                 "--tasks", tasks]) == 0
    scores = lambda folder: {(c["task"], c["row"]): c["mean"] for c in json.loads((folder / "card.json").read_text())["cells"]
                             if c["kind"] == "ruler"}
    assert scores(full) == scores(out)

    # a run with fewer rows resumes the rows it still has (sample files are named by the row, not its place),
    # and another dtype never reads float32's samples
    yarn_only = [*argv[:4], "--methods", "yarn", *argv[6:]]
    assert main(yarn_only) == 0
    assert {p: p.read_bytes() for p in files} == files and len(list((out / "ruler").glob("*.jsonl"))) == len(files)
    # ... and the card it writes keeps the unscaled row's cells of the first run, read again from their files
    kept = json.loads((out / "card.json").read_text())
    assert sorted((c["task"], c["row"], c["n"]) for c in kept["cells"]) == sorted((c["task"], c["row"], c["n"]) for c in card["cells"])
    # ... with its rows where they were: a run of some rows does not reorder the card (nor flip its pairs)
    assert {c["row_index"] for c in kept["cells"] if c["row"] == "base, unscaled"} == {0}
    assert {c["row_index"] for c in kept["cells"] if c["row"] == "base, yarn ×2"} == {1}
    assert [r["label"] for r in kept["settings"]["rows"]] == ["base, unscaled", "base, yarn ×2"]
    assert [(p["first"], p["second"]) for p in kept["paired"]] == [(p["first"], p["second"]) for p in card["paired"]]
    # a row given another label resumes the files written under the old one (nothing computed again), and the card
    # shows their cells once, under the new label
    renamed = [*yarn_only[:3], f"renamed={tiny_folder}", *yarn_only[4:]]
    assert main(renamed) == 0
    assert {p: p.read_bytes() for p in files} == files and len(list((out / "ruler").glob("*.jsonl"))) == len(files)
    again = json.loads((out / "card.json").read_text())
    assert sorted((c["task"], c["row"], c["n"]) for c in again["cells"] if c["kind"] == "ruler" and "yarn" in c["row"]) == sorted(
        (c["task"], "renamed, yarn ×2", c["n"]) for c in card["cells"] if c["kind"] == "ruler" and c["row"] == "base, yarn ×2")
    assert "base, yarn ×2" not in {r["label"] for r in again["settings"]["rows"]}
    assert json.loads(rewrite_card(out)["json"].read_text())["cells"] == again["cells"]
    assert main(yarn_only) == 0  # and back
    ruler_dtype = evaluation_dtype("auto", "ruler", "cpu")  # --dtype auto: bfloat16 on a CPU that has it natively
    assert all(f"yarn-x2-{ruler_dtype}-" in p.name or f"none-x1-{ruler_dtype}-" in p.name for p in files)
    other = "float32" if ruler_dtype == "bfloat16" else "bfloat16"
    assert main([*yarn_only[:-3], "--out", str(out), "--no-progress", "--tasks", "niah_single_1", "--dtype", other]) == 0
    assert len(list((out / "ruler").glob(f"niah_single_1-*-{other}-*.jsonl"))) == 1


def test_a_length_past_the_window_is_refused_before_any_model_runs(tiny_folder, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from hf_posext.cli import main

    out = tmp_path / "card"
    code = main(["eval", "suite", "--models", tiny_folder, "--methods", "none", "--lengths", str(2 * LENGTH),
                 "--tasks", "niah_single_1", "--trials", "1", "--out", str(out), "--no-progress"])
    assert code != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "niah_single_1" in error and str(2 * LENGTH) in error and "error:" in error, error
    assert not (out / "ruler").exists() and not (out / "card.json").exists()


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "float8"], "Unknown dtype 'float8'; use auto"),
    (["--dtype", "int8"], "Unknown dtype 'int8'; use auto"),
    (["--methods", "yarn", "--factor", "0.5"], "factor=0.5 is below 1"),
    (["--methods", "nosuch"], "Unknown method 'nosuch'"),
    (["--methods", "yarn", "--param", "nosuch=1"], "nosuch"),
    (["--device", "gpu0"], "--device gpu0 is not a device name"),
    (["--tasks", "needle", "--haystack", "no/such/book.txt"], "'no/such/book.txt' does not exist"),
    (["--tasks", "perplexity", "--data", "no/such/book.txt"], "'no/such/book.txt' does not exist"),
    (["--sample-cache", "A_FILE"], "--sample-cache A_FILE is a file"),
    (["--out", "A_FILE"], "--out A_FILE is a file"),
])
def test_bad_card_arguments_are_refused_in_one_line_before_any_model_loads(tiny_folder, tmp_path, capsys, monkeypatch, extra, message):
    """One line naming the value, and nothing loaded or written (the models load before the samples are drawn)."""
    from hf_posext.evaluation import loading
    from hf_posext.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_loading)
    monkeypatch.chdir(tmp_path)
    Path("A_FILE").write_text("not a folder")
    out = tmp_path / "card"
    code = main(["eval", "suite", "--models", f"{tiny_folder}", "--lengths", str(LENGTH), "--tasks", "niah_single_1",
                 "--trials", "1", "--out", str(out), "--no-progress", *extra])
    error = capsys.readouterr().err.strip()
    assert code != 0 and message in error and "error:" in error and len(error.splitlines()) == 1, error
    assert not out.exists()
    # the same model spec given per row (METHOD:FACTOR after @) is checked the same way
    if extra[0] == "--methods" and "--param" not in extra:
        spec = f"{tiny_folder}@{extra[1]}" + (f":{extra[3]}" if len(extra) > 2 else "")
        assert main(["eval", "suite", "--models", spec, "--lengths", str(LENGTH), "--tasks", "niah_single_1", "--out", str(out)]) != 0
        assert message in capsys.readouterr().err and not out.exists()


def test_skip_over_window_lists_the_cells_past_a_rows_window(tiny_folder, tmp_path):
    """With --skip-over-window a length past the unscaled row's window (the harness's max_length defaults to
    it) is listed as skipped with its reason, and the run goes on with the rows that fit."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from hf_posext.cli import main

    out = tmp_path / "card"
    assert main(["eval", "suite", "--models", f"base={tiny_folder}@none;yarn:factor=2", "--lengths", str(2 * LENGTH), "--tasks", "niah_single_1",
                 "--trials", "1", "--out", str(out), "--skip-over-window", "--no-progress"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert [c["row"] for c in card["cells"]] == ["base, yarn ×2"]
    (skipped,) = [s for s in card["skipped"] if s["what"].startswith("base, unscaled")]
    assert f"window {LENGTH}" in skipped["reason"], skipped


def test_a_cell_past_a_rows_window_is_refused_before_any_sample_is_written(tiny_folder, tmp_path, capsys):
    """The RULER samples are drawn before the length budgets are checked: a refused run wrote them into a new --out
    (or the --sample-cache). They are kept back until every cell is known to fit."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    from hf_posext.cli import main

    out, cache = tmp_path / "card", tmp_path / "cache"
    for extra in ([], ["--sample-cache", str(cache)], ["--max-length", str(LENGTH // 2)]):
        length = str(2 * LENGTH) if "--max-length" not in extra else str(LENGTH)
        code = main(["eval", "suite", "--models", f"base={tiny_folder}@none", "--lengths", length, "--tasks", "niah_single_1",
                     "--trials", "1", "--out", str(out), "--no-progress", *extra])
        error = capsys.readouterr().err.strip()
        assert code != 0 and "niah_single_1 at" in error and len(error.splitlines()) == 1, error
        assert not out.exists() and not cache.exists(), extra


def test_no_progress_leaves_a_card_log_without_loading_bars_or_lm_evals_metadata_note(tiny_folder, tmp_path):
    """A card's log is read by people: with --no-progress it held transformers' "Loading weights" bars at every
    model load, and lm-eval's advice to pass lengths with --metadata at every RULER task it built (the card passes
    them itself). Both are gone; the log still says what the card wrote."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    import os
    import subprocess
    import sys

    out = tmp_path / "card"
    done = subprocess.run([sys.executable, "-m", "hf_posext.cli", "eval", "suite", "--models", f"base={tiny_folder}@none",
                           "--lengths", str(LENGTH), "--tasks", "passkey,niah_single_1", "--trials", "1", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "Loading weights" not in log and "--metadata" not in log, log[-3000:]
    assert (out / "card.html").exists() and "card.html" in log


def test_a_tiny_test_model_is_refused_for_ruler_in_one_line(tmp_path, capsys):
    """The tiny test models keep their tokenizer in memory only; lm-eval draws RULER samples from a saved one, so
    the card names the fix instead of the hub's repo-id error."""
    pytest.importorskip("lm_eval")
    from hf_posext.cli import main

    out = tmp_path / "card"
    code = main(["eval", "suite", "--models", "tiny:llama:1024", "--lengths", "512", "--tasks", "ruler_fwe",
                 "--trials", "1", "--out", str(out), "--no-progress"])
    error = capsys.readouterr().err.strip()
    assert code != 0 and "tiny:llama:1024" in error and "save_pretrained(DIR)" in error and len(error.splitlines()) == 1, error
    assert not out.exists()


def test_a_card_stopped_after_some_rows_tasks_keeps_them_on_its_card(tiny_folder, tmp_path, monkeypatch):
    """Perplexity, passkey and needle at 16384 take hours on a CPU: the card is written after each row's task, so a
    run stopped later (a session's end) leaves a card with the cells it finished, marked partial, for the combined
    card to show; before, its card was written only at the very end."""
    from hf_posext.cli import main
    from hf_posext.evaluation import passkey

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(passkey, "evaluate_passkey", stopped)
    out = tmp_path / "card"
    argv = ["eval", "suite", "--models", f"base={tiny_folder}@none;yarn:factor=2", "--lengths", "256", "--tasks", "perplexity,passkey",
            "--trials", "1", "--data", "builtin:python-docs", "--dtype", "float32", "--out", str(out), "--no-progress"]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    card = json.loads((out / "card.json").read_text())
    assert [(c["task"], c["row"]) for c in card["cells"]] == [("perplexity", "base, unscaled")]
    assert card["settings"]["partial"] is True
