"""Continuing a stage-1 adapter whose trained norms or embeddings the stage-2 recipe turns off is refused before the
model loads, naming the recipe key: the adapter's modules_to_save shows which kinds it trained."""

from __future__ import annotations

import pytest

from tests.training_helpers import one_thread, tiny_config  # noqa: F401  (one_thread: a fixture)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    from hf_posext.training.trainer import train

    out = tmp_path_factory.mktemp("stage1") / "run"
    train(tiny_config(out, "train.max_steps=2"), progress=False)  # LoRA + trained norms and embeddings
    return out / "adapter"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("key, kind", [("finetune.train_norms", "norms"), ("finetune.train_embeddings", "embeddings")])
def test_stage2_without_a_kind_stage1_trained_is_refused_before_loading(stage1, tmp_path, monkeypatch, key, kind):
    import hf_posext.models
    from hf_posext.training.config import ConfigError
    from hf_posext.training.trainer import train

    monkeypatch.setattr(hf_posext.models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    config = tiny_config(tmp_path / "stage2", f"finetune.init_adapter={stage1}", f"{key}=false", "train.max_steps=2")
    with pytest.raises(ConfigError, match=rf"{key}: the adapter holds trained {kind} \(modules_to_save in "
                                          r"adapter_config.json\), the recipe does not train them") as error:
        train(config, progress=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "stage2").exists()


def test_the_kinds_are_told_by_module_names_or_left_to_the_load():
    from hf_posext.training.lora import extra_kinds

    assert extra_kinds(["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"]) == \
        {"norms", "embeddings"}
    assert extra_kinds(["transformer.wte.weight", "transformer.ln_f.bias"]) == {"norms", "embeddings"}
    assert extra_kinds(["model.layers.0.input_layernorm.weight"]) == {"norms"}
    assert extra_kinds(["model.something_else.weight"]) is None
