"""The diagonal affine group {(A, b): A > 0} acting by θ = A ⊙ ξ + b."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributions import Distribution

from ..distributions import base_family, fisher_information
from .base import KLForm, LieGroup, Shape, register_group
from .multiplicative import clamp_positive_

__all__ = ["DiagonalAffineGroup", "exprel"]


def exprel(u: Tensor) -> Tensor:
    r""":math:`\varphi(u) = (e^u - 1)/u` with :math:`\varphi(0) = 1`, accurate and differentiable
    everywhere (``expm1`` away from 0, its Taylor series :math:`1 + u/2 + u^2/6 + u^3/24` for
    :math:`|u| < \epsilon^{1/4}`)."""
    small = u.abs() < torch.finfo(u.dtype).eps ** 0.25
    safe = torch.where(small, torch.ones_like(u), u)
    taylor = 1 + u * (1 / 2 + u * (1 / 6 + u / 24))
    return torch.where(small, taylor, torch.expm1(safe) / safe)


@register_group
class DiagonalAffineGroup(LieGroup):
    r"""Elementwise affine maps :math:`g = (A, b)`, :math:`A > 0`, acting by
    :math:`g \cdot \xi = A \odot \xi + b`.

    Elements are stacked ``[A, b]`` and algebra vectors ``[u, v]``, both of shape
    ``(2, *shape)``; base draws have the parameter's shape.

    .. math::
        (A_1, b_1)(A_2, b_2) = (A_1 A_2,\ A_1 b_2 + b_1), \qquad
        \exp(u, v) = (e^u,\ v\,\varphi(u)),\ \varphi(u) = \frac{e^u - 1}{u},

    :math:`\log|\det J_g| = \sum \log A`. The point estimate (ξ₀ = 0) is :math:`b`.
    """

    name = "DiagonalAffine"
    elementwise = True
    gaussian_like = True
    components = ("scale", "shift")

    def element_shape(self, shape: Shape) -> torch.Size:
        return torch.Size((2, *shape))

    def param_shape(self, element_shape: Shape) -> torch.Size:
        if len(element_shape) == 0 or element_shape[0] != 2:
            raise ValueError(f"affine elements have shape (2, ...), got {tuple(element_shape)}")
        return torch.Size(element_shape[1:])

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        one = torch.ones(shape, dtype=dtype, device=device)
        return torch.stack((one, torch.zeros_like(one)))

    def exp(self, X: Tensor) -> Tensor:
        u, v = X[0], X[1]
        # φ is capped where e^u overflows anyway, so a huge step gives inf, never inf·0.
        capped = u.clamp(max=math.log(torch.finfo(u.dtype).max))
        return torch.stack((u.exp(), v * exprel(capped)))

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return torch.stack((g[0] * h[0], g[0] * h[1] + g[1]))

    def inverse(self, g: Tensor) -> Tensor:
        a_inv = g[0].reciprocal()
        return torch.stack((a_inv, -g[1] * a_inv))

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        return g[0] * x + g[1]

    def theta(self, g: Tensor, xi: Tensor) -> Tensor:
        """A ⊙ ξ + b as one fused multiply-add."""
        return torch.addcmul(g[1], g[0], xi)

    def point(self, g: Tensor, mean: float | None = None, shape: Shape | None = None) -> Tensor:
        """b, or b + E[ξ]·A as one fused add."""
        return g[1].clone() if mean is None else torch.add(g[1], g[0], alpha=mean)

    def log_abs_det(self, g: Tensor) -> Tensor:
        return g[0].log().sum()

    def from_point(self, theta: Tensor, scale: float = 1.0) -> Tensor:
        """``(A, b) = (scale, θ)``."""
        theta = theta.detach()
        return torch.stack((torch.full_like(theta, scale), theta))

    def with_point(self, g: Tensor, theta: Tensor, xi0: Tensor | None = None) -> Tensor:
        """``(A, θ − A ⊙ ξ₀)``: the scale A, the posterior's spread, is kept."""
        theta = theta.detach()
        b = theta.clone() if xi0 is None else torch.addcmul(theta, g[0], xi0, value=-1)
        return torch.stack((g[0], b))

    def parts(self, g: Tensor) -> dict[str, Tensor]:
        return {"A": g[0], "b": g[1]}

    def check_element(self, g: Tensor) -> tuple[bool, str | None]:
        ok, reason = super().check_element(g)
        if ok and not bool((g[0] > 0).all()):
            return False, "the scale A of an affine element must be positive"
        return ok, reason

    def fisher_block(self, base: Distribution) -> Tensor | None:
        """``diag(F_scale, F_loc)`` for the components (u, v) of a centred base: (2, 1/σ²)
        Gaussian, (1, 1/σ²) Laplace, (2ν/(ν+3), (ν+1)/((ν+3)σ²)) Student-t."""
        location, scale = fisher_information(base)
        if location is None or scale is None:
            return None
        return torch.diag(torch.tensor([scale, location]))

    def kl_closed_form(self, base: Distribution) -> KLForm | None:
        """The base family's KL between (A, b) and (A_h, b_h): its locations b + Aμ and
        scales A (μ the base's location), for this class exactly and a base whose family
        gives it (Gaussian, Laplace); the gradient in (u, v) includes the entropy's part."""
        family = base_family(base, exact=True)
        if type(self) is not DiagonalAffineGroup or family is None:
            return None
        kl = family.location_scale_kl
        if kl is None:
            return None
        mu = float(base.loc)  # type: ignore[attr-defined]

        def form(g: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
            (A, b), (A_h, b_h) = g, h
            loc = b + A * mu - (b_h + A_h * mu)
            value, d_log_scale, d_loc = kl(base, loc, A.log() - A_h.log(), A, A_h)
            return value, torch.stack((d_log_scale + A * mu * d_loc, A * d_loc))

        return form

    def coordinate_variance(self, g: Tensor, base: Distribution) -> Tensor:
        """A² Var ξ."""
        return g[0].square() * float(base.variance)

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        self.one_element(x)
        return x[0] * u

    def projx(self, x: Tensor) -> Tensor:
        """A clamped to [tiny, max], b to [−max, max] of the dtype."""
        self.one_element(x)
        x = x.clone()
        clamp_positive_(x[0])
        big = torch.finfo(x.dtype).max
        x[1].clamp_(-big, big)
        return x
