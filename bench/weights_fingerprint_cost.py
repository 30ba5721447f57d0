"""Cost of the evaluation's weights fingerprint on a SmolLM2-135M-shaped model (random weights, CPU).

Builds a ``LlamaForCausalLM`` with SmolLM2-135M's shapes (hidden 576, 30 layers, 9 heads / 3 KV heads,
MLP 1536, vocabulary 49152, tied embeddings: 134.5M parameters) without the hub, and times
:func:`hf_posext.evaluation.fingerprints.weights_fingerprint` (sha256 over every element) and the older
:func:`~hf_posext.evaluation.fingerprints.sampled_weights_fingerprint` (65,536 strided elements per
parameter), best of ``--repeats`` runs, in float32 and bfloat16. Prints JSON and writes it to ``--json``.

Run:

    python bench/weights_fingerprint_cost.py --json bench/results/weights_fingerprint_cost/weights_fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    from hf_posext.evaluation import fingerprints  # noqa: E402


def smollm2_135m_shaped() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                      tie_word_embeddings=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def best_seconds(function, model, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function(model)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    model = smollm2_135m_shaped()
    parameters = sum(p.numel() for p in model.parameters())
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for function in (fingerprints.weights_fingerprint, fingerprints.sampled_weights_fingerprint):
            rows.append({"function": function.__name__, "dtype": str(dtype).removeprefix("torch."),
                         "megabytes": round(parameters * dtype.itemsize / 1e6),
                         "best_seconds": round(best_seconds(function, model, args.repeats), 3)})
    result = {"parameters": parameters, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
              "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
