"""The model card (README.md) a recipe writes into its adapter folder: what it is, how it was trained, where
its measurements are. PEFT's own template is a page of blanks; this one says what the run knows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_posext.training.config import TrainConfig

__all__ = ["adapter_model_card"]


def _log_summary(log_path: Path) -> dict[str, Any]:
    """Steps, tokens, the first loss and the mean loss of the last (up to) 10 logged steps, from ``log.jsonl`` (empty when absent)."""
    if not log_path.is_file():
        return {}
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        return {}
    last = rows[-10:]
    return {"steps": rows[-1].get("step"), "tokens": rows[-1].get("tokens_seen"),
            "loss_last": sum(r["loss"] for r in last) / len(last), "last_count": len(last), "loss_first": rows[0]["loss"]}


def adapter_model_card(config: TrainConfig, record: dict[str, Any], log_path: Path) -> str:
    """The adapter's README.md: base model, scaling, recipe, data and training summary.

    Args:
        config: the run's recipe.
        record: the adapter record (:data:`hf_posext.adapters.ADAPTER_RECORD` contents).
        log_path: the run's ``log.jsonl``.
    """
    d, f, t = config.data, config.finetune, config.train
    summary = _log_summary(log_path)
    trained = [f"LoRA r={f.rank}, alpha={f.alpha:g} on {', '.join(f.target_modules)}"]
    if f.train_norms:
        trained.append("the normalisation layers")
    if f.train_embeddings:
        trained.append("the input embeddings (and the tied output head)")
    pose = (f"PoSE: {d.sequence_length}-token sequences whose position ids span [0, {d.pose_target_length or record.get('current_window')})"
            if d.pose else f"full-length {d.sequence_length}-token sequences")
    if d.pose and d.pose_far_fraction:
        pose += f", {d.pose_far_fraction:.0%} of them with their last chunk at the end of that span (data.pose_far_fraction)"
    lines = [
        "---",
        f"base_model: {record['base_model']}",
        "library_name: peft",
        "tags: [hf-posext, long-context, lora]",
        "---",
        "",
        f"# {record['base_model']} with {record['method']} x{record['factor']:g}: a LoRA adapter for a "
        f"{record.get('current_window')}-token window",
        "",
        f"- **Base model:** `{record['base_model']}` (window {record.get('original_window')} tokens).",
        f"- **Scaling:** `{record['method']}` x{record['factor']:g} (parameters {record.get('params') or {}}), window "
        f"{record.get('current_window')} tokens. The adapter only works under this scaling: `hf-posext eval --adapter` and "
        "`hf_posext.adapters.load_adapted_model` refuse another base or scaling.",
        f"- **Trained:** {'; '.join(trained)}.",
        f"- **Data:** `{d.source}`" + (f" without {', '.join(d.exclude)}" if d.exclude else "") + f"; {pose}.",
    ]
    if d.retrieval_records:
        every = d.retrieval_fraction == 1
        share, ask = ("every sample hides", "asks") if every else (f"{d.retrieval_fraction:.0%} of the samples hide", "ask")
        labels = ("every token" if d.retrieval_labels == "all" else
                  "their answers only" + (" (the loss below is over answer tokens)" if every else ""))
        wording = (", each record and each question in one of several wordings (`data.retrieval_wording: varied`)"
                   if d.retrieval_wording == "varied" else "")
        lines.append(f"- **Retrieval samples:** {share} {d.retrieval_records} synthetic key-value records and {ask} "
                     f"for them at the end (`hf_posext.training.retrieval_data`){wording}, trained on {labels}.")
    if f.init_adapter:
        lines.append(f"- **Started from:** the adapter `{f.init_adapter}` (its LoRA weights and trained norms/embeddings), "
                     "not a fresh LoRA.")
    lines += [
        f"- **Schedule:** {t.max_steps} optimizer steps of {t.batch_size} x {t.gradient_accumulation_steps} sequences per process, "
        f"learning rate {t.learning_rate:g} ({t.lr_schedule}, {t.warmup_steps} warm-up steps), seed {t.seed}, loss `{t.loss}`"
        + (", averaged over sequences (each sample weighs the same, `train.loss_average: sequences`)."
           if getattr(t, "loss_average", "tokens") == "sequences" else "."),
    ]
    if summary:
        tokens = f", {summary['tokens']:,} tokens" if summary.get("tokens") else ""
        lines.append(f"- **Run:** {summary['steps']} steps{tokens}; training loss {summary['loss_first']:.3f} at the first logged step, "
                     f"{summary['loss_last']:.3f} averaged over the last {summary['last_count']} (`log.jsonl` of the run).")
    lines += [
        "",
        "## Use",
        "",
        "```bash",
        f"hf-posext eval passkey --model {record['base_model']} --adapter ADAPTER_DIR --methods {record['method']} "
        f"--lengths {record.get('current_window')}",
        "```",
        "",
        "```python",
        "from hf_posext.adapters import load_adapted_model",
        f"model = load_adapted_model({record['base_model']!r}, 'ADAPTER_DIR')   # patched, adapted, merged",
        "```",
        "",
        "## Measured",
        "",
        "The training run measures nothing but its loss. Evaluations of this adapter, with their commands, are",
        "recorded where it is published (hf-posext: `docs/training.md`).",
        "",
    ]
    return "\n".join(lines)
