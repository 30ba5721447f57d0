"""The main job on the embedded default model: which methods make SmolLM2-135M work at 2x its window?

``hf-posext demo`` loads ``smollm2-135m`` (window 8192) once and evaluates it at 16384 tokens, twice
its window, under the unpatched baseline and the methods the README recommends at 2x:

* **perplexity** (one 16384-token window of ``builtin:python-docs``, the docstrings of the installed
  Python standard library: English prose available offline on any machine) for ``none`` (the
  baseline, which breaks past its window) and ``dynamic-yarn`` (the default pick: the original model
  inside the window, YaRN's perplexity past it);
* **passkey retrieval** (landmark-attention format, one seeded trial with the passkey at depth 0.1,
  about 15k tokens before the question: the case that separates the methods in the quality table)
  for ``dynamic-yarn`` (which misses it) and ``dynamic-ntk`` (which finds it). Scored by greedy
  generation and by the teacher-forced argmax check.
* **the fine-tuned model**, the README's headline: the recipe's adapter
  (``bench/results/finetune_retrieval_cpu/run-retrieval-aggregation/adapter``: ``yarn`` x4 plus LoRA, 200 steps of LoRA +
  PoSE on books then 50 steps in which half of the samples are retrieval practice (distractors, several values, chains,
  counting who did a thing most often, half of them in the chat template), on 2 CPU cores, ``docs/training.md``), loaded with :func:`hf_posext.adapters.load_adapted_model`, with STRING stacked on its
  yarn x4 (``yarn+string``: S = 0.33 of its 32768-token window), on the same perplexity window and the same
  passkey trial, so the table shows the fine-tune beside the training-free default (``dynamic-yarn``).

Each method runs only where it is recommended, plus one contrast per task, because one 16384-token
forward is the cost (78-182 s on 2 CPU cores, depending on the host's day): six forwards, so that the whole
demo stays under 15 minutes on 2 cores (the measured time is in ``docs/quality.md``). The quality table
(``bench/quality_table.py``, ``docs/beyond_rescaling.md``) has every method at every depth, Self-Extend's
perplexity and the searched LongRoPE factors included.

It prints a table and writes JSON, CSV, PNG plots and an HTML report to ``results/demo``
(``results/demo-quick`` with ``--quick``: 1024 and 2048 tokens, inside the window, a smoke run of a
minute or two that shows only what scaling costs at short lengths). Re-running resumes: finished cells
are read back, not recomputed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["run_demo", "demo_table", "demo_methods", "check_demo_adapter", "DEMO_MODEL", "DEMO_FACTOR", "DEMO_LENGTHS",
           "QUICK_LENGTHS", "PERPLEXITY_METHODS", "RETRIEVAL_METHODS", "PASSKEY_DEPTH", "DEMO_ADAPTER", "DEMO_ATTENTION",
           "FINE_TUNED_ROW"]

DEMO_MODEL = "smollm2-135m"
DEMO_FACTOR = 2.0  # 16384 / 8192: twice SmolLM2's window
DEMO_LENGTHS = (16384,)
QUICK_LENGTHS = (1024, 2048)
PASSKEY_DEPTH = 0.1  # the far passkey: ~15k tokens before the question at 16384
PERPLEXITY_METHODS = ("none", "dynamic-yarn")
RETRIEVAL_METHODS = ("dynamic-yarn", "dynamic-ntk")
# The recipe's committed adapter (stage 2 with aggregation practice): yarn x4 + LoRA + trained norms, 7 MB.
DEMO_ADAPTER = (Path(__file__).resolve().parents[1] / "bench" / "results" / "finetune_retrieval_cpu"
                / "run-retrieval-aggregation" / "adapter")
#: The attention-level method the headline stacks on the adapter's frequency scaling at evaluation (nothing trained).
DEMO_ATTENTION = "string"
FINE_TUNED_ROW = "fine-tuned: {label} + LoRA (250 CPU steps)"


def _display_path(path: Path) -> str:
    """``path`` relative to the working directory when it lies inside it (the cell ids then do not depend on
    where the repository was cloned), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def demo_methods(names: tuple[str, ...]) -> list:
    """Method requests for ``names``, parsed (and so checked) before the model loads."""
    from hf_posext.evaluation.arguments import parse_methods

    return [request for name in names for request in parse_methods(name)]


def check_demo_adapter(folder: Path = DEMO_ADAPTER):
    """The demo adapter's record, checked against the demo model before anything loads.

    Raises:
        FileNotFoundError: the folder is missing (the demo runs from a clone of the repository, which holds it).
        AdapterMismatchError, RecordError: see :func:`hf_posext.adapters.check_adapter`.
    """
    from hf_posext.adapters import check_adapter

    if not (folder / "posext_adapter.json").is_file():
        raise FileNotFoundError(f"The demo's fine-tuned adapter {folder} is missing; run the demo from a clone of the "
                                "hf-posext repository (bash scripts/demo.sh).")
    return check_adapter(folder, DEMO_MODEL)


def _row_name(record: dict[str, Any]) -> str:
    """``none``, ``dynamic-yarn x2``, or for a composition ``yarn x4 + string`` (the factor is the frequency part's)."""
    if record["method"] == "none":
        return "none"
    frequency, plus, attention = str(record["method"]).partition("+")
    return f"{frequency} x{record['factor']:g}" + (f" + {attention}" if plus else "")


def demo_table(perplexity_cells: dict, passkey_cells: dict, lengths: tuple[int, ...],
               fine_tuned_cells: tuple[dict, dict] | None = None) -> str:
    """The demo's markdown table: one row per method, perplexity and passkey per length (blank: not run).

    ``fine_tuned_cells`` (perplexity, passkey) of the adapted model come last, as one row named
    :data:`FINE_TUNED_ROW` with the scaling the adapter was trained with.
    """
    rows: dict[str, dict[str, str]] = {}
    named = [(cells, _row_name) for cells in (perplexity_cells, passkey_cells)]
    if fine_tuned_cells is not None:
        def fine_tuned_name(record: dict[str, Any]) -> str:
            return FINE_TUNED_ROW.format(label=_row_name(record))

        named += [(cells, fine_tuned_name) for cells in fine_tuned_cells]
    for (cells, row_name), kind in zip(named, ("ppl", "passkey") * 2):
        for record in cells.values():
            rows.setdefault(row_name(record), {})[f"{kind} {record['length']}"] = (
                f"{record['ppl']:.2f}" if kind == "ppl" else _passkey_value(record))
    columns = [f"ppl {n}" for n in lengths] + [f"passkey {n}" for n in lengths]
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name in sorted(rows, key=lambda m: (m.startswith("fine-tuned"), m != "none", m)):
        lines.append(f"| {name} | " + " | ".join(rows[name].get(c, "") for c in columns) + " |")
    return "\n".join(lines)


def _passkey_value(record: dict[str, Any]) -> str:
    """greedy / teacher-forced: ok or miss for one trial, else the two rates."""
    greedy = record.get("greedy_accuracy")
    teacher = record["teacher_forced_accuracy"]
    if record["trials"] == 1:
        return f"{'ok' if greedy else 'miss'} / {'ok' if teacher else 'miss'}" if greedy is not None else ('ok' if teacher else 'miss')
    return f"{greedy:.2f} / {teacher:.2f}" if greedy is not None else f"{teacher:.2f}"


def run_demo(quick: bool = False, out_dir: str | Path | None = None) -> int:
    """Run the demo comparison and print its table.

    Args:
        quick: use 1024 and 2048 tokens instead of 16384 (a smoke run inside the window).
        out_dir: results folder (default ``results/demo`` or ``results/demo-quick``).

    Returns:
        The exit code (0).
    """
    perplexity_methods = demo_methods(PERPLEXITY_METHODS)  # validated before the model loads
    retrieval_methods = demo_methods(RETRIEVAL_METHODS)
    adapter = check_demo_adapter()

    import torch

    from hf_posext.evaluation.passkey import evaluate_passkey
    from hf_posext.evaluation.perplexity import evaluate_perplexity
    from hf_posext.evaluation.report import write_report
    from hf_posext.evaluation.loading import load_model_and_tokenizer

    started = time.time()
    lengths = QUICK_LENGTHS if quick else DEMO_LENGTHS
    out = Path(out_dir or ("results/demo-quick" if quick else "results/demo"))
    print(f"hf-posext demo: {DEMO_MODEL} at {', '.join(map(str, lengths))} tokens (window 8192, factor {DEMO_FACTOR:g}); "
          f"perplexity: {', '.join(PERPLEXITY_METHODS)}; passkey at depth {PASSKEY_DEPTH}: {', '.join(RETRIEVAL_METHODS)}; "
          f"results in {out}/")
    budget = ("about 2 minutes with set-up" if quick else
              "six 16384-token forwards of 78-182 s each on 2 CPU cores, under 15 minutes in all (docs/quality.md)")
    print(f"torch threads: {torch.get_num_threads()}; {budget}.", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model_and_tokenizer(DEMO_MODEL, dtype="float32", device=device)
    config = {"dtype": "float32", "demo": True}
    perplexity = evaluate_perplexity(
        model, tokenizer, data="builtin:python-docs", methods=perplexity_methods, lengths=lengths, factor=DEMO_FACTOR,
        out_dir=out, model_name=DEMO_MODEL, max_segments=1, extra_config=config,
    )
    passkey = evaluate_passkey(
        model, tokenizer, methods=retrieval_methods, lengths=lengths, factor=DEMO_FACTOR, depths=(PASSKEY_DEPTH,), trials=1,
        out_dir=out, model_name=DEMO_MODEL, generate=True, extra_config=config,
    )
    del model  # the fine-tuned model next: the same base weights, patched with the adapter's scaling, LoRA merged
    adapter_methods = demo_methods((f"{adapter.method}+{DEMO_ATTENTION}",))
    print(f"fine-tuned: {DEMO_MODEL} + {_display_path(DEMO_ADAPTER)} ({adapter.method} x{adapter.factor:g}, LoRA merged, "
          f"{DEMO_ATTENTION} stacked on it)", flush=True)
    model, tokenizer = load_model_and_tokenizer(DEMO_MODEL, dtype="float32", device=device, adapter=str(DEMO_ADAPTER))
    adapted_name = f"{DEMO_MODEL}+{_display_path(DEMO_ADAPTER)}"
    adapted_perplexity = evaluate_perplexity(
        model, tokenizer, data="builtin:python-docs", methods=adapter_methods, lengths=lengths, factor=adapter.factor,
        out_dir=out, model_name=adapted_name, max_segments=1, extra_config=config,
    )
    adapted_passkey = evaluate_passkey(
        model, tokenizer, methods=adapter_methods, lengths=lengths, factor=adapter.factor, depths=(PASSKEY_DEPTH,), trials=1,
        out_dir=out, model_name=adapted_name, generate=True, extra_config=config,
    )
    table = demo_table(perplexity.cells, passkey.cells, lengths, (adapted_perplexity.cells, adapted_passkey.cells))
    _, plots = write_report(out)
    (out / "demo.md").write_text(
        f"{DEMO_MODEL} (window 8192), float32, factor {DEMO_FACTOR:g}; perplexity on one window of builtin:python-docs per "
        f"length; passkey at depth {PASSKEY_DEPTH}, one trial (greedy / teacher-forced). Blank: not run (each method runs "
        "where the README recommends it, plus one contrast per task).\n\n" + table + "\n"
    )
    print()
    print(table)
    print("\nperplexity: lower is better. passkey: greedy generation / teacher-forced argmax (ok = passkey retrieved). "
          "Blank: not run in the demo (see bench/results/quality/ for every method at every depth).")
    print(f"results: {perplexity.path}, {passkey.path}, {adapted_perplexity.path}, {adapted_passkey.path}; report: {out / 'report.html'}; plots: {', '.join(p.name for p in plots)}")
    print(f"done in {time.time() - started:.0f} s")
    return 0
