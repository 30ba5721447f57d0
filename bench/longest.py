"""The longest-length bisection shared by bench/train_memory.py (host RSS on CPU) and bench/train_gpu_loss.py
(GPU memory under a per-process cap). Run those scripts as ``python bench/<name>.py``: this folder is then
on ``sys.path``.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["bisect_longest", "bounds"]


def bisect_longest(fits: Callable[[int], bool], lo: int, hi: int, step: int,
                   known: dict[int, bool] | None = None) -> tuple[int, int | None]:
    """The longest multiple of ``step`` in ``[lo, hi]`` for which ``fits(length)`` holds, by bisection.

    ``lo`` is taken to fit without a probe (pass a length measured before); fitting is assumed monotone
    (a length that fits means every shorter one does). ``known`` holds earlier probes (length -> fits),
    which narrow the interval and are never probed again, so a stopped search resumes where it was.

    Args:
        fits: runs one probe at ``length`` and says whether it stayed within the limit (called at most
            ``ceil(log2((hi - lo) / step)) + 1`` times).
        lo, hi: the interval searched (tokens); ``step``: lengths probed are multiples of it.
        known: earlier probes, updated in place with the new ones.

    Returns:
        ``(longest_fitting, shortest_failing)``; ``shortest_failing`` is None when ``hi`` itself fits.
    """
    known = {} if known is None else known
    while True:
        low, high = bounds(lo, hi, step, known)
        high_units = (hi // step + 1) if high is None else high // step
        if high_units - low // step <= 1:
            return low, high
        middle = (low // step + high_units) // 2 * step
        known[middle] = bool(fits(middle))


def bounds(lo: int, hi: int, step: int, known: dict[int, bool]) -> tuple[int, int | None]:
    """What the probes in ``known`` establish so far: ``(longest_fitting, shortest_failing)`` over multiples
    of ``step`` in ``[lo, hi]`` (``lo`` taken to fit; None: no failure seen up to ``hi``)."""
    if step <= 0 or lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < lo <= hi and step > 0, got lo={lo}, hi={hi}, step={step}")
    low = max([lo // step] + [n // step for n, ok in known.items() if ok])
    failing = [n // step for n, ok in known.items() if not ok and n // step <= hi // step]
    return low * step, (min(failing) * step if failing else None)


if __name__ == "__main__":  # a helper module, imported by the benchmarks above; `--help` says so
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
