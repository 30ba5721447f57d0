"""Forward-pass overhead of patching: unpatched vs each method, interleaved, median of N repeats.

The target is a ratio <= 1.01: a patched model does no extra work per token (rotary tables are built
once per forward at the model level, like transformers does, never per layer or per step). Also
reports the one-time cost of ``hf_posext.patch``. ``string`` and ``yarn+string`` (attention-level: past
STRING's offset its attention is split into fused calls merged by log-sum-exp) are in the same table: the
whole model's forward, where ``bench/string_cost.py`` times one attention call.

``--decode`` times one generation step instead: one new token against a KV cache of ``n`` keys per layer (random
keys and values: a step's cost depends on the shapes, not on what the cache holds, so no prefill is run), each
method's step after the unpatched one, interleaved, median of ``--repeats`` rounds of ``--steps`` steps.

Usage:
    python bench/patch_overhead.py                                  # SmolLM2, 2048 and 8192 tokens, CPU
    python bench/patch_overhead.py --decode --methods yarn,dynamic-ntk,yarn+string --dtype bfloat16 --lengths 4096,16384 \
        --profile --out bench/results/patch_overhead/decode_cpu.json     # one generation step at 16384 cached tokens
    python bench/patch_overhead.py --device cuda --lengths 2048,8192,16384 --repeats 7
    python bench/patch_overhead.py --methods string,yarn+string --dtype bfloat16 --lengths 8192 --repeats 3 \
        --out bench/results/patch_overhead/overhead_string_cpu.json      # the report card's headline method
Results: bench/results/patch_overhead/overhead_<device>.json and .md (the table printed at the end).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

    import hf_posext
    from hf_posext.models import load_model

# method -> keyword arguments for patch (factor 2 unless the method needs more).
METHODS = {
    "linear": {"factor": 2},
    "ntk": {"factor": 2},
    "dynamic-ntk": {"factor": 2},
    "yarn": {"factor": 2},
    "dynamic-yarn": {"factor": 2},
    "theta": {"factor": 2, "base": 1e6},
    "llama3": {"factor": 2},
    # attention-level: past STRING's offset S (a third of the window it is sized on: 2703 for string x2 on SmolLM2's
    # 8192, 10813 for yarn+string x4's 32768) its attention runs as several fused calls; below S it is the model's
    "string": {"factor": 2},
    "yarn+string": {"factor": 4},
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _forward_seconds(model, ids, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.model(ids)  # the decoder: where the rotary tables are built and used
    _sync(device)
    return time.perf_counter() - start


def _rotary_call_ms(model, length: int, calls: int = 50) -> float:
    """Mean milliseconds of one call of the decoder's rotary module (the only code patching changes)."""
    rotary = model.model.rotary_emb
    hidden = torch.zeros(1, length, model.config.hidden_size, dtype=model.dtype, device=model.device)
    positions = torch.arange(length, device=model.device)[None]
    with torch.no_grad():
        for _ in range(3):
            rotary(hidden, positions)
        _sync(str(model.device))
        start = time.perf_counter()
        for _ in range(calls):
            rotary(hidden, positions)
        _sync(str(model.device))
    return 1000 * (time.perf_counter() - start) / calls


def _filled_cache(model, length: int):
    """A KV cache of ``length`` random keys and values in every layer, shaped and typed like the model's own."""
    from transformers import DynamicCache

    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(length)
    cache = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(1, heads, length, head_dim, generator=generator).to(model.device, model.dtype) for _ in range(2))
        cache.update(keys, values, layer)
    return cache


def _decode_step_seconds(model, length: int, steps: int, device: str, trace=None) -> list[float]:
    """Seconds of each of ``steps`` generation steps (one token, attention mask included, as ``generate`` passes
    it) after a cache of ``length`` tokens; the step at position ``length + i`` sees ``length + i`` cached keys.
    A ``trace`` (``torch.profiler.profile``) records the steps only, not the filling of the cache."""
    import inspect

    cache = _filled_cache(model, length)
    # transformers 5.x calls the argument ``cache``; 4.x ``past_key_values``
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    token = torch.tensor([[1]], device=device)
    seconds = []
    if trace is not None:
        trace.start()
    with torch.no_grad():
        for step in range(steps):
            position = length + step
            mask = torch.ones(1, position + 1, dtype=torch.long, device=device)
            _sync(device)
            start = time.perf_counter()
            model(input_ids=token, attention_mask=mask, position_ids=torch.tensor([[position]], device=device), use_cache=True,
                  **{keyword: cache})
            _sync(device)
            seconds.append(time.perf_counter() - start)
    if trace is not None:
        trace.stop()
    return seconds


def decode_steps(model, methods: list[str], lengths: list[int], args: argparse.Namespace, command: str) -> int:
    """``--decode``: one generation step after ``n`` cached tokens, unpatched vs each method."""
    order = ["none", *methods]
    times: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lengths} for m in order}
    for n in lengths:  # warm-up
        _decode_step_seconds(model, n, 1, args.device)
    for repeat in range(args.repeats):
        rotated = order[repeat % len(order):] + order[: repeat % len(order)]
        for n in lengths:
            for method in rotated:
                _apply(model, None if method == "none" else method)
                times[method][n] += _decode_step_seconds(model, n, args.steps, args.device)
                print(f"repeat {repeat + 1}/{args.repeats} length {n} {method}: {1000 * statistics.median(times[method][n][-args.steps:]):.1f} ms a step",
                      file=sys.stderr)
    _apply(model, None)
    rows = [{"method": method, "length": n, "step_ms": 1000 * statistics.median(times[method][n]),
             "unpatched_step_ms": 1000 * statistics.median(times["none"][n])} for method in methods for n in lengths]
    for row in rows:
        row["ratio"] = row["step_ms"] / row["unpatched_step_ms"]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    out = Path(args.out or f"bench/results/patch_overhead/decode_{args.device.split(':')[0]}.json")
    result = {"model": args.model, "device": args.device, "device_name": device_name, "dtype": args.dtype, "repeats": args.repeats,
              "steps": args.steps, "lengths": lengths, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
              "raw_seconds": times, "command": command}
    lines = [f"One generation step of `{args.model}` after n cached tokens ({args.dtype}, {device_name}, {torch.get_num_threads()} threads), "
             f"median of {args.repeats} interleaved rounds of {args.steps} steps; ratio = patched / unpatched. Command: `{command}`", "",
             "| method | cached tokens | unpatched (ms) | patched (ms) | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['length']} | {r['unpatched_step_ms']:.1f} | {r['step_ms']:.1f} | {r['ratio']:.2f} |" for r in rows]
    if args.profile:
        result["profile"] = {}
        for method in ["none", *methods]:
            result["profile"][method] = _step_profile(model, None if method == "none" else method, lengths[-1], args)
            lines += ["", f"Where a step's time goes, {method if method != 'none' else 'unpatched'}, {lengths[-1]} cached tokens "
                      f"(torch.profiler, {args.steps} steps; self CPU time):", "", "| operation | calls | ms a step | share |", "|---|---|---|---|"]
            lines += [f"| `{op['name']}` | {op['calls']} | {op['ms_a_step']:.1f} | {op['share']:.0%} |" for op in result["profile"][method]]
        _apply(model, None)
    write_results(out, result, lines)
    return 0


def _step_profile(model, method: str | None, length: int, args: argparse.Namespace, top: int = 4) -> list[dict]:
    """The ``top`` operations by self CPU time over ``args.steps`` generation steps after ``length`` cached tokens."""
    from torch.profiler import profile

    _apply(model, method)
    trace = profile()
    _decode_step_seconds(model, length, args.steps, args.device, trace=trace)
    events = [e for e in trace.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"name": e.key, "calls": e.count, "ms_a_step": e.self_cpu_time_total / 1000 / args.steps,
             "share": e.self_cpu_time_total / total} for e in events[:top]]


def write_results(out: Path, result: dict, lines: list[str]) -> None:
    """Write ``result`` as JSON at ``out`` and the markdown ``lines`` next to it; print the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def rotary_only(model, methods: list[str], lengths: list[int], args: argparse.Namespace, command: str) -> int:
    """``--rotary-only``: time the rotary module alone, unpatched vs each method (seconds, not minutes)."""
    rows = []
    for n in lengths:
        _apply(model, None)
        base = _rotary_call_ms(model, n)
        for method in methods:
            _apply(model, method)
            rows.append({"method": method, "length": n, "unpatched_ms": base, "patched_ms": _rotary_call_ms(model, n)})
        _apply(model, None)
    out = Path(args.out or f"bench/results/patch_overhead/overhead_rotary_{args.device.split(':')[0]}.json")
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "rows": rows, "command": command}
    lines = [f"Rotary module call, mean of 50 (`{args.model}`, {args.dtype}, {args.device}, {torch.get_num_threads()} threads). "
             f"Command: `{command}`", "", "| method | length | unpatched (ms) | patched (ms) |", "|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['length']} | {r['unpatched_ms']:.3f} | {r['patched_ms']:.3f} |" for r in rows]
    write_results(out, result, lines)
    return 0


def _apply(model, method: str | None) -> float:
    """Unpatch, then patch with ``method`` (None: leave unpatched); return the patch call's seconds."""
    if "_hf_posext_state" in model.__dict__:
        hf_posext.unpatch(model)
    if method is None:
        return 0.0
    start = time.perf_counter()
    hf_posext.patch(model, method, **METHODS[method])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/patch_overhead/overhead_<device>.json)")
    parser.add_argument(
        "--random-weights", metavar="CONFIG_JSON",
        help="build the architecture from this config.json with random weights (same shapes, same cost: "
        "for machines without the checkpoint, e.g. bench/configs/smollm2-135m.json)",
    )
    parser.add_argument("--rotary-only", action="store_true",
                        help="time only the rotary module (what patching replaces): robust on a noisy CPU, takes seconds")
    parser.add_argument("--decode", action="store_true",
                        help="time one generation step after --lengths cached tokens (random cache, no prefill) instead of a forward")
    parser.add_argument("--steps", type=int, default=4, help="--decode: steps a round (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="--decode: also trace --steps steps at the last length per method (torch.profiler) and list the costliest operations")
    args = parser.parse_args(argv)
    command = "python bench/patch_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])

    methods = [m for m in args.methods.split(",") if m]
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.random_weights)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        args.model = f"{args.model} (random weights from {args.random_weights})"
    else:
        model = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.rotary_only:
        return rotary_only(model, methods, lengths, args, command)
    if args.decode:
        return decode_steps(model, methods, lengths, args, command)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    inputs = {n: torch.randint(0, vocab, (1, n), generator=generator).to(args.device) for n in lengths}

    times: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lengths} for m in ["none", *methods]}
    patch_seconds: dict[str, list[float]] = {m: [] for m in methods}
    for n in lengths:  # warm-up: allocator, kernels, thread pools
        _forward_seconds(model, inputs[n], args.device)
    order = ["none", *methods]
    for repeat in range(args.repeats):
        rotated = order[repeat % len(order):] + order[: repeat % len(order)]
        for n in lengths:
            for method in rotated:
                seconds = _apply(model, None if method == "none" else method)
                if method != "none":
                    patch_seconds[method].append(seconds)
                times[method][n].append(_forward_seconds(model, inputs[n], args.device))
                print(f"repeat {repeat + 1}/{args.repeats} length {n} {method}: {times[method][n][-1]:.3f}s", file=sys.stderr)
    if "_hf_posext_state" in model.__dict__:
        hf_posext.unpatch(model)

    rows = []
    for method in methods:
        for n in lengths:
            base = statistics.median(times["none"][n])
            median = statistics.median(times[method][n])
            rows.append({
                "method": method, "length": n, "median_s": median, "unpatched_median_s": base,
                "ratio": median / base, "patch_ms": 1000 * statistics.median(patch_seconds[method]),
                # fastest over fastest: less sensitive to a busy machine's slow runs than the medians
                "ratio_min": min(times[method][n]) / min(times["none"][n]),
            })
    result = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "repeats": args.repeats,
        "lengths": lengths, "torch": torch.__version__, "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "rows": rows, "raw_seconds": times,
        "command": command,
    }
    import transformers

    result["transformers"] = transformers.__version__
    out = Path(args.out or f"bench/results/patch_overhead/overhead_{args.device.split(':')[0]}.json")
    lines = [
        f"Forward time of `{args.model}` ({args.dtype}, {result['device_name']}), median of {args.repeats} interleaved runs; "
        f"ratio = patched / unpatched. Command: `{result['command']}`",
        "",
        "| method | length | unpatched (s) | patched (s) | ratio | ratio of fastest runs | patch() (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['length']} | {row['unpatched_median_s']:.4f} | {row['median_s']:.4f} | "
            f"{row['ratio']:.3f} | {row['ratio_min']:.3f} | {row['patch_ms']:.1f} |"
        )
    write_results(out, result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
