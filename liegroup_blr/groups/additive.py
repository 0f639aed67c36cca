"""The additive group (R^P, +): θ = m + ξ — the rule becomes noisy SGD with momentum."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import LieGroup, Shape

__all__ = ["AdditiveGroup"]


class AdditiveGroup(LieGroup):
    r"""Translations :math:`g = m \in \mathbb{R}^P` acting by :math:`m \cdot \xi = m + \xi`.

    :math:`\exp(X) = X`, :math:`g \cdot h = g + h`, :math:`\log|\det J_g| = 0` (the entropy
    is constant). Elements, algebra vectors and base draws have the parameter's shape; the
    point estimate is :math:`m`.
    """

    name = "Additive"
    constant_entropy = True
    elementwise = True

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    def exp(self, X: Tensor) -> Tensor:
        return X

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return g + h

    def inverse(self, g: Tensor) -> Tensor:
        return -g

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        return g + x

    def log_abs_det(self, g: Tensor) -> Tensor:
        return (g * 0).sum()

    def from_point(self, theta: Tensor) -> Tensor:
        return theta.detach().clone()

    def point(self, g: Tensor, mean: float | None = None, shape: Shape | None = None) -> Tensor:
        """m, or m + E[ξ]."""
        return g.clone() if mean is None else g + mean

    def with_point(self, g: Tensor, theta: Tensor, xi0: Tensor | None = None) -> Tensor:
        """m = θ − ξ₀ (the spread is the base's: nothing of g to keep)."""
        return theta.detach().clone() if xi0 is None else theta.detach() - xi0

    def parts(self, g: Tensor) -> dict[str, Tensor]:
        return {"m": g}

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        return u  # every shape is one element: geoopt's batches need no check
