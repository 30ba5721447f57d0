"""Which model families does hf-posext patch, with which methods, on the installed transformers?

Builds a tiny random instance of every ``*ForCausalLM`` class that transformers exports and sweeps every
applicable method over it (patch, a forward beyond the window, unpatch to the bit, save/load, parity with
transformers' own ``rope_parameters`` scaling; :mod:`hf_posext.family_sweep`). Writes the rows as JSON, the
per-(class, method) findings as one line each, and regenerates the support matrix ``docs/families.md``.
Run it on the day a transformers release ships to see which new families need work.

Usage:
    nice python bench/family_sweep.py                               # every class; JSON + docs/families.md
    python bench/family_sweep.py --classes LlamaForCausalLM,Gemma3ForCausalLM --no-docs
    python bench/family_sweep.py --status /tmp/family_sweep_status.txt   # also the one-line findings
    python bench/family_sweep.py --classes Qwen3_5ForCausalLM --merge   # re-sweep one class, update JSON and page
    python bench/family_sweep.py --render-only                      # the page again from the JSON
Results: bench/results/family_sweep/sweep.json (rows, totals, versions, seconds); exit status 1 when a
result differs from hf_posext/family_sweep/known.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import logging
    import warnings

    import torch
    import transformers

    from hf_posext.core.files import write_text_atomic
    from hf_posext.family_sweep.known import problems
    from hf_posext.family_sweep.matrix import render_page
    from hf_posext.family_sweep.sweep import FamilyResult, result_from_dict, sweep_class
    from hf_posext.family_sweep.tiny import causal_lm_classes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "family_sweep"
DOCS = ROOT / "docs" / "families.md"
COMMAND = "python bench/family_sweep.py"


def versions() -> str:
    """The library versions the sweep ran on, for the page and the JSON."""
    return f"transformers {transformers.__version__}, torch {torch.__version__}"


def status_lines(results: list[FamilyResult]) -> list[str]:
    """One line per (class, method) that is not ok, and one per class not built: ``class<TAB>method<TAB>outcome<TAB>error``."""
    lines = []
    for result in results:
        if not result.built:
            lines.append(f"{result.class_name}\t*\tskipped\t{result.reason}")
        lines += [f"{result.class_name}\t{m.method}\t{m.outcome}\t{m.reason}" for m in result.methods if m.outcome != "ok"]
    return lines


def totals(results: list[FamilyResult]) -> dict[str, int]:
    """Classes, built, skipped, and (class, method) pairs by outcome."""
    outcomes = [m.outcome for r in results for m in r.methods]
    return {"classes": len(results), "built": sum(r.built for r in results), "skipped": sum(not r.built for r in results),
            "pairs": len(outcomes), **{name: outcomes.count(name) for name in ("ok", "refused", "crash")},
            "classes_with_crash": sum(any(m.outcome == "crash" for m in r.methods) for r in results)}


def run(classes: list[str], progress: bool = True) -> tuple[list[FamilyResult], float]:
    """Sweep ``classes``; returns the results and the seconds taken."""
    results, start = [], time.perf_counter()
    for index, name in enumerate(classes, 1):
        results.append(sweep_class(name))
        if progress:
            outcome = results[-1].reason[:80] if not results[-1].built else \
                " ".join(f"{m.method}={m.outcome}" for m in results[-1].methods if m.outcome != "ok") or "all ok"
            print(f"[{index}/{len(classes)}] {name}: {outcome}", file=sys.stderr, flush=True)
    return results, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--classes", help="comma-separated class names (default: every *ForCausalLM class)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the JSON record (default: {RESULTS / 'sweep.json'}; with --classes and no --merge, none "
                             "unless given: a partial sweep never replaces the whole record)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the generated matrix page (default: %(default)s)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the matrix page (always so with --classes)")
    parser.add_argument("--status", type=Path, help="also write the non-ok findings there, one line each")
    parser.add_argument("--merge", action="store_true",
                        help="replace only the --classes rows of the existing JSON, and regenerate the page from all rows")
    parser.add_argument("--render-only", action="store_true", help="regenerate the page from the existing JSON; sweep nothing")
    args = parser.parse_args(argv)
    partial = bool(args.classes) and not args.merge
    if args.out is None and not partial:
        args.out = RESULTS / "sweep.json"
    if args.render_only:
        record = json.loads(args.out.read_text())
        write_text_atomic(args.docs, render_page([result_from_dict(row) for row in record["rows"]], record["versions"], COMMAND))
        return 0
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    classes = [name.strip() for name in args.classes.split(",") if name.strip()] if args.classes else causal_lm_classes()
    unknown = sorted(set(classes) - set(causal_lm_classes()))
    if unknown:
        print(f"--classes: {', '.join(unknown)} is not a *ForCausalLM class of transformers {transformers.__version__} "
              "(python bench/family_sweep.py --help; every class: leave --classes out)", file=sys.stderr)
        return 2
    results, seconds = run(classes)
    merged: dict = {}
    if args.merge and args.out is not None and args.out.exists():
        swept = {r.class_name for r in results}
        before = json.loads(args.out.read_text())
        earlier = [result_from_dict(row) for row in before["rows"] if row["class_name"] not in swept]
        results = sorted(earlier + results, key=lambda r: r.class_name)
        # "seconds" stays the whole sweep's; the re-swept classes are listed apart, each with its time
        merged = {"seconds": before.get("seconds"), "merged": [
            *before.get("merged", []), {"classes": sorted(swept), "seconds": round(seconds, 1)}]}
    found = [line for result in results for line in problems(result)]
    record = {"versions": versions(), "machine": platform.machine(), "seconds": round(seconds, 1),
              "totals": totals(results), "problems": found, "rows": [dataclasses.asdict(r) for r in results], **merged}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, json.dumps(record, indent=1) + "\n")
    if args.status:
        write_text_atomic(args.status, "\n".join(status_lines(results)) + "\n")
    if not (args.no_docs or partial):
        write_text_atomic(args.docs, render_page(results, versions(), COMMAND))
    print(json.dumps({"totals": record["totals"], "seconds": record["seconds"]}))
    print("\n".join(found) or "every result as listed in hf_posext/family_sweep/known.py")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
