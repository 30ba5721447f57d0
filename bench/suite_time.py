"""Time the tests that existed at an old commit, on the old tree and on the current one, interleaved.

The suite grows with every issue, so "the suite's time" compared across commits mixes the cost of new
tests with any slowdown of old ones. This script compares like with like: it collects the old tree's
test ids, maps each to its id in the new tree (same id, or a rename given in ``RENAMED``), and runs
exactly those tests in both trees, in ABBA order (old, new, new, old by default) so that a change in the
machine's load hits both sides alike. Each run is a fresh ``python -m pytest`` with ``PYTHONPATH`` set to
its tree; per-test times (setup + call + teardown) come from pytest's junit XML, and the CPU seconds
(user + system) of the run and every process it waited for from ``getrusage``. On a shared, loaded machine
the CPU seconds are the fairer reading: wall time there mostly measures the other jobs. The JSON is
rewritten after every run, so an interrupted measurement keeps what it finished.

Example:
    python3 bench/suite_time.py --old-tree /tmp/hf_posext_a62e044 --new-tree . \\
        --out bench/results/suite_time/suite_time_a62e044.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: Old test id -> its id in the current tree, for tests renamed or replaced since a62e044.
RENAMED = {
    "tests/test_bench_gpu_checks.py::test_every_check_passes_on_cpu_and_is_written":
        "tests/test_bench_gpu_checks.py::test_every_check_passes_on_cpu_with_a_margin_and_is_written",
    "tests/test_cli.py::test_console_script_is_installed":
        "tests/test_cli.py::test_console_script_is_installed_and_runs",
    "tests/test_lm_eval_plugin.py::test_bad_posext_arguments_fail_before_the_model_loads"
    "[posext_args5-posext_factor must be a number >= 1]":
        "tests/test_lm_eval_plugin.py::test_bad_posext_arguments_fail_before_the_model_loads"
        "[posext_args5-posext_factor=0.5 is below 1]",
    "tests/test_patching.py::test_bad_input_is_a_clear_error_and_leaves_the_model_untouched"
    "[args0-kwargs0-ValueError-Unknown method 'wavelet'.*Known rope methods: dynamic-ntk]":
        "tests/test_patching.py::test_bad_input_is_a_clear_error_and_leaves_the_model_untouched"
        "[args0-kwargs0-ValueError-Unknown method 'wavelet'.*Known methods: dca, dynamic-ntk]",
    "tests/test_self_extend.py::test_bad_settings_raise_clear_errors_and_leave_the_model_untouched"
    "[kwargs4-Did you mean 'window']":
        "tests/test_self_extend.py::test_bad_settings_raise_clear_errors_and_leave_the_model_untouched"
        "[kwargs4-Did you mean 'neighbor_window']",
    # The hand-written training loop's two schedule tests became one test of the Trainer mapping.
    "tests/test_training_trainer.py::test_gradient_clipping_really_clips":
        "tests/test_training_trainer.py::test_recipe_maps_onto_training_arguments_and_the_schedule",
    "tests/test_training_trainer.py::test_lr_schedule_warmup_then_decay_to_floor":
        "tests/test_training_trainer.py::test_recipe_maps_onto_training_arguments_and_the_schedule",
}


def pytest_env(tree: Path) -> dict[str, str]:
    """The environment of one pytest run: the tree first on ``PYTHONPATH``, the TF4 tests skipped."""
    return {**os.environ, "PYTHONPATH": str(tree), "HF_POSEXT_SKIP_TF4": "1"}


def collect_ids(tree: Path) -> list[str]:
    """Every test id pytest collects in ``tree``, in collection order."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=tree,
                          env=pytest_env(tree), capture_output=True, text=True, check=False)
    return [line for line in done.stdout.splitlines() if "::" in line]


def map_ids(old_ids: list[str], new_ids: list[str]) -> tuple[list[str], list[str]]:
    """The new-tree ids of the old tests (deduplicated, in order) and the old ids with no counterpart."""
    present = set(new_ids)
    mapped, missing = [], []
    for old in old_ids:
        new = RENAMED.get(old, old)
        if new not in present:
            missing.append(old)
        elif new not in mapped:
            mapped.append(new)
    return mapped, missing


def junit_times(path: Path) -> dict[str, float]:
    """Per-test seconds (setup + call + teardown) from a junit XML file, keyed ``file::name``."""
    times = {}
    for case in ElementTree.parse(path).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        times[f"{module}::{case.get('name')}"] = float(case.get("time", 0))
    return times


def run_tests(tree: Path, ids: list[str], xml: Path) -> dict:
    """Run ``ids`` in ``tree`` in a fresh process; wall seconds, per-test seconds and the outcome line."""
    start, cpu_before = time.perf_counter(), _children_cpu_seconds()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                           *ids], cwd=tree, env=pytest_env(tree), capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - start, _children_cpu_seconds() - cpu_before
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "returncode": done.returncode, "summary": tail, "tests": junit_times(xml)}


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def slowdowns(old_runs: list[dict], new_runs: list[dict], mapping: dict[str, str], top: int) -> list[dict]:
    """The old tests whose median time grew the most in the new tree (seconds, both sides)."""
    rows = []
    for old_id, new_id in mapping.items():
        old = statistics.median(run["tests"].get(old_id, 0.0) for run in old_runs)
        new = statistics.median(run["tests"].get(new_id, 0.0) for run in new_runs)
        rows.append({"old": old_id, "new": new_id, "old_s": round(old, 2), "new_s": round(new, 2),
                     "delta_s": round(new - old, 2)})
    return sorted(rows, key=lambda row: -row["delta_s"])[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old-tree", type=Path, required=True, help="checkout of the old commit")
    parser.add_argument("--new-tree", type=Path, default=Path("."), help="checkout to compare (default: here)")
    parser.add_argument("--order", default="ONNO", help="run order, O = old tree, N = new tree (default ONNO)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--top", type=int, default=15, help="how many of the largest slowdowns to list")
    args = parser.parse_args(argv)
    old_tree, new_tree = args.old_tree.resolve(), args.new_tree.resolve()

    old_ids, new_ids = collect_ids(old_tree), collect_ids(new_tree)
    mapped, missing = map_ids(old_ids, new_ids)
    mapping = {old: RENAMED.get(old, old) for old in old_ids if old not in missing}
    runs: dict[str, list[dict]] = {"O": [], "N": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index, side in enumerate(args.order):
            tree, ids = (old_tree, old_ids) if side == "O" else (new_tree, mapped)
            run = run_tests(tree, ids, Path(scratch) / f"{index}.xml")
            runs[side].append(run)
            print(f"{side} wall {run['wall_s']:.1f} s, cpu {run['cpu_s']:.1f} s, tests {sum(run['tests'].values()):.1f} s: "
                  f"{run['summary']}", flush=True)
            result = summarize(runs, args, old_tree, new_tree, old_ids, new_ids, mapped, missing, mapping)
            write_json_atomic(args.out, result)
    print(f"new/old: {result['ratios_new_over_old']} -> {args.out}")
    return 0


def _median_ratio(runs: dict[str, list[dict]], measure) -> float | None:
    if not runs["O"] or not runs["N"]:
        return None
    old = statistics.median(measure(run) for run in runs["O"])
    new = statistics.median(measure(run) for run in runs["N"])
    return round(new / old, 3)


def summarize(runs, args, old_tree, new_tree, old_ids, new_ids, mapped, missing, mapping) -> dict:
    """The JSON record of the runs done so far (ratios are new over old, medians of each side's runs)."""
    return {
        "command": "python3 " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "old_tree": str(old_tree), "new_tree": str(new_tree), "order": args.order,
        "old_tests": len(old_ids), "mapped_tests": len(mapped), "old_tests_without_counterpart": missing,
        "new_tree_tests_total": len(new_ids),
        "cpu_s": {"old": [r["cpu_s"] for r in runs["O"]], "new": [r["cpu_s"] for r in runs["N"]]},
        "wall_s": {"old": [r["wall_s"] for r in runs["O"]], "new": [r["wall_s"] for r in runs["N"]]},
        "sum_of_test_times_s": {"old": [round(sum(r["tests"].values()), 2) for r in runs["O"]],
                                "new": [round(sum(r["tests"].values()), 2) for r in runs["N"]]},
        "summaries": {"old": [r["summary"] for r in runs["O"]], "new": [r["summary"] for r in runs["N"]]},
        "ratios_new_over_old": {
            "cpu": _median_ratio(runs, lambda run: run["cpu_s"]),
            "wall": _median_ratio(runs, lambda run: run["wall_s"]),
            "sum_of_test_times": _median_ratio(runs, lambda run: sum(run["tests"].values())),
        },
        "largest_slowdowns": slowdowns(runs["O"], runs["N"], mapping, args.top) if runs["O"] and runs["N"] else [],
        "per_test_median_s": {side: median_test_times(runs[key]) for side, key in (("old", "O"), ("new", "N"))},
    }


def median_test_times(runs: list[dict]) -> dict[str, float]:
    """Each test's median seconds over ``runs`` (a test missing from a run counts 0 there)."""
    names = sorted({name for run in runs for name in run["tests"]})
    return {name: round(statistics.median(run["tests"].get(name, 0.0) for run in runs), 3) for name in names}


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(path)


if __name__ == "__main__":
    sys.exit(main())
