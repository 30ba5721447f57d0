"""Searched per-dimension RoPE rescale factors, LongRoPE-style (Ding et al. 2024).

Ding, Zhang, Zhang, Xu, Shang, Xu, Yang, Yang 2024, "LongRoPE: Extending LLM Context Window Beyond 2
Million Tokens" (arXiv:2402.13753), section 3.2: an evolutionary search over per-dimension rescale
factors lambda_i (theta'_i = theta_i / lambda_i), with the fitness the perplexity at the target length.

What this module does, and where it differs from the paper:

* Search space: d/2 factors, each in ``[1, max_factor]`` and non-decreasing with the dimension index
  (low frequencies are stretched at least as much as high ones: the paper's monotonicity constraint).
  Every candidate is projected onto that space by a running maximum.
* Initial population: the frequency parts of PI (every factor s), YaRN (theta_i / theta'_i of
  :func:`hf_posext.methods.rope.yarn`) and NTK-aware scaling, then mutations of them. ``start_from=``
  adds the factors of earlier searches at other scales (LongRoPE extends progressively, each search
  seeded from the one before), carried to the new scale s' by ``lambda_i ** (ln s' / ln s)``: that maps
  an extrapolated dimension (1) to 1 and an interpolated one (s) to s', and keeps the order. The paper also
  searches n-hat, a number of initial tokens left unscaled; we do not (it needs a position-dependent
  rotary table, which ``longrope`` does not have).
* Generations: keep the best ``parents`` (elitism), fill the population with mutations (each factor
  multiplied by ``exp(N(0, mutation_scale))`` with probability ``mutation_rate``) and one-point
  crossovers of two parents; a candidate already evaluated is never evaluated twice.
* Fitness: mean next-token NLL (log-perplexity) of ``model`` patched with ``longrope`` and the
  candidate, on calibration segments of exactly ``target_length`` tokens; the loss runs over chunks of
  the final hidden states (:func:`hf_posext.lm.scoring.chunked_nll`), never the full logits.
  The attention factor is LongRoPE's sqrt(1 + ln s / ln L) for every candidate, as ``longrope`` applies.
* Data parallel: launched with several processes (``accelerate launch --num_processes N`` or
  ``torchrun``), each process evaluates its share of a generation's candidates and the results are
  gathered; every process draws the same candidates from the same seed, so they stay in step.
* Resume: ``resume=`` continues a search: its candidates are not evaluated again, it goes on with up to
  ``generations`` more generations, and ``time_budget_s`` counts this run only. With ``output``, the JSON is
  rewritten after every generation, so a search that was stopped (time budget, crash) resumes from its last
  finished generation. The children drawn after a resume differ from those an uninterrupted run would have drawn.
  The result's settings keep the key ``"windows"`` for the number of segments, as files written before the
  rename to ``segments`` do.

The result is a JSON file that ``hf_posext.patch(model, "longrope", factor=s, factors=PATH)`` reads.
"""

from hf_posext.search.factors import (
    calibration_segments,
    calibration_windows,
    initial_factors,
    make_monotone,
    rescale_factors,
)
from hf_posext.search.result import SearchResult
from hf_posext.search.run import search_factors

__all__ = [
    "SearchResult",
    "search_factors",
    "initial_factors",
    "rescale_factors",
    "make_monotone",
    "calibration_segments",
    "calibration_windows",
]
