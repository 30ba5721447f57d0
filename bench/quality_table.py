#!/usr/bin/env python
"""Quality table on SmolLM2: methods x lengths, perplexity on books and passkey, resumable.

Runs the library's perplexity and passkey evaluations (one model load, methods side by side), then the
longest extra lengths (default 32768) for the four methods with the best perplexity at the longest
regular length (three distinct: there dynamic-yarn is yarn), and writes ``quality.md`` (tables + which
method wins where) and plots next to the JSON.
Interrupt it at any time: the same command continues where it stopped (``--overwrite`` recomputes instead).

    python bench/quality_table.py                                   # 4096,8192,16384 (+32768 for the best 4)
    python bench/quality_table.py --lengths 4096,8192 --extra-lengths "" --passkey-trials 1   # a CPU subset
    python bench/quality_table.py --device cuda --dtype bfloat16 --extra-lengths 32768,65536    # on a GPU
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = "none,linear,ntk,dynamic-ntk,yarn,dynamic-yarn"


def winners(cells: dict, metric: str, lower_is_better: bool) -> dict[int, tuple[str, float]]:
    """Best method per length by the mean of ``metric`` over that length's cells; ties joined by " = "."""
    values: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in cells.values():
        if record.get(metric) is not None:
            name = record["method"] if record["method"] == "none" else f"{record['method']} x{record['factor']:g}"
            values[record["length"]][name].append(record[metric])
    best = {}
    for length, by_method in values.items():
        means = {m: sum(v) / len(v) for m, v in by_method.items()}
        value = (min if lower_is_better else max)(means.values())
        tied = sorted(m for m, v in means.items() if abs(v - value) <= 1e-9 * max(1.0, abs(value)))
        best[length] = (" = ".join(tied), value)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--extra-lengths", default="32768", help="lengths run only for the best --extra-top methods ('' for none)")
    parser.add_argument("--extra-top", type=int, default=4,
                        help="how many methods (best perplexity at the longest --lengths) get --extra-lengths; default 4 "
                             "gives three distinct ones, since dynamic-yarn xs at L*s tokens is exactly yarn xs")
    parser.add_argument("--factor", type=float, help="scale factor (default: longest length / 8192, per phase)")
    parser.add_argument("--data", default=str(ROOT / "data" / "books"),
                        help="books folder, files read in name order (default: the repository's %(default)s; the committed "
                             "cells read the same books from ../shared/data/books, and a results key holds the path)")
    parser.add_argument("--max-segments", "--max-windows", dest="max_segments", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16384,
                        help="perplexity windows per length = max(1, N // length): the same first N tokens at every length")
    parser.add_argument("--passkey-trials", type=int, default=1,
                        help="trials per depth (default 1: 3 depths x 1 = 3 trials per method and length)")
    parser.add_argument("--passkey-depths", default="0.1,0.5,0.9")
    parser.add_argument("--no-generate", dest="generate", action="store_false", help="passkey: teacher-forced only")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality"))
    parser.add_argument("--overwrite", action="store_true",
                        help="recompute every cell of this command's results files instead of continuing them")
    args = parser.parse_args()
    # after parse_args: `--help` answers without loading torch (tests/test_bench_help.py)
    from hf_posext.evaluation import evaluate_passkey, evaluate_perplexity, parse_lengths, parse_methods
    from hf_posext.evaluation.report import load_results, markdown_tables, write_plots
    from hf_posext.evaluation.loading import load_model_and_tokenizer
    from hf_posext.lm.distributed import Distributed

    dist = Distributed()
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=args.device or dist.default_device())
    lengths = parse_lengths(args.lengths)
    methods = parse_methods(args.methods)
    depths = [float(d) for d in args.passkey_depths.split(",")]
    common = dict(out_dir=args.out, model_name=args.model, batch_size=args.batch_size, dist=dist, extra_config={"dtype": args.dtype})

    def run(phase_methods, phase_lengths, factor, overwrite):
        ppl = evaluate_perplexity(model, tokenizer, data=args.data, methods=phase_methods, lengths=phase_lengths, factor=factor,
                                  max_segments=args.max_segments, max_tokens=args.max_tokens, overwrite=overwrite, **common)
        key = evaluate_passkey(model, tokenizer, methods=phase_methods, lengths=phase_lengths, factor=factor, depths=depths,
                               trials=args.passkey_trials, generate=args.generate, overwrite=overwrite, **common)
        return ppl, key

    factor = args.factor or max(lengths) / 8192
    # --overwrite starts the results files afresh in the first phase only: the extra phase adds to them.
    ppl, key = run(methods, lengths, factor, overwrite=args.overwrite)
    extra = parse_lengths(args.extra_lengths) if args.extra_lengths.strip() else []
    if extra:
        at_longest = {r["method"]: r["ppl"] for r in ppl.cells.values() if r["length"] == max(lengths) and r["method"] != "none"}
        top = sorted(at_longest, key=at_longest.get)[: args.extra_top]
        extra_factor = args.factor or max(extra) / 8192
        ppl, key = run(parse_methods(",".join(top)), extra, extra_factor, overwrite=False)
    if dist.is_main:
        lines = [f"# Quality table: {args.model}", "", "Command: `python " + " ".join(sys.argv) + "`", "", markdown_tables([ppl.data, key.data]), "",
                 "## Winners", ""]
        for metric, lower, label in (("ppl", True, "perplexity"), ("greedy_accuracy", False, "passkey (greedy)"),
                                     ("teacher_forced_accuracy", False, "passkey (teacher-forced)")):
            source = ppl.cells if metric == "ppl" else key.cells
            for length, (name, value) in sorted(winners(source, metric, lower).items()):
                lines.append(f"- {label} at {length}: **{name}** ({value:.3f})")
        (Path(args.out) / "quality.md").write_text("\n".join(lines) + "\n")
        write_plots(load_results(args.out), args.out)  # the folder's plots cover every results file in it
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
