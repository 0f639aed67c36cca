"""Rotation-scalings of weight pairs: each pair is multiplied by a non-zero complex number."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal

from .base import LieGroup, Shape, register_group

__all__ = ["RotationScalingGroup"]


def _pairs(x: Tensor) -> tuple[Tensor, Tensor]:
    """The two entries of each consecutive pair along the last axis."""
    x = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return x[..., 0], x[..., 1]


@register_group
class RotationScalingGroup(LieGroup):
    r"""Non-zero complex numbers :math:`z = r e^{i\varphi}`, one per pair of consecutive
    entries along a parameter's last axis, acting on the pair :math:`\xi = (\xi_1, \xi_2)` as
    :math:`\xi_1 + i\xi_2 \mapsto z(\xi_1 + i\xi_2)`: a rotation by φ and a scaling by r.

    For a parameter of shape ``(*s, 2k)`` elements are ``[Re z, Im z]`` and algebra vectors
    ``[a, φ]`` of shape ``(2, *s, k)``, so the group acts coordinatewise on pairs
    (``elementwise``, components ``("scale", "rotation")``); base draws have the
    parameter's shape.

    .. math:: \exp(a, \varphi) = e^{a}(\cos\varphi, \sin\varphi),\qquad
              z_1 z_2 \text{ complex},\qquad
              \log|\det J_z| = \sum \log |z|^2 .

    The point estimate reads ξ₀ = (1, 0) in each pair: :math:`\theta = (\operatorname{Re} z,
    \operatorname{Im} z)`. Under an isotropic base (e.g. a centred Gaussian) a rotation does
    not change the distribution, so the Fisher metric is singular: use a base with a non-zero
    mean, :math:`\mathcal N(\mu, \sigma^2)` per entry, for which it is
    :math:`\operatorname{diag}(4 + 2\mu^2/\sigma^2,\ 2\mu^2/\sigma^2)` per pair.
    """

    name = "RotationScaling"
    elementwise = True
    components = ("scale", "rotation")

    def element_shape(self, shape: Shape) -> torch.Size:
        if len(shape) == 0 or shape[-1] % 2:
            raise ValueError(
                f"rotation-scaling acts on pairs along the last axis, which must have an even "
                f"length; got a parameter of shape {tuple(shape)}"
            )
        return torch.Size((2, *shape[:-1], shape[-1] // 2))

    def param_shape(self, element_shape: Shape) -> torch.Size:
        if len(element_shape) < 2 or element_shape[0] != 2:
            raise ValueError(
                f"rotation-scaling elements have shape (2, ..., k), got {tuple(element_shape)}"
            )
        return torch.Size((*element_shape[1:-1], 2 * element_shape[-1]))

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        e = torch.zeros(self.element_shape(shape), dtype=dtype, device=device)
        e[0] = 1.0
        return e

    def exp(self, X: Tensor) -> Tensor:
        r = X[0].exp()
        return torch.stack((r * X[1].cos(), r * X[1].sin()))

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return torch.stack((g[0] * h[0] - g[1] * h[1], g[0] * h[1] + g[1] * h[0]))

    def inverse(self, g: Tensor) -> Tensor:
        r2 = g[0] ** 2 + g[1] ** 2
        return torch.stack((g[0] / r2, -g[1] / r2))

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        x1, x2 = _pairs(x)
        y = torch.stack((g[0] * x1 - g[1] * x2, g[0] * x2 + g[1] * x1), dim=-1)
        return y.reshape(x.shape)

    def log_abs_det(self, g: Tensor) -> Tensor:
        return (g[0] ** 2 + g[1] ** 2).log().sum()

    def reference_point(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        """ξ₀ = (1, 0) in each pair, so the point estimate is z itself."""
        return self.identity(shape, dtype=dtype, device=device).movedim(0, -1).reshape(shape)

    def from_point(self, theta: Tensor) -> Tensor:
        """``z = θ₁ + iθ₂`` per pair (every pair must be non-zero)."""
        x1, x2 = _pairs(theta.detach())
        g = torch.stack((x1, x2))
        if not bool(((x1 != 0) | (x2 != 0)).all()):
            raise ValueError("theta: every pair must be non-zero to be a rotation-scaling")
        return g.clone()

    def with_point(self, g: Tensor, theta: Tensor, xi0: Tensor | None = None) -> Tensor:
        """z = θ / ξ₀ per pair (complex division; z fixes location and spread alike, so
        nothing of g is kept); a zero pair becomes the smallest non-zero z, as :meth:`projx`
        makes it."""
        if xi0 is None:
            xi0 = self.reference_point(self.param_shape(g.shape), dtype=g.dtype, device=g.device)
        (t1, t2), (x1, x2) = _pairs(theta.detach()), _pairs(xi0)
        r2 = x1**2 + x2**2
        z = torch.stack(((t1 * x1 + t2 * x2) / r2, (t2 * x1 - t1 * x2) / r2))
        return self.projx(z)

    def parts(self, g: Tensor) -> dict[str, Tensor]:
        return {"re": g[0], "im": g[1]}

    def check_element(self, g: Tensor) -> tuple[bool, str | None]:
        ok, reason = super().check_element(g)
        if ok and not bool(((g[0] != 0) | (g[1] != 0)).all()):
            return False, "a rotation-scaling must be non-zero"
        return ok, reason

    def projx(self, x: Tensor) -> Tensor:
        """Entries clamped to the finite range of the dtype; a zero z becomes (√tiny, 0)."""
        self.one_element(x)
        info = torch.finfo(x.dtype)
        x = x.clamp(-info.max, info.max)
        zero = (x[0] == 0) & (x[1] == 0)
        return torch.stack((torch.where(zero, info.tiny**0.5, x[0]), x[1]))

    def fisher(self, base: Distribution, shape: Shape) -> Tensor | None:
        """``diag(4 + 2μ²/σ², 2μ²/σ²)`` per pair for a Gaussian base N(μ, σ²)."""
        if not isinstance(base, Normal):
            return None
        ratio = 2 * float(base.loc) ** 2 / float(base.scale) ** 2
        k = self.element_shape(shape)[1:].numel()
        return torch.tensor([4 + ratio] * k + [ratio] * k, dtype=torch.float64)
