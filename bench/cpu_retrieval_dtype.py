"""Is bfloat16 faster than float32 for retrieval on this CPU, with the same answers on the same trials?

Runs the same passkey trials (hf_posext.evaluation.passkey, one trial per depth) and the same RULER samples
(``hf-posext eval suite``, one task) once in float32 and once in bfloat16, one dtype after the other on the
same cores, and compares per trial: the greedy answer, whether it was found, and the seconds. RULER samples
come from the card's sample cache, so both dtypes read identical prompts; the card records prefill,
generation and harness seconds per sample.

Writes OUT/cpu_retrieval_dtype.json and OUT/cpu_retrieval_dtype.md. Each dtype's results stay in OUT/DTYPE/
(resumable: a rerun keeps finished trials and samples, with the seconds each one took when it ran).

    OMP_NUM_THREADS=2 python bench/cpu_retrieval_dtype.py --model runs/merged-run-retrieval-varied-yarn4 \
        --method string --factor 1 --length 16384 --ruler-task niah_single_1 --ruler-samples 3

Measure alone on the cores: the two dtypes run one after the other, so a load that changes between them
changes the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder or name (e.g. runs/merged-run-retrieval-varied-yarn4)")
    parser.add_argument("--method", default="string", help="method patched on the model (default: %(default)s)")
    parser.add_argument("--factor", type=float, default=1.0, help="its factor (default: %(default)s)")
    parser.add_argument("--length", type=int, default=16384, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--passkey-trials", type=int, default=1, help="passkey trials per depth, 5 depths (default: %(default)s)")
    parser.add_argument("--ruler-task", default="niah_single_1", help="RULER task (default: %(default)s)")
    parser.add_argument("--ruler-samples", type=int, default=3, help="RULER samples (default: %(default)s)")
    parser.add_argument("--sample-cache", default="bench/results/card/ruler-samples", help="RULER sample cache (default: %(default)s)")
    parser.add_argument("--out", default="bench/results/cpu_retrieval_dtype", help="results folder (default: %(default)s)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: passkey, ruler")
    return parser.parse_args(argv)


def run_passkey(args: argparse.Namespace, dtype: str) -> dict:
    from hf_posext.evaluation.arguments import parse_methods
    from hf_posext.evaluation.loading import load_model_and_tokenizer
    from hf_posext.evaluation.passkey import evaluate_passkey

    model, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype, device="cpu")
    (request,) = parse_methods(args.method)
    store = evaluate_passkey(model, tokenizer, methods=[request], lengths=[args.length], depths=DEPTHS, trials=args.passkey_trials,
                             factor=args.factor, out_dir=Path(args.out) / dtype, model_name=args.model,
                             extra_config={"dtype": dtype}, progress=False)
    trials = {}
    for record in store.cells.values():
        for key, unit in zip(record.get("unit_keys") or [], record.get("units") or []):
            trials[f"depth={float(key[2]):g},trial={int(key[3])}"] = {"found": bool(unit.get("greedy")), "value": unit["generated"],
                                                                     "seconds": unit["seconds"]}
    return {"trials": trials, "seconds_per_trial": sum(t["seconds"] for t in trials.values()) / max(1, len(trials))}


def run_ruler(args: argparse.Namespace, dtype: str) -> dict:
    out = Path(args.out) / dtype / "card"
    command = [sys.executable, "-m", "hf_posext.cli", "eval", "suite", "--models", f"{args.model}@{args.method}:{args.factor:g}",
               "--tasks", args.ruler_task, "--lengths", str(args.length), "--trials", str(args.ruler_samples),
               "--dtype", dtype, "--out", str(out), "--sample-cache", args.sample_cache, "--no-progress"]
    subprocess.run(command, check=True)
    samples = {}
    for path in sorted((out / "ruler").rglob("*.jsonl")):
        for line in path.read_text().splitlines()[1:]:
            record = json.loads(line)
            samples[str(record["doc_id"])] = {"score": record["score"], "response": record["response"], "timing": record["timing"],
                                              "generated_tokens": record["generated_tokens"]}
    return {"samples": samples}


def _answer(generated: str) -> str | None:
    """The number a passkey trial answered: the first integer of its generated text (as the scorer reads it)."""
    found = re.search(r"\d+", generated)
    return found.group(0) if found else None


def compare(results: dict) -> dict:
    first, second = (results[d] for d in DTYPES)
    summary: dict = {}
    if "passkey" in first and "passkey" in second:
        keys = sorted(set(first["passkey"]["trials"]) & set(second["passkey"]["trials"]))
        a, b = first["passkey"]["trials"], second["passkey"]["trials"]
        summary["passkey"] = {
            "trials": len(keys), "same_answer": sum(_answer(a[k]["value"]) == _answer(b[k]["value"]) for k in keys),
            "same_text": sum(a[k]["value"] == b[k]["value"] for k in keys),
            "found": {d: sum(results[d]["passkey"]["trials"][k]["found"] for k in keys) for d in DTYPES},
            "seconds_per_trial": {d: round(results[d]["passkey"]["seconds_per_trial"], 2) for d in DTYPES},
            "bfloat16_over_float32": round(second["passkey"]["seconds_per_trial"] / first["passkey"]["seconds_per_trial"], 3)}
    if "ruler" in first and "ruler" in second:
        a, b = first["ruler"]["samples"], second["ruler"]["samples"]
        keys = sorted(set(a) & set(b), key=int)
        mean = {d: {part: sum(results[d]["ruler"]["samples"][k]["timing"][part] for k in keys) / max(1, len(keys))
                    for part in ("prefill_s", "generate_s", "harness_s", "total_s")} for d in DTYPES}
        summary["ruler"] = {
            "samples": len(keys), "same_response": sum(a[k]["response"] == b[k]["response"] for k in keys),
            "score": {d: sum(results[d]["ruler"]["samples"][k]["score"] for k in keys) for d in DTYPES},
            "mean_seconds": {d: {p: round(v, 2) for p, v in mean[d].items()} for d in DTYPES},
            "bfloat16_over_float32": {p: round(mean["bfloat16"][p] / mean["float32"][p], 3) for p in mean["float32"] if mean["float32"][p]}}
    return summary


def markdown(record: dict) -> str:
    lines = [f"# bfloat16 against float32 on CPU, {record['model']} {record['method']} x{record['factor']:g} at {record['length']}", "",
             f"Measured {record['date']} on {record['cpus']} CPU cores ({record['threads']} threads), one dtype after the other.", "",
             "Same answer: the passkey trial's number (first integer generated), the RULER sample's whole response.", "",
             "| part | n | same answer | found / score (fp32, bf16) | seconds fp32 | seconds bf16 | bf16 / fp32 |", "|---|---|---|---|---|---|---|"]
    s = record["summary"]
    if "passkey" in s:
        p = s["passkey"]
        lines.append(f"| passkey trial | {p['trials']} | {p['same_answer']} | {p['found']['float32']}, {p['found']['bfloat16']} | "
                     f"{p['seconds_per_trial']['float32']} | {p['seconds_per_trial']['bfloat16']} | {p['bfloat16_over_float32']} |")
    if "ruler" in s:
        r = s["ruler"]
        for part in ("total_s", "prefill_s", "generate_s", "harness_s"):
            lines.append(f"| {record['ruler_task']} sample, {part[:-2]} | {r['samples']} | {r['same_response'] if part == 'total_s' else ''} | "
                         f"{(str(r['score']['float32']) + ', ' + str(r['score']['bfloat16'])) if part == 'total_s' else ''} | "
                         f"{r['mean_seconds']['float32'][part]} | {r['mean_seconds']['bfloat16'][part]} | {r['bfloat16_over_float32'].get(part, '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    results: dict = {d: {} for d in DTYPES}
    for dtype in DTYPES:
        if "passkey" not in skip:
            results[dtype]["passkey"] = run_passkey(args, dtype)
        if "ruler" not in skip:
            results[dtype]["ruler"] = run_ruler(args, dtype)
    record = {"model": args.model, "method": args.method, "factor": args.factor, "length": args.length, "ruler_task": args.ruler_task,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "threads": os.environ.get("OMP_NUM_THREADS", "default"), "summary": compare(results), "per_dtype": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("cpu_retrieval_dtype.json", json.dumps(record, indent=1)), ("cpu_retrieval_dtype.md", markdown(record))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
