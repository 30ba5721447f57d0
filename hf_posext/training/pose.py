"""PoSE position ids: train on a short window whose positions span a long target.

Positional Skip-wisE training (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via
Positional Skip-wise Training", arXiv:2309.10400) keeps the training window W short and makes the model
see the relative positions of a long target window T by giving each training sample position ids that
*skip*: the window is cut into N chunks; chunk i (length l_i, starting at token s_i = l_0 + ... + l_{i-1})
gets positions ``s_i + u_i, ..., s_i + u_i + l_i - 1`` with skipping biases

    u_0 = 0,   u_i ~ Uniform{u_{i-1}, ..., T - W}   (i >= 1),

so positions increase strictly, the first token sits at 0 and the last at most at T - 1. Biases and chunk
lengths are redrawn for every sample. The text itself stays contiguous (the paper's content skip v_i = 0).

A *far* sample (ours, not the paper's) pushes its last chunk to the end of the target,

    u_{N-1} = T - W,

so its last token sits at T - 1 and its longest distances are about T. Uniform biases almost never draw
those: with N = 2 a distance above T - W/2 needs u_1 > T - 3W/2 or so, a chance of about W/(2(T - W)) (under
4 % at W = 2048, T = 32768), and a fact must also lie in the first chunk. A retrieval question about the
first tokens of a T-token prompt (a passkey at depth 0) asks for exactly such a distance.
"""

from __future__ import annotations

import torch

__all__ = ["pose_position_ids", "sample_generator"]


def sample_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """A generator that depends only on (seed, epoch, sample index): resumable and process-independent."""
    generator = torch.Generator()
    # Distinct large odd multipliers keep nearby (epoch, index) pairs from sharing a seed.
    generator.manual_seed((seed * 1_000_003 + epoch * 7_919_993 + sample_index * 2_654_435_761) % (2**63 - 1))
    return generator


def pose_position_ids(
    window: int, target_length: int, num_chunks: int = 2, generator: torch.Generator | None = None, far: bool = False
) -> torch.Tensor:
    """Draw the PoSE position ids of one training sample.

    Args:
        window: training sequence length W (tokens per sample, ``data.sequence_length``).
        target_length: target context T; every position lies in [0, T).
        num_chunks: N, chunks the window is cut into (the paper uses 2). Chunk lengths are a uniform
            random composition of W into N positive parts.
        generator: torch random generator (for reproducible draws).
        far: push the last chunk to the end of the target (bias T - W, the last position T - 1; see the
            module docstring). The earlier biases are drawn as usual; with one chunk (or T = W) it changes nothing.

    Returns:
        LongTensor of shape [W]: strictly increasing, first element 0, last element <= T - 1.

    Raises:
        ValueError: W < 1, T < W, N < 1 or N > W.

    Example:
        >>> pose_position_ids(8, 32, 2, torch.Generator().manual_seed(0))  # e.g. [0, 1, 2, 19, 20, ...]
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"PoSE window must be a positive int, got {window!r}.")
    if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length < window:
        raise ValueError(
            f"PoSE target_length ({target_length!r}) must be an int >= the training window ({window}); "
            "the window cannot be longer than the context it simulates. Lower data.sequence_length or raise the target."
        )
    if not isinstance(num_chunks, int) or not 1 <= num_chunks <= window:
        raise ValueError(f"PoSE num_chunks must be an int in [1, window={window}], got {num_chunks!r}.")
    slack = target_length - window
    if num_chunks == 1 or slack == 0:
        # One chunk can only shift as a whole; starting at 0 keeps the original convention.
        return torch.arange(window, dtype=torch.long)
    # Chunk boundaries: N - 1 distinct cut points in 1..W-1.
    cuts = torch.randperm(window - 1, generator=generator)[: num_chunks - 1] + 1
    cuts, _ = torch.sort(cuts)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    ends = torch.cat([cuts, torch.tensor([window])])
    positions = torch.empty(window, dtype=torch.long)
    bias = 0
    for index, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        if index > 0:
            bias = int(torch.randint(bias, slack + 1, (1,), generator=generator))
            if far and index == num_chunks - 1:
                bias = slack
        positions[start:end] = torch.arange(start, end) + bias
    return positions
