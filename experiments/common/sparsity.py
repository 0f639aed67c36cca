"""Sparsity of first-layer weights (filters).

A layer's weight tensor ``(F, ...)`` holds F filters of n = numel/F entries each (n is the
fan-in). Four views, because each alone misleads:

- ``max_abs`` max|w| and ``median_abs`` median|w|: the scale of the largest and of a
  typical weight;
- ``near_zero``: the share of weights with |w| < ``NEAR_ZERO`` · σ₀, σ₀ = 1/√n the scale of
  the layer's initialisation (experiments/common/models.py). It does not depend on the largest
  weight, so a few huge weights cannot make every other weight "near zero";
- ``near_zero_max``: the share with |w| < 10⁻³ · max|w|, the reference code's measure, kept
  to compare with its numbers; one large weight drives it towards 1;
- ``hoyer``: (√n − ‖w‖₁/‖w‖₂)/(√n − 1) averaged over filters, 0 for equal magnitudes and
  1 for a single non-zero entry.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

NEAR_ZERO = 0.01  # near zero: |w| < 0.01 σ₀ (≈ 0.8% of the weights of a fresh layer)
NEAR_ZERO_MAX = 1e-3  # the reference's threshold relative to max|w|


def first_layer(model: nn.Module) -> nn.Parameter:
    """Weight of the first dense or convolutional layer (first parameter with ndim ≥ 2)."""
    for param in model.parameters():
        if param.ndim >= 2:
            return param
    raise ValueError("model has no dense or convolutional layer")


def init_scale(weight: Tensor) -> float:
    """σ₀ = 1/√n for filters of n entries: the scale of the layer's initialisation."""
    return 1.0 / math.sqrt(weight[0].numel())


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


def near_zero_fraction(weight: Tensor, threshold: float) -> float:
    """Fraction of entries with |w| < ``threshold``."""
    return (weight.detach().abs() < threshold).double().mean().item()


def sparsity(weight: Tensor) -> dict[str, float]:
    """The measures of the module docstring for one layer."""
    w = weight.detach().abs().double()
    peak = w.max().item()
    return {
        "max_abs": peak,
        "median_abs": w.median().item(),
        "near_zero": near_zero_fraction(w, NEAR_ZERO * init_scale(weight)),
        "near_zero_max": near_zero_fraction(w, NEAR_ZERO_MAX * peak),
        "hoyer": hoyer(weight),
    }
