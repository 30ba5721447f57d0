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
import hashlib
import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
    "RECIPE_SUFFIXES",
    "names_recipe",
    "stage_adapter_folder",
    "check_stage_adapter",
]


def _check_scaling_method(method: str, pose: bool) -> None:
    """``scaling.method``: a registered method, or a composition (``yarn+string``) whose attention part trains exactly.

    STRING splits near and far keys by their order in the sequence, which equals their distance only when the
    position ids count up by one: PoSE's skipping ids break that, so a composition is refused under PoSE and
    kept for evaluation. Self-Extend's and DCA's kernels are not checked for training.
    """
    from hf_posext.methods import available_methods, split_composition

    try:
        parts = split_composition(method) if isinstance(method, str) else None
    except ValueError as error:
        raise ConfigError(f"scaling.method: {error}") from None
    if parts is None:
        _choice("scaling.method", method, tuple(available_methods()))
        return
    frequency, attention = parts
    evaluation = (f"train with scaling.method: {frequency} and put {attention} on at evaluation (hf-posext eval ... "
                  f"--methods {frequency}+{attention}, or posext={frequency}+{attention}:factor=F in lm-eval)")
    if pose:
        raise ConfigError(
            f"scaling.method={method} with data.pose=true: {attention} tells near keys from far ones by their order in the "
            f"sequence, which PoSE's skipping position ids break, so training would not be exact; {evaluation}.")
    if attention != "string":
        raise ConfigError(f"scaling.method={method}: {attention}'s kernels are not checked for training; {evaluation}.")


class ConfigError(ValueError):
    """A recipe config that cannot be used as written (the message says what to change)."""


def _help(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class ModelSection:
    name: str = _help("hub name, local folder, or 'smollm2-135m' (the embedded default)", "smollm2-135m")
    precision: str = _help("'auto' (bf16 where the accelerator supports it, else fp32), 'bf16' or 'fp32'", "auto")
    attn_implementation: str = _help(
        "attention kernel: 'sdpa' or 'eager' (PoSE needs one that honours position ids with an explicit mask)", "sdpa"
    )
    gradient_checkpointing: bool = _help("recompute activations in backward (less memory, ~30% slower)", False)
    trust_remote_code: bool = _help("passed to from_pretrained", False)
    config_overrides: dict = _help(
        "model config fields to change at load time, e.g. {sliding_window: null} (passed to from_pretrained)", factory=dict
    )


@dataclass
class ScalingSection:
    method: str = _help("scaling method (hf_posext.available_methods())", "yarn")
    factor: float | None = _help("scale factor s >= 1 (give this or target_length)", None)
    target_length: int | None = _help("window to reach; factor = target_length / original window", None)
    original_max_position_embeddings: int | None = _help("override the pre-training window read from the config", None)
    params: dict = _help("method parameters, e.g. {beta_fast: 32, beta_slow: 1}", factory=dict)

    def to_request(self) -> "ScalingRequest":
        """This section as a validated :class:`~hf_posext.core.request.ScalingRequest` (raises ConfigError)."""
        from hf_posext.core.request import ScalingRequest

        try:
            return ScalingRequest.from_mapping(dataclasses.asdict(self), where="scaling").require_size("scaling.")
        except ValueError as error:
            raise ConfigError(str(error)) from error


@dataclass
class FinetuneSection:
    mode: str = _help("'lora' (PEFT adapters) or 'full' (every weight)", "lora")
    rank: int = _help("LoRA rank r", 8)
    alpha: float = _help("LoRA alpha (update scaled by alpha / r)", 16.0)
    dropout: float = _help("dropout on the LoRA input", 0.0)
    target_modules: list = _help(
        "module names to adapt (last name component, e.g. q_proj), or ['all-linear']",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    train_embeddings: bool = _help("also train the input embeddings (LongLoRA); tied output head included", False)
    train_norms: bool = _help("also train every normalisation layer (LongLoRA)", False)
    init_adapter: str | None = _help(
        "continue from this saved LoRA adapter folder (its LoRA weights and trained norms/embeddings) instead "
        "of a fresh LoRA; its base model, scaling, rank, alpha and targets must be this recipe's. A recipe YAML "
        "(stage 1 of a two-stage recipe) stands for the adapter its run writes, <its output.dir>/adapter", None)


@dataclass
class DataSection:
    source: str | None = _help(
        "a .txt/.jsonl/.parquet file, a folder of them, a `datasets` name ('pg19', 'name:config'), "
        "or 'builtin:python-docs' (see hf_posext.text_sources)", None
    )
    exclude: list = _help(
        "file-name patterns (fnmatch) to leave out of a source folder; the entry 'held-apart' stands for the books "
        "evaluations score (hf_posext.text_sources.HELD_APART_BOOKS) and is recorded as their names", factory=list
    )
    split: str = _help("`datasets` split, for a hub dataset", "train")
    text_field: str | None = _help("field holding the text in .jsonl/.parquet/datasets rows (null: text/content/...)", None)
    sequence_length: int = _help(
        "tokens per training sample W (the documents are packed into sequences of this length; "
        "formerly data.window)", 2048)
    pose: bool = _help("PoSE: position ids skip so each W-token sample spans [0, pose_target_length)", False)
    pose_target_length: int | None = _help("PoSE target T (default: the scaled window)", None)
    pose_chunks: int = _help("PoSE chunks per sample (the paper uses 2)", 2)
    pose_far_fraction: float = _help(
        "share of the PoSE samples whose last chunk ends at the target's last position, so that the longest "
        "distances are trained (0: the paper's uniform draws; hf_posext.training.pose)", 0.0)
    max_tokens: int | None = _help("use at most this many tokens of the source (after tokenizing)", None)
    max_documents: int | None = _help("use at most this many documents of the source", None)
    retrieval_records: int = _help(
        "synthetic key-value records hidden in each retrieval sample, each asked for at its end "
        "(0: off; hf_posext.training.retrieval_data)", 0)
    retrieval_fraction: float = _help("share of the samples that carry retrieval records", 1.0)
    retrieval_labels: str = _help("'answers': a retrieval sample trains on its answers only; 'all': on every token",
                                  "answers")
    retrieval_wording: str = _help(
        "'fixed': every record reads 'The locker code of NAME is CODE.'; 'varied': each record and each question "
        "drawn from several wordings and attributes (hf_posext.training.retrieval_data)", "fixed")
    retrieval_tasks: list = _help(
        "kinds of question, drawn per question: lookup, distractors (records that share the key's wording), "
        "several_values (a list answer), chain (a record naming another key), most_often (who did a thing most "
        "often: aggregation, at most one a sample); beyond lookup needs "
        "retrieval_wording: varied", factory=lambda: ["lookup"])
    retrieval_values: str = _help(
        "'digits': every value is a code; 'digits_and_words': a code or a two-word phrase, drawn per fact", "digits")
    retrieval_chat: float = _help(
        "share of the retrieval samples written as a conversation in the tokenizer's chat template, each answer "
        "trained up to its end-of-turn token (0: none)", 0.0)

    def __post_init__(self) -> None:
        from hf_posext.text_sources import expand_held_apart

        if isinstance(self.exclude, (list, tuple)):  # another type is reported by the config's type check
            self.exclude = expand_held_apart(self.exclude)


@dataclass
class TrainSection:
    max_steps: int = _help(
        "optimizer steps: the run's length, and so its learning-rate schedule's (`hf-posext train --stop-at-step N` "
        "runs the first N steps of that schedule)", 100)
    batch_size: int = _help("sequences per process per micro-batch", 1)
    gradient_accumulation_steps: int = _help("micro-batches per optimizer step", 1)
    learning_rate: float = _help("peak learning rate", 2e-4)
    lr_schedule: str = _help("'cosine', 'linear' or 'constant' (after warmup)", "cosine")
    warmup_steps: int = _help("linear warmup steps", 0)
    min_lr_ratio: float = _help("cosine/linear decay floor, as a fraction of the peak", 0.0)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    adam_beta1: float = _help("AdamW beta1", 0.9)
    adam_beta2: float = _help("AdamW beta2", 0.95)
    adam_epsilon: float = _help("AdamW epsilon", 1e-8)
    max_grad_norm: float | None = _help("clip the global gradient norm to this (null: no clipping)", 1.0)
    seed: int = _help("seed for weights init, data order, PoSE draws, dropout", 0)
    loss: str = _help(
        "'chunked': the output head and cross-entropy run over chunks of tokens, never holding the "
        "[tokens x vocabulary] logits (same loss and gradients); 'plain': model(**batch).loss", "chunked")
    loss_chunk_size: int = _help("tokens per chunk of the chunked loss", 1024)
    loss_average: str = _help(
        "'tokens': every predicted token of the accumulated batch weighs the same (transformers' default); "
        "'sequences': every sequence weighs the same however many tokens it trains on, so a retrieval sample's "
        "few answer tokens weigh as much as a book sample's text (use with data.retrieval_fraction < 1)", "tokens")


@dataclass
class ParallelismSection:
    sp_backend: str = _help(
        "'deepspeed': DeepSpeed Ulysses/ALST sequence parallelism (each of sp_size processes holds 1/sp_size of "
        "every sequence; CPU or GPU); 'none': off", "none")
    sp_size: int = _help("processes sharing one sequence under sp_backend=deepspeed (1: off)", 1)
    cp_backend: str = _help("'torch': torch context parallelism with FSDP2 (CUDA GPUs only); 'none': off", "none")
    cp_size: int = _help("processes sharing one sequence under cp_backend=torch (1: off)", 1)
    zero_stage: int = _help(
        "DeepSpeed ZeRO stage under sequence parallelism; only 3 is accepted (stages 0-2 scale every gradient "
        "by sp_size under the Trainer's sequence-parallel loss)", 3)

    @property
    def sequence_parallel(self) -> bool:
        """Whether DeepSpeed Ulysses shards the sequences (``sp_size > 1``)."""
        return self.sp_size > 1

    @property
    def context_parallel(self) -> bool:
        """Whether torch context parallelism shards the sequences (``cp_size > 1``)."""
        return self.cp_size > 1


@dataclass
class OutputSection:
    dir: str = _help("output folder (checkpoints/, adapter/, merged/, log.jsonl)", "runs/finetune")
    checkpoint_every: int = _help("save a checkpoint every N optimizer steps (0: only the final save)", 50)
    keep_last: int | None = _help("delete checkpoints older than the newest N, after the new one is complete (null: keep all)", None)
    log_every: int = _help("log every N optimizer steps", 1)
    report_to: list = _help("extra trackers: 'tensorboard', 'wandb' (must be installed)", factory=list)
    save_merged: bool = _help("write the merged model (LoRA merged into the weights) at the end", True)


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
        return hashlib.sha256(json.dumps(_resume_relevant(self.to_dict()), sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> "TrainConfig":
        """Check values that types alone do not catch. Returns self; raises ConfigError."""
        m, s, f, d, t, o, p = self.model, self.scaling, self.finetune, self.data, self.train, self.output, self.parallelism
        _choice("model.precision", m.precision, ("auto", "bf16", "fp32"))
        _choice("model.attn_implementation", m.attn_implementation, ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"))
        if d.pose and m.attn_implementation.startswith("flash_attention"):
            raise ConfigError(
                f"data.pose=true with model.attn_implementation={m.attn_implementation!r}: flash-attention kernels "
                "read skipping position ids as boundaries between packed sequences, so PoSE chunks would not see "
                "each other. Use model.attn_implementation=sdpa."
            )
        _check_scaling_method(s.method, d.pose)
        if s.factor is not None and s.target_length is not None:
            raise ConfigError("Give scaling.factor or scaling.target_length, not both (set the other to null).")
        if s.factor is None and s.target_length is None:
            raise ConfigError("Give scaling.factor (e.g. 4) or scaling.target_length (e.g. 32768).")
        if s.factor is not None and s.factor < 1:
            raise ConfigError(f"scaling.factor must be >= 1, got {s.factor}.")
        _choice("finetune.mode", f.mode, ("lora", "full"))
        _choice("train.loss", t.loss, ("chunked", "plain"))
        _positive("train.loss_chunk_size", t.loss_chunk_size)
        _choice("train.loss_average", t.loss_average, ("tokens", "sequences"))
        if t.loss_average == "sequences" and (p.sequence_parallel or p.context_parallel):
            raise ConfigError(
                "train.loss_average=sequences under sequence or context parallelism: each process holds a shard of "
                "a sequence, not whole sequences. Use train.loss_average=tokens.")
        _positive("finetune.rank", f.rank)
        if not 0 <= f.dropout < 1:
            raise ConfigError(f"finetune.dropout must be in [0, 1), got {f.dropout}.")
        if f.mode == "lora" and not f.target_modules:
            raise ConfigError("finetune.target_modules is empty: name the modules to adapt, e.g. [q_proj, v_proj].")
        if f.init_adapter is not None and names_recipe(f.init_adapter):
            raise ConfigError(
                f"finetune.init_adapter={f.init_adapter!r} names a recipe, which load_config replaces by the adapter "
                "folder its run writes; build the config with hf_posext.training.config.load_config.")
        if f.init_adapter is not None and f.mode != "lora":
            raise ConfigError(f"finetune.init_adapter needs finetune.mode=lora (got {f.mode!r}): it continues a LoRA adapter.")
        if not all(isinstance(x, str) for x in f.target_modules):
            raise ConfigError(f"finetune.target_modules must be a list of names, got {f.target_modules!r}.")
        if not d.source:
            raise ConfigError("data.source is not set: give a .txt/.jsonl/.parquet file, a folder, or a datasets name.")
        _positive("data.sequence_length", d.sequence_length)
        _positive("data.pose_chunks", d.pose_chunks)
        if d.pose_chunks > d.sequence_length:
            raise ConfigError(
                f"data.pose_chunks ({d.pose_chunks}) cannot exceed data.sequence_length ({d.sequence_length})."
            )
        if not 0 <= d.pose_far_fraction <= 1:  # its type is checked when the config loads, like retrieval_fraction's
            raise ConfigError(f"data.pose_far_fraction must be a number in [0, 1], got {d.pose_far_fraction!r}.")
        if d.pose_far_fraction > 0 and not d.pose:
            raise ConfigError(f"data.pose_far_fraction={d.pose_far_fraction} needs data.pose=true: it moves PoSE "
                              "position ids. Set data.pose: true or remove data.pose_far_fraction.")
        if d.pose_target_length is not None and d.pose_target_length < d.sequence_length:
            raise ConfigError(
                f"data.sequence_length ({d.sequence_length}) is longer than data.pose_target_length "
                f"({d.pose_target_length}): a PoSE sample simulates a longer context, so it must not exceed it. "
                "Lower data.sequence_length or raise the target."
            )
        if (s.target_length is not None and d.pose and d.pose_target_length is None
                and d.sequence_length > s.target_length):
            raise ConfigError(
                f"data.sequence_length ({d.sequence_length}) is longer than the target scaling.target_length "
                f"({s.target_length}). Lower data.sequence_length."
            )
        if isinstance(d.retrieval_records, bool) or not isinstance(d.retrieval_records, int) or d.retrieval_records < 0:
            raise ConfigError(f"data.retrieval_records must be an int >= 0 (0: off), got {d.retrieval_records!r}.")
        if not 0 < d.retrieval_fraction <= 1:
            raise ConfigError(f"data.retrieval_fraction must be in (0, 1], got {d.retrieval_fraction!r}.")
        _choice("data.retrieval_labels", d.retrieval_labels, ("answers", "all"))
        _choice("data.retrieval_wording", d.retrieval_wording, ("fixed", "varied"))
        from hf_posext.training.retrieval_data import TASKS, VALUES

        if not isinstance(d.retrieval_tasks, (list, tuple)) or not d.retrieval_tasks:
            raise ConfigError(f"data.retrieval_tasks must be a list of {', '.join(TASKS)}, got {d.retrieval_tasks!r}.")
        for task in d.retrieval_tasks:
            _choice("data.retrieval_tasks", task, TASKS)
        _choice("data.retrieval_values", d.retrieval_values, VALUES)
        if isinstance(d.retrieval_chat, bool) or not isinstance(d.retrieval_chat, (int, float)) or not 0 <= d.retrieval_chat <= 1:
            raise ConfigError(f"data.retrieval_chat must be a share in [0, 1], got {d.retrieval_chat!r}.")
        harder = [f"data.{name}={getattr(d, name)!r}" for name, plain in (("retrieval_tasks", ["lookup"]),
                  ("retrieval_values", "digits"), ("retrieval_chat", 0.0)) if getattr(d, name) != plain]
        if harder and d.retrieval_wording != "varied":
            raise ConfigError(f"{', '.join(harder)} {'is' if len(harder) == 1 else 'are'} drawn in the varied wording: set "
                              "data.retrieval_wording=varied.")
        defaults = {field.name: (field.default if field.default is not dataclasses.MISSING else field.default_factory())
                    for field in dataclasses.fields(DataSection)}
        idle = [f"data.{name}={getattr(d, name)!r}" for name in ("retrieval_fraction", "retrieval_labels", "retrieval_wording",
                                                                "retrieval_tasks", "retrieval_values", "retrieval_chat")
                if getattr(d, name) != defaults[name]]
        if idle and d.retrieval_records == 0:
            one = len(idle) == 1
            raise ConfigError(f"{', '.join(idle)} {'needs' if one else 'need'} data.retrieval_records > 0: with 0 records no "
                              f"sample is a retrieval sample, so {'it does' if one else 'they do'} nothing. Set "
                              f"data.retrieval_records (e.g. 8) or remove {'it' if one else 'them'}.")
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps"):
            _positive(f"train.{name}", getattr(t, name))
        if t.learning_rate <= 0:
            raise ConfigError(f"train.learning_rate must be > 0, got {t.learning_rate}.")
        _choice("train.lr_schedule", t.lr_schedule, ("cosine", "linear", "constant"))
        if t.warmup_steps < 0 or t.warmup_steps > t.max_steps:
            raise ConfigError(
                f"train.warmup_steps must be in [0, max_steps={t.max_steps}], got {t.warmup_steps}. To run only the "
                f"first steps of a recipe with its own schedule, keep train.max_steps and pass --stop-at-step N.")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}.")
        if t.max_grad_norm is not None and t.max_grad_norm <= 0:
            raise ConfigError(f"train.max_grad_norm must be > 0 or null, got {t.max_grad_norm}.")
        _choice("parallelism.sp_backend", p.sp_backend, ("deepspeed", "none"))
        _choice("parallelism.cp_backend", p.cp_backend, ("torch", "none"))
        _positive("parallelism.sp_size", p.sp_size)
        _positive("parallelism.cp_size", p.cp_size)
        if p.sequence_parallel and p.sp_backend != "deepspeed":
            raise ConfigError(f"parallelism.sp_size={p.sp_size} needs parallelism.sp_backend=deepspeed (DeepSpeed Ulysses).")
        if p.context_parallel and p.cp_backend != "torch":
            raise ConfigError(f"parallelism.cp_size={p.cp_size} needs parallelism.cp_backend=torch.")
        if p.sequence_parallel and p.context_parallel:
            raise ConfigError("parallelism.sp_size and parallelism.cp_size cannot both be > 1; shard with one of them.")
        if p.sequence_parallel and p.zero_stage != 3:
            raise ConfigError(
                f"parallelism.zero_stage={p.zero_stage}: under sequence parallelism only ZeRO stage 3 gives the right "
                f"gradients (stages 0-2 scale every gradient by sp_size={p.sp_size}); set parallelism.zero_stage=3."
            )
        if o.checkpoint_every < 0:
            raise ConfigError(f"output.checkpoint_every must be >= 0, got {o.checkpoint_every}.")
        if o.keep_last is not None:
            _positive("output.keep_last", o.keep_last)
        _positive("output.log_every", o.log_every)
        for tracker in o.report_to:
            _choice("output.report_to item", tracker, ("tensorboard", "wandb"))
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


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}.{hint}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}.")


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


#: A ``finetune.init_adapter`` ending in one of these names a recipe (the stage before), not an adapter folder.
RECIPE_SUFFIXES = (".yaml", ".yml")


def names_recipe(init_adapter: str) -> bool:
    """Whether a ``finetune.init_adapter`` value names a recipe YAML (a previous stage) rather than an adapter."""
    return str(init_adapter).lower().endswith(RECIPE_SUFFIXES)


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
    previous = config.finetune.init_adapter
    if previous is not None and names_recipe(previous):
        if path is not None and Path(previous).resolve() == path.resolve():
            raise ConfigError(f"{path}: finetune.init_adapter names this recipe itself; name the previous stage's recipe.")
        config.finetune.init_adapter = check_stage_adapter(previous) if require_previous_stage else stage_adapter_folder(previous)
    return config.validate() if validate else config
