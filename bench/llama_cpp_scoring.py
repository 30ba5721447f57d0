"""What llama.cpp really serves: score each export with llama.cpp itself and with transformers, same token ids.

For each case a small position-sensitive Llama (random weights, ``initializer_range`` 0.1) is patched,
saved, exported for llama.cpp, converted to GGUF with llama.cpp's own converter (as bench/llama_cpp_roundtrip.py
does) and scored twice on the same random token ids, twice the original window long:

- by transformers, loading the exported folder (what transformers serves from it);
- by llama.cpp, through node-llama-cpp's prebuilt CPU binaries from npm (no C++ build; bench/llama_cpp_score.mjs).

Cases: none (the control), linear, ntk and yarn x2, and yarn x2 with beta_fast=16, beta_slow=2, which
``export --for llama.cpp`` refuses; its folder is written with :func:`hf_posext.export.export_config`, exactly what
the export would write without the refusal. That case is also compared with transformers' yarn at the default
betas 32/1, the model llama.cpp is expected to build instead (docs/serving.md, C2).

    python bench/llama_cpp_scoring.py [--json bench/results/llama_cpp_scoring/llama_cpp_scoring.json] [--threads 1]

Needs ``node`` (>= 20) and ``npm`` on PATH; installs node-llama-cpp into ``--cache`` on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp_roundtrip import convert, extract_converter, fetch_sdist, install_sentencepiece, tiny_sentencepiece  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCORER = REPO / "bench" / "llama_cpp_score.mjs"
CACHE = Path.home() / ".cache" / "hf_posext"
NODE_LLAMA_CPP = "3.22.1"
FACTOR = 2.0
#: A small Llama whose outputs depend on position: head_dim 64 gives yarn's ramp room (beta_fast and beta_slow
#: select different dimensions), and the larger initialisation makes attention sharp.
MODEL = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=512, initializer_range=0.1)
#: case -> (method, params, written even though export refuses it)
CASES = {
    "none": ("none", {}, False),
    "linear": ("linear", {}, False),
    "ntk": ("ntk", {}, False),
    "yarn": ("yarn", {}, False),
    "yarn-betas-16-2": ("yarn", {"beta_fast": 16.0, "beta_slow": 2.0}, True),
}
#: llama.cpp's KV cache types: F16 is its default (what users get), F32 isolates the scaling from rounding.
KV_CACHE_TYPES = ("F16", "F32")


def install_node_llama_cpp(cache: Path) -> Path:
    """node-llama-cpp with only this platform's CPU binaries, installed with npm into ``cache``."""
    home = cache / "node-llama-cpp"
    if (home / "node_modules" / "node-llama-cpp" / "dist" / "index.js").exists():
        return home
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise SystemExit("node and npm are needed (node >= 20): install them, e.g. apt-get install nodejs npm")
    arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    binaries = {"Linux": f"@node-llama-cpp/linux-{arch}", "Darwin": f"@node-llama-cpp/mac-{arch}"}.get(platform.system())
    packages = [f"node-llama-cpp@{NODE_LLAMA_CPP}"] + ([f"{binaries}@{NODE_LLAMA_CPP}"] if binaries else [])
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--prefix", str(home), "--omit=optional", "--ignore-scripts", "--no-audit",
                    "--no-fund", *packages], check=True)
    return home


def build_folder(case: str, work: Path, deps: Path) -> Path:
    """Patch the small Llama for ``case``, save it with a tokenizer, write its llama.cpp export folder."""
    import hf_posext
    from hf_posext.export import export, export_config
    from hf_posext.models import tiny_model

    method, params, refused = CASES[case]
    model = tiny_model("llama", **MODEL)
    if method != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_posext.patch(model, method, FACTOR, **params)
    saved = work / f"{case}-saved"
    model.save_pretrained(saved)
    tiny_sentencepiece(saved, model.config.vocab_size, deps, byte_fallback=True)
    out = work / f"{case}-llama.cpp"
    if not refused:
        return export(saved, "llama.cpp", out)
    shutil.copytree(saved, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(export_config(config, "llama.cpp"), indent=2))
    return out


def transformers_scores(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL and greedy token of the model transformers loads from ``folder`` (float32, eager)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(tokens[None]).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="none")
    return nll, logits.argmax(-1)


def default_betas_folder(work: Path) -> Path:
    """The yarn x2 model at the default betas 32/1, saved (what llama.cpp builds from the 16/2 export)."""
    return work / "yarn-saved"


def llama_cpp_scores(home: Path, gguf: Path, tokens: torch.Tensor, threads: int, kv_cache: str,
                     work: Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-token NLL and greedy token from llama.cpp (bench/llama_cpp_score.mjs), KV cache in ``kv_cache``."""
    request, result = work / "tokens.json", work / "scores.json"
    request.write_text(json.dumps({"tokens": tokens.tolist(), "threads": threads, "kv_cache": kv_cache}))
    subprocess.run(["node", str(SCORER), str(gguf), str(request), str(result)], check=True,
                   env={**os.environ, "NODE_LLAMA_CPP_DIR": str(home)})
    scores = json.loads(result.read_text())
    return torch.tensor(scores["nll"], dtype=torch.float64), torch.tensor(scores["top1"]), scores["llama_cpp"]


def compare(reference: tuple[torch.Tensor, torch.Tensor], served: tuple[torch.Tensor, torch.Tensor], window: int) -> dict:
    """Mean |dNLL| and top-1 agreement, overall and past the original window (predictions of positions > window)."""
    (nll_a, top_a), (nll_b, top_b) = reference, served
    delta = (nll_a - nll_b).abs()
    past = slice(window, None)
    return {"mean_abs_dnll": round(float(delta.mean()), 6), "max_abs_dnll": round(float(delta.max()), 6),
            "mean_abs_dnll_past_window": round(float(delta[past].mean()), 6),
            "top1_agreement": round(float((top_a == top_b).double().mean()), 6),
            "top1_agreement_past_window": round(float((top_a[past] == top_b[past]).double().mean()), 6)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the sdist and node-llama-cpp are kept")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args()
    start = time.perf_counter()
    converter_cache = args.cache / "llama_cpp"
    converter_cache.mkdir(parents=True, exist_ok=True)
    llama_cpp = extract_converter(fetch_sdist(converter_cache), converter_cache)
    deps = install_sentencepiece(converter_cache)
    home = install_node_llama_cpp(args.cache)
    window = MODEL["max_position_embeddings"]
    tokens = torch.randint(3, MODEL["vocab_size"], (int(window * FACTOR),), generator=torch.Generator().manual_seed(args.seed))
    cases, runtime = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for case in CASES:
            folder = build_folder(case, work, deps)
            reference = transformers_scores(folder, tokens)
            cases[case] = {"transformers_mean_nll": round(float(reference[0].mean()), 6)}
            default = transformers_scores(default_betas_folder(work), tokens) if CASES[case][2] else None
            gguf = convert(llama_cpp, folder, deps)
            for kv_cache in KV_CACHE_TYPES:
                served_nll, served_top, runtime = llama_cpp_scores(home, gguf, tokens, args.threads, kv_cache, work)
                row = {"llama_cpp_mean_nll": round(float(served_nll.mean()), 6),
                       "against_transformers": compare(reference, (served_nll, served_top), window)}
                if default is not None:
                    row["against_transformers_default_betas"] = compare(default, (served_nll, served_top), window)
                cases[case][f"kv_cache_{kv_cache}"] = row
                print(f"{case:>16}, KV cache {kv_cache}: mean |dNLL| {row['against_transformers']['mean_abs_dnll']:.6f}, "
                      f"top-1 past the window {row['against_transformers']['top1_agreement_past_window']:.4f}", flush=True)
    result = {"node_llama_cpp": NODE_LLAMA_CPP, "llama_cpp": {k: v for k, v in runtime.items() if k != "kv_cache"}, "converter": "llama-cpp-python 0.3.36 sdist",
              "model": MODEL, "factor": FACTOR, "tokens": len(tokens), "seed": args.seed,
              "total_s": round(time.perf_counter() - start, 1), "cases": cases}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    verdicts = check(cases)
    print("\n".join(verdicts))
    return 1 if any(v.startswith("UNEXPECTED") for v in verdicts) else 0


def check(cases: dict) -> list[str]:
    """Each exported case should agree with transformers about as well as the control (within 10x its mean
    |dNLL|) and the refused one should not (at least 100x): otherwise export's accept/refuse rule is wrong."""
    verdicts = []
    for kv_cache in KV_CACHE_TYPES:
        control = cases["none"][f"kv_cache_{kv_cache}"]["against_transformers"]["mean_abs_dnll"]
        for case, (_, _, refused) in CASES.items():
            delta = cases[case][f"kv_cache_{kv_cache}"]["against_transformers"]["mean_abs_dnll"]
            ratio = delta / max(control, 1e-12)
            expected = ratio >= 100 if refused else ratio <= 10
            verdicts.append(f"{'ok' if expected else 'UNEXPECTED'}: {case} ({'refused' if refused else 'exported'}), "
                            f"KV cache {kv_cache}: {ratio:.3g}x the control's mean |dNLL|")
    return verdicts


if __name__ == "__main__":
    sys.exit(main())
