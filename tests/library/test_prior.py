"""A posterior as the next task's prior: the tempered sequential objective's known answers,
a task without data returning to the prior, refusals, resume and compiled steps."""

from __future__ import annotations

import copy
import io
from functools import partial

import pytest
import torch
from torch import nn
from torch.distributions import Normal, StudentT

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac
from liegroup_blr.fisher import entropy_gradient
from liegroup_blr.groups import DiagonalAffineGroup
from liegroup_blr.kl import kl_gradient
from liegroup_blr.optim.prior import Prior
from tests.shared import closure_for, make_problem, snapshot

D = torch.float64
A1, C1 = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=D), torch.tensor([0.3, -1.0, 2.0, 0.0], dtype=D)
A2, C2 = torch.tensor([2.0, 0.5, 1.5, 1.0], dtype=D), torch.tensor([1.0, 0.5, -0.5, 2.0], dtype=D)
N1, N2, TAU, DELTA, SIGMA = 50.0, 80.0, 0.5, 3.0, 0.1


def _entropy(G, g):
    """∇_X log|det J_{g exp X}| at 0: the same for every g, so the identity's."""
    return entropy_gradient(G, G.identity(G.param_shape(g.shape), dtype=g.dtype))


def _train(opt, theta, a, c, steps=500):
    """Steps on the separable quadratic ½ Σ_j a_j (θ_j − c_j)² (an orthogonal design),
    with a step size decaying as 1/(1 + k/20) to average the Monte-Carlo noise out."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k / 20))

    def closure():
        opt.zero_grad()
        loss = 0.5 * (a * (theta - c) ** 2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
        sched.step()


def _quadratic_task_optimizer(seed: int) -> tuple[nn.Parameter, lgb.AffineBLR]:
    """Four weights at 0 and the affine rule that learns them on the quadratic tasks: task 1's
    N₁, τ and δ, a Gaussian base, 16 antithetic samples per step."""
    theta = nn.Parameter(torch.zeros(4, dtype=D))
    opt = lgb.AffineBLR(
        [theta],
        lr=0.3,
        scale_lr=20.0,
        momentum=0.0,
        scale_momentum=0.0,
        base=Normal(0.0, SIGMA),
        data_size=N1,
        temperature=TAU,
        prior_precision=DELTA,
        mc_samples=16,
        antithetic=True,
        seed=seed,
    )
    return theta, opt


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_two_tasks_in_sequence_reach_the_tempered_posterior_of_both(seed):
    """Task 1 with the N(0, 1/δ) prior, task 2 with task 1's posterior as prior (affine rule,
    Gaussian base, τ ≠ 1, δ > 0): the result is the closed-form posterior of both tasks,
    q ∝ exp(−(N₁ℓ̄₁ + N₂ℓ̄₂ + δ‖θ‖²/2)/τ). Per coordinate its precision is
    (N₁a₁ + N₂a₂ + δ)/τ and its mean (N₁a₁c₁ + N₂a₂c₂)/(N₁a₁ + N₂a₂ + δ).

    Antithetic pairs make the mean's algebra gradient exact on a quadratic; the scale's
    keeps Monte-Carlo noise (a(Aξ)², 16 samples), so the learnt standard deviations are within
    a few percent (measured ≤ 4.4 % over 5 seeds), and task 2's mean inherits task 1's scale
    error through the prior (measured ≤ 0.34 posterior sd). Task 2's mean given the prior it
    was handed is exact."""
    theta, opt = _quadratic_task_optimizer(seed)
    _train(opt, theta, A1, C1)
    first = opt.group_element(theta)
    var1 = TAU / (N1 * A1 + DELTA)
    torch.testing.assert_close(first["b"], N1 * A1 * C1 / (N1 * A1 + DELTA), rtol=0, atol=1e-7)
    torch.testing.assert_close(first["A"] * SIGMA, var1.sqrt(), rtol=0.08, atol=0)

    prior = opt.next_task(data_size=N2)
    assert opt.param_groups[0]["prior_precision"] == 0 and opt.param_groups[0]["data_size"] == N2
    _train(opt, theta, A2, C2)
    second = opt.group_element(theta)
    h = prior[0].element  # the Bayes update of the prior it was handed, exactly
    prior_precision = 1 / (h[0] * SIGMA) ** 2
    given = (prior_precision * h[1] + N2 * A2 * C2 / TAU) / (prior_precision + N2 * A2 / TAU)
    torch.testing.assert_close(second["b"], given, rtol=0, atol=1e-5)  # 2e-4 posterior sd

    precision = (N1 * A1 + N2 * A2 + DELTA) / TAU  # both tasks at once
    mean = (N1 * A1 * C1 + N2 * A2 * C2) / (N1 * A1 + N2 * A2 + DELTA)
    assert float(((second["b"] - mean) * precision.sqrt()).abs().max()) < 0.6
    torch.testing.assert_close(second["A"] * SIGMA, precision.rsqrt(), rtol=0.06, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("strength", [0.5, 3.0])
def test_a_prior_of_strength_w_gives_the_posterior_of_the_tempered_prior(strength):
    """As above, task 2 with ``next_task(strength=w)``: the prior is task 1's posterior
    N(m₁, P₁⁻¹) tempered to N(m₁, (wP₁)⁻¹), and task 2 ends at the Bayes update of that prior,
    per coordinate precision wP₁ + N₂a₂/τ and mean (wP₁m₁ + N₂a₂c₂/τ)/(wP₁ + N₂a₂/τ). The
    mean is exact (antithetic pairs); the scale within its Monte-Carlo noise (≤ 4.4 % above).
    Weighting the whole KL by w (the entropy too) would give the precision N₂a₂/(wτ) + P₁."""
    theta, opt = _quadratic_task_optimizer(0)
    _train(opt, theta, A1, C1)
    prior = opt.next_task(data_size=N2, strength=strength)
    assert opt.state_dict()["prior_strength"] == strength
    _train(opt, theta, A2, C2)
    second = opt.group_element(theta)
    h = prior[0].element
    tempered = strength / (h[0] * SIGMA) ** 2  # wP₁
    precision = tempered + N2 * A2 / TAU
    torch.testing.assert_close(
        second["b"], (tempered * h[1] + N2 * A2 * C2 / TAU) / precision, rtol=0, atol=1e-5
    )
    torch.testing.assert_close(second["A"] * SIGMA, precision.rsqrt(), rtol=0.08, atol=0)


@pytest.mark.parametrize("strength", [0.5, 3.0])
def test_a_prior_of_strength_w_weights_the_cross_entropy_alone(strength):
    """Prior.gradients at strength w is (τ/N)∇KL(q ‖ q_h^w/Z), exactly: for the affine group
    with a Gaussian base the KL to N(b_h, (A_hσ)²/w) (the tempered Gaussian); for the
    multiplicative group with a Rayleigh base, whose tempered prior is no Rayleigh, zero at
    g = h·√((1 + w)/(2w)) per part (2w r² − (1 + w) = 0), h itself only at w = 1."""
    gen = torch.Generator().manual_seed(0)
    theta = nn.Parameter(torch.zeros(3, dtype=D))
    base = Normal(0.0, 0.2)
    opt = lgb.AffineBLR([theta], lr=0.1, scale_lr=0.1, base=base, data_size=10)
    G = opt.lie_group
    g = torch.stack((torch.rand(3, generator=gen, dtype=D) + 0.5, torch.randn(3, dtype=D)))
    h = torch.stack((torch.rand(3, generator=gen, dtype=D) + 0.5, torch.randn(3, dtype=D)))
    generator = opt.noise_source.generator
    prior = Prior({theta: h}, 1, strength=strength)
    got = prior.gradients(G, base, [theta], [g], 0.25, partial(_entropy, G), generator)
    tempered = torch.stack((h[0] / strength**0.5, h[1]))
    torch.testing.assert_close(got[0], 0.25 * kl_gradient(G, base, g, tempered))

    opt = lgb.MultiplicativeBLR([theta], lr=0.1, data_size=10, init="auto")
    G, base = opt.lie_group, opt.param_groups[0]["base"]
    h = torch.rand(2, 3, generator=gen, dtype=D) + 0.5
    at = h * ((1 + strength) / (2 * strength)) ** 0.5
    prior = Prior({theta: h}, 1, strength=strength)
    entropy = partial(_entropy, G)
    got = prior.gradients(G, base, [theta], [at], 0.25, entropy, generator)
    torch.testing.assert_close(got[0], torch.zeros_like(h), rtol=0, atol=1e-12)
    off = prior.gradients(G, base, [theta], [h], 0.25, entropy, generator)
    torch.testing.assert_close(off[0], torch.full_like(h, 0.25 * (strength - 1)))


@pytest.mark.parametrize("strength", [1.0, 0.5, 3.0])
def test_the_additive_rules_prior_is_an_isotropic_pull_of_strength_w(strength):
    """The additive rule's covariance σ²I is fixed (constant entropy), so the prior's whole
    effect is the pull w·τ/(Nσ²)·(m − m_prev): one step without a loss gradient (momentum 0)
    moves m by −α·w·τ/(Nσ²)·(m − m_prev), whatever the draws."""
    lr, n, tau, sigma = 0.05, 10.0, 0.5, 0.125  # σ exact in the base's float32
    theta = nn.Parameter(torch.tensor([0.3, -1.0, 2.0], dtype=D))
    make = partial(
        lgb.AdditiveBLR, lr=lr, momentum=0.0, base=Normal(0.0, sigma), data_size=n, temperature=tau
    )
    prev = torch.tensor([1.0, 0.5, -0.5], dtype=D)
    source = make([nn.Parameter(prev.clone())])
    opt = make([theta], seed=1)
    opt.set_prior(source.posterior(), strength=strength)
    m = theta.detach().clone()

    def closure():
        opt.zero_grad()
        loss = theta.sum() * 0.0
        loss.backward()
        return loss

    opt.step(closure)
    moved = opt.state[theta]["element"] - m
    torch.testing.assert_close(
        moved, -lr * strength * tau / (n * sigma**2) * (m - prev), rtol=1e-12, atol=1e-15
    )


def test_the_prior_strength_is_saved_resumed_bit_for_bit_and_checked():
    """A run with a prior of strength 3 resumes from its state dict bit for bit (the strength
    comes with it); a state dict saved before strengths (no ``"prior_strength"``) loads as
    w = 1; a strength that is not a finite float > 0 is refused, naming the argument, before
    next_task changes anything."""
    model, x, y = make_problem()

    def make(ps, **kw):
        return lgb.AffineBLR(ps, lr=0.1, scale_lr=0.05, base=Normal(0.0, 0.05), data_size=32, **kw)

    opt = make(model.parameters(), seed=3)
    opt.step(closure_for(opt, model, x, y))
    opt.next_task(data_size=20, strength=3.0)
    opt.step(closure_for(opt, model, x, y))
    saved_model = copy.deepcopy(model.state_dict())
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    for _ in range(2):
        opt.step(closure_for(opt, model, x, y))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["prior_strength"] == 3.0
    net = copy.deepcopy(model)
    net.load_state_dict(saved_model)
    resumed = make(net.parameters(), seed=3)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["prior_strength"] == 3.0
    for _ in range(2):
        resumed.step(closure_for(resumed, net, x, y))
    for a, b in zip(snapshot(resumed, net), snapshot(opt, model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    old = {k: v for k, v in saved.items() if k != "prior_strength"}
    resumed.load_state_dict(old)
    assert resumed.state_dict()["prior_strength"] == 1.0

    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "2", None):
        with pytest.raises(ValueError, match=r"^strength: expected a finite float > 0"):
            resumed.next_task(data_size=7, strength=bad)
        with pytest.raises(ValueError, match=r"^strength: "):
            resumed.set_prior(resumed.posterior(), strength=bad)
    assert resumed.param_groups[0]["data_size"] == 20
    assert resumed.state_dict()["prior_strength"] == 1.0


def _prior_and_model(kind, gen):
    """A posterior to return to, and a model at another start."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    make = FACTORIES[kind]
    source = make(copy.deepcopy(model).parameters(), seed=1)
    for state in source.state.values():  # somewhere else in the group
        element = state["element"]
        moved = element + 0.3 * torch.randn(element.shape, generator=gen, dtype=D)
        state["element"].copy_(moved.abs() + 0.05 if kind == "multiplicative" else moved)
        if kind in ("affine", "generic_t"):
            state["element"][0].copy_(
                element[0] * (1.5 + torch.rand(element[0].shape, generator=gen))
            )
    return source.posterior(), model


FACTORIES = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(
        ps, lr=0.05, base=Normal(0.0, 0.1), data_size=10, **kw
    ),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=0.5, data_size=10, temperature=1.0, **{"init": "auto", **kw}
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(
        ps, lr=0.5, scale_lr=0.5, scale_momentum=0.5, base=Normal(0.0, 0.1), data_size=10, **kw
    ),
    "generic": lambda ps, **kw: lgb.LieGroupBLR(
        ps, DiagonalAffineGroup(), Normal(0.0, 0.1), lr=0.5, momentum=0.5, data_size=10, **kw
    ),
    "generic_t": lambda ps, **kw: lgb.LieGroupBLR(  # no closed form: Monte-Carlo KL
        ps, DiagonalAffineGroup(), StudentT(4.0, 0.0, 0.1), lr=0.5, momentum=0.5, data_size=10, **kw
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", FACTORIES)
def test_a_task_without_data_returns_to_the_prior(kind):
    """Loss 0 (N_t > 0): the objective is (τ/N)·KL(q ‖ prior), minimised at q = prior, from
    another start. Closed forms converge exactly; the Monte-Carlo KL gradient (Student-t)
    within its noise at the fixed point (16 draws per step, a decaying step size)."""
    prior, model = _prior_and_model(kind, torch.Generator().manual_seed(0))
    mc = 16 if kind == "generic_t" else 1
    opt = FACTORIES[kind](model.parameters(), seed=2, prior=prior, mc_samples=mc)
    before = [opt.state[p]["element"].clone() for p in model.parameters()]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k / 100))

    def closure():
        opt.zero_grad()
        loss = sum(p.sum() for p in model.parameters()) * 0.0
        loss.backward()
        return loss

    for _ in range(400):
        opt.step(closure)
        if kind == "generic_t":
            sched.step()
    for p, entry, start in zip(model.parameters(), prior.values(), before, strict=True):
        g, h = opt.state[p]["element"], entry.element
        if kind == "generic_t":  # the distance to the prior shrank 10-fold, to its MC noise
            assert float((g - h).norm()) < 0.1 * float((start - h).norm())
        else:
            torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_prior_refusals_name_what_does_not_match():
    model, _, _ = make_problem()
    post = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.01, data_size=32).posterior()
    with pytest.raises(ValueError, match="prior_precision"):
        lgb.AffineBLR(
            model.parameters(), lr=0.1, scale_lr=0.01, data_size=32, prior_precision=1.0, prior=post
        )
    with pytest.raises(ValueError, match="base"):
        lgb.AffineBLR(
            model.parameters(),
            lr=0.1,
            scale_lr=0.01,
            data_size=32,
            base=Normal(0.0, 1.0),
            prior=post,
        )
    with pytest.raises(ValueError, match=r"MultiplicativeGroup|DiagonalAffine"):
        lgb.MultiplicativeBLR(model.parameters(), lr=0.1, data_size=32, prior=post, init="auto")
    other = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)).to(D)
    with pytest.raises(ValueError, match="shape"):
        lgb.AffineBLR(other.parameters(), lr=0.1, scale_lr=0.01, data_size=32, prior=post)
    with pytest.raises(ValueError, match="posterior of 4 parameters"):
        lgb.AffineBLR(other[0].parameters(), lr=0.1, scale_lr=0.01, data_size=32, prior=post)
    dirac = lgb.AdditiveBLR(model.parameters(), lr=0.1, base=Dirac(0.0)).posterior()
    with pytest.raises(ValueError, match="Dirac"):
        lgb.AdditiveBLR(model.parameters(), lr=0.1, base=Dirac(0.0), prior=dirac)
    with pytest.raises(ValueError, match="Posterior"):
        lgb.AdditiveBLR(model.parameters(), lr=0.1, prior={"0.weight": 1})


def test_a_posterior_by_name_is_matched_by_the_model_and_a_new_head_keeps_its_regularisers():
    """Task 2 adds a head: the backbone's prior is task 1's posterior, the head (not in it)
    keeps its param group's N(0, 1/δ) prior and entropy term."""
    model, x, y = make_problem()
    opt = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.01, data_size=32, seed=0)
    opt.step(closure_for(opt, model, x, y))
    post = opt.posterior(model)
    backbone = {k: v for k, v in post.items() if k.startswith("0.")}
    post = lgb.Posterior(backbone, point_at=post.point_at)
    head = nn.Linear(8, 3).to(D)
    net = nn.Sequential(model[0], model[1], head)
    opt2 = lgb.AffineBLR(
        [{"params": model[0].parameters()}, {"params": head.parameters(), "prior_precision": 2.0}],
        lr=0.1,
        scale_lr=0.01,
        data_size=32,
        seed=0,
    )
    opt2.set_prior(post, model)
    opt2.step(closure_for(opt2, net, x, y))
    assert set(opt2.state_dict()["prior"]) == {0, 1}  # model[0]'s weight and bias
    with pytest.raises(ValueError, match="not parameters of the model"):
        opt2.set_prior(post, head)


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["additive", "multiplicative", "affine", "generic"])
def test_with_a_prior_compiled_steps_equal_eager_ones_and_resume_bit_for_bit(kind):
    model, x, y = make_problem(dtype=torch.float32)
    make = {
        "additive": lambda ps, **kw: lgb.AdditiveBLR(
            ps, lr=0.1, base=Normal(0.0, 0.1), data_size=32, **kw
        ),
        "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
            ps, lr=0.2, data_size=32, temperature=0.5, **{"init": "auto", **kw}
        ),
        "affine": lambda ps, **kw: lgb.AffineBLR(
            ps, lr=0.1, scale_lr=0.05, base=Normal(0.0, 0.05), data_size=32, **kw
        ),
        "generic": lambda ps, **kw: lgb.LieGroupBLR(
            ps,
            DiagonalAffineGroup(),
            Normal(0.0, 0.05),
            lr=0.1,
            data_size=32,
            temperature=0.5,
            **kw,
        ),
    }[kind]
    first = make(model.parameters(), seed=0)
    for _ in range(2):
        first.step(closure_for(first, model, x, y))
    prior = first.posterior()
    runs = []
    for compile in (False, True):
        net = copy.deepcopy(model)
        opt = make(net.parameters(), seed=3, prior=prior, compile=compile)
        for _ in range(3):
            opt.step(closure_for(opt, net, x, y))
        runs.append(snapshot(opt, net))
    (p_eager, s_eager), (p_comp, s_comp) = runs
    torch.testing.assert_close(p_comp, p_eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_comp, s_eager, rtol=1e-5, atol=1e-6)

    net = copy.deepcopy(model)
    opt = make(net.parameters(), seed=3, prior=prior)
    opt.step(closure_for(opt, net, x, y))
    buffer = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buffer)
    for _ in range(2):
        opt.step(closure_for(opt, net, x, y))
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_net = copy.deepcopy(model)
    resumed_net.load_state_dict(saved["model"])
    resumed = make(resumed_net.parameters(), seed=3)  # the prior comes from the state dict
    resumed.load_state_dict(saved["opt"])
    for _ in range(2):
        resumed.step(closure_for(resumed, resumed_net, x, y))
    for a, b in zip(snapshot(resumed, resumed_net), snapshot(opt, net), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
