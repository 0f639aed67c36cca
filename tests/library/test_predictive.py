"""Predictive metrics against values computed by hand, and Bayesian model averaging."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from liegroup_blr import predictive

# Four 2-class predictions; labels 0, 1, 1, 0; predicted classes 0, 0, 1, 1 (2 correct).
PROBS = torch.tensor([[0.92, 0.08], [0.63, 0.37], [0.34, 0.66], [0.22, 0.78]], dtype=torch.float64)
LABELS = torch.tensor([0, 1, 1, 0])


def log(p: torch.Tensor) -> torch.Tensor:
    return p.log()


def test_accuracy_by_hand() -> None:
    assert predictive.accuracy(log(PROBS), LABELS) == 0.5
    assert predictive.accuracy(log(PROBS), torch.tensor([0, 0, 1, 1])) == 1.0


def test_nll_by_hand() -> None:
    expected = -(math.log(0.92) + math.log(0.37) + math.log(0.66) + math.log(0.22)) / 4
    assert predictive.nll(log(PROBS), LABELS) == pytest.approx(expected, rel=1e-12)


def test_brier_by_hand() -> None:
    # per example Σ_k (p_k − onehot_k)²: 2·0.08², 2·0.63², 2·0.34², 2·0.78²
    expected = (0.0128 + 0.7938 + 0.2312 + 1.2168) / 4
    assert predictive.brier(log(PROBS), LABELS) == pytest.approx(expected, rel=1e-12)
    three = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    assert predictive.brier(log(three), torch.tensor([2])) == pytest.approx(0.98)


def test_ece_each_example_in_its_own_bin() -> None:
    # confidences 0.92 (right), 0.63 (wrong), 0.66 (right), 0.78 (wrong): four different bins
    expected = (0.08 + 0.63 + 0.34 + 0.78) / 4
    assert predictive.ece(log(PROBS), LABELS) == pytest.approx(expected, rel=1e-12)


def test_ece_pools_examples_sharing_a_bin() -> None:
    # 0.61 (right) and 0.64 (wrong) share bin (0.60, 0.65]: accuracy 1/2, confidence 0.625
    probs = torch.tensor([[0.61, 0.39], [0.64, 0.36], [0.97, 0.03]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0])
    expected = (2 * abs(0.5 - 0.625) + abs(1 - 0.97)) / 3
    assert predictive.ece(log(probs), labels) == pytest.approx(expected, rel=1e-12)
    # with 2 bins all four examples of PROBS fall in (0.5, 1]: |0.5 − mean confidence|
    two_bins = abs(0.5 - (0.92 + 0.63 + 0.66 + 0.78) / 4)
    assert predictive.ece(log(PROBS), LABELS, bins=2) == pytest.approx(two_bins, rel=1e-12)


def test_reliability_bins_by_hand() -> None:
    hist = predictive.reliability_bins(log(PROBS), LABELS, bins=20)
    assert hist["count"].sum() == 4
    filled = torch.nonzero(hist["count"]).flatten().tolist()
    assert filled == [12, 13, 15, 18]  # (0.60,0.65], (0.65,0.70], (0.75,0.80], (0.90,0.95]
    assert hist["accuracy"][filled].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert hist["confidence"][filled].tolist() == pytest.approx([0.63, 0.66, 0.78, 0.92])
    assert hist["edges"][[0, 1, -1]].tolist() == pytest.approx([0.0, 0.05, 1.0])
    # a confidence of exactly 1/2 lies in the bin closed on the right, (0.25, 0.5] for 4 bins
    half = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    assert predictive.reliability_bins(log(half), torch.tensor([0]), 4)["count"].tolist() == [
        0,
        1,
        0,
        0,
    ]


def test_metrics_dict_and_shape_errors() -> None:
    out = predictive.metrics(log(PROBS), LABELS)
    assert set(out) == {"accuracy", "nll", "ece", "brier"}
    assert out["accuracy"] == 0.5
    with pytest.raises(ValueError, match="expected log_probs"):
        predictive.nll(log(PROBS), LABELS[:3])
    with pytest.raises(ValueError, match="bins"):
        predictive.ece(log(PROBS), LABELS, bins=0)


def test_log_mean_softmax_by_hand() -> None:
    # softmax([0, 0]) = (1/2, 1/2), softmax([ln 3, 0]) = (3/4, 1/4); mean (5/8, 3/8)
    logits = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]], dtype=torch.float64)
    out = predictive.log_mean_softmax(logits).exp()
    assert out[0].tolist() == pytest.approx([5 / 8, 3 / 8])


class _Bias(nn.Module):
    """Logits = bias, whatever the input (one row per input row)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(x.shape[0], 2)


class _TwoSamples:
    """Stands in for a BLR optimizer whose posterior alternates between two parameter values."""

    def __init__(self, model: _Bias, values: list[list[float]]) -> None:
        self.model, self.values, self.calls = model, values, 0

    @contextmanager
    def sampled_params(self) -> Iterator[None]:
        saved = self.model.bias.detach().clone()
        self.model.bias.data.copy_(torch.tensor(self.values[self.calls % len(self.values)]))
        self.calls += 1
        try:
            yield
        finally:
            self.model.bias.data.copy_(saved)


def test_model_average_by_hand() -> None:
    model = _Bias()
    opt = _TwoSamples(model, [[0.0, 0.0], [math.log(3.0), 0.0]])
    inputs = [torch.zeros(3, 1), torch.zeros(2, 1)]
    log_p = predictive.predictive_log_probs(model, inputs, opt, samples=2)
    assert opt.calls == 2  # one posterior sample per network, shared by all batches
    assert log_p.shape == (5, 2)
    assert log_p.exp()[:, 0].tolist() == pytest.approx([5 / 8] * 5)
    assert model.bias.tolist() == [0.0, 0.0]  # point estimate restored
    # without a sampler (SGD, Adam, None): the prediction at the current parameters
    point = predictive.predictive_log_probs(model, inputs, torch.optim.SGD(model.parameters(), 1))
    assert point.exp()[:, 0].tolist() == pytest.approx([0.5] * 5)
    with pytest.raises(ValueError, match="samples"):
        predictive.predictive_log_probs(model, inputs, opt, samples=0)


def test_model_average_nll_stays_finite_when_probabilities_underflow() -> None:
    model = _Bias()
    opt = _TwoSamples(model, [[1000.0, 0.0], [2000.0, 0.0]])
    log_p = predictive.predictive_log_probs(model, [torch.zeros(1, 1)], opt, samples=2)
    # log p(y=1) = log((e^-1000 + e^-2000)/2) ≈ −1000 − log 2
    assert predictive.nll(log_p, torch.tensor([1])) == pytest.approx(1000 + math.log(2))


# ---------------------------------------------------- optimizers inside wrappers
def _trained_affine() -> tuple[nn.Module, object]:
    import liegroup_blr as lgb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.1, data_size=50, seed=3)
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    return model, opt


class _Holder:
    """A wrapper that holds the optimizer as ``.optimizer`` and has no ``sampled_params``
    (as Lightning's LightningOptimizer and accelerate's AcceleratedOptimizer do)."""

    def __init__(self, optimizer: object) -> None:
        self.optimizer = optimizer


def _average_through(model: nn.Module, opt, wrapper: object) -> None:
    """The wrapper's model average is the optimizer's, from the same noise, not the point."""
    inputs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(1))]
    state = opt.state_dict()
    expected = predictive.predictive_log_probs(model, inputs, opt, samples=3)
    opt.load_state_dict(state)  # the same noise again
    got = predictive.predictive_log_probs(model, inputs, wrapper, samples=3)
    assert torch.equal(got, expected)
    assert not torch.equal(got, predictive.predictive_log_probs(model, inputs, None))


def test_a_wrapper_holding_the_optimizer_is_unwrapped() -> None:
    model, opt = _trained_affine()
    _average_through(model, opt, _Holder(_Holder(opt)))
    sgd = _Holder(torch.optim.SGD(model.parameters(), lr=1.0))  # no posterior: the point
    inputs = [torch.zeros(2, 3)]
    point = predictive.predictive_log_probs(model, inputs, sgd)
    assert torch.equal(point, predictive.predictive_log_probs(model, inputs, None))


def test_accelerates_optimizer_wrapper_is_unwrapped() -> None:
    accelerate = pytest.importorskip("accelerate")
    model, opt = _trained_affine()
    prepared, wrapped = accelerate.Accelerator(cpu=True).prepare(model, opt)
    assert not hasattr(wrapped, "sampled_params") and wrapped.optimizer is opt
    _average_through(prepared, opt, wrapped)
