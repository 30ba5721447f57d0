"""Patch a tiny instance of a ``*ForCausalLM`` class with every applicable method and check what it does.

Per (class, method), in order: ``patch``; a forward beyond the original window with finite logits; ``unpatch``
back to the bit (state dict, config, logits inside the window); for one method per class, ``save_pretrained`` +
:func:`hf_posext.load` back to the same logits; wherever transformers scales the family itself (the method has a
``rope_type`` and the model's config holds ``rope_parameters``), equality with the model transformers builds
from that ``rope_parameters``. The outcome is ``ok``, ``refused`` (``patch`` raised: its first line is kept) or
``crash`` (anything raised after a successful patch, or a wrong result). Every forward runs on
:func:`~hf_posext.family_sweep.tiny.model_inputs` (a drafting head's: synthetic target states).
"""

from __future__ import annotations

import copy
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_posext import api
from hf_posext.family_sweep.parity import method_parameters, stock_scaled_logits
from hf_posext.family_sweep.tiny import WINDOW, build_tiny, model_inputs, position_kind, tiny_family
from hf_posext.methods import BASELINE, COMPOSITION_SEPARATOR, METHODS

__all__ = ["OK", "REFUSED", "CRASH", "SKIPPED", "FACTOR", "MethodOutcome", "FamilyResult", "applicable_methods",
           "sweep_class", "first_line", "result_from_dict"]

OK, REFUSED, CRASH, SKIPPED = "ok", "refused", "crash", "skipped"
#: Every method is swept at this factor; the long forward runs at ``LONG_LENGTH`` > the window.
FACTOR = 2.0
LONG_LENGTH = int(WINDOW * 1.5)
SHORT_LENGTH = WINDOW // 2
#: The composition swept on RoPE families whose attention goes through transformers' AttentionInterface.
COMPOSITION = f"yarn{COMPOSITION_SEPARATOR}string"
#: Logits equal "to float precision": tiny float32 models, a handful of layers (measured: 0, bit for bit, on
#: Llama, Qwen 3, Gemma 3, Cohere, Phi-3, DeepSeek-V3 and gpt-oss).
TOLERANCE = 1e-4
#: Parity must be able to fail: the difference allowed is also at most this fraction of what transformers' scaling
#: changes in the logits (at the 0.02 init of a tiny model that can be 1e-5, below TOLERANCE).
SENSITIVITY = 0.01
#: The method whose saved folder is reloaded, by preference (the first one that patched is used otherwise).
SAVE_LOAD_PREFERENCE = ("yarn", "linear")


@dataclass
class MethodOutcome:
    """What one method did to one class.

    Attributes:
        method: the method name passed to ``patch``.
        outcome: ``ok``, ``refused`` or ``crash``.
        reason: the first line of the error (refused, crash), empty when ok.
        parity: equality with transformers' own ``rope_parameters`` scaling: True / False, None where transformers
            does not scale this family with this method.
        saved: ``save_pretrained`` + ``hf_posext.load`` was checked with this method.
    """

    method: str
    outcome: str
    reason: str = ""
    parity: bool | None = None
    saved: bool = False


@dataclass
class FamilyResult:
    """One ``*ForCausalLM`` class: how it was built, its positions, and each method's outcome.

    Attributes:
        class_name: the transformers class.
        kind: the position kind read from its structure (:func:`~hf_posext.family_sweep.tiny.position_kind`).
        built: the tiny instance was built and ran; when False, ``reason`` says why.
        reason: why the class was skipped (empty when built).
        recipe: the recipe's note, empty when the generic tiny config serves.
        attention_interface: its attention goes through transformers' AttentionInterface.
        notes: ``hf_posext.describe``'s notes after a successful frequency patch (which layers were scaled).
        methods: one outcome per applicable method.
    """

    class_name: str
    kind: str = "none"
    built: bool = True
    reason: str = ""
    recipe: str = ""
    attention_interface: bool = False
    notes: list[str] = field(default_factory=list)
    methods: list[MethodOutcome] = field(default_factory=list)


def result_from_dict(data: dict[str, Any]) -> FamilyResult:
    """A :class:`FamilyResult` back from its ``dataclasses.asdict`` form (the bench's JSON)."""
    return FamilyResult(**{**data, "methods": [MethodOutcome(**m) for m in data["methods"]]})


def first_line(error: BaseException) -> str:
    """``Type: message`` on one line, 300 characters at most."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300]


def _uses_attention_interface(model: nn.Module) -> bool:
    """transformers' own flag on a model whose attention modules call the AttentionInterface's function."""
    return bool(getattr(model, "_supports_attention_backend", False))


def applicable_methods(kind: str, attention_interface: bool) -> list[str]:
    """The methods swept on a family of this position kind: every registered method of that kind but the baseline
    (the baseline too where it is the kind's only one: ALiBi, sinusoids), plus the attention-level methods and
    :data:`COMPOSITION` on RoPE families whose attention goes through transformers' AttentionInterface. A family
    without positions is swept with ``linear`` alone, to check that it is refused."""
    if kind == "none":
        return ["linear"]
    names = list(METHODS.get(kind, {}))
    own = [name for name in names if name != BASELINE] or names
    if kind == "rope" and attention_interface:
        own += [name for name in METHODS["attention"] if name != BASELINE] + [COMPOSITION]
    return own


def _logits(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits.float()


#: Config fields that ``save_pretrained`` itself writes: not the patch's to restore (transformers 5.0 also fills in
#: ``dtype`` from the weights where the config had none).
_SAVE_FIELDS = ("architectures", "transformers_version", "_name_or_path", "dtype")


def _config_state(model: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in model.config.to_dict().items() if k not in _SAVE_FIELDS}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _round_trip(model: nn.Module, inputs: dict[str, Any], expected: torch.Tensor) -> None:
    """``save_pretrained`` + :func:`hf_posext.load` gives the patched model's logits back."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = api.load(folder, attn_implementation="eager", dtype=torch.float32).eval()
        got = _logits(loaded, inputs)
    _check(torch.allclose(got, expected, atol=TOLERANCE, rtol=0),
           f"save_pretrained + hf_posext.load changed the logits by {(got - expected).abs().max():.3g}")


def _sweep_method(model: nn.Module, method: str, baseline: dict[str, Any], save: bool) -> tuple[MethodOutcome, list[str]]:
    """Patch, long forward, parity, save/load, unpatch to the bit: one method on one model."""
    short, long = baseline["short_inputs"], baseline["long_inputs"]
    try:
        api.patch(model, method, factor=FACTOR, **method_parameters(method, model, FACTOR))
    except Exception as error:  # a refusal: the one line patch raised
        return MethodOutcome(method, REFUSED, first_line(error)), []
    outcome = MethodOutcome(method, OK)
    notes: list[str] = []
    try:
        notes = list(api.describe(model).notes)
        patched = _logits(model, long)
        _check(bool(torch.isfinite(patched).all()), f"non-finite logits at {LONG_LENGTH} tokens after {method}")
        outcome.parity = _parity(model, method, baseline, patched)
        if save:
            _round_trip(model, long, patched)
            outcome.saved = True
    except Exception as error:
        outcome.outcome, outcome.reason = CRASH, first_line(error)
    try:
        if api.patched_backends(model):  # a patch that changes nothing (ALiBi's "none" without a limit) holds no state
            api.unpatch(model)
        _check(_config_state(model) == baseline["config_json"], f"unpatch after {method} left the config changed")
        state = model.state_dict()
        _check(state.keys() == baseline["state"].keys() and all(torch.equal(state[k], v) for k, v in baseline["state"].items()),
               f"unpatch after {method} left the state dict changed")
        _check(torch.equal(_logits(model, short), baseline["short_logits"]), f"unpatch after {method} changed the logits")
    except Exception as error:
        if outcome.outcome == OK:
            outcome.outcome, outcome.reason = CRASH, first_line(error)
    return outcome, notes


def _parity(model: nn.Module, method: str, baseline: dict[str, Any], patched: torch.Tensor) -> bool | None:
    """Equality with transformers' own scaling of the same model (None where transformers has none for it)."""
    stock = stock_scaled_logits(model, method, FACTOR, baseline["config"], baseline["long_inputs"], baseline["state"],
                                baseline["long_logits"])
    if stock is None:
        return None
    difference = (stock - patched).abs().max().item()
    effect = (stock - baseline["long_logits"]).abs().max().item()
    allowed = min(TOLERANCE, SENSITIVITY * effect)
    _check(math.isfinite(difference) and difference <= allowed,
           f"{method} differs from transformers' own rope_parameters scaling by {difference:.3g} (allowed {allowed:.3g}: "
           f"1/100 of the {effect:.3g} its scaling changes)")
    return True


def _unpatched_long_logits(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor | None:
    if getattr(model.config.get_text_config(), "rope_parameters", None) is None:
        return None  # no parity to check: transformers scales no rope dict here
    try:
        return _logits(model, inputs)
    except Exception:  # positions past the window: a table without rows there
        return None


def _baseline(model: nn.Module) -> dict[str, Any]:
    short, long = model_inputs(model, SHORT_LENGTH), model_inputs(model, LONG_LENGTH, seed=1)
    return {
        "short_inputs": short,
        "long_inputs": long,
        "short_logits": _logits(model, short),
        "long_logits": _unpatched_long_logits(model, long),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "config_json": _config_state(model),
        "config": copy.deepcopy(model.config),
    }


def sweep_class(class_name: str, methods: list[str] | None = None) -> FamilyResult:
    """Sweep one class: build its tiny instance, then every applicable method (or ``methods``).

    Returns:
        Its :class:`FamilyResult`; a class whose tiny instance does not build or run is returned with
        ``built=False`` and the reason.
    """
    family = tiny_family(class_name)
    result = FamilyResult(class_name, recipe=family.note)
    try:
        model = build_tiny(class_name)
        baseline = _baseline(model)
    except Exception as error:  # a config that does not build (TinyModelError) or a model that does not run: a skip
        result.built, result.reason = False, first_line(error)
        return result
    result.kind = position_kind(model)
    result.attention_interface = _uses_attention_interface(model)
    names = methods or applicable_methods(result.kind, result.attention_interface)
    saved_with = next((name for name in SAVE_LOAD_PREFERENCE if name in names), names[0])
    for method in names:
        outcome, notes = _sweep_method(model, method, baseline, save=method == saved_with)
        if outcome.outcome == OK:
            result.notes += [note for note in notes if note not in result.notes]
        result.methods.append(outcome)
    return result
