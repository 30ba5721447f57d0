"""Recipe configs: YAML + overrides, type checks, validation, and every shipped config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.training_helpers import REPO, TINY_RECIPE

from hf_posext.training.config import ConfigError, TrainConfig, config_differences, load_config

CONFIGS = sorted((REPO / "recipes" / "configs").rglob("*.yaml"))
ACCELERATE = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


def test_the_shipped_recipes_are_all_found():
    names = {p.relative_to(REPO / "recipes" / "configs").as_posix() for p in CONFIGS}
    assert "tiny/ci-stage1-cpu.yaml" in names
    assert {"smollm2-135m", "llama-2-7b", "llama-3-8b", "mistral-7b"} <= {n.split("/")[0] for n in names}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO / "recipes" / "configs").as_posix())
def test_every_recipe_loads_validates_and_documents_its_launch(path):
    config = load_config(path)
    assert isinstance(config, TrainConfig)
    head = path.read_text().split("\n\n")[0]
    assert head.startswith("#"), "a recipe starts with a comment"
    assert "recipes/finetune.py" in head or "hf-posext train" in head, "the comment gives the launch command"
    assert "Hardware:" in head and "Expected time:" in head
    # every section written in the file is a real section (load_config would have raised otherwise)
    assert set(yaml.safe_load(path.read_text())) <= set(config.to_dict())
    # and the Trainer can express it (bf16 recipes are for GPUs; map them as fp32 here)
    from hf_posext.training.trainer import training_arguments

    if config.model.precision == "bf16":
        config.model.precision = "fp32"
    args = training_arguments(config, "/nonexistent/run", progress=False)
    assert args.max_steps == config.train.max_steps and args.learning_rate == config.train.learning_rate


@pytest.mark.parametrize("path", CONFIGS + ACCELERATE, ids=lambda p: p.relative_to(REPO / "recipes").as_posix())
def test_recipes_name_no_path_of_the_machine_they_were_written_on(path):
    """A user's clone has no /work or home folder: recipes name paths relative to the repository."""
    text = path.read_text()
    for machine_path in ("/work/", "/root/", "/home/", "/tmp/"):
        assert machine_path not in text, f"{path.name} names {machine_path}: use a path relative to the repository"
    source = str(yaml.safe_load(text).get("data", {}).get("source", ""))
    assert not source.startswith("/"), source


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_configs_parse_with_accelerate(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 1
    launch_options = {action.dest for action in launch_command_parser()._actions}
    for section in ("fsdp_config", "deepspeed_config"):
        unknown = [key for key in (getattr(config, section) or {}) if key not in launch_options]
        assert not unknown, f"{path.name}: {section} keys accelerate launch does not know: {unknown}"
    assert path.read_text().startswith("#") and "accelerate launch" in path.read_text().split("\n\n")[0]


def test_fsdp_config_builds_an_fsdp_plugin(monkeypatch):
    """accelerate (1.15) enables FSDP only on GPUs, so on CPU the FSDP config is validated, not run: its
    settings, passed as `accelerate launch` passes them, must build a valid FSDP-2 plugin."""
    from accelerate import FullyShardedDataParallelPlugin

    settings = yaml.safe_load((REPO / "recipes" / "accelerate" / "fsdp.yaml").read_text())
    assert settings["distributed_type"] == "FSDP"
    for key, value in settings["fsdp_config"].items():
        monkeypatch.setenv("FSDP_" + key.removeprefix("fsdp_").upper(), str(value).lower() if isinstance(value, bool) else str(value))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)


def test_overrides_are_typed_and_yaml_parsed():
    config = load_config(TINY_RECIPE, ["train.max_steps=3", "train.learning_rate=2e-5", "finetune.target_modules=[q_proj]",
                                       "scaling.params={beta_fast: 16}", "output.report_to=tensorboard", "data.pose=false"])
    assert config.train.max_steps == 3 and config.train.learning_rate == 2e-5
    assert config.finetune.target_modules == ["q_proj"] and config.scaling.params == {"beta_fast": 16}
    assert config.output.report_to == ["tensorboard"] and config.data.pose is False


@pytest.mark.parametrize("override,suggestion", [
    ("train.max_step=3", "train.max_steps"),
    ("trian.max_steps=3", "train.max_steps"),
    ("lora.rank=4", "finetune.rank"),
    ("rank=4", "finetune.rank"),
    ("data.windw=64", "data.sequence_length"),  # a typo of the former name points to the current one
    ("data.sequence_lenght=64", "data.sequence_length"),
])
def test_unknown_keys_suggest_the_closest(override, suggestion):
    with pytest.raises(ConfigError, match=f"Unknown config key .*Did you mean '{suggestion}'"):
        load_config(TINY_RECIPE, [override])


def test_unknown_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: x\n  precission: fp32\n")
    with pytest.raises(ConfigError, match="'model.precision'"):
        load_config(path)


@pytest.mark.parametrize("override,match", [
    ("train.max_steps=abc", "train.max_steps expects an integer"),
    ("data.pose=maybe", "data.pose expects true or false"),
    ("model.precision=fp8", "model.precision='fp8' is not one of"),
    ("scaling.method=yarm", "Did you mean 'yarn'"),
    ("scaling.target_length=256", "not both"),
    ("data.pose_target_length=16", r"data.sequence_length \(32\) is longer than data.pose_target_length \(16\)"),
    ("data.source=null", "data.source is not set"),
    ("finetune.target_modules=[]", "target_modules is empty"),
    ("train.warmup_steps=99", "warmup_steps must be in .* keep train.max_steps and pass --stop-at-step N"),
    ("model.attn_implementation=flash_attention_2", "Use model.attn_implementation=sdpa"),
    ("train.max_grad_norm=0", "max_grad_norm must be > 0"),
    ("data.pose_far_fraction=1.5", r"data.pose_far_fraction must be a number in \[0, 1\], got 1.5"),
    ("data.pose_far_fraction=true", "data.pose_far_fraction expects a number, got True"),
])
def test_bad_values_are_refused_with_the_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY_RECIPE, [override])


def test_pose_far_fraction_needs_pose():
    with pytest.raises(ConfigError, match="data.pose_far_fraction=0.25 needs data.pose=true"):
        load_config(TINY_RECIPE, ["data.pose=false", "data.pose_far_fraction=0.25"])
    assert load_config(TINY_RECIPE, ["data.pose_far_fraction=0.25"]).data.pose_far_fraction == 0.25


@pytest.mark.parametrize("overrides, named", [
    (["data.retrieval_fraction=0.5"], r"^data.retrieval_fraction=0.5 needs data.retrieval_records > 0: .*so it does nothing"),
    (["data.retrieval_labels=all", "data.retrieval_wording=varied"],
     r"^data.retrieval_labels='all', data.retrieval_wording='varied' need data.retrieval_records > 0"),
])
def test_retrieval_settings_without_retrieval_records_are_refused(overrides, named):
    # Was: accepted with no note that they do nothing
    with pytest.raises(ConfigError, match=named + r".*Set data.retrieval_records \(e.g. 8\) or remove"):
        load_config(TINY_RECIPE, overrides)
    assert load_config(TINY_RECIPE, overrides + ["data.retrieval_records=2"]).data.retrieval_records == 2


@pytest.mark.parametrize("body", ["", "# only a comment\n", "{}\n"])
def test_an_empty_recipe_file_is_named_as_empty(tmp_path, body):
    # Was: an empty recipe was told to "give scaling.factor", as if it were a recipe lacking one key
    path = tmp_path / "recipe.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=rf"^{path} is empty: it sets no section .*copy one from recipes/configs/"):
        load_config(path)
    assert load_config(path, ["scaling.factor=4", "data.source=builtin:python-docs"]).scaling.factor == 4  # overrides make a recipe


def test_missing_config_file_and_malformed_override():
    with pytest.raises(FileNotFoundError, match="not found"):
        load_config("recipes/configs/no/such.yaml")
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(TINY_RECIPE, ["train.max_steps"])


def test_fingerprint_ignores_output_keys_only():
    base = load_config(TINY_RECIPE)
    moved = load_config(TINY_RECIPE, ["output.dir=elsewhere", "output.log_every=5"])
    changed = load_config(TINY_RECIPE, ["finetune.rank=8"])
    assert base.fingerprint() == moved.fingerprint() != changed.fingerprint()
    assert config_differences(base.to_dict(), changed.to_dict()) == ["finetune.rank: 4 -> 8"]


def test_yaml_round_trip(tmp_path):
    config = load_config(TINY_RECIPE, ["train.learning_rate=3e-4"])
    path = tmp_path / "again.yaml"
    path.write_text(config.to_yaml())
    assert load_config(path).to_dict() == config.to_dict()


@pytest.mark.parametrize("body, shown", [("  - method\n  - yarn\n", "a list: ['method', 'yarn']"), (" 4\n", "a int: 4")])
def test_a_section_that_is_not_a_mapping_names_the_section_and_the_form(tmp_path, body, shown):
    # Was: a list under scaling: failed with "dictionary update sequence element #0 has length 6"
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  name: tiny\nscaling:" + ("\n" if body.startswith("  -") else "") + body)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: section 'scaling' must be a mapping of keys (e.g. scaling: yarn:factor=4, or "
                              "{method: yarn, factor: 4}")
    assert shown in message and "\n" not in message


def test_a_scaling_written_as_a_request_is_read_from_the_recipe_file(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  name: tiny\nscaling: yarn:factor=4:beta_fast=16\n")
    scaling = load_config(path, validate=False).scaling
    assert (scaling.method, scaling.factor, scaling.params) == ("yarn", 4.0, {"beta_fast": 16})
    path.write_text("model:\n  name: tiny\nscaling: yarn\n")
    with pytest.raises(ConfigError, match="needs its size"):
        load_config(path, validate=False).scaling.to_request()


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    import re

    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  max_steps: 4\n  learning_rate: [1e-4\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: line \d+, column \d+: not valid YAML") as caught:
        load_config(path)
    assert "<unicode string>" not in str(caught.value) and "\n" not in str(caught.value)


def _recipe_with_data_key(tmp_path, key: str, value: int) -> Path:
    """The tiny recipe written back with ``data.sequence_length`` spelled ``key``."""
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["data"] = {(key if k == "sequence_length" else k): (value if k == "sequence_length" else v)
                    for k, v in data["data"].items()}
    path = tmp_path / f"{key}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_former_data_window_key_still_loads_with_a_future_warning(tmp_path):
    current = load_config(_recipe_with_data_key(tmp_path, "sequence_length", 24))
    with pytest.warns(FutureWarning, match="data.window is now called data.sequence_length"):
        former = load_config(_recipe_with_data_key(tmp_path, "window", 24))
    assert former == current and former.data.sequence_length == 24
    assert "window" not in former.to_dict()["data"]  # saved under the current name from now on
    with pytest.warns(FutureWarning, match="data.window is now called data.sequence_length"):
        overridden = load_config(TINY_RECIPE, ["data.window=24"])
    assert overridden == current
    # an override under the current name replaces a recipe value written under the former one
    with pytest.warns(FutureWarning):
        assert load_config(_recipe_with_data_key(tmp_path, "window", 24), ["data.sequence_length=16"]).data.sequence_length == 16


def test_the_former_and_current_data_key_together_are_refused(tmp_path):
    path = tmp_path / "both.yaml"
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["data"]["window"] = 16
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError, match=r"Give data.sequence_length only \(data.window is its former name\), not both"):
        load_config(path)


def test_a_saved_config_under_the_former_key_counts_as_unchanged_on_resume():
    current = load_config(TINY_RECIPE).to_dict()
    saved = yaml.safe_load(yaml.safe_dump(current))
    saved["data"] = {("window" if k == "sequence_length" else k): v for k, v in saved["data"].items()}
    assert config_differences(saved, current) == []
    saved["data"]["window"] = 16  # the same key with another value is still a difference
    assert config_differences(saved, current) == ["data.sequence_length: 16 -> 32"]


SMOLLM2 = REPO / "recipes" / "configs" / "smollm2-135m"
COMMITTED_RUNS = REPO / "bench" / "results" / "finetune_retrieval_cpu"
#: Settings that name folders: the new recipes write elsewhere and read the books from data/books.
FOLDER_SETTINGS = ("output.dir", "finetune.init_adapter", "data.source")


@pytest.mark.parametrize("recipe, run", [("32k-stage1-books-cpu.yaml", "run-lr6e-4"),
                                         ("32k-stage2-lookups-and-counting-cpu.yaml", "run-retrieval-aggregation"),
                                         ("32k-stage2-lookups-cpu.yaml", "run-retrieval-varied")])
def test_the_two_stage_recipe_is_the_committed_runs_setting_for_setting(recipe, run):
    """The headline adapter's committed run configs (stage 1, and the headline's stage 2 with aggregation practice; the
    first recipe's stage 2 too), rebuilt from the recipes: only folders differ."""
    committed = yaml.safe_load((COMMITTED_RUNS / run / "train_config.yaml").read_text())
    differences = config_differences(committed, load_config(SMOLLM2 / recipe).to_dict())
    assert [d for d in differences if not d.startswith(FOLDER_SETTINGS)] == []
    if committed["data"]["source"] != "data/books":  # the runs before the books shipped read them beside the repository
        assert any(d.startswith("data.source: '../shared/data/books' -> 'data/books'") for d in differences)


def test_stage_2_names_stage_1_and_reads_the_adapter_its_run_writes():
    stage1 = load_config(SMOLLM2 / "32k-stage1-books-cpu.yaml")
    stage2 = load_config(SMOLLM2 / "32k-stage2-lookups-cpu.yaml")
    raw = yaml.safe_load((SMOLLM2 / "32k-stage2-lookups-cpu.yaml").read_text())
    assert raw["finetune"]["init_adapter"] == "recipes/configs/smollm2-135m/32k-stage1-books-cpu.yaml"
    assert stage2.finetune.init_adapter == f"{stage1.output.dir}/adapter" == "runs/smollm2-135m-32k-stage1-books-cpu/adapter"
    # an adapter folder given as an override is taken as it is
    folder = "bench/results/finetune_retrieval_cpu/run-lr6e-4/adapter"
    assert load_config(SMOLLM2 / "32k-stage2-lookups-cpu.yaml", [f"finetune.init_adapter={folder}"]).finetune.init_adapter == folder


def test_a_previous_stage_not_run_yet_is_refused_with_the_command(tmp_path):
    from hf_posext.training.config import check_stage_adapter, stage_adapter_folder

    stage1 = tmp_path / "stage1.yaml"
    stage1.write_text(yaml.safe_dump({"output": {"dir": str(tmp_path / "run1")}}))
    stage2 = tmp_path / "stage2.yaml"
    stage2.write_text(TINY_RECIPE.read_text().replace("finetune:\n", f"finetune:\n  init_adapter: {stage1}\n", 1))
    assert load_config(stage2).finetune.init_adapter == stage_adapter_folder(stage1) == str(tmp_path / "run1" / "adapter")
    with pytest.raises(ConfigError, match=rf"the previous stage has not been run: .* Run `hf-posext train --config {stage1}` first"):
        load_config(stage2, require_previous_stage=True)
    (tmp_path / "run1" / "adapter").mkdir(parents=True)
    (tmp_path / "run1" / "adapter" / "adapter_config.json").write_text("{}")
    assert check_stage_adapter(stage1) == load_config(stage2, require_previous_stage=True).finetune.init_adapter


def test_a_previous_stage_recipe_that_does_not_exist_or_is_this_recipe_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="names the recipe 'no/such/stage1.yaml', which does not exist .*repository root"):
        load_config(TINY_RECIPE, ["finetune.init_adapter=no/such/stage1.yaml"])
    looped = tmp_path / "looped.yaml"
    looped.write_text(TINY_RECIPE.read_text().replace("finetune:\n", f"finetune:\n  init_adapter: {looped}\n", 1))
    with pytest.raises(ConfigError, match="names this recipe itself"):
        load_config(looped)


def test_held_apart_stands_for_the_evaluation_books_and_is_recorded_as_their_names():
    from hf_posext.text_sources import HAYSTACK_BOOK, HELD_APART_BOOKS, PERPLEXITY_BOOK

    assert HELD_APART_BOOKS == (PERPLEXITY_BOOK, HAYSTACK_BOOK) == ("austen-emma.txt", "melville-moby_dick.txt")
    config = load_config(TINY_RECIPE, ["data.exclude=[held-apart, notes.txt]"])
    assert config.data.exclude == [*HELD_APART_BOOKS, "notes.txt"]
    assert "held-apart" not in config.to_yaml()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO / "recipes" / "configs").as_posix())
def test_a_recipe_reads_data_a_fresh_clone_has(path):
    """No recipe needs a folder beside the checkout; a local data.source ships in the repository, and a recipe
    that reads the repository's books leaves the evaluation books out by the one name for them."""
    from hf_posext.text_sources import BOOKS_FOLDER, HELD_APART, HELD_APART_BOOKS

    text = path.read_text()
    assert "../" not in text, f"{path.name} names a path outside the repository"
    raw = yaml.safe_load(text)["data"]
    source = raw["source"]
    local = source.startswith((".", "/")) or "/" in source and (REPO / source.split("/")[0]).is_dir()
    if local:
        assert (REPO / source).exists(), f"{path.name}: data.source {source!r} is not in the repository"
    if source == BOOKS_FOLDER:
        assert raw.get("exclude") == [HELD_APART], f"{path.name}: exclude the evaluation books with [{HELD_APART}]"
        assert all((REPO / BOOKS_FOLDER / name).is_file() for name in HELD_APART_BOOKS)


def test_the_evaluation_books_are_named_in_one_place_in_the_code():
    names = ("austen-emma", "melville-moby_dick")
    found = [p.relative_to(REPO).as_posix() for folder in ("hf_posext", "recipes", "scripts")
             for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".yaml", ".sh")
             and any(name in p.read_text() for name in names)]
    assert found == ["hf_posext/text_sources.py"]
