"""The two worked groups that do not act coordinatewise: full affine and rotation-scaling.

Oracles independent of the code under test: the full affine group as ``(n+1) × (n+1)``
matrices with ``scipy.linalg.expm``; rotation-scalings as numpy complex numbers; log|det J|
from ``torch.func.jacrev`` + ``slogdet``; algebra and entropy gradients and Fisher scores
written out by hand; and on a quadratic loss the exact Gaussian posterior, which both
families contain, found by :class:`~liegroup_blr.LieGroupBLR`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.func
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributions import Laplace, Normal

import liegroup_blr as lgb
from experiments.common.config import resolve
from experiments.common.optimizers import build_group, build_optimizer, build_preconditioner
from liegroup_blr.distributions import sample_into
from liegroup_blr.fisher import (
    algebra_gradient,
    entropy_gradient,
    fisher_monte_carlo,
    inverse_metric,
)
from liegroup_blr.groups import FullAffineGroup, LieGroup, RotationScalingGroup

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
SETTINGS = settings(max_examples=15, deadline=None)
SHAPES = {"full-affine": [(1,), (3,), (2, 2)], "rotation-scaling": [(2,), (3, 4), (2, 1, 2)]}
GROUPS = {"full-affine": FullAffineGroup, "rotation-scaling": RotationScalingGroup}


def close(actual: Tensor, expected: Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual, expected, **(tol or TOL))


# torch.linalg.matrix_exp in float64 is accurate to a few 1e-9 relative for small algebra
# elements (measured 3.9e-9 on [[0.048, 0.048], [0, 0]]); the full affine group inherits it.
MATRIX_EXP_TOL = {"rtol": 2e-8, "atol": 2e-9}


def random_algebra(group: LieGroup, shape: tuple[int, ...], seed: int, scale: float) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(group.algebra_shape(shape), dtype=F64, generator=gen)


def draws(data: st.DataObject, name: str) -> tuple[LieGroup, tuple[int, ...], list[Tensor]]:
    """A group, a parameter shape and four algebra vectors of moderate size."""
    group, shape = GROUPS[name](), data.draw(st.sampled_from(SHAPES[name]))
    seed = data.draw(st.integers(0, 2**31))
    return group, shape, [random_algebra(group, shape, seed + i, 0.7) for i in range(4)]


# ------------------------------------------------------------------ independent oracles
def affine_matrix(group: FullAffineGroup, g: Tensor) -> np.ndarray:
    """[[L, b], [0, 1]] as numpy, unpacked by hand (lower triangle row by row, then b)."""
    k = g.shape[0]
    n = int((math.isqrt(9 + 8 * k) - 3) // 2)
    M = np.zeros((n + 1, n + 1))
    M[np.tril_indices(n)] = g[: n * (n + 1) // 2].numpy()
    M[:n, n] = g[n * (n + 1) // 2 :].numpy()
    M[n, n] = 1.0
    return M


def complex_of(g: Tensor) -> np.ndarray:
    return g[0].numpy() + 1j * g[1].numpy()


@pytest.mark.parametrize("name", list(GROUPS))
@SETTINGS
@given(data=st.data())
def test_group_axioms(name: str, data: st.DataObject) -> None:
    group, shape, (X, Y, Z, W) = draws(data, name)
    tol = MATRIX_EXP_TOL if name == "full-affine" else TOL
    g, h, k = group.exp(X), group.exp(Y), group.exp(Z)
    e = group.identity(shape, dtype=F64)
    close(group.compose(group.compose(g, h), k), group.compose(g, group.compose(h, k)))
    close(group.compose(g, e), g)
    close(group.compose(e, g), g)
    close(group.compose(g, group.inverse(g)), e)
    close(group.compose(group.inverse(g), g), e)
    close(group.exp(0 * X), e)
    close(group.exp(-X), group.inverse(g), **tol)
    close(
        group.exp(0.3 * W + 0.5 * W), group.compose(group.exp(0.3 * W), group.exp(0.5 * W)), **tol
    )
    xi = W.new_tensor(np.random.default_rng(0).normal(size=shape))
    close(group.act(e, xi), xi)
    close(group.act(group.compose(g, h), xi), group.act(g, group.act(h, xi)))
    close(group.log_abs_det(group.compose(g, h)), group.log_abs_det(g) + group.log_abs_det(h))
    jac = torch.func.jacrev(lambda x: group.act(g, x.reshape(shape)).reshape(-1))(xi.reshape(-1))
    close(group.log_abs_det(g), torch.linalg.slogdet(jac).logabsdet)
    d = X.numel()
    dexp = torch.func.jacfwd(lambda V: group.exp(V.reshape(X.shape)).reshape(-1))(0 * X.reshape(-1))
    close(dexp, torch.eye(d, dtype=F64), **tol)  # exp is a chart at e: exp(X) = e + X + O(X²)
    assert group.check_element(g)[0]
    assert group.param_shape(group.element_shape(shape)) in (torch.Size(shape), (math.prod(shape),))


@SETTINGS
@given(data=st.data())
def test_full_affine_is_the_matrix_group(data: st.DataObject) -> None:
    group, _, (X, Y, _, _) = draws(data, "full-affine")
    algebra = affine_matrix(group, X)
    algebra[-1, -1] = 0.0  # [[X, v], [0, 0]]
    expm = scipy.linalg.expm(algebra)
    np.testing.assert_allclose(affine_matrix(group, group.exp(X)), expm, rtol=2e-8, atol=2e-9)
    g, h = group.exp(X), group.exp(Y)
    np.testing.assert_allclose(
        affine_matrix(group, group.compose(g, h)),
        affine_matrix(group, g) @ affine_matrix(group, h),
        rtol=1e-10,
        atol=1e-12,
    )
    np.testing.assert_allclose(
        affine_matrix(group, group.inverse(g)), np.linalg.inv(affine_matrix(group, g)), atol=1e-9
    )
    L, b = group.parts(g)["L"], group.parts(g)["b"]
    assert torch.equal(L, L.tril()) and bool((L.diagonal() > 0).all())
    xi = torch.linspace(-1, 2, len(b), dtype=F64)
    close(group.act(g, xi), L @ xi + b)


@SETTINGS
@given(data=st.data())
def test_rotation_scaling_is_complex_multiplication(data: st.DataObject) -> None:
    group, shape, (X, Y, _, W) = draws(data, "rotation-scaling")
    np.testing.assert_allclose(complex_of(group.exp(X)), np.exp(complex_of(X)), rtol=1e-12)
    g, h = group.exp(X), group.exp(Y)
    np.testing.assert_allclose(complex_of(group.compose(g, h)), complex_of(g) * complex_of(h))
    xi = W.new_tensor(np.random.default_rng(1).normal(size=shape))
    pairs = xi.reshape(*shape[:-1], shape[-1] // 2, 2).numpy()
    moved = complex_of(g) * (pairs[..., 0] + 1j * pairs[..., 1])
    expected = np.stack((moved.real, moved.imag), -1).reshape(shape)
    np.testing.assert_allclose(group.act(g, xi).numpy(), expected, rtol=1e-12, atol=1e-14)
    # ξ₀ = (1, 0) per pair: the point estimate is z itself; from_point inverts it
    close(group.point_estimate(g).reshape(-1), torch.stack((g[0], g[1]), -1).reshape(-1))
    close(group.from_point(group.point_estimate(g)), g)


def test_shapes_and_invalid_elements() -> None:
    affine, rotation = FullAffineGroup(), RotationScalingGroup()
    assert affine.element_shape((4, 5)) == (20 * 23 // 2,)
    assert affine.param_shape((9,)) == (3,)
    with pytest.raises(ValueError, match="n\\(n\\+3\\)/2"):
        affine.param_shape((8,))
    bad = affine.identity((2,), dtype=F64)
    bad[0] = -1.0
    assert not affine.check_element(bad)[0]
    assert affine.check_element(affine.projx(bad))[0]
    assert rotation.element_shape((3, 4)) == (2, 3, 2)
    with pytest.raises(ValueError, match="even"):
        rotation.element_shape((3, 5))
    with pytest.raises(ValueError, match="non-zero"):
        rotation.from_point(torch.zeros(4))
    zero = torch.zeros(2, 2, dtype=F64)
    assert not rotation.check_element(zero)[0]
    assert rotation.check_element(rotation.projx(zero))[0]
    assert not affine.elementwise and affine.components == ()
    assert rotation.elementwise and rotation.components == ("scale", "rotation")


# ------------------------------------------------------------------ gradients
def test_full_affine_gradients() -> None:
    group, gen = FullAffineGroup(), torch.Generator().manual_seed(3)
    g = group.exp(random_algebra(group, (4,), 1, 0.5))
    xi, grad = (torch.randn(4, dtype=F64, generator=gen) for _ in range(2))
    L = group.parts(g)["L"]
    # θ(X) = L(e^X ξ + v) + b: ∂θ/∂X_ij = L e_i ξ_j (i ≥ j), ∂θ/∂v = L
    pulled = L.T @ grad
    rows, cols = np.tril_indices(4)
    expected = torch.cat((torch.outer(pulled, xi)[rows, cols], pulled))
    close(algebra_gradient(group, g, xi, grad), expected)
    # log|det L e^X| = Σ log L_ii + tr X
    close(entropy_gradient(group, g), torch.cat((torch.tensor(rows == cols, dtype=F64), 0 * xi)))


def test_rotation_scaling_gradients() -> None:
    group, gen = RotationScalingGroup(), torch.Generator().manual_seed(4)
    g = group.exp(random_algebra(group, (2, 4), 2, 0.5))
    xi, grad = (torch.randn(2, 4, dtype=F64, generator=gen) for _ in range(2))
    z = complex_of(g)
    w = z * (xi[..., 0::2].numpy() + 1j * xi[..., 1::2].numpy())  # z ξ per pair
    dt = grad[..., 0::2].numpy() + 1j * grad[..., 1::2].numpy()
    # ∂θ/∂a = zξ, ∂θ/∂φ = i zξ; the gradient is the real inner product with ∇θ
    expected = np.stack(((np.conj(dt) * w).real, (np.conj(dt) * 1j * w).real))
    close(algebra_gradient(group, g, xi, grad), torch.from_numpy(expected))
    # log|z e^{a + iφ}|² = log|z|² + 2a
    close(
        entropy_gradient(group, g),
        torch.stack((torch.full((2, 2), 2.0), torch.zeros(2, 2))).double(),
    )


# ------------------------------------------------------------------ the Fisher metric
def hand_scores(group: LieGroup, base: Normal, x: Tensor) -> Tensor:
    """s(x) = ∇_X log q_{exp X}(x) at 0, one row per draw, with ψ(x) = −(x − μ)/σ²."""
    psi = -(x - float(base.loc)) / float(base.scale) ** 2
    if isinstance(group, FullAffineGroup):  # s_Xij = −ψ_i x_j − δ_ij, s_v = −ψ
        n = x.shape[1]
        rows, cols = np.tril_indices(n)
        outer = -psi[:, :, None] * x[:, None, :] - torch.eye(n, dtype=F64)
        return torch.cat((outer[:, rows, cols], -psi), 1)
    x1, x2, p1, p2 = x[..., 0::2], x[..., 1::2], psi[..., 0::2], psi[..., 1::2]
    s_a = -(p1 * x1 + p2 * x2) - 2  # d/da log q0(e^{-a} x) − 2a
    s_phi = p1 * x2 - p2 * x1  # d/dφ log q0(R(−φ) x)
    return torch.stack((s_a, s_phi), 1).reshape(len(x), -1)


@pytest.mark.parametrize(
    ("name", "shape", "base"),
    [
        ("full-affine", (3,), Normal(0.0, 0.5)),  # σ exact in float32
        ("rotation-scaling", (2, 2), Normal(1.5, 0.5)),
    ],
)
def test_monte_carlo_fisher_matches_the_declared_metric(
    name: str, shape: tuple[int, ...], base: Normal
) -> None:
    group, n, seed = GROUPS[name](), 40_000, 11
    mc = fisher_monte_carlo(
        group, base, shape, num_samples=n, generator=torch.Generator().manual_seed(seed)
    )
    x = sample_into(base, torch.empty((n, *shape), dtype=F64), torch.Generator().manual_seed(seed))
    s = hand_scores(group, base, x.reshape(n, -1) if name == "full-affine" else x)
    close(mc, s.T @ s / n, rtol=1e-9, atol=1e-9)  # autograd scores = hand scores
    products = s[:, :, None] * s[:, None, :]
    se = products.std(0) / math.sqrt(n)
    declared = torch.diag(group.fisher(base, shape))
    assert bool(((mc - declared).abs() < 5 * se + 1e-12).all()), (mc.diagonal(), declared)


def test_rotation_fisher_is_singular_under_an_isotropic_base() -> None:
    """A centred Gaussian pair is rotation-invariant: the score along φ vanishes."""
    group = RotationScalingGroup()
    assert float(group.fisher(Normal(0.0, 1.0), (4,)).min()) == 0.0
    with pytest.raises(ValueError, match=r"^base: Normal.*singular"):
        inverse_metric(group, Normal(0.0, 1.0), (4,))


def test_inverse_metric_uses_the_declared_diagonal_without_a_dense_matrix() -> None:
    group, base, shape = FullAffineGroup(), Normal(0.0, 0.1), (40, 30)  # d = 721_800
    solve = inverse_metric(group, base, shape)
    X = torch.ones(group.algebra_shape(shape))
    out = solve(X)
    n = 1200
    assert out.shape == X.shape and out.dtype == X.dtype
    diag_positions = torch.arange(n) * (torch.arange(n) + 3) // 2  # packed index of X_ii
    close(out[diag_positions], torch.full((n,), 0.5), rtol=1e-6, atol=0.0)
    assert float(out[1]) == pytest.approx(1.0)  # X_10, off-diagonal
    close(out[-n:], torch.full((n,), 0.01), rtol=1e-6, atol=0.0)


def test_full_affine_without_a_declared_metric() -> None:
    """A non-centred base has no closed form here: Monte Carlo for small d, else an error."""
    group, base = FullAffineGroup(), Laplace(0.5, 1.0)
    assert group.fisher(base, (3,)) is None
    solve = inverse_metric(
        group, base, (3,), generator=torch.Generator().manual_seed(0), num_samples=4000
    )
    assert solve(torch.ones(9, dtype=F64)).shape == (9,)
    with pytest.raises(ValueError, match=r"FullAffineGroup\.fisher"):
        inverse_metric(group, base, (70,))


# ------------------------------------------------------------------ exact posteriors
def train(
    group: LieGroup,
    base: Normal,
    shape: tuple[int, ...],
    loss_fn,
    init,
    steps: int,
    lr: float,
    mc: int,
) -> dict[str, Tensor]:
    """LieGroupBLR with the natural gradient (N = 50, τ = 1), cosine-annealed, antithetic."""
    p = torch.nn.Parameter(torch.zeros(shape))
    solve = inverse_metric(group, base, shape)
    opt = lgb.LieGroupBLR(
        [p],
        group,
        base,
        lr=lr,
        momentum=0.9,
        data_size=50,
        temperature=1.0,
        mc_samples=mc,
        preconditioner=solve,
        seed=0,
        antithetic=True,
        init=init,
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = loss_fn(p)
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
        schedule.step()
    return opt.group_element(p)


@pytest.mark.slow
def test_full_affine_finds_the_exact_full_covariance_posterior() -> None:
    """ℓ̄(θ) = ½(θ − c)ᵀB(θ − c), N = 50, τ = 1: the posterior N(c, (NB)⁻¹) is σ²LLᵀ for a
    Gaussian base. 300 steps × 16 antithetic samples, natural gradient, lr = ρN/τ with
    ρ = 0.1, cosine: relative Frobenius error of the covariance measured 4.6%, 3.8%, 3.0%,
    2.5% for seeds 0-3 (the MC noise frozen in by the annealing)."""
    group, sigma = FullAffineGroup(), 0.2
    c = torch.tensor([1.0, -0.5, 0.3])
    B = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.0, 0.3], [0.0, 0.3, 0.5]])
    parts = train(
        group,
        Normal(0.0, sigma),
        (3,),
        lambda theta: 0.5 * (theta - c) @ B @ (theta - c),
        lambda theta: group.from_point(torch.zeros_like(theta)),  # start N(0, σ²I)
        steps=300,
        lr=5.0,
        mc=16,
    )
    cov, exact = sigma**2 * parts["L"] @ parts["L"].T, torch.linalg.inv(50 * B)
    assert float((cov - exact).norm() / exact.norm()) < 0.06
    close(parts["b"], c, rtol=0.0, atol=1e-3)


@pytest.mark.slow
def test_rotation_scaling_finds_the_exact_posterior() -> None:
    """Base N(μ, σ²) per entry, so a pair is N(zμ(1 + i), |z|²σ²I). With
    ℓ̄ = Σ_k ½a_k|θ_k − c_k|², N = 50, τ = 1, the posterior N(c_k, s_k² I), s_k² = 1/(N a_k),
    lies in the family when |c_k| = √2 μ s_k/σ (then z_k = c_k/(μ(1 + i))); c_k's angle
    tests the rotation. 200 steps × 8 antithetic samples, natural gradient."""
    group, mu, sigma = RotationScalingGroup(), 1.0, 0.5
    a = torch.tensor([1.0, 2.0, 4.0])
    s = (1 / (50 * a)).sqrt()
    angle = torch.tensor([0.3, 2.0, -1.0])
    c = math.sqrt(2) * mu * (s / sigma)[:, None] * torch.stack((angle.cos(), angle.sin()), -1)
    parts = train(
        group,
        Normal(mu, sigma),
        (6,),
        lambda theta: 0.5 * (a * ((theta.reshape(3, 2) - c) ** 2).sum(-1)).sum(),
        lambda theta: group.from_point(torch.tensor([0.3, 0.1] * 3)),
        steps=200,
        lr=5.0,
        mc=8,
    )
    z = torch.complex(parts["re"], parts["im"])
    close(torch.view_as_real(z * mu * (1 + 1j)), c, rtol=0.03, atol=0.0)  # posterior mean
    close(z.abs() * sigma, s, rtol=0.03, atol=0.0)  # posterior standard deviation


# ------------------------------------------------------------------ driver configs
def halve(X: Tensor) -> Tensor:
    """A preconditioner named in a config as "tests.library.test_custom_groups:halve"."""
    return X / 2


NOT_CALLABLE = 3.0


def test_config_group_options_are_checked_against_the_constructor() -> None:
    """Issue: a misspelt key was ignored (geoopt.Manifold.__init__ takes **kwargs)."""
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['signd'\].*valid keys: \['signed'\]"):
        build_group("multiplicative", {"signd": False})
    with pytest.raises(ValueError, match=r"\['scale'\] for DiagonalAffineGroup; valid keys: \[\]"):
        build_group("affine", {"scale": 2.0})
    with pytest.raises(TypeError, match="scale"):
        lgb.groups.FullAffineGroup(scale=2.0)  # type: ignore[call-arg]
    assert not build_group("multiplicative", {"signed": False}).signed
    assert isinstance(build_group("full_affine", {}), FullAffineGroup)
    assert isinstance(build_group("liegroup_blr.groups:RotationScalingGroup", {}), LieGroup)


def test_config_preconditioners() -> None:
    affine = build_group("affine", {})
    assert build_preconditioner(None, affine) is None
    assert build_preconditioner("fisher", affine) == "fisher"
    assert build_preconditioner([1.0, 0.05], affine) == [1.0, 0.05]
    assert build_preconditioner({"scale": 0.05}, affine) == [0.05, 1.0]  # by component name
    assert build_preconditioner("tests.library.test_custom_groups:halve", affine) is halve
    for bad, message in [
        ({"scal": 0.05}, r"unknown component\(s\) \['scal'\].*\['scale', 'shift'\]"),
        ("newton", "unknown 'newton'"),
        ("tests.library.test_custom_groups:NOT_CALLABLE", "not callable"),
        ("tests.library.test_custom_groups:missing", "cannot import preconditioner"),
        ([1.0, -1.0], "positive"),
        ([], "positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_preconditioner(bad, affine)


def test_config_builds_lie_optimizer_with_named_callable() -> None:
    cfg = resolve(
        {
            "data": {"name": "digits"},
            "model": {"name": "mlp"},
            "schedule": {"epochs": 1},
            "optimizer": {
                "name": "lie",
                "lr": 0.1,
                "group": "rotation_scaling",
                "base": "gaussian",
                "preconditioner": "tests.library.test_custom_groups:halve",
            },
        }
    )
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(cfg["optimizer"], model.parameters(), data_size=100)
    assert isinstance(opt, lgb.LieGroupBLR)
    assert isinstance(opt.lie_group, RotationScalingGroup)
