"""Memory maps against known answers.

A linear-Gaussian model with an orthogonal design has a diagonal exact posterior, so the
diagonal affine group with a Gaussian base holds it exactly, and leaving an example out has a
closed form (Sherman–Morrison): the exact change of its prediction is v·e/(1 − λv), the
memory-perturbation estimate its first-order term v·e. The Monte-Carlo tolerances are five
standard errors of a sample variance of a Gaussian, √(2/(S − 1)) relative.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributions import Normal, StudentT

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac, Rayleigh
from liegroup_blr.groups import (
    DiagonalAffineGroup,
    FullAffineGroup,
    MultiplicativeGroup,
)
from liegroup_blr.memory_maps import memory_map, prediction_variance
from liegroup_blr.posterior import Posterior, PosteriorEntry

Z = 5.0
F64 = torch.float64


def mc_tolerance(samples: int) -> float:
    """Z standard errors of a sample variance, relative: Z·√(2/(S − 1))."""
    return Z * math.sqrt(2 / (samples - 1))


class Regression:
    """y = Xw + ε, ε ~ N(0, s²), prior N(0, 1/δ), X with orthogonal columns: the posterior
    N(m, Σ) has a diagonal Σ = 1/(diag XᵀX/s² + δ)."""

    def __init__(self, n: int = 200, scales: tuple[float, ...] = (3.0, 5.0, 8.0, 12.0)) -> None:
        gen = torch.Generator().manual_seed(0)
        d = len(scales)
        q, _ = torch.linalg.qr(torch.randn(n, d, generator=gen, dtype=F64))
        self.X = q * torch.tensor(scales, dtype=F64)
        self.noise, self.delta = 0.5, 2.0
        w = torch.randn(d, generator=gen, dtype=F64)
        self.y = self.X @ w + math.sqrt(self.noise) * torch.randn(n, generator=gen, dtype=F64)
        self.Sigma = 1 / ((self.X**2).sum(0) / self.noise + self.delta)
        self.m = self.Sigma * (self.X.T @ self.y) / self.noise
        self.model = nn.Linear(d, 1, bias=False).double()

    def posterior(self, scale: float = 0.5, tau: float = 1.0) -> Posterior:
        """The exact posterior (covariance times τ) as a diagonal-affine posterior with base
        N(0, scale²): A = √(τΣ)/scale, b = m."""
        A = (tau * self.Sigma).sqrt() / scale
        element = torch.stack((A[None], self.m[None]))
        entry = PosteriorEntry(
            element, DiagonalAffineGroup(), Normal(0.0, scale), torch.Size((1, 4))
        )
        return Posterior({"weight": entry})

    def refit_without(self, i: int) -> Tensor:
        """The exact posterior mean's prediction at x_i, fitted on every example but i."""
        keep = torch.arange(len(self.y)) != i
        X, y = self.X[keep], self.y[keep]
        H = X.T @ X / self.noise + self.delta * torch.eye(X.shape[1], dtype=F64)
        return self.X[i] @ torch.linalg.solve(H, X.T @ y / self.noise)


def test_linear_gaussian_estimate_is_the_first_order_term_of_the_exact_leave_one_out():
    r = Regression()
    mm = memory_map(r.model, r.posterior(), r.X, r.y, likelihood="gaussian", noise_variance=r.noise)
    assert mm.method == "jacobian"
    v = (r.X**2 * r.Sigma).sum(1)  # x_iᵀ Σ x_i
    f = r.X @ r.m
    e = (f - r.y) / r.noise
    lam = 1 / r.noise
    torch.testing.assert_close(mm.variances[:, 0], v, rtol=1e-12, atol=0)
    torch.testing.assert_close(mm.residuals[:, 0], e, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mm.predictions[:, 0], f, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mm.scores, (v * e).abs(), rtol=1e-12, atol=0)

    exact = torch.stack([r.refit_without(i) for i in range(len(r.y))]) - f
    torch.testing.assert_close(exact, v * e / (1 - lam * v), rtol=1e-9, atol=1e-12)
    # the estimate misses the exact change by its second-order part, v·e·λv/(1 − λv)
    second_order = v * e * lam * v / (1 - lam * v)
    torch.testing.assert_close(exact - v * e, second_order, rtol=1e-8, atol=1e-12)
    assert float((lam * v / (1 - lam * v)).max()) < 0.1  # leverage small: 10% at most


def test_temperature_divides_the_learned_covariance():
    r = Regression()
    exact = memory_map(r.model, r.posterior(), r.X, r.y, likelihood="gaussian", noise_variance=0.5)
    tempered = r.posterior(tau=0.006)
    right = memory_map(
        r.model, tempered, r.X, r.y, likelihood="gaussian", noise_variance=0.5, temperature=0.006
    )
    torch.testing.assert_close(right.scores, exact.scores, rtol=1e-10, atol=0)
    wrong = memory_map(r.model, tempered, r.X, r.y, likelihood="gaussian", noise_variance=0.5)
    torch.testing.assert_close(wrong.scores, 0.006 * exact.scores, rtol=1e-10, atol=0)
    assert torch.equal(wrong.scores.argsort(), exact.scores.argsort())  # rankings unchanged


def test_affine_rule_trained_at_a_temperature_gives_the_untempered_estimate():
    """AffineBLR at τ = 0.25 on the regression (antithetic pairs: the mean is exact, the scale
    fluctuates about its fixed point by about 10% in variance); the scores with τ read from
    the optimizer match the exact first-order change within 25% each, while forgetting τ would
    make them 4 times too small."""
    torch.manual_seed(0)
    r = Regression(n=50)
    nn.init.zeros_(r.model.weight)
    opt = lgb.AffineBLR(
        r.model.parameters(),
        lr=0.5,
        scale_lr=2.0,
        momentum=0.8,
        scale_momentum=0.9,
        data_size=50,
        temperature=0.25,
        prior_precision=r.delta,
        mc_samples=4,
        base=Normal(0.0, 0.1),
        antithetic=True,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k < 530 else 0.1)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = 0.5 * ((r.model(r.X)[:, 0] - r.y) ** 2).mean() / r.noise
        loss.backward()
        return loss

    for _ in range(800):
        opt.step(closure)
        schedule.step()
    scores = lgb.sensitivity(r.model, opt, r.X, r.y, likelihood="gaussian", noise_variance=0.5)
    exact = memory_map(r.model, r.posterior(), r.X, r.y, likelihood="gaussian", noise_variance=0.5)
    ratio = scores / exact.scores
    assert float((ratio - 1).abs().max()) < 0.25, ratio


def test_sample_variance_approaches_the_jacobian_form():
    r = Regression(n=40)
    post = r.posterior()
    S = 4000
    gen = torch.Generator().manual_seed(1)
    samples = memory_map(
        r.model,
        post,
        r.X,
        r.y,
        method="samples",
        samples=S,
        generator=gen,
        likelihood="gaussian",
        noise_variance=0.5,
    )
    jac = memory_map(r.model, post, r.X, r.y, likelihood="gaussian", noise_variance=0.5)
    rel = (samples.variances / jac.variances - 1).abs()
    assert float(rel.max()) < mc_tolerance(S)
    # the mean of the sample logits is the posterior mean's prediction within MC error
    sd = jac.variances[:, 0].sqrt() / math.sqrt(S)
    assert float(((samples.predictions - jac.predictions)[:, 0].abs() / sd).max()) < Z


@pytest.mark.slow
def test_nonlinear_network_sample_and_jacobian_forms_agree_for_a_narrow_posterior():
    """A tanh MLP under a posterior of standard deviation 1e-3: the network is linear over
    the posterior's width, so both forms estimate the same variances and scores."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x, y = torch.randn(30, 5, dtype=F64), torch.randint(0, 3, (30,))
    entries = {
        name: PosteriorEntry(
            torch.stack((0.5 + torch.rand_like(p), p.detach().clone())),
            DiagonalAffineGroup(),
            Normal(0.0, 1e-3),
            p.shape,
        )
        for name, p in model.named_parameters()
    }
    post = Posterior(entries)
    S = 4000
    samples = memory_map(
        model, post, x, y, method="samples", samples=S, generator=torch.Generator().manual_seed(0)
    )
    jac = memory_map(model, post, x, y, method="jacobian")
    tol = mc_tolerance(S)
    assert float((samples.variances / jac.variances - 1).abs().max()) < tol
    assert float((samples.scores / jac.scores - 1).abs().max()) < tol
    full_s = memory_map(
        model,
        post,
        x,
        y,
        method="samples",
        samples=S,
        cross_class=True,
        generator=torch.Generator().manual_seed(0),
    )
    full_j = memory_map(model, post, x, y, method="jacobian", cross_class=True)
    diag = torch.diagonal(full_j.variances, dim1=1, dim2=2)
    torch.testing.assert_close(diag, jac.variances, rtol=1e-10, atol=0)
    torch.testing.assert_close(
        torch.diagonal(full_s.variances, dim1=1, dim2=2), samples.variances, rtol=1e-10, atol=0
    )
    # cross terms: the sample covariance matches J Σ Jᵀ within MC error (relative to √(v_k v_l))
    scale = (diag[:, :, None] * diag[:, None, :]).sqrt()
    assert float(((full_s.variances - full_j.variances) / scale).abs().max()) < tol
    assert float((full_s.scores / full_j.scores - 1).abs().max()) < 2 * tol


def test_multiplicative_jacobian_form_is_the_variance_of_a_linear_model():
    """θ = g⁺ξ⁺ − g⁻ξ⁻ with Rayleigh(1) ξ: Var θ = (g⁺² + g⁻²)(2 − π/2), E θ = √(π/2)(g⁺ − g⁻);
    a linear model's logits have Var f = Σ x² Var θ exactly."""
    torch.manual_seed(0)
    model = nn.Linear(6, 1, bias=False).double()
    g = 0.1 + torch.rand(2, 1, 6, dtype=F64)
    post = Posterior(
        {
            "weight": PosteriorEntry(
                g, MultiplicativeGroup(), Rayleigh(torch.tensor(1.0, dtype=F64)), torch.Size((1, 6))
            )
        }
    )
    x, y = torch.randn(25, 6, dtype=F64), torch.randn(25, dtype=F64)
    var_theta = (g[0] ** 2 + g[1] ** 2) * (2 - math.pi / 2)
    jac = memory_map(model, post, x, y, method="jacobian", likelihood="gaussian")
    torch.testing.assert_close(jac.variances, x**2 @ var_theta.T, rtol=1e-12, atol=0)
    mean = math.sqrt(math.pi / 2) * (g[0] - g[1])
    torch.testing.assert_close(jac.predictions, x @ mean.T, rtol=1e-12, atol=1e-14)
    S = 4000
    auto = memory_map(
        model,
        post,
        x,
        y,
        samples=S,
        likelihood="gaussian",
        generator=torch.Generator().manual_seed(0),
    )
    assert auto.method == "samples"  # a multiplicative posterior is not Gaussian
    assert float((auto.variances / jac.variances - 1).abs().max()) < Z * math.sqrt(
        (2 + 0.25) / (S - 1)  # sum of Rayleigh terms: excess kurtosis ≈ 0.25 or less
    )


def _classifier(margin: float) -> tuple[nn.Module, Tensor, Tensor]:
    """A linear classifier whose logits for the three one-hot inputs are ``margin`` at the
    label and 0 elsewhere; at 2000, softmax gives exactly one-hot probabilities in float64."""
    model = nn.Linear(3, 3, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(margin * torch.eye(3, dtype=F64))
    return model, torch.eye(3, dtype=F64), torch.tensor([0, 1, 2])


def _affine_posterior(model: nn.Module, scale: float = 0.1) -> Posterior:
    return Posterior(
        {
            name: PosteriorEntry(
                torch.stack((torch.ones_like(p), p.detach().clone())),
                DiagonalAffineGroup(),
                Normal(0.0, scale),
                p.shape,
            )
            for name, p in model.named_parameters()
        }
    )


@pytest.mark.parametrize("method", ["jacobian", "samples"])
def test_an_example_fitted_with_certainty_scores_zero(method):
    """Residual 0 at the label: score 0 whatever the variance. Against the label with a
    saturated softmax, λ = p − p² = 0 and the probability score is 0 as well (the
    probabilities do not move to first order) while the logit score (the default) is not;
    unsaturated, a misfit example scores above 0 with either."""
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    model, x, y = _classifier(2000.0)
    post = _affine_posterior(model)
    mm = memory_map(model, post, x, y, method=method, generator=gen())
    assert torch.equal(mm.scores, torch.zeros(3, dtype=F64))
    assert torch.equal(mm.residuals, torch.zeros(3, 3, dtype=F64))
    assert bool((mm.variances > 0).all())  # not for want of variance: the residual is 0
    others = torch.tensor([1, 1, 1])
    saturated = memory_map(
        model, post, x, others, method=method, generator=gen(), change="probabilities"
    )
    assert torch.equal(saturated.scores, torch.zeros(3, dtype=F64))
    assert bool((saturated.residuals[[0, 2]].abs().sum(1) == 2).all())
    logits = memory_map(model, post, x, others, method=method, generator=gen())  # the default
    torch.testing.assert_close(
        logits.scores, (logits.variances * logits.residuals).abs().sum(1), rtol=1e-12, atol=0
    )
    assert bool((logits.scores[[0, 2]] > 0).all())  # the logits would move
    model, x, y = _classifier(2.0)
    post = _affine_posterior(model)
    for change in ("probabilities", "logits"):
        wrong = memory_map(model, post, x, others, method=method, generator=gen(), change=change)
        right = memory_map(model, post, x, y, method=method, generator=gen(), change=change)
        assert bool((wrong.scores[[0, 2]] > 3 * right.scores[[0, 2]]).all())


def test_a_posterior_without_variance_scores_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(10, 4, dtype=F64), torch.randint(0, 3, (10,))
    post = Posterior(
        {
            n: PosteriorEntry(p.detach().clone(), lgb.groups.AdditiveGroup(), Dirac(0.0), p.shape)
            for n, p in model.named_parameters()
        }
    )
    assert torch.equal(lgb.sensitivity(model, post, x, y), torch.zeros(10, dtype=F64))


@pytest.mark.parametrize("method", ["jacobian", "samples"])
@pytest.mark.parametrize("cross_class", [False, True])
def test_batched_equals_unbatched(method, cross_class):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(23, 4, dtype=F64), torch.randint(0, 3, (23,))
    post = _affine_posterior(model, scale=0.2)
    runs = [
        memory_map(
            model,
            post,
            x,
            y,
            method=method,
            samples=16,
            batch_size=b,
            cross_class=cross_class,
            generator=torch.Generator().manual_seed(3),
        )
        for b in (1, 7, 23, 100)
    ]
    one_by_one = [
        memory_map(
            model,
            post,
            x[i : i + 1],
            y[i : i + 1],
            method=method,
            samples=16,
            cross_class=cross_class,
            generator=torch.Generator().manual_seed(3),
        )
        for i in range(len(y))
    ]
    loop = {k: torch.cat([getattr(m, k) for m in one_by_one]) for k in ("scores", "variances")}
    for mm in runs:
        for key in ("scores", "variances", "residuals", "predictions"):
            torch.testing.assert_close(getattr(mm, key), getattr(runs[0], key), rtol=1e-12, atol=0)
        torch.testing.assert_close(mm.scores, loop["scores"], rtol=1e-12, atol=0)
        torch.testing.assert_close(mm.variances, loop["variances"], rtol=1e-12, atol=0)


def test_model_parameters_and_mode_are_left_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    before = [p.detach().clone() for p in model.parameters()]
    post = _affine_posterior(model)
    model.train()
    for method in ("jacobian", "samples"):
        a = memory_map(model, post, x, y, method=method, generator=torch.Generator().manual_seed(0))
        b = memory_map(model, post, x, y, method=method, generator=torch.Generator().manual_seed(0))
        assert torch.equal(a.scores, b.scores)  # eval mode: dropout off, same samples
    assert model.training
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def _trained(optimizer_cls, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    opt = optimizer_cls(model.parameters(), data_size=32, **kw)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return model, opt, x, y


class Wrapper:
    """What accelerate and Lightning hand out: the optimizer as ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def test_an_optimizer_or_a_wrapper_is_read_as_its_posterior_and_temperature():
    model, opt, x, y = _trained(lgb.AffineBLR, lr=0.1, scale_lr=0.05, temperature=0.5)
    post = Posterior.from_optimizer(opt, model)
    expected = lgb.sensitivity(model, post, x, y, temperature=0.5)
    assert torch.equal(lgb.sensitivity(model, opt, x, y), expected)
    assert torch.equal(lgb.sensitivity(model, Wrapper(opt), x, y), expected)
    assert torch.equal(lgb.sensitivity(model, opt, x, y, temperature=1.0), 0.5 * expected)

    model, opt, x, y = _trained(lgb.MultiplicativeBLR, lr=1.0, temperature=0.006, init="auto")
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    mm = memory_map(model, opt, x, y, generator=gen())
    assert mm.method == "samples"
    post = Posterior.from_optimizer(opt, model)
    same = memory_map(model, post, x, y, generator=gen(), temperature=0.006)
    assert torch.equal(mm.scores, same.scores)


def test_prediction_variance_needs_no_targets_and_matches_the_memory_map():
    model, opt, x, y = _trained(lgb.AffineBLR, lr=0.1, scale_lr=0.05)
    v = prediction_variance(model, opt, x, batch_size=5)
    torch.testing.assert_close(v, memory_map(model, opt, x, y).variances, rtol=1e-6, atol=0)
    assert v.shape == (32, 3)


def test_refusals_name_the_argument():
    model, opt, x, y = _trained(lgb.AffineBLR, lr=0.1, scale_lr=0.05)
    post = Posterior.from_optimizer(opt, model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(posterior=sgd), "posterior"),
        (dict(method="laplace"), "method"),
        (dict(samples=1, method="samples"), "samples"),
        (dict(batch_size=0), "batch_size"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(likelihood="poisson"), "likelihood"),
        (dict(change="loss"), "change"),
        (dict(noise_variance=2.0), "noise_variance"),
        (dict(targets=y[:5]), "targets"),
        (dict(targets=y.double()), "targets"),
        (dict(targets=y + 3), "targets"),
        (dict(model=nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))), "model"),
        (dict(model=nn.Linear(4, 3)), "model"),
    ]
    for change, name in cases:
        args = dict(model=model, posterior=post, inputs=x, targets=y) | change
        with pytest.raises(ValueError, match=f"^{name}: "):
            lgb.sensitivity(
                args.pop("model"),
                args.pop("posterior"),
                args.pop("inputs"),
                args.pop("targets"),
                **args,
            )


def test_jacobian_form_refuses_what_gives_no_diagonal_covariance():
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))
    heavy = Posterior(
        {
            n: PosteriorEntry(
                torch.stack((torch.ones_like(p), p.detach().clone())),
                DiagonalAffineGroup(),
                StudentT(2.0),
                p.shape,
            )
            for n, p in model.named_parameters()
        }
    )
    with pytest.raises(ValueError, match=r"^method: .*infinite variance"):
        lgb.sensitivity(model, heavy, x, y, method="jacobian")
    assert memory_map(model, heavy, x, y).method == "samples"
    G = FullAffineGroup()
    bias = PosteriorEntry(
        G.identity(torch.Size((2,)), dtype=torch.float32), G, Normal(0.0, 1.0), torch.Size((2,))
    )
    full = Posterior({"bias": bias})
    with pytest.raises(ValueError, match=r"^method: .*FullAffineGroup"):
        lgb.sensitivity(model, full, x, y, method="jacobian")
    assert lgb.sensitivity(model, full, x, y, samples=4).shape == (4,)


def _flipped_and_ambiguous(margin: float = 8.0) -> tuple[nn.Module, Tensor, Tensor]:
    """A linear classifier (``_classifier``) on 30 unit-norm inputs: 24 one-hot inputs with
    their class as label, 3 one-hot inputs with a flipped label (indices 0, 1, 2: the model is
    sure and wrong), and 3 inputs halfway between two classes (indices 3, 4, 5: p ≈ ½ at the
    label). Every input has norm 1, so under a posterior of equal spread s² every logit has
    the same variance s² and the scores differ by the residuals alone."""
    model, eye, _ = _classifier(margin)
    classes = torch.arange(24) % 3
    halfway = (eye + eye.roll(1, 0)) / math.sqrt(2)  # between classes c and c − 1
    x = torch.cat([eye, halfway, eye[classes]])
    y = torch.cat([(torch.arange(3) + 1) % 3, torch.arange(3), classes])
    return model, x, y


@pytest.mark.parametrize("method", ["jacobian", "samples"])
@pytest.mark.parametrize("cross_class", [False, True])
def test_the_logit_score_puts_flipped_labels_first_the_probability_score_does_not(
    method, cross_class
):
    """Flipped: ‖e‖₁ ≈ 2 but λ ≈ 0 (saturated). Halfway: ‖e‖₁ ≈ 1 and λ ≈ ¼. So the change
    of the logits (≈ s²‖e‖₁) ranks the 3 flipped labels highest, and the change of the
    probabilities ranks the 3 halfway examples highest, the flipped ones below them."""
    model, x, y = _flipped_and_ambiguous()
    post = _affine_posterior(model, scale=0.1)

    def top3(change: str) -> set[int]:
        mm = memory_map(
            model,
            post,
            x,
            y,
            method=method,
            cross_class=cross_class,
            change=change,
            samples=400,
            generator=torch.Generator().manual_seed(0),
        )
        return set(mm.scores.argsort(descending=True)[:3].tolist())

    assert top3("logits") == {0, 1, 2}
    assert top3("probabilities") == {3, 4, 5}


def test_regions_on_constructed_errors_and_variances():
    """Ten two-class examples with residual sizes ‖e‖₁ = 2a and total variances chosen: the
    0.9-quantile of nine 1s and one 10 is 1.9, so only the last is uncertain (its error
    does not matter); of the rest, those with ‖e‖₁ > 1 are unpredictable."""
    error = torch.tensor([0.1, 0.2, 1.5, 1.8, 0.3, 1.9, 0.1, 0.2, 0.4, 1.9], dtype=F64)
    a = error[:, None] / 2
    total = torch.tensor([1.0] * 9 + [10.0], dtype=F64)
    mm = lgb.MemoryMap(
        scores=torch.zeros(10, dtype=F64),
        variances=total[:, None].expand(10, 2) / 2,
        residuals=torch.cat([-a, a], 1),
        predictions=torch.full((10, 2), 0.5, dtype=F64),
        method="jacobian",
    )
    torch.testing.assert_close(mm.prediction_error, error, rtol=1e-15, atol=0)
    torch.testing.assert_close(mm.total_variance, total, rtol=1e-15, atol=0)
    named = [lgb.memory_maps.REGIONS[r] for r in mm.regions().tolist()]
    regular, unpredictable, uncertain = "regular", "unpredictable", "uncertain"
    assert named[:5] == [regular, regular, unpredictable, unpredictable, regular]
    assert named[5:] == [unpredictable, regular, regular, regular, uncertain]
    lower = [lgb.memory_maps.REGIONS[r] for r in mm.regions(error_threshold=0.35).tolist()]
    assert [i for i, r in enumerate(lower) if r == unpredictable] == [2, 3, 5, 8]
    assert (mm.regions(variance_quantile=0.5) == 2).tolist() == [False] * 9 + [True]
    full = lgb.MemoryMap(  # covariances [n, K, K]: the total variance is their trace
        mm.scores, torch.diag_embed(mm.variances) + 0.3, mm.residuals, mm.predictions, "jacobian"
    )
    torch.testing.assert_close(full.total_variance, total + 0.6, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="variance_quantile"):
        mm.regions(variance_quantile=1.0)
    with pytest.raises(ValueError, match="error_threshold"):
        mm.regions(error_threshold=0.0)


def test_a_categorical_prediction_error_is_twice_the_probability_missing_at_the_label():
    model, x, y = _flipped_and_ambiguous(margin=2.0)
    mm = memory_map(model, _affine_posterior(model), x, y)
    p_label = mm.predictions.gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(mm.prediction_error, 2 * (1 - p_label), rtol=1e-12, atol=0)


def test_the_old_module_name_warns_and_gives_the_same_functions() -> None:
    """``liegroup_blr.memory`` is the deprecated name of ``liegroup_blr.memory_maps``: importing
    it (or reading ``lgb.memory``) warns at the importing line and gives the same objects;
    ``import liegroup_blr`` does not import it."""
    code = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("error")
        import liegroup_blr as lgb
        assert "liegroup_blr.memory" not in sys.modules
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            regions = lgb.memory.REGIONS  # before the import, which sets the attribute
            from liegroup_blr.memory import REGIONS, sensitivity
        assert sensitivity is lgb.memory_maps.sensitivity and regions is REGIONS
        assert [w.category for w in caught] == [DeprecationWarning] * 2, caught
        assert all(w.filename == "<string>" for w in caught), [w.filename for w in caught]
        assert all("liegroup_blr.memory_maps" in str(w.message) for w in caught)
        """
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )
