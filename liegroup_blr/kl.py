r"""KL divergences between two posteriors of one group and base, and their algebra gradients.

For :math:`q_g = g\cdot q_0` and :math:`q_h = h\cdot q_0` (the laws of :math:`g\cdot\xi` and
:math:`h\cdot\xi`, :math:`\xi \sim q_0` i.i.d. per coordinate of the base space), the map
:math:`x \mapsto g^{-1}\cdot x` is a bijection that sends :math:`q_g` to :math:`q_0` and
:math:`q_h` to :math:`(g^{-1}h)\cdot q_0`, and a KL divergence does not change under a
bijection:

.. math:: \mathrm{KL}(q_g \,\|\, q_h) = \mathrm{KL}\big(q_0 \,\|\, k\cdot q_0\big),
          \qquad k = g^{-1}h .

The gradient the learning rule needs is taken in the Lie algebra at :math:`g`,
:math:`\nabla_X \mathrm{KL}(q_{g\exp X} \,\|\, q_h)|_{X=0}`, and it splits into the entropy's
and the cross-entropy's parts,

.. math::
    \nabla_X \mathrm{KL} = \underbrace{-\nabla_X \log|\det J_{g\exp X}|}_{-\nabla H}
    \;-\; \nabla_X\, \mathbb E_{\xi\sim q_0}\big[\log q_h\big((g\exp X)\cdot\xi\big)\big],

with :math:`H(q_g) = H(q_0) + \log|\det J_g|`. The rules now add :math:`-(\tau/N)\nabla H`;
:math:`(\tau/N)\nabla_X\mathrm{KL}` replaces that term *entirely*: every gradient here
includes the entropy's part. Per coordinate, with :math:`d = b - b_h` (the location moved by
the base's mean, :math:`b + A\mu`, when the base has mean :math:`\mu \ne 0`) and
:math:`r = A/A_h`:

* additive, :math:`\mathcal N(\mu, \sigma^2)`: :math:`d^2/2\sigma^2`, gradient
  :math:`d/\sigma^2` (the entropy is constant); Laplace(:math:`\mu, s`):
  :math:`|d|/s + e^{-|d|/s} - 1`, gradient :math:`\operatorname{sign}(d)(1 - e^{-|d|/s})/s`;
* diagonal affine, :math:`\mathcal N(\mu, \sigma^2)`:
  :math:`-\log r + (r^2 - 1)/2 + d^2/(2A_h^2\sigma^2)`, gradient
  :math:`\partial_u = r^2 - 1 + A\mu\, d/(A_h\sigma)^2` (the :math:`-1` is the entropy's),
  :math:`\partial_v = A\,d/(A_h\sigma)^2`;
* diagonal affine, Laplace(:math:`\mu, s`), with :math:`a = |d|/(As)`:
  :math:`-\log r + |d|/(A_h s) + r e^{-a} - 1`, gradient
  :math:`\partial_u = r e^{-a}(1 + a) - 1 + A\mu\,\kappa`,
  :math:`\partial_v = A\kappa`, :math:`\kappa = \operatorname{sign}(d)(1 - e^{-a})/(A_h s)`;
* multiplicative, Rayleigh (any scale), per part with :math:`r = g/h`:
  :math:`-2\log r + r^2 - 1`, gradient
  :math:`2(r^2 - 1)` (of its constant :math:`-2`, :math:`-1` is the entropy's and
  :math:`-1` the cross-entropy's :math:`\log\xi` term); for the signed group the sum over
  the two parts, the KL between the laws of the pair :math:`(\xi^+, \xi^-)` (an upper
  bound on the KL between the laws of :math:`\theta = g^+\xi^+ - g^-\xi^-`).

Every other (group, base) pair, user-defined groups included, is estimated by Monte Carlo
through the reparameterisation (:func:`kl_monte_carlo`, :func:`kl_gradient_monte_carlo`).
A Dirac base has no density: its KL is infinite and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.func
from torch import Tensor
from torch.distributions import Distribution, constraints

from .distributions import has_density, sample_into
from .fisher import entropy_gradient
from .groups import LieGroup

__all__ = [
    "has_closed_form",
    "kl_divergence",
    "kl_gradient",
    "kl_gradient_monte_carlo",
    "kl_monte_carlo",
]


# --------------------------------------------------------------------------- checks
def _check(group: LieGroup, base: Distribution, g: Tensor, h: Tensor) -> None:
    """ValueError for a Dirac base or elements that are not of one shape of ``group``."""
    if not has_density(base):
        raise ValueError(
            f"base: a {type(base).__name__} base gives KL(q_g || q_h) = inf between distinct "
            "posteriors (point masses have no density); use a base with a density, e.g. "
            "Normal(0, sigma)"
        )
    if g.shape != h.shape:
        raise ValueError(f"h: shape {tuple(h.shape)} differs from g's {tuple(g.shape)}")
    group.param_shape(g.shape)  # raises ValueError for a shape that is no element of group


def has_closed_form(group: LieGroup, base: Distribution) -> bool:
    """Whether :func:`kl_divergence` and :func:`kl_gradient` use a closed form for this pair:
    the group's :meth:`~liegroup_blr.groups.LieGroup.kl_closed_form` (the additive and
    diagonal affine groups with a Normal or Laplace base, the multiplicative group, signed or
    not, with a Rayleigh base). Types are matched exactly: a subclass may change the action
    or the density, so it goes to Monte Carlo."""
    return group.kl_closed_form(base) is not None


# ---------------------------------------------------------------------- Monte Carlo
@contextmanager
def _unvalidated(base: Distribution) -> Iterator[None]:
    """``base.log_prob`` without its support check (it branches on data, which vmap refuses)."""
    validate, base._validate_args = base._validate_args, False
    try:
        yield
    finally:
        base._validate_args = validate


def _relative(group: LieGroup, g: Tensor, h: Tensor) -> Tensor:
    """:math:`k^{-1} = h^{-1}g`: :math:`q_g = h\\cdot(k^{-1}\\cdot q_0)`."""
    return group.compose(group.inverse(h), g)


def _log_q0(group: LieGroup, base: Distribution) -> Callable[[Tensor, Tensor], Tensor]:
    """``(k, x) ↦ Σ log q0(k·x)``."""
    return lambda k, x: base.log_prob(group.act(k, x)).sum()


def kl_monte_carlo(group: LieGroup, base: Distribution, g: Tensor, h: Tensor, xi: Tensor) -> Tensor:
    r"""One Monte-Carlo term of :math:`\mathrm{KL}(q_g\|q_h)` per base draw in ``xi``:

    .. math:: \log q_0(\xi) - \log q_0(k^{-1}\cdot\xi) + \log|\det J_k|, \qquad k = g^{-1}h,

    whose mean over :math:`\xi \sim q_0` is the KL (and which is 0 for every draw at
    :math:`g = h`, up to rounding).

    Args:
        group: the Lie group.
        base: the scalar base q0.
        g, h: elements of one shape.
        xi: draws of shape ``(n, *group.base_shape(shape))``.

    Returns:
        a tensor ``(n,)``.
    """
    _check(group, base, g, h)
    k_inv = _relative(group, g, h)
    log_q0 = _log_q0(group, base)
    with _unvalidated(base):
        terms = torch.func.vmap(lambda x: base.log_prob(x).sum() - log_q0(k_inv, x))(xi)
    return terms - group.log_abs_det(k_inv)


def _supports_score_identity(group: LieGroup, base: Distribution) -> bool:
    """Whether the group keeps the base's support (all of R, or (0, ∞) for a scaling group),
    so that the score :math:`\\nabla_X \\log q_{\\exp X}` has mean 0 under q0."""
    support = base.support
    if support is constraints.real:
        return True
    return group.positive_base and support is constraints.positive


def kl_gradient_monte_carlo(
    group: LieGroup,
    base: Distribution,
    g: Tensor,
    h: Tensor,
    xi: Tensor,
    *,
    control_variate: bool = False,
) -> Tensor:
    r"""One reparameterised term of :math:`\nabla_X \mathrm{KL}(q_{g\exp X}\|q_h)|_{X=0}`
    per base draw in ``xi``:

    .. math::
        -\nabla_X \log|\det J_{g\exp X}| \;-\; \nabla_X \log q_0\big(k^{-1}\exp(X)\cdot\xi\big),
        \qquad k^{-1} = h^{-1}g,

    the first term the entropy's (exact), the second the cross-entropy's
    (:math:`q_h(x) = q_0(h^{-1}x)/|\det J_h|` at :math:`x = (g\exp X)\cdot\xi`), both by
    ``torch.func.grad``.

    With ``control_variate=True`` each term is instead
    :math:`\nabla_X[\log q_0(\exp(X)\cdot\xi) - \log q_0(k^{-1}\exp(X)\cdot\xi)]`: the first
    term minus the score :math:`s(\xi) = -\nabla_X[\log|\det J_{\exp X}| + \log q_0(\exp(X)
    \cdot\xi)]`, whose mean is 0 when the group keeps the base's support (it is the gradient
    of :math:`-\mathbb E_{q_0}[\log q_{\exp(-X)}] = H(q_0) + \mathrm{KL}(q_0\|q_{\exp(-X)})`
    at its minimum). It is exactly 0 at :math:`g = h` and has a lower variance when
    :math:`q_g` is close to :math:`q_h`, a higher one when :math:`q_g` is much narrower (for a
    Gaussian base and the affine group it is lower along u iff :math:`(A/A_h)^2 > 1/2`).

    Returns:
        a tensor ``(n, *group.algebra_shape(shape))``.

    Raises:
        ValueError: ``control_variate`` for a base whose support the group moves (e.g. a
            Uniform base), where the score does not average to 0.
    """
    _check(group, base, g, h)
    if control_variate and not _supports_score_identity(group, base):
        raise ValueError(
            f"control_variate: the {group.name} group moves the support {base.support} of "
            f"{type(base).__name__}, so its score does not average to 0; use control_variate=False"
        )
    k_inv = _relative(group, g, h)
    log_q0 = _log_q0(group, base)
    zero = group.algebra_zeros_like(g)

    def term(X: Tensor, x: Tensor) -> Tensor:
        e = group.exp(X)
        value = -log_q0(group.compose(k_inv, e), x)
        return value + log_q0(e, x) if control_variate else value

    with _unvalidated(base):
        grads = torch.func.vmap(torch.func.grad(term), in_dims=(None, 0))(zero, xi)
    if control_variate:
        return grads
    return grads - entropy_gradient(group, g)


def _draws(
    group: LieGroup,
    base: Distribution,
    g: Tensor,
    num_samples: int,
    generator: torch.Generator | None,
    per_draw: int,
) -> Iterator[Tensor]:
    """``num_samples`` base draws in chunks of at most 2²² values of ``per_draw`` each."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples: must be an integer >= 1, got {num_samples!r}")
    shape = group.base_shape(group.param_shape(g.shape))
    chunk = max(1, 2**22 // max(1, per_draw))
    for start in range(0, num_samples, chunk):
        n = min(chunk, num_samples - start)
        yield sample_into(base, g.new_empty((n, *shape)), generator)


# --------------------------------------------------------------------------- public
def kl_divergence(
    group: LieGroup,
    base: Distribution,
    g: Tensor,
    h: Tensor,
    *,
    num_samples: int = 1000,
    generator: torch.Generator | None = None,
) -> Tensor:
    r""":math:`\mathrm{KL}(g\cdot q_0 \,\|\, h\cdot q_0)` summed over the coordinates of one
    parameter (a 0-d tensor): the closed form where :func:`has_closed_form`, else the mean of
    ``num_samples`` terms of :func:`kl_monte_carlo` drawn from ``generator`` (standard error
    about sd(terms)/√num_samples).

    Args:
        group: the Lie group.
        base: the scalar base q0.
        g, h: elements of one shape (``group.element_shape(shape)``).
        num_samples: Monte-Carlo draws, where there is no closed form.
        generator: their generator (default: torch's global one).

    Raises:
        ValueError: a Dirac base (infinite KL), or elements of different or invalid shapes.
    """
    _check(group, base, g, h)
    form = group.kl_closed_form(base)
    if form is not None:
        return form(g, h)[0].sum()
    per_draw = group.base_shape(group.param_shape(g.shape)).numel()
    total = g.new_zeros(())
    for xi in _draws(group, base, g, num_samples, generator, per_draw):
        total = total + kl_monte_carlo(group, base, g, h, xi).sum()
    return total / num_samples


def kl_gradient(
    group: LieGroup,
    base: Distribution,
    g: Tensor,
    h: Tensor,
    *,
    num_samples: int = 1000,
    generator: torch.Generator | None = None,
    control_variate: bool = False,
) -> Tensor:
    r""":math:`\nabla_X \mathrm{KL}(q_{g\exp X} \,\|\, q_h)|_{X=0}`, entropy part included, in
    the algebra's shape: the closed form where :func:`has_closed_form`, else the mean of
    ``num_samples`` terms of :func:`kl_gradient_monte_carlo` (with ``control_variate``) drawn
    from ``generator``. Deterministic for a given generator state.

    Raises:
        ValueError: as :func:`kl_divergence`, and for ``control_variate`` where it is biased.
    """
    _check(group, base, g, h)
    form = group.kl_closed_form(base)
    if form is not None:
        return form(g, h)[1]
    per_draw = group.algebra_zeros_like(g).numel()
    total = group.algebra_zeros_like(g)
    for xi in _draws(group, base, g, num_samples, generator, per_draw):
        terms = kl_gradient_monte_carlo(group, base, g, h, xi, control_variate=control_variate)
        total = total + terms.sum(0)
    return total / num_samples
