"""What Self-Extend costs: forward and decode-step time against plain attention, same model, same input.

For each attention implementation (SDPA, eager) and length n, the decoder runs the same n tokens
unpatched and with Self-Extend (interleaved, median of ``--repeats``); then one decode step with a
KV cache of n tokens is timed the same way. Past the neighbour window W, Self-Extend computes the
attention scores explicitly in blocks (grouped scores for all earlier keys plus a band of neighbour
scores, and a re-rotation of q and k) instead of one fused SDPA call; this script measures what that
costs. Inside the window the two are the same computation.

With ``--attention-only`` it times one attention call instead of the model: transformers' SDPA
function against the registered Self-Extend function, on random q/k/v shaped like SmolLM2-135M's
layers (9 query heads, 3 key/value heads, head dim 64): the extra attention work in isolation.

Usage:
    python bench/self_extend_cost.py                                       # SmolLM2, 2048/8192/16384, G=3 W=2048
    python bench/self_extend_cost.py --attention-only --lengths 2048,4096 --window 512 --group-size 4
    python bench/self_extend_cost.py --lengths 1024,2048 --window 256 --group-size 4 --repeats 2   # small
    python bench/self_extend_cost.py --device cuda --lengths 8192,16384,32768
Results: bench/results/self_extend_cost/self_extend_cost_<device>.json and .md (the table printed at the end).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import count_operations, sync, timed  # noqa: E402  (bench/timing.py)

    import hf_posext
    from hf_posext.backends.attention import self_extend
    from hf_posext.evaluation.retrieval import _cache_argument, _returned_cache


def _set(model, patched: bool, group_size: int, window: int) -> None:
    if patched and not self_extend.is_patched(model):
        hf_posext.patch(model, "self-extend", group_size=group_size, neighbor_window=window)
    elif not patched and self_extend.is_patched(model):
        hf_posext.unpatch(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model name/folder, smollm2-135m or tiny[:FAMILY[:WINDOW]]")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--group-size", type=int, default=3, help="G (default %(default)s: SmolLM2 at 2x by the sizing rule)")
    parser.add_argument("--neighbor-window", "--window", dest="window", type=int, default=2048,
                        help="W, the neighbor window (default %(default)s; --window is its old spelling)")
    parser.add_argument("--implementations", default="sdpa,eager")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decode-step timing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", help="JSON path (default bench/results/self_extend_cost/self_extend_cost_<device>.json)")
    parser.add_argument("--attention-only", action="store_true", help="time one attention call (SmolLM2 shapes), not the model")
    args = parser.parse_args(argv)
    if args.attention_only:
        return _attention_only(args, argv)

    from hf_posext.evaluation.loading import load_model_and_tokenizer

    lengths = [int(n) for n in args.lengths.split(",") if n]
    implementations = [name for name in args.implementations.split(",") if name]
    model, _ = load_model_and_tokenizer(args.model, dtype=args.dtype, device=args.device)
    decoder = model.model
    generator = torch.Generator().manual_seed(0)
    inputs = {n: torch.randint(3, model.config.vocab_size, (1, n + 1), generator=generator).to(args.device) for n in lengths}
    rows = []
    for implementation in implementations:
        model.set_attn_implementation(implementation)
        for n in lengths:
            ids = inputs[n]
            forward = {False: [], True: []}
            step = {False: [], True: []}
            for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
                for patched in ((False, True) if repeat % 2 == 0 else (True, False)):
                    _set(model, patched, args.group_size, args.window)
                    forward_seconds = timed(lambda: decoder(ids[:, :n], use_cache=False), args.device)
                    if repeat:
                        forward[patched].append(forward_seconds)
                    if args.decode:
                        with torch.no_grad():
                            cache = _returned_cache(decoder(ids[:, :n], use_cache=True))
                        step_kwargs = {_cache_argument(decoder): cache, "use_cache": True}  # "cache" in newer transformers
                        seconds = timed(lambda: decoder(ids[:, n:], **step_kwargs), args.device)
                        if repeat:
                            step[patched].append(seconds)
                    label = "self-extend" if patched else "plain"
                    print(f"{implementation} n={n} {label} round {repeat}{' (warm-up)' if not repeat else ''}: forward {forward_seconds:.3f}s",
                          file=sys.stderr)
            _set(model, False, args.group_size, args.window)
            row = {
                "attn_implementation": implementation, "length": n,
                "plain_forward_s": statistics.median(forward[False]), "self_extend_forward_s": statistics.median(forward[True]),
            }
            row["forward_ratio"] = row["self_extend_forward_s"] / row["plain_forward_s"]
            if args.decode:
                row["plain_step_ms"] = 1000 * statistics.median(step[False])
                row["self_extend_step_ms"] = 1000 * statistics.median(step[True])
                row["step_ratio"] = row["self_extend_step_ms"] / row["plain_step_ms"]
            rows.append(row)
    import transformers

    result = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "group_size": args.group_size,
        "window": args.window, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows,
        "command": "python bench/self_extend_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out or f"bench/results/self_extend_cost/self_extend_cost_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [
        f"Self-Extend (G={args.group_size}, W={args.window}) vs plain attention, `{args.model}` ({args.dtype}, "
        f"{result['device_name']}, {result['threads']} threads), median of {args.repeats} interleaved runs. "
        f"Command: `{result['command']}`",
        "",
        "| attention | length | plain forward (s) | Self-Extend (s) | ratio | plain step (ms) | Self-Extend step (ms) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        decode = (f"{row['plain_step_ms']:.1f} | {row['self_extend_step_ms']:.1f} | {row['step_ratio']:.2f}"
                  if "step_ratio" in row else "- | - | -")
        lines.append(f"| {row['attn_implementation']} | {row['length']} | {row['plain_forward_s']:.3f} | "
                     f"{row['self_extend_forward_s']:.3f} | {row['forward_ratio']:.2f} | {decode} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


def _attention_only(args: argparse.Namespace, argv: list[str] | None) -> int:
    """One attention call, SDPA vs Self-Extend, SmolLM2-135M layer shapes (9 heads, 3 kv heads, dim 64)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from hf_posext.backends.attention.self_extend import SelfExtendLayerSettings, clear_decode_tables, self_extend_attention

    heads, kv_heads, dim = 9, 3, 64
    dtype = getattr(torch, args.dtype)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    module._hf_posext_self_extend = SelfExtendLayerSettings(inv_freq, dim, False, args.group_size, args.window, "sdpa")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in [int(v) for v in args.lengths.split(",") if v]:
        q = torch.randn(1, heads, n, dim, generator=generator).to(args.device, dtype)
        k = torch.randn(1, kv_heads, n, dim, generator=generator).to(args.device, dtype)
        v = torch.randn(1, kv_heads, n, dim, generator=generator).to(args.device, dtype)
        positions = torch.arange(n, device=args.device)[None]
        causal = torch.full((n, n), torch.finfo(dtype).min, device=args.device, dtype=dtype).triu(1)[None, None]
        last = positions[:, -1:]  # one tensor for every call, as a model passes each layer of a step
        calls = {
            "plain_forward": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=dim ** -0.5),
            "eager_forward": lambda: eager_attention_forward(module, q, k, v, causal, scaling=dim ** -0.5),
            "self_extend_forward": lambda: self_extend_attention(module, q, k, v, None, scaling=dim ** -0.5, position_ids=positions),
            "plain_step": lambda: sdpa_attention_forward(module, q[:, :, -1:], k, v, None, scaling=dim ** -0.5),
            "self_extend_step": lambda: self_extend_attention(module, q[:, :, -1:], k, v, None, scaling=dim ** -0.5,
                                                              position_ids=last),
        }

        def previous_step() -> None:
            # What generation does before the timed step: the layer saw the same keys minus the newest.
            with torch.no_grad():
                self_extend_attention(module, q[:, :, -2:-1], k[:, :, :-1], v[:, :, :-1], None, scaling=dim ** -0.5,
                                      position_ids=positions[:, -2:-1])

        times = {name: [] for name in calls}
        for repeat in range(args.repeats + 1):
            for name, call in (calls.items() if repeat % 2 == 0 else reversed(list(calls.items()))):
                if name == "self_extend_step":
                    previous_step()
                seconds = timed(call, args.device)
                if repeat:
                    times[name].append(seconds)
        row = {"length": n, **{f"{name}_ms": 1000 * statistics.median(values) for name, values in times.items()}}
        row["forward_ratio"] = row["self_extend_forward_ms"] / row["plain_forward_ms"]
        row["eager_ratio"] = row["self_extend_forward_ms"] / row["eager_forward_ms"]
        row["step_ratio"] = row["self_extend_step_ms"] / row["plain_step_ms"]
        # Operations per decode step (torch.profiler, bench/timing.py): the first layer of a step builds the
        # rotation factors and window mask that the other layers reuse.
        row["plain_step_kernels"] = count_operations(calls["plain_step"])["kernels"]
        previous_step()
        clear_decode_tables()
        first = count_operations(calls["self_extend_step"])
        counted = count_operations(calls["self_extend_step"])
        row["self_extend_step_first_layer_kernels"], row["self_extend_step_kernels"] = first["kernels"], counted["kernels"]
        row["self_extend_step_aten_ops"], row["self_extend_step_syncs"] = counted["aten"], counted["syncs"]
        row["self_extend_step_first_layer_syncs"] = first["syncs"]
        row["self_extend_step_kernel_names"] = counted["kernel_names"]
        rows.append(row)
    import transformers

    command = "python bench/self_extend_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "mode": "attention-only", "shapes": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim}, "device": args.device,
        "dtype": args.dtype, "group_size": args.group_size, "window": args.window, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "rows": rows, "command": command,
    }
    out = Path(args.out or f"bench/results/self_extend_cost/self_extend_cost_attention_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [
        f"One attention call, SmolLM2-135M shapes (9 heads, 3 kv heads, dim 64, {args.dtype}, {result['threads']} threads), "
        f"SDPA vs Self-Extend G={args.group_size} W={args.window}, median of {args.repeats}. Command: `{command}`",
        "",
        "| length | SDPA prefill (ms) | eager prefill (ms) | Self-Extend (ms) | vs SDPA | vs eager | SDPA decode step (ms) | Self-Extend step (ms) | ratio "
        "| step kernels SDPA / Self-Extend (first layer) | step host syncs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['length']} | {row['plain_forward_ms']:.1f} | {row['eager_forward_ms']:.1f} | "
                     f"{row['self_extend_forward_ms']:.1f} | {row['forward_ratio']:.2f} | {row['eager_ratio']:.2f} | {row['plain_step_ms']:.2f} | {row['self_extend_step_ms']:.2f} | "
                     f"{row['step_ratio']:.2f} | {row['plain_step_kernels']} / {row['self_extend_step_kernels']} "
                     f"({row['self_extend_step_first_layer_kernels']}) | {row['self_extend_step_syncs']} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
