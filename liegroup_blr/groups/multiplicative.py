"""The multiplicative group (R_{>0}^P, ⊙), optionally split into excitatory/inhibitory parts."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution

from ..distributions import base_family, fisher_information, positive_support
from .base import KLForm, LieGroup, Shape, register_group

__all__ = ["MultiplicativeGroup", "clamp_positive_"]


def clamp_positive_(g: Tensor) -> Tensor:
    """Clamp ``g`` in place to [tiny, max] of its dtype: positive and finite."""
    info = torch.finfo(g.dtype)
    return g.clamp_(info.tiny, info.max)


@register_group
class MultiplicativeGroup(LieGroup):
    r"""Positive scalings acting elementwise, :math:`g \cdot \xi = g \odot \xi`, :math:`g > 0`.

    :math:`\exp(X) = e^X`, :math:`g \cdot h = g \odot h`,
    :math:`\log|\det J_g| = \sum \log g`. The base q0 must live on (0, ∞) (e.g. Rayleigh).

    With ``signed=True`` (excitatory/inhibitory networks) each weight is the difference of two
    positive parts, each its own multiplicative element: elements, algebra vectors and base
    draws have shape ``(2, *shape)``, and
    :math:`\theta = g^+ \odot \xi^+ - g^- \odot \xi^-`. The point estimate "at g" reads
    ξ₀ = 1: :math:`g^+ - g^-` (or plain :math:`g` when ``signed=False``).
    """

    name = "Multiplicative"
    positive_base = True
    elementwise = True

    def __init__(self, signed: bool = True) -> None:
        super().__init__()
        self.signed = signed
        self.components: tuple[str, ...] = ("excitatory", "inhibitory") if signed else ()

    def extra_repr(self) -> str:
        return f"signed={self.signed}"

    def element_shape(self, shape: Shape) -> torch.Size:
        return torch.Size((2, *shape)) if self.signed else torch.Size(shape)

    def base_shape(self, shape: Shape) -> torch.Size:
        return self.element_shape(shape)

    def param_shape(self, element_shape: Shape) -> torch.Size:
        if not self.signed:
            return torch.Size(element_shape)
        if len(element_shape) == 0 or element_shape[0] != 2:
            raise ValueError(f"signed elements have shape (2, ...), got {tuple(element_shape)}")
        return torch.Size(element_shape[1:])

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        return torch.ones(self.element_shape(shape), dtype=dtype, device=device)

    def exp(self, X: Tensor) -> Tensor:
        return X.exp()

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return g * h

    def inverse(self, g: Tensor) -> Tensor:
        return g.reciprocal()

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        return g * x

    def log_abs_det(self, g: Tensor) -> Tensor:
        return g.log().sum()

    def readout(self, x: Tensor) -> Tensor:
        return x[0] - x[1] if self.signed else x

    def point(self, g: Tensor, mean: float | None = None, shape: Shape | None = None) -> Tensor:
        """g⁺ − g⁻ (or g), times E[ξ] after the difference."""
        point = g[0] - g[1] if self.signed else g.clone()
        return point if mean is None else point.mul_(mean)

    def reference_point(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        return torch.ones(self.base_shape(shape), dtype=dtype, device=device)

    def from_point(self, theta: Tensor, offset: float = 1e-5) -> Tensor:
        """``(relu(θ) + offset, relu(−θ) + offset)`` when signed (so g⁺ − g⁻ = θ), else θ > 0."""
        theta = theta.detach()
        if self.signed:
            return torch.stack((theta.clamp(min=0), (-theta).clamp(min=0))) + offset
        if not bool((theta > 0).all()):
            raise ValueError("theta: an unsigned multiplicative element must be positive")
        return theta.clone()

    def with_point(
        self, g: Tensor, theta: Tensor, xi0: Tensor | None = None, *, offset: float = 1e-5
    ) -> Tensor:
        r"""An element with point estimate θ = readout(g'·ξ₀), ξ₀ the same in both parts
        (1 or E[ξ]), so that w = θ/ξ₀ is :math:`g'^+ - g'^-`.

        Signed: the spread :math:`s^2 = g^{+2} + g^{-2}` (θ's variance is
        :math:`\operatorname{Var}\xi\, s^2`) is kept where it can be, :math:`w^2 < s^2`:
        the smaller part is :math:`(s^2 - w^2)/(|w| + \sqrt{2s^2 - w^2})` and the larger
        exceeds it by :math:`|w|`. Where :math:`w^2 \ge s^2` no positive pair has that spread;
        the nearest one, :math:`g'^\pm = \max(\pm w, 0) + \text{offset}`, is taken (as
        :meth:`from_point` makes it). Unsigned: g' = w where w > 0, else ``offset`` (a θ ≤ 0
        is no positive scaling's point estimate)."""
        theta = theta.detach()
        if xi0 is not None:
            if self.signed and not torch.equal(xi0[0], xi0[1]):
                raise ValueError("xi0: the signed group's point needs one ξ₀ for both parts")
            theta = theta / (xi0[0] if self.signed else xi0)
        if not self.signed:
            return clamp_positive_(torch.where(theta > 0, theta, offset))
        wide = torch.float64  # s² of elements near float32's max overflows float32
        w, s2 = theta.to(wide), g.to(wide).square().sum(0)
        smaller = (s2 - w * w) / (w.abs() + (2 * s2 - w * w).clamp(min=0).sqrt())
        larger = smaller + w.abs()
        up = w >= 0
        kept = torch.stack((torch.where(up, larger, smaller), torch.where(up, smaller, larger)))
        nearest = torch.stack((w.clamp(min=0), (-w).clamp(min=0))) + offset
        ok = (w * w < s2) & torch.isfinite(smaller)
        return clamp_positive_(torch.where(ok, kept, nearest).to(g.dtype))

    def parts(self, g: Tensor) -> dict[str, Tensor]:
        return {"g+": g[0], "g-": g[1]} if self.signed else {"g": g}

    def check_element(self, g: Tensor) -> tuple[bool, str | None]:
        ok, reason = super().check_element(g)
        if ok and not bool((g > 0).all()):
            return False, "multiplicative elements must be positive"
        return ok, reason

    def options(self) -> dict[str, Any]:
        return {"signed": bool(self.signed)}

    def fisher_block(self, base: Distribution) -> Tensor | None:
        """``F_scale · I`` over the parts for a base on (0, ∞) (Rayleigh: 4)."""
        _, scale = fisher_information(base) if positive_support(base) else (None, None)
        return None if scale is None else scale * torch.eye(2 if self.signed else 1)

    def kl_closed_form(self, base: Distribution) -> KLForm | None:
        """Per part, the base's scale-family KL in r = g/h (Rayleigh: r² − 1 − 2 log r), for
        this class exactly; signed, the sum over the parts (the KL between the laws of the
        pair of parts)."""
        family = base_family(base, exact=True)
        if type(self) is not MultiplicativeGroup or family is None or family.scale_kl is None:
            return None
        kl = family.scale_kl
        return lambda g, h: kl(g.log() - h.log())

    def coordinate_variance(self, g: Tensor, base: Distribution) -> Tensor:
        """(g⁺² + g⁻²) Var ξ signed, g² Var ξ unsigned."""
        var = float(base.variance)
        return (g[0].square() + g[1].square()) * var if self.signed else g.square() * var

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        self.one_element(x)
        return x * u

    def projx(self, x: Tensor) -> Tensor:
        """Clamped to [tiny, max] of the dtype: positive and finite."""
        self.one_element(x)
        return clamp_positive_(x.clone())
