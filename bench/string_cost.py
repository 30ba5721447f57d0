"""What STRING costs: one attention call against SDPA, prefill and one decode step, in the same run.

Random q/k/v shaped like SmolLM2-135M's layers (9 query heads, 3 key/value heads, head dim 64), its RoPE
base 1e5 and the paper's defaults for its 8192-token window (shifted_offset S = int(0.33 * 8192) = 2703,
local_value w = 128). For each length n it times, interleaved, median of ``--repeats`` (a first round
warms up and is dropped):

- prefill: transformers' SDPA function, eager attention (``--no-eager`` skips its n x n scores) and the
  registered STRING function (three fused calls per query block merged by log-sum-exp, ``string_split``);
- one decode step (one query against n cached keys): SDPA and STRING (the registered function:
  ``string_explicit``, the query scored twice), with the operations one step runs counted by
  torch.profiler (bench/timing.py): aten operations, kernels (operations that compute or copy) and host
  synchronisations.

The target: STRING's prefill at most 2x SDPA's. The JSON is written after every length
and a rerun with the same settings skips the lengths already there (``--fresh`` starts over), so a run cut
short by a device's time limit resumes.

Usage:
    python bench/string_cost.py                                     # CPU, 8192,16384,32768
    python bench/string_cost.py --device cuda --no-eager --repeats 5 --dtype bfloat16
    python bench/string_cost.py --lengths 512,1024 --shifted-offset 168 --local-value 32 --repeats 1   # smoke
Results: bench/results/string_cost/string_cost_<device>.json and .md.
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
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's hf_posext, not an installed one
    from timing import count_operations, timed  # noqa: E402  (bench/timing.py)


def _settings(args) -> dict:
    return {"device": args.device, "dtype": args.dtype, "shifted_offset": args.shifted_offset,
            "local_value": args.local_value, "repeats": args.repeats, "eager": args.eager,
            **({"split_blocks": args.split_blocks} if args.split_blocks else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--shifted-offset", type=int, default=int(0.33 * 8192))
    parser.add_argument("--local-value", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip eager prefill (its n x n scores)")
    parser.add_argument("--split-blocks", default="",
                        help="also time string_split's prefill at these query-block sizes (comma-separated; the library's "
                             "default is shifted_positions.SPLIT_QUERY_BLOCK): many small blocks cost kernel launches on a GPU")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--fresh", action="store_true", help="ignore the lengths already in --out")
    parser.add_argument("--out", help="JSON path (default bench/results/string_cost/string_cost_<device>.json)")
    args = parser.parse_args(argv)
    # after parse_args: `--help` answers without loading torch (tests/test_bench_help.py)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward
    from hf_posext.backends.attention import shifted_positions
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --device cpu")
    if not 0 <= args.local_value < args.shifted_offset:
        parser.error(f"--local-value {args.local_value} must be >= 0 and below --shifted-offset {args.shifted_offset}")
    lengths = [int(v) for v in args.lengths.split(",") if v]
    out = Path(args.out or f"bench/results/string_cost/string_cost_{args.device.split(':')[0]}.json")

    import transformers

    command = "python bench/string_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    heads, kv_heads, dim = 9, 3, 64
    result = {
        "shapes": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim}, "device_name": device_name,
        **_settings(args), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "rows": [], "command": command,
    }
    if out.exists() and not args.fresh:
        previous = json.loads(out.read_text())
        if all(previous.get(key) == value for key, value in _settings(args).items()):
            result["rows"] = [row for row in previous.get("rows", []) if row["length"] in lengths]
            done = sorted(row["length"] for row in result["rows"])
            if done:
                print(f"resuming: lengths {done} already in {out}", file=sys.stderr)

    dtype = getattr(torch, args.dtype)
    scaling = dim ** -0.5
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    layer = module._hf_posext_string = shifted_positions.StringLayerSettings(
        inv_freq, dim, False, args.shifted_offset, args.local_value, 1.0, "sdpa")
    blocks = [int(v) for v in args.split_blocks.split(",") if v]
    generator = torch.Generator().manual_seed(0)
    for n in lengths:
        if any(row["length"] == n for row in result["rows"]):
            continue
        q = torch.randn(1, heads, n, dim, generator=generator).to(args.device, dtype)
        k = torch.randn(1, kv_heads, n, dim, generator=generator).to(args.device, dtype)
        v = torch.randn(1, kv_heads, n, dim, generator=generator).to(args.device, dtype)
        positions = torch.arange(n, device=args.device)[None]
        last = positions[:, -1:]
        calls = {
            "sdpa_prefill": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scaling),
            "string_prefill": lambda: shifted_positions.string_attention(module, q, k, v, None, scaling=scaling,
                                                                         position_ids=positions),
            "sdpa_step": lambda: sdpa_attention_forward(module, q[:, :, -1:], k, v, None, scaling=scaling),
            "string_step": lambda: shifted_positions.string_attention(module, q[:, :, -1:], k, v, None, scaling=scaling,
                                                                      position_ids=last),
        }
        for block in blocks:  # string_split alone (the registered function adds one host sync): prefill only
            calls[f"string_split_b{block}_prefill"] = (
                lambda block=block: shifted_positions.string_split(q, k, v, None, 0, layer, scaling, block=block))
        if args.eager:
            causal = torch.full((n, n), torch.finfo(dtype).min, device=args.device, dtype=dtype).triu(1)[None, None]
            calls["eager_prefill"] = lambda: eager_attention_forward(module, q, k, v, causal, scaling=scaling)
        times = {name: [] for name in calls}
        with torch.no_grad():
            for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
                for name, call in (calls.items() if repeat % 2 == 0 else reversed(list(calls.items()))):
                    seconds = timed(call, args.device)
                    if repeat:
                        times[name].append(seconds)
                print(f"n={n} round {repeat} done", file=sys.stderr)
            row = {"length": n, **{f"{name}_ms": 1000 * statistics.median(values) for name, values in times.items()}}
            for name in ("sdpa_step", "string_step"):
                counted = count_operations(calls[name])
                row[f"{name}_aten_ops"], row[f"{name}_kernels"], row[f"{name}_syncs"] = counted["aten"], counted["kernels"], counted["syncs"]
        for phase in ("prefill", "step"):
            row[f"string_{phase}_ratio"] = row[f"string_{phase}_ms"] / row[f"sdpa_{phase}_ms"]
        result["rows"] = sorted(result["rows"] + [row], key=lambda r: r["length"])
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".json.partial")
        partial.write_text(json.dumps(result, indent=2))
        partial.replace(out)  # atomic: a run cut short leaves the last complete file
        del q, k, v, calls

    def cell(row, key, digits):
        return f"{row[key]:.{digits}f}" if key in row else "-"

    lines = [
        f"One attention call, SmolLM2-135M shapes (9 heads, 3 kv heads, dim 64, {args.dtype}, {device_name}, "
        f"{result['threads']} threads): SDPA vs STRING (S = {args.shifted_offset}, w = {args.local_value}), median of "
        f"{args.repeats} interleaved. Command: `{command}`",
        "",
        "| length | SDPA prefill (ms) | eager prefill (ms) | STRING prefill (ms) | STRING / SDPA | SDPA step (ms) "
        "| STRING step (ms) | STRING / SDPA | step kernels SDPA / STRING | step host syncs STRING |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['length']} | {cell(row, 'sdpa_prefill_ms', 1)} | {cell(row, 'eager_prefill_ms', 1)} | "
            f"{cell(row, 'string_prefill_ms', 1)} | {cell(row, 'string_prefill_ratio', 2)} | {cell(row, 'sdpa_step_ms', 3)} | "
            f"{cell(row, 'string_step_ms', 3)} | {cell(row, 'string_step_ratio', 2)} | "
            f"{cell(row, 'sdpa_step_kernels', 0)} / {cell(row, 'string_step_kernels', 0)} | {cell(row, 'string_step_syncs', 0)} |"
        )
    blocks_timed = sorted({int(key[len("string_split_b"):-len("_prefill_ms")]) for row in result["rows"] for key in row
                           if key.startswith("string_split_b") and key.endswith("_prefill_ms")})
    if blocks_timed:
        lines += ["", "`string_split` prefill alone by query-block size (ms; a block is at most S queries):", "",
                  "| length | " + " | ".join(f"block {b}" for b in blocks_timed) + " |", "|---|" + "---|" * len(blocks_timed)]
        for row in result["rows"]:
            lines.append(f"| {row['length']} | " + " | ".join(cell(row, f"string_split_b{b}_prefill_ms", 1) for b in blocks_timed) + " |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
