"""Do the SmolLM2 two-stage recipes reproduce the committed runs? The first N logged losses of each stage, rerun.

The headline adapter (README.md) was trained in two stages whose run configs and logs are committed in
bench/results/finetune_retrieval_cpu/run-lr6e-4/ (stage 1: 200 steps of LoRA + PoSE on the books) and
run-retrieval-varied/ (stage 2: 50 steps of retrieval practice mixed with book text, started from the
stage-1 adapter committed in run-lr6e-4/adapter). This script runs the first ``--steps`` steps of each stage's
recipe (recipes/configs/smollm2-135m/32k-stage{1-books,2-lookups}-cpu.yaml) with
``hf-posext train --stop-at-step N``, which keeps the recipe's own learning-rate schedule and samples (a run
with ``train.max_steps=N`` would warm up and decay over N steps instead), and compares the logged losses and
learning rates with the committed logs. Stage 2 starts from the committed stage-1 adapter, as the committed
stage 2 did. It also lists every setting where the recipe differs from the committed train_config.yaml
(output.dir and finetune.init_adapter name folders, data.source the same books at their new place, so those
three are expected).

    OMP_NUM_THREADS=2 python bench/recipe_reproduction.py                  # both stages, 5 steps each
    python bench/recipe_reproduction.py --stages 2 --steps 3 --threads 1   # stage 2 only, on one thread

Output: a JSON record (default bench/results/finetune_retrieval_cpu/reproduction.json) with, per stage, the command,
the losses and learning rates rerun and committed, their largest absolute differences, the config
differences and the wall time; the date and the machine. Exit code 1 when a loss differs by more than
``--tolerance``. Cost: model load plus 5 steps a stage, about 5 minutes a stage on 2 idle cores (43-50 s a
step); far more on cores shared with other jobs (two threads waiting on a descheduled partner).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "bench" / "results" / "finetune_retrieval_cpu"
RECIPES = ROOT / "recipes" / "configs" / "smollm2-135m"
#: stage -> (recipe, committed run folder, extra overrides)
STAGES = {
    1: ("32k-stage1-books-cpu.yaml", "run-lr6e-4", []),
    2: ("32k-stage2-lookups-cpu.yaml", "run-retrieval-varied",
        ["finetune.init_adapter=bench/results/finetune_retrieval_cpu/run-lr6e-4/adapter"]),
}
#: Settings expected to differ from the committed run configs (folders; the books' new place).
EXPECTED_DIFFERENCES = ("output.dir", "finetune.init_adapter", "data.source")


def first_rows(log: Path, steps: int) -> list[dict]:
    """The first logged row of steps 1..``steps`` (a resumed run's log repeats steps; the first is the run's)."""
    rows: dict[int, dict] = {}
    for line in log.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "loss" in row and row.get("step") not in rows:
                rows[row["step"]] = row
    missing = [step for step in range(1, steps + 1) if step not in rows]
    if missing:
        raise SystemExit(f"{log} has no logged loss for step(s) {missing}")
    return [rows[step] for step in range(1, steps + 1)]


def config_changes(recipe: Path, overrides: list[str], committed: Path) -> list[str]:
    """Settings where the recipe (with ``overrides``) and the committed train_config.yaml differ."""
    from hf_posext.training.config import config_differences, load_config

    config = load_config(recipe, overrides)
    return config_differences(yaml.safe_load(committed.read_text()), config.to_dict())


def run_stage(stage: int, steps: int, work: Path, threads: int, reuse: bool = False) -> dict:
    """Run the first ``steps`` steps of one stage's recipe; its record (losses rerun and committed).

    With ``reuse``, the rerun's folder in ``work`` is read instead (a rerun made by this same command earlier,
    e.g. left running in the background); its ``train_config.yaml`` must be the recipe's.
    """
    recipe_name, run, extra = STAGES[stage]
    recipe = RECIPES / recipe_name
    out = work / f"stage{stage}"
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    overrides = [f"output.dir={shown}", *extra]
    command = ["hf-posext", "train", "--config", str(recipe.relative_to(ROOT)), "--stop-at-step", str(steps),
               "--no-progress", "--overwrite", *overrides]
    changes = config_changes(recipe, extra, COMMITTED / run / "train_config.yaml")
    unexpected = [c for c in changes if not c.startswith(EXPECTED_DIFFERENCES)]
    if unexpected:
        raise SystemExit(f"stage {stage}: {recipe_name} differs from {run}/train_config.yaml in {unexpected}; "
                         "fix the recipe before comparing losses")
    began = time.time()
    if reuse:
        saved = yaml.safe_load((out / "train_config.yaml").read_text())
        rerun_changes = config_changes(recipe, overrides, out / "train_config.yaml")
        if rerun_changes:
            raise SystemExit(f"--reuse: {out} was not run with {recipe_name}: {rerun_changes}")
        print(f"stage {stage}: reading the rerun in {out} (output.dir {saved['output']['dir']})", flush=True)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        print(f"stage {stage}: OMP_NUM_THREADS={threads} {' '.join(command)}", flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
    seconds = time.time() - began
    rerun = first_rows(out / "log.jsonl", steps)
    committed = first_rows(COMMITTED / run / "log.jsonl", steps)
    losses, committed_losses = [r["loss"] for r in rerun], [r["loss"] for r in committed]
    lrs, committed_lrs = [r["lr"] for r in rerun], [r["lr"] for r in committed]
    return {
        "recipe": str(recipe.relative_to(ROOT)),
        "committed_run": str((COMMITTED / run).relative_to(ROOT)),
        "command": " ".join(command),
        "omp_num_threads": threads,  # with --reuse: as --threads states it for the earlier rerun
        "config_differences": changes,
        "losses": losses,
        "committed_losses": committed_losses,
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(losses, committed_losses)),
        "learning_rates": lrs,
        "committed_learning_rates": committed_lrs,
        "max_abs_lr_difference": max(abs(a - b) for a, b in zip(lrs, committed_lrs)),
        "grad_norms": [r.get("grad_norm") for r in rerun],
        "committed_grad_norms": [r.get("grad_norm") for r in committed],
        "seconds_per_step": [r.get("seconds_per_step") for r in rerun],
        "wall_seconds": None if reuse else round(seconds, 1),
        "read_from_an_earlier_rerun": reuse,
    }


def machine() -> dict:
    """Where the rerun ran: enough to tell two machines' summation orders apart."""
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "load_average_at_end": load}


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="steps of each stage to rerun (default: %(default)s)")
    parser.add_argument("--stages", default="1,2", help="stages to rerun, comma-separated (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)),
                        help="torch threads, OMP_NUM_THREADS (default: the environment's, else 2, as the committed runs; "
                             "with --reuse, the count the earlier rerun had)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "recipe-reproduction",
                        help="run folders of the reruns (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest loss difference accepted (default: %(default)s; the same thread count should "
                             "reproduce to float32 rounding)")
    parser.add_argument("--out", type=Path, default=COMMITTED / "reproduction.json",
                        help="JSON record (default: %(default)s); the stages rerun replace theirs in it, others are kept")
    parser.add_argument("--note", action="append", default=[],
                        help="a finding to keep with the record (repeatable; notes of earlier writes are kept)")
    parser.add_argument("--reuse", action="store_true",
                        help="compare the reruns already in --work-dir (made by this command) instead of running them")
    args = parser.parse_args(argv)
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--stages {args.stages!r}: give stage numbers, e.g. 1,2")
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        parser.error(f"--stages {args.stages!r}: the stages are {', '.join(map(str, STAGES))}")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    records = {f"stage{s}": run_stage(s, args.steps, args.work_dir, args.threads, args.reuse) for s in stages}
    notes = list(args.note)
    if args.out.is_file():  # keep the stages not rerun this time, and the notes
        earlier = json.loads(args.out.read_text())
        kept = earlier.get("stages", {})
        records = {**{k: v for k, v in kept.items() if k not in records}, **records}
        records = dict(sorted(records.items()))
        notes = [*earlier.get("notes", []), *(note for note in notes if note not in earlier.get("notes", []))]
    worst = max(r["max_abs_loss_difference"] for r in records.values())
    result = {
        "question": "do the SmolLM2 two-stage recipes reproduce the committed runs' first logged losses?",
        "command": "python bench/recipe_reproduction.py (each stage's own command: stages.*.command)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "steps": args.steps,
        "tolerance": args.tolerance,
        "max_abs_loss_difference": worst,
        "reproduced": worst <= args.tolerance,
        "notes": notes,
        "stages": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, record in records.items():
        print(f"{name}: losses {[round(x, 6) for x in record['losses']]}, committed "
              f"{[round(x, 6) for x in record['committed_losses']]}, max |diff| {record['max_abs_loss_difference']:.2e}")
    print(f"wrote {args.out}")
    return 0 if result["reproduced"] else 1


if __name__ == "__main__":
    sys.exit(main())
