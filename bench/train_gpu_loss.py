#!/usr/bin/env python
"""Peak GPU memory and tokens/s of the SmolLM2 training recipe at long lengths: plain loss vs chunked vs Liger.

Runs the library's training engine (``hf_posext.training.train``: transformers' ``Trainer``) for a few
optimizer steps, each (mode, loss) in a fresh process, on one GPU in bfloat16 mixed precision:

- ``plain``: ``train.loss=plain``, the model's own loss over the full [tokens x vocabulary] logits;
- ``chunked``: ``train.loss=chunked`` (the default), :mod:`hf_posext.lm.chunked_loss`, no full logits;
- ``liger``: ``train.loss=plain`` with Liger's fused linear cross-entropy patched into transformers'
  Llama (``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)``, what the Trainer's
  ``use_liger_kernel`` does), when the ``liger-kernel`` package is installed.

Modes: ``lora`` (rank 16 on q/k/v/o) and ``full``, both with gradient checkpointing and yarn x4 on
SmolLM2-135M (window 8192 -> 32768). The child records ``torch.cuda.max_memory_allocated`` over the
whole run and the per-step wall time from the run's ``log.jsonl``; tokens/s is the mean over the steps
after the first (warm-up). Losses of the first step are printed so the variants can be compared.

    python bench/train_gpu_loss.py --data ../shared/data/books/austen-emma.txt --lengths 32768 \
        --out bench/results/train_gpu_loss/train_gpu_loss_cuda.json
    python bench/train_gpu_loss.py --device cpu --precision fp32 --lengths 512 --steps 2   # a smoke run

The longest sequence that trains within a memory limit on one GPU (``--longest``): a bisection over
multiples of ``--step`` (bench/longest.py), each probe a fresh process of two optimizer steps whose
allocator is capped at ``--limit-gb`` GB (``torch.cuda.set_per_process_memory_fraction``), so a probe
that needs more stops with CUDA's out-of-memory error; other errors stop the search. Written under
``longest`` in the ``--out`` JSON, one search per (mode, variant), resumable::

    python bench/train_gpu_loss.py --data ../shared/data/books/austen-emma.txt --longest --limit-gb 20 \
        --variants plain,chunked --modes lora --lo 32768 --hi 1048576 --step 8192 \
        --out bench/results/train_gpu_loss/train_longest_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from longest import bisect_longest, bounds  # noqa: E402  (bench/longest.py)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "chunked", "liger")
MODES = ("lora", "full")

CHILD = r"""
import json, sys, time
import torch
spec = json.loads(sys.argv[1])
if spec["variant"] == "liger":
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                fused_linear_cross_entropy=True)
from hf_posext.training.config import load_config
from hf_posext.training.trainer import train
config = load_config(None, spec["overrides"])
if torch.cuda.is_available():
    if spec.get("limit_bytes"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["limit_bytes"] / total))
    torch.cuda.reset_peak_memory_stats()
began = time.perf_counter()
result = train(config, stop_at_step=spec["steps"], progress=False)
seconds = time.perf_counter() - began
log = [json.loads(line) for line in open(spec["log"])]
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
reserved = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None
print("RESULT " + json.dumps({"peak_allocated_bytes": peak, "peak_reserved_bytes": reserved,
      "train_seconds": seconds, "steps": [{k: r.get(k) for k in ("step", "loss", "grad_norm", "seconds_per_step")} for r in log]}))
"""


def overrides(length: int, variant: str, mode: str, data: str, out: str, precision: str, steps: int) -> list[str]:
    """The recipe of one measurement as ``key=value`` overrides (defaults for everything else)."""
    items = [
        "model.name=smollm2-135m", f"model.precision={precision}", "model.attn_implementation=sdpa",
        "model.gradient_checkpointing=true", "scaling.method=yarn", "scaling.factor=4",
        f"finetune.mode={mode}", "finetune.train_embeddings=false", "finetune.train_norms=false",
        f"data.source={data}", f"data.sequence_length={length}", "data.pose=false", f"data.max_tokens={(steps + 1) * length}",
        f"train.max_steps={steps}", "train.batch_size=1", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
        f"train.loss={'chunked' if variant == 'chunked' else 'plain'}",
        f"output.dir={out}", "output.checkpoint_every=0", "output.log_every=1",
    ]
    if mode == "lora":
        items += ["finetune.rank=16", "finetune.alpha=32", "finetune.dropout=0.0"]
    return items


def measure(length: int, variant: str, mode: str, args: argparse.Namespace, limit_bytes: float | None = None) -> dict:
    """One fresh training process; returns its record (or the error it stopped with).

    ``limit_bytes``: cap the child's CUDA allocator there (``--longest``); a probe that needs more ends
    with an error record naming CUDA's out-of-memory error.
    """
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        spec = {"variant": variant, "steps": args.steps, "log": str(run / "log.jsonl"), "limit_bytes": limit_bytes,
                "overrides": overrides(length, variant, mode, args.data, str(run), args.precision, args.steps)}
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        began = time.perf_counter()
        child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - began
    record = {"length": length, "variant": variant, "mode": mode, "precision": args.precision,
              "wall_seconds": round(wall, 1)}
    line = next((l for l in child.stdout.splitlines() if l.startswith("RESULT ")), None)
    if child.returncode != 0 or line is None:
        tail = (child.stderr or child.stdout).strip().splitlines()
        record["error"] = next((l for l in reversed(tail) if l.strip()), f"exit {child.returncode}")[:500]
        return record
    data = json.loads(line[len("RESULT "):])
    steps = data["steps"]
    timed = [s["seconds_per_step"] for s in steps[1:] if s.get("seconds_per_step")] or \
        [s["seconds_per_step"] for s in steps if s.get("seconds_per_step")]
    seconds_per_step = sum(timed) / len(timed) if timed else None
    record.update(
        peak_allocated_gib=None if data["peak_allocated_bytes"] is None else round(data["peak_allocated_bytes"] / 2**30, 3),
        peak_reserved_gib=None if data["peak_reserved_bytes"] is None else round(data["peak_reserved_bytes"] / 2**30, 3),
        seconds_per_step=None if seconds_per_step is None else round(seconds_per_step, 4),
        tokens_per_second=None if not seconds_per_step else round(length / seconds_per_step, 1),
        first_loss=steps[0]["loss"] if steps else None,
        losses=[s["loss"] for s in steps], grad_norms=[s["grad_norm"] for s in steps],
    )
    return record


def out_of_memory(record: dict) -> bool:
    """Whether a record ended in CUDA's out-of-memory error (a probe over the limit), not another failure."""
    error = record.get("error", "")
    return "OutOfMemoryError" in error or "out of memory" in error.lower()


def measure_longest(args: argparse.Namespace, meta: dict, out: Path, modes: list[str], variants: list[str]) -> int:
    """``--longest``: for each (mode, variant) the longest multiple of ``--step`` that trains within
    ``--limit-gb``; earlier probes in ``out`` are reused. Returns 1 when a probe failed other than by memory."""
    limit = args.limit_gb * 1e9
    payload = json.loads(out.read_text()) if out.exists() else {}
    payload.update(meta)
    searches = payload.setdefault("longest", {})
    for mode in modes:
        for variant in variants:
            search = searches.setdefault(f"{mode}_{variant}_{args.limit_gb:g}GB", {"probes": []})
            search.update(mode=mode, variant=variant, limit_gb=args.limit_gb, precision=args.precision,
                          memory_counted="CUDA caching allocator, capped by set_per_process_memory_fraction",
                          **{k: meta[k] for k in ("command", "device", "torch") if k in meta})
            known = {p["length"]: p["fits"] for p in search["probes"]}

            def fits(length: int) -> bool:
                print(f"{mode} {variant} at {length} tokens within {args.limit_gb:g} GB ...", flush=True)
                record = measure(length, variant, mode, args, limit_bytes=limit)
                if "error" in record and not out_of_memory(record):
                    raise RuntimeError(f"{mode} {variant} at {length} tokens failed, not by memory: {record['error']}")
                record["fits"] = "error" not in record
                search["probes"] = [p for p in search["probes"] if p["length"] != length] + [record]
                known[length] = record["fits"]
                search["longest_fitting"], search["shortest_failing"] = bounds(args.lo, args.hi, args.step, known)
                write_json(out, payload)
                print(json.dumps(record), flush=True)
                return record["fits"]

            try:
                search["longest_fitting"], search["shortest_failing"] = bisect_longest(fits, args.lo, args.hi, args.step, known)
            except RuntimeError as error:
                print(error, file=sys.stderr)
                return 1
            write_json(out, payload)
            print(json.dumps({"mode": mode, "variant": variant, "longest_fitting": search["longest_fitting"],
                              "shortest_failing": search["shortest_failing"]}), flush=True)
    return 0


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)


def table(records: list[dict]) -> str:
    """Markdown: one row per (mode, length), memory and tokens/s per variant, ratios against plain."""
    rows = ["| mode | tokens | variant | peak GPU memory (GiB) | tokens/s | memory / plain | tokens/s / plain | first loss |",
            "|---|---:|---|---:|---:|---:|---:|---:|"]
    by = {(r["mode"], r["length"], r["variant"]): r for r in records}
    for r in records:
        base = by.get((r["mode"], r["length"], "plain"), {})
        if "error" in r:
            rows.append(f"| {r['mode']} | {r['length']} | {r['variant']} | failed: {r['error'][:80]} | | | | |")
            continue
        mem_ratio = (f"{r['peak_allocated_gib'] / base['peak_allocated_gib']:.2f}"
                     if base.get("peak_allocated_gib") and r.get("peak_allocated_gib") else "")
        speed_ratio = (f"{r['tokens_per_second'] / base['tokens_per_second']:.2f}"
                       if base.get("tokens_per_second") and r.get("tokens_per_second") else "")
        rows.append(f"| {r['mode']} | {r['length']} | {r['variant']} | {r.get('peak_allocated_gib')} | "
                    f"{r.get('tokens_per_second')} | {mem_ratio} | {speed_ratio} | {r.get('first_loss')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a text file or folder to train on")
    parser.add_argument("--lengths", default="32768")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_gpu_loss" / "train_gpu_loss_cuda.json"))
    parser.add_argument("--longest", action="store_true", help="bisect the longest length within --limit-gb")
    parser.add_argument("--limit-gb", type=float, default=20.0, help="--longest: GPU memory limit in GB (1e9 bytes)")
    parser.add_argument("--lo", type=int, default=32768, help="--longest: a length known to fit")
    parser.add_argument("--hi", type=int, default=1048576, help="--longest: the longest length to consider")
    parser.add_argument("--step", type=int, default=8192, help="--longest: lengths are multiples of this")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants, modes = args.variants.split(","), args.modes.split(",")
    if set(variants) - set(VARIANTS) or set(modes) - set(MODES):
        parser.error(f"--variants from {VARIANTS}, --modes from {MODES}")
    if not Path(args.data).exists():
        parser.error(f"no such data file or folder: {args.data}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
    if args.longest and args.device != "cuda":
        parser.error("--longest caps the CUDA allocator: it needs --device cuda")
    if args.longest and not (0 < args.lo <= args.hi and args.step > 0 and args.lo % args.step == 0):
        parser.error("--longest needs 0 < --lo <= --hi and --lo a multiple of --step (a length known to fit)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    meta = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import torch
        meta.update(torch=torch.__version__, device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    except Exception as error:  # noqa: BLE001 - metadata only
        meta["device_error"] = str(error)
    if args.longest:
        return measure_longest(args, meta, out, modes, variants)
    for length in lengths:
        for mode in modes:
            for variant in variants:
                print(f"{mode} {variant} at {length} tokens ...", flush=True)
                records.append(measure(length, variant, mode, args))
                print(json.dumps(records[-1]), flush=True)
                write_json(out, {**meta, "results": records})
    print("\n" + table(records))
    return 0 if all("error" not in r for r in records if r["variant"] != "liger") else 1


if __name__ == "__main__":
    sys.exit(main())
