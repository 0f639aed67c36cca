"""The leave-one-out NLL estimated from the posterior alone (:func:`liegroup_blr.loo_nll`).

Where the answer is known: Bayesian linear regression with an orthogonal design, whose exact
posterior is the diagonal Gaussian a diagonal-affine posterior holds (``Regression`` of
``test_sensitivity``), against closed-form refits with each example removed.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import liegroup_blr as lgb
from liegroup_blr.memory_maps import LOO_FORMS, memory_map
from tests.library.test_sensitivity import F64, Regression, _affine_posterior, _classifier


def exact_loo(r: Regression) -> tuple[Tensor, Tensor, Tensor]:
    """Per example i, the exact leave-one-out posterior predictive of Bayesian linear
    regression, by refitting without i in closed form (full covariance): its mean, its
    variance (noise included) and the NLL of y_i under it."""
    means, variances = [], []
    for i in range(len(r.y)):
        keep = torch.arange(len(r.y)) != i
        X, y = r.X[keep], r.y[keep]
        H = X.T @ X / r.noise + r.delta * torch.eye(X.shape[1], dtype=F64)
        means.append(r.X[i] @ torch.linalg.solve(H, X.T @ y / r.noise))
        variances.append(r.X[i] @ torch.linalg.solve(H, r.X[i]) + r.noise)
    mean, var = torch.stack(means), torch.stack(variances)
    nll = 0.5 * (torch.log(2 * math.pi * var) + (r.y - mean) ** 2 / var)
    return mean, var, nll


def _loo(r: Regression, **options) -> Tensor:
    return lgb.loo_nll(
        r.model, r.posterior(), r.X, r.y, likelihood="gaussian", noise_variance=r.noise, **options
    )


@pytest.mark.parametrize("cross_class", [False, True])
def test_corrected_form_is_exact_leave_one_out_for_bayesian_linear_regression(cross_class):
    """Few examples (n = 20), so the leverage λv is large enough for the forms to differ."""
    r = Regression(n=20)
    _, _, exact = exact_loo(r)
    per_example = _loo(r, reduction="none", cross_class=cross_class)
    torch.testing.assert_close(per_example, exact, rtol=1e-9, atol=1e-12)
    mean = _loo(r, cross_class=cross_class)
    assert mean.ndim == 0
    torch.testing.assert_close(mean, exact.mean(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(_loo(r, reduction="sum"), exact.sum(), rtol=1e-9, atol=1e-12)


def test_first_order_form_misses_exact_leave_one_out_by_its_second_order_term():
    r = Regression(n=20)
    mean, var, exact = exact_loo(r)
    v = (r.X**2 * r.Sigma).sum(1)
    f = r.X @ r.m
    e, lam = (f - r.y) / r.noise, 1 / r.noise
    # the exact leave-one-out mean and variance, and what the first-order form keeps of them
    torch.testing.assert_close(mean, f + v * e / (1 - lam * v), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(var, v / (1 - lam * v) + r.noise, rtol=1e-9, atol=1e-12)
    first = _loo(r, form="first_order", reduction="none")
    mean1, var1 = f + v * e, v + r.noise
    by_hand = 0.5 * (torch.log(2 * math.pi * var1) + (r.y - mean1) ** 2 / var1)
    torch.testing.assert_close(first, by_hand, rtol=1e-12, atol=1e-14)
    # it misses the exact mean by v·e·λv/(1 − λv) and the variance by λv²/(1 − λv)
    torch.testing.assert_close(mean - mean1, v * e * lam * v / (1 - lam * v), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(var - var1, lam * v**2 / (1 - lam * v), rtol=1e-8, atol=1e-12)
    gap = (first - exact).abs()
    assert float(gap.max()) > 1e-4  # far above the corrected form's 1e-9
    assert float((first.mean() - exact.mean()).abs()) > 1e-5


def test_temperature_divides_the_variance_of_the_leave_one_out_estimate():
    r = Regression(n=20)
    _, _, exact = exact_loo(r)
    tempered = r.posterior(tau=0.25)
    got = lgb.loo_nll(
        r.model,
        tempered,
        r.X,
        r.y,
        likelihood="gaussian",
        noise_variance=r.noise,
        temperature=0.25,
        reduction="none",
    )
    torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["jacobian", "samples"])
@pytest.mark.parametrize("form", LOO_FORMS)
def test_categorical_estimate_is_the_nll_at_the_shifted_logits(method, form):
    """The categorical NLL is −log softmax at the shifted logits, from the memory map's own
    variances and residuals: f + v e/(1 − λv) (corrected) or f + v e (first order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(30, 4, dtype=F64)
    y = torch.randint(0, 3, (30,))
    post = _affine_posterior(model, scale=0.3)
    gen = torch.Generator().manual_seed(3)
    options = {"method": method, "samples": 16, "temperature": 0.5}
    got = lgb.loo_nll(model, post, x, y, form=form, reduction="none", generator=gen, **options)
    mm = memory_map(model, post, x, y, generator=torch.Generator().manual_seed(3), **options)
    p, v, e = mm.predictions, mm.variances, mm.residuals
    f = p.log()  # the logits up to a constant per example: the same softmax
    shift = v * e / (1 - (p - p**2) * v) if form == "corrected" else v * e
    expected = -torch.log_softmax(f + shift, -1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert float((v * (p - p**2)).max()) > 0.01  # the correction is not negligible here
    assert torch.isclose(
        lgb.loo_nll(
            model, post, x, y, form=form, generator=torch.Generator().manual_seed(3), **options
        ),
        expected.mean(),
        rtol=1e-10,
    )


def test_an_example_fitted_with_certainty_keeps_its_nll():
    """Residual 0: the leave-one-out prediction is the prediction itself, NLL 0."""
    model, x, y = _classifier(2000.0)
    post = _affine_posterior(model)
    got = lgb.loo_nll(model, post, x, y, reduction="none", method="jacobian")
    assert torch.equal(got, torch.zeros(3, dtype=F64))


def test_refusals_name_the_argument():
    r = Regression(n=20)
    with pytest.raises(ValueError, match=r"^form:"):
        _loo(r, form="second")
    with pytest.raises(ValueError, match=r"^reduction:"):
        _loo(r, reduction="max")
    with pytest.raises(ValueError, match=r"^form: the corrected"):  # λv ≥ 1
        _loo(r, temperature=1e-3)  # v/τ: a thousand times the exact variance
    with pytest.raises(ValueError, match=r"^form: the corrected"):
        _loo(r, temperature=1e-3, cross_class=True)
    assert torch.isfinite(_loo(r, temperature=1e-3, form="first_order"))


# ------------------------------------------------------------------ variance sources
class GeneralRegression:
    """Bayesian linear regression with a general (not orthogonal) design and a bias column
    (``bias=True``: an ``nn.Linear(d, 1)``), its weights at the exact posterior mean; the
    posterior held is a diagonal-affine one at that mean whose covariance is arbitrary (the
    Laplace sources read only the mean)."""

    def __init__(self, n: int = 20, d: int = 4, bias: bool = True) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, d, generator=gen, dtype=F64) @ torch.randn(
            d, d, generator=gen, dtype=F64
        )
        self.X = torch.cat([self.x, torch.ones(n, 1, dtype=F64)], 1) if bias else self.x
        self.noise, self.delta = 0.5, 2.0
        w = torch.randn(self.X.shape[1], generator=gen, dtype=F64)
        self.y = self.X @ w + math.sqrt(self.noise) * torch.randn(n, generator=gen, dtype=F64)
        H = self.X.T @ self.X / self.noise + self.delta * torch.eye(self.X.shape[1], dtype=F64)
        self.H, self.m = H, torch.linalg.solve(H, self.X.T @ self.y / self.noise)
        self.model = nn.Linear(d, 1, bias=bias).double()
        with torch.no_grad():
            self.model.weight.copy_(self.m[:d][None])
            if bias:
                self.model.bias.copy_(self.m[d:])
        self.post = _affine_posterior(self.model, scale=0.3)

    def loo(self, variance: str, **options) -> Tensor:
        return lgb.loo_nll(
            self.model,
            self.post,
            self.x,
            self.y,
            likelihood="gaussian",
            noise_variance=self.noise,
            variance=variance,
            prior_precision=self.delta,
            reduction="none",
            **options,
        )


@pytest.mark.parametrize("cross_class", [False, True])
@pytest.mark.parametrize("variance", ["ggn", "hessian", "kfac"])
def test_exact_sources_give_the_exact_leave_one_out_of_bayesian_linear_regression(
    variance, cross_class
):
    """A general design with a bias: the GGN (= the Hessian for a Gaussian likelihood) + δ,
    inverted, is the exact posterior precision, so the corrected form is the exact
    leave-one-out NLL; K-FAC of one linear layer with one output is exact there too (its
    output curvature 1/σ² is the same for every example, so the Kronecker factorisation
    loses nothing). The diagonal GGN and the rule's arbitrary covariance are not."""
    r = GeneralRegression()
    _, _, exact = exact_loo(r)
    got = r.loo(variance, cross_class=cross_class)
    torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-12)
    # (first order: the diagonal's λv reaches 1 for some example of this design)
    assert float((r.loo("diagonal_ggn", form="first_order") - exact).abs().max()) > 1e-3
    assert (
        float((r.loo("posterior", temperature=1.0, form="first_order") - exact).abs().max()) > 1e-3
    )


def test_laplace_variances_are_the_inverse_precisions_prediction_variance():
    """memory_map takes the same sources: v_i = x_iᵀ(XᵀX/σ² + δ)⁻¹x_i for the whole GGN, and
    with the diagonal of the precision for the diagonal GGN; neither depends on τ."""
    r = GeneralRegression(bias=False)
    options = dict(likelihood="gaussian", noise_variance=r.noise, prior_precision=r.delta)
    full = memory_map(r.model, r.post, r.x, r.y, variance="ggn", temperature=0.01, **options)
    v = (r.X @ torch.linalg.inv(r.H) * r.X).sum(1)
    torch.testing.assert_close(full.variances[:, 0], v, rtol=1e-10, atol=0)
    diag = memory_map(r.model, r.post, r.x, r.y, variance="diagonal_ggn", **options)
    torch.testing.assert_close(
        diag.variances[:, 0], (r.X**2 / r.H.diagonal()).sum(1), rtol=1e-10, atol=0
    )
    assert full.method == diag.method == "jacobian"


def test_diagonal_ggn_is_the_exact_ggn_for_an_orthogonal_design():
    """Orthogonal columns: the GGN XᵀX/σ² is diagonal, so its diagonal loses nothing; the
    rule's posterior (the exact diagonal Gaussian, divided by τ) agrees with both: the
    convention precision N·mean GGN + δ, untempered, is the affine rule's at convergence
    on a GLM with its covariance divided by τ."""
    r = Regression(n=20)
    _, _, exact = exact_loo(r)
    for variance in ("diagonal_ggn", "ggn", "kfac"):
        got = lgb.loo_nll(
            r.model,
            r.posterior(tau=0.25),
            r.X,
            r.y,
            likelihood="gaussian",
            noise_variance=r.noise,
            variance=variance,
            prior_precision=r.delta,
            reduction="none",
        )
        torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-12)
    rule = lgb.loo_nll(
        r.model,
        r.posterior(tau=0.25),
        r.X,
        r.y,
        likelihood="gaussian",
        noise_variance=r.noise,
        temperature=0.25,
        reduction="none",
    )
    torch.testing.assert_close(rule, exact, rtol=1e-9, atol=1e-12)


def test_data_size_scales_the_laplace_precision():
    """N·mean GGN + δ with N the posterior's recorded data size: twice the inputs' count
    doubles the GGN's part of the precision."""
    r = GeneralRegression(bias=False)
    post = lgb.Posterior(dict(r.post.items()), data_size=2 * len(r.y))
    got = lgb.memory_map(
        r.model,
        post,
        r.x,
        r.y,
        likelihood="gaussian",
        noise_variance=r.noise,
        variance="ggn",
        prior_precision=r.delta,
    ).variances[:, 0]
    H = 2 * r.X.T @ r.X / r.noise + r.delta * torch.eye(4, dtype=F64)
    torch.testing.assert_close(got, (r.X @ torch.linalg.inv(H) * r.X).sum(1), rtol=1e-10, atol=0)


def test_kfac_is_not_the_ggn_for_a_softmax_layer_or_two_layers():
    """Where the factorisation is an approximation (output curvature differing per example:
    a softmax; or two layers), K-FAC differs from the exact GGN: the exactness above is a
    property of the case, not of the code."""
    torch.manual_seed(0)
    x = torch.randn(40, 4, dtype=F64)
    y = torch.randint(0, 3, (40,))
    for model in (
        nn.Linear(4, 3).double(),
        nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double(),
    ):
        post = _affine_posterior(model)
        likelihood = (
            {"likelihood": "categorical"}
            if model.__class__ is nn.Linear
            else {"likelihood": "gaussian"}
        )
        targets = y if model.__class__ is nn.Linear else torch.randn(40, dtype=F64)
        each = {
            v: lgb.loo_nll(
                model,
                post,
                x,
                targets,
                variance=v,
                prior_precision=1.0,
                reduction="none",
                form="first_order",
                **likelihood,
            )
            for v in ("kfac", "ggn")
        }
        assert float((each["kfac"] - each["ggn"]).abs().max()) > 1e-4


def test_categorical_ggn_source_keeps_the_corrected_form_defined():
    """The exact GGN's precision holds each example's own curvature J_iᵀΛ_iJ_i, so the
    eigenvalues of Λ_iV_i stay below 1: with the cross-class terms (the whole Λ_i) the
    corrected form is defined at every δ, even where the rule's posterior (here a covariance
    far too wide, τ small) makes it undefined."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(30, 4, dtype=F64)
    y = torch.randint(0, 3, (30,))
    post = _affine_posterior(model, scale=3.0)
    with pytest.raises(ValueError, match=r"^form: the corrected"):
        lgb.loo_nll(model, post, x, y, temperature=1e-3, variance="posterior", cross_class=True)
    for delta in (1e-3, 1.0):
        got = lgb.loo_nll(
            model, post, x, y, variance="ggn", prior_precision=delta, cross_class=True
        )
        assert torch.isfinite(got)


def test_variance_source_refusals_name_the_argument():
    r = GeneralRegression()
    with pytest.raises(ValueError, match=r"^variance: must be one of"):
        r.loo("laplace")
    with pytest.raises(ValueError, match=r"^variance: must be one of"):
        memory_map(r.model, r.post, r.x, r.y, variance="laplace", likelihood="gaussian")
    with pytest.raises(ValueError, match=r"^prior_precision: a Posterior does not record"):
        lgb.loo_nll(r.model, r.post, r.x, r.y, variance="ggn", likelihood="gaussian")
    with pytest.raises(ValueError, match=r"^prior_precision: must be a number >= 0"):
        lgb.loo_nll(
            r.model,
            r.post,
            r.x,
            r.y,
            variance="ggn",
            prior_precision=-1.0,
            likelihood="gaussian",
        )
    conv = nn.Sequential(nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 1, 2), nn.Flatten()).double()
    with pytest.raises(ValueError, match=r"^variance: 'kfac' takes nn.Linear layers only"):
        lgb.loo_nll(
            conv,
            _affine_posterior(conv),
            r.x,
            torch.zeros(20, dtype=torch.long),
            variance="kfac",
            prior_precision=1.0,
        )
    with pytest.raises(ValueError, match=r"^variance: the 'hessian' precision"):  # δ = 0, bias
        lgb.loo_nll(
            r.model,
            r.post,
            torch.zeros(20, 4, dtype=F64),
            r.y,
            likelihood="gaussian",
            noise_variance=r.noise,
            variance="hessian",
            prior_precision=0.0,
        )
