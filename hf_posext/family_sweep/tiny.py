"""Tiny random instances of every ``*ForCausalLM`` class the installed transformers exports.

One generic rule sizes every config by its field names (:data:`GENERIC_SIZES`: hidden 32, 2 layers, 4 heads,
a 128-word vocabulary, a 32-token window, 4 experts, small MLA ranks, ...); :data:`RECIPES` overrides it for
the families where the generic config does not build or run (see :mod:`hf_posext.family_sweep.recipes`).
A model is first built on the meta device and refused when it is not tiny, so a config field the rules miss
(a 4-billion-parameter default) fails in one line instead of filling the machine's memory.

Every model is run on :func:`model_inputs`: token ids, or for a drafting head (whose forward takes its target
model's keys and values, ``shared_kv_states``) synthetic target states from a seed (:func:`drafting_inputs`).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_posext.backends.rope.rules import TARGET_STATES_ARGUMENT, reads_target_states
from hf_posext.family_sweep.recipes import RECIPES, UNBUILDABLE

__all__ = [
    "GENERIC_SIZES",
    "WINDOW",
    "MAX_PARAMETERS",
    "TinyModelError",
    "TinyFamily",
    "causal_lm_classes",
    "tiny_family_config",
    "build_tiny",
    "position_kind",
    "input_ids",
    "model_inputs",
    "drafting_inputs",
]

#: The pre-training window of every tiny model (``max_position_embeddings`` and its aliases).
WINDOW = 32
#: A tiny model above this many parameters is refused before its weights are allocated.
MAX_PARAMETERS = 8_000_000

#: Config field -> value, applied to every field of that name whose default is a number (never to a None default:
#: a None ``sliding_window`` means "no sliding window", and stays so).
GENERIC_SIZES: dict[str, int] = {
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size"), 128),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "embedding_dim", "dim", "hidden_size_global"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "ffn_hidden_size",
                     "dim_ff", "intermediate_size_mlp", "dense_intermediate_size", "first_dense_intermediate_size",
                     "mlp_only_intermediate_size"), 64),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "swa_num_key_value_heads"), 2),
    **dict.fromkeys(("head_dim", "swa_head_dim", "dim_head", "kv_channels"), 8),
    "swa_num_attention_heads": 4,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "original_max_position_embeddings", "context_length"), WINDOW),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
                     "window_size"), 16),
    # mixture of experts
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group", "n_groups"), 1),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "expert_ffn_hidden_size", "router_hidden_size"), 16),
    # multi-head latent attention (DeepSeek-V2/V3 style) and its sparse indexer
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 4),
    "v_head_dim": 8,
    **dict.fromkeys(("index_head_dim",), 8),
    **dict.fromkeys(("index_n_heads", "index_num_heads"), 2),
    **dict.fromkeys(("index_topk",), 8),
    # linear attention and state-space layers
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "mamba_head_dim"), 8),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads"), 2),
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size"), 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 4),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    # per-layer inputs, adapters and other side tables
    **dict.fromkeys(("vocab_size_per_layer_input",), 128),
    **dict.fromkeys(("hidden_size_per_layer_input", "laurel_rank", "adapter_rank", "loop_gate_rank", "hc_lowrank",
                     "gated_norm_rank"), 4),
}

#: Fields sized even where their default is None (None there means "derive it", not "off").
_SIZED_EVEN_IF_UNSET = ("head_dim", "num_key_value_heads", "num_experts_per_tok")

#: Special-token fields and the id each takes (inside the 128-word vocabulary).
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "sep_token_id": 2,
              "cls_token_id": 1, "image_token_id": 3}


class TinyModelError(RuntimeError):
    """A class whose tiny instance cannot be built or run (its config, its size or its forward)."""


@dataclass(frozen=True)
class TinyFamily:
    """One ``*ForCausalLM`` class and how its tiny instance is built.

    Attributes:
        class_name: the exported class (``"LlamaForCausalLM"``).
        config_overrides: the recipe's config fields (empty when the generic config builds).
        note: why the recipe exists, for the support matrix.
        unbuildable: the one-line reason no tiny instance can run here, or None.
    """

    class_name: str
    config_overrides: dict[str, Any]
    note: str = ""
    unbuildable: str | None = None


def causal_lm_classes() -> list[str]:
    """Every PyTorch ``*ForCausalLM`` class name the installed transformers exports (``AutoModelForCausalLM`` left
    out, and 4.x's TensorFlow and Flax twins: ``TF...``, ``Flax...``)."""
    import transformers

    return sorted(name for name in dir(transformers) if name.endswith("ForCausalLM") and not name.startswith("Auto")
                  and not re.match(r"(TF|Flax)[A-Z]", name))


def _field_defaults(config_cls: type) -> dict[str, Any]:
    if dataclasses.is_dataclass(config_cls):
        return {field.name: field.default for field in dataclasses.fields(config_cls)}
    parameters = inspect.signature(config_cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _is_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def generic_overrides(config_cls: type) -> dict[str, Any]:
    """The generic tiny sizes of the fields ``config_cls`` has (:data:`GENERIC_SIZES`, special-token ids), and of
    its sub-configs (a dict each: ``text_config``, ``attn_config``, ...)."""
    defaults = _field_defaults(config_cls)
    overrides = {name: value for name, value in GENERIC_SIZES.items()
                 if _is_number(defaults.get(name)) or (name in _SIZED_EVEN_IF_UNSET and name in defaults)}
    overrides.update({name: value for name, value in _TOKEN_IDS.items() if _is_number(defaults.get(name))})
    if "qk_rope_head_dim" in overrides:  # MLA: keys and values carry every head; the rotary head is the rope part
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", 4)
        if "head_dim" in defaults:
            overrides["head_dim"] = overrides["qk_rope_head_dim"]
    for name, sub_config_cls in (getattr(config_cls, "sub_configs", None) or {}).items():
        if name in defaults and isinstance(sub_config_cls, type):
            overrides[name] = _sub_config_overrides(config_cls, name, sub_config_cls)
    return overrides


def _sub_config_overrides(config_cls: type, name: str, sub_config_cls: type) -> dict[str, Any]:
    """A sub-config's generic sizes; one declared as ``AutoConfig`` is sized as the type its spec names
    (``sub_configs_defaults``), else as the type the default config holds (a default that does not validate,
    such as a drafting head's, has only its spec)."""
    if dataclasses.is_dataclass(sub_config_cls) or not hasattr(sub_config_cls, "for_model"):
        return generic_overrides(sub_config_cls)
    from transformers import CONFIG_MAPPING

    spec = (getattr(config_cls, "sub_configs_defaults", None) or {}).get(name)
    model_type = getattr(spec, "model_type", None)
    if model_type is None:
        default = getattr(config_cls(), name, None)
        model_type = getattr(default, "model_type", None)
    if model_type not in CONFIG_MAPPING:
        return {}
    return {"model_type": model_type, **generic_overrides(CONFIG_MAPPING[model_type])}


def _merge(base: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``recipe`` on top; a sub-config given as a dict in both is merged, not replaced."""
    merged = dict(base)
    for key, value in recipe.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            and "rope_type" not in value else value
    return merged


def tiny_family(class_name: str) -> TinyFamily:
    """How ``class_name``'s tiny instance is built: its recipe (:data:`RECIPES`) or the generic config."""
    if class_name in UNBUILDABLE:
        return TinyFamily(class_name, {}, unbuildable=UNBUILDABLE[class_name])
    overrides, note = RECIPES.get(class_name, ({}, ""))
    return TinyFamily(class_name, dict(overrides), note)


def tiny_family_config(class_name: str, **extra: Any) -> Any:
    """The tiny config of ``class_name``: generic sizes, then its recipe, then ``extra``.

    Raises:
        TinyModelError: the class is listed as unbuildable here, or its config rejects the sizes.
    """
    import transformers

    family = tiny_family(class_name)
    if family.unbuildable:
        raise TinyModelError(f"{class_name}: {family.unbuildable}")
    config_cls = getattr(transformers, class_name).config_class
    overrides = _merge(_merge(generic_overrides(config_cls), family.config_overrides), extra)
    builder = overrides.pop("build_config", None)
    try:
        config = builder(config_cls, overrides) if builder else config_cls(**overrides)
        config = _with_a_global_layer(config_cls, config, overrides)
        if _rotary_dim_or_none(config) <= 2:  # one frequency: too few for NTK's b * s^(d/(d-2)); widen the heads
            wider = {"head_dim": 16} if "head_dim" in _field_defaults(config_cls) else {"hidden_size": 64}
            try:
                config = config_cls(**{**overrides, **wider})
            except Exception:  # a config that sets head sizes per layer type keeps its own
                pass
        return config
    except Exception as error:
        raise TinyModelError(f"{class_name}: the tiny config does not build ({type(error).__name__}: "
                             f"{' '.join(str(error).split())[:200]}); give it a recipe in family_sweep/recipes.py") from None


def _rotary_dim(config: Any) -> float:
    """The rotary width a config gives its heads (inf when it says nothing about a partial rotary)."""
    parameters = getattr(config, "rope_parameters", None)
    partial = (parameters.get("partial_rotary_factor") if isinstance(parameters, dict) else None) \
        or getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads and hasattr(config, "hidden_size") else None)
    return head_dim * partial if partial and head_dim else float("inf")


#: Layer types whose attention sees only a local window.
_LOCAL_TYPES = ("sliding_attention", "chunked_attention")


def _with_a_global_layer(config_cls: type, config: Any, overrides: dict[str, Any]) -> Any:
    """Two layers of a 1-global-in-N pattern are both local: make the last one global, so the layers a scaling
    is meant for exist (Gemma 2/3, Cohere 2: the global layers carry the long distances)."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types or "layer_types" in overrides or not set(layer_types) <= set(_LOCAL_TYPES):
        return config
    try:
        return config_cls(**{**overrides, "layer_types": [*layer_types[:-1], "full_attention"]})
    except Exception:  # a family whose layer types cannot mix: keep its own
        return config


def _rotary_dim_or_none(config: Any) -> float:
    try:
        return _rotary_dim(config)
    except Exception:  # head sizes that vary per layer type (Gemma 4): no single width to read
        return float("inf")


def build_tiny(class_name: str, seed: int = 0, config: Any = None) -> nn.Module:
    """A tiny random float32 instance of ``class_name`` in eval mode, eager attention.

    Args:
        class_name: a ``*ForCausalLM`` class of the installed transformers.
        seed: the random seed of its weights.
        config: a config to use instead of :func:`tiny_family_config`'s.

    Raises:
        TinyModelError: no tiny config, more than :data:`MAX_PARAMETERS` parameters (a size the rules miss).
    """
    import transformers

    model_cls = getattr(transformers, class_name)
    config = config if config is not None else tiny_family_config(class_name)
    with torch.device("meta"):
        skeleton = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    count = sum(parameter.numel() for parameter in skeleton.parameters())
    if count > MAX_PARAMETERS:
        raise TinyModelError(f"{class_name}: the tiny config still has {count:,} parameters (> {MAX_PARAMETERS:,}); "
                             "a size field the generic rules miss: add it to GENERIC_SIZES or the family's recipe")
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def input_ids(model: nn.Module, length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` random token ids inside the model's vocabulary, above the special ids."""
    embeddings = model.get_input_embeddings()
    vocab = embeddings.weight.shape[0] if isinstance(embeddings, nn.Embedding) else 128
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, max(5, min(vocab, 128)), (1, length), generator=generator)


def model_inputs(model: nn.Module, length: int, seed: int = 0) -> dict[str, Any]:
    """The forward's inputs for a sequence of ``length`` positions: ``input_ids`` (:func:`input_ids`), or for a
    drafting head (its forward takes its target's keys and values) :func:`drafting_inputs`."""
    if reads_target_states(model):
        return drafting_inputs(model, length, seed)
    return {"input_ids": input_ids(model, length, seed)}


def _target_key_shapes(model: nn.Module) -> dict[str, tuple[int, int, int | None]]:
    """Layer type -> (key/value heads, head dim, sliding window or None), read off the first attention module of
    each layer type (transformers' attention attributes)."""
    heads = model.config.get_text_config().num_attention_heads
    shapes: dict[str, tuple[int, int, int | None]] = {}
    for module in model.modules():
        layer_type = getattr(module, "layer_type", None)
        if isinstance(layer_type, str) and hasattr(module, "num_key_value_groups") and layer_type not in shapes:
            shapes[layer_type] = (heads // module.num_key_value_groups, module.head_dim, getattr(module, "sliding_window", None))
    return shapes


def drafting_inputs(model: nn.Module, length: int, seed: int = 0) -> dict[str, Any]:
    """Synthetic inputs of a drafting head that drafts the token at position ``length - 1``, after its target model
    has read ``length`` tokens (what transformers' assisted generation passes it), from ``seed``:

    - ``inputs_embeds`` ``[1, 1, 2 * backbone_hidden_size]``: the token's embedding beside the target's last hidden state;
    - ``position_ids`` ``[[length - 1]]``: the position its queries are rotated to;
    - ``shared_kv_states``: per layer type, the target's keys and values ``[1, key heads, n, head dim]``, n = ``length``
      (a sliding-window layer type: the window's last tokens). Random normal: the target rotated them, and a random
      vector rotated by any angle is as random, so no rotation is applied here (none of the head's own would be right).
    """
    generator = torch.Generator().manual_seed(seed)
    width = 2 * int(model.config.backbone_hidden_size)
    states = {}
    for layer_type, (heads, head_dim, window) in _target_key_shapes(model).items():
        kept = min(length, window) if window else length
        keys, values = (torch.randn(1, heads, kept, head_dim, generator=generator) for _ in range(2))
        states[layer_type] = (keys, values)
    return {"inputs_embeds": torch.randn(1, 1, width, generator=generator),
            "position_ids": torch.tensor([[length - 1]]), TARGET_STATES_ARGUMENT: states}


def position_kind(model: nn.Module) -> str:
    """The kind of positions ``model`` carries, read from its structure (never its class name).

    Returns:
        ``"rope"`` (rotary frequencies or a fixed rotary table), ``"relative"`` (a T5-style bias table),
        ``"learned"`` (a position embedding table), ``"sinusoidal"`` (a fixed sinusoidal encoding),
        ``"alibi"`` (linear attention biases) or ``"none"`` (no positions: recurrent or state-space layers).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    names = [(name, type(module).__name__) for name, module in model.named_modules()]
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("inv_freq") for name in buffers) or any("Rotary" in cls for _, cls in names) \
            or getattr(config, "rotary_dim", None) or getattr(config, "rotary_pct", None):
        return "rope"
    if any(hasattr(module, "relative_attention_bias") for module in model.modules()):
        return "relative"
    if any("Sinusoidal" in cls for _, cls in names):
        return "sinusoidal"
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False) \
            or hasattr(inspect.getmodule(type(model)), "build_alibi_tensor"):
        return "alibi"
    if any(isinstance(module, nn.Embedding) and ("pos" in name.rsplit(".", 1)[-1] or name.endswith("wpe"))
           for name, module in model.named_modules()):
        return "learned"
    return "none"
