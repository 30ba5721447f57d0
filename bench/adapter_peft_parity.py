"""Does stock PEFT read a committed adapter as hf-posext loads it?

Loads the adapter twice on the same base: ``hf_posext.adapters.load_adapted_model(base, adapter)`` (the recorded
scaling applied, LoRA and the trained norms merged) and stock ``peft.PeftModel.from_pretrained`` on the base patched
with the adapter's recorded scaling (LoRA unmerged, the norms as PEFT ``modules_to_save``), then compares their
logits on ``--tokens`` seeded random token ids. The guarded effect is the adapter itself: the same logits from the
patched base without it. Prints JSON and writes it to ``--json``.

Run:

    python bench/adapter_peft_parity.py --adapter bench/results/finetune_retrieval_cpu/run-retrieval-aggregation/adapter \\
        --json bench/results/adapter_peft_parity/run-retrieval-aggregation.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="an adapter folder (OUT/adapter of a LoRA run)")
    parser.add_argument("--model", default="smollm2-135m", help="the base model (default: the embedded smollm2-135m)")
    parser.add_argument("--tokens", type=int, default=64, help="random token ids to score (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the JSON record here")
    args = parser.parse_args(argv)
    if not (Path(args.adapter) / "adapter_config.json").is_file():
        parser.error(f"--adapter {args.adapter}: no adapter_config.json there; pass a LoRA run's OUT/adapter folder")

    import torch
    from peft import PeftModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import hf_posext
    from hf_posext.adapters import load_adapted_model, read_adapter_record
    from hf_posext.models import load_model

    started = time.perf_counter()
    record = read_adapter_record(args.adapter)
    ids = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        ours = load_adapted_model(args.model, args.adapter).eval()(ids).logits
        base = load_model(args.model)
        hf_posext.patch(base, record.method, factor=record.factor, **record.params)
        without = base.eval()(ids).logits
        stock = PeftModel.from_pretrained(base, args.adapter).eval()(ids).logits
    result = {"adapter": args.adapter, "model": args.model, "scaling": record.scaling,
              "tokens": args.tokens, "seed": args.seed, "dtype": str(ours.dtype).replace("torch.", ""),
              "max_abs_diff_stock_peft": float((ours - stock).abs().max()),
              "max_abs_diff_without_adapter": float((ours - without).abs().max()),
              "max_abs_logit": float(ours.abs().max()), "seconds": round(time.perf_counter() - started, 1),
              "versions": {"torch": torch.__version__, "peft": __import__("peft").__version__,
                           "transformers": __import__("transformers").__version__}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        partial.write_text(text + "\n")
        os.replace(partial, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
