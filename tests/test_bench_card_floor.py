"""bench/card_floor.py: the cells the card's sample floor needs, with what the card has; the cells the floor lets
a card leave out (beyond the base model at 32768, a training-free row that scored 0 at 16384, over the window)."""

from __future__ import annotations

import json
import os

from tests.bench_helpers import BENCH, load_bench_script


def _card() -> dict:
    floor = load_bench_script("card_floor")
    cells = [{"task": "niah_single_1", "row": floor.HEADLINE, "length": 16384, "n": 20, "mean": 1.0},
             {"task": "niah_single_1", "row": floor.YARN, "length": 16384, "n": 19, "mean": 0.9},
             {"task": "ruler_cwe", "row": floor.YARN, "length": 16384, "n": 20, "mean": 0.0},
             {"task": "niah_multikey_2", "row": floor.YARN, "length": 16384, "n": 20, "mean": 0.0},
             {"task": "perplexity", "row": floor.BASE, "length": 2048, "n": 8, "mean": 27.5}]
    return {"cells": cells, "skipped": [{"what": f"{floor.BASE}: ruler_fwe at 8192", "reason": "over its window"}],
            "beyond_base_model": {"ruler_cwe": True, "niah_multikey_2": False}}


def test_the_floor_lists_each_cell_with_what_the_card_has():
    floor = load_bench_script("card_floor")
    cells = {(c["task"], c["row"], c["length"]): c for c in floor.floor_cells(_card())}
    assert len(cells) == 9 * 8  # 9 tasks x (3 in-window + 3 rows at 16384 + 2 rows at 32768)
    assert cells[("niah_single_1", floor.HEADLINE, 16384)] == {
        "task": "niah_single_1", "row": floor.HEADLINE, "length": 16384, "have": 20, "need": 20, "why": "", "tier": 0}
    assert cells[("niah_single_1", floor.YARN, 16384)]["have"] == 19  # one short: missing
    assert cells[("perplexity", floor.BASE, 2048)]["have"] == cells[("perplexity", floor.BASE, 2048)]["need"] == 1
    assert cells[("niah_single_1", floor.YARN, 32768)]["need"] == 10
    # what the floor lets a card leave out
    assert cells[("ruler_fwe", floor.BASE, 8192)]["why"] == "over the window" and cells[("ruler_fwe", floor.BASE, 8192)]["need"] == 0
    assert cells[("ruler_cwe", floor.HEADLINE, 32768)]["why"] == "beyond the base model"
    assert cells[("niah_multikey_2", floor.YARN, 32768)] == {
        "task": "niah_multikey_2", "row": floor.YARN, "length": 32768, "have": 0, "need": 0, "why": "0 at 16384", "tier": 0}
    # ... never the headline model's own cell, nor a task that counts where the row scored above 0
    assert cells[("niah_multikey_2", floor.HEADLINE, 32768)]["need"] == 10
    assert cells[("niah_single_1", floor.YARN, 32768)]["need"] == 10


def test_the_table_is_written_beside_the_card_and_a_missing_card_is_named(tmp_path, capsys):
    floor = load_bench_script("card_floor")
    card = tmp_path / "card.json"
    card.write_text(json.dumps(_card()))
    assert floor.main(["--card", str(card)]) == 0
    text = (tmp_path / "FLOOR.md").read_text()
    assert text.startswith("# The card's sample floor: 8 of 72 cells met")  # 4 with their samples, 4 that the floor leaves out
    assert "| niah_single_1 | base, yarn ×4 | 16384 | 19 | 20 | missing |" in text
    assert not list(tmp_path.glob("*.partial"))
    assert floor.main(["--card", str(tmp_path / "none.json")]) == 2
    assert "bench/card_smollm2.sh combine" in capsys.readouterr().err


def test_each_missing_cell_is_named_with_the_command_that_fills_it(tmp_path):
    """FLOOR.md says which `bench/card_smollm2.sh` line fills the missing cells, grouped, with their samples: every
    command names a part the script has and settings it reads, and the groups add up to what is missing."""
    import re

    floor = load_bench_script("card_floor")
    script = (BENCH / "card_smollm2.sh").read_text()
    (parts,) = re.findall(r'^PARTS="([^"]+)"', script, flags=re.M)
    card = tmp_path / "card.json"
    card.write_text(json.dumps(_card()))
    assert floor.main(["--card", str(card)]) == 0
    text = (tmp_path / "FLOOR.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| (\d+) \| (\d+) \|$", text, flags=re.M)
    assert rows, text
    for command, _, _ in rows:
        *settings, bash, path, part = command.split()
        assert (bash, path) == ("bash", "bench/card_smollm2.sh") and part in parts.split("|"), command
        assert all(setting.split("=")[0] in ("GRID", "TASKS") and f"${{{setting.split('=')[0]}" in script for setting in settings)
    missing = [c for c in floor.floor_cells(_card()) if c["have"] < c["need"]]
    assert sum(int(cells) for _, cells, _ in rows) == len(missing)
    # the commands' samples add up to the total the page states; a perplexity cell adds a cell, not samples
    (total,) = re.findall(r"Missing: \d+ cells, (\d+) samples", text)
    assert sum(int(samples) for _, _, samples in rows) == int(total) == sum(
        c["need"] - c["have"] for c in missing if c["task"] != "perplexity")
    assert any(c["task"] == "perplexity" for c in missing), "the fixture should miss a perplexity cell"
    # the cell one sample short is filled by the floor's RULER line, a base model's cell by its GRID=base line
    assert floor.filling_part("niah_single_1", floor.YARN, 16384)[0] == "GRID=floor TASKS=niah_single_1 bash bench/card_smollm2.sh ruler"
    assert floor.filling_part("ruler_vt", floor.BASE, 4096)[0] == "GRID=base bash bench/card_smollm2.sh ruler-float32"
    assert floor.filling_part("passkey", floor.HEADLINE, 32768)[0] == "bash bench/card_smollm2.sh tasks32"
    # the GPU's floor (50 samples) is filled by the GPU stage, not these parts
    assert floor.main(["--card", str(card), "--floor", "50", "--floor-32k", "50"]) == 0
    assert "bench/card_smollm2.sh" not in (tmp_path / "FLOOR.md").read_text()


def test_the_floor_fills_the_tasks_that_count_first_then_retrieval_then_the_tasks_beyond_the_base_model():
    """FLOOR.md's order (what `bash bench/card_smollm2.sh floor` runs): the commands with cells on a RULER task that
    counts first (the targets are judged there), then perplexity, passkey and needle, then the tasks beyond the base
    model; within each, the fewest missing samples first."""
    floor = load_bench_script("card_floor")
    cells = floor.floor_cells(_card())
    assert {c["task"]: c["tier"] for c in cells} == {
        "niah_single_1": 0, "niah_multikey_2": 0, "niah_multikey_3": 0, "ruler_vt": 0, "ruler_fwe": 0,
        "perplexity": 1, "passkey": 1, "needle": 1, "ruler_cwe": 2}  # _card() marks only ruler_cwe beyond
    runs = floor.filling_runs(cells)
    tiers = [min(c["tier"] for c in group) for _, _, group in runs]
    assert tiers == sorted(tiers) and set(tiers) == {0, 1, 2}
    for tier in set(tiers):
        samples = [sum(c["need"] - c["have"] for c in group) for (_, _, group), t in zip(runs, tiers) if t == tier]
        assert samples == sorted(samples), (tier, samples)
    # the first command meets its cell soonest (10 samples at 32768); retrieval's come after every RULER task that
    # counts, and the last command holds ruler_cwe's cells only (beyond the base model)
    assert runs[0][0] == "TASKS=niah_multikey_2 bash bench/card_smollm2.sh counting32"
    commands = [part for part, _, _ in runs]
    assert commands.index("GRID=floor TASKS=niah_single_1 bash bench/card_smollm2.sh ruler") < commands.index("bash bench/card_smollm2.sh tasks32")
    assert all(c["task"] == "ruler_cwe" for c in runs[-1][2])


def test_the_floor_commands_for_this_cpu_take_the_float32_twins_where_it_has_no_native_bfloat16(tmp_path, capsys, monkeypatch):
    """`bash bench/card_smollm2.sh floor` runs what `card_floor.py --commands` prints: each command once, in FLOOR.md's
    order; on a CPU without native bfloat16 a bfloat16 part's float32 twin instead, and a part with none is named."""
    from hf_posext.evaluation import loading

    floor = load_bench_script("card_floor")
    card = tmp_path / "card.json"
    card.write_text(json.dumps(_card()))
    runs = floor.filling_runs(floor.floor_cells(_card()))
    native, cannot = floor.commands_for_this_cpu(runs, native_bfloat16=True)
    assert native == [part for part, _, _ in runs] and cannot == []
    twins, cannot = floor.commands_for_this_cpu(runs, native_bfloat16=False)
    assert "GRID=floor bash bench/card_smollm2.sh ruler-float32" in twins and len(twins) == len(set(twins))
    assert not [c for c in twins if c.endswith(" ruler") or c.endswith(" tasks-bfloat16")]
    # niah_single_1 and ruler_fwe are `ruler`'s alone (bfloat16): inside the window and at 16384
    assert "GRID=base bash bench/card_smollm2.sh ruler" in cannot
    assert "GRID=floor TASKS=niah_single_1 bash bench/card_smollm2.sh ruler" in cannot and all(c.endswith(" ruler") for c in cannot)
    assert len(twins) < len(native)  # the four RULER tasks' float32 part runs once for all of them
    monkeypatch.setattr(loading, "cpu_has_native_bfloat16", lambda: False)
    capsys.readouterr()
    assert floor.main(["--card", str(card), "--commands"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == twins and err.count("needs a CPU with native bfloat16") == len(cannot)
    assert not (tmp_path / "FLOOR.md").exists()  # --commands writes nothing
    assert floor.main(["--card", str(card), "--commands", "--floor", "50"]) == 2


def test_the_card_script_refuses_a_grid_it_does_not_know_before_running_anything(tmp_path):
    """A misspelt GRID used to fall through to the part's whole grid (hours on 2 cores); it is refused in one line,
    and the grids it knows reach the card (PYTHON=echo prints the command instead of running it)."""
    import subprocess

    def run(part: str, grid: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHON": "echo", "MERGED": str(tmp_path / "merged"), "AGGREGATION": str(headline),
               "GRID": grid, "TASKS": "ruler_vt"}
        return subprocess.run(["bash", str(BENCH / "card_smollm2.sh"), part], capture_output=True, text=True, env=env,
                              cwd=BENCH.parent, timeout=60)

    headline = tmp_path / "headline"  # a merged model: the script checks for its config.json
    headline.mkdir()
    (headline / "config.json").write_text("{}")
    for part in ("ruler", "ruler-float32", "tasks"):
        refused = run(part, "flor")
        assert refused.returncode == 2 and "eval suite" not in refused.stdout, refused.stdout
        assert refused.stderr.strip() == f"unknown GRID=flor for {part}: use all, floor or base (ruler also takes training-free)"
    assert run("tasks", "training-free").returncode == 2
    grids = {"training-free": "--models base=smollm2-135m@yarn:4;dynamic-ntk:4 --tasks ruler_vt --lengths 16384",
             "floor": f"--models base=smollm2-135m@yarn:4;dynamic-ntk:4,fine-tuned with aggregation practice={headline}@string:1 "
                      "--tasks ruler_vt"}
    for grid, expected in grids.items():
        done = run("ruler", grid)
        assert done.returncode == 0 and expected in done.stdout, done.stdout + done.stderr
    assert run("tasks32", "floor").returncode == 0  # a part GRID does not narrow ignores it


def test_the_card_script_asks_for_the_headline_model_only_where_a_part_measures_it(tmp_path):
    """The headline row is the aggregation-practice fine-tune: the parts that measure it stop in one line when its
    merged model is missing; the original model's cells (GRID=base) and the training-free rows run without it."""
    import subprocess

    def run(part: str, grid: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHON": "echo", "MERGED": str(tmp_path / "merged"), "AGGREGATION": str(tmp_path / "absent"),
               "GRID": grid, "TASKS": "ruler_vt"}
        return subprocess.run(["bash", str(BENCH / "card_smollm2.sh"), part], capture_output=True, text=True, env=env,
                              cwd=BENCH.parent, timeout=60)

    for part, grid in (("ruler", "floor"), ("tasks-bfloat16", "all"), ("tasks32", "all"), ("counting32", "all")):
        stopped = run(part, grid)
        assert stopped.returncode == 1 and "eval suite" not in stopped.stdout, (part, stopped.stdout)
        assert stopped.stderr.splitlines()[-1].startswith("no merged aggregation-practice model"), stopped.stderr
    for part, grid in (("ruler", "base"), ("ruler", "training-free"), ("best32", "all")):
        done = run(part, grid)
        assert done.returncode == 0 and "eval suite" in done.stdout and "aggregation" not in done.stdout, (part, done.stderr)


def test_the_card_script_refuses_the_old_switch_for_the_aggregation_row(tmp_path):
    """WITH_AGGREGATION=1 added the aggregation-practice row before it became the headline; a command copied from an
    older history entry is told so in one line instead of running a part that means something else now."""
    import subprocess

    env = {**os.environ, "PYTHON": "echo", "MERGED": str(tmp_path / "merged"), "AGGREGATION": str(tmp_path / "absent"),
           "WITH_AGGREGATION": "1", "TASKS": "needle"}
    done = subprocess.run(["bash", str(BENCH / "card_smollm2.sh"), "tasks32"], capture_output=True, text=True, env=env,
                          cwd=BENCH.parent, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().startswith("WITH_AGGREGATION is gone: the aggregation-practice fine-tune is the headline")
