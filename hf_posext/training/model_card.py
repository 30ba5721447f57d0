"""The model card (README.md) a recipe writes into its adapter folder: what it is, how it was trained, how to
use it, where its measurements are. PEFT's own template is a page of blanks; this one says what the run knows.

It is written for a reader on the hub: the base model is named by its hub id, and no path of the machine that
trained it appears (a local data folder or adapter is named by its last component).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_posext.models import EMBEDDED, EMBEDDED_HUB_IDS, hub_id, looks_like_local_path
from hf_posext.training.config import TrainConfig

__all__ = ["adapter_model_card", "measured_section"]

#: What a card says under "## Measured" when nothing was measured beyond the training loss.
NOT_MEASURED = ("The training run measures nothing but its loss. Evaluations of this adapter, with their commands, are\n"
                "recorded where it is published (hf-posext: `docs/training.md`).")


def _public_name(value: str) -> str:
    """``value`` as a hub reader may see it: a local path shortened to its last component, anything else as given."""
    text = str(value)
    if os.path.isabs(text) or text.startswith((".", "~")) or looks_like_local_path(text) or os.path.exists(text):
        return Path(text.rstrip("/")).name or text
    return text


def measured_section(card: str) -> str | None:
    """The measurements written under ``## Measured`` of an existing card (without the generated note), issue
    references reworded for a hub reader; None when it holds none."""
    if "## Measured" not in card:
        return None
    text = card.split("## Measured", 1)[1].replace(NOT_MEASURED, "").strip()
    text = re.sub(r"issue \d+'s target", "the target set for this adapter", text)
    text = re.sub(r"\s*\(?(?:see )?issue #?\d+\)?", "", text)
    return text or None


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


def adapter_model_card(config: TrainConfig, record: dict[str, Any], log_path: Path, measured: str | None = None) -> str:
    """The adapter's README.md: base model, scaling, recipe, data, training summary, use and measurements.

    Args:
        config: the run's recipe.
        record: the adapter record (:data:`hf_posext.adapters.ADAPTER_RECORD` contents).
        log_path: the run's ``log.jsonl``.
        measured: the text of the "Measured" section (None: say that only the loss was measured).
    """
    base = _BaseNames.of(record["base_model"])
    lines = [*_front_matter(base, record), *_recipe_lines(config, record, _log_summary(log_path)),
             *_use_section(config, record, base), "## Measured", "", measured or NOT_MEASURED, ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class _BaseNames:
    """How the card names the base model: ``name`` as the record gives it, its hub id, and the name a hub reader sees."""

    name: str
    hub: str
    is_hub: bool
    shown: str

    @classmethod
    def of(cls, name: str) -> _BaseNames:
        hub = hub_id(name)
        is_hub = not looks_like_local_path(hub) and not os.path.exists(hub) and hub.count("/") == 1
        return cls(name, hub, is_hub, hub if is_hub else _public_name(name))

    @property
    def embedded(self) -> bool:
        return self.name.strip().lower() in EMBEDDED_HUB_IDS

    @property
    def argument(self) -> str:
        """The name to pass hf-posext: the embedded name, the hub id, or for a local base a placeholder (no machine path)."""
        return self.name if self.embedded else self.hub if self.is_hub else "BASE_MODEL_DIR"


def _front_matter(base: _BaseNames, record: dict[str, Any]) -> list[str]:
    """The YAML header, the title, and the base model and scaling lines."""
    window = record.get("current_window")
    if base.embedded:
        embedded = EMBEDDED[base.name.strip().lower()]
        provenance = (f", as embedded in hf-posext (`{base.name}`: the model's {embedded.quantisation} GGUF dequantised "
                      f"to float32, under {embedded.licence}; the hub's own weights are close to it but not equal, and "
                      "hf-posext's loaders, which check the weights fingerprint in `posext_adapter.json`, refuse them).")
    else:
        provenance = "."
    return ["---"] + ([f"base_model: {base.hub}"] if base.is_hub else []) + [
        "library_name: peft",
        "tags: [hf-posext, long-context, lora]",
        "---",
        "",
        f"# {base.shown} with {record['method']} x{record['factor']:g}: a LoRA adapter for a {window}-token window",
        "",
        f"- **Base model:** `{base.shown}` (window {record.get('original_window')} tokens){provenance}",
        f"- **Scaling:** `{record['method']}` x{record['factor']:g} (parameters {record.get('params') or {}}), window "
        f"{window} tokens. The adapter only works under this scaling: `hf-posext eval --adapter`, "
        "`hf-posext lm-eval` (`peft=`) and `hf_posext.adapters.load_adapted_model` refuse another base or scaling.",
    ]


def _recipe_lines(config: TrainConfig, record: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """What was trained, on which data, from which start, on which schedule, and what the run logged."""
    d, f, t = config.data, config.finetune, config.train
    trained = [f"LoRA r={f.rank}, alpha={f.alpha:g} on {', '.join(f.target_modules)}"]
    if f.train_norms:
        trained.append("the normalisation layers")
    if f.train_embeddings:
        trained.append("the input embeddings (and the tied output head)")
    pose = (f"PoSE: {d.sequence_length}-token sequences whose position ids span [0, {d.pose_target_length or record.get('current_window')})"
            if d.pose else f"full-length {d.sequence_length}-token sequences")
    if d.pose and d.pose_far_fraction:
        pose += f", {d.pose_far_fraction:.0%} of them with their last chunk at the end of that span (data.pose_far_fraction)"
    excluded = f" without {', '.join(_public_name(e) for e in d.exclude)}" if d.exclude else ""
    lines = [f"- **Trained:** {'; '.join(trained)}.", f"- **Data:** `{_public_name(d.source)}`{excluded}; {pose}."]
    if d.retrieval_records:
        lines.append(_retrieval_line(d))
    if f.init_adapter:
        start = Path(str(f.init_adapter).rstrip("/"))
        start_name = f"{start.parent.name}/{start.name}" if start.name == "adapter" and start.parent.name else start.name
        lines.append(f"- **Started from:** the adapter `{start_name}` (its LoRA weights and trained norms/embeddings), "
                     "not a fresh LoRA.")
    lines.append(
        f"- **Schedule:** {t.max_steps} optimizer steps of {t.batch_size} x {t.gradient_accumulation_steps} sequences per process, "
        f"learning rate {t.learning_rate:g} ({t.lr_schedule}, {t.warmup_steps} warm-up steps), seed {t.seed}, loss `{t.loss}`"
        + (", averaged over sequences (each sample weighs the same, `train.loss_average: sequences`)."
           if getattr(t, "loss_average", "tokens") == "sequences" else ".")
    )
    if summary:
        tokens = f", {summary['tokens']:,} tokens" if summary.get("tokens") else ""
        lines.append(f"- **Run:** {summary['steps']} steps{tokens}; training loss {summary['loss_first']:.3f} at the first logged step, "
                     f"{summary['loss_last']:.3f} averaged over the last {summary['last_count']} (`log.jsonl` of the run).")
    return lines


def _retrieval_line(d: Any) -> str:
    """The line on the synthetic retrieval samples of the recipe's data section ``d``."""
    every = d.retrieval_fraction == 1
    share, ask = ("every sample hides", "asks") if every else (f"{d.retrieval_fraction:.0%} of the samples hide", "ask")
    labels = ("every token" if d.retrieval_labels == "all" else
              "their answers only" + (" (the loss below is over answer tokens)" if every else ""))
    wording = (", each record and each question in one of several wordings (`data.retrieval_wording: varied`)"
               if d.retrieval_wording == "varied" else "")
    tasks = list(getattr(d, "retrieval_tasks", ["lookup"]))
    if tasks != ["lookup"]:
        wording += f"; questions drawn from {', '.join(t.replace('_', ' ') for t in tasks)} (`data.retrieval_tasks`)"
    if getattr(d, "retrieval_values", "digits") != "digits":
        wording += "; values codes or two-word phrases"
    if getattr(d, "retrieval_chat", 0.0):
        wording += (f"; {d.retrieval_chat:.0%} of them conversations in the model's chat template (an answer with "
                    "its end-of-turn token)")
    return (f"- **Retrieval samples:** {share} {d.retrieval_records} synthetic key-value records and {ask} "
            f"for them at the end (`hf_posext.training.retrieval_data`){wording}, trained on {labels}.")


def _use_section(config: TrainConfig, record: dict[str, Any], base: _BaseNames) -> list[str]:
    """``## Use``: loading the adapter with hf-posext (Python and CLI), then with stock transformers and PEFT."""
    f = config.finetune
    method, factor, argument = record["method"], record["factor"], base.argument
    extras = " + the trained norms/embeddings (PEFT `modules_to_save`)" if (f.train_norms or f.train_embeddings) else ""
    params = ("".join(f", {k}={v!r}" for k, v in sorted((record.get("params") or {}).items()))
              if method != "yarn" else "")
    return [
        "",
        "## Use",
        "",
        "The base model needs the scaling the adapter was trained with before the adapter goes on. With hf-posext (it checks",
        "the base model, its weights, the scaling and the adapter's files, then merges):",
        "",
        "```python",
        "from hf_posext.adapters import load_adapted_model, save_merged",
        f"model = load_adapted_model({argument!r}, 'ADAPTER_DIR')     # {method} x{factor:g}, adapted, merged",
        f"save_merged({argument!r}, 'ADAPTER_DIR', 'merged')          # the merged model + tokenizer, scaling in config.json",
        "```",
        "",
        "```bash",
        f"hf-posext eval passkey --model {argument} --adapter ADAPTER_DIR --methods {method} "
        f"--lengths {record.get('current_window')}",
        f"hf-posext lm-eval run --model hf-posext --model_args pretrained={argument},peft=ADAPTER_DIR --tasks niah_single_1",
        "```",
        "",
        "With stock transformers and PEFT:",
        "",
        "```python",
        "import hf_posext",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f"base = AutoModelForCausalLM.from_pretrained({(base.hub if base.is_hub else 'BASE_MODEL_DIR')!r})",
        f"hf_posext.patch(base, {method!r}, factor={factor:g}){params}",
        f"model = PeftModel.from_pretrained(base, 'ADAPTER_DIR')     # LoRA{extras}",
        "```",
        "",
    ]
