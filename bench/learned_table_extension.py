"""Absolute-position lab: how well does each way of extending a learned table work?

Trains a small GPT-2 (window 256) on a folder of text on CPU, saves it, extends its learned position
table 4x to 1024 positions, and reports perplexity at 256, 512 and 1024 tokens for:

- ``reference``: the unpatched model truncated to its 256 window (sliding window, stride 128, over the
  same tokens: every token is predicted with 128-255 tokens of context);
- ``linear``: hf_posext's ``linear`` (T'[p] = interpolation of T at p/s);
- ``dct-stretch``: band-limited interpolation (every DCT component of the table stretched by s), the
  spectral counterpart of ``linear``, to separate "how to interpolate" from "what to interpolate";
- ``spectral``: the frequency-aware variant (YaRN's ramp on the table's DCT spectrum): components whose
  wavelength along the position axis is short keep their original resolution, long ones are
  interpolated, a linear ramp in between;
- ``linear+ft`` / ``spectral+ft``: each after a short full fine-tune at the new window.

Also ``linear`` and ``spectral`` at s=2 (window 512), without fine-tuning. The spectral ramp is chosen on a
validation slice (never on the test tokens). Writes ``learned_table_extension.json``, ``learned_table_extension.md`` and
``learned_table_extension.png`` under ``--out``.

Run (measured 2026-11-26: pre-training 2500 steps + everything, 2862 s of CPU on a busy 2-core machine;
``--reuse-base`` redoes the evaluations and fine-tunes on the saved model in 1227 s of CPU):

    python bench/learned_table_extension.py --train-steps 2500 --threads 2 --finetune-steps 100 --finetune-lr 1e-4 \
        --data data/books --out bench/results/learned_table_extension
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from fractions import Fraction
from pathlib import Path

HELP_ONLY = __name__ == "__main__" and any(arg in ("-h", "--help") for arg in sys.argv[1:])
if not HELP_ONLY:  # `--help` answers without loading torch (tests/test_bench_help.py)
    import torch
    from tqdm import tqdm

    import hf_posext
    from hf_posext.methods.learned import linear_table

#: The repository's books, found from this script's place.
DEFAULT_DATA = str(Path(__file__).resolve().parent.parent / "data" / "books")


# --------------------------------------------------------------------------------------------------
# The frequency-aware variant (kept here: it ships only with a measured win over linear)
# --------------------------------------------------------------------------------------------------


def dct_basis(length: int, positions: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II basis a_k cos(pi k (x + 1/2) / L) evaluated at positions x (float64).

    Args:
        length: L, the table length the basis belongs to.
        positions: [P] positions, or [P, L] when each component k has its own position (x_k(p)).

    Returns:
        [P, L] matrix B with B[p, k] = a_k cos(pi k (x + 1/2) / L); a_0 = sqrt(1/L), a_k = sqrt(2/L).
    """
    k = torch.arange(length, dtype=torch.float64)
    scale = torch.full((length,), math.sqrt(2.0 / length), dtype=torch.float64)
    scale[0] = math.sqrt(1.0 / length)
    x = positions.to(torch.float64)
    if x.dim() == 1:
        x = x[:, None]
    return scale * torch.cos(math.pi * k * (x + 0.5) / length)


def spectral_table(table: torch.Tensor, new_length: int, factor: Fraction, keep_below: float, interpolate_above: float) -> torch.Tensor:
    """Frequency-aware extension of a learned table (YaRN's ramp applied to the table's DCT spectrum).

    With c = DCT(T) along the position axis, component k has wavelength lambda_k = 2L/k tokens.
    gamma_k = clamp((interpolate_above - lambda_k) / (interpolate_above - keep_below), 0, 1)
    (1: a short wavelength, kept at the original resolution; 0: a long one, interpolated), and

        T'[p] = sum_k c_k a_k cos(pi k (x_k(p) + 1/2) / L),   x_k(p) = p * ((1 - gamma_k) / s + gamma_k).

    With every gamma_k = 0 this is band-limited interpolation ("dct-stretch"); with every gamma_k = 1 it
    continues the table's cosine series past L (a mirror image of the table).

    Args:
        table: [L, d] position rows.
        new_length: rows to produce.
        factor: s.
        keep_below: wavelength (tokens) under which a component keeps its resolution.
        interpolate_above: wavelength over which a component is fully interpolated.
    """
    length = table.shape[0]
    wide = table.detach().to(torch.float64)
    coefficients = dct_basis(length, torch.arange(length)).T @ wide  # [L, d]
    k = torch.arange(length, dtype=torch.float64)
    wavelength = torch.where(k > 0, 2.0 * length / k.clamp(min=1), torch.full_like(k, float("inf")))
    if interpolate_above <= keep_below:
        gamma = (wavelength < keep_below).to(torch.float64)
    else:
        gamma = ((interpolate_above - wavelength) / (interpolate_above - keep_below)).clamp(0, 1)
    step = (1.0 - gamma) / float(factor) + gamma  # [L]
    positions = torch.arange(new_length, dtype=torch.float64)[:, None] * step[None, :]  # [P, L]
    basis = dct_basis(length, positions)
    return (basis @ coefficients).to(table.dtype)


def apply_table(model, rows: torch.Tensor) -> None:
    """Put a precomputed position table into a GPT-2 patched by hf_posext to the same size."""
    with torch.no_grad():
        model.transformer.wpe.weight.copy_(rows)


# --------------------------------------------------------------------------------------------------
# Data, tokenizer, model
# --------------------------------------------------------------------------------------------------


def read_texts(folder: str) -> list[tuple[str, str]]:
    """(name, text) of every .txt file under ``folder``, sorted by name."""
    files = sorted(Path(folder).rglob("*.txt"))
    if not files:
        raise SystemExit(f"No .txt files under {folder!r}: pass --data with a folder of text files.")
    return [(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` (seconds), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   model_max_length=256)


def split_tokens(tokenizer, texts: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Train on the first 90% of each text; the last 10% is split into validation (first 2%) and test."""
    train, validation, test = [], [], []
    eos = tokenizer.eos_token_id
    for _, text in texts:
        ids = tokenizer(text)["input_ids"]
        cut, cut_val = int(len(ids) * 0.9), int(len(ids) * 0.92)
        train += ids[:cut] + [eos]
        validation += ids[cut:cut_val] + [eos]
        test += ids[cut_val:] + [eos]
    return {name: torch.tensor(ids, dtype=torch.long) for name, ids in (("train", train), ("validation", validation), ("test", test))}


def batches(tokens: torch.Tensor, length: int, batch_size: int, steps: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - length - 1, (batch_size,), generator=generator)
        yield torch.stack([tokens[s : s + length] for s in starts])


def train(model, tokens: torch.Tensor, length: int, batch_size: int, steps: int, lr: float, seed: int, desc: str) -> list[float]:
    """AdamW with linear warm-up (5%) and cosine decay; returns the loss of every step."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))
    )
    losses = []
    progress = tqdm(batches(tokens, length, batch_size, steps, seed), total=steps, desc=desc, mininterval=5)
    for ids in progress:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def eval_segments(tokens: torch.Tensor, length: int, eval_tokens: int, repeat: bool = False) -> tuple[torch.Tensor, int]:
    """[count, length] test segments and the first position whose prediction is scored.

    Plain: non-overlapping ``length``-token segments, every token after the first scored. ``repeat``: each
    segment is a ``length/2``-token passage written twice and only the second copy is scored, so a model
    that can look ``length/2`` tokens back can copy it (the lab's long-range retrieval test).
    """
    if not repeat:
        count = max(1, eval_tokens // length)
        return tokens[: count * length].view(count, length), 1
    half = length // 2
    count = max(1, eval_tokens // half)
    passages = tokens[: count * half].view(count, half)
    return torch.cat([passages, passages], dim=1), half


def perplexity(*args, **kwargs) -> float:
    """:func:`_perplexity` without gradients (a wrapper, not ``@torch.no_grad()``: torch loads after ``--help``)."""
    with torch.no_grad():
        return _perplexity(*args, **kwargs)


def _perplexity(model, tokens: torch.Tensor, length: int, eval_tokens: int, window: int | None = None, batch_size: int = 4,
               repeat: bool = False) -> float:
    """Perplexity over the :func:`eval_segments` of ``length`` tokens (positions from the first scored one).

    With ``window`` (the reference), each segment is read through a sliding window of ``window`` tokens
    and stride window/2, and each token is scored once, in the first window where it is new: the same
    tokens are predicted, each with between window/2 and window-1 tokens of context.
    """
    segments, score_from = eval_segments(tokens, length, eval_tokens, repeat)
    count = segments.shape[0]
    total, predicted = 0.0, 0
    for start in range(0, count, batch_size):
        batch = segments[start : start + batch_size]
        if window is None or window >= length:
            logits = model(input_ids=batch).logits[:, score_from - 1 : -1].float()
            targets = batch[:, score_from:]
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
            predicted += targets.numel()
            continue
        stride = window // 2
        scored_until = score_from  # next token position to score
        for begin in range(0, length - 1, stride):
            end = min(begin + window, length)
            if end <= scored_until:
                continue
            piece = batch[:, begin:end]
            logits = model(input_ids=piece).logits[:, :-1].float()
            targets = piece[:, 1:]
            first_new = scored_until - (begin + 1)  # index into targets of the first unscored token
            logits, targets = logits[:, first_new:], targets[:, first_new:]
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
            predicted += targets.numel()
            scored_until = end
            if end == length:
                break
    return math.exp(total / predicted)


# --------------------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------------------


def patched_copy(base_dir: str, method_rows=None, factor: int = 4):
    """Load the saved base model, extend it with hf_posext ``linear``, optionally replace the rows."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(base_dir, attn_implementation="eager")
    model.eval()
    hf_posext.patch(model, "linear", factor=factor)
    if method_rows is not None:
        apply_table(model, method_rows)
    return model


def finetune_with_recipe_trainer(extended, tokenizer, name: str, train_text: str, args: argparse.Namespace):
    """Full fine-tune of an extended model at 1024 tokens with hf_posext's recipe trainer.

    The extended model is saved as a plain 1024-position GPT-2 (its table is just a bigger table) and
    trained by :func:`hf_posext.training.train` with the identity scaling (``linear`` x1), so the linear
    and spectral tables go through the same recipe: AdamW, 5% warm-up, cosine decay, clipping at 1.0.
    Returns the trained model and its logged losses.
    """
    from transformers import GPT2LMHeadModel

    from hf_posext.training import train as recipe_train
    from hf_posext.training.config import config_from_dict

    folder = os.path.join(args.work_dir, f"extended-{name}")
    config = extended.config.to_dict()
    config.pop("hf_posext", None)
    plain = GPT2LMHeadModel(type(extended.config).from_dict(config))
    plain.load_state_dict(extended.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run_dir = os.path.join(args.work_dir, f"finetune-{name}")
    recipe = config_from_dict({
        "model": {"name": folder, "precision": "fp32", "attn_implementation": "eager"},
        "scaling": {"method": "linear", "factor": 1.0},
        "finetune": {"mode": "full"},
        "data": {"source": train_text, "window": 4 * 256},
        "train": {"max_steps": args.finetune_steps, "batch_size": max(1, args.batch_size // 4),
                  "learning_rate": args.finetune_lr, "warmup_steps": max(1, args.finetune_steps // 20),
                  "lr_schedule": "cosine", "weight_decay": 0.01, "adam_beta2": 0.95, "max_grad_norm": 1.0,
                  "seed": args.seed + 1},
        "output": {"dir": run_dir, "checkpoint_every": 0, "log_every": 1},
    })
    recipe_train(recipe, overwrite=True, progress=True)
    with open(os.path.join(run_dir, "log.jsonl")) as handle:
        losses = [json.loads(line)["loss"] for line in handle if '"loss"' in line]
    tuned = GPT2LMHeadModel.from_pretrained(os.path.join(run_dir, "merged"), attn_implementation="eager").eval()
    return tuned, losses


def run(args: argparse.Namespace) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    texts = read_texts(args.data)
    base_dir = os.path.join(args.work_dir, "base")
    reuse = args.reuse_base and os.path.exists(os.path.join(base_dir, "config.json"))
    if reuse:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(base_dir)
    else:
        tokenizer = train_tokenizer([t for _, t in texts], args.vocab_size)
    data = split_tokens(tokenizer, texts)
    print(f"tokens: train {data['train'].numel()}, validation {data['validation'].numel()}, test {data['test'].numel()}")

    window = 256
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=window, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    if reuse:
        # Same data, same seed: the model a previous run of this script trained and saved.
        model = GPT2LMHeadModel.from_pretrained(base_dir, attn_implementation="eager").eval()
        with open(os.path.join(base_dir, "pretrain.json")) as handle:
            saved = json.load(handle)
        pretrain_losses, pretrain_seconds = saved["losses"], saved["seconds"]
    else:
        model = GPT2LMHeadModel(config)
        pretrain_losses = train(model, data["train"], window, args.batch_size, args.train_steps, args.lr, args.seed, "pre-train @256")
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        pretrain_seconds = time.time() - started
        with open(os.path.join(base_dir, "pretrain.json"), "w") as handle:
            json.dump({"losses": pretrain_losses, "seconds": pretrain_seconds, "cpu_seconds": time.process_time()}, handle)

    lengths = [256, 512, 1024]
    results: dict[str, dict[str, float]] = {}
    test, validation = data["test"], data["validation"]
    original_rows = model.transformer.wpe.weight.detach().clone()
    s4, s2 = Fraction(4), Fraction(2)

    repeats: dict[str, dict[str, float]] = {}  # second copy of a repeated passage: can the model look back?

    def measure(name: str, candidate, measured_lengths, reference_window=None) -> None:
        results[name] = {str(n): perplexity(candidate, test, n, args.eval_tokens, window=reference_window) for n in measured_lengths}
        repeats[name] = {str(n): perplexity(candidate, test, n, args.eval_tokens, window=reference_window, repeat=True)
                         for n in measured_lengths}

    measure("reference (256, sliding)", model, lengths, reference_window=window)

    # Choose the spectral ramp on the validation slice (eval-only, at 1024).
    candidates = [(8.0, 32.0), (16.0, 64.0), (32.0, 128.0)]
    choice_scores = {}
    for keep_below, interpolate_above in candidates:
        rows = spectral_table(original_rows, 4 * window, s4, keep_below, interpolate_above)
        candidate = patched_copy(base_dir, rows)
        choice_scores[f"{keep_below:g}/{interpolate_above:g}"] = perplexity(candidate, validation, 1024, args.validation_tokens)
    best = min(choice_scores, key=choice_scores.get)
    keep_below, interpolate_above = (float(v) for v in best.split("/"))
    print(f"spectral ramp on validation (PPL@1024): {choice_scores} -> keep_below={keep_below:g}, interpolate_above={interpolate_above:g}")

    tables = {
        "linear": linear_table(original_rows, 4 * window, s4),
        "dct-stretch": spectral_table(original_rows, 4 * window, s4, 0.0, 0.0),
        "spectral": spectral_table(original_rows, 4 * window, s4, keep_below, interpolate_above),
    }
    exact_rows = torch.equal(tables["linear"][::4], original_rows)
    models = {}
    for name, rows in tables.items():
        models[name] = patched_copy(base_dir, rows)
        measure(f"{name} x4", models[name], lengths)
    for name, rows in (("linear", linear_table(original_rows, 2 * window, s2)),
                       ("spectral", spectral_table(original_rows, 2 * window, s2, keep_below, interpolate_above))):
        half = patched_copy(base_dir, rows, factor=2)
        measure(f"{name} x2", half, lengths[:2])

    finetune_losses = {}
    train_text = os.path.join(args.work_dir, "train.txt")
    with open(train_text, "w", encoding="utf-8") as handle:  # the training split, for the recipe trainer
        handle.write(tokenizer.decode(data["train"].tolist()))
    for name in ("linear", "spectral"):
        tuned, finetune_losses[name] = finetune_with_recipe_trainer(models[name], tokenizer, name, train_text, args)
        measure(f"{name} x4 + fine-tune (lr {args.finetune_lr:g})", tuned, lengths)

    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "settings": {k: v for k, v in vars(args).items()},
        "model": {"layers": args.layers, "width": args.width, "heads": args.heads, "window": window,
                  "vocab": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters())},
        "tokens": {k: int(v.numel()) for k, v in data.items()},
        "pretrain_final_loss": sum(pretrain_losses[-20:]) / min(20, len(pretrain_losses)),
        "pretrain_seconds": round(pretrain_seconds, 1),
        "reused_base_model": reuse,
        "cpu_seconds": round(time.process_time(), 1),
        "finetune_final_loss": {k: sum(v[-10:]) / min(10, len(v)) for k, v in finetune_losses.items()},
        "spectral_ramp_validation_ppl_1024": choice_scores,
        "spectral_ramp": {"keep_below": keep_below, "interpolate_above": interpolate_above},
        "linear_rows_exact_at_multiples_of_s": exact_rows,
        "perplexity": results,
        "repeated_passage_perplexity": repeats,
        "seconds": round(time.time() - started, 1),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
    }


def write_outputs(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "learned_table_extension.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    lengths = ["256", "512", "1024"]
    lines = [
        "| method | PPL@256 | PPL@512 | PPL@1024 |",
        "|---|---:|---:|---:|",
    ]
    for name, row in report["perplexity"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[n]:.2f}" if n in row else "—" for n in lengths) + " |")
    with open(os.path.join(out, "learned_table_extension.md"), "w") as handle:
        handle.write("# Absolute-position lab (learned GPT-2 table, window 256 -> 1024)\n\n")
        handle.write(f"Command: `{report['command']}`  \n")
        model = report["model"]
        handle.write(
            f"Model: GPT-2, {model['layers']} layers, width {model['width']}, {model['heads']} heads, vocab {model['vocab']} "
            f"(BPE trained on the data), {model['parameters']:,} parameters, pre-trained {report['settings']['train_steps']} "
            f"steps at 256 tokens (final loss {report['pretrain_final_loss']:.3f}). Fine-tunes: {report['settings']['finetune_steps']} "
            f"steps at 1024 tokens. Test: {report['settings']['eval_tokens']} tokens per length from held-out text. "
            f"Spectral ramp chosen on validation: keep_below={report['spectral_ramp']['keep_below']:g}, "
            f"interpolate_above={report['spectral_ramp']['interpolate_above']:g}. Total {report['seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU on {report['machine']}.\n\n"
        )
        handle.write("\n".join(lines) + "\n")
        repeats = report.get("repeated_passage_perplexity")
        if repeats:
            handle.write(
                "\nRepeated passage (each test segment is an n/2-token passage written twice; perplexity of the second "
                "copy only). A model that attends n/2 tokens back can copy it; the 256-token reference cannot at "
                "n >= 512.\n\n| method | n=256 | n=512 | n=1024 |\n|---|---:|---:|---:|\n"
            )
            for name, row in repeats.items():
                handle.write(f"| {name} | " + " | ".join(f"{row[n]:.2f}" if n in row else "—" for n in lengths) + " |\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written")
        return
    from matplotlib.lines import Line2D

    from hf_posext.evaluation.plots import method_styles, save_figure

    panels = [("perplexity", "held-out text")]
    if report.get("repeated_passage_perplexity"):
        panels.append(("repeated_passage_perplexity", "second copy of a repeated passage"))
    names = list(report["perplexity"])
    styles = method_styles(names)  # one colour and marker per method, in both panels
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.4), squeeze=False, layout="constrained")
    for axis, (key, label) in zip(axes[0], panels):
        for i, name in enumerate(names):
            row = report[key].get(name, {})
            xs = [int(n) for n in lengths if n in row]
            shift = 2 ** ((i - (len(names) - 1) / 2) * 0.03)  # ties stay visible: methods offset sideways
            colour, marker, filled = styles[name]
            axis.plot([x * shift for x in xs], [row[str(x)] for x in xs], "-" if "fine-tune" in name else "--", marker=marker,
                      color=colour, markerfacecolor=colour if filled else "none")
        axis.axvline(256, color="grey", linestyle=":", linewidth=1.2)
        axis.set_xscale("log", base=2)
        axis.set_xticks([256, 512, 1024], ["256", "512", "1024"])
        axis.minorticks_off()
        axis.set_xlim(256 / 2 ** 0.3, 1024 * 2 ** 0.3)
        axis.set_xlabel("evaluation length (tokens)")
        axis.set_ylabel(f"perplexity ({label})")
        axis.grid(alpha=0.3)
    handles = [Line2D([], [], color=styles[n][0], marker=styles[n][1], markerfacecolor=styles[n][0] if styles[n][2] else "none",
                      linestyle="-" if "fine-tune" in n else "--") for n in names]
    handles.append(Line2D([], [], color="grey", linestyle=":"))
    figure.legend(handles, names + ["original window (256)"], loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    figure.suptitle("Extending a learned position table 256 -> 1024 (small GPT-2)")
    save_figure(figure, os.path.join(out, "learned_table_extension.png"), dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA if os.path.isdir(DEFAULT_DATA) else None,
                        help=f"folder of .txt files (default {DEFAULT_DATA} when present)")
    parser.add_argument("--out", default="bench/results/learned_table_extension", help="where learned_table_extension.{json,md,png} go")
    parser.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_posext_learned_table_extension"),
                        help="where the trained model is saved")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="pre-training sequences per step (fine-tune: a quarter)")
    parser.add_argument("--train-steps", type=int, default=2500)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--finetune-lr", type=float, default=1e-4)
    parser.add_argument("--eval-tokens", type=int, default=16384, help="test tokens per evaluation length")
    parser.add_argument("--validation-tokens", type=int, default=8192)
    parser.add_argument("--reuse-base", action="store_true",
                        help="load the model a previous run saved in --work-dir instead of pre-training again")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a shared 2-core machine: no OpenMP spinning)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.data is None:
        parser.error(f"--data is required ({DEFAULT_DATA} does not exist here)")
    return args


def render(json_path: str, out: str) -> None:
    """Rewrite the markdown table and PNG from a saved ``learned_table_extension.json``."""
    with open(json_path) as handle:
        write_outputs(json.load(handle), out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    write_outputs(report, args.out)
    print(open(os.path.join(args.out, "learned_table_extension.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
