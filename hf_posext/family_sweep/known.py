"""The one table of outcomes other than ``ok``: every refusal, every known crash, every class that is not built.

Keyed by ``(class name, method)``; the method ``"*"`` covers every method of that class, ``"attention"`` its
attention-level methods and their composition (:data:`ATTENTION_GROUP`). Each entry holds the
expected outcome and a piece of the one-line reason that must appear in what the sweep saw, so a reworded or
new failure shows up as a difference, and an entry that starts to pass shows up as stale. A family that a new
transformers release adds starts with no entry: anything but ``ok`` fails until it is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sweep's result type, for annotations only
    from hf_posext.family_sweep.sweep import FamilyResult

__all__ = ["ATTENTION_GROUP", "Expected", "KNOWN", "expected_outcome", "problems", "REFUSED", "XFAIL", "SKIPPED"]

REFUSED, XFAIL, SKIPPED = "refused", "xfail", "skipped"
#: The methods an ``"attention"`` entry covers.
ATTENTION_GROUP = ("self-extend", "dca", "string", "yarn+string")


@dataclass(frozen=True)
class Expected:
    """A listed outcome.

    Attributes:
        outcome: ``refused`` (``patch`` says no, in one line), ``xfail`` (a crash after a successful patch, or a
            wrong result: a backend bug still open) or ``skipped`` (no tiny instance can run here).
        reason: a piece of the one-line error that the sweep must see (and the matrix shows).
    """

    outcome: str
    reason: str


#: (class name, method or "*") -> what the sweep is expected to see there.
#: Regenerated from the sweep at the date in bench/results/family_sweep/sweep.json; XFAIL rows are backend bugs still open.
KNOWN: dict[tuple[str, str], Expected] = {
    ('AXK2ForCausalLM', 'attention'): Expected(REFUSED, 'a sparse-attention indexer that picks the keys by their rotary positions, which'),
    ('CpmAntForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in CpmAntForCausalLM (no position embedding module found either). hf_posext'),
    ('CsmDepthDecoderForCausalLM', '*'): Expected(REFUSED, "CsmDepthDecoderForCausalLM's positions count its 32 codebooks (one token per codebook"),
    ('DeepseekV32ForCausalLM', 'attention'): Expected(REFUSED, 'a sparse-attention indexer that picks the keys by their rotary positions, which'),
    ('DeepseekV4ForCausalLM', 'attention'): Expected(REFUSED, 'holds its own rotary module (model.layers.0.self_attn.compressor.rotary_emb)'),
    ('DeepseekV4ForCausalLM', 'dynamic-ntk'): Expected(REFUSED, 'NTK-aware scaling raises the base to b*s^(d/(d-2)), undefined for rotary dim d=2: use linear or yarn for this'),
    ('DeepseekV4ForCausalLM', 'ntk'): Expected(REFUSED, 'NTK-aware scaling raises the base to b*s^(d/(d-2)), undefined for rotary dim d=2: use linear or yarn for this'),
    ('Dots3NoteForCausalLM', 'attention'): Expected(REFUSED, 'a sparse-attention indexer that picks the keys by their rotary positions, which'),
    ('FalconMambaForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in FalconMambaForCausalLM (no position embedding module found either).'),
    ('Gemma4AssistantForCausalLM', 'attention'): Expected(REFUSED, "it is a drafting head that attends to its target model's keys (shared_kv_states)"),
    ('Gemma4UnifiedAssistantForCausalLM', 'attention'): Expected(REFUSED, "it is a drafting head that attends to its target model's keys (shared_kv_states)"),
    ('GlmMoeDsaForCausalLM', 'attention'): Expected(REFUSED, 'a sparse-attention indexer that picks the keys by their rotary positions, which'),
    ('GraniteMoeHybridForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in GraniteMoeHybridForCausalLM (no position embedding module found either).'),
    ('HYV4ForCausalLM', 'attention'): Expected(REFUSED, 'a sparse-attention indexer that picks the keys by their rotary positions, which'),
    ('Inkling2ForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in Inkling2ForCausalLM (no position embedding module found either). hf_posext'),
    ('Inkling2LoopForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in Inkling2LoopForCausalLM (no position embedding module found either).'),
    ('InklingForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in InklingForCausalLM (no position embedding module found either). hf_posext'),
    ('JambaForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in JambaForCausalLM (no position embedding module found either). hf_posext'),
    ('KimiLinearForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in KimiLinearForCausalLM (no position embedding module found either). hf_posext'),
    ('Mamba2ForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in Mamba2ForCausalLM (no position embedding module found either). hf_posext'),
    ('MambaForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in MambaForCausalLM (no position embedding module found either). hf_posext'),
    ('MiMoV2FlashForCausalLM', 'dynamic-ntk'): Expected(REFUSED, 'NTK-aware scaling raises the base to b*s^(d/(d-2)), undefined for rotary dim d=2: use linear or yarn for this'),
    ('MiMoV2FlashForCausalLM', 'ntk'): Expected(REFUSED, 'NTK-aware scaling raises the base to b*s^(d/(d-2)), undefined for rotary dim d=2: use linear or yarn for this'),
    ('MusicgenForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in MusicgenForCausalLM (no position embedding module found either). hf_posext'),
    ('MusicgenMelodyForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in MusicgenMelodyForCausalLM (no position embedding module found either).'),
    ('NemotronHForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in NemotronHForCausalLM (no position embedding module found either). hf_posext'),
    ('RecurrentGemmaForCausalLM', '*'): Expected(REFUSED, 'recurrent_gemma attends only within a sliding window of 16 tokens (attention_window_size)'),
    ('RwkvForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in RwkvForCausalLM (no position embedding module found either). hf_posext'),
    ('WhisperForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in WhisperForCausalLM (found learned position tables:'),
    ('Zamba2ForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in Zamba2ForCausalLM (no position embedding module found either). hf_posext'),
    ('ZambaForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in ZambaForCausalLM (no position embedding module found either). hf_posext'),
    ('xLSTMForCausalLM', '*'): Expected(REFUSED, 'No rotary (RoPE) module found in xLSTMForCausalLM (no position embedding module found either). hf_posext'),
}


def expected_outcome(class_name: str, method: str) -> Expected | None:
    """The listed outcome of ``method`` on ``class_name``: its own entry, else its group's, else the class's ``"*"``."""
    group = KNOWN.get((class_name, "attention")) if method in ATTENTION_GROUP else None
    return KNOWN.get((class_name, method)) or group or KNOWN.get((class_name, "*"))


def problems(result: "FamilyResult") -> list[str]:
    """Every difference between a class's sweep and :data:`KNOWN`, one line each (empty: as expected).

    A skip, refusal or crash must be listed with a reason found in what the sweep saw; a listed entry that now
    passes is stale and must be removed.
    """
    name = result.class_name
    if not result.built:
        expected = KNOWN.get((name, "*"))
        if expected is None or expected.outcome != SKIPPED:
            return [f"{name} was not built ({result.reason}): give it a recipe in family_sweep/recipes.py, or list it "
                    f"as skipped in family_sweep/known.py with the reason"]
        return [] if expected.reason in result.reason else [f"{name}: skipped for another reason than listed: {result.reason}"]
    found = []
    for outcome in result.methods:
        expected = expected_outcome(name, outcome.method)
        seen = {"ok": None, "refused": REFUSED, "crash": XFAIL}[outcome.outcome]
        where = f"{name} / {outcome.method}"
        if seen is None and expected is not None and expected.outcome != SKIPPED:
            found.append(f"{where} is listed as {expected.outcome} ({expected.reason!r}) but now passes: remove it from KNOWN")
        elif seen is not None and (expected is None or expected.outcome != seen):
            found.append(f"{where}: {outcome.outcome}, not listed as such in family_sweep/known.py: {outcome.reason}")
        elif seen is not None and expected.reason not in outcome.reason:
            found.append(f"{where}: {outcome.outcome} for another reason than listed ({expected.reason!r}): {outcome.reason}")
    return found
