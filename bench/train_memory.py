#!/usr/bin/env python
"""Peak memory of one training step on SmolLM2-135M: the a62e044 loop, the Trainer engine's plain loss
(full logits) and its chunked loss; and the longest sequence that trains within a memory limit.

Each (length, variant) runs in a fresh process: LoRA (rank 16 on q/k/v/o), gradient checkpointing
(non-reentrant), float32, SDPA attention, batch 1, one optimizer step, stopped before the final save.
The parent records the child's peak resident memory (``ru_maxrss`` of the child, exact) and its wall
time; the child also samples its own RSS every 2 ms and reports the peak of each phase of the step
(``load`` up to the first forward, ``forward`` up to ``backward()``, ``backward``, ``optimizer``), so a
table row says where the memory went. Each child runs as ``python -P`` in a temporary directory (``python -c``
would put the working directory first on sys.path and import the checkout's package whatever PYTHONPATH
says) and reports the ``hf_posext`` folder it imported; the parent refuses a run from the wrong tree. Variants:

- ``old``: the training package of commit a62e044 (the hand-written accelerate loop before the chunked
  loss), imported from a ``git worktree`` of that commit (``--old-tree``; created when missing);
- ``plain``: today's engine (``PosextTrainer``) with ``train.loss=plain`` (``model(**batch).loss``);
- ``chunked``: today's engine with ``train.loss=chunked`` (the default).

Table (writes ``bench/results/train_memory/train_memory_cpu.json``, merging with what is there, so lengths can be
added one run at a time)::

    nice -n 10 python bench/train_memory.py --lengths 4096,8192,16384,32768 [--variants old,plain,chunked]

Estimated longest length within a limit, from a least-squares line through the table's one-process peaks (no
new runs; written under ``estimates``)::

    python bench/train_memory.py --estimate --limit-gb 20 --mmap-threshold 131072

Longest sequence within a limit (bisection over multiples of ``--step``; a probe whose RSS passes the
limit is killed at once, so the machine never swaps; writes ``bench/results/train_memory/train_longest_cpu.json``)::

    nice -n 10 python bench/train_memory.py --longest --limit-gb 20 --processes 1 --lo 16384 --hi 65536
    nice -n 10 python bench/train_memory.py --longest --limit-gb 20 --processes 3 --step 12288 --lo 12288 --hi 131072

With ``--processes N`` (N > 1) the step runs under DeepSpeed Ulysses (sp_size=N, ZeRO-3, N gloo CPU processes,
transformers' ``Trainer`` with accelerate's ``ParallelismConfig`` as ``tests/sp_driver.py`` drives it, and
the Trainer's own sequence-parallel loss); the limit applies to the SUM of the processes' RSS (the
launcher included), and each process's own peak is recorded too. SmolLM2-135M has 9 attention heads, so
DeepSpeed accepts sp_size 3 or 9, not 2 ("Attention head count 9 is not divisible by SP size 2"), and
the length must be a multiple of sp_size.

Peak RSS does not depend on how busy the CPU is; wall times do (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from longest import bisect_longest, bounds  # noqa: E402  (bench/longest.py)

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "a62e044"
GIB = 2**30
PHASES = ("load", "forward", "backward", "optimizer", "after")

# The child: sample this process's RSS every 2 ms and mark the phases of the step by wrapping the
# model's top-level forward, Tensor.backward and the optimizer's step (the same hooks for both trees).
PROBE = r"""
import json, os, sys, threading, time
import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
try:  # if the machine runs out of memory, the kernel ends this measurement first, not someone else's job
    with open("/proc/self/oom_score_adj", "w") as handle:
        handle.write("1000")
except OSError:
    pass
state = {"phase": "load", "peaks": {}, "at_start": {}}

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE

def enter(phase):
    state["phase"] = phase
    state["at_start"].setdefault(phase, rss())

def sample():
    while True:
        value, phase = rss(), state["phase"]
        if value > state["peaks"].get(phase, 0):
            state["peaks"][phase] = value
        time.sleep(0.002)

threading.Thread(target=sample, daemon=True).start()

def wrap(owner, name, before, after=None):
    original = getattr(owner, name)
    def wrapped(*args, **kwargs):
        enter(before)
        result = original(*args, **kwargs)
        if after:
            enter(after)
        return result
    setattr(owner, name, wrapped)

def report(extra):
    import resource
    import hf_posext
    record = {"package": os.path.dirname(os.path.abspath(hf_posext.__file__)),
              "phase_peak_gib": {k: round(v / 2**30, 3) for k, v in state["peaks"].items()},
              "phase_start_gib": {k: round(v / 2**30, 3) for k, v in state["at_start"].items()},
              "self_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3), **extra}
    print("PROBE " + json.dumps(record), flush=True)

import transformers.models.llama.modeling_llama as llama
wrap(llama.LlamaForCausalLM, "forward", "forward")
wrap(torch.Tensor, "backward", "backward", "optimizer")
for optimizer in (torch.optim.AdamW, torch.optim.Adam):
    wrap(optimizer, "step", "optimizer", "after")
try:
    import deepspeed
    wrap(deepspeed.DeepSpeedEngine, "backward", "backward", "optimizer")
    wrap(deepspeed.DeepSpeedEngine, "step", "optimizer", "after")
except ImportError:
    pass

"""

ENGINE_CHILD = PROBE + r"""
from hf_posext.training.config import load_config
from hf_posext.training.trainer import train
config = load_config(None, json.loads(sys.argv[1]))
began = time.perf_counter()
train(config, stop_at_step=1, progress=False)
report({"train_seconds": round(time.perf_counter() - began, 1)})
"""

# Two processes (torch.distributed.run): the Trainer under DeepSpeed Ulysses, as tests/sp_driver.py.
SP_CHILD = PROBE + r"""
import deepspeed
from transformers import Trainer, TrainingArguments
from hf_posext.training.config import load_config
from hf_posext.training.packing import load_packed_sequences
from hf_posext.training.lora import setup_trainable
from hf_posext.training.config import ParallelismSection
from hf_posext.training.parallel import accelerate_parallelism_config
from hf_posext.training.trainer import SequenceDataset, collate_sequences
from hf_posext.models import load_model, load_tokenizer
import hf_posext
config = load_config(None, json.loads(sys.argv[1]))
sp_size = int(os.environ["WORLD_SIZE"])
deepspeed.init_distributed(dist_backend="gloo")
ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
checkpointing = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"
args = TrainingArguments(output_dir=config.output.dir, max_steps=1, per_device_train_batch_size=1,
                         learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no",
                         **{checkpointing: True, checkpointing + "_kwargs": {"use_reentrant": False}},
                         deepspeed=ds_config, remove_unused_columns=False, dataloader_num_workers=0,
                         parallelism_config=accelerate_parallelism_config(ParallelismSection(sp_size=sp_size, sp_backend="deepspeed")),
                         disable_tqdm=True, seed=0)
tokenizer = load_tokenizer(config.model.name)
model = load_model(config.model.name, dtype=torch.float32, attn_implementation=config.model.attn_implementation)
hf_posext.patch(model, **config.scaling.to_request().patch_kwargs())
model.config.use_cache = False
model = setup_trainable(model, config.finetune, seed=0)
data = load_packed_sequences(config.data, tokenizer, 0, None, progress=False)
trainer = Trainer(model=model, args=args, train_dataset=SequenceDataset(data, 1), data_collator=collate_sequences)
began = time.perf_counter()
trainer.train()
report({"train_seconds": round(time.perf_counter() - began, 1), "rank": int(os.environ["RANK"])})
"""


def overrides(length: int, variant: str, data: str, out: str) -> list[str]:
    """The recipe of one measurement (old and new trees read the same keys)."""
    items = [
        "model.name=smollm2-135m", "model.precision=fp32", "model.attn_implementation=sdpa",
        "model.gradient_checkpointing=true", "scaling.method=yarn", f"scaling.factor={max(4, -(-length // 8192))}",
        "finetune.mode=lora", "finetune.rank=16", "finetune.alpha=32", "finetune.dropout=0.0",
        "finetune.train_embeddings=false", "finetune.train_norms=false",
        # a62e044 names the sample length data.window; today's engine data.sequence_length (the old key warns).
        f"data.source={data}", f"data.{'window' if variant == 'old' else 'sequence_length'}={length}", "data.pose=false",
        f"data.max_tokens={2 * length}",
        # max_steps=2 with stop_at_step=1: one optimizer step, then stop as an interruption would, so the
        # final save/merge (a second model copy) is not part of the measurement.
        "train.max_steps=2", "train.batch_size=1", "train.gradient_accumulation_steps=1", "train.warmup_steps=0",
        f"output.dir={out}", "output.checkpoint_every=0",
    ]
    if variant in ("plain", "chunked"):
        items.append(f"train.loss={variant}")
    return items


def ensure_old_tree(path: Path) -> Path:
    """A worktree of the a62e044 loop at ``path`` (created when missing)."""
    if not (path / "hf_posext" / "training" / "trainer.py").exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), OLD_COMMIT], check=True)
    return path


def tree_rss(process) -> int:
    """Resident bytes of a process and all its descendants (psutil), 0 once gone."""
    import psutil

    total = 0
    try:
        for member in [process, *process.children(recursive=True)]:
            try:
                total += member.memory_info().rss
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        return 0
    return total


def run_probe(length: int, variant: str, data: str, old_tree: Path, processes: int = 1,
              limit_bytes: float | None = None, mmap_threshold: int | None = None) -> dict:
    """One measurement in fresh process(es); kills them when their summed RSS passes ``limit_bytes``.

    Returns a record with ``peak_rss_gib`` (the largest child's ``ru_maxrss``, exact), for several processes
    also ``per_process_peak_rss_gib`` and ``sum_peak_rss_gib`` (sum of each process's own peak: an upper
    bound of the simultaneous sum), ``sampled_sum_peak_gib`` (summed RSS polled every 0.1 s), the phase
    peaks, and ``exceeded_limit`` when killed.
    """
    import psutil

    with tempfile.TemporaryDirectory() as out:
        tree = old_tree if variant == "old" else ROOT
        env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        if mmap_threshold is not None:
            # A fixed glibc mmap threshold: every block from this size up is mmap'ed and given back to the
            # kernel when freed (by default glibc raises the threshold up to 32 MiB as big blocks are freed,
            # and freed heap memory then stays resident).
            env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
        recipe = json.dumps(overrides(length, variant, data, out + "/run"))
        if processes == 1:
            # -P and a neutral working directory: `python -c` would otherwise put the current directory first
            # on sys.path, and run from a checkout the "old" child would import today's package, not the old tree.
            command = [sys.executable, "-P", "-c", ENGINE_CHILD, recipe]
        else:
            script = Path(out) / "sp_child.py"
            script.write_text(SP_CHILD)
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // processes)))
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                       "--master_port", str(_free_port()), str(script), recipe]
        began = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True, cwd=out)
        watched = psutil.Process(child.pid)
        sampled_peak, exceeded = 0, False
        while child.poll() is None:
            current = tree_rss(watched)
            sampled_peak = max(sampled_peak, current)
            if limit_bytes is not None and current > limit_bytes:
                exceeded = True
                os.killpg(child.pid, 9)
                break
            time.sleep(0.1)
        stdout, stderr = child.communicate()
        wall = time.perf_counter() - began
    record = {"length": length, "variant": variant, "processes": processes, "wall_seconds": round(wall, 1),
              "allocator": allocator_name(mmap_threshold),
              "sampled_sum_peak_gib": round(sampled_peak / GIB, 3)}
    if exceeded:
        return {**record, "exceeded_limit": True, "limit_gib": round(limit_bytes / GIB, 3)}
    if child.returncode != 0:
        raise RuntimeError(f"{variant} at {length} tokens ({processes} process(es)) failed:\n{stderr[-3000:]}")
    probes = [json.loads(line[len("PROBE "):]) for line in stdout.splitlines() if line.startswith("PROBE ")]
    if len(probes) != processes:
        raise RuntimeError(f"expected {processes} probe reports, got {len(probes)}:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    check_package(probes, tree)
    peaks = [p["self_peak_rss_gib"] for p in probes]
    record.update(peak_rss_gib=max(peaks), train_seconds=probes[0]["train_seconds"], package=probes[0]["package"],
                  phase_peak_gib=probes[0]["phase_peak_gib"], phase_start_gib=probes[0]["phase_start_gib"])
    if processes > 1:
        record.update(per_process_peak_rss_gib=peaks, sum_peak_rss_gib=round(sum(peaks), 3),
                      per_process_phase_peak_gib=[p["phase_peak_gib"] for p in probes])
    if limit_bytes is not None:
        record.update(exceeded_limit=False, limit_gib=round(limit_bytes / GIB, 3))
    return record


def check_package(probes: list[dict], tree: Path) -> None:
    """Raise unless every child imported ``hf_posext`` from ``tree`` (the variant's checkout).

    Guards the comparison itself: a child that picked up another checkout's package measures the wrong loop.
    """
    expected = (Path(tree) / "hf_posext").resolve()
    for probe in probes:
        if Path(probe["package"]).resolve() != expected:
            raise RuntimeError(f"the child imported hf_posext from {probe['package']}, not from {expected}: "
                               "it measured the wrong tree (check PYTHONPATH and the child's sys.path).")


def default_data() -> Path:
    """The repository's books, ``data/books`` (found from this script's place, whatever the working directory)."""
    return ROOT / "data" / "books"


def allocator_name(mmap_threshold: int | None) -> str:
    return "glibc default" if mmap_threshold is None else f"glibc MALLOC_MMAP_THRESHOLD_={mmap_threshold}"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)


def machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def table(results: list[dict], variants: list[str]) -> str:
    """Markdown: peak RSS per variant and length, the ratios, and the chunked run's phase peaks."""
    by = {(r["length"], r["variant"]): r for r in results}
    lines = ["| tokens | " + " | ".join(f"{v} (GiB)" for v in variants) + " | chunked / old | chunked / plain |",
             "|---:|" + "---:|" * (len(variants) + 2)]
    for length in sorted({r["length"] for r in results}):
        def cell(v: str) -> str:
            if (length, v) not in by:
                return ""
            r = by[(length, v)]
            return f"> {r['sampled_sum_peak_gib']:.2f}" if r.get("exceeded_limit") else f"{r['peak_rss_gib']:.2f}"

        cells = [cell(v) for v in variants]

        def ratio(a: str, b: str) -> str:
            if (length, a) in by and (length, b) in by and not by[(length, a)].get("exceeded_limit"):
                top = by[(length, b)]
                bound = "< " if top.get("exceeded_limit") else ""
                denominator = top["sampled_sum_peak_gib"] if top.get("exceeded_limit") else top["peak_rss_gib"]
                return f"{bound}{by[(length, a)]['peak_rss_gib'] / denominator:.2f}"
            return ""

        lines.append(f"| {length} | " + " | ".join(cells) + f" | {ratio('chunked', 'old')} | {ratio('chunked', 'plain')} |")
    return "\n".join(lines)


def measure_table(args: argparse.Namespace, old_tree: Path) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    path = Path(args.out or ROOT / "bench" / "results" / "train_memory" / "train_memory_cpu.json")
    results = json.loads(path.read_text())["results"] if path.exists() else []
    allocator = allocator_name(args.mmap_threshold)

    def key(r: dict) -> tuple:
        return r["length"], r["variant"], r.get("allocator", "glibc default"), r.get("processes", 1)

    for length in lengths:
        for variant in variants:
            print(f"{variant} at {length} tokens ({allocator}) ...", flush=True)
            limit = args.kill_above_gb * 1e9 if args.kill_above_gb else None
            record = run_probe(length, variant, args.data, old_tree, processes=args.processes, limit_bytes=limit,
                               mmap_threshold=args.mmap_threshold)
            record.update(command="nice -n 10 python bench/train_memory.py " + " ".join(sys.argv[1:]), **machine())
            results = [r for r in results if key(r) != key(record)] + [record]
            write_atomic(path, {"about": __doc__.split("\n\n")[0], "results": sorted(results, key=key)})
            print(json.dumps(record), flush=True)
    for name in sorted({key(r)[2] for r in results}):
        print(f"\n{name}:\n" + table([r for r in results if key(r)[2] == name and key(r)[3] == 1], ["old", "plain", "chunked"]))
    return 0


def measure_longest(args: argparse.Namespace, old_tree: Path) -> int:
    """Bisection over multiples of ``args.step`` in [lo, hi] for the longest length that fits the limit."""
    limit = args.limit_gb * 1e9
    path = Path(args.out or ROOT / "bench" / "results" / "train_memory" / "train_longest_cpu.json")
    payload = json.loads(path.read_text()) if path.exists() else {"searches": {}}
    key = f"{args.processes}proc_{args.variant}_{args.limit_gb:g}GB"
    search = payload["searches"].setdefault(key, {"probes": []})
    search.update(limit_gb=args.limit_gb, processes=args.processes, variant=args.variant,
                  rss_counted="sum of both processes" if args.processes > 1 else "the one process",
                  command="nice -n 10 python bench/train_memory.py " + " ".join(sys.argv[1:]))
    known = {p["length"]: p["fits"] for p in search["probes"]}

    def fits(length: int) -> bool:
        print(f"{args.processes} process(es), {length} tokens ...", flush=True)
        record = run_probe(length, args.variant, args.data, old_tree, processes=args.processes, limit_bytes=limit,
                           mmap_threshold=args.mmap_threshold)
        record.update(machine())
        ok = not record["exceeded_limit"] and record.get("sum_peak_rss_gib", record.get("peak_rss_gib", 0)) * GIB <= limit
        record["fits"] = ok
        search["probes"] = [p for p in search["probes"] if p["length"] != length] + [record]
        known[length] = ok
        search["longest_fitting"], search["shortest_failing"] = bounds(args.lo, args.hi, args.step, known)
        write_atomic(path, payload)
        print(json.dumps(record), flush=True)
        return ok

    search["longest_fitting"], search["shortest_failing"] = bisect_longest(fits, args.lo, args.hi, args.step, known)
    write_atomic(path, payload)
    print(json.dumps({k: search.get(k) for k in ("longest_fitting", "shortest_failing")}))
    return 0


def linear_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (length, peak GiB) points: returns (GiB at zero tokens, GiB per token).

    Raises:
        ValueError: fewer than two distinct lengths.
    """
    lengths = [float(x) for x, _ in points]
    if len(set(lengths)) < 2:
        raise ValueError(f"a line needs peaks at two or more lengths, got {sorted(set(lengths))}")
    mean_x = sum(lengths) / len(lengths)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, (_, y) in zip(lengths, points)) / sum((x - mean_x) ** 2 for x in lengths)
    return mean_y - slope * mean_x, slope


def longest_within(limit_gib: float, base_gib: float, gib_per_token: float, processes: int = 1,
                   summed: bool = False, multiple: int = 1024) -> int:
    """Estimated longest length (a multiple of ``multiple``) whose peak stays within ``limit_gib``.

    One process needs ``base + gib_per_token * L``. Under sequence parallelism each of ``processes`` ranks
    holds 1/N of the tokens: ``base + gib_per_token * L / N`` per rank. ``summed`` applies the limit to the
    sum over the ranks (one host's memory) instead of to each rank (one device's memory each).
    """
    room = limit_gib - (processes * base_gib if summed else base_gib)
    if room <= 0:
        return 0
    tokens = room / gib_per_token * (1 if summed else processes)
    return int(tokens // multiple) * multiple


def estimate(results: list[dict], limit_gb: float, allocator: str = "glibc default", fit_from: int = 0) -> dict:
    """Linear fits of the measured one-process peaks per variant, and the longest lengths they predict.

    ``fit_from``: fit only the peaks at this many tokens or more (with glibc's default allocator the peaks
    below 16384 tokens follow the heap, not the live tensors; see docs/training.md).

    A sequence-parallel record (``processes`` > 1, today's engine) fixes its per-rank base: its largest
    rank's peak less the fitted per-token cost of its 1/N share of the tokens. Everything returned here is
    an extrapolation and says so.
    """
    limit_gib = limit_gb * 1e9 / GIB
    out: dict = {"limit_gb": limit_gb, "limit_gib": round(limit_gib, 3), "allocator": allocator, "fit_from": fit_from,
                 "kind": "estimate: extrapolated from a least-squares line through the measured peaks", "variants": {}}
    single = [r for r in results if r.get("processes", 1) == 1 and not r.get("exceeded_limit")
              and r.get("allocator", "glibc default") == allocator and r["length"] >= fit_from]
    for variant in sorted({r["variant"] for r in single}):
        points = sorted((r["length"], r["peak_rss_gib"]) for r in single if r["variant"] == variant)
        if len({x for x, _ in points}) < 2:
            continue
        base, per_token = linear_fit(points)
        entry = {"measured": [list(p) for p in points], "gib_at_zero_tokens": round(base, 3),
                 "gib_per_1k_tokens": round(per_token * 1024, 4),
                 "longest_1_process": longest_within(limit_gib, base, per_token)}
        for sp in (r for r in results if r.get("processes", 1) > 1 and r["variant"] == variant and not r.get("exceeded_limit")):
            n, rank_peak = sp["processes"], max(sp["per_process_peak_rss_gib"])
            rank_base = rank_peak - per_token * sp["length"] / n
            entry[f"sp{n}"] = {"measured_length": sp["length"], "largest_rank_peak_gib": rank_peak,
                               "rank_base_gib": round(rank_base, 3),
                               "longest_limit_per_process": longest_within(limit_gib, rank_base, per_token, n),
                               "longest_limit_on_the_sum": longest_within(limit_gib, rank_base, per_token, n, summed=True)}
        out["variants"][variant] = entry
    return out


def write_estimate(args: argparse.Namespace) -> int:
    """Add the linear-fit estimates to the table's JSON (under ``estimates``) and print them."""
    path = Path(args.out or ROOT / "bench" / "results" / "train_memory" / "train_memory_cpu.json")
    payload = json.loads(path.read_text())
    allocator = allocator_name(args.mmap_threshold)
    result = estimate(payload["results"], args.limit_gb, allocator, args.fit_from)
    result["command"] = "python bench/train_memory.py " + " ".join(sys.argv[1:])
    name = f"{args.limit_gb:g}GB {allocator}" + (f" from {args.fit_from}" if args.fit_from else "")
    payload.setdefault("estimates", {})[name] = result
    write_atomic(path, payload)
    print(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--variants", default="old,plain,chunked")
    parser.add_argument("--data", default=str(default_data()))
    parser.add_argument("--old-tree", default=str(Path(tempfile.gettempdir()) / f"hf_posext_{OLD_COMMIT}"))
    parser.add_argument("--out", default=None, help="result JSON (default bench/results/train_memory/train_memory_cpu.json, "
                        "or train_longest_cpu.json with --longest)")
    parser.add_argument("--longest", action="store_true", help="bisect the longest length within --limit-gb")
    parser.add_argument("--estimate", action="store_true",
                        help="fit the table's measured peaks (no new runs) and extrapolate the longest length within --limit-gb")
    parser.add_argument("--limit-gb", type=float, default=20.0, help="memory limit in GB (1e9 bytes) for --longest")
    parser.add_argument("--fit-from", type=int, default=0, help="--estimate: fit only the peaks at this many tokens or more")
    parser.add_argument("--processes", type=int, default=1,
                        help="N > 1: DeepSpeed Ulysses sp_size=N on N processes (SmolLM2-135M has 9 attention heads: N=3)")
    parser.add_argument("--variant", default="chunked", help="variant for --longest (old, plain, chunked)")
    parser.add_argument("--lo", type=int, default=4096, help="--longest: a length known to fit")
    parser.add_argument("--hi", type=int, default=131072, help="--longest: the longest length to consider")
    parser.add_argument("--kill-above-gb", type=float, default=None,
                        help="table mode: stop a run once its RSS passes this many GB (recorded as a lower bound)")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="run the child with MALLOC_MMAP_THRESHOLD_=N (a fixed glibc mmap threshold, bytes)")
    parser.add_argument("--step", type=int, default=4096, help="--longest: lengths are multiples of this")
    args = parser.parse_args(argv)
    variants = args.variants.split(",") if not args.longest else [args.variant]
    unknown = set(variants) - {"old", "plain", "chunked"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: choose from old, plain, chunked")
    if args.processes > 1 and "old" in variants:
        parser.error("--processes N > 1 runs today's engine under DeepSpeed Ulysses; the a62e044 loop cannot shard "
                     "sequences (drop 'old' from --variants)")
    if args.processes not in (1, 3, 9):
        parser.error(f"--processes {args.processes}: SmolLM2-135M has 9 attention heads, so Ulysses needs sp_size 3 or 9 (or 1)")
    if not args.longest and any(int(x) % args.processes for x in args.lengths.split(",")):
        parser.error(f"--lengths must be multiples of --processes {args.processes} (each rank takes an equal share)")
    if args.estimate:
        return write_estimate(args)
    if not Path(args.data).exists():
        parser.error(f"no such data folder: {args.data} (give --data a text file or folder)")
    args.data = str(Path(args.data).resolve())  # the children run in a temporary working directory
    old_tree = ensure_old_tree(Path(args.old_tree)) if "old" in variants else Path(args.old_tree)
    return measure_longest(args, old_tree) if args.longest else measure_table(args, old_tree)


if __name__ == "__main__":
    sys.exit(main())
