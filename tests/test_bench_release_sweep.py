"""``bench/release_sweep.py`` refuses bad input in one line before it makes a venv, and its table reads the records."""

from __future__ import annotations

import json

import pytest
import transformers

from tests.bench_helpers import load_bench_script

release_sweep = load_bench_script("release_sweep")


@pytest.mark.parametrize("args, message", [
    (["--transformers", "5.x"], "--transformers needs a release such as 5.10.4, got '5.x'"),
    ([], "--transformers needs a release such as 5.10.4, got None"),
    (["--transformers", transformers.__version__], "is the installed one: run python bench/family_sweep.py"),
])
def test_a_bad_release_is_refused_before_any_venv_is_made(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        release_sweep.main([*args, "--venv", str(tmp_path / "venv")])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "venv").exists()


def test_a_folder_that_is_not_a_venv_is_refused_and_left_alone(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("kept")
    with pytest.raises(SystemExit, match=r"--venv .*mine exists and is not a venv \(no pyvenv.cfg\); name another folder"):
        release_sweep.main(["--transformers", "5.0.0", "--venv", str(folder)])
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


def _record(version: str, crash_reason: str = "") -> dict:
    methods = [{"method": "linear", "outcome": "ok", "reason": ""},
               {"method": "yarn", "outcome": "crash" if crash_reason else "ok", "reason": crash_reason}]
    return {"versions": f"transformers {version}, torch 2.13.0", "rows": [
        {"class_name": "LlamaForCausalLM", "built": True, "reason": "", "methods": methods},
        {"class_name": "OddForCausalLM", "built": False, "reason": "ValueError: no tiny config", "methods": []}],
        "totals": {"classes": 2, "built": 1, "pairs": 2, "ok": 2 - bool(crash_reason), "refused": 0, "crash": int(bool(crash_reason))}}


def test_the_table_has_a_row_per_release_in_release_order_with_each_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(release_sweep, "RELEASES", tmp_path)
    for version, reason in (("5.10.4", ""), ("5.9.0", "TypeError: float() | None")):
        (tmp_path / f"sweep-{version}.json").write_text(json.dumps(_record(version, reason)))
    rows = [line for line in release_sweep.write_summary().read_text().splitlines() if line.startswith("| 5.")]
    assert [row.split(" | ")[0] for row in rows] == ["| 5.9.0", "| 5.10.4"]  # 5.9 before 5.10: numbers, not text
    assert "LlamaForCausalLM: yarn: TypeError: float() / None" in rows[0] and "| 1 |" in rows[0]
    assert "OddForCausalLM: not built (ValueError: no tiny config)" in rows[1] and "LlamaForCausalLM" not in rows[1]


def test_a_damaged_record_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(release_sweep, "RELEASES", tmp_path)
    (tmp_path / "sweep-5.0.0.json").write_text('{"versions": ')
    with pytest.raises(SystemExit, match=r"sweep-5.0.0.json is not a sweep record .*; run that release again"):
        release_sweep.write_summary()
    assert not (tmp_path / "README.md").exists()


def test_an_edited_record_without_a_sweeps_fields_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(release_sweep, "RELEASES", tmp_path)
    record = _record("5.1.0")
    del record["totals"]
    (tmp_path / "sweep-5.1.0.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=r"lacks a sweep's fields \(KeyError\('totals'\)\); run that release again"):
        release_sweep.write_summary()


def test_a_second_run_of_the_same_release_is_refused_before_it_touches_the_venv(tmp_path, monkeypatch):
    from hf_posext.core.locks import hold_folder

    monkeypatch.setattr(release_sweep, "RELEASES", tmp_path / "releases")
    with hold_folder(tmp_path / "releases", part="release 5.0.0"):
        with pytest.raises(SystemExit, match=r"being written by another release 5.0.0 run \(pid \d+ .*\); wait for it"):
            release_sweep.main(["--transformers", "5.0.0", "--venv", str(tmp_path / "venv")])
    assert not (tmp_path / "venv").exists()
