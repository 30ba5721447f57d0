"""Reports: tables, CSV, plots from results folders; the demo table; the CLI subcommands."""

import json

import pytest

from hf_posext.cli import main
from hf_posext.demo import demo_table
from hf_posext.evaluation.report import load_results, markdown_tables, write_report


def _record(method, factor, length, **metrics):
    return {"method": method, "label": method, "factor": factor, "length": length, "supported_window": 64, **metrics}


def _write(folder, task, cells):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{task}-x.json").write_text(json.dumps({"task": task, "config": {"model": "m"}, "cells": cells}))


def test_report_tables_and_plots(tmp_path):
    _write(tmp_path, "perplexity", {
        "a": _record("none", 1.0, 64, ppl=10.0, nll=2.3, tokens=63),
        "b": _record("none", 1.0, 128, ppl=90.0, nll=4.5, tokens=127),
        "c": _record("yarn", 2.0, 128, ppl=12.5, nll=2.5, tokens=127),
    })
    _write(tmp_path, "passkey", {
        "a": _record("none", 1.0, 128, depth=0.0, greedy_accuracy=0.0, teacher_forced_accuracy=0.5, trials=2),
        "b": _record("none", 1.0, 128, depth=1.0, greedy_accuracy=1.0, teacher_forced_accuracy=1.0, trials=2),
    })
    (tmp_path / "notes.json").write_text("[1, 2]")
    runs = load_results(tmp_path)
    assert [r["task"] for r in runs] == ["passkey", "perplexity"]
    tables = markdown_tables(runs)
    assert "| none | 10.00 | 90.00 |" in tables and "| yarn x2 |  | 12.50 |" in tables
    assert "| none | 0.50 |" in tables  # greedy accuracy averaged over the two depths
    assert "scored tokens per length 64: 63, 128: 127)" in tables
    markdown, plots = write_report(tmp_path)
    assert {p.name for p in plots} >= {"perplexity.png", "passkey.png", "passkey-heatmap-none.png"}
    assert (tmp_path / "report.md").read_text().startswith("Perplexity")


def test_report_token_note_covers_every_method(tmp_path):
    # A length that only some methods reach (the quality table's longest column) still gets its count.
    _write(tmp_path, "perplexity", {
        "a": _record("none", 1.0, 64, ppl=10.0, nll=2.3, tokens=63),
        "b": _record("yarn", 4.0, 256, ppl=12.0, nll=2.5, tokens=255),
        "c": _record("ntk", 4.0, 64, ppl=11.0, nll=2.4, tokens=60),
    })
    tables = markdown_tables(load_results(tmp_path))
    assert "scored tokens per length 64: 60/63, 256: 255)" in tables


def test_report_keeps_models_apart(tmp_path):
    # A base model and its fine-tuned copy in one folder (bench/finetune_smollm2.sh): same method, two rows.
    for name, model, ppl in (("base", "smollm2-135m", 28.2), ("tuned", "runs/smollm2-8k-32k/merged", 25.0)):
        (tmp_path / f"perplexity-{name}.json").write_text(json.dumps({"task": "perplexity", "config": {"model": model}, "cells": {
            "a": _record("yarn", 4.0, 128, ppl=ppl, nll=3.0, tokens=127)}}))
        (tmp_path / f"passkey-{name}.json").write_text(json.dumps({"task": "passkey", "config": {"model": model}, "cells": {
            depth: _record("yarn", 4.0, 128, depth=depth, greedy_accuracy=float(name == "tuned"), teacher_forced_accuracy=1.0, trials=1)
            for depth in (0.1, 0.9)}}))
    tables = markdown_tables(load_results(tmp_path))
    assert "| smollm2-135m: yarn x4 | 28.20 |" in tables
    assert "| smollm2-8k-32k/merged: yarn x4 | 25.00 |" in tables
    assert "| smollm2-8k-32k/merged: yarn x4 | 1.00 |" in tables and "| smollm2-135m: yarn x4 | 0.00 |" in tables
    _, plots = write_report(tmp_path)
    names = {p.name for p in plots}
    assert {"passkey-heatmap-smollm2-135m-yarnx4.png", "passkey-heatmap-smollm2-8k-32k-merged-yarnx4.png"} <= names


def test_report_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_results(tmp_path / "missing")
    with pytest.raises(ValueError, match="no evaluation results"):
        load_results(tmp_path)


def test_demo_table():
    perplexity = {"1": _record("none", 1.0, 4096, ppl=9.5), "2": _record("yarn", 2.0, 4096, ppl=9.9)}
    passkey = {"1": _record("none", 1.0, 4096, greedy_accuracy=1.0, teacher_forced_accuracy=0.0, trials=1)}
    table = demo_table(perplexity, passkey, (4096,))
    assert "| none | 9.50 | ok / miss |" in table and "| yarn x2 | 9.90 |  |" in table


def test_cli_eval_and_report_end_to_end(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("Some words to read. " * 30)
    out = tmp_path / "results"
    code = main(["eval", "perplexity", "--model", "tiny", "--methods", "none,linear", "--factor", "2", "--lengths", "32,64",
                 "--data", str(data), "--out", str(out), "--max-windows", "2", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| linear x2 |" in printed and "perplexity.png" in printed
    assert main(["report", str(out)]) == 0
    assert "Perplexity" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "32", "--methods", "none,yran"], "Unknown method 'yran'"),
    (["--lengths", "32", "--data", "/no/such/books"], "does not exist"),
    (["--lengths", "abc"], "Bad length"),
])
def test_cli_bad_input_gives_one_clear_line(tmp_path, capsys, argv, message):
    code = main(["eval", "perplexity", "--model", "tiny", "--out", str(tmp_path)] + argv)
    assert code == 2
    assert message in capsys.readouterr().err
