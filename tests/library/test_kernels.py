"""The rules' kernels against their groups' operations, and the public sample protocol."""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import liegroup_blr as lgb
from liegroup_blr.fisher import algebra_gradient
from liegroup_blr.groups import AdditiveGroup, DiagonalAffineGroup, MultiplicativeGroup
from liegroup_blr.groups.affine import exprel
from liegroup_blr.optim.additive import (
    additive_accumulate,
    additive_draw,
    additive_momentum_,
    additive_move_,
    additive_readout_,
    additive_update,
)
from liegroup_blr.optim.affine import (
    affine_accumulate,
    affine_draw,
    affine_momentum_,
    affine_move,
    affine_move_,
    affine_readout_,
    affine_update,
)
from liegroup_blr.optim.engine import all_finite
from liegroup_blr.optim.kernel_utils import rows as parts
from liegroup_blr.optim.multiplicative import (
    multiplicative_accumulate,
    multiplicative_draw,
    multiplicative_momentum_,
    multiplicative_move_,
    multiplicative_readout_,
    multiplicative_update,
)
from tests.shared import DTYPE, FACTORIES, closure_for, make_problem, snapshot

SHAPE = (4, 3)
ROOT = Path(__file__).resolve().parents[2]


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=DTYPE)


def test_additive_kernels_follow_the_group():
    G, gen = AdditiveGroup(), torch.Generator().manual_seed(0)
    m, xi, grad, mom = (_randn(*SHAPE, gen=gen) for _ in range(4))
    p = torch.empty(SHAPE, dtype=DTYPE)
    additive_draw([m], [xi], [p])
    torch.testing.assert_close(p, G.readout(G.act(m, xi)))
    acc = torch.empty(SHAPE, dtype=DTYPE)
    additive_accumulate([acc], [grad], first=True)
    additive_accumulate([acc], [2 * grad], first=False)
    X = algebra_gradient(G, m, xi, grad) + algebra_gradient(G, m, xi, 2 * grad)
    additive_momentum_([acc], [mom], n=2, beta=0.7)
    new_mom = torch.lerp(X / 2, mom, 0.7)
    torch.testing.assert_close(acc, new_mom)
    deferred = torch.empty_like(acc)  # one sample, accumulated by the proposal itself
    additive_momentum_([deferred], [mom], n=1, beta=0.7, grads=[grad])
    torch.testing.assert_close(deferred, torch.lerp(algebra_gradient(G, m, xi, grad), mom, 0.7))
    moved = m.clone()
    additive_move_([moved], [acc], lr=0.3)
    additive_readout_([p], [moved], mean=None)
    torch.testing.assert_close(moved, G.step(m, -0.3 * new_mom))
    torch.testing.assert_close(p, G.point_estimate(moved))


@pytest.mark.parametrize("n", [1, 3])
def test_multiplicative_kernels_follow_the_group(n):
    G, gen = MultiplicativeGroup(signed=True), torch.Generator().manual_seed(1)
    g = _randn(2, *SHAPE, gen=gen).abs() + 0.1
    mom = 0.1 * _randn(2, *SHAPE, gen=gen)
    xis = [_randn(2, *SHAPE, gen=gen).abs() for _ in range(n)]
    grads = [_randn(*SHAPE, gen=gen) for _ in range(n)]
    acc, p, q = (
        torch.empty_like(g),
        torch.empty(SHAPE, dtype=DTYPE),
        torch.empty(SHAPE, dtype=DTYPE),
    )
    X = torch.zeros_like(g)
    for s, (xi, grad) in enumerate(zip(xis, grads, strict=True)):
        w = torch.empty_like(xi)
        multiplicative_draw([g], [xi], [p], [w], signed=True)  # keeps the products w = g ⊙ ξ
        torch.testing.assert_close(p, G.readout(G.act(g, xi)))
        torch.testing.assert_close(w, g * xi)
        buf = xi.clone()  # fresh noise: the products overwrite ξ in its own buffer
        multiplicative_draw([g], [buf], [q], [buf], signed=True)
        torch.testing.assert_close(q, p)
        torch.testing.assert_close(buf, w)
        multiplicative_accumulate([acc], [w], [grad], first=s == 0, signed=True)
        X += algebra_gradient(G, g, xi, grad)
    beta, shift, lr = 0.8, 0.05, 0.4
    multiplicative_momentum_([acc], [mom], n=n, beta=beta, offset=-shift, signed=True)
    new_mom = torch.lerp(X / n - shift, mom, beta)  # X̂ = algebra gradient − (τ/N)∇log|det|
    torch.testing.assert_close(acc, new_mom)
    if n == 1:  # the sample accumulated by the proposal itself
        deferred = torch.empty_like(g)
        multiplicative_momentum_(
            [deferred], [mom], n=n, beta=beta, offset=-shift, signed=True, sample=([w], [grads[0]])
        )
        torch.testing.assert_close(deferred, new_mom)
    moved = g.clone()
    multiplicative_move_([moved], [acc], [torch.empty_like(g)], lr=lr)
    multiplicative_readout_([p], [moved], mean=None, signed=True)
    torch.testing.assert_close(moved, G.step(g, -lr * new_mom))
    torch.testing.assert_close(p, G.point_estimate(moved))


@pytest.mark.parametrize("in_place", [True, False])
def test_multiplicative_draw_rounds_a_half_precision_theta_once(in_place):
    """θ = g⁺ξ⁺ − g⁻ξ⁻ into bfloat16 parameters (float32 state) is the difference rounded
    once: near-cancelling parts rounded first would lose θ."""
    gen = torch.Generator().manual_seed(6)
    g = torch.rand(2, 64, generator=gen) + 1.0
    xi = torch.rand(2, 64, generator=gen) + 0.5
    xi[1] = (g[0] * xi[0] - 1e-3 * (0.5 + torch.rand(64, generator=gen))) / g[1]  # θ ≈ 1e-3
    p = torch.empty(64, dtype=torch.bfloat16)
    theta = g[0].double() * xi[0] - g[1].double() * xi[1]
    noise = xi if in_place else torch.empty_like(g)
    multiplicative_draw([g], [xi], [p], [noise], signed=True)
    torch.testing.assert_close(p.double(), theta, rtol=2**-8, atol=0)  # bf16: 8 bits


@pytest.mark.parametrize("zero_scale_momentum", [False, True])
def test_affine_kernels_follow_the_group(zero_scale_momentum):
    """With α₁ = α₂ the commit is g·exp(−αM), in the in-place form (eager steps) and the
    functional one (compiled steps); M_U = 0 takes the limit φ(0) = 1."""
    G, gen = DiagonalAffineGroup(), torch.Generator().manual_seed(2)
    g = torch.stack((_randn(*SHAPE, gen=gen).abs() + 0.2, _randn(*SHAPE, gen=gen)))
    mom = 0.1 * _randn(2, *SHAPE, gen=gen)
    xis, grads = ([_randn(*SHAPE, gen=gen) for _ in range(2)] for _ in range(2))
    p, acc = torch.empty(SHAPE, dtype=DTYPE), torch.empty_like(g)
    for s, (xi, grad) in enumerate(zip(xis, grads, strict=True)):
        affine_draw([g], [xi], [p])
        torch.testing.assert_close(p, G.readout(G.act(g, xi)))
        affine_accumulate([acc], [xi], [grad], first=s == 0)
    X = [algebra_gradient(G, g, xi, grad) for xi, grad in zip(xis, grads, strict=True)]
    betas = torch.tensor([0.9, 0.6], dtype=DTYPE).view(2, 1, 1)
    shift = torch.tensor([0.02, 0.0], dtype=DTYPE).view(2, 1, 1)  # (τ/N)∇log|det| = (τ/N, 0)
    affine_momentum_([acc], [mom], [g], n=2, betas=(0.9, 0.6), offset=-0.02)
    torch.testing.assert_close(acc, torch.lerp((X[0] + X[1]) / 2 - shift, mom, betas))
    deferred = torch.empty_like(g)  # one sample, accumulated by the proposal itself
    sample = ([xis[0]], [grads[0]])
    affine_momentum_([deferred], [mom], [g], n=1, betas=(0.9, 0.6), offset=-0.02, sample=sample)
    new_mom = torch.lerp(X[0] - shift, mom, betas)
    torch.testing.assert_close(deferred, new_mom)
    acc = new_mom
    if zero_scale_momentum:
        acc[0] = 0.0
    moved = g.clone()
    affine_move_([moved], [acc], [torch.empty_like(g)], lr=0.3, scale_lr=0.3)
    affine_readout_([p], [moved], mean=None)
    torch.testing.assert_close(moved, G.step(g, -0.3 * acc), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(p, moved[1])
    functional = torch.stack(affine_move(parts([g])[0], *acc, 0.3, 0.3))
    torch.testing.assert_close(functional, G.step(g, -0.3 * acc), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("functional", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_affine_commit_with_two_step_sizes_is_the_documented_update(functional, dtype):
    """b ← b + A M_V (e^{−α₁M_U} − 1)/M_U and A ← A e^{−α₂M_U} (docs/concepts.md, the
    diagonal affine group), in the functional form (compiled steps) and the in-place form
    (eager steps) alike, at and near the limit φ(0) = 1."""
    gen = torch.Generator().manual_seed(3)
    A, b = _randn(*SHAPE, gen=gen).abs() + 0.2, _randn(*SHAPE, gen=gen)
    mom = 0.3 * _randn(2, *SHAPE, gen=gen)
    mom[0, 0] = torch.tensor([1e-7, -1e-9, 0.0])  # near and at the limit φ(0) = 1
    g, p = torch.stack((A, b)).to(dtype), torch.empty(SHAPE, dtype=dtype)
    a1, a2 = 0.7, 0.05
    if functional:
        g = torch.stack(affine_move(parts([g])[0], *mom.to(dtype), a1, a2))
    else:
        affine_move_([g], [mom.to(dtype)], [torch.empty_like(g)], lr=a1, scale_lr=a2)
        affine_readout_([p], [g], mean=None)
        torch.testing.assert_close(p, g[1])
    u, v = mom
    phi = torch.where(u == 0, 1.0, torch.expm1(-a1 * u) / (-a1 * u))
    torch.testing.assert_close(g[1], (b - a1 * A * v * phi).to(dtype))
    torch.testing.assert_close(g[0], (A * torch.exp(-a2 * u)).to(dtype))


def _update_inputs(kind, n, gen):
    """Element, momentum, accumulator (n samples) and a deferred sample of one parameter:
    (its noise as the rule keeps it, its gradient)."""
    stacked = kind != "additive"
    lead = (2,) if stacked else ()
    g = _randn(*lead, *SHAPE, gen=gen).abs() + 0.2
    if kind == "affine":
        g[1] = _randn(*SHAPE, gen=gen)
    mom, acc = 0.1 * _randn(*lead, *SHAPE, gen=gen), n * _randn(*lead, *SHAPE, gen=gen)
    noise, grad = _randn(*SHAPE, gen=gen), _randn(*SHAPE, gen=gen)
    if kind == "multiplicative":
        noise = g * _randn(2, *SHAPE, gen=gen).abs()  # the products w = g ⊙ ξ
    return g, mom, acc, noise, grad


def _eager_update(kind, g, mom, acc, p, sample, hp):
    """The eager kernels of a step: the new momentum into ``acc``, then the move of ``g``
    and the readout into ``p``, all in place."""
    if kind == "additive":
        grads = None if sample is None else sample[1]
        additive_momentum_([acc], [mom], n=hp["n"], beta=hp["beta"], grads=grads)
        additive_move_([g], [acc], lr=hp["lr"])
        additive_readout_([p], [g], mean=hp["mean"])
    elif kind == "multiplicative":
        multiplicative_momentum_(
            [acc],
            [mom],
            n=hp["n"],
            beta=hp["beta"],
            offset=-hp["shift"],
            signed=True,
            sample=sample,
        )
        multiplicative_move_([g], [acc], [torch.empty_like(g)], lr=hp["lr"])
        multiplicative_readout_([p], [g], mean=hp["mean"], signed=True)
    else:
        betas = (0.9, hp["beta"])
        affine_momentum_(
            [acc], [mom], [g], n=hp["n"], betas=betas, offset=-hp["shift"], sample=sample
        )
        affine_move_(
            [g], [acc], [torch.empty_like(g)], lr=hp["lr"], scale_lr=hp["scale_lr"],
            growth=hp["growth"],
        )  # fmt: skip
        affine_readout_([p], [g], mean=hp["mean"])


def _functional_update(kind, g, mom, acc, spare, p, sample, hp):
    """The formulas a compiled step runs (here uncompiled); returns the momenta's sums."""
    common = dict(n=hp["n"], lr=torch.tensor(hp["lr"], dtype=DTYPE), mean=hp["mean"])
    if kind == "additive":
        grads = None if sample is None else sample[1]
        return additive_update(
            [acc], [mom], [g], [spare], [p], grads, None, [], beta=hp["beta"], **common
        )
    tensors = (parts([t]) for t in (acc, mom, g, spare))
    if kind == "multiplicative":
        rows = None if sample is None else (parts(sample[0]), sample[1])
        return multiplicative_update(
            *tensors, [p], rows, -hp["shift"], [], beta=hp["beta"], **common
        )
    return affine_update(
        *tensors,
        [p],
        sample,
        -hp["shift"],
        [],
        betas=(0.9, hp["beta"]),
        scale_lr=torch.tensor(hp["scale_lr"], dtype=DTYPE),
        growth=torch.tensor(hp["growth"], dtype=DTYPE),
        **common,
    )


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["additive", "multiplicative", "affine"])
@pytest.mark.parametrize("n, deferred", [(1, False), (3, False), (1, True)])
@pytest.mark.parametrize("mean", [None, 1.3])
@pytest.mark.parametrize("growth", [math.inf, 2e-3], ids=["unbounded", "bounded"])
def test_compiled_form_update_equals_propose_then_commit(kind, n, deferred, mean, growth):
    """``*_update`` (what compile=True runs, here uncompiled) writes the momentum, the moved
    element (into a spare, the element left as it was) and θ as the eager kernels do in
    place, and returns the momentum's sums; the affine scale's growth bound (``scale_step``)
    as the eager move applies it, where it binds and where it does not."""
    g, mom, acc, noise, grad = _update_inputs(kind, n, torch.Generator().manual_seed(5))
    hp = dict(n=n, lr=0.3, scale_lr=0.05, beta=0.8, shift=0.02, mean=mean, growth=growth)
    sample = ([noise], [grad]) if deferred else None
    eager_acc, eager_g, eager_p = acc.clone(), g.clone(), torch.empty(SHAPE, dtype=DTYPE)
    _eager_update(kind, eager_g, mom, eager_acc, eager_p, sample, hp)
    before, spare, p = g.clone(), torch.empty_like(g), torch.empty(SHAPE, dtype=DTYPE)
    (total,) = _functional_update(kind, g, mom, acc, spare, p, sample, hp)
    torch.testing.assert_close(acc, eager_acc)
    torch.testing.assert_close(spare, eager_g)
    torch.testing.assert_close(p, eager_p)
    torch.testing.assert_close(total, acc.sum())
    assert torch.equal(g, before)
    if kind == "affine" and growth < math.inf:  # the bound binds for some entries, not all
        exponent = -hp["scale_lr"] * acc[0]
        assert (exponent > growth).any() and (exponent < growth).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_affine_phi_in_place_is_the_twin_of_the_group_exprel(dtype):
    """The eager move computes φ(x) = expm1(x)/x in place; the compiled one uses the group's
    exprel (a Taylor series near 0). Both agree at 0, near 0, far from it and where eˣ
    overflows (φ clamped to the dtype's max)."""
    info = torch.finfo(dtype)
    x = torch.tensor([0.0, -0.0, 1e-12, -1e-9, 1e-5, -3e-4, 0.5, -2.0, 30.0, -200.0], dtype=dtype)
    u = torch.cat((x, torch.tensor([2 * math.log(info.max)], dtype=dtype)))
    lr = 1.0
    A, b = torch.ones_like(u), torch.zeros_like(u)
    g, mom = torch.stack((A, b)), torch.stack((-u / lr, torch.ones_like(u)))  # x = −α₁ M_U = u
    affine_move_([g], [mom], [torch.empty_like(g)], lr=lr, scale_lr=1e-30)
    in_place = -g[1] / lr  # b − α₁ A M_V φ = −φ
    functional = -affine_move(parts([torch.stack((A, b))])[0], mom[0], mom[1], lr, 1e-30)[1] / lr
    assert torch.isfinite(in_place).all() and in_place[-1] == info.max
    torch.testing.assert_close(in_place, functional, rtol=4 * info.eps, atol=0)
    torch.testing.assert_close(in_place[:-1], exprel(u[:-1]), rtol=4 * info.eps, atol=0)


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
            ps, lr=0.3, mc_samples=3, data_size=32, temperature=0.5, seed=4, init="auto"
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


def _sampled_backward(opt, model, x, y):
    sample = opt.draw(train=True)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return sample


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize("samples", [1, 2])
def test_deferred_accumulation_equals_immediate(kind, samples):
    """accumulate(..., defer=True) holds the gradients (``p.grad`` may be set to None before
    the step) and reads them at the next draw or in the update: the same steps as
    accumulating at once."""
    runs = []
    for defer in (False, True):
        model, x, y = make_problem()
        opt = FACTORIES[kind](model.parameters(), seed=3, temperature=0.5)
        for _ in range(3):
            for _ in range(samples):
                opt.accumulate(_sampled_backward(opt, model, x, y), defer=defer)
            opt.zero_grad(set_to_none=True)
            opt.step()
        runs.append(snapshot(opt, model))
    (params, states), (deferred_params, deferred_states) = runs
    torch.testing.assert_close(deferred_params, params, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(deferred_states, states, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["additive", "multiplicative"])
def test_gradient_changed_after_a_deferred_accumulate_raises_and_keeps_state(kind):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0)
    opt.step(closure_for(opt, model, x, y))
    before = snapshot(opt, model)
    opt.accumulate(_sampled_backward(opt, model, x, y), defer=True)
    next(model.parameters()).grad.mul_(2.0)  # e.g. clipping after the sample was accumulated
    with pytest.raises(RuntimeError, match="changed in place"):
        opt.step()
    assert opt.pending_samples == 0
    after = snapshot(opt, model)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_all_finite_is_exact_when_a_sum_overflows():
    big = torch.full((4,), 3e38)  # finite float32 values whose sum is inf
    assert torch.isinf(big.sum())
    assert all_finite([big])
    assert all_finite([big], [big.sum()])
    assert not all_finite([big, torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("-inf")])], [torch.tensor(float("-inf"))])


@pytest.mark.parametrize("kind", ["multiplicative", "affine"])
def test_parameter_frozen_between_a_deferred_accumulate_and_the_step(kind):
    """The deferred sample no longer matches the parameters the step updates: it is
    accumulated instead, and the step equals the one with immediate accumulation."""
    runs = []
    for defer in (False, True):
        model, x, y = make_problem()
        opt = FACTORIES[kind](model.parameters(), seed=5, temperature=0.5)
        opt.accumulate(_sampled_backward(opt, model, x, y), defer=defer)
        model[0].bias.requires_grad_(False)
        opt.step()
        runs.append(snapshot(opt, model))
    (params, states), (deferred_params, deferred_states) = runs
    torch.testing.assert_close(deferred_params, params, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(deferred_states, states, rtol=1e-12, atol=1e-14)
