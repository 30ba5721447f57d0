"""Adapters carry what they were trained on; another base model or scaling is refused before anything loads."""

import json
from pathlib import Path

import pytest
import torch

import hf_posext
from hf_posext.adapters import ADAPTER_RECORD, AdapterMismatchError, check_adapter, load_adapted_model, read_adapter_record
from hf_posext.cli import main
from hf_posext.core.errors import RecordError
from tests.training_helpers import TINY_MODEL, one_thread, tiny_config  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from hf_posext.training.trainer import train

    out = tmp_path_factory.mktemp("adapter-run") / "run"
    train(tiny_config(out, "train.max_steps=4"), progress=False)
    return out


def test_the_recipe_writes_the_record(run):
    record = read_adapter_record(run / "adapter")
    assert (record.base_model, record.method, record.factor) == (str(TINY_MODEL), "yarn", 4.0)
    assert (record.original_window, record.current_window) == (64, 256)


def test_adapter_applied_to_its_base_equals_the_merged_model(run):
    # load_adapted_model rebuilds what the recipe merged: base + yarn x4 + LoRA + trained norms and embeddings
    adapted = load_adapted_model(str(TINY_MODEL), run / "adapter")
    merged = hf_posext.load(run / "merged")
    assert hf_posext.describe(adapted).method == "yarn" and hf_posext.describe(adapted).factor == 4.0
    ids = torch.randint(0, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = adapted(ids).logits, merged(ids).logits
        base = hf_posext.patch(_base_model(), "yarn", 4)(ids).logits
    gap = float((got - want).abs().max())
    effect = float((base - want).abs().max())  # what the adapter changes: the thing this test guards
    assert gap <= 1e-5 and effect >= 100 * max(gap, 1e-7), (gap, effect)


def _base_model():
    from hf_posext.models import load_model

    return load_model(str(TINY_MODEL))


@pytest.mark.parametrize("base,method,factor,expected", [
    ("other-model", None, None, r"trained on base model '.*tiny-llama' \(posext_adapter.json\), not 'other-model': pass --model .*tiny-llama"),
    (None, "dynamic-ntk", None, r"trained with yarn x4 \(posext_adapter.json\), not dynamic-ntk x4: evaluate it with --methods yarn --factor 4"),
    (None, "yarn", 8.0, r"trained with yarn x4 \(posext_adapter.json\), not yarn x8"),
    (None, "none", None, r"not none x4"),
])
def test_another_base_or_scaling_is_refused_naming_both(run, base, method, factor, expected):
    with pytest.raises(AdapterMismatchError, match=expected) as raised:
        check_adapter(run / "adapter", base or str(TINY_MODEL), method, factor)
    assert "\n" not in str(raised.value)


def test_the_eval_command_refuses_a_mismatch_before_loading_or_writing(run, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--methods", "yarn",
            "--factor", "8", "--lengths", "64", "--data", str(TINY_MODEL.parent / "corpus"), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "trained with yarn x4" in err and "not yarn x8" in err and "\n" not in err
    assert not out.exists()


def test_the_eval_command_runs_the_adapter_with_its_scaling(run, tmp_path):
    out = tmp_path / "results"
    # no --factor: the adapter's x4, not longest length / window (128 / 64 = 2)
    argv = ["eval", "perplexity", "--model", str(TINY_MODEL), "--adapter", str(run / "adapter"), "--methods", "yarn",
            "--lengths", "128", "--data", str(TINY_MODEL.parent / "corpus"), "--max-segments", "1",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    (results,) = out.glob("perplexity-*.json")
    data = json.loads(results.read_text())
    assert data["config"]["model"] == f"{TINY_MODEL}+{run / 'adapter'}"
    (cell,) = data["cells"].values()
    assert cell["factor"] == 4.0
    merged = ["eval", "perplexity", "--model", str(run / "merged"), "--methods", "yarn", "--factor", "4", "--lengths", "128",
              "--data", str(TINY_MODEL.parent / "corpus"), "--max-segments", "1", "--out", str(tmp_path / "merged"), "--no-progress"]
    assert main(merged) == 0
    (reference,) = json.loads(next((tmp_path / "merged").glob("perplexity-*.json")).read_text())["cells"].values()
    assert cell["nll"] == pytest.approx(reference["nll"], abs=1e-5)


@pytest.mark.parametrize("content,expected", [
    ("{", "is not readable JSON"),
    ('{"base_model": "m", "method": "yarn", "factor": "4"}', "has factor '4', not a number"),
    ('{"base_model": "m", "method": "yarn", "factor": 0.5}', "not a number >= 1"),
    ('[1]', "holds a JSON list"),
])
def test_a_damaged_record_is_named(run, tmp_path, content, expected):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(run / "adapter", folder)
    (folder / ADAPTER_RECORD).write_text(content)
    with pytest.raises(RecordError, match=expected):
        read_adapter_record(folder)


def test_an_adapter_without_a_record_or_a_folder_that_is_not_an_adapter(run, tmp_path):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(run / "adapter", folder)
    (folder / ADAPTER_RECORD).unlink()
    with pytest.raises(FileNotFoundError, match="has no posext_adapter.json"):
        read_adapter_record(folder)
    with pytest.raises(FileNotFoundError, match="is not a LoRA adapter folder"):
        read_adapter_record(tmp_path)


def test_parameters_are_compared_only_where_given(run):
    # the record holds yarn's resolved defaults (beta_fast=32, ...): not giving them is no mismatch, another value is
    assert check_adapter(run / "adapter", str(TINY_MODEL), "yarn", 4, {}).factor == 4.0
    assert check_adapter(run / "adapter", str(TINY_MODEL), "yarn", 4, {"beta_fast": 32}).method == "yarn"
    with pytest.raises(AdapterMismatchError, match=r"trained with yarn x4 beta_fast=32.0 .*not yarn x4 beta_fast=16"):
        check_adapter(run / "adapter", str(TINY_MODEL), "yarn", 4, {"beta_fast": 16})


def test_the_adapter_folder_carries_a_model_card(run):
    card = (run / "adapter" / "README.md").read_text()
    assert card.startswith("---\nbase_model: ")
    assert "yarn` x4" in card and "window 256 tokens" in card and "PoSE: 32-token sequences" in card
    assert "4 steps" in card and "training loss" in card and "--adapter ADAPTER_DIR --methods yarn" in card


def test_the_model_card_names_far_pose_samples(tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.model_card import adapter_model_card
    from tests.training_helpers import TINY_RECIPE

    record = {"base_model": "tiny", "method": "yarn", "factor": 4.0, "original_window": 64, "current_window": 256}
    plain = adapter_model_card(load_config(TINY_RECIPE), record, tmp_path / "log.jsonl")
    far = adapter_model_card(load_config(TINY_RECIPE, ["data.pose_far_fraction=0.25"]), record, tmp_path / "log.jsonl")
    assert "pose_far_fraction" not in plain
    assert "25% of them with their last chunk at the end of that span (data.pose_far_fraction)" in far


def test_the_model_card_names_the_varied_retrieval_wording(tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.model_card import adapter_model_card
    from tests.training_helpers import TINY_RECIPE

    record = {"base_model": "tiny", "method": "yarn", "factor": 4.0, "original_window": 64, "current_window": 256}
    fixed = adapter_model_card(load_config(TINY_RECIPE, ["data.retrieval_records=2"]), record, tmp_path / "log.jsonl")
    varied = adapter_model_card(load_config(TINY_RECIPE, ["data.retrieval_records=2", "data.retrieval_wording=varied"]),
                                record, tmp_path / "log.jsonl")
    assert "Retrieval samples" in fixed and "retrieval_wording" not in fixed
    assert ("asks for them at the end (`hf_posext.training.retrieval_data`), each record and each question in one of "
            "several wordings (`data.retrieval_wording: varied`), trained on") in varied
