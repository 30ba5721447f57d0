"""How far is the SmolLM2 report card from its sample floor? Reads a card.json, writes what is missing.

    python bench/card_floor.py                     # bench/results/card/card.json -> bench/results/card/FLOOR.md
    python bench/card_floor.py --card bench/results/card/gpu/card.json --floor 50 --floor-32k 50 --out -

The floor (the card's issue, "CPU floor"): every task at least ``--floor`` samples (20) for the original model
inside its window (2048, 4096, 8192) and for yarn x4, the best training-free method x4 and the fine-tuned
headline model at 16384; at 32768 at least ``--floor-32k`` (10) for the headline model and yarn x4. Two cells
may be left out: at 32768 a task marked "beyond the base model" (the card's own mark), and the training-free row
on a task where it scored 0 at 16384. A cell the card lists as skipped (over the model's window) is not needed.
Perplexity counts as one cell (its segments are capped by the text, not by ``--floor``).

Reads the card only (run ``bash bench/card_smollm2.sh combine`` first for the parts' latest samples); no
model is loaded. The table lists every cell the floor needs with what it has, and (for the CPU floor) which
`bash bench/card_smollm2.sh` line fills the missing ones, so a session knows which part to run next.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RETRIEVAL = ("perplexity", "passkey", "needle")
TASKS = (*RETRIEVAL, "niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt",
         "ruler_cwe", "ruler_fwe")
BASE, YARN, BEST = "base, unscaled", "base, yarn ×4", "base, dynamic-ntk ×4"
#: The README's headline row (bench/results/card/README.md, "Which fine-tune is the headline?"): the fine-tune with
#: aggregation practice since card run 27; before it, "fine-tuned, yarn ×4 + string" (the first recipe's fine-tune).
HEADLINE = "fine-tuned with aggregation practice, yarn ×4 + string"


def floor_cells(card: dict[str, Any], *, floor: int = 20, floor_32k: int = 10, base: str = BASE, yarn: str = YARN,
                best: str = BEST, headline: str = HEADLINE) -> list[dict[str, Any]]:
    """Every cell the floor needs: ``{"task", "row", "length", "have", "need", "why", "tier"}``; ``have >= need``
    where met; ``tier`` orders the commands that fill them (`filling_runs`).

    ``why`` says where a cell is not needed ("over the window", "beyond the base model", "0 at 16384"): those
    have ``need`` 0.
    """
    cells = {(c["task"], c["row"], c["length"]): c for c in card.get("cells", [])}
    skipped = {item.get("what") for item in card.get("skipped", [])}
    beyond = {task for task, mark in (card.get("beyond_base_model") or {}).items() if mark}

    def have(task: str, row: str, length: int) -> int:
        cell = cells.get((task, row, length))
        if cell is None:
            return 0
        return 1 if task == "perplexity" else int(cell.get("n") or 0)

    def tier(task: str) -> int:
        """Which cells the floor fills first: 0 a RULER task that counts (the targets are judged there), 1 the
        project's own perplexity, passkey and needle, 2 a task beyond the base model."""
        return 2 if task in beyond else 1 if task in RETRIEVAL else 0

    out = []

    def add(task: str, row: str, length: int, need: int) -> None:
        why = ""
        if f"{row}: {task} at {length}" in skipped:
            need, why = 0, "over the window"
        elif length == 32768 and task in beyond:
            need, why = 0, "beyond the base model"
        elif length == 32768 and row != headline and (task, row, 16384) in cells and task != "perplexity" \
                and float(cells[(task, row, 16384)].get("mean") or 0) == 0 and have(task, row, 16384) >= floor:
            need, why = 0, "0 at 16384"
        out.append({"task": task, "row": row, "length": length, "have": have(task, row, length),
                    "need": 1 if task == "perplexity" and need else need, "why": why, "tier": tier(task)})

    for task in TASKS:
        for length in (2048, 4096, 8192):
            add(task, base, length, floor)
        for row in (yarn, best, headline):
            add(task, row, 16384, floor)
        for row in (headline, yarn):
            add(task, row, 32768, floor_32k)
    return out


#: The RULER tasks `ruler-float32` runs (on a CPU without native bfloat16; `cpu/` holds the other two in bfloat16).
FLOAT32_RULER = ("niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe")


def _command(part: str) -> str:
    """``GRID=floor TASKS=x ruler`` -> ``GRID=floor TASKS=x bash bench/card_smollm2.sh ruler``."""
    *settings, name = part.split()
    return " ".join([*settings, "bash bench/card_smollm2.sh", name])


def filling_part(task: str, row: str, length: int, base: str = BASE) -> tuple[str, str]:
    """The command (CPU) that fills a cell of the floor, and where it runs (a bfloat16 part runs on a CPU with
    native bfloat16 only; elsewhere its float32 twin)."""
    retrieval = task in ("perplexity", "passkey", "needle")
    if length == 32768:
        return _command("tasks32" if retrieval else f"TASKS={task} counting32"), ("any CPU (--dtype auto)" if retrieval else "any CPU (float32)")
    if row == base:
        if retrieval:
            return _command("GRID=base tasks"), "any CPU (float32)"
        return (_command("GRID=base ruler-float32"), "any CPU (float32)") if task in FLOAT32_RULER else (_command("GRID=base ruler"), "native bfloat16")
    if retrieval:
        return _command("tasks-bfloat16"), "native bfloat16; elsewhere `GRID=floor tasks`"
    if task in FLOAT32_RULER:
        return _command(f"GRID=floor TASKS={task} ruler"), "native bfloat16; elsewhere `GRID=floor ruler-float32`"
    return _command(f"GRID=floor TASKS={task} ruler"), "native bfloat16"


def missing_samples(cells: list[dict[str, Any]]) -> int:
    """The RULER samples and passkey/needle trials that ``cells`` still lack. A perplexity cell is one run over the
    book's windows, not samples: it counts as a cell, and adds nothing here."""
    return sum(c["need"] - c["have"] for c in cells if c["have"] < c["need"] and c["task"] != "perplexity")


def filling_runs(cells: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """``(command, where it runs, missing cells)`` for the CPU floor's missing cells, grouped by the command that fills
    them, in FLOOR.md's order: first the commands with cells on a RULER task that counts (the issue's targets are
    judged on those), then perplexity, passkey and needle, then the tasks beyond the base model; within each, the
    fewest missing samples first, so a cell is met as soon as it can be."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        if c["have"] < c["need"]:
            runs.setdefault(filling_part(c["task"], c["row"], c["length"]), []).append(c)
    ordered = sorted(runs.items(), key=lambda item: (min(c["tier"] for c in item[1]), missing_samples(item[1])))
    return [(part, where, group) for (part, where), group in ordered]


def commands_for_this_cpu(runs: list[tuple[str, str, list[dict[str, Any]]]], native_bfloat16: bool) -> tuple[list[str], list[str]]:
    """The commands that fill the missing cells on this CPU, in order, each once; and the ones it cannot run (a
    bfloat16 part with no float32 twin, on a CPU without native bfloat16). A bfloat16 part's float32 twin stands in
    for it where the CPU has no native bfloat16 (FLOOR.md's "elsewhere")."""
    commands: list[str] = []
    cannot: list[str] = []
    for part, where, _cells in runs:
        if native_bfloat16 or where.startswith("any CPU"):
            command = part
        elif "elsewhere `" in where:
            command = _command(where.split("elsewhere `", 1)[1].split("`", 1)[0])
        else:
            cannot.append(part)
            continue
        if command not in commands:
            commands.append(command)
    return commands, cannot


def markdown(cells: list[dict[str, Any]], source: str, parts: bool = True) -> str:
    """FLOOR.md: the cells and, with ``parts``, the CPU runs that fill the missing ones (in `filling_runs`' order)."""
    missing = [c for c in cells if c["have"] < c["need"]]
    samples = missing_samples(missing)
    lines = [f"# The card's sample floor: {len(cells) - len(missing)} of {len(cells)} cells met",
             "",
             f"From `{source}` (`python bench/card_floor.py`). Missing: {len(missing)} cells, {samples} samples"
             " (RULER samples and passkey/needle trials; a perplexity cell counts as a cell, not as samples).",
             ""]
    if parts and missing:
        lines += ["What fills them (each command resumes per sample; `bash bench/card_smollm2.sh floor` runs them all, in this "
                  "order, on this CPU or their float32 twins):", "",
                  "| command | runs on | cells | samples |", "|---|---|---:|---:|"]
        for part, where, group in filling_runs(cells):
            lines.append(f"| `{part}` | {where} | {len(group)} | {missing_samples(group)} |")
        lines.append("")
    lines += ["| task | row | length | have | need | |",
              "|---|---|---:|---:|---:|---|"]
    for c in cells:
        state = c["why"] or ("met" if c["have"] >= c["need"] else "missing")
        lines.append(f"| {c['task']} | {c['row']} | {c['length']} | {c['have']} | {c['need']} | {state} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--card", default="bench/results/card/card.json", help="a card.json (default: the combined SmolLM2 card)")
    parser.add_argument("--floor", type=int, default=20, help="samples a cell up to 16384 (default 20; the GPU's: 50)")
    parser.add_argument("--floor-32k", type=int, default=10, help="samples a cell at 32768 (default 10)")
    parser.add_argument("--best", default=BEST, help=f"the best training-free row's label (default {BEST!r})")
    parser.add_argument("--out", default=None, help="where to write the Markdown table (default FLOOR.md beside the card; - prints it)")
    parser.add_argument("--commands", action="store_true",
                        help="print, one a line, the commands that fill the CPU floor's missing cells on this CPU (float32 twins "
                             "where it has no native bfloat16), in FLOOR.md's order, and write nothing (what `bash "
                             "bench/card_smollm2.sh floor` runs)")
    args = parser.parse_args(argv)
    path = Path(args.card)
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"card_floor: cannot read {path} ({error}); run `bash bench/card_smollm2.sh combine` first", file=sys.stderr)
        return 2
    cells = floor_cells(card, floor=args.floor, floor_32k=args.floor_32k, best=args.best)
    if args.commands:
        if (args.floor, args.floor_32k) != (20, 10):
            print("card_floor: --commands lists the CPU floor's parts (--floor 20 --floor-32k 10); the GPU's floor is "
                  "`bash bench/gpu_session.sh card`'s", file=sys.stderr)
            return 2
        from hf_posext.evaluation.loading import cpu_has_native_bfloat16  # here: --help must not import torch

        commands, cannot = commands_for_this_cpu(filling_runs(cells), cpu_has_native_bfloat16())
        for part in cannot:
            print(f"card_floor: `{part}` needs a CPU with native bfloat16 (this one has none); run it on one", file=sys.stderr)
        sys.stdout.write("".join(f"{command}\n" for command in commands))
        return 0
    # the CPU parts fill the CPU floor; the GPU's (--floor 50) is filled by `bash bench/gpu_session.sh card`
    text = markdown(cells, str(path), parts=args.floor == 20 and args.floor_32k == 10)
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out) if args.out else path.with_name("FLOOR.md")
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text)
    partial.replace(out)
    print(text.splitlines()[0].lstrip("# ") + f": {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
