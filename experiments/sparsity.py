"""Sparsity of first-layer weights (filters).

A layer's weight tensor ``(F, ...)`` holds F filters of n = numel/F entries each.
"""

from __future__ import annotations

import math

from torch import Tensor, nn


def first_layer(model: nn.Module) -> nn.Parameter:
    """Weight of the first dense or convolutional layer (first parameter with ndim ≥ 2)."""
    for param in model.parameters():
        if param.ndim >= 2:
            return param
    raise ValueError("model has no dense or convolutional layer")


def hoyer(weight: Tensor) -> float:
    """Hoyer sparsity averaged over filters: (√n − ‖w‖₁/‖w‖₂) / (√n − 1).

    1 for a filter with a single non-zero entry, 0 for one with equal magnitudes; an
    all-zero filter counts as 1.
    """
    w = weight.detach().double().flatten(1)
    n = w.shape[1]
    if n < 2:
        raise ValueError(f"Hoyer measure needs filters of at least 2 entries, got {n}")
    l1, l2 = w.abs().sum(dim=1), w.norm(dim=1)
    ratio = (l1 / l2.clamp_min(1e-300)).where(l2 > 0, l1.new_ones(()))
    return ((math.sqrt(n) - ratio) / (math.sqrt(n) - 1)).mean().item()


def near_zero_fraction(weight: Tensor, relative: float = 1e-3) -> float:
    """Fraction of entries with |w| < relative · max |w| over the whole layer."""
    w = weight.detach().abs()
    return (w < relative * w.max()).double().mean().item()


def sparsity(weight: Tensor) -> dict[str, float]:
    """Hoyer measure and near-zero fraction of a layer."""
    return {"hoyer": hoyer(weight), "near_zero": near_zero_fraction(weight)}
