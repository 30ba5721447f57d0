#!/usr/bin/env python
"""Evaluated tokens per second: hf_posext's chunked perplexity vs a bare forward pass over the same tokens.

The bare forward is ``model(ids)`` (full logits, no loss): the least work any perplexity evaluation
can do. The two are interleaved ``--repeats`` times per length (so background load hits both alike)
and the median times compared. Results go to a JSON file; lengths already measured are skipped.

    python bench/eval_throughput.py --lengths 2048,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="bench/results/eval_throughput/eval_throughput.json")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    # after parse_args: `--help` answers without loading torch (tests/test_bench_help.py)
    from hf_posext.evaluation.perplexity import chunked_nll
    from hf_posext.evaluation.loading import load_model_and_tokenizer
    from hf_posext.evaluation.store import versions
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() and not args.overwrite else {}
    results.setdefault("config", {k: v for k, v in vars(args).items() if k != "overwrite"} | {"command": " ".join(["python"] + sys.argv)})
    results["versions"] = versions()
    cells = results.setdefault("cells", {})
    model, _ = load_model_and_tokenizer(args.model, dtype=args.dtype, device=args.device)
    torch.manual_seed(0)
    for length in map(int, args.lengths.split(",")):
        if str(length) in cells:
            continue
        ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device)
        bare, ours = [], []
        with torch.no_grad():
            model(ids[:, :256])  # warm-up
            for _ in range(args.repeats):
                began = time.perf_counter()
                model(ids)
                bare.append(time.perf_counter() - began)
                began = time.perf_counter()
                chunked_nll(model, ids, args.chunk_size)
                ours.append(time.perf_counter() - began)
        cell = {
            "bare_forward_seconds": bare, "chunked_perplexity_seconds": ours,
            "bare_tokens_per_second": length / statistics.median(bare), "ours_tokens_per_second": length / statistics.median(ours),
        }
        cell["ratio"] = cell["ours_tokens_per_second"] / cell["bare_tokens_per_second"]
        cells[str(length)] = cell
        print(f"{length}: bare {cell['bare_tokens_per_second']:.0f} tok/s, ours {cell['ours_tokens_per_second']:.0f} tok/s, ratio {cell['ratio']:.3f}", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
