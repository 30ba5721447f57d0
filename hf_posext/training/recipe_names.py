"""The recipes' former file names, so that a command or script written for an old name still runs.

Each recipe was renamed to say what it does (``TARGET-WHAT-HARDWARE.yaml``, recipes/README.md): ``hf-posext train
--config OLD`` runs the new file and prints one line naming it. The old names are kept for one release.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RENAMED_RECIPES", "renamed_recipe"]

#: Old path (from the repository root) -> new path.
RENAMED_RECIPES: dict[str, str] = {
    "recipes/configs/smollm2-135m/8k_to_32k_stage1_books_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage1-books-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_stage2_retrieval_aggregation_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage2-lookups-and-counting-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_stage2_retrieval_tasks_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage2-hard-lookups-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_stage2_retrieval_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage2-lookups-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_retrieval_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage2-lookups-only-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_retrieval_mixed_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage2-lookups-one-wording-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_lora_pose_long_cpu.yaml": "recipes/configs/smollm2-135m/32k-stage1-books-lr2e-4-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_lora_pose_cpu.yaml": "recipes/configs/smollm2-135m/32k-books-24-steps-cpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_lora_1gpu.yaml": "recipes/configs/smollm2-135m/32k-stage1-books-1gpu.yaml",
    "recipes/configs/smollm2-135m/8k_to_32k_stage2_retrieval_1gpu.yaml": "recipes/configs/smollm2-135m/32k-stage2-lookups-1gpu.yaml",
    "recipes/configs/llama-2-7b/4k_to_32k_lora_pose_1gpu.yaml": "recipes/configs/llama-2-7b/32k-stage1-books-1gpu.yaml",
    "recipes/configs/llama-2-7b/4k_to_32k_stage2_retrieval_1gpu.yaml": "recipes/configs/llama-2-7b/32k-stage2-lookups-1gpu.yaml",
    "recipes/configs/llama-2-7b/4k_to_32k_yarn_full_fsdp.yaml": "recipes/configs/llama-2-7b/32k-full-finetune-8gpu.yaml",
    "recipes/configs/llama-2-7b/4k_to_64k_lora_pose_1gpu.yaml": "recipes/configs/llama-2-7b/64k-stage1-books-1gpu.yaml",
    "recipes/configs/llama-2-7b/4k_to_64k_stage2_retrieval_1gpu.yaml": "recipes/configs/llama-2-7b/64k-stage2-lookups-1gpu.yaml",
    "recipes/configs/llama-3-8b/8k_to_64k_lora_pose_1gpu.yaml": "recipes/configs/llama-3-8b/64k-stage1-books-1gpu.yaml",
    "recipes/configs/llama-3-8b/8k_to_64k_stage2_retrieval_1gpu.yaml": "recipes/configs/llama-3-8b/64k-stage2-lookups-1gpu.yaml",
    "recipes/configs/mistral-7b/8k_to_32k_lora_pose_1gpu.yaml": "recipes/configs/mistral-7b/32k-stage1-books-1gpu.yaml",
    "recipes/configs/mistral-7b/8k_to_32k_stage2_retrieval_1gpu.yaml": "recipes/configs/mistral-7b/32k-stage2-lookups-1gpu.yaml",
    "recipes/configs/qwen3-8b/32k_to_128k_yarn_lora_ulysses_8gpu.yaml": "recipes/configs/qwen3-8b/128k-stage1-books-8gpu.yaml",
    "recipes/configs/qwen3-8b/32k_to_128k_stage2_retrieval_8gpu.yaml": "recipes/configs/qwen3-8b/128k-stage2-lookups-8gpu.yaml",
    "recipes/configs/tiny/lora_pose_cpu.yaml": "recipes/configs/tiny/ci-stage1-cpu.yaml",
    "recipes/configs/tiny/retrieval_stage2_cpu.yaml": "recipes/configs/tiny/ci-stage2-lookups-cpu.yaml",
}


def renamed_recipe(config: str | Path) -> str | None:
    """The new path of a recipe named by its old path (as given, or ending in its old path), else None.

    A file that exists at the given path is never renamed: a user's own recipe of an old name stays theirs.
    """
    given = Path(config)
    if given.exists():
        return None
    text = given.as_posix()
    for old, new in RENAMED_RECIPES.items():
        if text == old or text.endswith("/" + old):
            return text[: len(text) - len(old)] + new
    return None
