"""PoSE position-id sampling, and PoSE chunks seeing each other in a model (batches from the packing)."""

from __future__ import annotations

import pytest
import torch

from tests.training_helpers import one_thread  # noqa: F401  (autouse fixture)

from hf_posext.training.packing import PackedSequences
from hf_posext.training.pose import pose_position_ids, sample_generator


@pytest.mark.parametrize("window,target,chunks", [(8, 32, 2), (16, 64, 3), (5, 6, 2), (32, 256, 4), (2, 1000, 2)])
def test_positions_increase_start_at_zero_and_stay_inside_the_target(window, target, chunks):
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        positions = pose_position_ids(window, target, chunks, generator)
        assert positions.shape == (window,) and positions.dtype == torch.long
        assert int(positions[0]) == 0 and int(positions[-1]) <= target - 1
        steps = positions[1:] - positions[:-1]
        assert bool((steps >= 1).all())
        # contiguous inside chunks: at most chunks - 1 jumps
        assert int((steps > 1).sum()) <= chunks - 1


def test_draws_cover_the_whole_target_range():
    """Over many samples the last position reaches the end of the target and the skips span [0, T - W]."""
    window, target = 8, 40
    generator = torch.Generator().manual_seed(1)
    lasts, seen = set(), torch.zeros(target, dtype=torch.bool)
    for _ in range(3000):
        positions = pose_position_ids(window, target, 2, generator)
        lasts.add(int(positions[-1]))
        seen[positions] = True
    assert max(lasts) == target - 1 and min(lasts) == window - 1
    assert bool(seen.all())  # every position of [0, T) is trained


def test_two_chunks_follow_the_paper_rule():
    """N = 2: the second chunk is shifted by one bias u ~ U{0..T-W}; chunk 1 stays at 0..l-1."""
    generator = torch.Generator().manual_seed(2)
    biases = set()
    for _ in range(2000):
        positions = pose_position_ids(6, 12, 2, generator)
        shift = positions - torch.arange(6)
        cut = int((shift == 0).sum()) if int(shift[-1]) else 6
        assert bool((shift[:cut] == 0).all()) and len(set(shift[cut:].tolist())) <= 1
        biases.add(int(shift[-1]))
    assert biases == set(range(0, 12 - 6 + 1))


def test_degenerate_cases_and_determinism():
    assert torch.equal(pose_position_ids(8, 8, 2), torch.arange(8))  # no room to skip
    assert torch.equal(pose_position_ids(8, 100, 1), torch.arange(8))  # one chunk
    a = pose_position_ids(16, 128, 3, sample_generator(0, 1, 5))
    b = pose_position_ids(16, 128, 3, sample_generator(0, 1, 5))
    c = pose_position_ids(16, 128, 3, sample_generator(0, 1, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("args,match", [
    ((16, 8), "must be an int >= the training window"),
    ((0, 8), "positive int"),
    ((8, 32, 9), "num_chunks"),
    ((8, 32, 0), "num_chunks"),
])
def test_bad_arguments_raise_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        pose_position_ids(*args)


@pytest.mark.parametrize("window,target,chunks", [(8, 32, 2), (16, 64, 3), (32, 256, 4)])
def test_a_far_sample_ends_at_the_last_target_position(window, target, chunks):
    generator = torch.Generator().manual_seed(3)
    middles = set()
    for _ in range(300):
        positions = pose_position_ids(window, target, chunks, generator, far=True)
        steps = positions[1:] - positions[:-1]
        assert int(positions[0]) == 0 and int(positions[-1]) == target - 1 and bool((steps >= 1).all())
        middles.add(tuple(positions.tolist()))
    assert len(middles) >= window - 1  # the cuts (and earlier biases) are still drawn
    assert torch.equal(pose_position_ids(8, 8, 2, far=True), torch.arange(8))  # no room to skip: unchanged
    assert torch.equal(pose_position_ids(8, 100, 1, far=True), torch.arange(8))  # one chunk: unchanged


def test_far_samples_train_the_longest_distances_that_uniform_draws_miss():
    """The share of samples holding a distance above T - W/2 (a fact in the first tokens of a T-token prompt):
    about W / (2 (T - W)) under the paper's draws, at least the far fraction with them."""
    window, target = 64, 1024
    sequences = torch.zeros(400, window, dtype=torch.long)

    def share_far(fraction: float) -> float:
        data = PackedSequences(sequences, seed=0, pose_target_length=target, pose_far_fraction=fraction)
        spans = [int(p[-1] - p[0]) for p in (data.sample(i)["position_ids"] for i in range(len(sequences)))]
        return sum(span > target - window // 2 for span in spans) / len(spans)

    uniform, far = share_far(0.0), share_far(0.5)
    assert uniform < 0.06 and far > 0.4


def test_far_fraction_leaves_the_other_samples_draws_unchanged():
    sequences = torch.zeros(200, 16, dtype=torch.long)
    plain = PackedSequences(sequences, seed=4, pose_target_length=128)
    half = PackedSequences(sequences, seed=4, pose_target_length=128, pose_far_fraction=0.5)
    every = PackedSequences(sequences, seed=4, pose_target_length=128, pose_far_fraction=1.0)
    far = 0
    for i in range(len(sequences)):
        a, b, c = (d.sample(i)["position_ids"] for d in (plain, half, every))
        assert int(c[-1]) == 127
        if torch.equal(a, b):
            continue
        far += 1
        assert int(b[-1]) == 127 and torch.equal(b, c)  # a far sample: the same cut, its last chunk at the end
    assert 70 < far < 130  # about half


def test_pose_chunks_attend_to_each_other_in_the_model():
    """The batch's explicit attention mask keeps transformers from reading PoSE skips as packed-sequence
    boundaries: changing a token of chunk 1 must change the predictions in chunk 2."""
    from hf_posext.models import tiny_model

    model = tiny_model("llama", attn_implementation="sdpa")
    sequences = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    data = PackedSequences(sequences, seed=0, pose_target_length=64)
    batch = data.batch(0, 0, 1, 1)
    positions = batch["position_ids"][0]
    jump = int(torch.nonzero(positions[1:] - positions[:-1] > 1)[0]) + 1
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, 0] = (changed["input_ids"][0, 0] + 1) % 128
    with torch.no_grad():
        a = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"]).logits
        b = model(input_ids=changed["input_ids"], position_ids=changed["position_ids"], attention_mask=changed["attention_mask"]).logits
    assert (a[0, jump:] - b[0, jump:]).abs().max() > 1e-4
