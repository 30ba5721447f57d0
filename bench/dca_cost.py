"""What Dual Chunk Attention costs: one attention call against SDPA, prefill and one decode step.

Random q/k/v shaped like SmolLM2-135M's layers (9 query heads, 3 key/value heads, head dim 64), its
RoPE base 1e5 and ChunkLlama's defaults for its 8192-token window (chunk_size 6144, local_window 512:
chunks of 5632 tokens). For each length n it times, interleaved, median of ``--repeats``:

- prefill: transformers' SDPA function, eager attention, the registered DCA function (fused calls
  merged by log-sum-exp past one chunk) and Self-Extend (G=3, W=2048, for comparison);
- one decode step (one query against n cached keys): SDPA, DCA (the registered function, which runs
  ``dual_chunk_decode``), DCA's explicit pass (the decode step before it), Self-Extend (registered function:
  on CPU it reuses kept rotated keys) and Self-Extend's accelerator decode path ``self_extend_decode``,
  with the operations
  one step runs, counted by torch.profiler (bench/timing.py): aten operations called, the kernels among
  them (operations that compute or copy, not views), and host synchronisations.

Usage:
    python bench/dca_cost.py                                    # CPU, 8192,16384,32768
    python bench/dca_cost.py --device cuda --repeats 10         # a GPU
Results: bench/results/dca_cost/dca_cost_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import count_operations, sync, timed  # noqa: E402  (bench/timing.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--chunk-size", type=int, default=6144)
    parser.add_argument("--local-window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip eager prefill (its n x n scores)")
    parser.add_argument("--steps-only", action="store_true", help="time the decode steps only (many repeats are cheap)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's); 1 keeps a busy shared machine's "
                        "thread scheduling out of the many small kernels of a decode step")
    parser.add_argument("--out", help="JSON path (default bench/results/dca_cost/dca_cost_<device>.json)")
    args = parser.parse_args(argv)
    # after parse_args: `--help` answers without loading torch (tests/test_bench_help.py)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward
    from hf_posext.backends.attention import dual_chunk, self_extend
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --device cpu")

    heads, kv_heads, dim = 9, 3, 64
    dtype = getattr(torch, args.dtype)
    scaling = dim ** -0.5
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    module._hf_posext_dca = dual_chunk.DualChunkLayerSettings(inv_freq, dim, False, args.chunk_size, args.local_window, "sdpa")
    module._hf_posext_self_extend = self_extend.SelfExtendLayerSettings(inv_freq, dim, False, 3, 2048, "sdpa")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in [int(v) for v in args.lengths.split(",") if v]:
        q = torch.randn(1, heads, n, dim, generator=generator).to(args.device, dtype)
        k = torch.randn(1, kv_heads, n, dim, generator=generator).to(args.device, dtype)
        v = torch.randn(1, kv_heads, n, dim, generator=generator).to(args.device, dtype)
        positions = torch.arange(n, device=args.device)[None]
        last = positions[:, -1:]
        calls = {
            "sdpa_prefill": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scaling),
            "dca_prefill": lambda: dual_chunk.dual_chunk_attention(module, q, k, v, None, scaling=scaling, position_ids=positions),
            "self_extend_prefill": lambda: self_extend.self_extend_attention(module, q, k, v, None, scaling=scaling,
                                                                             position_ids=positions),
            "sdpa_step": lambda: sdpa_attention_forward(module, q[:, :, -1:], k, v, None, scaling=scaling),
            "dca_step": lambda: dual_chunk.dual_chunk_attention(module, q[:, :, -1:], k, v, None, scaling=scaling, position_ids=last),
            # The decode step before dual_chunk_decode: the explicit pass (the same function, ~40 kernels).
            "dca_explicit_step": lambda: dual_chunk.dual_chunk_explicit(q[:, :, -1:], k, v, None, last, positions,
                                                                        module._hf_posext_dca, scaling),
            "self_extend_step": lambda: self_extend.self_extend_attention(module, q[:, :, -1:], k, v, None, scaling=scaling,
                                                                          position_ids=last),
            # Self-Extend's accelerator decode step (on CPU the registered function reuses kept rotated keys).
            "self_extend_decode_step": lambda: self_extend.self_extend_decode(q[:, :, -1:], k, v, None, last,
                                                                              module._hf_posext_self_extend, scaling),
        }
        if args.steps_only:
            calls = {name: call for name, call in calls.items() if name.endswith("_step")}
        elif args.eager:
            causal = torch.full((n, n), torch.finfo(dtype).min, device=args.device, dtype=dtype).triu(1)[None, None]
            calls["eager_prefill"] = lambda: eager_attention_forward(module, q, k, v, causal, scaling=scaling)

        def previous_self_extend_step() -> None:
            # What generation does before a Self-Extend step: the layer saw the same keys minus the newest.
            with torch.no_grad():
                self_extend.self_extend_attention(module, q[:, :, -2:-1], k[:, :, :-1], v[:, :, :-1], None, scaling=scaling,
                                                  position_ids=positions[:, -2:-1])

        times = {name: [] for name in calls}
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for name, call in (calls.items() if repeat % 2 == 0 else reversed(list(calls.items()))):
                if name == "self_extend_step":
                    previous_self_extend_step()
                seconds = timed(call, args.device)
                if repeat:
                    times[name].append(seconds)
            print(f"n={n} round {repeat} done", file=sys.stderr)
        row = {"length": n, **{f"{name}_ms": 1000 * statistics.median(values) for name, values in times.items()}}
        for name, call in calls.items():
            if name.endswith("_step"):  # operations per decode step (torch.profiler): launch-bound or not
                if name == "self_extend_step":
                    previous_self_extend_step()
                if name in ("dca_step", "self_extend_decode_step"):  # a step's first layer builds the tables the others reuse
                    (dual_chunk if name == "dca_step" else self_extend).clear_decode_tables()
                    first = count_operations(call)
                    row[f"{name}_first_layer_kernels"], row[f"{name}_first_layer_aten_ops"] = first["kernels"], first["aten"]
                counted = count_operations(call)
                row[f"{name}_aten_ops"], row[f"{name}_kernels"], row[f"{name}_syncs"] = counted["aten"], counted["kernels"], counted["syncs"]
                row[f"{name}_kernel_names"] = counted["kernel_names"]
        for method in ("dca", "dca_explicit", "self_extend", "self_extend_decode"):
            for phase in ("prefill", "step"):
                if f"{method}_{phase}_ms" in row:
                    row[f"{method}_{phase}_ratio"] = row[f"{method}_{phase}_ms"] / row[f"sdpa_{phase}_ms"]
        rows.append(row)
        del q, k, v, calls
    import transformers

    command = "python bench/dca_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    result = {
        "shapes": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim}, "device": args.device, "device_name": device_name,
        "dtype": args.dtype, "chunk_size": args.chunk_size, "local_window": args.local_window, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "rows": rows, "command": command,
    }
    out = Path(args.out or f"bench/results/dca_cost/dca_cost_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [
        f"One attention call, SmolLM2-135M shapes (9 heads, 3 kv heads, dim 64, {args.dtype}, {device_name}, "
        f"{result['threads']} threads): SDPA vs DCA (chunk_size {args.chunk_size}, local_window {args.local_window}) "
        f"and Self-Extend (G=3, W=2048), median of {args.repeats} interleaved. Command: `{command}`",
        "",
        "| length | SDPA prefill (ms) | eager prefill (ms) | DCA prefill (ms) | DCA / SDPA | Self-Extend / SDPA "
        "| SDPA step (ms) | DCA step (ms) | DCA / SDPA | DCA explicit-pass step / SDPA | Self-Extend step (ms) "
        "| Self-Extend / SDPA | SE decode path / SDPA | step kernels SDPA / DCA (first layer) / DCA explicit / SE / SE decode path "
        "(first layer) | step host syncs DCA / SE / SE decode path |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def cell(row, key, digits):
        return f"{row[key]:.{digits}f}" if key in row else "-"

    for row in rows:
        lines.append(
            f"| {row['length']} | {cell(row, 'sdpa_prefill_ms', 1)} | {cell(row, 'eager_prefill_ms', 1)} | "
            f"{cell(row, 'dca_prefill_ms', 1)} | {cell(row, 'dca_prefill_ratio', 2)} | {cell(row, 'self_extend_prefill_ratio', 2)} | "
            f"{cell(row, 'sdpa_step_ms', 3)} | {cell(row, 'dca_step_ms', 3)} | {cell(row, 'dca_step_ratio', 2)} | "
            f"{cell(row, 'dca_explicit_step_ratio', 2)} | "
            f"{cell(row, 'self_extend_step_ms', 3)} | {cell(row, 'self_extend_step_ratio', 2)} | "
            f"{cell(row, 'self_extend_decode_step_ratio', 2)} | "
            f"{cell(row, 'sdpa_step_kernels', 0)} / {cell(row, 'dca_step_kernels', 0)} ({cell(row, 'dca_step_first_layer_kernels', 0)}) / "
            f"{cell(row, 'dca_explicit_step_kernels', 0)} / "
            f"{cell(row, 'self_extend_step_kernels', 0)} / {cell(row, 'self_extend_decode_step_kernels', 0)} "
            f"({cell(row, 'self_extend_decode_step_first_layer_kernels', 0)}) | "
            f"{cell(row, 'dca_step_syncs', 0)} / {cell(row, 'self_extend_step_syncs', 0)} / {cell(row, 'self_extend_decode_step_syncs', 0)} |"
        )
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
