"""What a finished run leaves in its folder: ``adapter/`` (PEFT adapter, record, model card, manifest),
``merged/`` (merged or fully fine-tuned model with its tokenizer) and ``scaling.json``.

Each folder is written under a temporary name and renamed into place, so a folder that exists is complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from hf_posext.adapters import (
    apply_adapter, finish_adapter_folder, trained_module_names, write_adapter_record, write_trained_modules,
)
from hf_posext.api import describe
from hf_posext.core.files import staged_folder, write_json_atomic
from hf_posext.core.saved_config import save_tokenizer_with_max_length
from hf_posext.training.config import TrainConfig
from hf_posext.training.loading import load_patched_model
from hf_posext.training.model_card import adapter_model_card
from hf_posext.training.run_folder import LOG_FILE

__all__ = ["save_outputs", "publish_folder", "write_adapter_folder", "merge_adapter", "save_tokenizer_for"]

#: The scaling of the trained model (``hf_posext.describe``), beside adapter/ and merged/.
SCALING_FILE = "scaling.json"


def publish_folder(output_dir: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Have ``write`` fill a temporary folder, then rename it to ``output_dir/name`` (replacing an earlier one).

    Returns:
        The published folder.
    """
    final = output_dir / name
    with staged_folder(final) as staged:  # replaces a previous final save of this same run (re-run after --resume)
        write(staged)
    return final


def write_adapter_folder(folder: Path, config: TrainConfig, model: Any, state_dict: dict[str, Any],
                         base_weights: dict[str, str] | None, log_path: Path) -> None:
    """Write the trained LoRA adapter of ``model`` (a PEFT model) into ``folder``.

    PEFT's own save of the LoRA weights, then the norms/embeddings trained in place added as PEFT
    ``modules_to_save`` (:func:`hf_posext.adapters.write_trained_modules`), the record, the model card and last
    the manifest.

    Args:
        folder: the (temporary) adapter folder.
        config: the run's recipe.
        model: the unwrapped PEFT model.
        state_dict: its full state dict (gathered under FSDP/DeepSpeed).
        base_weights: the fingerprints of the base weights it was trained on.
        log_path: the run's ``log.jsonl``, summarised in the model card.
    """
    from hf_posext.models import hub_id
    from hf_posext.training.lora import extra_parameter_names

    base = model.get_base_model()
    base_names = extra_parameter_names(base, config.finetune.train_embeddings, config.finetune.train_norms)
    model.save_pretrained(str(folder), state_dict=state_dict)
    prefix = "base_model.model."
    extras = {n: state_dict[prefix + n].detach().cpu().contiguous() for n in base_names if prefix + n in state_dict}
    modules, tied = trained_module_names(base, sorted(extras)) if extras else ([], None)
    write_trained_modules(folder, extras, modules, tied, hub_id(config.model.name))
    # what the adapter was trained on, checked whenever it is applied again (hf_posext.adapters)
    record = write_adapter_record(folder, config.model.name, describe(base), base_weights)
    (folder / "README.md").write_text(adapter_model_card(config, json.loads(record.read_text()), log_path))
    finish_adapter_folder(folder)


def save_outputs(config: TrainConfig, accelerator: Any, model: Any, tokenizer: Any, output_dir: Path, dtype: torch.dtype,
                 base_weights: dict[str, str] | None = None) -> None:
    """Write adapter/, merged/ and scaling.json (each through a temporary folder and a rename); every process
    calls it (gathering the state dict is collective), the main process writes.

    Args:
        config: the run's recipe.
        accelerator: the Trainer's accelerator.
        model: the (wrapped) trained model.
        tokenizer: saved with the merged model.
        output_dir: the run folder.
        dtype: the dtype the merged model's base is rebuilt in.
        base_weights: the base weights' fingerprints, recorded with the adapter (LoRA).
    """
    state_dict = accelerator.get_state_dict(model)  # collective under FSDP/DeepSpeed
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    unwrapped = accelerator.unwrap_model(model)
    if config.finetune.mode == "lora":
        adapter_dir = publish_folder(output_dir, "adapter", lambda folder: write_adapter_folder(
            folder, config, unwrapped, state_dict, base_weights, output_dir / LOG_FILE))
        if config.output.save_merged:
            publish_folder(output_dir, "merged", lambda folder: merge_adapter(config, adapter_dir, folder, dtype, tokenizer))
    else:
        def write_full(folder: Path) -> None:
            unwrapped.save_pretrained(str(folder), state_dict=state_dict)
            save_tokenizer_for(unwrapped, tokenizer, folder)

        publish_folder(output_dir, "merged", write_full)
    report = describe(unwrapped.get_base_model() if config.finetune.mode == "lora" else unwrapped)
    write_json_atomic(output_dir / SCALING_FILE, report.to_dict())
    accelerator.wait_for_everyone()


def merge_adapter(config: TrainConfig, adapter_dir: Path, out_dir: Path, dtype: torch.dtype, tokenizer: Any | None = None) -> None:
    """Rebuild the patched base model, apply a saved adapter (+ extras), merge it, and save to ``out_dir``
    with ``tokenizer`` (``model_max_length`` = the scaled window).

    Working from the saved adapter (not the live training model) makes the merged model the same on
    one process, DDP, FSDP or DeepSpeed, and checks that the adapter files are complete.
    """
    base = load_patched_model(config, dtype)
    merged = apply_adapter(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    if tokenizer is not None:
        save_tokenizer_for(merged, tokenizer, out_dir)


def save_tokenizer_for(model: Any, tokenizer: Any, folder: str | Path) -> None:
    """Save ``tokenizer`` next to ``model`` with ``model_max_length`` = the model's extended window
    (serving runtimes cap their length there; docs/serving.md)."""
    save_tokenizer_with_max_length(tokenizer, folder, describe(model).current_window)
