"""The additive group (R^P, +): θ = m + ξ — the rule becomes noisy SGD with momentum."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Distribution

from ..distributions import base_family, fisher_information
from .base import KLForm, LieGroup, Shape, register_group

__all__ = ["AdditiveGroup"]


@register_group
class AdditiveGroup(LieGroup):
    r"""Translations :math:`g = m \in \mathbb{R}^P` acting by :math:`m \cdot \xi = m + \xi`.

    :math:`\exp(X) = X`, :math:`g \cdot h = g + h`, :math:`\log|\det J_g| = 0` (the entropy
    is constant). Elements, algebra vectors and base draws have the parameter's shape; the
    point estimate is :math:`m`.
    """

    name = "Additive"
    constant_entropy = True
    elementwise = True
    gaussian_like = True

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

    def fisher_block(self, base: Distribution) -> Tensor | None:
        """``[[F_loc]]``: the base's location-family Fisher information (1/σ² for a Gaussian
        or Laplace, (ν+1)/((ν+3)σ²) for a centred Student-t)."""
        location, _ = fisher_information(base)
        return None if location is None else torch.tensor([[location]])

    def kl_closed_form(self, base: Distribution) -> KLForm | None:
        """The base family's KL between locations m and m_h (scale 1: the entropy is
        constant), for this class exactly and a base whose family gives it (Gaussian,
        Laplace)."""
        family = base_family(base, exact=True)
        if type(self) is not AdditiveGroup or family is None or family.location_scale_kl is None:
            return None
        kl = family.location_scale_kl

        def form(g: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
            one = torch.ones_like(g)
            value, _, d_loc = kl(base, g - h, torch.zeros_like(g), one, one)
            return value, d_loc

        return form

    def coordinate_variance(self, g: Tensor, base: Distribution) -> Tensor:
        """Var ξ at every coordinate."""
        return g.new_full(g.shape, float(base.variance))

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        return u  # every shape is one element: geoopt's batches need no check
