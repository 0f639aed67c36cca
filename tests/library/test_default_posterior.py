"""The posterior a user gets from the documented values (issue: a posterior by default).

- the affine rule's ``scale_step`` moves the precision the fraction ρ₂ of the way to its fixed
  point per step, at every N, and ``scale_lr=α₂`` is the same step as ``scale_step=2τα₂/N``;
- the README's values learn σ within 1.5 times of the mean-field fixed point in 10 passes;
- the next task trains with the README's values (digits 0–4, then 5–9), a prior keeps the old
  task better than fine-tuning on a stream where it can, and a prior that a step cannot take
  stably (the additive rule's fixed covariance) is refused in one line that names the fix.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Normal
from torch.func import functional_call, grad, jacrev

import liegroup_blr as lgb
from liegroup_blr.optim.affine import SCALE_STEP

README_AFFINE = {"lr": 0.01, "prior_precision": 25.0}
"""The README's AffineBLR values (besides data_size)."""


# ------------------------------------------------------------------ the scale's step
def quadratic_step(n: int, rho: float, sigma0_over_star: float) -> tuple[float, float, float]:
    """One step of a scalar AffineBLR on ℓ̄(θ) = ½hθ² with many antithetic samples:
    (precision before, after, at the fixed point)."""
    h, delta, tau = 2.0, 3.0, 0.5
    star2 = tau / (n * h + delta)
    theta = nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = lgb.AffineBLR(
        [theta], lr=1e-9, scale_step=rho, data_size=n, temperature=tau, prior_precision=delta,
        init_scale=1.0, base=Normal(0.0, sigma0_over_star * math.sqrt(star2)),
        mc_samples=4000, antithetic=True, seed=0,
    )  # fmt: skip

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = 0.5 * h * theta**2
        loss.backward()
        return loss

    before = (sigma0_over_star**2 * star2) ** -1
    opt.step(closure)
    sigma = float(opt.group_element(theta)["A"]) * sigma0_over_star * math.sqrt(star2)
    return before, sigma**-2, 1 / star2


@pytest.mark.parametrize("n", [100, 100_000])
@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_scale_step_is_the_fraction_of_the_way_at_every_n(n, ratio):
    rho = 0.02
    before, after, star = quadratic_step(n, rho, ratio)
    fraction = (before - after) / (before - star)
    # the exponential map is the precision EMA to first order in ρ: |error| ≲ ρ·|P*/P − 1|
    assert fraction == pytest.approx(rho, rel=2 * rho * abs(star / before - 1) + 0.01)


def test_scale_lr_is_the_same_step_as_scale_step():
    """The old parametrisation (α₂) and the new (ρ₂ = 2τα₂/N) give the same run."""
    n, tau, alpha2 = 900, 0.7, 37.0
    runs = []
    for step in ({"scale_lr": alpha2}, {"scale_step": 2 * tau * alpha2 / n}):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = lgb.AffineBLR(
            model.parameters(), lr=0.01, **step, scale_momentum=0.999, base=Normal(0, 0.02),
            init_scale=1.0, data_size=n, temperature=tau, prior_precision=2.0, seed=0,
        )  # fmt: skip
        x, y = torch.randn(64, 5), torch.randint(0, 2, (64,))
        for _ in range(30):
            opt.step(lambda opt=opt, model=model, x=x, y=y: closure(opt, model, x, y))
        runs.append(torch.cat([opt.group_element(p)["A"].reshape(-1) for p in model.parameters()]))
    assert not torch.equal(runs[0], torch.ones_like(runs[0]))  # the scale moved
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=0)


def test_defaults_and_their_errors():
    model = nn.Linear(3, 2)
    opt = lgb.AffineBLR(model.parameters(), lr=0.1, data_size=100, prior_precision=25.0)
    group = opt.param_groups[0]
    assert group["scale_step"] == SCALE_STEP and group["scale_lr"] is None
    assert group["scale_momentum"] == 0.0
    assert float(group["base"].stddev) == pytest.approx(math.sqrt(1 / 100))
    # σ₀² = τ/(N h₀ + δ) with h₀ = 1: A₀ = 1/√(1 + δ/N)
    assert opt.group_element(model.weight)["A"].unique().item() == pytest.approx(
        1 / math.sqrt(1.25)
    )
    reference = lgb.AffineBLR(model.parameters(), lr=1.0, scale_lr=0.05, data_size=100)
    group = reference.param_groups[0]
    assert (group["scale_momentum"], float(group["base"].stddev)) == (0.999, pytest.approx(0.005))
    assert reference.group_element(model.weight)["A"].unique().item() == 1.0
    with pytest.raises(TypeError, match="lr is required: the shift's step size"):
        lgb.AffineBLR(model.parameters(), data_size=100)
    with pytest.raises(TypeError, match="data_size is required: N, the number of training"):
        lgb.AffineBLR(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not both"):
        lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=1.0, scale_step=0.1, data_size=9)
    with pytest.raises(ValueError, match="scale_step: needs temperature > 0"):
        lgb.AffineBLR(model.parameters(), lr=0.1, data_size=9, temperature=0.0)
    with pytest.raises(ValueError, match=r"scale_step: must lie in \(0, 1\]"):
        lgb.AffineBLR(model.parameters(), lr=0.1, data_size=9, scale_step=1.5)


# ------------------------------------------------------------------ the README's values
def closure(opt, model, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def readme_data():
    torch.manual_seed(0)
    inputs = torch.randn(1200, 20)
    labels = (inputs @ torch.randn(20, 3)).argmax(-1)
    return inputs[:1000], labels[:1000]


def train(opt, model, x, y, passes, seed=0, losses=None):
    order = torch.Generator().manual_seed(seed)
    for _ in range(passes):
        perm = torch.randperm(len(y), generator=order)
        for i in range(0, len(y) - 49, 50):
            xb, yb = x[perm[i : i + 50]], y[perm[i : i + 50]]
            loss = opt.step(lambda xb=xb, yb=yb: closure(opt, model, xb, yb))
            if losses is not None:
                losses.append(float(loss))


def mean_field_sigma(opt, model, x, y, delta, draws=4):
    """σ*² = τ/(N E_q[∇²_jj ℓ̄] + δ) per parameter, the exact Hessian's diagonal over draws."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]

    def total(flat):
        parts = [t.reshape(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]
        params = dict(zip(names, parts, strict=True))
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y, reduction="sum")

    post, generator = opt.posterior(model), torch.Generator().manual_seed(0)
    diagonal = 0
    for _ in range(draws):
        draw = post.sample(generator)
        flat = torch.cat([draw[n].reshape(-1) for n in names])
        diagonal = diagonal + jacrev(grad(total), chunk_size=512)(flat).diagonal() / draws
    return dict(zip(names, (1 / (diagonal + delta)).sqrt().split(sizes), strict=True))


def test_readme_values_learn_the_scale_in_ten_passes():
    x, y = readme_data()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3))
    opt = lgb.AffineBLR(model.parameters(), **README_AFFINE, data_size=len(y), seed=1)
    train(opt, model, x, y, passes=10, seed=1)
    std = float(opt.param_groups[0]["base"].stddev)
    star = mean_field_sigma(opt, model, x, y, README_AFFINE["prior_precision"])
    for name, p in model.named_parameters():
        ratio = float((opt.group_element(p)["A"] * std).reshape(-1).div(star[name]).median())
        assert 2 / 3 <= ratio <= 1.5, (name, ratio)
    assert opt.skipped_steps == 0


# ------------------------------------------------------------------ the next task
def digits():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return torch.tensor(bunch.data, dtype=torch.float32) / 16, torch.tensor(bunch.target)


RULES = {
    "affine": lambda params, n: lgb.AffineBLR(params, **README_AFFINE, data_size=n, seed=1),
    "multiplicative": lambda params, n: lgb.MultiplicativeBLR(
        params, lr=2.0, temperature=0.006, data_size=n, init="keep", seed=1
    ),
}


def accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


@pytest.mark.parametrize("rule", sorted(RULES))
def test_next_task_trains_with_readme_values(rule):
    """Digits 0–4 for 10 passes, then 5–9 for 2: with ``next_task`` no step is skipped, no loss
    passes 10³, and task 2's accuracy is within 10 points of fine-tuning's."""
    x, y = digits()
    first, second = y < 5, y >= 5
    ends = {}
    for prior in (True, False):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
        opt = RULES[rule](model.parameters(), int(first.sum()))
        train(opt, model, x[first], y[first], passes=10, seed=1)
        if prior:
            opt.next_task(data_size=int(second.sum()))
        losses: list[float] = []
        train(opt, model, x[second], y[second], passes=2, seed=2, losses=losses)
        ends[prior] = accuracy(model, x[second], y[second])
        if prior:
            assert opt.skipped_steps == 0
            assert max(losses) < 1e3
    assert ends[True] >= ends[False] - 0.10, ends


def test_a_prior_keeps_the_old_task_better_than_fine_tuning():
    """Digits, then the same digits with their pixels permuted: task 1 is kept better with
    the posterior as prior than by fine-tuning."""
    x, y = digits()
    permuted = x[:, torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    kept = {}
    for prior in (True, False):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
        opt = RULES["affine"](model.parameters(), len(y))
        train(opt, model, x, y, passes=10, seed=1)
        if prior:
            opt.next_task(data_size=len(y))
        train(opt, model, permuted, y, passes=5, seed=2)
        kept[prior] = accuracy(model, x, y)
    assert kept[True] > kept[False] + 0.05, kept


def test_additive_prior_past_its_stable_step_is_refused():
    """The additive rule's posterior keeps the base's σ²: the README's lr = 0.05 with
    σ = 10⁻³ cannot take its pull; the error names the largest stable lr and strength."""
    x, y = digits()
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.05, data_size=901)
    train(opt, model, x[:200], y[:200], passes=1)
    with pytest.raises(ValueError, match=r"lower lr below 0\.03.*strength below 0\.6"):
        opt.next_task(data_size=896)
    stable = lgb.AdditiveBLR(model.parameters(), lr=0.01, data_size=901)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stable.next_task(data_size=896)  # lr·c = 11 < 38: taken


@pytest.mark.parametrize(
    "build",
    [
        lambda ps: lgb.AdditiveBLR(ps, data_size=10),
        lambda ps: lgb.MultiplicativeBLR(ps, data_size=10, init="auto"),
        lambda ps: lgb.AffineBLR(ps, data_size=10),
        lambda ps: lgb.LieGroupBLR(ps, lgb.groups.AdditiveGroup(), Normal(0.0, 0.1), data_size=10),
    ],
    ids=["additive", "multiplicative", "affine", "generic"],
)
def test_a_missing_lr_says_what_it_means(build):
    with pytest.raises(TypeError, match=r"BLR: lr is required: the step size|the shift's step"):
        build([nn.Parameter(torch.ones(3))])
