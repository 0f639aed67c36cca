"""Group elements as ``geoopt.ManifoldParameter``s, optimised by geoopt's Riemannian optimizers.

Each problem has a known minimiser:

* affine: KL(N(b, A²) ‖ N(μ, σ²)) = Σ log(σ/A) + (A² + (b − μ)²)/(2σ²) − ½, minimised at
  (A, b) = (σ, μ) with value 0;
* multiplicative: Σ log cosh(log(g/c)), minimised at g = c > 0 with value 0 (a bounded
  Riemannian gradient tanh(log(g/c)), curvature 1 at the optimum in log-coordinates);
* additive: ½‖m − c‖².

The iterates must stay on the manifold (finite, A > 0, g > 0) at every step, including with
learning rates for which the same Euclidean optimizer leaves the positive orthant in one step
(shown in each test by running the torch.optim counterpart on a plain tensor).
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import geoopt
import pytest
import torch
from torch import Tensor

from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    LieGroup,
    MultiplicativeGroup,
)

F64 = torch.float64
MU = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
SIGMA = torch.tensor([1.0, 0.5, 2.0], dtype=F64)


def kl_affine(p: Tensor) -> Tensor:
    A, b = p[0], p[1]
    return (torch.log(SIGMA / A) + (A**2 + (b - MU) ** 2) / (2 * SIGMA**2) - 0.5).sum()


def log_cosh(target: Tensor) -> Callable[[Tensor], Tensor]:
    """Σ log cosh(log(g/target)), evaluated stably (|z| + softplus(−2|z|) − log 2) so that its
    gradient stays finite at the extreme elements a huge step reaches."""

    def loss(g: Tensor) -> Tensor:
        z = torch.log(g / target).abs()
        return (z + torch.nn.functional.softplus(-2 * z) - math.log(2)).sum()

    return loss


def quadratic(target: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda m: 0.5 * ((m - target) ** 2).sum()


def on_manifold(group: LieGroup, p: Tensor) -> bool:
    x = p.detach()
    ok = bool(group.check_point_on_manifold(x)) and bool(torch.isfinite(x).all())
    if isinstance(group, MultiplicativeGroup):
        ok = ok and bool((x > 0).all())
    if isinstance(group, DiagonalAffineGroup):
        ok = ok and bool((x[0] > 0).all())
    return ok


def run(
    group: LieGroup,
    start: Tensor,
    loss_fn: Callable[[Tensor], Tensor],
    make_opt: Callable[[list[Tensor]], torch.optim.Optimizer],
    steps: int,
    schedule: bool = False,
) -> tuple[geoopt.ManifoldParameter, list[float]]:
    p = geoopt.ManifoldParameter(start.clone(), manifold=group)
    opt = make_opt([p])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if schedule else None
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(p)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        assert on_manifold(group, p), f"left the manifold at step {step}: {p.detach()}"
    losses.append(float(loss_fn(p.detach())))
    return p, losses


OPTIMIZERS: dict[str, tuple[Callable[[list[Tensor]], torch.optim.Optimizer], int, bool]] = {
    "sgd": (lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.3), 300, False),
    "sgd-momentum": (
        lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05, momentum=0.9),
        600,
        False,
    ),
    "adam": (lambda ps: geoopt.optim.RiemannianAdam(ps, lr=0.1), 500, True),
}


def test_manifold_parameter_wraps_group_elements() -> None:
    for group, element in [
        (AdditiveGroup(), torch.zeros(3, dtype=F64)),
        (MultiplicativeGroup(signed=True), torch.ones(2, 3, dtype=F64)),
        (DiagonalAffineGroup(), DiagonalAffineGroup().identity((3,), dtype=F64)),
    ]:
        p = geoopt.ManifoldParameter(element, manifold=group)
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert p.manifold is group
        u = torch.full_like(element, 0.5)
        torch.testing.assert_close(p.retr(u).detach(), group.compose(element, group.exp(u)))
    with pytest.raises(ValueError):
        geoopt.ManifoldParameter(torch.ones(3, 4), manifold=DiagonalAffineGroup())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_affine_kl_converges(opt_name: str) -> None:
    make_opt, steps, schedule = OPTIMIZERS[opt_name]
    group = DiagonalAffineGroup()
    start = torch.stack((torch.full((3,), 2.0, dtype=F64), torch.full((3,), -1.5, dtype=F64)))
    p, losses = run(group, start, kl_affine, make_opt, steps, schedule)
    assert losses[0] > 1.0
    assert losses[-1] < 1e-8 * losses[0]
    torch.testing.assert_close(p.detach()[0], SIGMA, rtol=1e-4, atol=0.0)
    torch.testing.assert_close(p.detach()[1], MU, rtol=0.0, atol=1e-4)


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_multiplicative_log_cosh_converges(signed: bool, opt_name: str) -> None:
    make_opt, steps, schedule = OPTIMIZERS[opt_name]
    group = MultiplicativeGroup(signed=signed)
    target = torch.tensor([0.1, 1.0, 7.0], dtype=F64)
    if signed:
        target = torch.stack((target, target.flip(0)))
    start = torch.full_like(target, 0.5)
    p, losses = run(group, start, log_cosh(target), make_opt, steps, schedule)
    assert losses[0] > 1.0
    assert losses[-1] < 1e-8 * losses[0]
    torch.testing.assert_close(p.detach(), target, rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_additive_quadratic_converges(opt_name: str) -> None:
    make_opt, steps, schedule = OPTIMIZERS[opt_name]
    target = torch.tensor([-3.0, 0.25, 4.0], dtype=F64)
    p, losses = run(
        AdditiveGroup(), torch.zeros(3, dtype=F64), quadratic(target), make_opt, steps, schedule
    )
    assert losses[-1] < 1e-8 * losses[0]
    torch.testing.assert_close(p.detach(), target, rtol=0.0, atol=1e-4)


def _euclidean_step(
    start: Tensor,
    loss_fn: Callable[[Tensor], Tensor],
    make_opt: Callable[[list[Tensor]], torch.optim.Optimizer],
) -> Tensor:
    x = start.clone().requires_grad_()
    opt = make_opt([x])
    loss_fn(x).backward()
    opt.step()
    return x.detach()


@pytest.mark.parametrize("signed", [False, True])
def test_multiplicative_large_step_sgd_stays_positive_and_converges(signed: bool) -> None:
    """lr = 1.5: log-coordinate contraction |1 − lr| = 0.5 near the optimum, so Riemannian SGD
    converges, while one Euclidean SGD step from g = 0.5 towards c = 0.1 lands below 0."""
    group = MultiplicativeGroup(signed=signed)
    target = torch.tensor([0.1, 0.05, 0.2], dtype=F64)
    if signed:
        target = torch.stack((target, target.flip(0)))
    start = torch.full_like(target, 0.5)
    loss = log_cosh(target)
    euclid = _euclidean_step(start, loss, lambda ps: torch.optim.SGD(ps, lr=1.5))
    assert bool((euclid < 0).any())
    p, losses = run(group, start, loss, lambda ps: geoopt.optim.RiemannianSGD(ps, lr=1.5), 120)
    assert losses[-1] < 1e-10 * losses[0]
    torch.testing.assert_close(p.detach(), target, rtol=1e-6, atol=0.0)


def test_affine_large_step_adam_stays_positive_and_converges() -> None:
    """Adam's first step moves every coordinate by lr = 2: A = 1.5 → −0.5 for Euclidean Adam,
    A·e^{−2} > 0 for Riemannian Adam (cosine-annealed so that it settles)."""
    group = DiagonalAffineGroup()
    start = torch.stack((torch.full((3,), 1.5, dtype=F64), torch.zeros(3, dtype=F64)))
    euclid = _euclidean_step(start, kl_affine, lambda ps: torch.optim.Adam(ps, lr=2.0))
    assert bool((euclid[0] < 0).any())
    p, losses = run(
        group, start, kl_affine, lambda ps: geoopt.optim.RiemannianAdam(ps, lr=2.0), 600, True
    )
    assert losses[-1] < 1e-8 * losses[0]
    torch.testing.assert_close(p.detach()[0], SIGMA, rtol=1e-4, atol=0.0)
    torch.testing.assert_close(p.detach()[1], MU, rtol=0.0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    "group", [MultiplicativeGroup(signed=True), DiagonalAffineGroup()], ids=["signed", "affine"]
)
def test_huge_steps_stay_on_manifold(group: LieGroup, dtype: torch.dtype) -> None:
    """lr = 1e3 with |Riemannian gradient| ≈ 1: the retraction x·exp(−1e3·…) underflows.

    The retraction is the group's exponential update, so every iterate must remain a valid
    element (positive and finite), as the BLR optimizers guarantee for any step.
    """
    target = torch.tensor([[0.1, 2.0], [3.0, 0.2]], dtype=dtype)
    start = torch.full_like(target, 0.5)
    if isinstance(group, DiagonalAffineGroup):

        def loss(p: Tensor) -> Tensor:
            return log_cosh(target[0])(p[0]) + 0.5 * ((p[1] - target[1]) ** 2).sum()

    else:
        loss = log_cosh(target)
    run(group, start, loss, lambda ps: geoopt.optim.RiemannianSGD(ps, lr=1e3), 4)


def test_importing_the_library_raises_no_warning_where_warnings_are_errors() -> None:
    """geoopt decorates with ``torch.jit.script``, deprecated in torch: ``import liegroup_blr``
    under ``python -W error`` (a strict pytest configuration) must not fail on it."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-W", "error", "-c", "import liegroup_blr"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr.splitlines()[-1:]
