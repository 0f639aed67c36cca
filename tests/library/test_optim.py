"""The optimizers: equivalences, agreement of generic and specialised rules, API semantics."""

from __future__ import annotations

import copy
import inspect
import io
import math
import typing
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributions import Laplace, Normal, Uniform

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac, Rayleigh
from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    LieGroup,
    MultiplicativeGroup,
)
from liegroup_blr.optim.checks import REQUIRED
from tests.shared import DTYPE, FACTORIES, closure_for, make_problem, snapshot


def train(opt, model, x, y, steps):
    closure = closure_for(opt, model, x, y)
    return [float(opt.step(closure)) for _ in range(steps)]


def point_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x).float(), y))


# ----------------------------------------------------------------- equivalences
@pytest.mark.parametrize("prior_precision", [0.0, 3.0])
def test_additive_with_dirac_base_is_sgd_with_ema_momentum(prior_precision):
    model, x, y = make_problem()
    reference = copy.deepcopy(model)
    lr, beta, n = 0.3, 0.7, 50.0
    opt = lgb.AdditiveBLR(
        model.parameters(),
        lr=lr,
        momentum=beta,
        base=Dirac(0.0),
        data_size=n,
        prior_precision=prior_precision,
    )
    train(opt, model, x, y, 15)

    # SGD with EMA momentum and weight decay δ/N, M₀ = 0, written out by hand.
    params = list(reference.parameters())
    moms = [torch.zeros_like(p) for p in params]
    for _ in range(15):
        loss = nn.functional.cross_entropy(reference(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g, m in zip(params, grads, moms, strict=True):
                m.mul_(beta).add_((1 - beta) * (g + prior_precision / n * p))
                p.sub_(lr * m)
    for p, q in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_multiplicative_dirac_one_no_momentum_is_closed_form_update():
    model, x, y = make_problem()
    lr = 0.5
    opt = lgb.MultiplicativeBLR(
        model.parameters(),
        lr=lr,
        momentum=0.0,
        base=Dirac(1.0),
        data_size=None,
        temperature=0.0,
        init="auto",
    )
    params = list(model.parameters())
    g_plus = [opt.group_element(p)["g+"] for p in params]
    g_minus = [opt.group_element(p)["g-"] for p in params]
    probe = copy.deepcopy(model)
    for _ in range(10):
        # θ = g⁺ − g⁻ exactly (ξ = 1); g± ← g± ⊙ exp(∓α g± ⊙ ∇ℓ)
        with torch.no_grad():
            for q, gp, gm in zip(probe.parameters(), g_plus, g_minus, strict=True):
                q.copy_(gp - gm)
        loss = nn.functional.cross_entropy(probe(x), y)
        grads = torch.autograd.grad(loss, list(probe.parameters()))
        g_plus = [gp * torch.exp(-lr * gp * g) for gp, g in zip(g_plus, grads, strict=True)]
        g_minus = [gm * torch.exp(lr * gm * g) for gm, g in zip(g_minus, grads, strict=True)]
        train(opt, model, x, y, 1)
    for p, gp, gm in zip(params, g_plus, g_minus, strict=True):
        torch.testing.assert_close(opt.group_element(p)["g+"], gp, rtol=1e-12, atol=0)
        torch.testing.assert_close(opt.group_element(p)["g-"], gm, rtol=1e-12, atol=0)
        torch.testing.assert_close(p.detach(), gp - gm, rtol=1e-12, atol=1e-15)


def _pair(specialised, group: LieGroup, base, **generic_kwargs):
    """A specialised optimizer and a generic one with identical elements, seed and noise."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    spec = specialised(model.parameters())
    gen = lgb.LieGroupBLR(twin.parameters(), group, base, seed=spec.seed, **generic_kwargs)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        gen.set_group_element(q, spec.state[p]["element"])
    return (spec, model), (gen, twin), x, y


AGREEMENT_CASES = {
    "additive": (
        lambda ps: lgb.AdditiveBLR(
            ps, lr=0.2, base=Laplace(0.0, 0.05), data_size=32, prior_precision=2.0, mc_samples=3
        ),
        AdditiveGroup(),
        Laplace(0.0, 0.05),
        dict(lr=0.2, data_size=32, prior_precision=2.0, mc_samples=3),
    ),
    "multiplicative": (
        lambda ps: lgb.MultiplicativeBLR(
            ps,
            lr=1.0,
            data_size=32,
            temperature=0.5,
            prior_precision=1.0,
            mc_samples=2,
            init="auto",
        ),
        MultiplicativeGroup(signed=True),
        Rayleigh(1.0),
        dict(lr=1.0, data_size=32, temperature=0.5, prior_precision=1.0, mc_samples=2),
    ),
    "multiplicative-unsigned": (
        lambda ps: lgb.MultiplicativeBLR(
            ps,
            lr=0.3,
            momentum=0.5,
            data_size=32,
            temperature=0.2,
            signed=False,
            mc_samples=2,
            init="auto",
        ),
        MultiplicativeGroup(signed=False),
        Rayleigh(1.0),
        dict(
            lr=0.3,
            momentum=0.5,
            data_size=32,
            temperature=0.2,
            mc_samples=2,
            init=lambda theta: theta.abs() + 1.0,  # replaced by the specialised elements
        ),
    ),
    "affine": (
        lambda ps: lgb.AffineBLR(
            ps,
            lr=0.2,
            scale_lr=0.2,
            momentum=0.8,
            scale_momentum=0.8,
            base=Normal(0.0, 0.1),
            data_size=32,
            prior_precision=1.0,
            mc_samples=2,
        ),
        DiagonalAffineGroup(),
        Normal(0.0, 0.1),
        dict(lr=0.2, momentum=0.8, data_size=32, prior_precision=1.0, mc_samples=2),
    ),
}


@pytest.mark.parametrize("case", AGREEMENT_CASES)
def test_generic_rule_equals_specialised_rule_step_for_step(case):
    specialised, group, base, kwargs = AGREEMENT_CASES[case]
    (spec, m1), (gen, m2), x, y = _pair(specialised, group, base, **kwargs)
    c1, c2 = closure_for(spec, m1, x, y), closure_for(gen, m2, x, y)
    for _ in range(12):
        l1, l2 = spec.step(c1), gen.step(c2)
        torch.testing.assert_close(l1, l2, rtol=1e-12, atol=0)
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-11, atol=1e-14)
            for key in ("element", "momentum"):
                torch.testing.assert_close(
                    spec.state[p][key], gen.state[q][key], rtol=1e-11, atol=1e-14
                )


def test_generic_fisher_preconditioner_equals_specialised_with_folded_rate():
    """With a Gaussian base of scale σ, F = 1/σ² for translations: F⁻¹ folds into α·σ²."""
    sigma = 0.1
    (spec, m1), (gen, m2), x, y = _pair(
        lambda ps: lgb.AdditiveBLR(ps, lr=0.5 * sigma**2, base=Normal(0.0, sigma)),
        AdditiveGroup(),
        Normal(0.0, sigma),
        lr=0.5,
        preconditioner="fisher",
    )
    train(spec, m1, x, y, 5)
    train(gen, m2, x, y, 5)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-11, atol=1e-14)


def test_generic_per_component_factors_scale_the_algebra_gradient():
    """Factors (c, c) on the affine algebra equal the specialised rule at rate c·α."""
    (spec, m1), (gen, m2), x, y = _pair(
        lambda ps: lgb.AffineBLR(
            ps,
            lr=0.3,
            scale_lr=0.3,
            momentum=0.5,
            scale_momentum=0.5,
            base=Normal(0.0, 0.1),
            data_size=None,
            temperature=0.0,
        ),
        DiagonalAffineGroup(),
        Normal(0.0, 0.1),
        lr=0.1,
        momentum=0.5,
        temperature=0.0,
        preconditioner=[3.0, 3.0],
    )
    train(spec, m1, x, y, 5)
    train(gen, m2, x, y, 5)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-11, atol=1e-14)


# ------------------------------------------------ convergence to closed-form optima
# ℓ̄(θ) = ½ Σᵢ hᵢ(θᵢ − cᵢ)², objective E_q[ℓ̄] + (δ/N)E_q[½‖θ‖²] − (τ/N)H(q).
H = torch.tensor([1.0, 4.0, 0.25], dtype=DTYPE)
C = torch.tensor([1.0, -0.5, 2.0], dtype=DTYPE)
N, TAU, DELTA = 10.0, 1.0, 2.0


def quadratic_run(opt_factory, steps, chains=16):
    """Group elements after ``steps`` (cosine-decayed lr) of ``chains`` independent chains.

    The rules act coordinatewise with i.i.d. noise, so one parameter of shape (chains, 3)
    runs the chains side by side."""
    theta = nn.Parameter(torch.zeros(chains, 3, dtype=DTYPE))
    opt = opt_factory([theta])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=0.0)

    def closure():
        opt.zero_grad()
        loss = 0.5 * (H * (theta - C) ** 2).sum()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
        sched.step()
    return opt.group_element(theta)


def assert_mc_close(estimates, target, rel_floor=2e-3):
    """|mean − target| < 5·SE(mean) + rel_floor·|target| over independent chains, with
    SE(mean) = std/√R: a wrong fixed point is off by far more than the chain-to-chain noise."""
    mean, se = estimates.mean(0), estimates.std(0) / math.sqrt(len(estimates))
    assert bool((se < 0.02 * target.abs() + 1e-3).all()), f"runs too noisy to test: {se}"
    err = (mean - target).abs()
    assert bool((err < 5 * se + rel_floor * target.abs()).all()), (mean, target, se)


@pytest.mark.slow
def test_affine_gaussian_converges_to_exact_gaussian_posterior():
    """With q = N(b, s²), s = Aσ: b* = hc/(h + δ/N), s*² = (τ/N)/(h + δ/N)."""
    sigma = 0.5
    b_star = H * C / (H + DELTA / N)
    s_star = torch.sqrt(TAU / N / (H + DELTA / N))
    final = quadratic_run(
        lambda ps: lgb.AffineBLR(
            ps,
            lr=0.1,
            scale_lr=0.05,
            momentum=0.8,
            scale_momentum=0.9,
            base=Normal(0.0, sigma),
            data_size=N,
            temperature=TAU,
            prior_precision=DELTA,
            mc_samples=16,
        ),
        steps=1500,
    )
    assert_mc_close(final["b"], b_star)
    assert_mc_close(final["A"] * sigma, s_star)


@pytest.mark.slow
def test_additive_converges_to_map_of_the_smoothed_objective():
    """Entropy is constant, so m* = hc/(h + δ/N) for any centred base."""
    final = quadratic_run(
        lambda ps: lgb.AdditiveBLR(
            ps,
            lr=0.2,
            base=Normal(0.0, 0.3),
            data_size=N,
            prior_precision=DELTA,
            mc_samples=8,
        ),
        steps=600,
    )
    assert_mc_close(final["m"], H * C / (H + DELTA / N))


@pytest.mark.slow
def test_unsigned_multiplicative_converges_to_closed_form_scale():
    """θ = gξ, ξ ~ Rayleigh(σ): E[θ] = gμ, E[θ²] = 2σ²g², H = log g + const, so
    f(g) = ½h(2σ²g² − 2cμg) + (δ/N)σ²g² − (τ/N)log g, whose positive root of f'(g) = 0 is
    g* = [hcμ + √((hcμ)² + 8σ²(h + δ/N)τ/N)] / (4σ²(h + δ/N))."""
    sigma = 0.5
    mu = sigma * math.sqrt(math.pi / 2)
    k = H + DELTA / N
    g_star = (H * C * mu + torch.sqrt((H * C * mu) ** 2 + 8 * sigma**2 * k * TAU / N)) / (
        4 * sigma**2 * k
    )

    def factory(ps):
        with torch.no_grad():
            ps[0].fill_(1.0)
        return lgb.MultiplicativeBLR(
            ps,
            lr=0.2,
            base=Rayleigh(sigma),
            data_size=N,
            temperature=TAU,
            prior_precision=DELTA,
            mc_samples=16,
            signed=False,
            init_offset=1e-3,
            init="auto",
        )

    assert_mc_close(quadratic_run(factory, steps=1500)["g"], g_star)


# ------------------------------------------------------------------- robustness
INVALID = [
    ("lr", dict(lr=0.0)),
    ("lr", dict(lr=-1.0)),
    ("lr", dict(lr=float("nan"))),
    ("momentum", dict(momentum=1.0)),
    ("momentum", dict(momentum=-0.1)),
    ("mc_samples", dict(mc_samples=0)),
    ("mc_samples", dict(mc_samples=2.0)),
    ("data_size", dict(data_size=0)),
    ("data_size", dict(data_size=-5)),
    ("temperature", dict(temperature=-1.0)),
    ("prior_precision", dict(prior_precision=-0.1)),
    ("weight_decay", dict(weight_decay=-0.1)),
    ("point_at", dict(point_at="median")),
]


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize(("name", "kwargs"), INVALID)
def test_invalid_hyperparameter_raises_value_error_naming_it(kind, name, kwargs):
    with pytest.raises(ValueError, match=rf"^{name}"):
        FACTORIES[kind]([nn.Parameter(torch.zeros(3))], **kwargs)


@pytest.mark.parametrize(
    ("kind", "name", "kwargs"),
    [
        ("multiplicative", "base", dict(base=Normal(0.0, 1.0))),
        ("multiplicative", "base", dict(base=Dirac(0.0))),
        ("multiplicative", "base", dict(base=Uniform(-1.0, 1.0))),
        ("multiplicative", "init_offset", dict(init_offset=0.0)),
        ("multiplicative", "data_size", dict(data_size=None)),
        ("affine", "scale_lr", dict(scale_lr=0.0)),
        ("affine", "scale_momentum", dict(scale_momentum=1.0)),
        ("affine", "init_scale", dict(init_scale=-1.0)),
        ("affine", "data_size", dict(data_size=None)),
        ("additive", "data_size", dict(data_size=None, prior_precision=1.0)),
        ("additive", "base", dict(base=Normal(torch.zeros(2), 1.0))),
        ("generic", "preconditioner", dict(preconditioner="newton")),
        ("generic", "preconditioner", dict(preconditioner=[1.0, -1.0])),
    ],
)
def test_invalid_option_raises_value_error_naming_it(kind, name, kwargs):
    with pytest.raises(ValueError, match=rf"^{name}"):
        FACTORIES[kind]([nn.Parameter(torch.zeros(3))], **kwargs)


def test_generic_rejects_non_group():
    with pytest.raises(ValueError, match=r"^group"):
        lgb.LieGroupBLR([nn.Parameter(torch.zeros(3))], "affine", Normal(0.0, 1.0), lr=0.1)


def test_invalid_param_group_hyperparameter_raises():
    opt = lgb.AdditiveBLR([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"^momentum"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "momentum": 2.0})
    assert len(opt.param_groups) == 1


def test_additive_without_data_size_is_fine_when_n_is_unused():
    opt = lgb.AdditiveBLR([nn.Parameter(torch.zeros(3))], lr=0.1, temperature=1.0)
    assert opt.param_groups[0]["data_size"] is None


@pytest.mark.parametrize("kind", ["multiplicative", "affine"])
def test_data_size_is_required_where_the_default_temperature_divides_by_it(kind):
    """τ = 1 by default, so N has no default: keyword-only and required (``None`` is an
    answer where τ = δ = 0)."""
    cls = {"multiplicative": lgb.MultiplicativeBLR, "affine": lgb.AffineBLR}[kind]
    data_size = inspect.signature(cls).parameters["data_size"]
    assert data_size.kind is inspect.Parameter.KEYWORD_ONLY
    assert data_size.default is REQUIRED  # a missing one says what it means
    rates = {"lr": 0.1, "scale_lr": 0.1} if kind == "affine" else {"lr": 0.1}
    with pytest.raises(TypeError, match="data_size is required: N, the number of training"):
        cls([nn.Parameter(torch.ones(3))], **rates)
    opt = cls([nn.Parameter(torch.ones(3))], **rates, data_size=None, temperature=0.0)
    assert opt.param_groups[0]["data_size"] is None


def _no_gradient(opt, model, x, y):
    opt.step(lambda: 1.0)


def _non_finite(opt, model, x, y):
    opt.step(lambda: closure_for(opt, model, x, y)() * math.nan)


def _non_finite_scheduled(opt, model, x, y):
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps step()
    opt.step(lambda: closure_for(opt, model, x, y)() * math.nan)


def _frozen_left_out(opt, model, x, y):
    model[0].bias.requires_grad_(False)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2), requires_grad=False)]})
    opt.posterior()


def _no_noise_state(opt, model, x, y):
    state = opt.state_dict()
    del state["rng"]
    opt.load_state_dict(state)


@pytest.mark.parametrize(
    ("trigger", "words"),
    [
        (_no_gradient, "no trained parameter has a gradient"),
        (_non_finite, "non-finite"),
        (_non_finite_scheduled, "non-finite"),
        (_frozen_left_out, "without optimizer state"),
        (_no_noise_state, "no noise state"),
    ],
)
def test_every_warning_points_at_the_users_line(trigger, words):
    """As torch's warnings do: the file and line of the call into the optimizer."""
    model, x, y = make_problem()
    opt = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.01, data_size=10, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trigger(opt, model, x, y)
    said = [w for w in caught if words in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [w.filename for w in said]


def test_step_is_typed_as_torch_optim_types_it():
    """Overloads as torch.optim's stubs: no closure gives None, a closure its own type."""
    first, second = (typing.get_type_hints(f) for f in typing.get_overloads(lgb.AffineBLR.step))
    assert first == {"closure": type(None), "return": type(None)}
    loss = second["return"]
    assert isinstance(loss, typing.TypeVar) and second["closure"] == Callable[[], loss]
    assert typing.get_type_hints(lgb.AffineBLR.step)["return"] == loss | None


@pytest.mark.parametrize("kind", ["multiplicative", "affine", "generic"])
@pytest.mark.filterwarnings("ignore:.*non-finite:RuntimeWarning")
def test_huge_gradients_and_rates_keep_elements_positive_and_finite(kind):
    torch.manual_seed(0)
    theta = nn.Parameter(torch.randn(50))
    huge = {"lr": 1e12}
    if kind == "affine":
        huge["scale_lr"] = 1e12
    opt = FACTORIES[kind]([theta], **huge)
    for scale in (1e30, -1e30, 1e-30, 1e30):

        def closure(scale=scale):
            opt.zero_grad()
            loss = scale * (theta * torch.linspace(-1, 1, 50)).sum() + (theta**2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        element = opt.state[theta]["element"]
        assert bool(torch.isfinite(element).all())
        assert bool(torch.isfinite(theta).all())
        positive = element if kind == "multiplicative" else element[0]
        assert bool((positive > 0).all())
        assert opt.lie_group.check_element(element)[0]


@pytest.mark.parametrize(
    "kind, compile",
    [
        *((kind, False) for kind in FACTORIES),
        *(
            pytest.param(kind, True, marks=pytest.mark.compile)
            for kind in ("multiplicative", "affine")
        ),
    ],
)
@pytest.mark.parametrize("bad", ["loss", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_loss_or_gradient_skips_step_and_keeps_state(kind, compile, bad, value):
    """Compiled, the multiplicative and affine rules move the elements into spare buffers
    before the check: these must not be swapped in."""
    model, x, y = make_problem(dtype=torch.float32)
    opt = FACTORIES[kind](model.parameters(), compile=compile)
    train(opt, model, x, y, 3)
    params, states = snapshot(opt, model)

    def poisoned():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if bad == "loss":
            loss = loss + value
        loss.backward()
        if bad == "grad":
            next(model.parameters()).grad[0, 0] = value
        return loss

    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step(poisoned)
    assert opt.skipped_steps == 1
    after_params, after_states = snapshot(opt, model)
    for p, q in zip(params, after_params, strict=True):
        assert torch.equal(p, q)
    for s, t in zip(states, after_states, strict=True):
        for key in s:
            assert torch.equal(s[key], t[key])
    train(opt, model, x, y, 1)  # and training goes on
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ----------------------------------------------------------------- state dicts
@pytest.mark.parametrize("kind", FACTORIES)
def test_state_dict_round_trip_continues_bit_identically(kind):
    model, x, y = make_problem(dtype=torch.float32)
    opt = FACTORIES[kind](model.parameters(), mc_samples=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    closure = closure_for(opt, model, x, y)
    for _ in range(5):
        opt.step(closure)
        sched.step()
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
        buffer,
    )
    torch.manual_seed(123)  # the global RNG must not matter
    for _ in range(5):
        opt.step(closure)
        sched.step()
    expected = snapshot(opt, model)

    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)
    model2, _, _ = make_problem(seed=1, dtype=torch.float32)
    model2.load_state_dict(ckpt["model"])
    opt2 = FACTORIES[kind](model2.parameters(), mc_samples=2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    closure2 = closure_for(opt2, model2, x, y)
    for _ in range(5):
        opt2.step(closure2)
        sched2.step()
    got = snapshot(opt2, model2)
    for p, q in zip(expected[0], got[0], strict=True):
        assert torch.equal(p, q)
    for s, t in zip(expected[1], got[1], strict=True):
        assert s.keys() == t.keys()
        assert all(torch.equal(s[k], t[k]) for k in s)


def test_load_state_dict_writes_point_estimate_and_keeps_base():
    model, x, y = make_problem(dtype=torch.float32)
    opt = lgb.MultiplicativeBLR(model.parameters(), lr=0.5, data_size=32, init="auto")
    train(opt, model, x, y, 3)
    sd = opt.state_dict()
    assert all("base" not in g for g in sd["param_groups"])
    model2, _, _ = make_problem(seed=5, dtype=torch.float32)
    opt2 = lgb.MultiplicativeBLR(
        model2.parameters(), lr=0.5, data_size=32, base=Rayleigh(2.0), init="auto"
    )
    opt2.load_state_dict(sd)
    assert float(opt2.param_groups[0]["base"].scale) == 2.0
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_refused_between_samples_and_step():
    model, x, y = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1)
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="state_dict"):
        opt.state_dict()


# ------------------------------------------------------------- schedules, groups
def test_affine_scale_rate_follows_the_lr_schedule():
    """After a scheduler halves lr, a step equals one of an optimizer built with α₁/2, α₂/2."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    kwargs = dict(momentum=0.5, scale_momentum=0.9, data_size=32, seed=7)
    opt = lgb.AffineBLR(model.parameters(), lr=0.4, scale_lr=0.2, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    ref = lgb.AffineBLR(twin.parameters(), lr=0.2, scale_lr=0.1, **kwargs)
    train(opt, model, x, y, 3)
    train(ref, twin, x, y, 3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(opt.state[p]["element"], ref.state[q]["element"])
    assert sched.get_last_lr() == [pytest.approx(0.2)]


def test_param_groups_use_their_own_hyperparameters():
    model, x, y = make_problem()
    reference = copy.deepcopy(model)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt = lgb.AdditiveBLR(
        [{"params": first}, {"params": second, "lr": 0.05, "momentum": 0.0}],
        lr=0.3,
        momentum=0.6,
        base=Dirac(0.0),
    )
    train(opt, model, x, y, 4)
    sgd = torch.optim.SGD(
        [
            {"params": list(reference[0].parameters())},
            {"params": list(reference[2].parameters()), "lr": 0.05, "momentum": 0.0},
        ],
        lr=0.3 * (1 - 0.6),  # EMA momentum M = (1−β)·Σβᵏ∇ equals SGD momentum with lr(1−β)
        momentum=0.6,
    )
    # torch's SGD seeds its buffer with the first gradient; EMA starts from 0. Both agree
    # after rescaling: M_t = (1−β) buf_t for every t, since buf₁ = ∇₁ = M₁/(1−β).
    for _ in range(4):
        sgd.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        sgd.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------- sampling semantics
def test_params_hold_point_estimate_outside_sampling_and_samples_inside():
    model, _, _ = make_problem()
    opt = lgb.AffineBLR(
        model.parameters(), lr=0.1, scale_lr=0.01, base=Normal(0.0, 0.1), data_size=10
    )
    w = model[0].weight
    point = w.detach().clone()
    torch.testing.assert_close(point, opt.group_element(w)["b"])
    with opt.sampled_params():
        sample = w.detach().clone()
    assert not torch.equal(sample, point)
    assert torch.equal(w.detach(), point)
    # θ − b = A·ξ with A = 1, ξ ~ N(0, 0.1²) over 40 weights
    assert 0.05 < float((sample - point).std()) < 0.2


def test_sampled_params_restores_point_estimate_on_error_and_refuses_nesting():
    model, _, _ = make_problem()
    opt = lgb.MultiplicativeBLR(model.parameters(), lr=0.1, data_size=10, init="auto")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(KeyError), opt.sampled_params(train=True):
        raise KeyError("boom")
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    with pytest.raises(RuntimeError, match="nested"), opt.sampled_params():
        with opt.sampled_params():
            pass
    with pytest.raises(RuntimeError, match="closure"):
        opt.step()


@pytest.mark.parametrize("kind", FACTORIES)
def test_manual_sampling_loop_equals_closure_loop(kind):
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    opt = FACTORIES[kind](model.parameters(), mc_samples=3, seed=11)
    opt2 = FACTORIES[kind](twin.parameters(), mc_samples=3, seed=11)
    train(opt, model, x, y, 4)
    for _ in range(4):
        for _ in range(3):
            with opt2.sampled_params(train=True):
                opt2.zero_grad()
                nn.functional.cross_entropy(twin(x), y).backward()
        opt2.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def recording_closure(opt, theta, seen):
    """A closure on ℓ = ‖θ‖² that appends every sample θ it is evaluated at to ``seen``."""

    def closure():
        opt.zero_grad()
        seen.append(theta.detach().clone())
        loss = (theta**2).sum()
        loss.backward()
        return loss

    return closure


def test_closure_is_called_once_per_mc_sample_at_distinct_samples():
    theta = nn.Parameter(torch.zeros(4))
    opt = lgb.AdditiveBLR([theta], lr=0.1, base=Normal(0.0, 1.0), mc_samples=5)
    seen: list[torch.Tensor] = []
    loss = opt.step(recording_closure(opt, theta, seen))
    assert len(seen) == 5
    assert len({tuple(s.tolist()) for s in seen}) == 5
    torch.testing.assert_close(loss, torch.stack([(s**2).sum() for s in seen]).mean())


def test_parameters_without_grad_are_skipped():
    model, x, y = make_problem()
    frozen = nn.Parameter(torch.ones(3, dtype=DTYPE), requires_grad=False)
    unused = nn.Parameter(torch.ones(3, dtype=DTYPE))
    opt = lgb.MultiplicativeBLR(
        [*model.parameters(), frozen, unused], lr=0.5, data_size=32, temperature=1.0, init="auto"
    )
    assert frozen not in opt.state
    unused_state = {k: v.clone() for k, v in opt.state[unused].items()}
    unused_point = unused.detach().clone()
    train(opt, model, x, y, 3)
    assert torch.equal(frozen, torch.ones(3, dtype=DTYPE))
    assert unused.grad is None
    assert all(torch.equal(unused_state[k], opt.state[unused][k]) for k in unused_state)
    assert torch.equal(unused.detach(), unused_point)


def test_multiplicative_point_estimate_mean_is_rayleigh_mean_times_difference():
    model, _, _ = make_problem()
    opt = lgb.MultiplicativeBLR(
        model.parameters(), lr=0.1, data_size=1, point_at="mean", init="auto"
    )
    w = model[0].weight
    parts = opt.group_element(w)
    torch.testing.assert_close(w.detach(), math.sqrt(math.pi / 2) * (parts["g+"] - parts["g-"]))


def test_multiplicative_initialisation_follows_the_reference():
    """g⁺ = |w| + offset and g⁻ = |w'| + offset, w' a permutation of w's entries."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(20, 30))
    w0 = w.detach().clone()
    opt = lgb.MultiplicativeBLR([w], lr=0.1, data_size=1, init_offset=1e-3, init="reference")
    parts = opt.group_element(w)
    torch.testing.assert_close(parts["g+"], w0.abs() + 1e-3)
    torch.testing.assert_close(
        parts["g-"].flatten().sort().values, parts["g+"].flatten().sort().values
    )
    assert not torch.equal(parts["g-"], parts["g+"])
    torch.testing.assert_close(w.detach(), parts["g+"] - parts["g-"])


def test_posterior_samples_have_the_pushforward_distribution():
    """Signed multiplicative with Rayleigh(1): E[θ] = μ(g⁺ − g⁻), Var θ = (2 − π/2)(g⁺² + g⁻²)."""
    w = nn.Parameter(torch.full((200_000,), 0.3, dtype=DTYPE))
    opt = lgb.MultiplicativeBLR([w], lr=0.1, data_size=1, signed=True, init="auto")
    g = opt.state[w]["element"]
    g.copy_(torch.tensor([2.0, 0.5], dtype=DTYPE)[:, None].expand_as(g))
    with opt.sampled_params():
        sample = w.detach().clone()
    mean, var = math.sqrt(math.pi / 2) * 1.5, (2 - math.pi / 2) * (4 + 0.25)
    se = math.sqrt(var / sample.numel())
    assert abs(float(sample.mean()) - mean) < 5 * se
    assert abs(float(sample.var()) - var) < 0.02 * var


def test_set_group_element_validates_and_writes_point():
    w = nn.Parameter(torch.zeros(3))
    opt = lgb.AffineBLR([w], lr=0.1, scale_lr=0.1, data_size=10)
    opt.set_group_element(w, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    assert torch.equal(w.detach(), torch.tensor([4.0, 5.0, 6.0]))
    with pytest.raises(ValueError, match="element"):
        opt.set_group_element(w, torch.tensor([[-1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    with pytest.raises(ValueError, match="element"):
        opt.set_group_element(w, torch.zeros(3))


# ------------------------------------------------------------- dtypes, devices
@pytest.mark.parametrize("kind", FACTORIES)
def test_bfloat16_parameters_keep_float32_state(kind):
    model, x, y = make_problem(dtype=torch.bfloat16)
    opt = FACTORIES[kind](model.parameters(), data_size=1000, seed=0)
    before = point_loss(model, x, y)
    train(opt, model, x, y, 40)
    assert point_loss(model, x, y) < 0.9 * before
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
        point = opt.lie_group.point_estimate(opt.state[p]["element"])
        assert torch.equal(p.detach(), point.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", FACTORIES)
def test_cuda_matches_cpu_in_float64(kind):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.cuda().parameters(), seed=0)
    losses = train(opt, model, x.cuda(), y.cuda(), 10)
    assert losses[-1] < losses[0]
    assert all(v.is_cuda for p in model.parameters() for v in opt.state[p].values())


@pytest.mark.parametrize("kind", FACTORIES)
def test_all_rules_train_a_network(kind):
    model, x, y = make_problem(dtype=torch.float32)
    opt = FACTORIES[kind](model.parameters(), mc_samples=2, data_size=1000, seed=0)
    before = point_loss(model, x, y)
    train(opt, model, x, y, 60)
    assert point_loss(model, x, y) < 0.85 * before


def test_the_old_names_of_point_at_and_footprint_warn_and_still_work():
    """``point_estimate=`` (now ``point_at=``, the block keeps the name), ``point_convention``
    (now ``point_at``) and ``memory()`` (now ``footprint()``) work for one release, each with a
    DeprecationWarning naming the new name."""
    model, x, y = make_problem()
    with pytest.warns(DeprecationWarning, match=r"point_estimate=\.\.\.\) is now point_at"):
        old = lgb.MultiplicativeBLR(
            model.parameters(), lr=0.1, data_size=1, point_estimate="mean", init="auto"
        )
    new = lgb.MultiplicativeBLR(
        model.parameters(), lr=0.1, data_size=1, point_at="mean", init="auto"
    )
    assert old.point_at == new.point_at == "mean"
    with pytest.warns(DeprecationWarning, match="point_convention is now point_at"):
        assert old.point_convention == "mean"
    old.step(closure_for(old, model, x, y))
    with pytest.warns(DeprecationWarning, match=r"memory\(\) is now footprint\(\)"):
        assert old.memory() == old.footprint()
    assert old.footprint()["scratch"] > 0
