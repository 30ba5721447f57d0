"""LongRoPE-style factor search on SmolLM2-135M (or any model), sized to finish within a time budget.

Runs :func:`hf_posext.search_factors` and writes the JSON that ``patch(model, "longrope", factors=...)``
reads. Every candidate costs ``--segments`` forward passes at ``--target-length`` tokens; the search
stops before a generation that would overrun ``--time-budget-minutes`` (estimated from the measured
time per candidate) and returns the best factors found so far. The JSON is rewritten after every
generation; ``--resume`` continues a stopped search without evaluating its candidates again.

Usage (the settings that fit an hour on 2 CPU cores; see docs/beyond_rescaling.md for the arithmetic):
    python bench/longrope_search.py                                   # 16384 tokens, 55-minute budget
    python bench/longrope_search.py --target-length 32768 --time-budget-minutes 240
    python bench/longrope_search.py --target-length 32768 --population 4 --parents 2 \
        --start-from bench/results/longrope_search/search_smollm2-135m_16384.json   # 4x seeded from the 2x search
    python bench/longrope_search.py --target-length 32768 --population 4 --parents 2 \
        --resume bench/results/longrope_search/search_smollm2-135m_32768.json      # more generations of that search
    accelerate launch --multi_gpu --num_processes 2 bench/longrope_search.py   # candidates split over 2 processes
    torchrun --nproc_per_node 2 bench/longrope_search.py --model tiny --target-length 128 --data text.txt  # smoke run
Then:
    hf-posext eval perplexity --model smollm2-135m --methods longrope --factor 2 \
        --param factors=bench/results/longrope_search/search_smollm2-135m_16384.json --lengths 8192,16384 --data /work/shared/data/books
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Calibration text: a book other than austen-emma.txt, the first file of the books folder and the text
# every perplexity table here is scored on, so searched factors are never scored on what they were fit to.
DEFAULT_BOOKS = ROOT.parent / "shared" / "data" / "books" / "austen-persuasion.txt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model name/folder, smollm2-135m, or tiny[:FAMILY[:WINDOW]]")
    parser.add_argument("--target-length", type=int, default=16384, help="length the factors are searched for (default: %(default)s)")
    parser.add_argument("--data", default=str(DEFAULT_BOOKS) if DEFAULT_BOOKS.is_file() else "builtin:python-docs",
                        help="calibration text: file, folder, dataset name or builtin:python-docs (default: %(default)s)")
    parser.add_argument("--segments", "--windows", dest="segments", type=int, default=1,
                        help="calibration segments per candidate (default: %(default)s; --windows is the old name)")
    parser.add_argument("--population", type=int, default=8, help="candidates per generation (default: %(default)s)")
    parser.add_argument("--generations", type=int, default=20, help="most generations after the first (default: %(default)s)")
    parser.add_argument("--parents", type=int, default=3, help="best candidates kept and bred from (default: %(default)s)")
    parser.add_argument("--time-budget-minutes", type=float, default=55.0, help="stop before overrunning this (default: %(default)s)")
    parser.add_argument("--start-from", action="append", metavar="JSON",
                        help="an earlier search's result (another scale) to seed the first generation; repeatable")
    parser.add_argument("--resume", metavar="JSON",
                        help="continue this search's result (same target and data): more generations, nothing re-evaluated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk-size", type=int, default=2048, help="positions per loss chunk (default: %(default)s)")
    parser.add_argument("--out", help="result JSON (default: bench/results/longrope_search/search_<model>_<target>.json)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)

    import torch

    from hf_posext.evaluation.loading import load_model_and_tokenizer
    from hf_posext.lm.distributed import Distributed
    from hf_posext.search import search_factors

    dist = Distributed()
    if dist.world_size > 1 and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.world_size))
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=dist.default_device())
    slug = args.model.replace("/", "_").replace(":", "-")
    out = Path(args.out or ROOT / "bench" / "results" / "longrope_search" / f"search_{slug}_{args.target_length}.json")
    result = search_factors(
        model, args.target_length, args.data, tokenizer=tokenizer, segments=args.segments, population=args.population,
        generations=args.generations, parents=args.parents, time_budget_s=args.time_budget_minutes * 60,
        seed=args.seed, chunk_size=args.chunk_size, output=out, progress=args.progress, start_from=args.start_from,
        resume=args.resume,
    )
    if dist.is_main:
        summary = {
            "model": args.model, "target_length": args.target_length, "evaluations": result.evaluations,
            "minutes": round(result.seconds / 60, 2), "best_ppl": round(result.best_ppl, 4),
            "initial_ppl": {k: round(v, 4) for k, v in result.to_dict()["initial_ppl"].items()},
            "processes": dist.world_size, "out": str(out),
        }
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
