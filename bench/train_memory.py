#!/usr/bin/env python
"""Peak memory of one training step on SmolLM2-135M: the plain loss (full logits) against the chunked loss.

Each (length, variant) runs in a fresh process: LoRA (rank 16 on q/k/v/o), gradient checkpointing,
float32, batch 1, one optimizer step, stopped before the final save; the parent records the child's
peak resident memory (``ru_maxrss``) and wall time. Variants:

- ``old``: the training package of commit a62e044 (the loop before the chunked loss), imported from a
  ``git worktree`` of that commit (``--old-tree``; created when missing);
- ``plain``: today's loop with ``train.loss=plain`` (``model(**batch).loss``);
- ``chunked``: today's loop with ``train.loss=chunked`` (the default).

    python bench/train_memory.py --lengths 4096,8192 [--variants old,plain,chunked] [--data ../shared/data/books]

Writes ``bench/results/train_memory_cpu.json`` (merging with what is there, so lengths can be added one
run at a time) and prints a table with the chunked/old ratio per length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "a62e044"

CHILD = r"""
import json, sys, time
from hf_posext.training.config import load_config
from hf_posext.training.trainer import train
overrides = json.loads(sys.argv[1])
config = load_config(None, overrides)
began = time.perf_counter()
train(config, stop_at_step=1, progress=False)
print("SECONDS", time.perf_counter() - began)
"""


def overrides(length: int, variant: str, data: str, out: str) -> list[str]:
    items = [
        "model.name=smollm2-135m", "model.precision=fp32", "model.attn_implementation=sdpa",
        "model.gradient_checkpointing=true", "scaling.method=yarn", "scaling.factor=4",
        "finetune.mode=lora", "finetune.rank=16", "finetune.alpha=32", "finetune.dropout=0.0",
        "finetune.train_embeddings=false", "finetune.train_norms=false",
        f"data.source={data}", f"data.window={length}", "data.pose=false", f"data.max_tokens={2 * length}",
        "train.max_steps=1", "train.batch_size=1", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
        f"output.dir={out}", "output.checkpoint_every=0",
    ]
    if variant in ("plain", "chunked"):
        items.append(f"train.loss={variant}")
    return items


def ensure_old_tree(path: Path) -> Path:
    if not (path / "hf_posext" / "training" / "trainer.py").exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), OLD_COMMIT], check=True)
    return path


def run_one(length: int, variant: str, data: str, old_tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(old_tree if variant == "old" else ROOT))
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        began = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides(length, variant, data, out + "/run"))],
                                env=env, capture_output=True, text=True)
        wall = time.perf_counter() - began
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if result.returncode != 0:
        raise RuntimeError(f"{variant} at {length} tokens failed:\n{result.stderr[-3000:]}")
    if peak_kib <= before:
        raise RuntimeError("ru_maxrss did not grow: run each measurement from a parent that ran nothing larger before")
    train_seconds = float(next(l.split()[1] for l in result.stdout.splitlines() if l.startswith("SECONDS")))
    return {"length": length, "variant": variant, "peak_rss_gib": round(peak_kib / 2**20, 3),
            "train_seconds": round(train_seconds, 1), "wall_seconds": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--variants", default="old,plain,chunked")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "books"))
    parser.add_argument("--old-tree", default=str(Path(tempfile.gettempdir()) / f"hf_posext_{OLD_COMMIT}"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_memory_cpu.json"))
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    unknown = set(variants) - {"old", "plain", "chunked"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from old, plain, chunked")
    if not Path(args.data).exists():
        parser.error(f"no such data folder: {args.data} (give --data a text file or folder)")
    old_tree = ensure_old_tree(Path(args.old_tree)) if "old" in variants else Path(args.old_tree)
    path = Path(args.out)
    results = json.loads(path.read_text())["results"] if path.exists() else []
    # Largest first within each length: ru_maxrss of children is a running maximum over all of them.
    for length in lengths:
        for variant in variants:
            print(f"{variant} at {length} tokens ...", flush=True)
            # A fresh parent per measurement keeps RUSAGE_CHILDREN's maximum to this child alone.
            child = subprocess.run([sys.executable, __file__, "--measure", str(length), variant, args.data, str(old_tree)],
                                   capture_output=True, text=True)
            if child.returncode != 0:
                print(child.stderr[-3000:], file=sys.stderr)
                return 1
            record = json.loads(child.stdout.strip().splitlines()[-1])
            record.update(command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
                          measured=time.strftime("%Y-%m-%d"), cpu_count=os.cpu_count())
            results = [r for r in results if (r["length"], r["variant"]) != (length, variant)] + [record]
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"results": sorted(results, key=lambda r: (r["length"], r["variant"]))}, indent=1))
            temporary.replace(path)
            print(json.dumps(record), flush=True)
    by = {(r["length"], r["variant"]): r for r in results}
    print("\n| tokens | " + " | ".join(f"{v} peak RSS (GiB)" for v in variants) + " | chunked / old |")
    print("|---:|" + "---:|" * (len(variants) + 1))
    for length in sorted({r["length"] for r in results}):
        cells = [f"{by[(length, v)]['peak_rss_gib']:.2f}" if (length, v) in by else "" for v in variants]
        ratio = (by[(length, "chunked")]["peak_rss_gib"] / by[(length, "old")]["peak_rss_gib"]
                 if (length, "chunked") in by and (length, "old") in by else None)
        print(f"| {length} | " + " | ".join(cells) + f" | {'' if ratio is None else f'{ratio:.2f}'} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        length, variant, data, old_tree = int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5])
        print(json.dumps(run_one(length, variant, data, old_tree)))
        sys.exit(0)
    sys.exit(main())
