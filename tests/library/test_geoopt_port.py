"""geoopt's own manifold and optimizer checks, ported to every group.

Ported from geoopt's ``tests/test_manifold_basic.py`` (projection identity, projection via
``assert_check_point_on_manifold``, tangent projection, broadcast projx/proju/retr/transp,
reversibility of ``retr_transp``, logmap), ``test_rsgd.py`` / ``test_adam.py`` (a
``ManifoldParameter`` optimised to a known minimiser) and the definition of the Riemannian
gradient (⟨egrad2rgrad(x, ∇f), u⟩ = d/dt f(retr(x, tu)) at 0).

Batches: geoopt reads leading axes as a batch. For the groups with one element per shape
(additive, unsigned multiplicative) any stack is a batch. The groups whose component axis
comes first refuse a leading batch with a ValueError; coordinatewise ones take a batch
stacked along axis 1, and the results must equal the per-element ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import geoopt
import pytest
import torch
from torch import Tensor

from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    FullAffineGroup,
    LieGroup,
    MultiplicativeGroup,
    RotationScalingGroup,
)

F64 = torch.float64
SHAPE = (2, 4)
GROUPS: dict[str, Callable[[], LieGroup]] = {
    "additive": AdditiveGroup,
    "multiplicative": lambda: MultiplicativeGroup(signed=False),
    "signed": lambda: MultiplicativeGroup(signed=True),
    "affine": DiagonalAffineGroup,
    "full-affine": FullAffineGroup,
    "rotation-scaling": RotationScalingGroup,
}
BATCH_FREE = ("additive", "multiplicative")  # one element per shape: leading axes are a batch


@pytest.fixture(params=[1, 2, 3], ids=lambda s: f"seed{s}")
def seed(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def point(group: LieGroup, seed: int) -> Tensor:
    """A random element: the identity moved by a random algebra vector."""
    return group.exp(tangent(group, seed + 100))


def tangent(group: LieGroup, seed: int, scale: float = 0.5) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(group.algebra_shape(SHAPE), dtype=F64, generator=gen)


def close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ test_manifold_basic
@pytest.mark.parametrize("name", list(GROUPS))
def test_projection_identity(name: str, seed: int) -> None:
    group = GROUPS[name]()
    x = point(group, seed)
    group.assert_check_point_on_manifold(x)
    close(group.projx(x), x)


BREAK: dict[str, Callable[[Tensor], Tensor]] = {
    "multiplicative": lambda x: x.index_fill(0, torch.tensor([0]), 0.0),  # underflowed scale
    "signed": lambda x: torch.where(x > 1, math.inf, x),  # overflowed scale
    "affine": lambda x: torch.cat((torch.zeros_like(x[:1]), x[1:])),
    "full-affine": lambda x: x.index_fill(0, torch.arange(8) * (torch.arange(8) + 3) // 2, 0.0),
    "rotation-scaling": lambda x: torch.cat((torch.zeros_like(x[:, :1]), x[:, 1:]), 1),
}


@pytest.mark.parametrize("name", list(BREAK))
def test_projection_via_assert(name: str, seed: int) -> None:
    """projx repairs what floating point breaks (0 or inf scales) and leaves the rest."""
    group = GROUPS[name]()
    x = point(group, seed)
    broken = BREAK[name](x)
    assert not group.check_point_on_manifold(broken)
    repaired = group.projx(broken)
    group.assert_check_point_on_manifold(repaired)
    intact = torch.isfinite(broken) & (broken != 0)
    assert bool(intact.any())
    close(repaired[intact], broken[intact])  # projx moves only what was broken


@pytest.mark.parametrize("name", list(GROUPS))
def test_vector_projection_via_assert(name: str, seed: int) -> None:
    group = GROUPS[name]()
    x, u = point(group, seed), tangent(group, seed)
    close(group.proju(x, u), u)  # tangent vectors are algebra vectors: nothing to project
    group.assert_check_vector_on_tangent(x, u)
    ok, reason = group.check_vector_on_tangent(x, u.reshape(-1)[:-1], explain=True)
    assert not ok and "shape" in str(reason)


def stack_axis(name: str) -> int:
    return 0 if name in BATCH_FREE else 1


@pytest.mark.parametrize("name", [n for n in GROUPS if n != "full-affine"])
@pytest.mark.parametrize("op", ["projx", "proju", "retr", "transp", "egrad2rgrad"])
def test_broadcast(name: str, op: str, seed: int) -> None:
    """A stack of four elements gives the four per-element results (geoopt's broadcast_*)."""
    group, axis = GROUPS[name](), stack_axis(name)
    xs = [point(group, seed + i) for i in range(4)]
    us = [tangent(group, seed + 10 + i) for i in range(4)]
    vs = [tangent(group, seed + 20 + i) for i in range(4)]
    calls = {
        "projx": lambda x, u, v: group.projx(x),
        "proju": lambda x, u, v: group.proju(x, u),
        "retr": lambda x, u, v: group.retr(x, u),
        "transp": lambda x, u, v: group.transp_follow_retr(x, u, v),
        "egrad2rgrad": lambda x, u, v: group.egrad2rgrad(x, v),
    }
    call = calls[op]
    X, U, V = (torch.stack(t, axis) for t in (xs, us, vs))
    out = call(X, U, V)
    for i, (x, u, v) in enumerate(zip(xs, us, vs, strict=True)):
        close(out.select(axis, i), call(x, u, v))
    if op in ("projx", "retr"):
        group.assert_check_point_on_manifold(out)


@pytest.mark.parametrize("name", ["signed", "affine", "rotation-scaling", "full-affine"])
@pytest.mark.parametrize("op", ["projx", "proju", "retr", "expmap", "transp", "egrad2rgrad"])
def test_leading_batch_is_refused(name: str, op: str) -> None:
    """Issue: a leading stack was read as one element whose components were batch entries."""
    group = GROUPS[name]()
    X = torch.stack([point(group, i) for i in range(3)])
    U = torch.stack([tangent(group, i) for i in range(3)])
    calls = {
        "projx": lambda: group.projx(X),
        "proju": lambda: group.proju(X, U),
        "retr": lambda: group.retr(X, U),
        "expmap": lambda: group.expmap(X, U),
        "transp": lambda: group.transp(X, X, U),
        "egrad2rgrad": lambda: group.egrad2rgrad(X, torch.ones_like(X)),
    }
    advice = "one element at a time" if name == "full-affine" else "along axis 1"
    with pytest.raises(ValueError, match=f"not one .* element.*{advice}"):
        calls[op]()
    assert not group.check_point_on_manifold(X)
    with pytest.raises(ValueError):
        geoopt.ManifoldParameter(X, manifold=group)


@pytest.mark.parametrize("name", list(GROUPS))
def test_reversibility(name: str, seed: int) -> None:
    group = GROUPS[name]()
    assert group.reversible
    x, u = point(group, seed), tangent(group, seed, scale=1 / 3)
    z, q = group.retr_transp(x, u, u)
    x1, u1 = group.retr_transp(z, -q, q)
    torch.testing.assert_close(x1, x, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(u1, u, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(GROUPS))
def test_logmap_is_not_provided(name: str) -> None:
    """The groups give exp but no log (geoopt's test skips on NotImplementedError)."""
    group = GROUPS[name]()
    x = point(group, 0)
    with pytest.raises(NotImplementedError):
        group.logmap(x, group.retr(x, tangent(group, 1)))


# ------------------------------------------------------------------ retraction and gradient
@pytest.mark.parametrize("name", list(GROUPS))
def test_retraction_and_riemannian_gradient(name: str, seed: int) -> None:
    """retr = expmap, retr(x, 0) = x, and ⟨egrad2rgrad(x, ∇f), u⟩ = d/dt f(retr(x, tu))|₀
    for f(x) = Σ w·sin(x) (the defining property of the Riemannian gradient)."""
    group = GROUPS[name]()
    x, u = point(group, seed), tangent(group, seed)
    close(group.retr(x, u), group.expmap(x, u))
    close(group.retr(x, 0 * u), x)
    w = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(seed))

    def f(y: Tensor) -> Tensor:
        return (w * y.sin()).sum()

    egrad = torch.func.grad(f)(x)
    directional = torch.func.jvp(
        lambda t: f(group.retr(x, t * u)),
        (torch.zeros((), dtype=F64),),
        (torch.ones((), dtype=F64),),
    )[1]
    inner = group.inner(x, group.egrad2rgrad(x, egrad), u).sum()
    torch.testing.assert_close(inner, directional, rtol=1e-9, atol=1e-12)
    close(group.inner(x, u), u * u)


# ------------------------------------------------------------------ optimisers (test_rsgd/adam)
def full_affine_kl(group: FullAffineGroup, mu: Tensor, cov: Tensor) -> Callable[[Tensor], Tensor]:
    """KL(N(b, LLᵀ) ‖ N(μ, Σ)) = ½[tr(Σ⁻¹LLᵀ) + (μ − b)ᵀΣ⁻¹(μ − b) − n + log det Σ] − Σ log Lᵢᵢ,
    minimised at L = chol(Σ), b = μ with value 0."""
    precision, logdet = torch.linalg.inv(cov), torch.linalg.slogdet(cov).logabsdet

    def kl(p: Tensor) -> Tensor:
        L, b = group.matrices(p)
        r = mu - b
        trace = (precision * (L @ L.T)).sum()
        return 0.5 * (trace + r @ precision @ r - len(b) + logdet) - L.diagonal().log().sum()

    return kl


def rotation_target(target: Tensor) -> Callable[[Tensor], Tensor]:
    """Σ |log z − log c|² over pairs in log-polar coordinates (minimum 0 at z = c)."""

    def loss(p: Tensor) -> Tensor:
        z, c = torch.complex(p[0], p[1]), torch.complex(target[0], target[1])
        ratio = z / c
        return (ratio.abs().log() ** 2 + ratio.angle() ** 2).sum()

    return loss


PROBLEMS: dict[str, tuple[Callable[[], LieGroup], Callable[[LieGroup], tuple]]] = {
    "full-affine": (
        FullAffineGroup,
        lambda G: (
            G.identity((3,), dtype=F64),
            full_affine_kl(
                G,
                torch.tensor([0.5, -1.0, 2.0], dtype=F64),
                torch.tensor([[2.0, 0.6, 0.0], [0.6, 1.0, -0.3], [0.0, -0.3, 0.5]], dtype=F64),
            ),
        ),
    ),
    "rotation-scaling": (
        RotationScalingGroup,
        lambda G: (
            G.identity((2, 4), dtype=F64),
            rotation_target(
                torch.tensor([[[0.5, -2.0], [3.0, 0.1]], [[0.2, 1.0], [-1.0, -0.3]]], dtype=F64)
            ),
        ),
    ),
}
OPTIMIZERS = {
    "rsgd": lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.2),
    "rsgd-momentum": lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05, momentum=0.9),
    "radam": lambda ps: geoopt.optim.RiemannianAdam(ps, lr=0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_riemannian_optimisers_reach_the_minimiser(name: str, opt_name: str) -> None:
    make_group, make_problem = PROBLEMS[name]
    group = make_group()
    start, loss_fn = make_problem(group)
    p = geoopt.ManifoldParameter(start.clone(), manifold=group)
    opt = OPTIMIZERS[opt_name]([p])
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 600)
    first = float(loss_fn(p.detach()))
    for _ in range(600):
        opt.zero_grad()
        loss_fn(p).backward()
        opt.step()
        schedule.step()
        group.assert_check_point_on_manifold(p.detach())
    assert first > 0.5
    assert float(loss_fn(p.detach())) < 1e-8 * first
