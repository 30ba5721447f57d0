"""Peak memory of the training loss: plain full-logits cross-entropy against hf_posext.lm.chunked_loss.

Each measurement runs in a fresh process (peak RSS from getrusage, minus the RSS before the loss), forward
and backward of the loss alone on random final hidden states shaped like SmolLM2-135M (hidden 576,
vocabulary 49152, float32). Usage:

    python bench/chunked_loss_memory.py --tokens 8192 --out bench/results/chunked_loss_memory/chunked_loss_memory_cpu.json

The full-training memory comparison (SmolLM2-135M, LoRA, gradient checkpointing, old loop vs the
Trainer engine, 4k-32k tokens, longest sequence in 20 GB with and without sp_size=2) is not implemented yet.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HIDDEN, VOCAB = 576, 49152


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(kind: str, tokens: int, chunk_size: int) -> dict:
    """Forward+backward of one loss in this process; returns the memory and time it took."""
    import torch
    import torch.nn.functional as F

    from hf_posext.lm.chunked_loss import linear_cross_entropy, shift_labels

    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, HIDDEN, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, tokens))
    before = _current_rss_bytes()
    start = time.perf_counter()
    if kind == "plain":
        logits = (hidden @ weight.t()).float()
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:])
    else:
        loss = linear_cross_entropy(hidden, weight, shift_labels(labels), chunk_size=chunk_size)
    loss.backward()
    seconds = time.perf_counter() - start
    return {"kind": kind, "tokens": tokens, "vocab": VOCAB, "hidden": HIDDEN, "chunk_size": chunk_size,
            "loss": float(loss.detach()), "peak_rss_gb": _peak_rss_bytes() / 1e9,
            "peak_above_inputs_gb": (_peak_rss_bytes() - before) / 1e9, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--out", default=None, help="JSON file to write (atomically)")
    parser.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print(json.dumps(measure(options.child, options.tokens[0], options.chunk_size)))
        return 0
    rows = []
    for tokens in options.tokens:
        for kind in ("plain", "chunked"):
            command = [sys.executable, __file__, "--child", kind, "--tokens", str(tokens),
                       "--chunk-size", str(options.chunk_size)]
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]))
    result = {"command": "python bench/chunked_loss_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "note": "loss alone (forward+backward), fresh process each, 2 shared CPU cores", "rows": rows}
    if options.out:
        temporary = options.out + ".tmp"
        with open(temporary, "w") as handle:
            json.dump(result, handle, indent=2)
        os.replace(temporary, options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
