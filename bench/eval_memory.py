#!/usr/bin/env python
"""Peak memory of one perplexity forward: hf_posext's chunked loss vs the naive ``model(ids, labels=ids)``.

Each (mode, length) runs in a fresh child process so its peak RSS (``ru_maxrss``) is its own; the
model-only RSS (weights loaded, no forward) is measured the same way and reported too. Results go to
a JSON file; re-running skips the measurements already in it (``--overwrite`` redoes them).

    python bench/eval_memory.py --lengths 8192,16384                 # docs/benchmarks.md's lengths (~6 min on 2 cores)
    python bench/eval_memory.py --lengths 2048,4096 --out bench/results/eval_memory/eval_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import json, resource, sys, time, torch
from hf_posext.evaluation.perplexity import chunked_nll
from hf_posext.evaluation.loading import load_model_and_tokenizer
mode, length, model_name, chunk = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
model, _ = load_model_and_tokenizer(model_name, device="cpu")
torch.manual_seed(0)
ids = torch.randint(0, model.config.vocab_size, (1, length))
began = time.time()
with torch.no_grad():
    if mode == "naive":
        nll = float(model(ids, labels=ids).loss) * (length - 1)
    elif mode == "chunked":
        nll = float(chunked_nll(model, ids, chunk)[0][0])
    else:
        nll = None
seconds = time.time() - began
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds, "nll_sum": nll}))
'''


def measure(mode: str, length: int, model: str, chunk: int) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, mode, str(length), model, str(chunk)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} at {length} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--out", default="bench/results/eval_memory/eval_memory.json")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() and not args.overwrite else {}
    results.setdefault("config", {"model": args.model, "chunk_size": args.chunk_size, "dtype": "float32", "device": "cpu",
                                  "command": " ".join(["python"] + sys.argv)})
    cells = results.setdefault("cells", {})
    for key, (mode, length) in [("model-only", ("none", 0))] + [(f"{m}@{n}", (m, n)) for n in map(int, args.lengths.split(",")) for m in ("naive", "chunked")]:
        if key in cells:
            continue
        began = time.time()
        cells[key] = {"mode": mode, "length": length, **measure(mode, max(length, 2), args.model, args.chunk_size)}
        print(f"{key}: peak RSS {cells[key]['peak_rss_mb']:.0f} MB ({time.time() - began:.0f} s)", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    lines = ["| length | naive peak RSS (MB) | chunked peak RSS (MB) | ratio | NLL difference |", "|---:|---:|---:|---:|---:|"]
    for n in sorted({c["length"] for c in cells.values() if c["mode"] == "chunked"}):
        naive, chunked = cells.get(f"naive@{n}"), cells.get(f"chunked@{n}")
        if naive and chunked:
            ratio = chunked["peak_rss_mb"] / naive["peak_rss_mb"]
            results.setdefault("ratios", {})[str(n)] = ratio
            lines.append(f"| {n} | {naive['peak_rss_mb']:.0f} | {chunked['peak_rss_mb']:.0f} | {ratio:.2f}x | "
                         f"{abs(naive['nll_sum'] - chunked['nll_sum']) / (n - 1):.1e} per token |")
    out.write_text(json.dumps(results, indent=1))
    print(f"model only: {cells['model-only']['peak_rss_mb']:.0f} MB\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
