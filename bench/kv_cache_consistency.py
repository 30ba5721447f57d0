"""Dynamic scaling with a KV cache: hf-posext vs transformers' built-in ``dynamic`` rope type.

Generates past the original window with the cache, then recomputes the whole sequence without it and
reports the largest difference between the per-step logits and the recomputed ones. transformers'
built-in dynamic NTK changes the rotation of new queries once the length grows while the cached keys
keep the old one (transformers issue 25104); hf-posext fixes the length for the whole generation.

Usage:
    python bench/kv_cache_consistency.py --random-weights bench/configs/smollm2-135m.json --device cuda
    python bench/kv_cache_consistency.py --model smollm2-135m --prompt 8000 --new 300     # CPU: slow
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_posext
    from hf_posext.backends.rope.sites import rope_parameters, set_rope_parameters
    from hf_posext.models import load_model


def _max_step_difference(model, prompt: torch.Tensor, new_tokens: int) -> float:
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
        steps = torch.stack(out.logits, dim=1).float()
        # The full sequence (prompt + every generated token) is what the generation's fixed length covers.
        full = model(out.sequences, use_cache=False).logits[:, prompt.shape[1] - 1 : -1].float()
    return (steps - full).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--random-weights", metavar="CONFIG_JSON", help="architecture from a config.json, random weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", type=int, default=8000, help="prompt tokens (inside the window)")
    parser.add_argument("--new", type=int, default=400, help="generated tokens (crossing the window)")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--out", default="bench/results/kv_cache_consistency/kv_cache_consistency.json")
    args = parser.parse_args(argv)

    if args.random_weights:
        config = AutoConfig.from_pretrained(args.random_weights)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(args.device).eval()
    else:
        model = load_model(args.model, device=args.device)
    window = model.config.max_position_embeddings
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=generator).to(args.device)
    rows = []

    # Floor: the unpatched (static) model has no scale to get wrong, so its difference is what the
    # attention kernels alone give between a batched prefill and one-token decode steps.
    rows.append({"implementation": "unpatched (static rotation: kernel noise floor)", "max_abs_diff": _max_step_difference(model, prompt, args.new)})
    builtin_config = copy.deepcopy(model.config)
    params = {"rope_type": "dynamic", "factor": args.factor, "rope_theta": rope_parameters(model.config)["rope_theta"]}
    set_rope_parameters(builtin_config, params)
    builtin = AutoModelForCausalLM.from_config(builtin_config, dtype=torch.float32).to(args.device).eval()
    builtin.load_state_dict(model.state_dict())
    rows.append({"implementation": "transformers rope_type=dynamic", "max_abs_diff": _max_step_difference(builtin, prompt, args.new)})
    del builtin

    for method in ("dynamic-ntk", "dynamic-yarn"):
        hf_posext.patch(model, method, factor=args.factor)
        rows.append({"implementation": f"hf_posext {method}", "max_abs_diff": _max_step_difference(model, prompt, args.new)})
        hf_posext.unpatch(model)

    result = {
        "model": args.model if not args.random_weights else f"random weights from {args.random_weights}",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "window": window, "prompt_tokens": args.prompt, "new_tokens": args.new, "factor": args.factor,
        "rows": rows, "command": "python bench/kv_cache_consistency.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"cached generation vs no-cache recompute, {args.prompt}+{args.new} tokens, window {window}:")
    for row in rows:
        print(f"  {row['implementation']:<48} max |logit difference| = {row['max_abs_diff']:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
