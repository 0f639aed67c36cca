r"""Reparameterised Lie-algebra gradients and the Fisher metric at the identity.

Oracles: hand-derived closed forms; central finite differences; scores written out by hand
from each base's log-density derivative ψ = (log p)′ (at the identity of a group acting by
x ↦ A x + b the scores are s_b = −ψ(x), s_{log A} = −xψ(x) − 1); ``scipy.integrate.quad``.

Monte-Carlo Fisher checks use the *same draws* as :func:`fisher_monte_carlo` (same generator
seed), so that (i) the library's autograd scores must reproduce the hand scores to float64
rounding, and (ii) each entry of the closed form must lie within 5 standard errors of the
estimate, SE_ij = sd(s_i s_j)/√N computed from those draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import scipy.integrate
import scipy.stats
import torch
import torch.func
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import Tensor
from torch.distributions import (
    Cauchy,
    Distribution,
    Exponential,
    Laplace,
    LogNormal,
    Normal,
    StudentT,
    Uniform,
)

from liegroup_blr.distributions import Dirac, Rayleigh, sample_into
from liegroup_blr.fisher import (
    MAX_MONTE_CARLO_DIM,
    algebra_gradient,
    entropy_gradient,
    fisher_at_identity,
    fisher_closed_form,
    fisher_monte_carlo,
    inverse_metric,
)
from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    LieGroup,
    MultiplicativeGroup,
)
from liegroup_blr.groups.base import Shape

F64 = torch.float64
Z = 5.0
N = 50_000
SHAPES = hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape: Shape, gen: torch.Generator) -> Tensor:
    return torch.randn(tuple(shape), dtype=F64, generator=gen)


def _random_element(group: LieGroup, shape: Shape, gen: torch.Generator) -> Tensor:
    if isinstance(group, AdditiveGroup):
        return _randn(shape, gen)
    if isinstance(group, MultiplicativeGroup):
        return _randn(group.element_shape(shape), gen).exp()
    return torch.stack((_randn(shape, gen).exp(), _randn(shape, gen)))


def _random_base(group: LieGroup, shape: Shape, gen: torch.Generator) -> Tensor:
    xi = _randn(group.base_shape(shape), gen)
    return xi.abs() + 0.1 if group.positive_base else xi


# ------------------------------------------------------------------ algebra gradient
def _expected_algebra_gradient(group: LieGroup, g: Tensor, xi: Tensor, gt: Tensor) -> Tensor:
    """Hand-derived ∇_X ℓ(θ(X)) at X = 0 (docs/concepts.md, "The reparameterised gradient" and
    "The three built-in groups")."""
    if isinstance(group, AdditiveGroup):
        return gt
    if isinstance(group, MultiplicativeGroup) and group.signed:
        return torch.stack((gt * g[0] * xi[0], -gt * g[1] * xi[1]))
    if isinstance(group, MultiplicativeGroup):
        return gt * g * xi
    return torch.stack((gt * g[0] * xi, gt * g[0]))


GROUPS: dict[str, Callable[[], LieGroup]] = {
    "additive": AdditiveGroup,
    "multiplicative": lambda: MultiplicativeGroup(signed=False),
    "signed": lambda: MultiplicativeGroup(signed=True),
    "affine": DiagonalAffineGroup,
}


@pytest.mark.parametrize("name", list(GROUPS))
@settings(max_examples=15, deadline=None)
@given(shape=SHAPES, seed=st.integers(0, 2**31))
def test_algebra_gradient_closed_forms(name: str, shape: tuple[int, ...], seed: int) -> None:
    group, gen = GROUPS[name](), _gen(seed)
    g, xi = _random_element(group, shape, gen), _random_base(group, shape, gen)
    grad_theta = _randn(shape, gen)
    got = algebra_gradient(group, g, xi, grad_theta)
    assert got.shape == group.algebra_shape(shape)
    torch.testing.assert_close(
        got, _expected_algebra_gradient(group, g, xi, grad_theta), rtol=1e-13, atol=1e-13
    )


@pytest.mark.parametrize("name", list(GROUPS))
def test_algebra_gradient_matches_finite_differences(name: str) -> None:
    """Chain rule against central differences of ℓ(θ(X)), ℓ(θ) = Σ w sin θ, float64.

    Error of a central difference with h = 1e-5: h²/6·|ℓ'''| + eps·|ℓ|/h ≲ 1e-9.
    """
    group, gen, shape = GROUPS[name](), _gen(3), (2, 3)
    g, xi, w = (
        _random_element(group, shape, gen),
        _random_base(group, shape, gen),
        _randn(shape, gen),
    )

    def loss(X: Tensor) -> Tensor:
        theta = group.readout(group.act(group.compose(g, group.exp(X)), xi))
        return (w * theta.sin()).sum()

    X0 = group.algebra_zeros_like(g)
    theta0 = group.readout(group.act(g, xi))
    got = algebra_gradient(group, g, xi, w * theta0.cos())
    h, fd = 1e-5, torch.empty_like(X0)
    for i in range(X0.numel()):
        e = torch.zeros_like(X0).view(-1)
        e[i] = h
        fd.view(-1)[i] = (loss(e.view_as(X0)) - loss(-e.view_as(X0))) / (2 * h)
    torch.testing.assert_close(got, fd, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("name", list(GROUPS))
@settings(max_examples=10, deadline=None)
@given(shape=SHAPES, seed=st.integers(0, 2**31))
def test_entropy_gradient_closed_forms(name: str, shape: tuple[int, ...], seed: int) -> None:
    group = GROUPS[name]()
    g = _random_element(group, shape, _gen(seed))
    got = entropy_gradient(group, g)
    ones = torch.ones(shape, dtype=F64)
    expected = {
        "additive": torch.zeros(shape, dtype=F64),
        "multiplicative": ones,
        "signed": torch.stack((ones, ones)),
        "affine": torch.stack((ones, torch.zeros_like(ones))),
    }[name]
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


# ------------------------------------------------------------------ hand scores
Psi = Callable[[Tensor], Tensor]


def psi_of(base: Distribution) -> Psi:
    """ψ(x) = d log p(x)/dx, written out by hand for each family."""
    if isinstance(base, Normal):
        mu, s = float(base.loc), float(base.scale)
        return lambda x: -(x - mu) / s**2
    if isinstance(base, Laplace):
        mu, b = float(base.loc), float(base.scale)
        return lambda x: -torch.sign(x - mu) / b
    if isinstance(base, StudentT):
        nu, mu, s = float(base.df), float(base.loc), float(base.scale)
        return lambda x: -(nu + 1) * (x - mu) / (nu * s**2 + (x - mu) ** 2)
    if isinstance(base, Cauchy):
        mu, g = float(base.loc), float(base.scale)
        return lambda x: -2 * (x - mu) / (g**2 + (x - mu) ** 2)
    if isinstance(base, Rayleigh):
        s = float(base.scale)
        return lambda x: 1 / x - x / s**2
    if isinstance(base, Exponential):
        rate = float(base.rate)
        return lambda x: torch.full_like(x, -rate)
    if isinstance(base, LogNormal):
        mu, s = float(base.loc), float(base.scale)
        return lambda x: -1 / x - (x.log() - mu) / (s**2 * x)
    raise AssertionError(base)


def hand_scores(group: LieGroup, base: Distribution, draws: Tensor) -> Tensor:
    """Scores s(x) = ∇_X log q_{exp X}(x) at X = 0, one row per draw, flattened algebra."""
    psi, n = psi_of(base), draws.shape[0]
    x = draws
    if isinstance(group, AdditiveGroup):
        s = -psi(x)
    elif isinstance(group, MultiplicativeGroup):
        s = -x * psi(x) - 1
    else:
        s = torch.stack((-x * psi(x) - 1, -psi(x)), dim=1)
    return s.reshape(n, -1)


def same_draws(group: LieGroup, base: Distribution, shape: Shape, n: int, seed: int) -> Tensor:
    draws = torch.empty((n, *group.base_shape(shape)), dtype=F64)
    return sample_into(base, draws, _gen(seed))


def moment_and_se(s: Tensor) -> tuple[Tensor, Tensor]:
    """E[s sᵀ] and the standard error of each entry, from per-sample products."""
    products = s[:, :, None] * s[:, None, :]
    return products.mean(0), products.std(0) / math.sqrt(s.shape[0])


def assert_within_se(estimate: Tensor, truth: Tensor, se: Tensor) -> None:
    """|estimate − truth| < Z·SE, plus the rounding of ``truth`` to its dtype (closed forms
    come back in the default dtype, float32; some entries, e.g. Laplace's 1/b², are
    deterministic per sample, so SE = 0 there)."""
    gap = (estimate.to(F64) - truth.to(F64)).abs()
    rounding = 2 * torch.finfo(truth.dtype).eps * truth.to(F64).abs() + 1e-300
    assert bool((gap < Z * se + rounding).all()), (estimate, truth, se)


# ------------------------------------------------------------------ closed form vs MC
CLOSED_PAIRS: dict[str, tuple[Callable[[], LieGroup], Callable[[], Distribution]]] = {
    "additive-normal": (AdditiveGroup, lambda: Normal(0.0, 0.5)),
    "additive-normal-shifted": (AdditiveGroup, lambda: Normal(1.5, 2.0)),
    "additive-laplace": (AdditiveGroup, lambda: Laplace(0.0, 1.25)),
    "additive-student-t3": (AdditiveGroup, lambda: StudentT(3.0, 0.0, 0.75)),
    "additive-student-t5": (AdditiveGroup, lambda: StudentT(5.0, 0.0, 2.0)),
    "multiplicative-rayleigh": (lambda: MultiplicativeGroup(signed=False), lambda: Rayleigh(0.5)),
    "signed-rayleigh": (lambda: MultiplicativeGroup(signed=True), lambda: Rayleigh(2.0)),
    "affine-normal": (DiagonalAffineGroup, lambda: Normal(0.0, 0.5)),
    "affine-laplace": (DiagonalAffineGroup, lambda: Laplace(0.0, 1.25)),
    "affine-student-t3": (DiagonalAffineGroup, lambda: StudentT(3.0, 0.0, 0.75)),
    "affine-student-t5": (DiagonalAffineGroup, lambda: StudentT(5.0, 0.0, 2.0)),
}


@pytest.mark.parametrize("key", list(CLOSED_PAIRS))
def test_fisher_closed_form_matches_monte_carlo(key: str) -> None:
    make_group, make_base = CLOSED_PAIRS[key]
    group, base, shape, seed = make_group(), make_base(), (2,), 11
    closed = fisher_closed_form(group, base, shape)
    assert closed is not None
    d = group.algebra_shape(shape).numel()
    assert closed.shape == (d, d) and closed.dtype == torch.get_default_dtype()

    mc = fisher_monte_carlo(group, base, shape, num_samples=N, generator=_gen(seed))
    assert mc.shape == (d, d) and mc.dtype == F64
    s = hand_scores(group, base, same_draws(group, base, shape, N, seed))
    estimate, se = moment_and_se(s)
    # (i) the library's autograd scores are the hand scores: float64 rounding only
    torch.testing.assert_close(mc, estimate, rtol=1e-9, atol=1e-9 * float(estimate.abs().max()))
    # (ii) the closed form is the expectation the estimate converges to
    assert_within_se(mc, closed, se)
    # at the identity the Fisher metric is what fisher_at_identity reports
    torch.testing.assert_close(fisher_at_identity(group, base, shape), closed, rtol=0, atol=0)


def test_fisher_closed_form_layout_is_component_major() -> None:
    """Hand values for shape (2, 3): Gaussian σ = 0.5 → diag(2 (u), 1/σ² = 4 (v)) per entry."""
    f = fisher_closed_form(DiagonalAffineGroup(), Normal(0.0, 0.5), (2, 3))
    assert f is not None
    torch.testing.assert_close(f, torch.diag(torch.tensor([2.0] * 6 + [4.0] * 6)))
    f = fisher_closed_form(MultiplicativeGroup(signed=True), Rayleigh(3.0), (2,))
    assert f is not None
    torch.testing.assert_close(f, 4 * torch.eye(4))  # E[(ξ²/σ² − 2)²] = Var(χ²₂) = 4
    f = fisher_closed_form(AdditiveGroup(), StudentT(3.0, 0.0, 2.0), ())
    assert f is not None
    torch.testing.assert_close(f, torch.tensor([[4 / (6 * 4)]]))  # (ν+1)/((ν+3)σ²)


# ------------------------------------------------------------------ uncovered pairs: MC fallback
def _affine_normal_shifted(mu: float, s: float) -> Tensor:
    """x = μ + σz: s_v = z/σ, s_u = z² − 1 + μz/σ → [[2 + μ²/σ², μ/σ²], [μ/σ², 1/σ²]]."""
    return torch.tensor([[2 + mu**2 / s**2, mu / s**2], [mu / s**2, 1 / s**2]], dtype=F64)


FALLBACK_PAIRS: dict[str, tuple[Callable[[], LieGroup], Callable[[], Distribution], Tensor]] = {
    # s = λx − 1, Var(λx) = 1
    "multiplicative-exponential": (
        lambda: MultiplicativeGroup(signed=False),
        lambda: Exponential(2.0),
        torch.ones(1, 1, dtype=F64),
    ),
    # s = (log x − μ)/σ², E[s²] = 1/σ²
    "signed-lognormal": (
        lambda: MultiplicativeGroup(signed=True),
        lambda: LogNormal(0.25, 0.5),
        4 * torch.eye(2, dtype=F64),
    ),
    # Cauchy(0, γ): location information 1/(2γ²)
    "additive-cauchy": (
        AdditiveGroup,
        lambda: Cauchy(0.0, 2.0),
        torch.tensor([[0.125]], dtype=F64),
    ),
    # Cauchy(0, γ): log-scale information 1/2, location 1/(2γ²)
    "affine-cauchy": (
        DiagonalAffineGroup,
        lambda: Cauchy(0.0, 2.0),
        torch.diag(torch.tensor([0.5, 0.125], dtype=F64)),
    ),
    "affine-normal-shifted": (
        DiagonalAffineGroup,
        lambda: Normal(1.5, 0.5),
        _affine_normal_shifted(1.5, 0.5),
    ),
}


@pytest.mark.parametrize("key", list(FALLBACK_PAIRS))
def test_uncovered_pairs_fall_back_to_monte_carlo(key: str) -> None:
    make_group, make_base, per_coordinate = FALLBACK_PAIRS[key]
    group, base, shape, n = make_group(), make_base(), (), 50_000
    assert fisher_closed_form(group, base, shape) is None

    torch.manual_seed(5)
    fallback = fisher_at_identity(group, base, shape, num_samples=n)
    assert fallback.dtype == torch.get_default_dtype()
    torch.manual_seed(5)  # fisher_at_identity draws from the global RNG: replay it
    draws = sample_into(base, torch.empty((n, *group.base_shape(shape)), dtype=F64))
    estimate, se = moment_and_se(hand_scores(group, base, draws))
    # float64 estimate rounded to float32 on return
    torch.testing.assert_close(fallback.to(F64), estimate, rtol=1e-6, atol=1e-7)
    assert_within_se(estimate, per_coordinate, se)


@pytest.mark.parametrize(
    "group",
    [AdditiveGroup(), MultiplicativeGroup(signed=True), DiagonalAffineGroup()],
    ids=["additive", "signed", "affine"],
)
@pytest.mark.parametrize("value", [0.0, 1.0])
def test_dirac_has_no_fisher(group: LieGroup, value: float) -> None:
    assert fisher_closed_form(group, Dirac(value), (2,)) is None
    with pytest.raises(ValueError, match="base"):
        fisher_monte_carlo(group, Dirac(value), (2,), num_samples=10)
    with pytest.raises(ValueError, match="base"):
        fisher_at_identity(group, Dirac(value), (2,), num_samples=10)


def test_monte_carlo_restores_validation_flag() -> None:
    base = StudentT(3.0, 0.0, 1.0, validate_args=True)
    fisher_monte_carlo(AdditiveGroup(), base, (), num_samples=100, generator=_gen(0))
    assert base._validate_args is True


# ------------------------------------------------------------------ a user-defined group
def _exprel(u: Tensor) -> Tensor:
    """(e^u − 1)/u, written independently of the library (series below 1e-5)."""
    small = u.abs() < 1e-5
    safe = torch.where(small, torch.ones_like(u), u)
    return torch.where(small, 1 + u / 2 + u * u / 6, torch.expm1(safe) / safe)


class SharedAffineGroup(LieGroup):
    """θ = s·ξ + t with a single (s > 0, t) shared by a whole tensor of ``size`` entries.

    Elements and algebra vectors have shape (2,) whatever the parameter's shape; base draws
    have the parameter's shape. log|det J| = size · log s.
    """

    name = "SharedAffine"

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def element_shape(self, shape: Shape) -> torch.Size:
        return torch.Size((2,))

    def param_shape(self, element_shape: Shape) -> torch.Size:
        return torch.Size((self.size,))

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        return torch.tensor([1.0, 0.0], dtype=dtype, device=device)

    def exp(self, X: Tensor) -> Tensor:
        return torch.stack((X[0].exp(), X[1] * _exprel(X[0])))

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return torch.stack((g[0] * h[0], g[0] * h[1] + g[1]))

    def inverse(self, g: Tensor) -> Tensor:
        return torch.stack((1 / g[0], -g[1] / g[0]))

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        return g[0] * x + g[1]

    def log_abs_det(self, g: Tensor) -> Tensor:
        return self.size * g[0].log()


def _quad_fisher(nu: float, mu: float, sigma: float) -> Tensor:
    """Per-coordinate Fisher of x ↦ e^u x + v at 0 for a Student-t base, by quadrature.

    F = ∫ p(x) s(x) s(x)ᵀ dx with s = (−xψ − 1, −ψ), ψ = (log p)′ and p from scipy.stats.t.
    """
    pdf = scipy.stats.t(nu, mu, sigma).pdf

    def psi(x: float) -> float:
        return -(nu + 1) * (x - mu) / (nu * sigma**2 + (x - mu) ** 2)

    def entry(f: Callable[[float], float]) -> float:
        return scipy.integrate.quad(lambda x: pdf(x) * f(x), -np.inf, np.inf, epsabs=1e-12)[0]

    uu = entry(lambda x: (x * psi(x) + 1) ** 2)
    uv = entry(lambda x: (x * psi(x) + 1) * psi(x))
    vv = entry(lambda x: psi(x) ** 2)
    return torch.tensor([[uu, uv], [uv, vv]], dtype=F64)


def test_user_defined_group_heavy_tailed_fisher() -> None:
    nu, mu, sigma, shape, n, seed = 4.0, 0.75, 1.25, (3,), N, 17
    group, base = SharedAffineGroup(size=3), StudentT(nu, mu, sigma)
    assert fisher_closed_form(group, base, shape) is None

    mc = fisher_monte_carlo(group, base, shape, num_samples=n, generator=_gen(seed))
    assert mc.shape == (2, 2)
    torch.testing.assert_close(mc, mc.T, rtol=1e-12, atol=0.0)
    assert bool((torch.linalg.eigvalsh(mc) > 0).all())

    # Scores of the shared parameters are sums of per-coordinate scores.
    draws = same_draws(group, base, shape, n, seed)
    psi = psi_of(base)(draws)
    s = torch.stack(((-draws * psi - 1).sum(1), (-psi).sum(1)), dim=1)
    estimate, se = moment_and_se(s)
    torch.testing.assert_close(mc, estimate, rtol=1e-9, atol=1e-9)

    # i.i.d. coordinates with mean-zero scores: F = size · F₁, F₁ by quadrature. The
    # location-shifted Student-t makes the (u, v) cross term non-zero: F₁_uv = μ F₁_vv.
    truth = 3 * _quad_fisher(nu, mu, sigma)
    assert float(truth[0, 1]) == pytest.approx(mu * float(truth[1, 1]), rel=1e-6)
    assert_within_se(mc, truth, se)

    # fisher_at_identity has no closed form for this group and falls back to MC
    torch.manual_seed(0)
    fallback = fisher_at_identity(group, base, shape, num_samples=20_000)
    assert fallback.shape == (2, 2) and bool((torch.linalg.eigvalsh(fallback.double()) > 0).all())


def test_user_defined_group_gradients() -> None:
    group, gen = SharedAffineGroup(size=6), _gen(8)
    g = torch.tensor([1.7, -0.4], dtype=F64)
    xi, grad_theta = _randn((2, 3), gen), _randn((2, 3), gen)
    # θ(u, v) = s e^u ξ + s v φ(u) + t: ∂θ/∂u = sξ, ∂θ/∂v = s at 0
    expected = torch.stack(((grad_theta * 1.7 * xi).sum(), (grad_theta * 1.7).sum()))
    torch.testing.assert_close(algebra_gradient(group, g, xi, grad_theta), expected)
    # log|det J| = 6 log(s e^u)
    torch.testing.assert_close(
        entropy_gradient(group, g), torch.tensor([6.0, 0.0], dtype=F64), rtol=1e-13, atol=0.0
    )


# ------------------------------------------------------------------ inverse_metric
class ScaledTranslation(LieGroup):
    """θ = s·ξ + t, one scale s > 0 per tensor and one shift per entry: elements and algebra
    vectors are flat ``[s, t₁..tₙ]`` of size n + 1 (the docs tutorial's group; not
    coordinatewise). For a base N(0, σ²), F = diag(2n, I/σ²) on (u, v)."""

    name = "ScaledTranslation"

    def element_shape(self, shape: Shape) -> torch.Size:
        return torch.Size((1 + math.prod(shape),))

    def param_shape(self, element_shape: Shape) -> torch.Size:
        return torch.Size((element_shape[0] - 1,))

    def identity(
        self, shape: Shape, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> Tensor:
        return torch.cat((torch.ones(1, dtype=dtype), torch.zeros(math.prod(shape), dtype=dtype)))

    def exp(self, X: Tensor) -> Tensor:
        return torch.cat((X[:1].exp(), X[1:] * _exprel(X[:1])))

    def compose(self, g: Tensor, h: Tensor) -> Tensor:
        return torch.cat((g[:1] * h[:1], g[:1] * h[1:] + g[1:]))

    def inverse(self, g: Tensor) -> Tensor:
        return torch.cat((1 / g[:1], -g[1:] / g[:1]))

    def act(self, g: Tensor, x: Tensor) -> Tensor:
        return g[0] * x + g[1:].reshape(x.shape)

    def log_abs_det(self, g: Tensor) -> Tensor:
        return (g.shape[0] - 1) * g[0].log()


def _columns(solve: Callable[[Tensor], Tensor], d: int) -> Tensor:
    """F⁻¹ as a matrix, column by column."""
    return torch.stack([solve(torch.eye(d, dtype=F64)[i]) for i in range(d)], 1)


@pytest.mark.parametrize("n", [64, 63], ids=["odd-algebra-65", "even-algebra-64"])
def test_inverse_metric_of_a_non_coordinatewise_group(n: int) -> None:
    """Issue: the algebra was reshaped to (2, −1): size 65 raised, size 64 was split in halves
    (factors ½ and σ² where 1/(2n) and σ² are right). The metric must be the parameter's own
    (n+1) × (n+1) Fisher: D^{-1/2} F̂ D^{-1/2} = I within the Monte-Carlo error (σ_entry ≈
    √2/√S on the diagonal, 1/√S off it; S = 40,000 draws, 5σ)."""
    sigma, S = 0.1, 40_000
    group, base = ScaledTranslation(), Normal(0.0, sigma)
    solve = inverse_metric(group, base, (n,), generator=_gen(3), num_samples=S)
    F_hat = torch.linalg.inv(_columns(solve, n + 1))
    exact = torch.tensor([2.0 * n] + [1 / sigma**2] * n, dtype=F64)
    scaled = F_hat / torch.outer(exact.sqrt(), exact.sqrt())
    off = scaled - torch.diag(scaled.diagonal())
    assert float((scaled.diagonal() - 1).abs().max()) < 5 * math.sqrt(2 / S)
    assert float(off.abs().max()) < 6 / math.sqrt(S)
    # The step the issue measured, F⁻¹X / (the right F⁻¹X), was 0.49 and 0.00998 where 1 is
    # right: here each entry is 1 within 5σ, σ = √(2 + n)/√S (a row sum of the scaled noise).
    out = solve(exact)  # F⁻¹(F·1) = 1
    assert float((out - 1).abs().max()) < 5 * math.sqrt((2 + n) / S)
    assert float(out[1:].mean()) == pytest.approx(1.0, abs=5 * math.sqrt((2 + n) / S / n))


def test_inverse_metric_closed_form_block_is_applied_per_coordinate() -> None:
    """Equal to solving with fisher_closed_form's kron matrix, and never builds it: a
    (300, 400) affine parameter would need a 240,000² matrix."""
    group, base = DiagonalAffineGroup(), Normal(0.0, 0.5)
    X = _randn(group.algebra_shape((3, 4)), _gen(0))
    expected = torch.linalg.solve(fisher_closed_form(group, base, (3, 4)).double(), X.reshape(-1))
    torch.testing.assert_close(inverse_metric(group, base, (3, 4))(X), expected.reshape(X.shape))
    big = torch.ones(group.algebra_shape((300, 400)))
    out = inverse_metric(group, base, (300, 400))(big)
    assert out.dtype == big.dtype
    torch.testing.assert_close(
        out, torch.stack((torch.full((300, 400), 0.5), torch.full((300, 400), 0.25)))
    )
    signed = MultiplicativeGroup(signed=True)
    torch.testing.assert_close(
        inverse_metric(signed, Rayleigh(1.0), (5,))(torch.ones(2, 5)), torch.full((2, 5), 0.25)
    )


def test_inverse_metric_monte_carlo_block_for_elementwise_groups() -> None:
    """No closed form for a shifted Gaussian under the affine group: the c × c block is
    estimated from all coordinates' scores and matches [[2 + μ²/σ², μ/σ²], [μ/σ², 1/σ²]]."""
    group, base, shape = DiagonalAffineGroup(), Normal(1.5, 0.5), (10, 10)
    solve = inverse_metric(group, base, shape, generator=_gen(1), num_samples=200_000)
    X = torch.zeros(group.algebra_shape(shape), dtype=F64)
    X[0, 0, 0], X[1, 3, 7] = 1.0, 1.0  # one u unit at coordinate (0, 0), one v at (3, 7)
    out = solve(X)
    inv = torch.linalg.inv(_affine_normal_shifted(1.5, 0.5))
    torch.testing.assert_close(out[:, 0, 0], inv[:, 0], rtol=0.03, atol=0.0)
    torch.testing.assert_close(out[:, 3, 7], inv[:, 1], rtol=0.03, atol=0.0)
    out[:, 0, 0] = out[:, 3, 7] = 0
    assert not bool(out.any())  # no coupling across coordinates


@pytest.mark.parametrize(
    ("group", "base", "why"),
    [
        (AdditiveGroup(), Uniform(-1.0, 1.0), "Uniform.*score is zero"),
        (DiagonalAffineGroup(), Uniform(-1.0, 1.0), "Uniform.*(zero|singular)"),
        (AdditiveGroup(), Dirac(0.0), "Dirac.*no density"),
        (ScaledTranslation(), Dirac(1.0), "Dirac.*no density"),
    ],
    ids=["additive-uniform", "affine-uniform", "additive-dirac", "custom-dirac"],
)
def test_inverse_metric_rejects_bases_without_fisher_information(
    group: LieGroup, base: Distribution, why: str
) -> None:
    """Issue: a Uniform base made torch.linalg.solve fail with a raw linear-algebra error."""
    with pytest.raises(ValueError, match=f"^base: {why}"):
        inverse_metric(group, base, (3,), generator=_gen(0), num_samples=2000)


def test_inverse_metric_declared_metric_and_limits() -> None:
    class Declared(ScaledTranslation):
        def fisher(self, base: Distribution, shape: Shape) -> Tensor | None:
            return torch.diag(torch.arange(1.0, 2.0 + math.prod(shape)))

    solve = inverse_metric(Declared(), Normal(0.0, 1.0), (3,))
    torch.testing.assert_close(solve(torch.ones(4)), 1 / torch.arange(1.0, 5.0))

    class WrongShape(ScaledTranslation):
        def fisher(self, base: Distribution, shape: Shape) -> Tensor | None:
            return torch.eye(2)

    with pytest.raises(ValueError, match=r"WrongShape.fisher returned shape \(2, 2\)"):
        inverse_metric(WrongShape(), Normal(0.0, 1.0), (3,))
    with pytest.raises(ValueError, match=r"declare it with ScaledTranslation\.fisher"):
        inverse_metric(ScaledTranslation(), Normal(0.0, 1.0), (MAX_MONTE_CARLO_DIM,))


def test_builtin_groups_declare_their_structure() -> None:
    assert AdditiveGroup().elementwise and AdditiveGroup().components == ()
    assert MultiplicativeGroup(signed=False).components == ()
    assert MultiplicativeGroup().components == ("excitatory", "inhibitory")
    assert DiagonalAffineGroup().components == ("scale", "shift")
    for group in (AdditiveGroup(), MultiplicativeGroup(), DiagonalAffineGroup()):
        assert group.elementwise and group.fisher(Normal(0.0, 1.0), (3,)) is None
        c = max(1, len(group.components))
        assert group.algebra_shape((4, 5)) == ((c, 4, 5) if c > 1 else (4, 5))
    assert not ScaledTranslation().elementwise and ScaledTranslation().components == ()
