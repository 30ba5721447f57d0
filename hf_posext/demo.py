"""The main job on the embedded default model: does SmolLM2-135M still work at 2x its window?

``hf-posext demo`` loads ``smollm2-135m`` (window 8192) once and compares, side by side, the unpatched
model (``none``), ``yarn`` and ``dynamic-yarn`` (factor 2 = 16384 / 8192) at 8192 tokens (the window:
what scaling costs) and 16384 (twice the window: what it buys):

* perplexity on one window per length of ``builtin:python-docs`` (the docstrings of the installed Python
  standard library: English prose available offline on any machine, not stored in this repository);
* passkey retrieval (landmark-attention format, passkey at depth 0.5, one seeded trial per length),
  scored by greedy generation and by the teacher-forced argmax check.

It prints a table and writes JSON, CSV and PNG plots to ``results/demo`` (``results/demo-quick`` with
``--quick``, which uses 1024 and 2048 tokens with the same factor 2: a smoke run of a minute or two,
inside the window, so it shows only what scaling costs at short lengths). Re-running resumes: finished cells are read back, not recomputed.

Budget (2 idle CPU cores, float32, measured 2026-11-26): one forward pass takes about 50 s at 8192
tokens and 155 s at 16384; the whole demo took 800 s by its own clock (13:23 wall with start-up and
loading, ``/usr/bin/time -v hf-posext demo``). ``dynamic-yarn`` is computed by nothing new: inside the
window it is the unpatched model, and at 16384 tokens it is ``yarn`` with s = 2 (the grid detects equal
rotary tables and reuses the result, and the JSON says so under ``reused_from``).
"""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["run_demo", "demo_table", "DEMO_MODEL", "DEMO_METHODS", "DEMO_FACTOR", "DEMO_LENGTHS", "QUICK_LENGTHS"]

DEMO_MODEL = "smollm2-135m"
DEMO_METHODS = "none,yarn,dynamic-yarn"
DEMO_FACTOR = 2.0  # 16384 / 8192: the longest demo length over SmolLM2's window
DEMO_LENGTHS = (8192, 16384)  # the window and 2x: where scaling costs, where it pays
QUICK_LENGTHS = (1024, 2048)


def demo_table(perplexity_cells: dict, passkey_cells: dict, lengths: tuple[int, ...]) -> str:
    """The demo's markdown table: one row per method, perplexity and passkey per length."""
    rows: dict[str, dict[str, str]] = {}
    for record in perplexity_cells.values():
        name = record["method"] if record["method"] == "none" else f"{record['method']} x{record['factor']:g}"
        rows.setdefault(name, {})[f"ppl {record['length']}"] = f"{record['ppl']:.2f}"
    for record in passkey_cells.values():
        name = record["method"] if record["method"] == "none" else f"{record['method']} x{record['factor']:g}"
        greedy = record.get("greedy_accuracy")
        value = f"{'ok' if greedy else 'miss'} / {'ok' if record['teacher_forced_accuracy'] else 'miss'}" if record["trials"] == 1 else (
            f"{greedy:.2f} / {record['teacher_forced_accuracy']:.2f}")
        rows.setdefault(name, {})[f"passkey {record['length']}"] = value
    columns = [f"ppl {n}" for n in lengths] + [f"passkey {n}" for n in lengths]
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name in sorted(rows, key=lambda m: (m != "none", m)):
        lines.append(f"| {name} | " + " | ".join(rows[name].get(c, "") for c in columns) + " |")
    return "\n".join(lines)


def run_demo(quick: bool = False, out_dir: str | Path | None = None) -> int:
    """Run the demo comparison and print its table.

    Args:
        quick: use 1024 and 2048 tokens instead of 8192 and 16384 (a smoke run).
        out_dir: results folder (default ``results/demo`` or ``results/demo-quick``).

    Returns:
        The exit code (0).
    """
    import torch

    from hf_posext.evaluation.passkey import evaluate_passkey
    from hf_posext.evaluation.perplexity import evaluate_perplexity
    from hf_posext.evaluation.report import write_plots
    from hf_posext.evaluation.runner import load_model_and_tokenizer, parse_methods

    started = time.time()
    lengths = QUICK_LENGTHS if quick else DEMO_LENGTHS
    out = Path(out_dir or ("results/demo-quick" if quick else "results/demo"))
    print(f"hf-posext demo: {DEMO_MODEL}, methods {DEMO_METHODS}, lengths {', '.join(map(str, lengths))}; results in {out}/")
    budget = ("about 1.5 minutes with set-up (measured 60 s)" if quick else
              "about 13-16 minutes on 2 otherwise idle CPU cores (measured 800 s and 920 s; one forward: ~50 s at 8192 tokens, ~155 s at 16384)")
    print(f"torch threads: {torch.get_num_threads()}; {budget}.", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(DEMO_MODEL, dtype="float32", device=device)
    methods = parse_methods(DEMO_METHODS)
    config = {"dtype": "float32", "demo": True}
    perplexity = evaluate_perplexity(
        model, tokenizer, data="builtin:python-docs", methods=methods, lengths=lengths, factor=DEMO_FACTOR, out_dir=out,
        model_name=DEMO_MODEL, max_windows=1, extra_config=config,
    )
    passkey = evaluate_passkey(
        model, tokenizer, methods=methods, lengths=lengths, factor=DEMO_FACTOR, depths=(0.5,), trials=1, out_dir=out,
        model_name=DEMO_MODEL, generate=True, extra_config=config,
    )
    table = demo_table(perplexity.cells, passkey.cells, lengths)
    plots = write_plots([perplexity.data, passkey.data], out)
    (out / "demo.md").write_text(
        f"{DEMO_MODEL} (window 8192), float32, {len(lengths)} lengths; perplexity on one window of builtin:python-docs per "
        "length; passkey at depth 0.5, one trial (greedy / teacher-forced).\n\n" + table + "\n"
    )
    print()
    print(table)
    print("\nperplexity: lower is better. passkey: greedy generation / teacher-forced argmax (ok = passkey retrieved).")
    print(f"results: {perplexity.path}, {passkey.path}; plots: {', '.join(str(p) for p in plots)}")
    print(f"done in {time.time() - started:.0f} s")
    return 0
