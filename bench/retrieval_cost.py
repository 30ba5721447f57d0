"""What one passkey or needle trial costs, against a bare forward of the same length in the same run.

The target: one trial at 32768 tokens in bfloat16 (the teacher-forced score plus a short greedy
answer with the KV cache, exactly what ``hf-posext eval passkey`` runs per prompt) in at most 0.5 s on one
H100 or H200, so that 50 trials per length and method cost under a minute.

For each method it times, with the model patched and warmed up (median of ``--repeats`` after one warm-up):

* ``forward``: the decoder over the prompt without a cache, plus the output head on the last position
  (the least any evaluation of that prompt can cost);
* ``teacher_forced``: :func:`hf_posext.evaluation.retrieval.score_retrieval` with ``generate=False``;
* ``trial``: the same with ``generate=True`` (prefill with the cache, the answer teacher-forced on it, then
  ``--max-new-tokens`` greedy steps): one trial of the evaluation.

Usage (GPU)::

    python bench/retrieval_cost.py --device cuda --dtype bfloat16 --lengths 32768 \
        --methods none,yarn,self-extend,dca --out bench/results/retrieval_cost/retrieval_cost_cuda.json

CPU smoke run on a tiny random model (seconds)::

    python bench/retrieval_cost.py --model tiny --lengths 512 --repeats 1 --out /tmp/retrieval_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import hf_posext  # noqa: E402
    from hf_posext.evaluation.passkey import build_passkey_prompt, draw_passkey  # noqa: E402
    from hf_posext.evaluation.retrieval import score_retrieval  # noqa: E402
    from hf_posext.lm.scoring import base_model, head_logits  # noqa: E402
    from timing import sync, timed  # noqa: E402


def load(model_name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer); ``tiny`` is a random 2-layer Llama with window 256 and a character tokenizer."""
    if model_name == "tiny":
        from hf_posext.evaluation.loading import AsciiTokenizer
        from hf_posext.models import tiny_model

        return tiny_model("llama", seed=0, max_position_embeddings=256).to(device=device, dtype=dtype).eval(), AsciiTokenizer()
    from hf_posext.models import load_model, load_tokenizer

    return load_model(model_name, dtype=dtype, device=device).eval(), load_tokenizer(model_name)


def measure(model, tokenizer, method: str, length: int, factor: float, device: str, repeats: int, max_new_tokens: int) -> dict:
    """Median seconds of a bare forward, a teacher-forced score and a whole trial at ``length`` under ``method``."""
    if method != "none":
        hf_posext.patch(model, method, factor)
    try:
        key = draw_passkey(0, length, 0.5, 0)
        prompt, answer = build_passkey_prompt(tokenizer, length - max_new_tokens, 0.5, key)
        decoder = base_model(model)
        ids = torch.tensor([prompt], device=device)

        def forward():
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            return head_logits(model, hidden[:, -1:])

        calls = {
            "forward": forward,
            "teacher_forced": lambda: score_retrieval(model, tokenizer, [prompt], [answer], [key], generate=False),
            "trial": lambda: score_retrieval(model, tokenizer, [prompt], [answer], [key], generate=True,
                                             max_new_tokens=max_new_tokens),
        }
        seconds = {}
        for name, call in calls.items():
            timed(call, device)  # warm-up: kernels, caches, allocator
            seconds[name] = statistics.median(timed(call, device) for _ in range(repeats))
        found = score_retrieval(model, tokenizer, [prompt], [answer], [key], generate=True, max_new_tokens=max_new_tokens)[0]
    finally:
        if method != "none":
            hf_posext.unpatch(model)
    return {"method": method, "factor": factor if method != "none" else 1.0, "length": length, **{f"{k}_s": round(v, 4) for k, v in seconds.items()},
            "trial_over_forward": round(seconds["trial"] / seconds["forward"], 3), "found": bool(found.get("greedy"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name, or 'tiny' for a CPU smoke run")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--lengths", default="32768", help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--methods", default="none,yarn,self-extend,dca", help="comma-separated methods")
    parser.add_argument("--factor", type=float, default=4.0, help="scale factor of every method but none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=10, help="greedy steps per trial (passkey's default)")
    parser.add_argument("--out", required=True, help="JSON file (rewritten after every measurement)")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu" and dtype != torch.float32:
        print("note: bfloat16 on CPU is slow and not what the target is about; use --dtype float32 there", file=sys.stderr)
    model, tokenizer = load(args.model, args.device, dtype)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report = {"model": args.model, "device": device_name, "dtype": args.dtype, "torch": torch.__version__,
              "command": "python bench/retrieval_cost.py " + " ".join(sys.argv[1:] if argv is None else argv), "rows": []}
    for length in (int(n) for n in args.lengths.split(",")):
        for method in args.methods.split(","):
            try:
                row = measure(model, tokenizer, method, length, args.factor, args.device, args.repeats, args.max_new_tokens)
            except torch.cuda.OutOfMemoryError as error:  # report and go on with the next method
                row = {"method": method, "length": length, "error": str(error).splitlines()[0]}
                torch.cuda.empty_cache()
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            temporary = out.with_suffix(".tmp")
            temporary.write_text(json.dumps(report, indent=1))
            temporary.replace(out)
            sync(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
