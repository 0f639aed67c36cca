"""The :class:`LieGroup` interface: a Lie group acting on parameter space, and a geoopt manifold."""

from __future__ import annotations

import abc
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.func
from torch import Tensor
from torch.distributions import Distribution

with warnings.catch_warnings():  # geoopt decorates with torch.jit.script, deprecated in torch
    warnings.filterwarnings("ignore", r"`torch\.jit\.script", DeprecationWarning)
    import geoopt

__all__ = ["LieGroup", "register_group", "registered_group"]

Shape = torch.Size | tuple[int, ...]
KLForm = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
r"""``form(g, h)`` → (per-coordinate :math:`\mathrm{KL}(q_g \,\|\, q_h)`, its algebra
gradient at g)."""
MAX_JACOBIAN = 2**24
"""Largest Jacobian (parameter × base entries) :meth:`LieGroup.coordinate_variance` builds for a
group that does not act coordinatewise."""


class LieGroup(geoopt.Manifold, abc.ABC):
    r"""A Lie group :math:`G` acting on a space in which base draws :math:`\xi \sim q_0` live.

    A posterior candidate is the pushforward :math:`q_g = g \cdot q_0`: a sample is
    :math:`\theta = \operatorname{readout}(g \cdot \xi)`, and the learning rule moves
    :math:`g \leftarrow g \cdot \exp(-\alpha X)` with :math:`X` in the Lie algebra.

    Elements, algebra vectors and base draws are tensors. Every ``shape`` argument below is
    the shape of the *network parameter* the group is used for; :meth:`element_shape`,
    :meth:`algebra_shape` and :meth:`base_shape` say what it becomes. A subclass implements
    :meth:`identity`, :meth:`exp`, :meth:`compose`, :meth:`inverse`, :meth:`act` and
    :meth:`log_abs_det`; the rest has defaults.

    Every group is also a :class:`geoopt.Manifold` whose tangent vectors are Lie-algebra
    vectors (left trivialisation): ``retr(x, u) = expmap(x, u) = x · exp(u)``, vector
    transport is the identity and ``egrad2rgrad`` pulls a Euclidean gradient back to the
    algebra, :math:`\nabla_X f(x \cdot \exp X)|_{X=0}`. An element can therefore be a
    :class:`geoopt.ManifoldParameter` optimised by geoopt's Riemannian optimisers.
    """

    name = "LieGroup"
    ndim = 0
    reversible = True
    positive_base: bool = False
    """Whether base draws must lie in (0, ∞) (groups that act by scaling)."""
    constant_entropy: bool = False
    """Whether log|det J_g| is constant, so the temperature term vanishes (translations)."""
    elementwise: bool = False
    """True when the group acts coordinatewise. Then the algebra tensor is ``(c, *coords)``
    with ``c = len(components)`` (no component axis when ``c ≤ 1``), each coordinate has its
    own independent ``c``-dimensional algebra block, the same for every coordinate, and the
    Fisher metric is block-diagonal with one ``c × c`` block repeated. True for the built-in
    groups."""
    gaussian_like: bool = False
    """Whether θ's law is a location-scale family of the base's (θ affine in ξ, one scale
    per coordinate), so memory maps take their Jacobian form by default: the additive and
    diagonal affine groups."""
    components: tuple[str, ...] = ()
    """Names of the leading algebra components, one per entry of the algebra tensor's axis 0,
    for per-component step factors (e.g. ``("scale", "shift")``); ``()``: a single component."""

    def __init__(self) -> None:
        super().__init__()  # geoopt.Manifold takes and ignores **kwargs: a typo would pass

    # ----------------------------------------------------------------- shapes
    def element_shape(self, shape: Shape) -> torch.Size:
        """Shape of a group element for a parameter of ``shape``."""
        return torch.Size(shape)

    def algebra_shape(self, shape: Shape) -> torch.Size:
        """Shape of a Lie-algebra vector for a parameter of ``shape``."""
        return self.element_shape(shape)

    def base_shape(self, shape: Shape) -> torch.Size:
        """Shape of a base draw ξ (the space the group acts on) for a parameter of ``shape``."""
        return torch.Size(shape)

    def param_shape(self, element_shape: Shape) -> torch.Size:
        """Inverse of :meth:`element_shape`."""
        return torch.Size(element_shape)

    # ------------------------------------------------------------- structure
    @abc.abstractmethod
    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        """The identity element e."""

    @abc.abstractmethod
    def exp(self, X: Tensor) -> Tensor:
        """Exponential map from the Lie algebra to the group."""

    @abc.abstractmethod
    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        """The product g·h."""

    @abc.abstractmethod
    def inverse(self, g: Tensor) -> Tensor:
        """The inverse g⁻¹."""

    @abc.abstractmethod
    def act(self, g: Tensor, x: Tensor) -> Tensor:
        """The action g·x on the base space (``x`` has :meth:`base_shape`)."""

    @abc.abstractmethod
    def log_abs_det(self, g: Tensor) -> Tensor:
        r"""Scalar :math:`\log|\det J_g|` of :math:`x \mapsto g \cdot x`, so that
        :math:`H(g \cdot q_0) = H(q_0) + \log|\det J_g|`."""

    def readout(self, x: Tensor) -> Tensor:
        """The network parameter that a point ``x`` of the base space represents."""
        return x

    def reference_point(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        """The base point ξ₀ at which the point estimate "at g" is read: 0 by default."""
        return torch.zeros(self.base_shape(shape), dtype=dtype, device=device)

    def point_estimate(self, g: Tensor, xi0: Tensor | None = None) -> Tensor:
        """Point estimate ``readout(g · ξ₀)`` (ξ₀ defaults to :meth:`reference_point`)."""
        if xi0 is None:
            xi0 = self.reference_point(self.param_shape(g.shape), dtype=g.dtype, device=g.device)
        return self.theta(g, xi0)

    # ------------------------------------------- the arithmetic every user shares
    def theta(self, g: Tensor, xi: Tensor) -> Tensor:
        """A sample's parameter, θ = readout(g · ξ): the arithmetic the optimizers and the
        posterior of this group share (a group may override it with a faster exact form, as
        the diagonal affine group's fused multiply-add), so a posterior reproduces its
        optimizer's samples bit for bit."""
        return self.readout(self.act(g, xi))

    def point(self, g: Tensor, mean: float | None = None, shape: Shape | None = None) -> Tensor:
        """The point estimate the optimizers write: readout(g · ξ₀) at the reference point
        (``mean=None``, "at g"), or at E[ξ] = ``mean`` in every coordinate (the posterior
        mean); the arithmetic shared as :meth:`theta`'s. ``shape`` is the parameter's
        (default :meth:`param_shape` of ``g``'s)."""
        shape = self.param_shape(g.shape) if shape is None else shape
        if mean is None:
            xi0 = self.reference_point(shape, dtype=g.dtype, device=g.device)
        else:
            xi0 = torch.full(self.base_shape(shape), mean, dtype=g.dtype, device=g.device)
        return self.theta(g, xi0)

    def from_point(self, theta: Tensor) -> Tensor:
        """An element whose point estimate is ``theta`` (used to initialise from a network)."""
        raise NotImplementedError(f"{type(self).__name__} does not define from_point")

    def with_point(self, g: Tensor, theta: Tensor, xi0: Tensor | None = None) -> Tensor:
        r"""An element :math:`g'` whose point estimate :math:`\operatorname{readout}(g' \cdot
        \xi_0)` is ``theta``, keeping what it can of ``g``'s spread: how the optimizers adopt a
        value written into a parameter outside them (a loaded checkpoint, a weight
        constraint) as the posterior's new location. ``xi0`` defaults to
        :meth:`reference_point`.

        A group without it cannot take such a write: the optimizers then refuse it in one line
        naming ``set_group_element``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define with_point")

    def parts(self, g: Tensor) -> dict[str, Tensor]:
        """Named components of an element, e.g. ``{'A': ..., 'b': ...}``."""
        return {"g": g}

    def check_element(self, g: Tensor) -> tuple[bool, str | None]:
        """Whether ``g`` is a valid (finite, in-domain) element, and why not."""
        if not bool(torch.isfinite(g).all()):
            return False, "element has non-finite entries"
        return True, None

    def algebra_zeros_like(self, g: Tensor) -> Tensor:
        """The zero algebra vector matching element ``g``."""
        return g.new_zeros(self.algebra_shape(self.param_shape(g.shape)))

    def fisher(self, base: Distribution, shape: Shape) -> Tensor | None:
        r"""The Fisher metric at the identity for a parameter of ``shape`` under ``base``, if
        the group knows it in closed form (default ``None``: estimated by
        :func:`~liegroup_blr.fisher.inverse_metric`).

        .. math:: F = E_{x \sim q_0}\big[s(x) s(x)^\top\big],\quad
                  s(x) = \nabla_X \log q_{\exp X}(x)\big|_{X=0}

        over the flattened algebra (``d = algebra_shape(shape).numel()``, row-major): a
        ``(d, d)`` matrix, or a ``(d,)`` vector when the metric is diagonal (no ``d × d``
        matrix is then ever built).
        """
        return None

    # -------------------------------------------------- what a base asks of the group
    def options(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this group (a posterior file stores them)."""
        return {}

    def fisher_block(self, base: Distribution) -> Tensor | None:
        """The ``(c, c)`` block of the Fisher metric at the identity per coordinate of an
        :attr:`elementwise` group under ``base`` (``c = max(1, len(components))``), in closed
        form from the base's Fisher informations
        (:func:`~liegroup_blr.distributions.fisher_information`); default ``None``: estimated
        by Monte Carlo (:func:`~liegroup_blr.fisher.inverse_metric`)."""
        return None

    def kl_closed_form(self, base: Distribution) -> KLForm | None:
        r"""``form(g, h)`` → (per-coordinate :math:`\mathrm{KL}(q_g \,\|\, q_h)`, its algebra
        gradient at g, the entropy's part included) in closed form for this group and
        ``base``; default ``None``: estimated by Monte Carlo (:mod:`liegroup_blr.kl`)."""
        return None

    def coordinate_variance(self, g: Tensor, base: Distribution) -> Tensor:
        r"""Var θ per coordinate of the parameter under :math:`q_g`, to first order in ξ
        (exact for an action linear in ξ, as every built-in group's):

        .. math:: \operatorname{Var}\theta_i = \operatorname{Var}\xi
                  \sum_j \big(\partial\theta_i/\partial\xi_j\big)^2

        at ξ = E ξ (0 where the base has no finite mean), by ``torch.func`` (one ``jvp`` per
        base part for an :attr:`elementwise` group, whose Jacobian is diagonal per part; the
        whole Jacobian otherwise).

        Raises:
            ValueError: a group that does not act coordinatewise, whose Jacobian would have
                more than 2²⁴ entries: override this method.
        """
        shape = self.param_shape(g.shape)
        base_shape = self.base_shape(shape)
        xi = g.new_full(base_shape, _centre(base))

        def theta(x: Tensor) -> Tensor:
            return self.readout(self.act(g, x))

        if self.elementwise:
            parts = base_shape[0] if len(base_shape) > len(shape) else 0
            tangents = [xi.new_zeros(base_shape) for _ in range(max(1, parts))]
            for p, t in enumerate(tangents):
                (t[p] if parts else t).fill_(1.0)
            slopes = [torch.func.jvp(theta, (xi,), (t,))[1] for t in tangents]
            return torch.stack(slopes).square().sum(0) * float(base.variance)
        if math.prod(shape) * xi.numel() > MAX_JACOBIAN:
            raise ValueError(
                f"coordinate_variance: the {self.name} group's Jacobian for a parameter of "
                f"shape {tuple(shape)} is too large to build; override "
                f"{type(self).__name__}.coordinate_variance"
            )
        jacobian = torch.func.jacfwd(theta)(xi).reshape(*shape, -1)
        return jacobian.square().sum(-1) * float(base.variance)

    # -------------------------------------------------- geoopt.Manifold API
    def step(self, x: Tensor, u: Tensor) -> Tensor:
        """``x · exp(u)`` kept in the group for any step: ``u`` is clamped to the finite range
        of its dtype (an overflowed step cannot make inf·0) and the result goes through
        :meth:`projx`."""
        big = torch.finfo(u.dtype).max
        return self.projx(self.compose(x, self.exp(u.clamp(-big, big))))

    def one_element(self, x: Tensor, name: str = "x") -> None:
        """Raise ValueError unless ``x`` has the shape of one element.

        geoopt reads leading axes as a batch, but groups with a component axis put it first
        (signed multiplicative, diagonal affine, rotation-scaling): an ``(n, 2, ...)`` stack
        would be read as one element and mix the batch entries. The geoopt methods refuse it.
        For a coordinatewise group, stack elements along axis 1 instead
        (``torch.stack(elements, 1)``): the stack is one element, acted on entry by entry. A
        stack of exactly two elements along axis 0 cannot be told from one element of a
        parameter with leading axis 2, so it is not caught.
        """
        try:
            ok = self.element_shape(self.param_shape(x.shape)) == x.shape
            reason = "its shape does not round-trip through param_shape"
        except ValueError as err:
            ok, reason = False, str(err)
        if ok:
            return
        advice = (
            "stack a batch along axis 1 (torch.stack(elements, 1)): the group acts "
            "coordinatewise, so the stack is one element"
            if self.elementwise
            else "apply the group to one element at a time"
        )
        raise ValueError(
            f"{name}: a tensor of shape {tuple(x.shape)} is not one {self.name} element "
            f"({reason}); geoopt's leading batch axes are not supported because the "
            f"component axis comes first: {advice}"
        )

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        self.one_element(x)
        return self.step(x, u)

    def expmap(self, x: Tensor, u: Tensor) -> Tensor:
        self.one_element(x)
        return self.step(x, u)

    def transp(self, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
        self.one_element(x)
        return v

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        self.one_element(x)
        pullback = torch.func.vjp(
            lambda X: self.compose(x, self.exp(X)), self.algebra_zeros_like(x)
        )[1]
        return pullback(u)[0]

    def inner(
        self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        self.one_element(x)
        return u * u if v is None else u * v

    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        self.one_element(x)
        return u

    def projx(self, x: Tensor) -> Tensor:
        """The nearest valid element in the dtype's range (default: ``x``).

        Not a projection onto a submanifold: every group here is an open subset of its
        coordinates, and ``projx`` only keeps a step in the group when floating point breaks
        it (a scale that underflowed to 0 or overflowed to inf). ``step``, the optimizers'
        update, applies it after every move."""
        self.one_element(x)
        return x

    def _check_point_on_manifold(
        self, x: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        return self.check_element(x)

    def _check_vector_on_tangent(
        self, x: Tensor, u: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        expected = self.algebra_shape(self.param_shape(x.shape))
        if u.shape != expected:
            return False, f"u: algebra vectors have shape {tuple(expected)}, got {tuple(u.shape)}"
        if not bool(torch.isfinite(u).all()):
            return False, "u: algebra vector has non-finite entries"
        return True, None

    def _check_shape(self, shape: Shape, name: str) -> tuple[bool, str | None]:
        try:
            self.element_shape(self.param_shape(shape))
        except ValueError as err:
            return False, f"{name}: {err}"
        return True, None


def _centre(base: Distribution) -> float:
    """E ξ, or 0 for a base whose mean is undefined (Cauchy) or not implemented."""
    try:
        mean = float(base.mean)
    except NotImplementedError:
        return 0.0
    return mean if math.isfinite(mean) else 0.0


_GROUPS: dict[str, type[LieGroup]] = {}


def register_group(cls: type[LieGroup]) -> type[LieGroup]:
    """Register a group class by its name, so that a posterior file saved with it loads
    without passing it (rebuilt from :meth:`LieGroup.options`); usable as a class decorator.

    Raises:
        ValueError: ``cls`` is not a LieGroup subclass, or another registered class has the
            same name (a file names groups by class name).
    """
    if not (isinstance(cls, type) and issubclass(cls, LieGroup)):
        raise ValueError(f"cls: expected a LieGroup subclass, got {cls!r}")
    clash = _GROUPS.get(cls.__name__)
    if clash is not None and clash is not cls:
        raise ValueError(
            f"cls: {clash.__module__}.{clash.__qualname__} is registered under the name "
            f"{cls.__name__!r} already; a posterior file names groups by class name, so rename one"
        )
    _GROUPS[cls.__name__] = cls
    return cls


def registered_group(name: str) -> type[LieGroup] | None:
    """The registered group class named ``name``, if any."""
    return _GROUPS.get(name)
