#!/usr/bin/env python
"""Peak memory of torch's cross-entropy over full float32 logits, alone (no model): what any loss that
builds [tokens x vocabulary] logits must hold, as a reference for bench/train_memory.py.

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python bench/cross_entropy_memory.py --tokens 4096 --reduction mean

Prints the RSS above the inputs (hidden states and head weight): the forward peak, what stays held for
backward, and the backward peak (sampled every 1 ms). Run with a fixed glibc mmap threshold so that RSS
follows live memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_gib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--reduction", choices=("mean", "sum"), default="mean")
    args = parser.parse_args()
    peak = [0.0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_gib())
            time.sleep(0.001)

    threading.Thread(target=sample, daemon=True).start()
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    weight = torch.randn(args.vocab, args.hidden)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    time.sleep(0.05)
    base, peak[0] = rss_gib(), 0.0
    logits = hidden @ weight.t()
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction=args.reduction)
    del logits
    time.sleep(0.05)
    forward_peak, held, peak[0] = peak[0], rss_gib(), 0.0
    loss.backward()
    time.sleep(0.05)
    print(json.dumps({"tokens": args.tokens, "vocab": args.vocab, "reduction": args.reduction,
                      "logits_gib": round(args.tokens * args.vocab * 4 / 2**30, 3),
                      "forward_peak_above_inputs_gib": round(forward_peak - base, 3),
                      "held_for_backward_gib": round(held - base, 3),
                      "backward_peak_above_inputs_gib": round(peak[0] - base, 3)}))


if __name__ == "__main__":
    main()
