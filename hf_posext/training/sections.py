"""The seven sections of a training recipe, each a typed dataclass that validates itself.

:class:`~hf_posext.training.config.TrainConfig` holds one of each and adds the checks that span sections
(PoSE with a flash-attention kernel, the loss average under sequence parallelism, the PoSE sample against the
scaling target). Every field's ``help`` is its documentation.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ConfigError",
    "check_choice",
    "check_positive",
    "check_scaling_method",
    "names_recipe",
    "RECIPE_SUFFIXES",
    "ModelSection",
    "ScalingSection",
    "FinetuneSection",
    "DataSection",
    "TrainSection",
    "ParallelismSection",
    "OutputSection",
]

#: File suffixes that make a path a recipe (YAML), not an adapter folder.
RECIPE_SUFFIXES = (".yaml", ".yml")


def names_recipe(init_adapter: str) -> bool:
    """Whether a ``finetune.init_adapter`` value names a recipe YAML (a previous stage) rather than an adapter."""
    return str(init_adapter).lower().endswith(RECIPE_SUFFIXES)


def check_scaling_method(method: str, pose: bool) -> None:
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
        check_choice("scaling.method", method, tuple(available_methods()))
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
    name: str = _help("hub name, local folder, or an embedded name: 'smollm2-135m-instruct' (also 'smollm2-135m', the default)", "smollm2-135m")
    precision: str = _help("'auto' (bf16 where the accelerator supports it, else fp32), 'bf16' or 'fp32'", "auto")
    attn_implementation: str = _help(
        "attention kernel: 'sdpa' or 'eager' (PoSE needs one that honours position ids with an explicit mask)", "sdpa"
    )
    gradient_checkpointing: bool = _help("recompute activations in backward (less memory, ~30% slower)", False)
    trust_remote_code: bool = _help("passed to from_pretrained", False)
    config_overrides: dict = _help(
        "model config fields to change at load time, e.g. {sliding_window: null} (passed to from_pretrained)", factory=dict
    )

    def validate(self) -> None:
        """Check this section alone (raises ConfigError)."""
        check_choice("model.precision", self.precision, ("auto", "bf16", "fp32"))
        check_choice("model.attn_implementation", self.attn_implementation,
                     ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"))


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

    def validate(self, pose: bool) -> None:
        """Check this section; ``pose``: whether the data section trains with PoSE (raises ConfigError)."""
        check_scaling_method(self.method, pose)
        if self.factor is not None and self.target_length is not None:
            raise ConfigError("Give scaling.factor or scaling.target_length, not both (set the other to null).")
        if self.factor is None and self.target_length is None:
            raise ConfigError("Give scaling.factor (e.g. 4) or scaling.target_length (e.g. 32768).")
        if self.factor is not None and self.factor < 1:
            raise ConfigError(f"scaling.factor must be >= 1, got {self.factor}.")


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

    def validate(self) -> None:
        """Check this section alone (raises ConfigError)."""
        check_choice("finetune.mode", self.mode, ("lora", "full"))
        check_positive("finetune.rank", self.rank)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"finetune.dropout must be in [0, 1), got {self.dropout}.")
        if self.mode == "lora" and not self.target_modules:
            raise ConfigError("finetune.target_modules is empty: name the modules to adapt, e.g. [q_proj, v_proj].")
        if self.init_adapter is not None and names_recipe(self.init_adapter):
            raise ConfigError(
                f"finetune.init_adapter={self.init_adapter!r} names a recipe, which load_config replaces by the adapter "
                "folder its run writes; build the config with hf_posext.training.config.load_config.")
        if self.init_adapter is not None and self.mode != "lora":
            raise ConfigError(f"finetune.init_adapter needs finetune.mode=lora (got {self.mode!r}): it continues a LoRA adapter.")
        if not all(isinstance(x, str) for x in self.target_modules):
            raise ConfigError(f"finetune.target_modules must be a list of names, got {self.target_modules!r}.")


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

    def validate(self) -> None:
        """Check this section alone (raises ConfigError)."""
        if not self.source:
            raise ConfigError("data.source is not set: give a .txt/.jsonl/.parquet file, a folder, or a datasets name.")
        check_positive("data.sequence_length", self.sequence_length)
        self._validate_pose()
        self._validate_retrieval()

    def _validate_pose(self) -> None:
        check_positive("data.pose_chunks", self.pose_chunks)
        if self.pose_chunks > self.sequence_length:
            raise ConfigError(
                f"data.pose_chunks ({self.pose_chunks}) cannot exceed data.sequence_length ({self.sequence_length})."
            )
        if not 0 <= self.pose_far_fraction <= 1:  # its type is checked when the config loads, like retrieval_fraction's
            raise ConfigError(f"data.pose_far_fraction must be a number in [0, 1], got {self.pose_far_fraction!r}.")
        if self.pose_far_fraction > 0 and not self.pose:
            raise ConfigError(f"data.pose_far_fraction={self.pose_far_fraction} needs data.pose=true: it moves PoSE "
                              "position ids. Set data.pose: true or remove data.pose_far_fraction.")
        if self.pose_target_length is not None and self.pose_target_length < self.sequence_length:
            raise ConfigError(
                f"data.sequence_length ({self.sequence_length}) is longer than data.pose_target_length "
                f"({self.pose_target_length}): a PoSE sample simulates a longer context, so it must not exceed it. "
                "Lower data.sequence_length or raise the target."
            )

    def _validate_retrieval(self) -> None:
        d = self
        if isinstance(d.retrieval_records, bool) or not isinstance(d.retrieval_records, int) or d.retrieval_records < 0:
            raise ConfigError(f"data.retrieval_records must be an int >= 0 (0: off), got {d.retrieval_records!r}.")
        if not 0 < d.retrieval_fraction <= 1:
            raise ConfigError(f"data.retrieval_fraction must be in (0, 1], got {d.retrieval_fraction!r}.")
        check_choice("data.retrieval_labels", d.retrieval_labels, ("answers", "all"))
        check_choice("data.retrieval_wording", d.retrieval_wording, ("fixed", "varied"))
        from hf_posext.training.retrieval_data import TASKS, VALUES

        if not isinstance(d.retrieval_tasks, (list, tuple)) or not d.retrieval_tasks:
            raise ConfigError(f"data.retrieval_tasks must be a list of {', '.join(TASKS)}, got {d.retrieval_tasks!r}.")
        for task in d.retrieval_tasks:
            check_choice("data.retrieval_tasks", task, TASKS)
        check_choice("data.retrieval_values", d.retrieval_values, VALUES)
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

    def validate(self) -> None:
        """Check this section alone (raises ConfigError)."""
        t = self
        check_choice("train.loss", t.loss, ("chunked", "plain"))
        check_positive("train.loss_chunk_size", t.loss_chunk_size)
        check_choice("train.loss_average", t.loss_average, ("tokens", "sequences"))
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps"):
            check_positive(f"train.{name}", getattr(t, name))
        if t.learning_rate <= 0:
            raise ConfigError(f"train.learning_rate must be > 0, got {t.learning_rate}.")
        check_choice("train.lr_schedule", t.lr_schedule, ("cosine", "linear", "constant"))
        if t.warmup_steps < 0 or t.warmup_steps > t.max_steps:
            raise ConfigError(
                f"train.warmup_steps must be in [0, max_steps={t.max_steps}], got {t.warmup_steps}. To run only the "
                f"first steps of a recipe with its own schedule, keep train.max_steps and pass --stop-at-step N.")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}.")
        if t.max_grad_norm is not None and t.max_grad_norm <= 0:
            raise ConfigError(f"train.max_grad_norm must be > 0 or null, got {t.max_grad_norm}.")


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

    def validate(self) -> None:
        """Check this section alone (raises ConfigError)."""
        p = self
        check_choice("parallelism.sp_backend", p.sp_backend, ("deepspeed", "none"))
        check_choice("parallelism.cp_backend", p.cp_backend, ("torch", "none"))
        check_positive("parallelism.sp_size", p.sp_size)
        check_positive("parallelism.cp_size", p.cp_size)
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


@dataclass
class OutputSection:
    dir: str = _help("output folder (checkpoints/, adapter/, merged/, log.jsonl)", "runs/finetune")
    checkpoint_every: int = _help("save a checkpoint every N optimizer steps (0: only the final save)", 50)
    keep_last: int | None = _help("delete checkpoints older than the newest N, after the new one is complete (null: keep all)", None)
    log_every: int = _help("log every N optimizer steps", 1)
    report_to: list = _help("extra trackers: 'tensorboard', 'wandb' (must be installed)", factory=list)
    save_merged: bool = _help("write the merged model (LoRA merged into the weights) at the end", True)

    def validate(self) -> None:
        """Check this section alone (raises ConfigError)."""
        if self.checkpoint_every < 0:
            raise ConfigError(f"output.checkpoint_every must be >= 0, got {self.checkpoint_every}.")
        if self.keep_last is not None:
            check_positive("output.keep_last", self.keep_last)
        check_positive("output.log_every", self.log_every)
        for tracker in self.report_to:
            check_choice("output.report_to item", tracker, ("tensorboard", "wandb"))


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (the message suggests the closest)."""
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}.{hint}")


def check_positive(name: str, value: int) -> None:
    """Refuse a count below 1."""
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}.")
