"""Reports: tables, CSV, plots from results folders; the demo table; the CLI subcommands."""

import json
import shutil
from math import log
from pathlib import Path

import pytest

from hf_posext.cli import main
from hf_posext.demo import demo_table
from hf_posext.evaluation.report import load_results, markdown_tables, write_report
from hf_posext.evaluation.results_files import ResultsFileError


def _record(method, factor, length, **metrics):
    return {"method": method, "label": method, "factor": factor, "length": length, "supported_window": 64, **metrics}


def _write(folder, task, cells):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{task}-x.json").write_text(json.dumps({"task": task, "config": {"model": "m"}, "cells": cells}))


def test_report_tables_and_plots(tmp_path):
    _write(tmp_path, "perplexity", {
        "a": _record("none", 1.0, 64, ppl=10.0, nll=log(10.0), tokens=63),
        "b": _record("none", 1.0, 128, ppl=90.0, nll=log(90.0), tokens=127),
        "c": _record("yarn", 2.0, 128, ppl=12.5, nll=log(12.5), tokens=127),
    })
    _write(tmp_path, "passkey", {
        "a": _record("none", 1.0, 128, depth=0.0, greedy_accuracy=0.0, teacher_forced_accuracy=0.5, trials=2),
        "b": _record("none", 1.0, 128, depth=1.0, greedy_accuracy=1.0, teacher_forced_accuracy=1.0, trials=2),
    })
    runs = load_results(tmp_path)
    assert [r["task"] for r in runs] == ["passkey", "perplexity"]
    tables = markdown_tables(runs)
    assert "| none | 10.00 | 90.00 |" in tables and "| yarn x2 |  | 12.50 |" in tables
    # greedy: 0/2 and 2/2 over the two depths, pooled as 2/4 with its 95 % Wilson interval
    assert "| none | 2/4 [0.15, 0.85] |" in tables
    assert "| none | 3/4 [0.30, 0.95] |" in tables  # teacher-forced: 1/2 and 2/2
    assert "scored tokens per length 64: 63, 128: 127)" in tables
    markdown, plots = write_report(tmp_path)
    assert {p.name for p in plots} == {"perplexity.png", "passkey.png", "passkey-heatmap-none.png"}
    assert (tmp_path / "report.md").read_text().startswith("Perplexity")
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_report_token_note_covers_every_method(tmp_path):
    # A length that only some methods reach (the quality table's longest column) still gets its count.
    _write(tmp_path, "perplexity", {
        "a": _record("none", 1.0, 64, ppl=10.0, nll=log(10.0), tokens=63),
        "b": _record("yarn", 4.0, 256, ppl=12.0, nll=log(12.0), tokens=255),
        "c": _record("ntk", 4.0, 64, ppl=11.0, nll=log(11.0), tokens=60),
    })
    tables = markdown_tables(load_results(tmp_path))
    assert "scored tokens per length 64: 60/63, 256: 255)" in tables


def test_report_keeps_models_apart(tmp_path):
    # A base model and its fine-tuned copy in one folder (bench/reproduce_smollm2_first_finetune.sh): same method, two rows.
    for name, model, ppl in (("base", "smollm2-135m", 28.2), ("tuned", "runs/smollm2-8k-32k/merged", 25.0)):
        (tmp_path / f"perplexity-{name}.json").write_text(json.dumps({"task": "perplexity", "config": {"model": model}, "cells": {
            "a": _record("yarn", 4.0, 128, ppl=ppl, nll=log(ppl), tokens=127)}}))
        (tmp_path / f"passkey-{name}.json").write_text(json.dumps({"task": "passkey", "config": {"model": model}, "cells": {
            depth: _record("yarn", 4.0, 128, depth=depth, greedy_accuracy=float(name == "tuned"), teacher_forced_accuracy=1.0, trials=1)
            for depth in (0.1, 0.9)}}))
    tables = markdown_tables(load_results(tmp_path))
    assert "| smollm2-135m: yarn x4 | 28.20 |" in tables
    assert "| smollm2-8k-32k/merged: yarn x4 | 25.00 |" in tables
    assert "| smollm2-8k-32k/merged: yarn x4 | 2/2 [0.34, 1.00] |" in tables and "| smollm2-135m: yarn x4 | 0/2 [0.00, 0.66] |" in tables
    _, plots = write_report(tmp_path)
    names = {p.name for p in plots}
    assert {"passkey-heatmap-smollm2-135m-x4.png", "passkey-heatmap-smollm2-8k-32k-merged-x4.png"} <= names


def test_report_keeps_dtypes_of_one_model_apart(tmp_path):
    # The same trials in float32 (CPU) and bfloat16 (a GPU session) in one folder are one prompt twice: two rows,
    # never one pooled cell of 2/4; one dtype alone keeps the plain row name.
    for dtype, found in (("float32", 1.0), ("bfloat16", 0.0)):
        (tmp_path / f"passkey-{dtype}.json").write_text(json.dumps({"task": "passkey", "config": {"model": "smollm2-135m", "dtype": dtype},
            "cells": {depth: _record("yarn", 4.0, 128, depth=depth, greedy_accuracy=found, teacher_forced_accuracy=found, trials=1)
                      for depth in (0.1, 0.9)}}))
    tables = markdown_tables(load_results(tmp_path))
    assert "| smollm2-135m (bfloat16): yarn x4 | 0/2 [0.00, 0.66] |" in tables
    assert "| smollm2-135m (float32): yarn x4 | 2/2 [0.34, 1.00] |" in tables and "2/4" not in tables
    _, plots = write_report(tmp_path)
    assert {"passkey-heatmap-smollm2-135m-bfloat16-x4.png", "passkey-heatmap-smollm2-135m-float32-x4.png"} <= {p.name for p in plots}
    (tmp_path / "passkey-bfloat16.json").unlink()
    assert "| yarn x4 | 2/2 [0.34, 1.00] |" in markdown_tables(load_results(tmp_path))


def test_report_labels_a_factors_file_by_its_name(tmp_path):
    _write(tmp_path, "perplexity", {"a": {**_record("longrope", 2.0, 128, ppl=9.0, nll=log(9.0), tokens=127),
                                          "label": "longrope(factors=bench/results/search_m_128.json)"}})
    tables = markdown_tables(load_results(tmp_path))
    assert "| longrope(factors=search_m_128.json) x2 | 9.00 |" in tables and "bench/results" not in tables


_GOOD_CELL = _record("none", 1.0, 64, ppl=10.0, nll=log(10.0), tokens=63)


@pytest.mark.parametrize("content, problem", [
    (b"\x8f\x00\xffrandom bytes", "not a readable results file"),
    (b"{not json", "not a readable results file"),
    (b"[]", "holds a JSON list"),
    (b'{"task": "perplexity", "config": {}}', "lacks 'cells'"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": 3}}).encode(), "cell 'a' holds 3 (int), not a record"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "ppl": "12.5"}}}).encode(),
     "cell 'a' has ppl '12.5', not a number"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {k: v for k, v in _GOOD_CELL.items() if k != "ppl"}}}).encode(),
     "cell 'a' lacks its 'ppl'"),
    (json.dumps({"task": "passkey", "config": {}, "cells": {"a": _record("none", 1.0, 64, depth=0.5, trials=1,
                                                                        teacher_forced_accuracy=None)}}).encode(),
     "cell 'a' lacks its 'teacher_forced_accuracy'"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "length": "64"}}}).encode(),
     "has length '64', not a token count"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "run": 4}}, "runs": []}).encode(),
     "names run 4"),
    # Was: numbers no evaluation gives (a hand-edited or corrupted cell) were drawn as if measured
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "nll": -2.3}}}).encode(),
     "cell 'a' has nll -2.3, but a negative log-likelihood is never below 0"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "ppl": 0}}}).encode(),
     "cell 'a' has ppl 0, but a perplexity (exp of the nll) is never below 1"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "ppl": -10.0}}}).encode(),
     "cell 'a' has ppl -10.0, but a perplexity"),
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "tokens": 0}}}).encode(),
     "cell 'a' has tokens 0, but a cell scores at least 1"),
    (json.dumps({"task": "passkey", "config": {}, "cells": {"a": _record("none", 1.0, 64, depth=0.5, trials=4,
                                                                        teacher_forced_accuracy=1.5)}}).encode(),
     "cell 'a' has teacher_forced_accuracy 1.5, outside [0, 1]"),
    # Was: numbers that contradict the cell's own others were printed as given
    (json.dumps({"task": "perplexity", "config": {}, "cells": {"a": {**_GOOD_CELL, "ppl": 20.0}}}).encode(),
     "cell 'a' has ppl 20.0, but its nll 2.302585092994046 gives exp(nll) = 10; the perplexity is exp of the nll"),
    (json.dumps({"task": "passkey", "config": {}, "cells": {"a": _record("none", 1.0, 64, depth=1.5, trials=4,
                                                                        teacher_forced_accuracy=0.5)}}).encode(),
     "cell 'a' has depth 1.5, outside [0, 1]"),
    # the finished units of an unfinished cell, damaged: named, never resumed from
    (json.dumps({"task": "perplexity", "config": {}, "cells": {}, "partial": {"a": {"units": [{}], "unit_keys": []}}}).encode(),
     "has a 'partial' entry (the finished units of unfinished cells) that is not an object of unit lists"),
])
def test_report_names_a_corrupt_results_file(tmp_path, capsys, content, problem):
    # a damaged file beside good ones stops the report with its name; nothing is written
    _write(tmp_path, "perplexity", {"a": _GOOD_CELL})
    (tmp_path / "zz-damaged.json").write_bytes(content)
    with pytest.raises(ResultsFileError, match="zz-damaged.json") as error:
        load_results(tmp_path)
    assert problem in str(error.value)
    assert main(["report", str(tmp_path)]) == 1  # a damaged file is a runtime error (exit 1), not a usage error
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "zz-damaged.json" in err and problem in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["perplexity-x.json", "zz-damaged.json"]


def test_result_store_refuses_a_cell_without_its_numbers(tmp_path):
    # Was: a stored cell that lacks its numbers was reused (a blank table cell, exit 0)
    from hf_posext.evaluation import evaluate_perplexity, parse_methods
    from hf_posext.evaluation.loading import load_model_and_tokenizer

    data = tmp_path / "text.txt"
    data.write_text("Some words to read. " * 30)
    model, tokenizer = load_model_and_tokenizer("tiny")
    common = dict(data=str(data), methods=parse_methods("none"), lengths=[32], out_dir=tmp_path, model_name="tiny", max_segments=1)
    store = evaluate_perplexity(model, tokenizer, **common)
    saved = json.loads(store.path.read_text())
    for record in saved["cells"].values():
        del record["ppl"]
    store.path.write_text(json.dumps(saved))
    damaged = store.path.read_bytes()
    with pytest.raises(ResultsFileError, match=f"{store.path.name}.*lacks its 'ppl'"):
        evaluate_perplexity(model, tokenizer, **common)
    assert store.path.read_bytes() == damaged  # left as it was, not reused and not overwritten


def test_a_results_folder_may_hold_a_perfectly_predicted_cell(tmp_path):
    # the bounds above refuse only what no evaluation gives: nll 0 / ppl 1 (every token certain) is possible
    _write(tmp_path, "perplexity", {"a": {**_GOOD_CELL, "nll": 0.0, "ppl": 1.0}})
    assert load_results(tmp_path)[0]["cells"]["a"]["ppl"] == 1.0


def test_a_folder_named_like_a_results_file_is_named(tmp_path):
    _write(tmp_path, "perplexity", {"a": _GOOD_CELL})
    (tmp_path / "old.json").mkdir()
    with pytest.raises(ResultsFileError, match=r"old.json is a folder, not a results file; rename it or move it out of"):
        load_results(tmp_path)


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_results(tmp_path / "missing")
    with pytest.raises(ValueError, match="no evaluation results"):
        load_results(tmp_path)


def test_demo_table():
    perplexity = {"1": _record("none", 1.0, 4096, ppl=9.5), "2": _record("yarn", 2.0, 4096, ppl=9.9)}
    passkey = {"1": _record("none", 1.0, 4096, greedy_accuracy=1.0, teacher_forced_accuracy=0.0, trials=1),
               "2": _record("dynamic-ntk", 2.0, 4096, greedy_accuracy=0.0, teacher_forced_accuracy=1.0, trials=1)}
    table = demo_table(perplexity, passkey, (4096,))
    assert "| none | 9.50 | ok / miss |" in table and "| yarn x2 | 9.90 |  |" in table
    assert "| dynamic-ntk x2 |  | miss / ok |" in table  # a method run only for retrieval: blank perplexity


def test_demo_table_puts_the_fine_tuned_model_in_its_own_last_row():
    perplexity = {"1": _record("none", 1.0, 4096, ppl=9.5), "2": _record("yarn", 2.0, 4096, ppl=9.9)}
    passkey = {"1": _record("yarn", 2.0, 4096, greedy_accuracy=0.0, teacher_forced_accuracy=0.0, trials=1)}
    fine_tuned = ({"1": _record("yarn", 4.0, 4096, ppl=7.25)},
                  {"1": _record("yarn", 4.0, 4096, greedy_accuracy=1.0, teacher_forced_accuracy=1.0, trials=1)})
    lines = demo_table(perplexity, passkey, (4096,), fine_tuned).splitlines()
    assert lines[2:] == ["| none | 9.50 |  |", "| yarn x2 | 9.90 | miss / miss |",
                         "| fine-tuned: yarn x4 + LoRA (250 CPU steps) | 7.25 | ok / ok |"]


def test_demo_adapter_is_checked_before_anything_loads(tmp_path):
    from hf_posext.adapters import AdapterMismatchError, finish_adapter_folder
    from hf_posext.demo import DEMO_ADAPTER, check_demo_adapter

    record = check_demo_adapter()  # the committed adapter of the recipe's CPU run
    assert (record.method, record.factor) == ("yarn", 4.0) and (DEMO_ADAPTER / "adapter_model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="fine-tuned adapter .*missing"):
        check_demo_adapter(tmp_path / "gone")
    other = tmp_path / "other"
    shutil.copytree(DEMO_ADAPTER, other)
    record_file = other / "posext_adapter.json"
    record_file.write_text(record_file.read_text().replace('"smollm2-135m"', '"tiny"'))
    finish_adapter_folder(other)  # re-signed: an edit the manifest would otherwise refuse first
    with pytest.raises(AdapterMismatchError, match="trained on base model 'tiny'"):
        check_demo_adapter(other)


def test_demo_methods_are_parsed_before_the_model_loads():
    from hf_posext.demo import PERPLEXITY_METHODS, RETRIEVAL_METHODS, demo_methods

    assert [r.name for r in demo_methods(RETRIEVAL_METHODS)] == ["dynamic-yarn", "dynamic-ntk"]
    assert [r.name for r in demo_methods(PERPLEXITY_METHODS)] == ["none", "dynamic-yarn"]
    with pytest.raises(ValueError, match="dynamic-yarm"):
        demo_methods(("dynamic-yarm",))


def test_cli_eval_and_report_end_to_end(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("Some words to read. " * 30)
    out = tmp_path / "results"
    code = main(["eval", "perplexity", "--model", "tiny", "--methods", "none,linear", "--factor", "2", "--lengths", "32,64",
                 "--data", str(data), "--out", str(out), "--max-segments", "2", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| linear x2 |" in printed and "perplexity.png" in printed
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Perplexity" in printed and f"HTML report (self-contained, opens offline): {out / 'report.html'}" in printed
    assert (out / "report.html").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "32", "--methods", "none,yran"], "Unknown method 'yran'"),
    (["--lengths", "32", "--data", "/no/such/books"], "does not exist"),
    (["--lengths", "abc"], "Bad length"),
])
def test_cli_bad_input_gives_one_clear_line(tmp_path, capsys, argv, message):
    code = main(["eval", "perplexity", "--model", "tiny", "--out", str(tmp_path)] + argv)
    assert code == 2
    assert message in capsys.readouterr().err


def test_eval_names_a_damaged_file_beside_its_results(tmp_path, capsys):
    # the plots after an evaluation cover the folder; a damaged file there is named, not silently left out
    data = tmp_path / "text.txt"
    data.write_text("Some words to read. " * 30)
    out = tmp_path / "results"
    out.mkdir()
    (out / "passkey-old.json").write_text("[]")
    code = main(["eval", "perplexity", "--model", "tiny", "--methods", "none", "--lengths", "32", "--data", str(data),
                 "--out", str(out), "--max-segments", "1", "--no-progress"])
    assert code == 0
    err = capsys.readouterr().err
    assert "warning: plots cover only this run:" in err and "passkey-old.json holds a JSON list" in err


def test_demo_shows_the_headline_composition_on_the_fine_tuned_row():
    """The demo's fine-tuned row is the README's headline: the adapter's yarn x4 with STRING stacked on it."""
    from hf_posext.demo import DEMO_ATTENTION, check_demo_adapter, demo_methods

    record = check_demo_adapter()
    assert [r.name for r in demo_methods((f"{record.method}+{DEMO_ATTENTION}",))] == ["yarn+string"]
    passkey = {"1": _record("dynamic-yarn", 2.0, 4096, greedy_accuracy=0.0, teacher_forced_accuracy=0.0, trials=1)}
    fine_tuned = ({"1": _record("yarn+string", 4.0, 4096, ppl=7.5)},
                  {"1": _record("yarn+string", 4.0, 4096, greedy_accuracy=1.0, teacher_forced_accuracy=1.0, trials=1)})
    lines = demo_table({}, passkey, (4096,), fine_tuned).splitlines()
    assert lines[-1] == "| fine-tuned: yarn x4 + string + LoRA (250 CPU steps) | 7.50 | ok / ok |"


def test_a_composition_is_named_with_its_frequency_parts_factor():
    from hf_posext.evaluation.labels import series_name

    assert series_name({"method": "yarn+string", "label": "yarn+string", "factor": 4.0}) == "yarn x4 + string"
    assert series_name({"method": "yarn+string", "label": "yarn+string(string.local_value=64)", "factor": 4.0}) == \
        "yarn x4 + string(string.local_value=64)"
    assert series_name({"method": "yarn", "factor": 2.0, "_model": "m"}) == "m: yarn x2"
