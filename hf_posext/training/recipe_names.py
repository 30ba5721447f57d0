"""The recipes' former file names, so that a command or script written for an old name still runs.

Each recipe was renamed to say what it does (``TARGET-WHAT-HARDWARE.yaml``, recipes/README.md): ``hf-posext train
--config OLD`` runs the new file and prints one line naming it, and a ``finetune.init_adapter`` naming an old recipe
or a folder under an old recipe's output folder (``runs/OLD/adapter``) is read as the new one, also with one line.
The old names are kept for one release.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RENAMED_RECIPES", "RENAMED_OUTPUT_DIRS", "renamed_recipe", "renamed_output_folder", "recipe_writing"]

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


#: Old output folder (a recipe's ``output.dir`` before the rename) -> the new recipe's ``output.dir``.
RENAMED_OUTPUT_DIRS: dict[str, str] = {
    "runs/smollm2-135m-8k-32k-stage1-books": "runs/smollm2-135m-32k-stage1-books-cpu",
    "runs/smollm2-135m-8k-32k-stage2-retrieval-aggregation": "runs/smollm2-135m-32k-stage2-lookups-and-counting-cpu",
    "runs/smollm2-135m-8k-32k-stage2-retrieval-tasks": "runs/smollm2-135m-32k-stage2-hard-lookups-cpu",
    "runs/smollm2-135m-8k-32k-stage2-retrieval": "runs/smollm2-135m-32k-stage2-lookups-cpu",
    "runs/smollm2-135m-8k-32k-retrieval": "runs/smollm2-135m-32k-stage2-lookups-only-cpu",
    "runs/smollm2-135m-8k-32k-lora-pose-long-retrieval": "runs/smollm2-135m-32k-stage2-lookups-only-cpu",
    "runs/smollm2-135m-8k-32k-retrieval-mixed": "runs/smollm2-135m-32k-stage2-lookups-one-wording-cpu",
    "runs/smollm2-135m-8k-32k-lora-pose-long-retrieval-mixed": "runs/smollm2-135m-32k-stage2-lookups-one-wording-cpu",
    "runs/smollm2-135m-8k-32k-lora-pose-long": "runs/smollm2-135m-32k-stage1-books-lr2e-4-cpu",
    "runs/smollm2-135m-8k-32k-lora-pose": "runs/smollm2-135m-32k-books-24-steps-cpu",
    "runs/smollm2-135m-8k-32k-lora-1gpu": "runs/smollm2-135m-32k-stage1-books-1gpu",
    "runs/smollm2-135m-8k-32k-stage2-retrieval-1gpu": "runs/smollm2-135m-32k-stage2-lookups-1gpu",
    "runs/llama-2-7b-4k-32k-lora-pose": "runs/llama-2-7b-32k-stage1-books-1gpu",
    "runs/llama-2-7b-4k-32k-stage2-retrieval": "runs/llama-2-7b-32k-stage2-lookups-1gpu",
    "runs/llama-2-7b-4k-32k-yarn-full": "runs/llama-2-7b-32k-full-finetune-8gpu",
    "runs/llama-2-7b-4k-64k-lora-pose": "runs/llama-2-7b-64k-stage1-books-1gpu",
    "runs/llama-2-7b-4k-64k-stage2-retrieval": "runs/llama-2-7b-64k-stage2-lookups-1gpu",
    "runs/llama-3-8b-8k-64k-lora-pose": "runs/llama-3-8b-64k-stage1-books-1gpu",
    "runs/llama-3-8b-8k-64k-stage2-retrieval": "runs/llama-3-8b-64k-stage2-lookups-1gpu",
    "runs/mistral-7b-8k-32k-lora-pose": "runs/mistral-7b-32k-stage1-books-1gpu",
    "runs/mistral-7b-8k-32k-stage2-retrieval": "runs/mistral-7b-32k-stage2-lookups-1gpu",
    "runs/qwen3-8b-32k-128k-yarn-lora-ulysses": "runs/qwen3-8b-128k-stage1-books-8gpu",
    "runs/qwen3-8b-32k-128k-stage2-retrieval": "runs/qwen3-8b-128k-stage2-lookups-8gpu",
    "runs/tiny-lora-pose": "runs/tiny-ci-stage1-cpu",
    "runs/tiny-retrieval-stage2": "runs/tiny-ci-stage2-lookups-cpu",
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


def renamed_output_folder(folder: str | Path) -> str | None:
    """The new path of a folder under a renamed recipe's former output folder (``runs/OLD`` or anything under
    it, as given or after a leading folder), else None.

    A folder that exists is never renamed: the output of a run made before the rename stays where it is.

    Example:
        >>> renamed_output_folder("runs/tiny-lora-pose/adapter")
        'runs/tiny-ci-stage1-cpu/adapter'
    """
    given = Path(folder)
    if given.exists():
        return None
    parts = given.parts
    for old, new in RENAMED_OUTPUT_DIRS.items():
        old_parts = Path(old).parts
        for start in range(len(parts) - len(old_parts) + 1):
            if parts[start:start + len(old_parts)] == old_parts:
                return Path(*parts[:start], *Path(new).parts, *parts[start + len(old_parts):]).as_posix()
    return None


def recipe_writing(output_dir: str) -> str | None:
    """The recipe (its path from the repository root) whose ``output.dir`` is ``output_dir``, among the renamed ones."""
    name = Path(output_dir).name
    for new in RENAMED_RECIPES.values():
        model, stem = Path(new).parent.name, Path(new).stem
        if name == f"{model}-{stem}":
            return new
    return None
