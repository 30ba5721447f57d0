"""Does every family saved after ``patch`` under transformers 5 load under transformers 4.57 as the model saved?

For every ``*ForCausalLM`` class that both the installed transformers (5.x) and ``--tf457-python``'s transformers
export, a tiny random instance (``hf_posext.family_sweep.tiny.build_tiny``) is patched with each ``--methods`` entry
(x2), its logits on 64 random tokens are kept, and it is saved with ``save_pretrained``. The folder is read back
under transformers 5 (``hf_posext.load`` and stock ``AutoModelForCausalLM.from_pretrained``), then every folder is
read by ONE transformers 4.57 process (starting one costs seconds) in both ways. Each (class, method) is then:

- ``loaded``: ``hf_posext.load`` under 4.57 gives the saved logits (``stock_457`` says whether stock
  ``from_pretrained`` does too: ``equal``, ``error`` (transformers' own) or ``MISMATCH``, a silent other model);
- ``refused``: ``hf_posext.load`` under 4.57 raised a one-line error from hf_posext's own code;
- ``incompatible``: 4.57 cannot read even the UNPATCHED transformers 5 save of the family (a control folder saved
  before ``patch``, loaded by stock ``from_pretrained``: an error, or other logits: renamed config fields, fused
  expert weights), and ``hf_posext.load`` does no better: a transformers 5 -> 4 limit, not a RoPE one;
- ``FAILING``: anything else (a crash from transformers, a traceback, other logits, a multi-line refusal).

``stock_457`` is ``MISMATCH (not stock-loadable)`` where the saved record says stock ``from_pretrained`` cannot
rebuild the patch (``stock_loadable: false``: a method transformers has no rope type for), and ``MISMATCH (warned)``
where ``save_pretrained`` warned that 4.x reads the folder as another model (no legacy form serves every reader).

Classes whose tiny instance does not build, or that ``hf_posext.patch`` refuses under transformers 5, are listed
apart (``not_built``, ``not_patched``): there is no patched folder to load.

Usage::

    nice python bench/legacy_load_sweep.py --tf457-python .venv-tf457/bin/python \
        --out bench/results/legacy_rope_fields/legacy_load_sweep.json
    nice python bench/legacy_load_sweep.py --classes Gemma3ForCausalLM,OlmoForCausalLM --methods yarn
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch

LENGTH, FACTOR, WINDOW = 64, 2.0, 32
#: Relative tolerance on logits: |loaded - saved| <= TOLERANCE * max(1, |saved|max).
TOLERANCE = 1e-4

#: Run by ``--tf457-python`` with the repository as the working directory: one line of JSON per call.
CLASSES_SCRIPT = """
import json, transformers
print(json.dumps({"version": transformers.__version__,
                  "classes": sorted(n for n in dir(transformers) if n.endswith("ForCausalLM") and not n.startswith("Auto"))}))
"""

LOAD_SCRIPT = """
import json, sys, traceback, warnings, torch, transformers
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
import hf_posext
from transformers import AutoModelForCausalLM
TOLERANCE = float(sys.argv[1])

def read(folder, how):
    saved = torch.load(folder + ("/control-logits.pt" if how == "control" else "/logits.pt"))
    try:
        source = folder + "/control" if how == "control" else folder
        model = hf_posext.load(source) if how == "hf_posext" else AutoModelForCausalLM.from_pretrained(source)
        with torch.no_grad():
            logits = model.eval()(input_ids=torch.load(folder + ("/control-ids.pt" if how == "control" else "/ids.pt"))).logits
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        return {"error": f"{type(error).__name__}: {error}", "raised_in": frames[-1].filename if frames else "",
                "traceback": traceback.format_exc()[-2000:]}
    diff = float((logits - saved).abs().max()) if logits.shape == saved.shape else float("inf")
    return {"max_diff": diff, "equal": diff <= TOLERANCE * max(1.0, float(saved.abs().max()))}

found = {folder: {how: read(folder, how) for how in ("hf_posext", "stock", "control")} for folder in json.loads(sys.argv[2])}
print(json.dumps({"version": transformers.__version__, "found": found}))
"""


def run_457(python: str, script: str, *args: str) -> dict[str, Any]:
    """One ``python -c script args`` under transformers 4.57 (cwd: the repository); its last stdout line, parsed."""
    result = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if result.returncode != 0:
        raise RuntimeError(f"the transformers 4.57 process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def read_under_5(folder: Path, saved: "torch.Tensor", ids: "torch.Tensor") -> dict[str, Any]:
    """The folder read back under the installed transformers 5: max |logit diff| per reader, or its error."""
    import hf_posext
    from transformers import AutoModelForCausalLM

    result = {}
    for how in ("hf_posext", "stock"):
        try:
            model = hf_posext.load(folder) if how == "hf_posext" else AutoModelForCausalLM.from_pretrained(folder)
            with torch.no_grad():
                logits = model.eval()(input_ids=ids).logits
            result[how] = float((logits - saved).abs().max())
        except Exception as error:  # recorded, not raised: the sweep goes on
            result[how] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return result


def save_patched(class_name: str, method: str, folder: Path) -> dict[str, Any]:
    """Build, patch, keep logits and ids, save; the row's status under transformers 5."""
    import hf_posext
    from hf_posext.backends.rope.rules import reads_target_states
    from hf_posext.family_sweep.tiny import build_tiny, input_ids

    try:
        model = build_tiny(class_name)
    except Exception as error:
        return {"status": "not_built", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    if reads_target_states(model):
        return {"status": "not_built", "error": "a drafting head (needs its target's states)"}
    try:
        hf_posext.patch(model, method, factor=FACTOR)
    except Exception as error:
        return {"status": "not_patched", "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    ids = input_ids(model, LENGTH)
    try:
        with torch.no_grad():
            saved = model(input_ids=ids).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.save_pretrained(folder)
    except Exception as error:
        return {"status": "not_patched", "error": f"forward/save: {type(error).__name__}: {str(error)[:200]}"}
    torch.save(ids, folder / "ids.pt")
    torch.save(saved, folder / "logits.pt")
    save_control(class_name, folder, ids[:, :WINDOW])
    warned = any("transformers 4.x" in str(warning.message) for warning in caught)
    record = json.loads((folder / "config.json").read_text()).get("hf_posext", {})
    return {"status": "saved", "warned": warned, "stock_loadable": record.get("stock_loadable"),
            "tf5": read_under_5(folder, saved, ids)}


def save_control(class_name: str, folder: Path, ids: "torch.Tensor") -> None:
    """The same tiny instance (same seed), unpatched, saved to ``folder/control`` with its logits on ``ids`` (inside the
    pre-training window: an unpatched learned table has no row past it)."""
    from hf_posext.family_sweep.tiny import build_tiny

    model = build_tiny(class_name)
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, folder / "control-logits.pt")
    torch.save(ids, folder / "control-ids.pt")
    model.save_pretrained(folder / "control")


def classify(row: dict[str, Any], found: dict[str, Any]) -> tuple[str, str]:
    """(status, stock_457) of one folder as read under 4.57 (see the module docstring)."""
    ours, stock = found["hf_posext"], found["stock"]
    stock_457 = "equal" if stock.get("equal") else "error" if "error" in stock else "MISMATCH"
    if stock_457 == "MISMATCH" and row.get("stock_loadable") is False:
        stock_457 = "MISMATCH (not stock-loadable)"
    elif stock_457 == "MISMATCH" and row.get("warned"):
        stock_457 = "MISMATCH (warned)"
    if ours.get("equal"):
        return "loaded", stock_457
    error = ours.get("error", "")
    if error and "/hf_posext/" in ours["raised_in"] and "\n" not in error:
        return "refused", stock_457
    if not found["control"].get("equal"):
        return "incompatible", stock_457
    return "FAILING", stock_457


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tf457-python", default=".venv-tf457/bin/python", help="a Python with transformers 4.57")
    parser.add_argument("--methods", default="yarn,linear", help="comma-separated methods, each patched x2")
    parser.add_argument("--classes", help="comma-separated *ForCausalLM classes (default: every class both have)")
    parser.add_argument("--out", help="write the JSON record here (and a Markdown table beside it)")
    args = parser.parse_args()

    import transformers

    from hf_posext.family_sweep.tiny import causal_lm_classes

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    started = time.time()
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    if not Path(args.tf457_python).is_file():
        sys.exit(f"--tf457-python {args.tf457_python}: no such file; make the venv with `bash scripts/tf457_venv.sh .venv-tf457`")
    older = run_457(args.tf457_python, CLASSES_SCRIPT)
    classes, problem = chosen_classes(args.classes, causal_lm_classes(), older)
    problem = problem or unknown_methods(methods)
    if problem:
        sys.exit(problem)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as root:
        saved_root = root
        for class_name in classes:
            for method in methods:
                folder = Path(root) / f"{class_name}-{method}"
                rows[f"{class_name} {method}"] = {"class": class_name, "method": method, "folder": str(folder),
                                                  **save_patched(class_name, method, folder)}
                print(class_name, method, rows[f"{class_name} {method}"]["status"], file=sys.stderr, flush=True)
        saved = [row["folder"] for row in rows.values() if row["status"] == "saved"]
        found = run_457(args.tf457_python, LOAD_SCRIPT, str(TOLERANCE), json.dumps(saved))["found"]
    for row in rows.values():
        diff = row.get("tf5", {}).get("hf_posext", 0.0)
        row["tf5_differs"] = not isinstance(diff, float) or diff > 1e-4  # hf_posext.load under transformers 5
        if row["status"] == "saved":
            row["status"], row["stock_457"] = classify(row, found[row["folder"]])
            row["tf457"] = found[row["folder"]]
        del row["folder"]
    record = portable(summary(rows, args, older["version"], transformers.__version__, time.time() - started), saved_root)
    print(json.dumps(record["totals"], indent=1))
    for row in rows.values():
        if row["status"] == "FAILING" or row.get("stock_457") == "MISMATCH" or row.get("tf5_differs"):
            print("!", row["class"], row["method"], row["status"], row.get("stock_457"),
                  json.dumps(row.get("tf457"))[:600])
    if args.out:
        from hf_posext.core.files import write_text_atomic

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.out), json.dumps(record, indent=1) + "\n")
        write_text_atomic(Path(args.out).with_suffix(".md"), markdown(record))


def portable(value: Any, saved_root: str | None = None) -> Any:
    """``value`` (a record, recursively) with the machine's paths written as paths of no machine: the saved folders'
    temporary root as ``SAVED``, an installed package's folder from ``site-packages/``, the repository relative."""
    if isinstance(value, dict):
        return {key: portable(item, saved_root) for key, item in value.items()}
    if isinstance(value, list):
        return [portable(item, saved_root) for item in value]
    if not isinstance(value, str):
        return value
    if saved_root:
        value = value.replace(saved_root, "SAVED")
    value = re.sub(r"(?:/[^\s\"',:()]*)?/site-packages/", "site-packages/", value)
    value = value.replace(str(Path(__file__).resolve().parents[1]) + "/", "")
    return re.sub(r"/tmp/[\w.-]+", "$TMPDIR/x", value)


def chosen_classes(asked: str | None, newer: list[str], older: dict[str, Any]) -> tuple[list[str], str]:
    """The classes to sweep (every class both releases have, or those asked for), and why not in one line ("" if fine)."""
    if not str(older["version"]).startswith("4."):
        return [], (f"--tf457-python runs transformers {older['version']}, not 4.x: the sweep would compare a release with "
                    "itself; pass .venv-tf457/bin/python (bash scripts/tf457_venv.sh .venv-tf457)")
    both = sorted(set(newer) & set(older["classes"]))
    if not asked:
        return both, ""
    names = [name.strip() for name in asked.split(",") if name.strip()]
    missing = [name for name in names if name not in both]
    if missing:
        return [], (f"--classes: {', '.join(missing)} is not a *ForCausalLM class that transformers {older['version']} and "
                    "the installed release both have")
    return names, ""


def unknown_methods(methods: list[str]) -> str:
    """Why ``methods`` cannot be swept, in one line ("" when each is a frequency method hf_posext knows)."""
    from hf_posext.methods import available_methods

    known = sorted(name for name in available_methods() if " " not in name and name != "none")
    wrong = [name for name in methods if name not in known]
    return f"--methods: unknown {', '.join(wrong)}; pick from {', '.join(known)}" if wrong or not methods else ""


def summary(rows: dict[str, dict[str, Any]], args: argparse.Namespace, older: str, newer: str,
            seconds: float) -> dict[str, Any]:
    """The JSON record: command, machine, versions, totals per status and the rows."""
    totals: dict[str, int] = {}
    for row in rows.values():
        key = row["status"] + (f" (stock 4.57: {row['stock_457']})" if "stock_457" in row else "")
        totals[key] = totals.get(key, 0) + 1
    return {
        "question": __doc__.split("\n")[0],
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"), "seconds": round(seconds),
        "versions": {"transformers_saved_with": newer, "transformers_loaded_with": older, "torch": torch.__version__},
        "factor": FACTOR, "tolerance": TOLERANCE, "totals": dict(sorted(totals.items())), "rows": rows,
    }


def markdown(record: dict[str, Any]) -> str:
    """A Markdown table of the record: one row per (class, method)."""
    lines = [f"# {record['question']}", "", f"`{record['command']}`", "",
             f"{record['date']}, {record['machine']}; saved with transformers {record['versions']['transformers_saved_with']},"
             f" loaded with {record['versions']['transformers_loaded_with']}; torch {record['versions']['torch']}.", "",
             "| status | count |", "|---|---|", *[f"| {key} | {count} |" for key, count in record["totals"].items()], "",
             "| class | method | status | stock from_pretrained (4.57) | hf_posext.load (4.57): diff or error |",
             "|---|---|---|---|---|"]
    for row in record["rows"].values():
        ours = row.get("tf457", {}).get("hf_posext", {})
        detail = ours.get("max_diff", ours.get("error", row.get("error", "")))
        detail = f"{detail:.1e}" if isinstance(detail, float) else str(detail).splitlines()[0][:160].replace("|", "/")
        lines.append(f"| {row['class']} | {row['method']} | {row['status']} | {row.get('stock_457', '')} | {detail} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
