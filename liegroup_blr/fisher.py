r"""Reparameterised Lie-algebra gradients and the Fisher metric at the identity.

For a group :math:`G` acting on base draws :math:`\xi \sim q_0`, the sample at
:math:`g \cdot \exp(X)` is :math:`\theta(X) = \operatorname{readout}((g \exp X) \cdot \xi)`.
Everything here is computed by automatic differentiation with :mod:`torch.func`, so it
works for any :class:`~liegroup_blr.groups.LieGroup`; the specialised optimizers use the
closed forms these functions are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.func
from torch import Tensor
from torch.distributions import Distribution

from .distributions import has_density, sample_into
from .groups import LieGroup
from .groups.base import Shape

__all__ = [
    "MAX_MONTE_CARLO_DIM",
    "algebra_gradient",
    "entropy_gradient",
    "fisher_at_identity",
    "fisher_closed_form",
    "fisher_monte_carlo",
    "inverse_metric",
]


def algebra_gradient(group: LieGroup, g: Tensor, xi: Tensor, grad_theta: Tensor) -> Tensor:
    r"""Lie-algebra gradient of a loss at one sample, by reparameterisation.

    .. math:: \nabla_X \ell(\theta(X))\big|_{X=0}
              = J_X^\top \nabla_\theta \ell, \quad
              \theta(X) = \operatorname{readout}((g \exp X) \cdot \xi),

    a vector-Jacobian product through ``torch.func.vjp``.

    Args:
        group: the group.
        g: current element.
        xi: base draw of shape ``group.base_shape(grad_theta.shape)``.
        grad_theta: :math:`\nabla_\theta \ell` at :math:`\theta(0)`.
    """

    def sample(X: Tensor) -> Tensor:
        return group.readout(group.act(group.compose(g, group.exp(X)), xi))

    zero = g.new_zeros(group.algebra_shape(grad_theta.shape))
    pullback = torch.func.vjp(sample, zero)[1]
    return pullback(grad_theta.to(g.dtype))[0]


def entropy_gradient(group: LieGroup, g: Tensor) -> Tensor:
    r""":math:`\nabla_X \log|\det J_{g \exp X}|\,|_{X=0}`, the gradient of the entropy
    :math:`H(g \exp(X) \cdot q_0) = H(q_0) + \log|\det J_{g \exp X}|` (``torch.func.grad``)."""
    return torch.func.grad(lambda X: group.log_abs_det(group.compose(g, group.exp(X))))(
        group.algebra_zeros_like(g)
    )


# --------------------------------------------------------------------------- Fisher
def fisher_closed_form(group: LieGroup, base: Distribution, shape: Shape = ()) -> Tensor | None:
    r"""Closed-form Fisher metric at the identity, from the group's
    :meth:`~liegroup_blr.groups.LieGroup.fisher_block`, else ``None``.

    Per coordinate (σ the base scale):

    * additive, location family: :math:`1/\sigma^2` (Gaussian, Laplace),
      :math:`(\nu+1)/((\nu+3)\sigma^2)` (Student-t);
    * multiplicative, Rayleigh: :math:`E[(\xi^2/\sigma^2 - 2)^2] = 4` per part;
    * diagonal affine, centred Gaussian: :math:`\operatorname{diag}(2, 1/\sigma^2)` for
      :math:`(u, v)`; Laplace :math:`\operatorname{diag}(1, 1/\sigma^2)`;
      Student-t :math:`\operatorname{diag}(2\nu/(\nu+3), (\nu+1)/((\nu+3)\sigma^2))`.

    Returns:
        the ``(d, d)`` matrix over the flattened algebra (``d = algebra_shape(shape).numel()``,
        component-major), or ``None`` if the pair has no closed form here.
    """
    block = group.fisher_block(base)
    if block is None:
        return None
    n = math.prod(shape)
    return torch.kron(block, torch.eye(n)).to(torch.get_default_dtype())


def _log_density(group: LieGroup, base: Distribution) -> Callable[..., Tensor]:
    r""":math:`\log q_{\exp X}(x) = \log q_0(\exp(X)^{-1} \cdot x) - \log|\det J_{\exp X}|`."""

    def log_q(X: Tensor, x: Tensor) -> Tensor:
        g = group.exp(X)
        return base.log_prob(group.act(group.inverse(g), x)).sum() - group.log_abs_det(g)

    return log_q


def _scores(
    group: LieGroup,
    base: Distribution,
    shape: Shape,
    num_samples: int,
    generator: torch.Generator | None,
    chunk: int,
    dtype: torch.dtype = torch.float64,
) -> Iterator[Tensor]:
    r"""Scores :math:`s(x) = \nabla_X \log q_{\exp X}(x)|_{X=0}` of ``num_samples`` draws, as
    ``(n, d)`` blocks of ``chunk`` draws, from one ``torch.func.vmap(torch.func.grad(...))``
    per block."""
    zero = torch.zeros(group.algebra_shape(shape), dtype=dtype)
    score = torch.func.vmap(torch.func.grad(_log_density(group, base)), in_dims=(None, 0))
    validate, base._validate_args = base._validate_args, False  # support checks branch on data
    try:
        for start in range(0, num_samples, chunk):
            n = min(chunk, num_samples - start)
            draws = torch.empty((n, *group.base_shape(shape)), dtype=dtype)
            sample_into(base, draws, generator)
            yield score(zero, draws).reshape(n, -1)
    finally:
        base._validate_args = validate


def fisher_monte_carlo(
    group: LieGroup,
    base: Distribution,
    shape: Shape = (),
    num_samples: int = 100_000,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    r"""Monte-Carlo Fisher metric at the identity from ``base.log_prob``:

    .. math:: F = E_{x \sim q_0}\big[s(x) s(x)^\top\big], \qquad
              s(x) = \nabla_X \log q_{\exp X}(x)\big|_{X=0},

    with the scores of all draws computed in one ``torch.func.vmap(torch.func.grad(...))``.
    The standard error of each entry is about ``sqrt(Var[s_i s_j] / num_samples)``.
    """
    if not has_density(base):
        raise ValueError(
            f"base: a {type(base).__name__} base has no density and no Fisher information"
        )
    s = next(_scores(group, base, shape, num_samples, generator, num_samples, dtype))
    return s.T @ s / num_samples


MAX_MONTE_CARLO_DIM = 2048
"""Largest algebra (``d``) of a non-elementwise group whose ``d × d`` Fisher metric
:func:`inverse_metric` estimates by Monte Carlo; larger groups must declare
:meth:`LieGroup.fisher <liegroup_blr.groups.LieGroup.fisher>`."""


def _singular(group: LieGroup, base: Distribution, why: str) -> ValueError:
    return ValueError(
        f"base: {base!r} gives no usable Fisher metric for the {group.name} group ({why}); "
        "use another base, or a preconditioner other than the inverse Fisher metric"
    )


def _metric_solver(group: LieGroup, base: Distribution, F: Tensor) -> Callable[[Tensor], Tensor]:
    """``X ↦ F⁻¹X`` by Cholesky for a ``(c, c)`` matrix (a ``(d, d)`` metric, or a block
    applied to ``X.reshape(c, -1)``), or a ``(d,)`` diagonal; ValueError where F is singular."""
    F = F.to(torch.float64)
    if not bool(torch.isfinite(F).all()):
        raise _singular(group, base, "its scores are not finite")
    diag = F if F.ndim == 1 else F.diagonal()
    scale = float(diag.abs().max())
    if scale == 0.0:
        raise _singular(
            group,
            base,
            "its score is zero: the density does not change when the group moves "
            "it, as for a flat density",
        )
    if F.ndim == 1:
        if float(F.min()) <= 1e-10 * scale:
            raise _singular(group, base, "the metric is singular along some algebra direction")
        return _cached(lambda X, inv: X * inv.reshape(X.shape), F.reciprocal())
    chol, info = torch.linalg.cholesky_ex(F)
    if int(info) != 0 or float(chol.diagonal().min()) ** 2 <= 1e-10 * scale:
        raise _singular(
            group,
            base,
            "the metric is singular: along some algebra direction the density "
            "does not change when the group moves it",
        )
    c = len(chol)
    return _cached(lambda X, L: torch.cholesky_solve(X.reshape(c, -1), L).reshape(X.shape), chol)


def _cached(
    apply: Callable[[Tensor, Tensor], Tensor], factor: Tensor
) -> Callable[[Tensor], Tensor]:
    """``X ↦ apply(X, factor)`` with ``factor`` moved to X's dtype and device once each."""
    copies: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def solve(X: Tensor) -> Tensor:
        key = (X.dtype, X.device)
        if key not in copies:
            copies[key] = factor.to(dtype=X.dtype, device=X.device)
        return apply(X, copies[key])

    return solve


def inverse_metric(
    group: LieGroup,
    base: Distribution,
    shape: Shape,
    *,
    generator: torch.Generator | None = None,
    num_samples: int = 100_000,
) -> Callable[[Tensor], Tensor]:
    r"""The inverse Fisher metric at the identity, :math:`X \mapsto F^{-1} X`, for algebra
    tensors of ``group.algebra_shape(shape)`` (the natural-gradient preconditioner).

    :math:`F` comes from, in order:

    1. the group's own :meth:`~liegroup_blr.groups.LieGroup.fisher` (a ``(d, d)`` matrix or
       a ``(d,)`` diagonal);
    2. the group's :meth:`~liegroup_blr.groups.LieGroup.fisher_block`, a closed form for
       built-in pairs;
    3. for an :attr:`~liegroup_blr.groups.LieGroup.elementwise` group, a Monte-Carlo estimate
       of its ``c × c`` block (``c = len(components)``, at least 1), averaged over the
       coordinates of ``shape``;
    4. otherwise a Monte-Carlo estimate of the whole ``d × d`` metric, ``d`` =
       ``algebra_shape(shape).numel()`` ≤ :data:`MAX_MONTE_CARLO_DIM`.

    A block is applied per coordinate (never expanded to ``d × d``); a matrix is applied by
    a Cholesky solve. The result depends only on (G, q0, shape): cache it per shape.

    Args:
        group: the group.
        base: the base distribution q0 (scalar, i.i.d. per coordinate).
        shape: the network parameter's shape.
        generator: generator of the Monte-Carlo draws.
        num_samples: Monte-Carlo draws (per coordinate for an elementwise block; draws of the
            whole parameter for a ``d × d`` metric).

    Raises:
        ValueError: if the base has no density (Dirac) or gives a singular metric (e.g. a
            Uniform base under translations: its score is 0 inside the support), naming the
            base; or if ``d`` > :data:`MAX_MONTE_CARLO_DIM` and the group declares no metric.
    """
    if not has_density(base):
        why = f"a {type(base).__name__} base has no density, hence no Fisher information"
        raise _singular(group, base, why)
    declared = group.fisher(base, shape)
    d = group.algebra_shape(shape).numel()
    if declared is not None:
        if tuple(declared.shape) not in ((d,), (d, d)):
            raise ValueError(
                f"{type(group).__name__}.fisher returned shape {tuple(declared.shape)}; "
                f"expected ({d},) or ({d}, {d}) for a parameter of shape {tuple(shape)}"
            )
        return _metric_solver(group, base, declared)
    c = max(1, len(group.components))
    block = group.fisher_block(base)
    if block is None and group.elementwise:
        coords = max(1, d // c)
        draws = max(1, math.ceil(num_samples / coords))
        F = torch.zeros(c, c, dtype=torch.float64)
        for s in _scores(group, base, shape, draws, generator, chunk=max(1, 2**20 // d)):
            s = s.reshape(len(s), c, coords)
            F += torch.einsum("nik,njk->ij", s, s)
        block = F / (draws * coords)
    if block is not None:
        return _metric_solver(group, base, block)
    if d > MAX_MONTE_CARLO_DIM:
        raise ValueError(
            f"preconditioner: the {group.name} group's algebra has {d} > "
            f"{MAX_MONTE_CARLO_DIM} dimensions for a parameter of shape {tuple(shape)}, too many "
            f"for a Monte-Carlo Fisher metric; declare it with {type(group).__name__}.fisher"
        )
    F = torch.zeros(d, d, dtype=torch.float64)
    for s in _scores(group, base, shape, num_samples, generator, chunk=max(1, 2**20 // d)):
        F.addmm_(s.T, s)
    return _metric_solver(group, base, F / num_samples)


def fisher_at_identity(
    group: LieGroup, base: Distribution, shape: Shape = (), num_samples: int = 100_000
) -> Tensor:
    """Fisher metric at the identity: :func:`fisher_closed_form` where known, otherwise
    :func:`fisher_monte_carlo`. It depends only on (G, q0), not on the current element."""
    closed = fisher_closed_form(group, base, shape)
    if closed is not None:
        return closed
    return fisher_monte_carlo(group, base, shape, num_samples).to(torch.get_default_dtype())
