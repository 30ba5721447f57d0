"""Training throughput of the Trainer engine against the former hand-written accelerate loop, interleaved.

    git worktree add /tmp/oldloop a62e044          # the last commit with the hand-written loop
    python3 bench/train_throughput.py --old-tree /tmp/oldloop --pairs 8

Each run is a fresh process (``recipes/finetune.py`` of that tree, its own PYTHONPATH) on the same recipe
(by default SmolLM2-135M, LoRA + PoSE, short windows so a step takes seconds on a CPU). Runs come in
old/new pairs whose order alternates (old-new, new-old, old-new, ...), so a drift in machine load
hits both sides alike. Per run, tokens/s is the tokens of one optimizer step divided by the median
wall time of the steps after the first (the first includes warm-up); the process CPU-seconds per step
are recorded too (less sensitive to other jobs on a shared machine), and so is the 1-minute load
average before and after each run. The result is the MEDIAN of the per-pair new/old ratios, with every
pair's ratio beside it; ``idle`` says whether every run started and ended with the load average under
the number of cores plus 0.5 (only then is the wall-clock ratio a clean measurement). Writes
``bench/results/train_throughput/train_throughput_cpu.json`` after every pair (an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = "recipes/configs/smollm2-135m/32k-books-24-steps-cpu.yaml"
DEFAULT_OVERRIDES = [
    f"data.source={REPO / 'data' / 'books'}", "data.sequence_length=512", "data.max_tokens=40000", "train.batch_size=1", "train.gradient_accumulation_steps=1",
    "train.max_steps=5", "train.warmup_steps=0", "output.checkpoint_every=0", "output.save_merged=false",
]


def run_once(tree: Path, recipe: str, overrides: list[str], out: Path) -> dict:
    """Train once with ``tree``'s code in a fresh process; return per-step timings from its log.jsonl."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(tree / "recipes" / "finetune.py"), "--config", str(REPO / recipe), *overrides,
               f"output.dir={out}", "--no-progress"]
    load_before = os.getloadavg()[0]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: training failed:\n{done.stderr[-3000:]}")
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steady = log[1:]
    seconds = statistics.median(r["seconds_per_step"] for r in steady)
    tokens_per_step = log[0]["tokens_seen"]
    return {
        "tree": str(tree), "wall_seconds": time.perf_counter() - began, "steps": len(log),
        "tokens_per_step": tokens_per_step, "median_seconds_per_step": seconds,
        "tokens_per_second": tokens_per_step / seconds,
        "median_process_cpu_seconds_per_step": statistics.median(r["process_cpu_seconds"] for r in steady),
        "losses": [r["loss"] for r in log],
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-tree", type=Path, required=True, help="a checkout of the hand-written loop (a62e044)")
    parser.add_argument("--pairs", "--repeats", dest="pairs", type=int, default=8, help="old/new pairs (order alternates)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "train_throughput" / "train_throughput_cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (default: a short SmolLM2 LoRA config)")
    args = parser.parse_args(argv)
    overrides = args.overrides or DEFAULT_OVERRIDES
    pairs = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.pairs):
            pair = {}
            order = (("old", args.old_tree.resolve()), ("new", REPO))
            for name, tree in order if repeat % 2 == 0 else order[::-1]:
                pair[name] = run_once(tree, args.recipe, overrides, Path(scratch) / f"{name}-{repeat}")
                print(name, repeat, f"{pair[name]['tokens_per_second']:.1f} tokens/s", flush=True)
            pair["ratio_tokens_per_second"] = pair["new"]["tokens_per_second"] / pair["old"]["tokens_per_second"]
            pair["ratio_cpu_seconds_per_step"] = (pair["new"]["median_process_cpu_seconds_per_step"]
                                                  / pair["old"]["median_process_cpu_seconds_per_step"])
            pair["order"] = "old-new" if repeat % 2 == 0 else "new-old"
            pairs.append(pair)
            write_result(args, overrides, pairs)  # after every pair: an interrupted benchmark keeps what it measured
    return 0


def write_result(args: argparse.Namespace, overrides: list[str], pairs: list[dict]) -> None:
    """Write the runs so far and their median new/old ratios to ``args.out`` (atomically)."""
    cores = os.cpu_count() or 1
    loads = [x for p in pairs for side in ("old", "new") for x in p[side]["load_average_1min"]]
    ratios = [p["ratio_tokens_per_second"] for p in pairs]
    result = {
        "command": "python3 bench/train_throughput.py " + " ".join(sys.argv[1:]),
        "recipe": args.recipe, "overrides": overrides, "cpu_count": cores,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1min_range": [min(loads), max(loads)],
        "idle": max(loads) < cores + 0.5,
        "target": "median new/old tokens/s ratio >= 0.95",
        "per_pair_ratio_tokens_per_second": [round(r, 3) for r in ratios],
        "per_pair_ratio_cpu_seconds_per_step": [round(p["ratio_cpu_seconds_per_step"], 3) for p in pairs],
        "median_ratio_tokens_per_second": statistics.median(ratios),
        "median_ratio_cpu_seconds_per_step": statistics.median(p["ratio_cpu_seconds_per_step"] for p in pairs),
        "pairs_at_or_above_0.95": sum(r >= 0.95 for r in ratios),
        "pairs": pairs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    temporary = args.out.with_name(f".{args.out.name}.tmp")
    temporary.write_text(json.dumps(result, indent=2))
    os.replace(temporary, args.out)
    print(json.dumps({k: result[k] for k in ("median_ratio_tokens_per_second", "median_ratio_cpu_seconds_per_step",
                                             "per_pair_ratio_tokens_per_second", "load_average_1min_range", "idle")}))


if __name__ == "__main__":
    sys.exit(main())
