"""Which forms of the legacy RoPE fields three readers all read as the patched model.

For each method and rotary base, a tiny Llama is patched and saved plainly; then each candidate form of
the legacy fields (top-level ``rope_theta``, a ``rope_scaling`` copy, key order, ...) is written into a
copy of the folder and read by:

- ``tf5``: transformers 5.x ``AutoModelForCausalLM.from_pretrained`` (logits equal to the patched model's);
- ``generic``: transformers 5.x ``PreTrainedConfig.from_json_file`` (what ``Trainer`` runs when it resumes);
- ``tf457``: transformers 4.57 ``from_pretrained`` in ``--tf457-python`` (logits equal to the patched model's).

Usage::

    python bench/legacy_rope_fields.py --tf457-python .venv-tf457/bin/python \
        --json bench/results/legacy_rope_fields/legacy_rope_fields.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

L, FACTOR, SEQ, TOLERANCE = 64, 4.0, 200, 1e-4
METHODS = {"linear": {}, "ntk": {}, "dynamic-ntk": {}, "yarn": {}, "llama3": {},
           "longrope": {"long_factor": [1.0, 1.5, 3.0, 4.5]}}
THETAS = (10000.0, 50000.0)

TF457_SCRIPT = """
import json, sys, warnings, torch, transformers
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
from transformers import AutoModelForCausalLM
ids = torch.randint(0, 100, (1, int(sys.argv[1])), generator=torch.Generator().manual_seed(1))
result = {}
for folder in sys.argv[2:]:
    try:
        with torch.no_grad():
            torch.save(AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits, folder + "/tf457.pt")
        result[folder] = "ok"
    except Exception as error:
        result[folder] = f"{type(error).__name__}: {error}"[:200]
print(json.dumps({"version": transformers.__version__, "loads": result}))
"""


def legacy_variants(saved: dict) -> dict[str, dict]:
    """Candidate forms of the legacy fields for one ``config.json`` written by a patched model's ``save_pretrained``."""
    config = {key: value for key, value in saved.items()
              if key not in ("rope_scaling", "rope_theta", "original_max_position_embeddings")}
    params = config["rope_parameters"]
    window = {"original_max_position_embeddings": params["original_max_position_embeddings"]} \
        if "original_max_position_embeddings" in params else {}
    full = {**config, "rope_theta": params["rope_theta"], "rope_scaling": copy.deepcopy(params)}
    window_first = {key: config[key] for key in ("max_position_embeddings",)}
    window_first.update(window)
    window_first.update({key: value for key, value in full.items() if key not in window_first})
    legacy_type = {**full, "rope_scaling": {("type" if key == "rope_type" else key): value
                                            for key, value in params.items()}}
    return {
        "rope_parameters only (transformers 5 save)": config,
        "hf_posext save_pretrained (this tree)": saved,
        "theta+scaling": full,
        "theta+scaling+top-level window, window keys first": window_first,
        "theta+scaling+top-level original window": {**full, **window},
        "theta+scaling with 'type'": legacy_type,
        "scaling only (no top-level theta)": {**{k: v for k, v in full.items() if k != "rope_theta"}, **window},
    }


def generic_read(path: Path) -> str:
    from transformers import PreTrainedConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            PreTrainedConfig.from_json_file(path)
        return "ok"
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:200]


def logits_of(model) -> torch.Tensor:
    ids = torch.randint(0, 100, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tf457-python", required=True, help="a python with transformers 4.57 (and torch)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    # after parse_args: `--help` answers without loading torch (tests/test_bench_help.py)
    import hf_posext
    from hf_posext.models import tiny_model
    from transformers import AutoModelForCausalLM
    root = Path(tempfile.mkdtemp(prefix="legacy_rope_fields."))
    rows, expected = [], {}
    for theta in THETAS:
        for method, kwargs in METHODS.items():
            model = tiny_model("llama", initializer_range=0.1, max_position_embeddings=L, rope_theta=theta).eval()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf_posext.patch(model, method, FACTOR, **kwargs)
                plain = root / f"{method}-{theta:g}-plain-save"
                model.save_pretrained(plain)
            patched = logits_of(model)
            config = json.loads((plain / "config.json").read_text())
            for name, variant in legacy_variants(config).items():
                folder = root / f"{method}-{theta:g}-{len(rows)}"
                shutil.copytree(plain, folder)
                (folder / "config.json").write_text(json.dumps(variant, indent=2))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    stock = AutoModelForCausalLM.from_pretrained(folder).eval()
                tf5 = (logits_of(stock) - patched).abs().max().item()
                rows.append({"method": method, "theta": theta, "form": name, "folder": str(folder),
                             "tf5_max_diff": tf5, "generic": generic_read(folder / "config.json")})
                expected[str(folder)] = patched
    result = subprocess.run([args.tf457_python, "-c", TF457_SCRIPT, str(SEQ), *expected], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": ""}, check=True)
    tf457 = json.loads(result.stdout.strip().splitlines()[-1])
    for row in rows:
        folder = row.pop("folder")
        status = tf457["loads"][folder]
        row["tf457_max_diff"] = (torch.load(Path(folder) / "tf457.pt") - expected[folder]).abs().max().item() \
            if status == "ok" else status
        row["all_three_same_model"] = (row["tf5_max_diff"] < TOLERANCE and row["generic"] == "ok"
                                       and status == "ok" and row["tf457_max_diff"] < TOLERANCE)
    shutil.rmtree(root)
    print(f"{'method':12} {'theta':>7}  {'form':50} {'tf5':>8} {'generic':10} {'tf457':>8}  same")
    for row in rows:
        tf457_cell = f"{row['tf457_max_diff']:.1e}" if isinstance(row["tf457_max_diff"], float) else "error"
        generic = "ok" if row["generic"] == "ok" else row["generic"].split(":")[0]
        print(f"{row['method']:12} {row['theta']:7g}  {row['form']:50} {row['tf5_max_diff']:8.1e} {generic:10} "
              f"{tf457_cell:>8}  {'YES' if row['all_three_same_model'] else 'no'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python bench/legacy_rope_fields.py --tf457-python "
                                               "PY --json " + args.json, "transformers_4": tf457["version"],
                                               "tolerance": TOLERANCE, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
