"""T5 linear scaling at every distance, not only at multiples of the factor (methods/relative.py).

The rule is d -> trunc(d / s): distance d after scaling is bucketed as trunc(d / s) was before. Between
multiples of s a rule that floors (negative distances one bucket off), rounds, or ceils gives other
buckets, and the bias tables are large (std 3), so any such bucket changes the bias by O(1).
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_posext
from hf_posext.backends.relative import find_bias_sites
from hf_posext.methods.relative import scaled_distances
from tests.test_relative import MAX_DISTANCE, tiny_t5


@pytest.mark.parametrize("factor", [2, 3, 2.5, 1.3])
def test_scaled_distances_truncate_toward_zero_at_every_distance(factor):
    distances = torch.arange(-200, 201)
    scaled = scaled_distances(distances, factor)
    assert scaled.dtype == distances.dtype
    assert scaled.tolist() == [math.trunc(d / factor) for d in range(-200, 201)]
    assert scaled_distances(distances, 1) is distances


@pytest.mark.parametrize("family", ["t5", "umt5"])
@pytest.mark.parametrize("factor", [3, 2.5])
def test_bias_between_multiples_is_the_bias_of_the_truncated_distance(family, factor):
    model = tiny_t5(family)
    length = 3 * MAX_DISTANCE
    sites = find_bias_sites(model)
    original = [site.module.compute_bias(length, length) for site in sites]
    hf_posext.patch(model, "linear", factor=factor)
    scaled = [site.module.compute_bias(length, length) for site in sites]
    query = length // 2
    off_multiple = 0
    for before, after in zip(original, scaled):
        for key in range(length):
            d = key - query
            expected = before[0, :, query, query + math.trunc(d / factor)]
            assert torch.equal(after[0, :, query, key], expected), (d, factor)
            off_multiple += bool(d % factor)
    assert off_multiple > length  # most distances are not multiples of the factor
