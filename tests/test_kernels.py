"""The rules' kernels against their groups' operations, and the public sample protocol."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import liegroup_blr as lgb
from liegroup_blr.fisher import algebra_gradient
from liegroup_blr.groups import AdditiveGroup, DiagonalAffineGroup, MultiplicativeGroup
from liegroup_blr.optim.additive import (
    additive_accumulate,
    additive_commit,
    additive_draw,
    momentum_propose,
)
from liegroup_blr.optim.affine import (
    affine_accumulate,
    affine_commit,
    affine_commit_,
    affine_draw,
    affine_propose,
)
from liegroup_blr.optim.multiplicative import (
    multiplicative_accumulate,
    multiplicative_commit,
    multiplicative_commit_,
    multiplicative_draw,
    multiplicative_propose,
)

from .test_optim import DTYPE, closure_for, make_problem, snapshot

SHAPE = (4, 3)
ROOT = Path(__file__).resolve().parents[1]


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=DTYPE)


def test_additive_kernels_follow_the_group():
    G, gen = AdditiveGroup(), torch.Generator().manual_seed(0)
    m, xi, grad, mom = (_randn(*SHAPE, gen=gen) for _ in range(4))
    p = torch.empty(SHAPE, dtype=DTYPE)
    additive_draw([m], [xi], [p])
    torch.testing.assert_close(p, G.readout(G.act(m, xi)))
    acc = torch.empty(SHAPE, dtype=DTYPE)
    additive_accumulate([acc], [grad], True)
    additive_accumulate([acc], [2 * grad], False)
    X = algebra_gradient(G, m, xi, grad) + algebra_gradient(G, m, xi, 2 * grad)
    momentum_propose([acc], [mom], 2, 0.7)
    new_mom = torch.lerp(X / 2, mom, 0.7)
    torch.testing.assert_close(acc, new_mom)
    moved = m.clone()
    additive_commit([moved], [acc], [p], 0.3, None)
    torch.testing.assert_close(moved, G.step(m, -0.3 * new_mom))
    torch.testing.assert_close(p, G.point_estimate(moved))


@pytest.mark.parametrize("n", [1, 3])
def test_multiplicative_kernels_follow_the_group(n):
    G, gen = MultiplicativeGroup(signed=True), torch.Generator().manual_seed(1)
    g = _randn(2, *SHAPE, gen=gen).abs() + 0.1
    mom = 0.1 * _randn(2, *SHAPE, gen=gen)
    xis = [_randn(2, *SHAPE, gen=gen).abs() for _ in range(n)]
    grads = [_randn(*SHAPE, gen=gen) for _ in range(n)]
    acc, p = torch.empty_like(g), torch.empty(SHAPE, dtype=DTYPE)
    X = torch.zeros_like(g)
    for s, (xi, grad) in enumerate(zip(xis, grads, strict=True)):
        w = torch.empty_like(xi)
        multiplicative_draw([g], [xi], [w], [p], True)
        torch.testing.assert_close(p, G.readout(G.act(g, xi)))
        multiplicative_accumulate([acc], [w], [grad], s == 0)
        X += algebra_gradient(G, g, xi, grad)
    beta, shift, lr = 0.8, 0.05, 0.4
    multiplicative_propose([acc], [mom], n, beta, shift)
    new_mom = torch.lerp(X / n - shift, mom, beta)  # X̂ = algebra gradient − (τ/N)∇log|det|
    torch.testing.assert_close(acc, new_mom)
    for functional in (True, False):  # compiled steps run the first, eager ones the second
        moved = g.clone()
        if functional:
            multiplicative_commit([moved], [acc], [p], lr, True, None)
        else:
            multiplicative_commit_([moved], [acc], [torch.empty_like(g)], [p], lr, True, None)
        torch.testing.assert_close(moved, G.step(g, -lr * new_mom))
        torch.testing.assert_close(p, G.point_estimate(moved))


@pytest.mark.parametrize("zero_scale_momentum", [False, True])
def test_affine_kernels_follow_the_group(zero_scale_momentum):
    """With α₁ = α₂ the commit is g·exp(−αM); M_U = 0 takes the limit φ(0) = 1."""
    G, gen = DiagonalAffineGroup(), torch.Generator().manual_seed(2)
    g = torch.stack((_randn(*SHAPE, gen=gen).abs() + 0.2, _randn(*SHAPE, gen=gen)))
    mom = 0.1 * _randn(2, *SHAPE, gen=gen)
    xi, grad = _randn(*SHAPE, gen=gen), _randn(*SHAPE, gen=gen)
    p, noise = torch.empty(SHAPE, dtype=DTYPE), torch.empty_like(xi)
    affine_draw([g], [xi], [noise], [p])
    torch.testing.assert_close(p, G.readout(G.act(g, xi)))
    acc = torch.empty_like(g)
    affine_accumulate([acc], [noise], [grad], [g], True)
    X = algebra_gradient(G, g, xi, grad)
    torch.testing.assert_close(acc, X)
    affine_propose([acc], [mom], 1, (0.9, 0.6), 0.02)
    betas = torch.tensor([0.9, 0.6], dtype=DTYPE).view(2, 1, 1)
    new_mom = torch.lerp(X - torch.tensor([0.02, 0.0], dtype=DTYPE).view(2, 1, 1), mom, betas)
    torch.testing.assert_close(acc, new_mom)
    if zero_scale_momentum:
        acc[0] = 0.0
    for functional in (True, False):
        moved = g.clone()
        if functional:
            affine_commit([moved], [acc], [p], 0.3, 0.3, None)
        else:
            affine_commit_([moved], [acc], [torch.empty_like(g)], [p], 0.3, 0.3, None)
        torch.testing.assert_close(moved, G.step(g, -0.3 * acc), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(p, moved[1])


@pytest.mark.parametrize("functional", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_affine_commit_with_two_step_sizes_is_the_documented_update(functional, dtype):
    """b ← b + A M_V (e^{−α₁M_U} − 1)/M_U and A ← A e^{−α₂M_U} (DESIGN, affine group), in
    the functional form (compiled steps) and the in-place form (eager steps) alike."""
    gen = torch.Generator().manual_seed(3)
    A, b = _randn(*SHAPE, gen=gen).abs() + 0.2, _randn(*SHAPE, gen=gen)
    mom = 0.3 * _randn(2, *SHAPE, gen=gen)
    mom[0, 0] = torch.tensor([1e-7, -1e-9, 0.0])  # near and at the limit φ(0) = 1
    g, p = torch.stack((A, b)).to(dtype), torch.empty(SHAPE, dtype=dtype)
    a1, a2 = 0.7, 0.05
    if functional:
        affine_commit([g], [mom.to(dtype)], [p], a1, a2, None)
    else:
        affine_commit_([g], [mom.to(dtype)], [torch.empty_like(g)], [p], a1, a2, None)
    u, v = mom
    phi = torch.where(u == 0, 1.0, torch.expm1(-a1 * u) / (-a1 * u))
    torch.testing.assert_close(g[1], (b - a1 * A * v * phi).to(dtype))
    torch.testing.assert_close(g[0], (A * torch.exp(-a2 * u)).to(dtype))
    torch.testing.assert_close(p, g[1])


def test_no_private_optimizer_access_outside_the_optimizer_package():
    """mc.py, the drivers and the benchmarks use the documented sample protocol only."""
    files = [ROOT / "liegroup_blr" / "mc.py", *(ROOT / "experiments").rglob("*.py")]
    allowed_roots = {"self", "cls", "torch"}
    offences = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                if node.attr.endswith("__"):
                    continue
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if getattr(root, "id", None) not in allowed_roots:
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not offences


@pytest.mark.parametrize("kind", ["additive", "multiplicative", "affine"])
def test_sample_protocol_with_explicit_gradients_equals_the_closure_step(kind):
    """draw → accumulate(sample.clone(), grads) after further draws equals step(closure)."""
    make = {
        "additive": lambda ps: lgb.AdditiveBLR(ps, lr=0.1, mc_samples=3, seed=4),
        "multiplicative": lambda ps: lgb.MultiplicativeBLR(
            ps, lr=0.3, mc_samples=3, data_size=32, temperature=0.5, seed=4
        ),
        "affine": lambda ps: lgb.AffineBLR(
            ps, lr=0.1, scale_lr=0.02, mc_samples=3, data_size=32, prior_precision=1.0, seed=4
        ),
    }[kind]
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    ref, opt = make(model.parameters()), make(twin.parameters())
    ref.step(closure_for(ref, model, x, y))
    samples = [opt.draw(train=True).clone() for _ in range(3)]  # all drawn first
    for sample in samples:
        with torch.enable_grad():
            theta = [t.clone().requires_grad_() for t in sample.theta]
            model_copy = copy.deepcopy(twin)
            for p, t in zip(model_copy.parameters(), theta, strict=True):
                p.data = t
            loss = nn.functional.cross_entropy(model_copy(x), y)
            grads = torch.autograd.grad(loss, list(model_copy.parameters()))
        opt.accumulate(sample, list(grads))
    assert opt.pending_samples == 3
    opt.step()
    for (p, s), (q, t) in zip(
        zip(*snapshot(ref, model), strict=True), zip(*snapshot(opt, twin), strict=True), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
        for key in s:
            torch.testing.assert_close(s[key], t[key], rtol=1e-12, atol=1e-14)
