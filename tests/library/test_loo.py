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
from liegroup_blr.memory import LOO_FORMS, memory_map
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
