"""``finetune.init_adapter`` naming a recipe by its former name, or a folder under a former output folder: read as
the new one with one ``X is now Y`` line, or refused naming the new folder and the command that writes it."""

from __future__ import annotations

import warnings

import pytest
import yaml

from tests.training_helpers import REPO, TINY_RECIPE

from hf_posext.training.config import ConfigError, load_config
from hf_posext.training.recipe_names import RENAMED_OUTPUT_DIRS, RENAMED_RECIPES, recipe_writing, renamed_output_folder

OLD_STAGE1 = "recipes/configs/smollm2-135m/8k_to_32k_stage1_books_cpu.yaml"
NEW_STAGE1 = "recipes/configs/smollm2-135m/32k-stage1-books-cpu.yaml"


def test_every_former_output_folder_maps_to_the_output_folder_of_a_recipe_that_exists():
    for old, new in RENAMED_OUTPUT_DIRS.items():
        recipe = recipe_writing(new)
        assert recipe in RENAMED_RECIPES.values(), new
        assert yaml.safe_load((REPO / recipe).read_text())["output"]["dir"] == new
    assert renamed_output_folder("runs/smollm2-135m-8k-32k-stage2-retrieval-1gpu/adapter") == \
        "runs/smollm2-135m-32k-stage2-lookups-1gpu/adapter"  # the longer name, not its prefix
    assert renamed_output_folder("/abs/runs/tiny-lora-pose/adapter") == "/abs/runs/tiny-ci-stage1-cpu/adapter"
    assert renamed_output_folder("runs/my-own-run/adapter") is None


def test_a_former_recipe_path_is_read_as_the_new_recipe_with_one_line(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.warns(FutureWarning) as caught:
        config = load_config(TINY_RECIPE, [f"finetune.init_adapter={OLD_STAGE1}"])
    lines = [str(w.message) for w in caught if "init_adapter" in str(w.message)]
    assert lines == [f"finetune.init_adapter: {OLD_STAGE1} is now {NEW_STAGE1} (the old name works for one release); "
                     "rename it in the recipe."]
    assert config.finetune.init_adapter == "runs/smollm2-135m-32k-stage1-books-cpu/adapter"


def test_a_former_output_folder_is_read_as_the_new_one_or_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = "runs/smollm2-135m-8k-32k-stage1-books/adapter"
    new = "runs/smollm2-135m-32k-stage1-books-cpu/adapter"
    with pytest.raises(ConfigError, match=rf"^finetune.init_adapter: {old} does not exist, and its recipe now writes it to "
                                          rf"{new}, which does not exist yet either: run `hf-posext train --config "
                                          rf"{NEW_STAGE1}` first") as refused:
        load_config(TINY_RECIPE, [f"finetune.init_adapter={old}"], require_previous_stage=True)
    assert "\n" not in str(refused.value)
    (tmp_path / new).mkdir(parents=True)
    with pytest.warns(FutureWarning, match=rf"^finetune.init_adapter: {old} is now {new} \(written by {NEW_STAGE1}; the old "
                                           r"name works for one release\)"):
        config = load_config(TINY_RECIPE, [f"finetune.init_adapter={old}"], require_previous_stage=True)
    assert config.finetune.init_adapter == new


def test_a_former_output_folder_that_exists_is_kept_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = "runs/smollm2-135m-8k-32k-stage1-books/adapter"
    (tmp_path / old).mkdir(parents=True)  # a run made before the rename
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert load_config(TINY_RECIPE, [f"finetune.init_adapter={old}"]).finetune.init_adapter == old
