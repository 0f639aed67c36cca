"""Out-of-distribution detection by predictive entropy.

A model that knows what it does not know predicts with higher entropy
H(x) = −Σ_k p(k|x) log p(k|x) on inputs unlike its training data. The AUROC of H as a
score separating shifted inputs (positives) from in-distribution test inputs (negatives)
is 1 for perfect separation and 0.5 for none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from scipy.stats import rankdata
from torch import Tensor

SHIFTS = ("rotated", "permuted", "noise")


def entropy(log_probs: Tensor) -> Tensor:
    """Predictive entropy −Σ_k p_k log p_k per row of log probabilities ``(N, K)``."""
    return -(log_probs.exp() * log_probs).nan_to_num().sum(dim=-1)


def auroc(negatives: Tensor, positives: Tensor) -> float:
    """Area under the ROC curve of a score: P(s⁺ > s⁻) + ½ P(s⁺ = s⁻).

    By the rank-sum (Mann–Whitney) identity: (R⁺ − n⁺(n⁺ + 1)/2) / (n⁺ n⁻), R⁺ the sum of
    the positives' ranks in the pooled scores (ties get their average rank).
    """
    n_neg, n_pos = negatives.numel(), positives.numel()
    if n_neg == 0 or n_pos == 0:
        raise ValueError(f"AUROC needs scores of both kinds, got {n_neg} and {n_pos}")
    pooled = torch.cat([negatives.flatten(), positives.flatten()]).double().cpu().numpy()
    ranks = rankdata(pooled)[n_neg:]
    return float((ranks.sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def shifted_inputs(inputs: Sequence[Tensor], seed: int = 0) -> dict[str, list[Tensor]]:
    """Inputs the model never saw, batch by batch like ``inputs`` (images ``(B, C, H, W)``).

    ``rotated``: each image turned by 90° (square images only); ``permuted``: the pixels of
    every image moved by one fixed random permutation; ``noise``: pixels uniform between
    the smallest and largest input value.
    """
    gen = torch.Generator().manual_seed(seed)
    first = inputs[0]
    low = min(float(x.min()) for x in inputs)
    high = max(float(x.max()) for x in inputs)
    shifts: dict[str, list[Tensor]] = {}
    if first.ndim == 4 and first.shape[-1] == first.shape[-2]:
        shifts["rotated"] = [x.rot90(1, dims=(-2, -1)) for x in inputs]
    pixels = first[0, 0].numel() if first.ndim == 4 else first[0].numel()
    perm = torch.randperm(pixels, generator=gen).to(first.device)
    shifts["permuted"] = [
        x.flatten(-2)[..., perm].view_as(x) if x.ndim == 4 else x.flatten(1)[:, perm].view_as(x)
        for x in inputs
    ]
    shifts["noise"] = [
        low + (high - low) * torch.rand(x.shape, generator=gen).to(x.device) for x in inputs
    ]
    return shifts
