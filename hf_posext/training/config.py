"""The training recipe config: typed dataclasses loaded from YAML plus ``key=value`` overrides.

A recipe YAML has seven sections (``model``, ``scaling``, ``finetune``, ``data``, ``train``, ``parallelism``,
``output``);
every field below is documented by its ``help``. Overrides use dotted keys, values are read as YAML::

    train.max_steps=10  finetune.rank=16  data.source=my_books/  scaling.factor=4

An unknown key is an error that suggests the closest known key; every value is type-checked and the
whole config is validated before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_posext.core.integrity import stable_digest
from hf_posext.training.sections import (
    RECIPE_SUFFIXES,
    ConfigError,
    DataSection,
    FinetuneSection,
    ModelSection,
    OutputSection,
    ParallelismSection,
    ScalingSection,
    TrainSection,
    names_recipe,
)

__all__ = [
    "ConfigError",
    "check_sections",
    "ModelSection",
    "ScalingSection",
    "FinetuneSection",
    "DataSection",
    "TrainSection",
    "ParallelismSection",
    "OutputSection",
    "TrainConfig",
    "load_config",
    "apply_overrides",
    "RESUME_IGNORED_KEYS",
    "RENAMED_KEYS",
    "upgrade_renamed_keys",
    "current_init_adapter",
    "RECIPE_SUFFIXES",
    "names_recipe",
    "stage_adapter_folder",
    "check_stage_adapter",
]


@dataclass
class TrainConfig:
    """A full training recipe (see the module docstring)."""

    model: ModelSection = field(default_factory=ModelSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    output: OutputSection = field(default_factory=OutputSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """Hash of every setting that changes the trained weights (output/logging keys excluded)."""
        return stable_digest(_resume_relevant(self.to_dict()))

    def validate(self) -> "TrainConfig":
        """Check values that types alone do not catch: each section checks itself, then the checks that span
        sections. Returns self; raises ConfigError."""
        m, s, d, t, p = self.model, self.scaling, self.data, self.train, self.parallelism
        m.validate()
        if d.pose and m.attn_implementation.startswith("flash_attention"):
            raise ConfigError(
                f"data.pose=true with model.attn_implementation={m.attn_implementation!r}: flash-attention kernels "
                "read skipping position ids as boundaries between packed sequences, so PoSE chunks would not see "
                "each other. Use model.attn_implementation=sdpa."
            )
        s.validate(pose=d.pose)
        t.validate()
        if t.loss_average == "sequences" and (p.sequence_parallel or p.context_parallel):
            raise ConfigError(
                "train.loss_average=sequences under sequence or context parallelism: each process holds a shard of "
                "a sequence, not whole sequences. Use train.loss_average=tokens.")
        self.finetune.validate()
        d.validate()
        if (s.target_length is not None and d.pose and d.pose_target_length is None
                and d.sequence_length > s.target_length):
            raise ConfigError(
                f"data.sequence_length ({d.sequence_length}) is longer than the target scaling.target_length "
                f"({s.target_length}). Lower data.sequence_length."
            )
        p.validate()
        self.output.validate()
        return self


#: Former config keys -> their current names. The old spelling still loads, with a FutureWarning, and a run
#: folder saved with it still resumes (the two spellings of one value count as the same setting).
RENAMED_KEYS = {"data.window": "data.sequence_length"}


def upgrade_renamed_keys(data: dict[str, Any], warn: bool = True) -> dict[str, Any]:
    """A copy of a nested config dict with every former key (:data:`RENAMED_KEYS`) under its current name.

    Args:
        data: ``{section: {key: value}}`` as read from YAML (sections that are not mappings are kept as
            they are, for :func:`config_from_dict` to report).
        warn: emit a ``FutureWarning`` for each former key found.

    Returns:
        The upgraded copy; ``data`` itself is not changed.

    Raises:
        ConfigError: a section gives both the former and the current name of one key.
    """
    upgraded = dict(data)
    for old, new in RENAMED_KEYS.items():
        section, old_key = old.split(".")
        new_key = new.split(".")[1]
        body = upgraded.get(section)
        if not isinstance(body, dict) or old_key not in body:
            continue
        if new_key in body:
            raise ConfigError(f"Give {new} only ({old} is its former name), not both.")
        if warn:
            warnings.warn(f"{old} is now called {new}; rename it in the recipe (the old name will be removed).",
                          FutureWarning, stacklevel=3)
        upgraded[section] = {(new_key if key == old_key else key): value for key, value in body.items()}
    return upgraded


# Keys that may change between an interrupted run and its resumption (they do not change the weights).
RESUME_IGNORED_KEYS = ("output",)


def _resume_relevant(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in RESUME_IGNORED_KEYS}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts (resume-relevant sections only)."""
    out = []
    saved = _resume_relevant(upgrade_renamed_keys(saved, warn=False))
    current = _resume_relevant(upgrade_renamed_keys(current, warn=False))
    defaults = _resume_relevant(TrainConfig().to_dict())
    for section in sorted(set(saved) | set(current)):
        # a section added after the checkpoint was written (e.g. parallelism) counts as its defaults there
        # and so does a key added to a section after it (e.g. data.retrieval_records)
        a = {**defaults.get(section, {}), **saved.get(section, {})}
        b = {**defaults.get(section, {}), **current.get(section, {})}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{section}.{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return out


def _sections() -> dict[str, type]:
    return typing.get_type_hints(TrainConfig)


def _known_keys() -> list[str]:
    keys = []
    for section, cls in _sections().items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _unknown(key: str) -> ConfigError:
    known = _known_keys()
    candidates = known + list(RENAMED_KEYS)  # a typo of a former name points to the current one
    close = [RENAMED_KEYS.get(k, k) for k in difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)]
    if not close:  # a right field name in the wrong section, or a section-less key
        leaf = key.rsplit(".", 1)[-1]
        leaves = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.6)
        close = [k for k in known if k.rsplit(".", 1)[-1] in leaves][:1]
    hint = f" Did you mean {close[0]!r}?" if close else f" Known keys: {', '.join(known)}."
    return ConfigError(f"Unknown config key {key!r}.{hint}")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, options[0])
    if value is None:
        raise ConfigError(f"{key} cannot be null; expected {getattr(annotation, '__name__', annotation)}.")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} expects true or false, got {value!r}.")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} expects an integer, got {value!r}.")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 2e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} expects a number, got {value!r}.")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} expects a string, got {value!r}.")
    if annotation is list:
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{key} expects a list, got {value!r}.")
    if annotation is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key} expects a mapping, got {value!r}.")
    return value


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from nested dicts, checking every key and type (not yet validated)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"A recipe config must be a mapping of sections, got {type(data).__name__}.")
    data = expand_scaling_text(data)
    sections = _sections()
    built = {}
    for name, body in upgrade_renamed_keys(data).items():
        if name not in sections:
            raise _unknown(str(name))
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"Section {name!r} must be a mapping of keys, got {body!r}.")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in body.items():
            if key not in hints:
                raise _unknown(f"{name}.{key}")
            values[key] = _coerce(f"{name}.{key}", value, hints[key])
        built[name] = cls(**values)
    return TrainConfig(**built)


def expand_scaling_text(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """``scaling: yarn:factor=4`` (the request grammar, :mod:`hf_posext.core.grammar`) as the mapping the section holds.

    Raises:
        ConfigError: the text is not a valid request (names the fix).
    """
    body = data.get("scaling") if isinstance(data, dict) else None
    if not isinstance(body, str):
        return data
    from hf_posext.core.grammar import parse_request

    try:
        request = parse_request(body, where="scaling:")
    except ValueError as error:
        raise ConfigError(str(error)) from error
    section = {name: value for name, value in request.to_dict().items() if value not in (None, {})}
    return {**data, "scaling": section}


def check_sections(data: dict[str, Any], where: str = "the recipe") -> None:
    """Refuse a section that is not a mapping of keys (a YAML list or a value where ``key: value`` lines belong).

    Raises:
        ConfigError: names the section, what it holds and the form it needs.
    """
    for name, body in (data or {}).items():
        if name == "scaling" and isinstance(body, str):
            continue  # a request in the request grammar (scaling: yarn:factor=4), read by expand_scaling_text
        if body is not None and not isinstance(body, dict):
            example = {"scaling": "yarn:factor=4, or {method: yarn, factor: 4}"}.get(str(name), "{key: value, ...}")
            raise ConfigError(
                f"{where}: section {name!r} must be a mapping of keys (e.g. {name}: {example}, or one `key: value` "
                f"line per key indented under it), got a {type(body).__name__}: {body!r:.80}."
            )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML) to a nested config dict.

    Raises:
        ConfigError: a section that is not a mapping, an override that is not ``key=value`` or names no key.
    """
    data = expand_scaling_text(data)
    check_sections(data)
    data = upgrade_renamed_keys({k: dict(v or {}) for k, v in (data or {}).items()})
    sections = _sections()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} is not key=value (e.g. train.max_steps=10).")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key.count(".") != 1:
            raise _unknown(key)
        if key in RENAMED_KEYS:
            warnings.warn(f"{key} is now called {RENAMED_KEYS[key]}; rename it in the override (the old name "
                          "will be removed).", FutureWarning, stacklevel=2)
            key = RENAMED_KEYS[key]
        section, name = key.split(".")
        if section not in sections or name not in {f.name for f in dataclasses.fields(sections[section])}:
            raise _unknown(key)
        data.setdefault(section, {})[name] = yaml.safe_load(raw) if raw.strip() else None
    return data


def stage_adapter_folder(recipe: str | Path) -> str:
    """The adapter folder that a run of ``recipe`` writes when it finishes: ``<its output.dir>/adapter``.

    Only the recipe's ``output.dir`` is read (with its defaults); the recipe is not validated here.

    Args:
        recipe: a recipe YAML, relative to the current directory (the repository root) or absolute.

    Raises:
        ConfigError: ``recipe`` does not exist or is not a recipe.
    """
    recipe = Path(recipe)
    if not recipe.is_file():
        where = "" if recipe.is_absolute() else f" (relative to the current directory, {Path.cwd()}: run from the repository root)"
        raise ConfigError(f"finetune.init_adapter names the recipe {str(recipe)!r}, which does not exist{where}. "
                          "Name an existing recipe YAML or an adapter folder.")
    return str(Path((_read_recipe(recipe).get("output") or {}).get("dir") or OutputSection().dir) / "adapter")


def check_stage_adapter(recipe: str | Path) -> str:
    """The adapter folder of the previous stage ``recipe``, refusing one whose run has not finished yet.

    Returns:
        The folder, as :func:`stage_adapter_folder` gives it.

    Raises:
        ConfigError: no adapter there yet; the message gives the command that makes it.
    """
    folder = stage_adapter_folder(recipe)
    if not (Path(folder).is_dir() and any(Path(folder).iterdir())):
        raise ConfigError(
            f"finetune.init_adapter: the previous stage has not been run: {recipe} writes its adapter to {folder}, "
            f"which does not exist yet. Run `hf-posext train --config {recipe}` first (or set "
            "finetune.init_adapter=PATH to an adapter folder).")
    return folder


def current_init_adapter(value: str, require_previous_stage: bool = False) -> str:
    """A ``finetune.init_adapter`` as given, or its new name where it names a renamed recipe (its former path) or a
    folder under a renamed recipe's former output folder (``runs/OLD/adapter``); the new name comes with one
    ``FutureWarning`` line, ``X is now Y``. A path that exists is kept as it is.

    Raises:
        ConfigError: (``require_previous_stage``) the former output folder's new one does not exist either; the
            message names it and the command that writes it.
    """
    from hf_posext.training.recipe_names import recipe_writing, renamed_output_folder, renamed_recipe

    if names_recipe(value):
        new = renamed_recipe(value)
        if new is not None:
            warnings.warn(f"finetune.init_adapter: {value} is now {new} (the old name works for one release); "
                          "rename it in the recipe.", FutureWarning, stacklevel=3)
        return value if new is None else new
    new = renamed_output_folder(value)
    if new is None:
        return value
    recipe = recipe_writing(str(Path(new).parent if Path(new).name == "adapter" else new))
    written_by = f"written by {recipe}; " if recipe else ""
    if require_previous_stage and not Path(new).is_dir():
        run = f"run `hf-posext train --config {recipe}` first" if recipe else "run its recipe first"
        raise ConfigError(f"finetune.init_adapter: {value} does not exist, and its recipe now writes it to {new}, which does "
                          f"not exist yet either: {run} (or point finetune.init_adapter at an adapter folder you have).")
    warnings.warn(f"finetune.init_adapter: {value} is now {new} ({written_by}the old name works for one release); "
                  "rename it in the recipe.", FutureWarning, stacklevel=3)
    return new


def _read_recipe(path: Path) -> dict[str, Any]:
    """The sections of a recipe YAML as written (no overrides, no type checks), refusing text that is not one."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}:{line}: not valid YAML ({problem}). Fix the recipe file.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level.")
    check_sections(data, str(path))
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None, validate: bool = True,
                require_previous_stage: bool = False) -> TrainConfig:
    """Read a recipe YAML, apply overrides, check types and (by default) validate.

    A ``finetune.init_adapter`` that names a recipe (stage 1 of a two-stage recipe) is replaced by the adapter
    folder that recipe's run writes (:func:`stage_adapter_folder`), so the config and the run's saved
    ``train_config.yaml`` name the adapter actually continued.

    Args:
        path: the YAML file (None: start from the defaults).
        overrides: ``section.key=value`` strings.
        validate: run :meth:`TrainConfig.validate`.
        require_previous_stage: refuse a ``finetune.init_adapter`` recipe whose run has not written its adapter
            yet, naming the command that does (``hf-posext train`` asks for this; ``--print-config`` does not).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigError: unknown key (with the closest known one), wrong type, invalid value, a previous stage not run.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Recipe config {str(path)!r} not found (see recipes/configs/ for examples).")
        data = _read_recipe(path)
        if not data and not overrides:  # else the first default left unset is named, as if the file were a recipe
            raise ConfigError(f"{path} is empty: it sets no section (model, scaling, data, ...). Write the recipe in it, "
                              "or copy one from recipes/configs/.")
    config = config_from_dict(apply_overrides(data, overrides or []))
    if config.finetune.init_adapter is not None:
        config.finetune.init_adapter = current_init_adapter(str(config.finetune.init_adapter), require_previous_stage)
    previous = config.finetune.init_adapter
    if previous is not None and names_recipe(previous):
        if path is not None and Path(previous).resolve() == path.resolve():
            raise ConfigError(f"{path}: finetune.init_adapter names this recipe itself; name the previous stage's recipe.")
        config.finetune.init_adapter = check_stage_adapter(previous) if require_previous_stage else stage_adapter_folder(previous)
    return config.validate() if validate else config
