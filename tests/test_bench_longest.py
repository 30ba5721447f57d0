"""bench/longest.py: the bisection both training-memory benchmarks use finds the boundary with few probes,
never probes a length twice, resumes from recorded probes, and says when nothing up to ``hi`` failed."""

from __future__ import annotations

import math

import pytest

from tests.bench_helpers import load_bench_script


@pytest.mark.parametrize("boundary", [4096, 12288, 40960, 131072, 135168])
def test_bisection_finds_the_boundary_in_log2_probes(boundary):
    longest = load_bench_script("longest")
    probed = []

    def fits(length):
        probed.append(length)
        return length <= boundary

    found, failing = longest.bisect_longest(fits, 4096, 135168, 4096)
    assert found == boundary
    assert failing == (None if boundary == 135168 else boundary + 4096)
    assert len(probed) == len(set(probed)) <= math.ceil(math.log2(135168 // 4096)) + 1
    assert all(length % 4096 == 0 and 4096 < length <= 135168 for length in probed)


def test_recorded_probes_are_reused_and_bounds_report_the_interval_so_far():
    longest = load_bench_script("longest")
    known = {65536: True, 98304: False}
    assert longest.bounds(4096, 131072, 4096, known) == (65536, 98304)
    probed = []
    found, failing = longest.bisect_longest(lambda n: probed.append(n) or n <= 81920, 4096, 131072, 4096, known)
    assert (found, failing) == (81920, 86016)
    assert all(65536 < n < 98304 for n in probed) and len(probed) <= 3
    assert known[81920] is True and known[86016] is False  # new probes are recorded for a resume


def test_bad_intervals_are_refused():
    longest = load_bench_script("longest")
    with pytest.raises(ValueError, match="lo <= hi"):
        longest.bisect_longest(lambda n: True, 8192, 4096, 4096)
    with pytest.raises(ValueError, match="step > 0"):
        longest.bounds(4096, 8192, 0, {})
