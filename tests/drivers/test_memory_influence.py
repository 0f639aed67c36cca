"""The exact-Hessian predictions of leave-one-out (``experiments.memory.influence``) on tiny
affine and multiplicative runs: the Hessian is autograd's, the Newton step is the first-order
change of the minimiser, and with every draw at the mean it is the memory-perturbation
equation with the Laplace covariance."""

from __future__ import annotations

import pytest
import torch

from experiments.memory import converged as mc
from experiments.memory import influence as mi
from experiments.memory.maps import trained
from tests.drivers.test_memory_map_converged import MULTIPLICATIVE, tiny


def _converged(raw, tmp_path):
    configs, table = mc.resolve(raw)
    (label,) = configs
    cfg = configs[label][0]
    run = trained(cfg, tmp_path / "train")
    r = mc.RETRAINERS[cfg["optimizer"]["name"]](run, table, 0)
    r.retrain(None, torch.arange(2))
    return r, r.last


@pytest.fixture(scope="module")
def converged(tmp_path_factory):
    """A tiny affine run's retrainer at its converged control."""
    return _converged(tiny(), tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """A tiny multiplicative run's retrainer at its converged control (log g±)."""
    return _converged(tiny(MULTIPLICATIVE, samples=8), tmp_path_factory.mktemp("run"))


def test_the_hessian_is_autograds(converged):
    r, control = converged
    u, unflat = mi._flat(control)
    expected = torch.autograd.functional.hessian(lambda v: r.objective(unflat(v), None), u)
    torch.testing.assert_close(mi.hessian(r, control, block=7), expected, rtol=1e-10, atol=1e-12)


def _minimise(objective, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = {n: v.detach().clone().requires_grad_(True) for n, v in start.items()}
    opt = torch.optim.LBFGS(
        list(params.values()),
        max_iter=500,
        history_size=50,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-13,
        tolerance_change=1e-16,
    )

    def closure():
        opt.zero_grad()
        value = objective(params)
        value.backward()
        return value

    opt.step(closure)
    return {n: v.detach() for n, v in params.items()}


@pytest.mark.parametrize("which", ["converged", "scaled"])
def test_the_newton_step_is_the_first_order_change_of_the_minimiser(which, request):
    r, control = request.getfixturevalue(which)
    examples, w = [3, 20], 1e-2
    predicted = mi.predict(r, control, examples)
    assert predicted["positive_definite"]
    index = torch.tensor(examples)
    for row, i in enumerate(examples):
        # weigh example i by 1 ∓ w: the minimiser moves by ±w times the Newton step + O(w²);
        # the central difference cancels the O(w²) and what the control's own convergence
        # left (both retrainings start there)
        def weighted(params, sign, i=i):
            return r.objective(params, None) - sign * w * r.example_loss(params, i) / r.size

        lighter, heavier = (
            r.logits(_minimise(lambda p, k=k: weighted(p, k), control), index)[row]
            for k in (1.0, -1.0)
        )
        moved = (lighter - heavier) / (2 * w)
        torch.testing.assert_close(predicted["newton"][row], moved, rtol=0.01, atol=1e-6)
        # the memory map's simplifications give other numbers
        assert not torch.allclose(predicted["mean_field"][row], moved, rtol=0.1)


def test_with_the_draws_at_the_mean_the_newton_step_is_the_laplace_form(converged):
    r, control = converged
    at_mean = {n: torch.zeros_like(v) for n, v in r.noise.items()}
    saved, r.noise = r.noise, at_mean
    try:
        predicted = mi.predict(r, control, [0, 7])
    finally:
        r.noise = saved
    # ∇ℓ̄_i = J_iᵀ e_i when every draw is the mean: J (NH)⁻¹ Jᵀ e = J (NH)⁻¹ ∇ℓ_i
    torch.testing.assert_close(predicted["full"], predicted["newton"], rtol=1e-8, atol=1e-12)
    full, diagonal = predicted["full"], predicted["diagonal"]
    assert not torch.allclose(full, diagonal, rtol=1e-3)  # the cross-class terms matter
