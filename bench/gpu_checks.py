"""Correctness checks that only a GPU can run: the test suite's device-sensitive claims, on CUDA.

The test suite runs on CPU (CI has no GPU). This script repeats, on an accelerator, the checks whose
outcome depends on the device:

- Self-Extend's cached generation against a full recompute (SDPA and eager), and its SDPA path
  against its eager path;
- STRING's cached generation against a full recompute, its SDPA path (the prefill's fused calls merged by
  log-sum-exp) against its eager path (explicit scores), and ``unpatch`` giving back the exact logits;
- Dual Chunk Attention's cached generation against a full recompute (SDPA and eager: the prefill runs
  the fused calls merged by log-sum-exp — PyTorch's CUDA flash / memory-efficient kernels on a GPU —
  and the decode steps the explicit pass), its SDPA path against its eager path, and ``unpatch``
  giving back the exact logits;
- yarn, dynamic-ntk and llama3 logits against a model that transformers itself builds from the same
  ``rope_parameters`` on the device, and ``unpatch`` giving back the exact logits;
- a model cast to bfloat16 and then patched: its rotary cos/sin at positions up to 32768 equal the
  float32 tables rounded once to bfloat16 (what keeping the patched frequencies float32 promises).

Every check can fail. Each records, beside its tolerance, the *effect* it guards: how far the
compared quantity moves when the thing under test is absent or wrong (the unpatched logits, the
unscaled rotation, frequencies rounded to bfloat16). A check passes only when its difference is within
tolerance **and** the effect is at least 100x that tolerance, so a check that could not tell a broken
implementation from a working one fails instead of passing. The tiny models use a large init range
(0.1) so that their logits depend on position strongly. ``tests/test_bench_gpu_checks.py`` runs the
same checks on CPU and shows that broken variants fail.

Each check prints PASS or FAIL with its difference and margin; the exit status is the number of
failures. Tiny models only: seconds on any GPU.

Usage:
    python bench/gpu_checks.py                 # cuda
    python bench/gpu_checks.py --device cpu    # the same checks on CPU (what the tests do)
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Any

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_posext, installed or not
    import hf_posext
    from hf_posext.models import tiny_model

#: Initializer range of the tiny models: 0.1 makes yarn x4 move their logits by ~0.5 (0.02 gives 2e-3).
POSITION_SENSITIVE_INIT = 0.1
#: A check must guard an effect at least this many times its tolerance.
MINIMUM_MARGIN = 100.0
#: transformers' own rope_parameters for the frequency methods compared on the device.
STOCK_ROPE = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic-ntk": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}
#: Dual Chunk Attention on the 64-token tiny model: chunks of 24 - 4 = 20 tokens, so 120 tokens span six
#: chunks and every kind of position index (intra, successive, inter) is used.
DCA = {"factor": 4, "chunk_size": 24, "local_window": 4}
#: STRING on the 64-token tiny model: distances from 40 on shifted, so the 90-token prefix runs string_split in
#: blocks of 40 queries (the first one clamped at the first key, the others whole causal squares).
STRING = {"factor": 2, "shifted_offset": 40, "local_value": 8}


def position_sensitive_model(device: str, **overrides: Any) -> torch.nn.Module:
    return tiny_model("llama", initializer_range=POSITION_SENSITIVE_INIT, **overrides).to(device)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def cached_logits(model: torch.nn.Module, ids: torch.Tensor, prefix: int, step: int) -> torch.Tensor:
    """Logits of ``ids`` computed as a prefix, then chunks of ``step`` tokens through the KV cache."""
    # transformers 5.x renamed ``past_key_values`` to ``cache`` in some releases: ask the signature.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def returned(out):
        return out.get("cache") if out.get("cache") is not None else out.get("past_key_values")

    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        cache, parts = returned(out), [out.logits]
        for start in range(prefix, ids.shape[1], step):
            out = model(ids[:, start : start + step], use_cache=True, **{name: cache})
            cache, parts = returned(out), parts + [out.logits]
    return torch.cat(parts, 1).float()


def rotary_tables(model: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """cos and sin of the model's rotary module at ``positions``, in the model's dtype, as float32."""
    module = model.model.rotary_emb
    probe = torch.zeros(1, 1, dtype=next(model.parameters()).dtype, device=positions.device)
    with torch.no_grad():
        cos, sin = module(probe, positions[None])
    return torch.cat([cos, sin], -1).float()


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def run_checks(device: str) -> list[dict]:
    results: list[dict] = []

    def record(name: str, difference: float, effect: float, tolerance: float) -> None:
        margin = effect / tolerance if tolerance else float("inf") if effect > 0 else 0.0
        passed = difference <= tolerance and margin >= MINIMUM_MARGIN
        results.append({"check": name, "max_abs_difference": difference, "effect": effect, "tolerance": tolerance,
                        "margin": margin, "passed": passed})
        print(f"{'PASS' if passed else 'FAIL'}  {name}: max |diff| {difference:.2e} (tolerance {tolerance:g}; "
              f"effect guarded {effect:.2e}, {margin:.0f}x the tolerance)")

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (1, 120), generator=generator).to(device)

    # Each attention-level method: cached generation against a full recompute, and its SDPA path against its
    # eager path. For DCA the 90-token prefix runs the fused calls and the 10-token steps the explicit decode pass.
    # DCA also checks that unpatch restores the exact logits (Self-Extend's unpatch is checked in the tests).
    attention_methods = {
        "self-extend": ({"group_size": 3, "neighbor_window": 10}, "self-extend: SDPA path vs eager path", False),
        "dca": (DCA, "dca: SDPA path (fused calls, log-sum-exp merge) vs eager path (explicit scores)", True),
        "string": (STRING, "string: SDPA path (causal squares, log-sum-exp merge) vs eager path (explicit scores)", True),
    }
    for method, (settings, paths_check, check_unpatch) in attention_methods.items():
        by_implementation = {}
        for implementation in ("sdpa", "eager"):
            model = position_sensitive_model(device)
            model.set_attn_implementation(implementation)
            unpatched = logits(model, ids)
            hf_posext.patch(model, method, **settings)
            full = logits(model, ids)
            cached = cached_logits(model, ids, prefix=90, step=10)
            # A cache that ignored the method would give the unpatched logits on the cached steps.
            record(f"{method} {implementation}: cached generation vs full recompute",
                   max_difference(cached, full), max_difference(unpatched[:, 90:], full[:, 90:]), 1e-4)
            by_implementation[implementation] = full, unpatched
            if check_unpatch:
                hf_posext.unpatch(model)
                record(f"{method} {implementation}: unpatch restores the exact logits",
                       max_difference(logits(model, ids), unpatched), max_difference(unpatched, full), 0.0)
        (sdpa_full, sdpa_unpatched), (eager_full, _) = by_implementation["sdpa"], by_implementation["eager"]
        record(paths_check, max_difference(sdpa_full, eager_full), max_difference(sdpa_unpatched, eager_full), 1e-4)

    for method, rope in STOCK_ROPE.items():
        model = position_sensitive_model(device)
        before = logits(model, ids)
        hf_posext.patch(model, method, factor=4)
        patched = logits(model, ids)
        stock = position_sensitive_model(device, rope_parameters={"rope_theta": 10000.0, **rope})
        stock.load_state_dict(model.state_dict(), strict=False)
        record(f"{method}: patched logits vs transformers' own rope_parameters model",
               max_difference(patched, logits(stock, ids)), max_difference(before, patched), 1e-4)
        hf_posext.unpatch(model)
        # Exact restoration: tolerance 0, and the effect is the patch's own change of the logits.
        record(f"{method}: unpatch restores the exact logits", max_difference(logits(model, ids), before),
               max_difference(before, patched), 0.0)

    positions = torch.arange(0, 32768, 7, device=device)
    # Head dim 32 and SmolLM2's base 1e5: 16 frequencies, most of them not exact in bfloat16 (the
    # default tiny model's four are nearly powers of two, which bfloat16 holds exactly).
    wide = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2}
    reference = position_sensitive_model(device, **wide, rope_theta=1e5)
    hf_posext.patch(reference, "yarn", factor=4)
    expected = rotary_tables(reference, positions).to(torch.bfloat16).float()  # float32 tables, rounded once
    model = position_sensitive_model(device, **wide, rope_theta=1e5).to(torch.bfloat16)
    rounded_frequencies = position_sensitive_model(device, **wide, rope_parameters={
        "rope_theta": 1e5, **STOCK_ROPE["yarn"]}).to(torch.bfloat16)
    rounded_frequencies.model.rotary_emb.inv_freq.data = rounded_frequencies.model.rotary_emb.inv_freq.to(torch.bfloat16)
    hf_posext.patch(model, "yarn", factor=4)
    # bfloat16 has 8 significant bits: one unit in the last place for values in [0.5, 1) is 2**-8.
    record("yarn on a bfloat16-cast model: rotary cos/sin equal float32 tables rounded once",
           max_difference(rotary_tables(model, positions), expected),
           max_difference(rotary_tables(rounded_frequencies, positions), expected), 2.0**-8)
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
