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
        --out bench/results/train_gpu_loss_cuda.json
    python bench/train_gpu_loss.py --device cpu --precision fp32 --lengths 512 --steps 2   # a smoke run
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


def measure(length: int, variant: str, mode: str, args: argparse.Namespace) -> dict:
    """One fresh training process; returns its record (or the error it stopped with)."""
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        spec = {"variant": variant, "steps": args.steps, "log": str(run / "log.jsonl"),
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
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_gpu_loss_cuda.json"))
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants, modes = args.variants.split(","), args.modes.split(",")
    if set(variants) - set(VARIANTS) or set(modes) - set(MODES):
        parser.error(f"--variants from {VARIANTS}, --modes from {MODES}")
    if not Path(args.data).exists():
        parser.error(f"no such data file or folder: {args.data}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
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
    for length in lengths:
        for mode in modes:
            for variant in variants:
                print(f"{mode} {variant} at {length} tokens ...", flush=True)
                records.append(measure(length, variant, mode, args))
                print(json.dumps(records[-1]), flush=True)
                temporary = out.with_suffix(".tmp")
                temporary.write_text(json.dumps({**meta, "results": records}, indent=1))
                temporary.replace(out)
    print("\n" + table(records))
    return 0 if all("error" not in r for r in records if r["variant"] != "liger") else 1


if __name__ == "__main__":
    sys.exit(main())
