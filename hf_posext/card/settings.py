"""What a suite run is asked for, typed: :class:`CardSettings`, which the command line builds and
:func:`hf_posext.card.run.run_card` takes (no ``argparse.Namespace`` below the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hf_posext.card.spec import ModelSpec, ruler_tasks

__all__ = ["DEFAULT_OUT", "DEFAULT_TASKS", "CardSettings"]

#: Where a suite writes when no ``--out`` is given (beside the other eval commands' ``results``).
DEFAULT_OUT = "results/suite"
DEFAULT_TASKS = ("perplexity", "passkey", "needle", "ruler", "ending")


@dataclass(frozen=True)
class CardSettings:
    """One suite run: rows (models × methods), lengths and tasks, and how to run them.

    Each field is the command-line flag of the same name (``hf-posext eval suite --help``).

    Args:
        models: the ``--models`` entries (:func:`hf_posext.card.spec.parse_model_specs`); the first, when it has no
            adapter and no scaling saved in its config, is the base model.
        lengths: lengths in tokens.
        tasks: perplexity, passkey, needle, ruler (the six offline RULER tasks and the seven that need a download),
            RULER task names, or ending (:func:`hf_posext.card.spec.parse_tasks`).
        methods: comma-separated scaling requests applied to every model without its own (``none`` = unscaled,
            ``as-saved`` = the model's own saved scaling).
        factor: the factor of every method but none and as-saved (None: longest length / window).
        params: deprecated ``--param`` method parameters.
        trials: samples per task and length (passkey and needle: trials over the depths; perplexity: windows,
            at most 8).
        seed: seed of the RULER samples and the passkeys.
        out: the suite's folder (``card.json``, ``card.md``, ``card.html``, plots, ``ruler/``, ``tasks/``).
        sample_cache: folder of cached RULER samples (None: ``out/ruler-samples``).
        budget: ``short`` (generate short first, again with the full budget only where that could change the score)
            or ``full`` (lm-eval's budgets).
        max_length: the harness's ``max_length`` (None: each row's scaled window).
        skip_over_window: list cells whose prompt does not fit the row's window as skipped instead of refusing.
        dtype: float32, bfloat16, float16 or auto.
        device: cpu, cuda, ... (None: this process's accelerator, else cpu).
        data: the perplexity text.
        haystack: the needle haystack text.
        progress: draw progress bars (else one log line a sample).

    Raises:
        ValueError: no model or length, fewer than one trial, an unknown budget, dtype or device.
    """

    models: tuple[ModelSpec, ...]
    lengths: tuple[int, ...]
    tasks: tuple[str, ...] = DEFAULT_TASKS
    methods: str = "none"
    factor: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    trials: int = 20
    seed: int = 0
    out: Path = Path(DEFAULT_OUT)
    sample_cache: Path | None = None
    budget: str = "short"
    max_length: int | None = None
    skip_over_window: bool = False
    dtype: str = "auto"
    device: str | None = None
    data: str = "builtin:python-docs"
    haystack: str = "builtin:python-docs"
    progress: bool = True

    def __post_init__(self) -> None:
        from hf_posext.evaluation.loading import check_device_name, check_dtype_name

        for name in ("models", "lengths", "tasks"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "out", Path(self.out))
        if self.sample_cache is not None:
            object.__setattr__(self, "sample_cache", Path(self.sample_cache))
        if not self.models:
            raise ValueError("--models is empty; pass e.g. --models smollm2-135m.")
        if not self.lengths:
            raise ValueError("--lengths is empty; pass e.g. --lengths 2048,4096.")
        if self.trials < 1:
            raise ValueError(f"--trials must be a positive number of samples, got {self.trials}.")
        if self.budget not in ("short", "full"):
            raise ValueError(f"--budget {self.budget!r}: pass short or full.")
        check_dtype_name(self.dtype)
        if self.device is not None:
            check_device_name(self.device)

    @property
    def ruler(self) -> list[str]:
        """The offline RULER tasks asked for, each once."""
        return ruler_tasks(self.tasks)

    def with_device(self) -> "CardSettings":
        """These settings with ``device`` chosen: as given, else this process's accelerator, else cpu."""
        if self.device is not None:
            return self
        import torch

        return replace(self, device="cuda" if torch.cuda.is_available() else "cpu")
