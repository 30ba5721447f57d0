"""Correctness checks that only a GPU can run: the test suite's device-sensitive claims, on CUDA.

The test suite runs on CPU (CI has no GPU). This script repeats, on an accelerator, the checks whose
outcome depends on the device: rotary tables built where the model lives, Self-Extend's cached
generation against a full recompute (SDPA and eager, float32, tolerance 1e-4 as in the tests), its
SDPA and eager paths against each other, patch/unpatch restoring the exact logits, and a patch of a
bfloat16 model. Each check prints PASS or FAIL with its largest difference; the exit status is the
number of failures. Tiny models only: seconds on any GPU.

Usage:
    python bench/gpu_checks.py                 # cuda
    python bench/gpu_checks.py --device cpu    # the same checks on CPU (what the tests do)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import hf_posext
from hf_posext.evaluation.retrieval import _cache_argument, _returned_cache
from hf_posext.models import tiny_model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _cached_logits(model, ids, prefix: int, step: int):
    """Logits of ``ids`` computed as a prefix, then chunks of ``step`` tokens through the KV cache."""
    argument = _cache_argument(model)  # "cache" in newer transformers, "past_key_values" before
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, parts = _returned_cache(out), [out.logits]
        for start in range(prefix, ids.shape[1], step):
            out = model(ids[:, start : start + step], use_cache=True, **{argument: cache})
            cache, parts = _returned_cache(out), parts + [out.logits]
    return torch.cat(parts, 1)


def run_checks(device: str) -> list[dict]:
    results: list[dict] = []

    def record(name: str, difference: float, tolerance: float) -> None:
        results.append({"check": name, "max_abs_difference": difference, "tolerance": tolerance,
                        "passed": difference <= tolerance})
        print(f"{'PASS' if difference <= tolerance else 'FAIL'}  {name}: max |diff| {difference:.2e} (tolerance {tolerance:g})")

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (1, 120), generator=generator).to(device)

    for implementation in ("sdpa", "eager"):
        model = tiny_model("llama").to(device)
        model.set_attn_implementation(implementation)
        hf_posext.patch(model, "self-extend", group_size=3, window=10)
        full = _logits(model, ids)
        cached = _cached_logits(model, ids, prefix=90, step=10)
        record(f"self-extend {implementation}: cached generation vs full recompute",
               (cached - full).abs().max().item(), 1e-4)
        if implementation == "sdpa":
            sdpa_full = full
        else:
            record("self-extend: SDPA path vs eager path", (sdpa_full - full).abs().max().item(), 1e-4)

    for method, params in (("yarn", {"factor": 4}), ("dynamic-ntk", {"factor": 4}), ("llama3", {"factor": 4})):
        model = tiny_model("llama").to(device)
        before = _logits(model, ids)
        hf_posext.patch(model, method, **params)
        patched = _logits(model, ids)
        tables = [b.device.type for n, b in model.named_buffers() if "inv_freq" in n]
        record(f"{method}: rotary tables on the model's device ({sorted(set(tables))})",
               0.0 if tables and all(t == torch.device(device).type for t in tables) else 1.0, 0.0)
        record(f"{method}: patched logits finite", 0.0 if torch.isfinite(patched).all() else 1.0, 0.0)
        hf_posext.unpatch(model)
        record(f"{method}: unpatch restores the exact logits", (_logits(model, ids) - before).abs().max().item(), 0.0)

    model = tiny_model("llama").to(device=device, dtype=torch.bfloat16)
    reference = tiny_model("llama").to(device)
    hf_posext.patch(model, "yarn", factor=4)
    hf_posext.patch(reference, "yarn", factor=4)
    difference = (_logits(model, ids).float() - _logits(reference, ids)).abs().max().item()
    record("yarn on a bfloat16 model vs float32 (bf16 rounding)", difference, 0.1)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu (or mps) to run the checks elsewhere")
    results = run_checks(args.device)
    failures = sum(not r["passed"] for r in results)
    print(f"{len(results) - failures}/{len(results)} checks passed on {args.device}")
    if args.out:
        device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
        with open(args.out, "w") as handle:
            json.dump({"device": device_name, "torch": torch.__version__, "results": results}, handle, indent=1)
    return failures


if __name__ == "__main__":
    sys.exit(main())
