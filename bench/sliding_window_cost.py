"""What one perplexity window costs on a model with sliding-window layers: banded against masked attention.

transformers computes a sliding-window layer as full T x T attention under a band mask; hf_posext's scoring
computes it banded (``hf_posext.backends.attention.sliding_window``: cost ~ T x window). For each length this
times one perplexity window (``hf_posext.lm.scoring.chunked_nll``: the forward pass plus the chunked loss,
whose chunk shrinks with the vocabulary), its CPU time (all threads; on a shared machine the wall time
stretches with the load, the CPU time much less) and its peak memory, each path in a fresh process, and puts
beside them the FLOP count of the attention and of the rest of the model. The masked path runs only up to
``--masked-max-length`` (it grows as T²). The input is random token ids (seeded): the cost does not depend on
the text, and both paths score the same ids, so their NLLs must agree.

Usage:
    nice python bench/sliding_window_cost.py --lengths 16384                      # gemma3-270m, float32, CPU
    nice python bench/sliding_window_cost.py --lengths 16384,32768,65536 --masked-max-length 16384
Results: bench/results/sliding_window_cost/sliding_window_cost_<device>.json and .md; every run is appended to
HISTORY.md there with its command and the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "sliding_window_cost"


def child(model_name: str, length: int, path: str, dtype: str, seed: int) -> dict:
    """One window in this process: seconds, peak RSS, NLL (run as ``--child``)."""
    import torch

    from hf_posext.lm.scoring import chunked_nll
    from hf_posext.models import load_model

    model = load_model(model_name, dtype=dtype)
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=generator)
    usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    nll, scored = chunked_nll(model, ids, banded=path == "banded")
    seconds, done = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = done.ru_utime + done.ru_stime - usage.ru_utime - usage.ru_stime
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_mb": done.ru_maxrss / 1024,
            "model_rss_mb": loaded_mb, "nll_per_token": float(nll[0]) / scored, "threads": torch.get_num_threads()}


def attention_child(model_name: str, length: int, path: str, dtype: str, seed: int) -> dict:
    """One sliding layer's attention call in this process (run as ``--child`` with ``--attention-only``): the
    model's shapes, random rotated q/k/v; banded kernel or transformers' SDPA under the mask it builds."""
    import torch
    from transformers import AutoConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from hf_posext.backends.attention.sliding_window import banded_attention
    from hf_posext.models import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(model_name))
    generator = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype)
    query = torch.randn(1, config.num_attention_heads, length, config.head_dim, generator=generator).to(kind)
    key, value = (torch.randn(1, config.num_key_value_heads, length, config.head_dim, generator=generator).to(kind)
                  for _ in range(2))
    window, scaling = config.sliding_window, config.query_pre_attn_scalar ** -0.5
    module = type("Layer", (), {"is_causal": True, "num_key_value_groups": config.num_attention_heads // config.num_key_value_heads,
                                "training": False})()
    usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with torch.no_grad():
        if path == "banded":
            banded_attention(query, key, value, window, scaling)
        else:  # as transformers computes the layer: the [T x T] band mask, then SDPA under it
            mask = sdpa_mask(batch_size=1, q_length=length, kv_length=length, mask_function=sliding_window_causal_mask_function(window),
                             local_size=window, allow_is_causal_skip=True)
            sdpa_attention_forward(module, query, key, value, mask, scaling=scaling)
    seconds, done = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "cpu_seconds": done.ru_utime + done.ru_stime - usage.ru_utime - usage.ru_stime,
            "peak_rss_mb": done.ru_maxrss / 1024, "model_rss_mb": 0.0, "nll_per_token": float("nan"),
            "threads": torch.get_num_threads()}


def flops(config, length: int, parameters: int) -> dict:
    """Multiply-adds x 2 of one window: the matrix products outside attention, and attention's QK and PV products
    per path (pairs of query and key scored)."""
    heads, head_dim, window = config.num_attention_heads, config.head_dim, config.sliding_window
    layer_types = list(config.layer_types)
    sliding, full = layer_types.count("sliding_attention"), layer_types.count("full_attention")
    per_pair = 4 * heads * head_dim  # QK^T and PV, 2 FLOPs per multiply-add
    head = 2 * config.vocab_size * config.hidden_size * length
    embedding = config.vocab_size * config.hidden_size
    causal_pairs = length * (length + 1) // 2  # the full layers (SDPA is_causal)
    needed_pairs = sum(min(p + 1, window) for p in range(length))
    block = window  # the kernel's default: queries per block
    banded_pairs = sum((min(s + block, length) - s) * (min(s + block, length) - max(0, s - window + 1))
                       for s in range(0, length, block))
    return {
        "linear": 2 * (parameters - embedding) * length, "output_head": head,
        "full_layers_attention": full * per_pair * causal_pairs,
        "sliding_layers_needed": sliding * per_pair * needed_pairs,
        "sliding_layers_banded": sliding * per_pair * banded_pairs,
        "sliding_layers_masked": sliding * per_pair * length * length,
    }


def _measure(args, length: int, path: str) -> dict:
    command = [sys.executable, __file__, "--child", path, "--lengths", str(length), "--model", args.model, "--dtype", args.dtype]
    command += ["--attention-only"] if args.attention_only else []
    load_before = os.getloadavg()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over --timeout {args.timeout} s", "load_before": load_before}
    if done.returncode != 0:
        how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return {"error": how + (f": {errors[-1].strip()}" if errors else ""), "load_before": load_before}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load_before": load_before, "load_after": os.getloadavg()}


def _table(rows: list[dict]) -> str:
    lines = ["| length | path | seconds | CPU seconds | peak RSS (GB) | model RSS (GB) | NLL/token | attention TFLOP (sliding + full) | other TFLOP | load before |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        f = row["flops"]
        sliding = f[f"sliding_layers_{row['path']}"]
        attention = f"{sliding / 1e12:.3g} + {f['full_layers_attention'] / 1e12:.3g}"
        other = (f["linear"] + f["output_head"]) / 1e12
        if "error" in row:
            lines.append(f"| {row['length']} | {row['path']} | {row['error']} | | | | | {attention} | {other:.3g} | |")
            continue
        lines.append(f"| {row['length']} | {row['path']} | {row['seconds']:.1f} | {row['cpu_seconds']:.1f} | {row['peak_rss_mb'] / 1024:.2f} | "
                     f"{row['model_rss_mb'] / 1024:.2f} | {row['nll_per_token']:.4f} | {attention} | {other:.3g} | "
                     f"{', '.join(f'{v:.1f}' for v in row['load_before'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="a model with sliding-window layers (default gemma3-270m)")
    parser.add_argument("--lengths", default="16384", help="comma-separated window lengths in tokens")
    parser.add_argument("--masked-max-length", type=int, default=16384,
                        help="run transformers' masked path only up to this length (it grows as T^2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one window may take")
    parser.add_argument("--out", help="JSON path (default bench/results/sliding_window_cost/sliding_window_cost_cpu.json)")
    parser.add_argument("--attention-only", action="store_true",
                        help="time one sliding layer's attention call (the model's shapes, random q/k/v) instead of a window")
    parser.add_argument("--child", choices=("banded", "masked"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [int(v) for v in args.lengths.split(",") if v]
    if args.child:
        measure = attention_child if args.attention_only else child
        print(json.dumps(measure(args.model, lengths[0], args.child, args.dtype, args.seed)))
        return 0
    from transformers import AutoConfig
    from safetensors import safe_open

    from hf_posext.models import resolve_model_path

    folder = resolve_model_path(args.model)
    config = AutoConfig.from_pretrained(folder)
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as weights:
        parameters = sum(_product(weights.get_slice(name).get_shape()) for name in weights.keys())
    rows = []
    for length in lengths:
        for path in ("banded", "masked") if length <= args.masked_max_length else ("banded",):
            row = {"length": length, "path": path, "flops": flops(config, length, parameters), **_measure(args, length, path)}
            if args.attention_only:  # one layer's attention: nothing else counted
                layers = list(config.layer_types).count("sliding_attention")
                row["flops"] = {key: (value // layers if key.startswith("sliding") else 0) for key, value in row["flops"].items()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "flops"}), file=sys.stderr)
    _write(args, argv, rows, parameters)
    return 0


def _product(shape) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def _write(args, argv, rows: list[dict], parameters: int) -> None:
    import torch
    import transformers

    command = "nice python bench/sliding_window_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{len(os.sched_getaffinity(0))} CPU cores ({platform.processor() or platform.machine()}), nice {os.nice(0)}"
    result = {"command": command, "date": when, "machine": machine, "model": args.model, "parameters": parameters,
              "measured": "one sliding layer's attention call" if args.attention_only else "one perplexity window (chunked_nll)",
              "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
              "input": f"random token ids, seed {args.seed}", "rows": rows}
    out = Path(args.out) if args.out else RESULTS / "sliding_window_cost_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for target, text in ((out, json.dumps(result, indent=2) + "\n"), (out.with_suffix(".md"), _table(rows) + "\n")):
        partial = target.with_name(target.name + ".partial")
        partial.write_text(text)
        partial.replace(target)
    history = out.parent / "HISTORY.md"
    what = "one sliding layer's attention call" if args.attention_only else "one perplexity window"
    entry = (f"\n## {when}, {machine}: {what}\n\n`{command}` ({args.model}, {args.dtype}; load average before each "
             f"measurement in the last column: 1, 5, 15 minutes)\n\n{_table(rows)}\n")
    if not history.exists():
        entry = "# What a perplexity window costs with banded sliding-window layers (`bench/sliding_window_cost.py`)\n" + entry
    with open(history, "a") as handle:
        handle.write(entry)


if __name__ == "__main__":
    sys.exit(main())
