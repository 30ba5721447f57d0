"""Seconds of one forward pass of SmolLM2-135M in float32 and in bfloat16 on this CPU (a quick check of whether
bfloat16 is native here: on AVX-512 BF16 / AMX it is faster, on AVX2 it is emulated and slower).

    OMP_NUM_THREADS=2 python bench/cpu_forward_dtype.py --length 4096

Measure alone on the cores. For the full retrieval comparison (same answers on paired trials) see
bench/cpu_retrieval_dtype.py.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name (default: %(default)s)")
    parser.add_argument("--length", type=int, default=4096, help="tokens in the forward pass (default: %(default)s)")
    args = parser.parse_args()

    import torch

    from hf_posext.evaluation.loading import cpu_has_native_bfloat16
    from hf_posext.models import load_model

    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bfloat16: {cpu_has_native_bfloat16()}, "
          f"threads {torch.get_num_threads()}")
    tokens = torch.randint(0, 1000, (1, args.length), generator=torch.Generator().manual_seed(0))
    seconds = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(args.model).to(getattr(torch, dtype)).eval()
        with torch.no_grad():
            model(tokens[:, :256])  # warm-up
            started = time.perf_counter()
            model(tokens)
            seconds[dtype] = time.perf_counter() - started
        print(f"{dtype}: {seconds[dtype]:.2f} s for {args.length} tokens", flush=True)
    print(f"bfloat16 / float32: {seconds['bfloat16'] / seconds['float32']:.2f}")


if __name__ == "__main__":
    main()
