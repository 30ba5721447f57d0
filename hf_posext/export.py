"""Export a model saved by hf_posext so that a serving runtime reads its position scaling right.

Each runtime reads the RoPE fields of ``config.json`` by its own rules (see docs/serving.md for the
evidence). :func:`export` copies a saved folder, rewrites ``config.json`` for one target and refuses,
before writing anything, when the target would serve the model differently from transformers.

Usage::

    hf-posext export SAVED_DIR --for vllm --out SERVE_DIR     (the command: hf_posext.cli.export_command)
    export(saved_dir_or_patched_model, "vllm", serve_dir)     (this module's typed entry point)
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from hf_posext.core.errors import DamagedFileError
from hf_posext.core.loading import check_weight_files
from hf_posext.core.files import check_output_folder, refuse_non_empty_folder, staged_folder
from hf_posext.core.saved_config import (
    flat_rope_parameters,
    set_tokenizer_max_length,
    with_legacy_rope_fields,
    write_json_atomically,
)


TARGETS = ("transformers", "vllm", "sglang", "llama.cpp")
RECORD_KEY = "hf_posext"


class ExportError(ValueError):
    """A request that cannot be exported as asked (the message names the fix)."""


def scaling_record(config: dict[str, Any]) -> dict[str, Any]:
    """The hf_posext scaling record of a saved ``config.json`` (``{"method": "none"}`` when unpatched).

    Args:
        config: the parsed ``config.json``.

    Returns:
        The record written by hf_posext at save time, or a record for an unscaled model.
    """
    record = config.get(RECORD_KEY)
    if isinstance(record, dict):
        return record
    return {"method": "none", "kind": "rope", "factor": 1.0, "params": {}}


def yarn_keys_ignored_by(target: str, params: dict[str, Any]) -> list[str]:
    """The YaRN parameters set in ``params`` that ``target`` does not read as transformers does.

    vLLM 0.33 reads all of them (``YaRNScalingRotaryEmbedding.__init__``). SGLang 0.5.23 reads
    ``mscale``/``mscale_all_dim`` (as a ratio when both are set, where transformers needs both non-zero)
    and ``truncate``, but not ``attention_factor`` (it reads ``attn_factor``). llama.cpp's converter writes
    ``attention_factor`` as ``yarn_attn_factor`` but skips ``mscale_all_dim`` and never reads ``truncate``.
    """
    given = {key for key in ("attention_factor", "mscale", "mscale_all_dim") if params.get(key) is not None}
    if params.get("truncate", True) is False:
        given.add("truncate")
    if target == "sglang":
        ignored = given & {"attention_factor"}
        if {"mscale", "mscale_all_dim"} <= given and not (params["mscale"] and params["mscale_all_dim"]):
            ignored |= {"mscale", "mscale_all_dim"}
        return sorted(ignored)
    if target == "llama.cpp":
        return sorted(given)
    return []


#: YaRN's ramp bounds (Peng et al. 2023, for Llama): what llama.cpp uses whatever the GGUF file says.
DEFAULT_YARN_BETAS = (32.0, 1.0)


def yarn_betas_ignored_by_llama_cpp(params: dict[str, Any]) -> bool:
    """Whether yarn ``params`` set ramp bounds other than 32/1, which llama.cpp serves as 32/1.

    llama.cpp's converter writes ``rope.scaling.yarn_beta_fast``/``yarn_beta_slow``, but its model loader
    reads those keys only for a few architectures (Grok and a few others), not for Llama and its kin: the
    context takes ``yarn_beta_fast``/``yarn_beta_slow`` from its own parameters, 32 and 1 by default, so the
    served ramp differs from the exported one.
    """
    betas = (float(params.get("beta_fast", DEFAULT_YARN_BETAS[0])), float(params.get("beta_slow", DEFAULT_YARN_BETAS[1])))
    return betas != DEFAULT_YARN_BETAS


def _served_rope(record: dict[str, Any], config: dict[str, Any] | None) -> str:
    """What a runtime reading only config.json serves of an attention-level record's model: the RoPE scaling the
    record composes, else the one the config carries (a model saved with yarn x2, patched with STRING), else none."""
    frequency = record.get("frequency_scaling")
    if isinstance(frequency, dict) and frequency.get("method", "none") != "none":
        return f"{frequency['method']} x{float(frequency.get('factor') or 1.0):g}"
    rope = flat_rope_parameters(config) if config else None
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type"))
    if rope_type not in (None, "default"):
        factor = rope.get("factor")
        return f"{rope_type}" + (f" x{float(factor):g}" if factor is not None else "") + " (from config.json)"
    return ""


def serving_problems(record: dict[str, Any], target: str, config: dict[str, Any] | None = None) -> list[str]:
    """Reasons why ``target`` would serve a model with this scaling record differently from transformers.

    Args:
        record: an hf_posext scaling record (see :func:`scaling_record`).
        target: one of :data:`TARGETS`.
        config: the saved ``config.json`` the record is in, to say what a runtime would serve instead.

    Returns:
        One-line problems, each naming the method, the target and a fix; empty when the target serves it exactly.
    """
    if target not in TARGETS:
        raise ExportError(f"unknown export target {target!r}: choose one of {', '.join(TARGETS)}")
    method = record.get("method", "none")
    kind = record.get("kind", "rope")
    params = record.get("params") or {}
    problems = []
    if kind == "attention":
        served = _served_rope(record, config)
        problems.append(f"{method} is applied in attention, not in config.json: {target} would serve "
                        f"{served + ' without ' + method if served else 'the model unscaled'}; serve it with "
                        "hf_posext.load, or re-patch with yarn or ntk")
    elif kind != "rope" and target != "transformers":
        problems.append(f"{method} ({kind} positions) is not a RoPE scaling {target} can read from config.json; "
                        f"serve it with hf_posext.load")
    elif record.get("stock_loadable") is False:
        repatch = ", or re-patch with yarn or ntk" if kind == "rope" else ""
        if target == "transformers":
            problems.append(f"{method}" + (f" ({kind} positions)" if kind != "rope" else "") + ": transformers' "
                            f"from_pretrained cannot rebuild this scaling from config.json and would load the model "
                            f"without it; load it with hf_posext.load{repatch}")
        else:
            problems.append(f"{method}: transformers cannot rebuild this scaling from config.json, so {target} cannot "
                            f"either; serve it with hf_posext.load{repatch}")
    elif method in ("dynamic-ntk", "dynamic-yarn") and target != "transformers":
        problems.append(f"{method} is not served like transformers by {target} (no length-dependent base); "
                        f"re-patch with yarn or ntk")
    elif method == "yarn" and target == "llama.cpp" and yarn_betas_ignored_by_llama_cpp(params):
        problems.append(f"yarn with beta_fast={params.get('beta_fast', 32):g}, beta_slow={params.get('beta_slow', 1):g}: "
                        "llama.cpp's converter writes the betas but its Llama loader does not read them and builds "
                        "the ramp from 32/1, so it would serve another model; re-patch yarn with the default "
                        "beta_fast=32, beta_slow=1, or serve with vLLM or SGLang (they read the betas)")
    elif method == "yarn" and yarn_keys_ignored_by(target, params):
        keys = "/".join(yarn_keys_ignored_by(target, params))
        problems.append(f"yarn's {keys} setting is not read by {target} as transformers reads it; re-patch yarn "
                        f"without it (default attention scaling, truncate=True)")
    elif method == "longrope" and target in ("vllm", "llama.cpp", "sglang"):
        reasons = {
            "vllm": "vLLM applies the long factors at every length once max_model_len exceeds the original window",
            "llama.cpp": "llama.cpp's converter writes no factor tensors for Llama, so it runs unscaled",
            "sglang": "SGLang switches a whole batch to the long factors once any position in it exceeds the "
                      "original window, keeping short-factor keys in the cache",
        }
        problems.append(f"longrope for {target}: {reasons[target]}; re-patch with yarn or llama3")
    return problems


def served_length(record: dict[str, Any], config: dict[str, Any]) -> int:
    """The extended context length of the saved model (its original window times the factor)."""
    original = record.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    return int(round(float(original) * float(record.get("factor") or 1.0)))


def export_config(config: dict[str, Any], target: str) -> dict[str, Any]:
    """The ``config.json`` content ``target`` reads right, plus legacy fields for older readers.

    Args:
        config: the parsed ``config.json`` saved by hf_posext (transformers 5 layout).
        target: one of :data:`TARGETS`.

    Returns:
        A new dict: ``max_position_embeddings`` as the target's length rule needs it, plus the full legacy
        fields of :func:`hf_posext.core.saved_config.with_legacy_rope_fields`. A plain ``save_pretrained``
        writes them only where transformers 5 can still resume training from the folder
        (:func:`~hf_posext.core.saved_config.plain_save_legacy_fields`); folders saved by older hf_posext
        releases lack them.
    """
    record = scaling_record(config)
    if record.get("kind", "rope") != "rope":
        return with_legacy_rope_fields(config)
    result = with_legacy_rope_fields(config)
    rope = flat_rope_parameters(config) or result.get("rope_scaling")  # nested per layer type: the scaled layers'
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "linear":
        original = int(record.get("original_max_position_embeddings") or config["max_position_embeddings"])
        # vLLM and SGLang multiply max_position_embeddings by the factor for linear; llama.cpp's converter
        # copies it to context_length unchanged.
        result["max_position_embeddings"] = served_length(record, config) if target == "llama.cpp" else original
    return result


def _record_and_config(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{path} is not valid JSON ({error}); save the model again") from None
    if not isinstance(config, dict):
        raise DamagedFileError(f"{path} holds a {type(config).__name__}, not a config object; save the model again")
    return scaling_record(config), config


def check_serving(folder_or_model: Any, target: str) -> list[str]:
    """Problems serving a saved folder (or a model patched by hf_posext) with ``target``.

    Args:
        folder_or_model: a folder written by ``save_pretrained`` or a model object with a ``config``.
        target: one of :data:`TARGETS`.

    Returns:
        One-line problems (empty when ``target`` serves the model as transformers does).
    """
    if isinstance(folder_or_model, (str, os.PathLike)):
        record, config = _record_and_config(Path(folder_or_model))
    else:
        config = folder_or_model.config.to_dict()
        record = scaling_record(config)
    return serving_problems(record, target, config)


def _check_destination(source: Path | None, out: Path, overwrite: bool) -> None:
    if source is not None:
        source_path, out_path = source.resolve(), out.resolve()
        if out_path == source_path:
            raise ExportError(f"--out {out} is the source folder: choose a new folder")
        if source_path in out_path.parents:
            raise ExportError(f"--out {out} is inside the source folder {source}: choose a folder outside it")
        if out_path in source_path.parents:
            raise ExportError(f"--out {out} contains the source folder {source}: choose a folder outside it")
    try:
        refuse_non_empty_folder(out, overwrite=overwrite)
    except FileExistsError as error:
        raise ExportError(f"--out {error}") from None
    try:
        check_output_folder(out, "--out", "the exported model")
    except ValueError as error:
        raise ExportError(str(error)) from None



#: The warning ``save_pretrained`` of a patched model gives about transformers 4.x readers; :func:`export` writes
#: the legacy fields it asks for, so it is not shown for the folder export itself saves.
_LEGACY_FIELDS_WARNING = r"the saved config\.json holds its .* scaling only in rope_parameters"


def _resolve_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as an object: a name or folder is loaded (:func:`hf_posext.models.load_tokenizer`)."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from hf_posext.models import load_tokenizer

    try:
        return load_tokenizer(os.fspath(tokenizer))
    except (ValueError, FileNotFoundError) as error:
        raise ExportError(f"tokenizer={os.fspath(tokenizer)!r}: {error}") from None


def export(source: Any, target: str, out: str | os.PathLike, overwrite: bool = False, tokenizer: Any = None) -> Path:
    """Write ``out``: a copy of ``source`` whose config ``target`` serves like transformers.

    Args:
        source: a folder saved by hf_posext (``save_pretrained``) or a model patched by hf_posext.
        target: one of :data:`TARGETS`.
        out: the new folder (must not exist, be empty, or ``overwrite`` must be set; never the source).
        overwrite: replace an existing non-empty ``out``.
        tokenizer: the tokenizer to save beside the model (an object, or a model name or folder to load it
            from), with ``model_max_length`` = the extended window. A source folder's own tokenizer files are
            copied anyway; a model object has none, and a folder without a tokenizer cannot run lm-eval tasks
            (``hf-posext lm-eval`` refuses it), so pass it, e.g. ``tokenizer="smollm2-135m"``.

    Returns:
        The path of the written folder.

    Raises:
        ExportError: before anything is written, when the target cannot serve the model, ``out`` is bad or the
            tokenizer cannot be loaded.

    Example:
        >>> from hf_posext.adapters import load_adapted_model
        >>> export(load_adapted_model("smollm2-135m", adapter), "transformers", "merged", tokenizer="smollm2-135m")
    """
    out = Path(out)
    folder = Path(source) if isinstance(source, (str, os.PathLike)) else None
    if folder is not None and not (folder / "config.json").is_file():
        raise ExportError(f"no saved model folder at {folder} (no config.json): pass a folder written by save_pretrained")
    _check_destination(folder, out, overwrite)
    tokenizer = _resolve_tokenizer(tokenizer)
    if folder is not None:
        check_weight_files(folder)  # a truncated weights file is named, not copied into a served folder
    problems = check_serving(source, target)
    if problems:
        raise ExportError(problems[0])
    with staged_folder(out) as staged:
        if folder is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_LEGACY_FIELDS_WARNING)
                source.save_pretrained(staged)
        else:
            shutil.copytree(folder, staged, dirs_exist_ok=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staged))
        elif folder is None:
            warnings.warn(f"export wrote {out} without a tokenizer (a model object carries none): lm-eval and serving "
                          "runtimes need one; pass tokenizer= (e.g. the base model's name)", stacklevel=2)
        record, config = _record_and_config(staged)
        write_json_atomically(staged / "config.json", export_config(config, target))
        if record.get("kind", "rope") == "rope":
            set_tokenizer_max_length(staged, served_length(record, config))
    return out
