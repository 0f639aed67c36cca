r"""KL(q_g ‖ q_h) and its Lie-algebra gradient: closed forms against independent oracles.

Oracles: ``scipy.integrate.quad`` of q_g log(q_g/q_h) per coordinate (exact to ~1e-9);
Monte Carlo from ``torch.distributions`` laws written out by hand (θ ~ q_g = the law of
g·ξ, e.g. Normal(b + Aμ, Aσ) or Rayleigh(gσ)), accepted within Z = 5 standard errors
SE = sd(terms)/√n of the same draws; ``torch.distributions.kl_divergence`` of multivariate
normals for the full affine group; autograd (``torch.func.grad``) and central finite
differences of the closed-form KL through X ↦ g·exp(X) for the gradients. Everything is in
float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import scipy.integrate
import torch
import torch.func
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributions import (
    Distribution,
    Laplace,
    MultivariateNormal,
    Normal,
    StudentT,
    Uniform,
)

from liegroup_blr.distributions import Dirac, Rayleigh, sample_into
from liegroup_blr.fisher import entropy_gradient
from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    FullAffineGroup,
    LieGroup,
    MultiplicativeGroup,
)
from liegroup_blr.kl import (
    has_closed_form,
    kl_divergence,
    kl_gradient,
    kl_gradient_monte_carlo,
    kl_monte_carlo,
)

F64 = torch.float64
Z = 5.0


def _f64(*values: float) -> list[Tensor]:
    """Base parameters in float64 (a float32 scale would round σ² in log_prob)."""
    return [torch.tensor(v, dtype=F64) for v in values]


CASES: dict[str, tuple[Callable[[], LieGroup], Distribution]] = {
    "additive-normal": (AdditiveGroup, Normal(*_f64(0.3, 0.7))),
    "additive-laplace": (AdditiveGroup, Laplace(*_f64(-0.2, 0.5))),
    "affine-normal": (DiagonalAffineGroup, Normal(*_f64(0.0, 0.7))),
    "affine-normal-mean": (DiagonalAffineGroup, Normal(*_f64(0.4, 1.3))),
    "affine-laplace": (DiagonalAffineGroup, Laplace(*_f64(0.0, 0.5))),
    "affine-laplace-mean": (DiagonalAffineGroup, Laplace(*_f64(-0.3, 2.0))),
    "signed-rayleigh": (MultiplicativeGroup, Rayleigh(*_f64(1.0))),
    "unsigned-rayleigh": (lambda: MultiplicativeGroup(signed=False), Rayleigh(*_f64(0.6))),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _element(group: LieGroup, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """A random element: log-scales and shifts of order 1."""
    size = group.element_shape(shape)
    z = torch.randn(size, dtype=F64, generator=gen)
    if isinstance(group, MultiplicativeGroup):
        return (0.5 * z).exp()
    if isinstance(group, DiagonalAffineGroup):
        return torch.stack(((0.5 * z[0]).exp(), z[1]))
    return z


def _law(group: LieGroup, base: Distribution, g: Tensor) -> Distribution:
    """The law of g·ξ per coordinate of the base space, written out by hand."""
    if isinstance(group, MultiplicativeGroup):  # gξ, ξ ~ Rayleigh(σ): Rayleigh(gσ)
        return Rayleigh(g * float(base.scale))
    A, b = (torch.ones_like(g), g) if isinstance(group, AdditiveGroup) else (g[0], g[1])
    family = Normal if isinstance(base, Normal) else Laplace
    return family(b + A * float(base.loc), A * float(base.scale))


def _draws(group: LieGroup, base: Distribution, g: Tensor, n: int, seed: int) -> Tensor:
    shape = group.base_shape(group.param_shape(g.shape))
    return sample_into(base, torch.empty((n, *shape), dtype=F64), _gen(seed))


def _within(estimate: Tensor, terms: Tensor, expected: Tensor, floor: float = 1e-9) -> None:
    """|estimate − expected| ≤ Z·SE (per coordinate; SE from the terms), or ≤ floor where the
    terms do not vary."""
    se = terms.std(0) / math.sqrt(len(terms))
    gap = (estimate - expected).abs()
    assert bool((gap <= Z * se + floor).all()), (gap / se).max()


# ------------------------------------------------------------------- closed-form KL
@pytest.mark.parametrize("case", list(CASES))
def test_closed_form_kl_against_monte_carlo_of_the_laws(case: str) -> None:
    """θ ~ q_g drawn from the hand-written law; terms log q_g(θ) − log q_h(θ)."""
    make, base = CASES[case]
    group, gen = make(), _gen(1)
    g, h = _element(group, (5,), gen), _element(group, (5,), gen)
    law_g, law_h = _law(group, base, g), _law(group, base, h)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        theta = law_g.sample((200_000,))
    terms = (law_g.log_prob(theta) - law_h.log_prob(theta)).flatten(1).sum(1)
    assert has_closed_form(group, base)
    _within(kl_divergence(group, base, g, h), terms, terms.mean())


def _quad_kl(law_g: Distribution, law_h: Distribution) -> float:
    """∫ q_g log(q_g/q_h) for scalar laws, by adaptive quadrature (kinks at both locations)."""

    def integrand(x: float) -> float:
        t = torch.tensor(x, dtype=F64)
        lg, lh = law_g.log_prob(t), law_h.log_prob(t)
        return float(lg.exp() * (lg - lh)) if math.isfinite(float(lg)) else 0.0

    if isinstance(law_g, Rayleigh):
        lo, hi, points = 0.0, 40 * float(law_g.scale), None
    else:
        loc, scale = float(law_g.loc), float(law_g.scale)
        lo, hi = loc - 60 * scale, loc + 60 * scale
        points = sorted({loc, min(max(float(law_h.loc), lo), hi)})
    value, _ = scipy.integrate.quad(integrand, lo, hi, points=points, limit=400, epsabs=1e-12)
    return value


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_closed_form_kl_against_quadrature_per_coordinate(case: str, seed: int) -> None:
    make, base = CASES[case]
    group, gen = make(), _gen(seed)
    g, h = _element(group, (), gen), _element(group, (), gen)
    law_g, law_h = _law(group, base, g), _law(group, base, h)
    parts = [(law_g, law_h)]
    if isinstance(group, MultiplicativeGroup) and group.signed:  # the pair: two parts
        parts = [(Rayleigh(law_g.scale[i]), Rayleigh(law_h.scale[i])) for i in range(2)]
    expected = sum(_quad_kl(a, b) for a, b in parts)
    got = float(kl_divergence(group, base, g, h))
    assert got == pytest.approx(expected, rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("case", list(CASES))
def test_library_monte_carlo_agrees_with_the_closed_form(case: str) -> None:
    """The fallback's terms, and the public fallback taken by a subclass (not a built-in
    type, so it goes to Monte Carlo), against the closed form."""
    make, base = CASES[case]
    group, gen = make(), _gen(3)
    g, h = _element(group, (4,), gen), _element(group, (4,), gen)
    closed = kl_divergence(group, base, g, h)
    xi = _draws(group, base, g, 200_000, seed=4)
    terms = kl_monte_carlo(group, base, g, h, xi)
    _within(terms.mean(), terms, closed)

    subclass = type("Sub", (type(group),), {})
    sub = subclass(signed=group.signed) if isinstance(group, MultiplicativeGroup) else subclass()
    assert not has_closed_form(sub, base)
    fallback = kl_divergence(sub, base, g, h, num_samples=200_000, generator=_gen(4))
    torch.testing.assert_close(fallback, terms.mean(), rtol=1e-12, atol=1e-12)  # same draws


# -------------------------------------------------------------- closed-form gradient
def _kl_at(group: LieGroup, base: Distribution, g: Tensor, h: Tensor) -> Callable[..., Tensor]:
    """X ↦ KL(q_{g exp X} ‖ q_h) by the closed form."""
    return lambda X: kl_divergence(group, base, group.compose(g, group.exp(X)), h)


@pytest.mark.parametrize("case", list(CASES))
def test_closed_form_gradient_against_autograd_and_finite_differences(case: str) -> None:
    make, base = CASES[case]
    group, gen = make(), _gen(5)
    g, h = _element(group, (2, 3), gen), _element(group, (2, 3), gen)
    got = kl_gradient(group, base, g, h)
    X0 = group.algebra_zeros_like(g)
    assert got.shape == X0.shape
    kl = _kl_at(group, base, g, h)
    torch.testing.assert_close(got, torch.func.grad(kl)(X0), rtol=1e-10, atol=1e-12)
    step, fd = 1e-5, torch.empty_like(X0)
    for i in range(X0.numel()):
        e = torch.zeros_like(X0).view(-1)
        e[i] = step
        fd.view(-1)[i] = (kl(e.view_as(X0)) - kl(-e.view_as(X0))) / (2 * step)
    torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("control_variate", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_closed_form_gradient_against_monte_carlo(case: str, control_variate: bool) -> None:
    make, base = CASES[case]
    group, gen = make(), _gen(6)
    g, h = _element(group, (4,), gen), _element(group, (4,), gen)
    xi = _draws(group, base, g, 100_000, seed=7)
    terms = kl_gradient_monte_carlo(group, base, g, h, xi, control_variate=control_variate)
    _within(terms.mean(0), terms, kl_gradient(group, base, g, h))


def test_the_entropy_part_of_the_rayleigh_gradient() -> None:
    """Of the constant −2 in 2((g/h)² − 1), −1 is the entropy's (−∇ log g) and −1 the
    cross-entropy's: at g = h the cross-entropy gradient is +1 per part."""
    group, base = MultiplicativeGroup(), Rayleigh(1.0)
    g = _element(group, (3,), _gen(8))
    entropy_part = -entropy_gradient(group, g)
    torch.testing.assert_close(entropy_part, -torch.ones_like(g))
    cross = kl_gradient(group, base, g, g) - entropy_part
    torch.testing.assert_close(cross, torch.ones_like(g))


# ---------------------------------------------------------- the Monte-Carlo fallback
def _full_affine_gaussian(group: FullAffineGroup, g: Tensor, sigma: float) -> MultivariateNormal:
    L, b = group.matrices(g)
    return MultivariateNormal(b, scale_tril=sigma * L)


def _random_full_affine(group: FullAffineGroup, n: int, gen: torch.Generator) -> Tensor:
    L = torch.randn(n, n, dtype=F64, generator=gen).tril(-1) * 0.5
    L = L + torch.diag((0.4 * torch.randn(n, dtype=F64, generator=gen)).exp())
    return group.pack(L, torch.randn(n, dtype=F64, generator=gen))


@pytest.mark.slow
def test_monte_carlo_fallback_for_a_full_affine_group_against_gaussian_kl() -> None:
    """A group without a closed form here: KL and gradient against torch's KL of the two
    multivariate normals (and its autograd through X ↦ g·exp X)."""
    group, base, sigma, n = FullAffineGroup(), Normal(*_f64(0.0, 0.8)), 0.8, 3
    gen = _gen(9)
    g, h = _random_full_affine(group, n, gen), _random_full_affine(group, n, gen)
    assert not has_closed_form(group, base)

    def exact(X: Tensor) -> Tensor:
        moved = group.compose(g, group.exp(X))
        return torch.distributions.kl_divergence(
            _full_affine_gaussian(group, moved, sigma), _full_affine_gaussian(group, h, sigma)
        )

    X0 = group.algebra_zeros_like(g)
    xi = _draws(group, base, g, 100_000, seed=10)
    terms = kl_monte_carlo(group, base, g, h, xi)
    _within(terms.mean(), terms, exact(X0))
    grads = kl_gradient_monte_carlo(group, base, g, h, xi)
    _within(grads.mean(0), grads, torch.func.grad(exact)(X0))
    public = kl_gradient(group, base, g, h, num_samples=100_000, generator=_gen(10))
    torch.testing.assert_close(public, grads.mean(0), rtol=1e-10, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_monte_carlo_affine_student_t_against_quadrature(seed: int) -> None:
    """Affine with a Student-t base (no elementary closed form): per coordinate, the law of
    A·ξ + b is StudentT(ν, b + Aμ, As)."""
    group, base = DiagonalAffineGroup(), StudentT(*_f64(4.0, 0.2, 0.7))
    gen = _gen(seed)
    g, h = _element(group, (), gen), _element(group, (), gen)

    def law(e: Tensor) -> StudentT:
        return StudentT(4.0, e[1] + e[0] * 0.2, e[0] * float(base.scale))

    def integrand(x: float) -> float:
        t = torch.tensor(x, dtype=F64)
        lg, lh = law(g).log_prob(t), law(h).log_prob(t)
        return float(lg.exp() * (lg - lh))

    expected = scipy.integrate.quad(integrand, -np.inf, np.inf, limit=400, epsabs=1e-12)[0]
    xi = _draws(group, base, g, 40_000, seed=seed % 1000)
    terms = kl_monte_carlo(group, base, g, h, xi)
    _within(terms.mean(), terms, torch.tensor(expected, dtype=F64))
    assert expected >= 0


# ------------------------------------------------------------------------ at g = h
@pytest.mark.parametrize("case", list(CASES))
def test_zero_kl_and_zero_gradient_at_equal_elements(case: str) -> None:
    make, base = CASES[case]
    group = make()
    g = _element(group, (3, 2), _gen(11))
    assert float(kl_divergence(group, base, g, g)) == 0.0
    assert torch.equal(kl_gradient(group, base, g, g), group.algebra_zeros_like(g))
    xi = _draws(group, base, g, 20_000, seed=12)
    assert float(kl_monte_carlo(group, base, g, g, xi).abs().max()) < 1e-12
    exact_zero = kl_gradient_monte_carlo(group, base, g, g, xi, control_variate=True)
    assert float(exact_zero.abs().max()) < 1e-10
    plain = kl_gradient_monte_carlo(group, base, g, g, xi)
    _within(plain.mean(0), plain, group.algebra_zeros_like(g))


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "call",
    [
        lambda G, b, g: kl_divergence(G, b, g, g),
        lambda G, b, g: kl_gradient(G, b, g, g),
        lambda G, b, g: kl_monte_carlo(G, b, g, g, torch.zeros(4, 3, dtype=F64)),
        lambda G, b, g: kl_gradient_monte_carlo(G, b, g, g, torch.zeros(4, 3, dtype=F64)),
    ],
)
def test_a_dirac_base_is_refused_in_one_line(call: Callable[..., Tensor]) -> None:
    group = AdditiveGroup()
    with pytest.raises(ValueError, match=r"^base: a Dirac base gives KL.*inf[^\n]*$"):
        call(group, Dirac(0.0), torch.zeros(3, dtype=F64))


def test_control_variate_refused_where_the_group_moves_the_support() -> None:
    group, g = DiagonalAffineGroup(), _element(DiagonalAffineGroup(), (3,), _gen(13))
    for base in (Uniform(-1.0, 1.0), Rayleigh(1.0)):
        xi = _draws(group, base, g, 10, seed=0)
        with pytest.raises(ValueError, match=r"^control_variate: .*support"):
            kl_gradient_monte_carlo(group, base, g, g, xi, control_variate=True)
    assert kl_gradient_monte_carlo(group, Uniform(-1.0, 1.0), g, g, xi).shape == (10, 2, 3)


def test_bad_shapes_and_sample_counts_are_refused() -> None:
    group, base = DiagonalAffineGroup(), StudentT(3.0)
    g = _element(group, (3,), _gen(14))
    with pytest.raises(ValueError, match=r"^h: shape"):
        kl_divergence(group, base, g, g[:, :2])
    with pytest.raises(ValueError, match="affine elements"):
        kl_divergence(group, base, g[0], g[0])
    with pytest.raises(ValueError, match=r"^num_samples"):
        kl_gradient(group, base, g, g, num_samples=0)


def test_monte_carlo_is_deterministic_given_a_generator() -> None:
    group, base = DiagonalAffineGroup(), StudentT(3.0)
    gen = _gen(15)
    g, h = _element(group, (3,), gen), _element(group, (3,), gen)
    first = kl_gradient(group, base, g, h, num_samples=64, generator=_gen(16))
    again = kl_gradient(group, base, g, h, num_samples=64, generator=_gen(16))
    other = kl_gradient(group, base, g, h, num_samples=64, generator=_gen(17))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# ------------------------------------------------------------------------ properties
@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_kl_is_nonnegative_and_left_invariant(case: str, seed: int) -> None:
    """KL ≥ 0, and KL(q_{fg} ‖ q_{fh}) = KL(q_g ‖ q_h): f· is a bijection of both laws."""
    make, base = CASES[case]
    group, gen = make(), _gen(seed)
    f, g, h = (_element(group, (3,), gen) for _ in range(3))
    kl = kl_divergence(group, base, g, h)
    assert float(kl) >= 0
    moved = kl_divergence(group, base, group.compose(f, g), group.compose(f, h))
    torch.testing.assert_close(moved, kl, rtol=1e-9, atol=1e-12)
