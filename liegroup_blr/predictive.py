"""Bayesian model averaging and predictive metrics.

All metrics take **log** predictive probabilities ``log_probs`` of shape ``(N, K)``
(e.g. ``log_softmax(logits)`` or the output of :func:`predictive_log_probs`) and
integer labels ``labels`` of shape ``(N,)``. Working in log space keeps the NLL of a
model average finite where the averaged probabilities underflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from functools import partial

import torch
from torch import Tensor, nn

from .posterior import Posterior

__all__ = [
    "accuracy",
    "brier",
    "ece",
    "log_mean_softmax",
    "metrics",
    "nll",
    "predictive_log_probs",
    "reliability_bins",
]


def log_mean_softmax(logits: Tensor) -> Tensor:
    """Log of the averaged softmax over the leading sample axis.

    For logits ``(S, N, K)``: log (1/S) Σ_s softmax(logits_s) = logsumexp_s(log_softmax) − log S.
    """
    return torch.logsumexp(torch.log_softmax(logits, dim=-1), dim=0) - math.log(logits.shape[0])


@torch.no_grad()
def predictive_log_probs(
    model: nn.Module,
    inputs: Iterable[Tensor],
    optimizer: object | None = None,
    samples: int = 32,
) -> Tensor:
    """Log predictive probabilities of ``model`` on every batch of ``inputs``.

    With an optimizer that has ``sampled_params()`` (the Lie-group BLR optimizers, also
    inside a wrapper that holds one as ``.optimizer``, such as accelerate's
    ``AcceleratedOptimizer``) or a :class:`~liegroup_blr.Posterior`, this is the Bayesian
    model average of ``samples`` posterior samples θ_s = g·ξ_s,
    p(y|x) ≈ (1/S) Σ_s p(y|x, θ_s); each sample is one network used for all batches, so
    ``inputs`` must be re-iterable (a list, or a loader). Without one (``None`` or a
    deterministic optimizer such as SGD), it is the prediction at the current parameters.
    Returns a tensor ``(N, K)`` on the device of the model outputs.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    sampler = _sampler(model, optimizer)
    was_training = model.training
    model.eval()
    try:
        if sampler is None:
            return torch.cat([torch.log_softmax(model(x), dim=-1) for x in inputs])
        total: Tensor | None = None
        for _ in range(samples):
            with sampler():
                log_p = torch.cat([torch.log_softmax(model(x), dim=-1) for x in inputs])
            total = log_p if total is None else torch.logaddexp(total, log_p)
        assert total is not None
        return total - math.log(samples)
    finally:
        model.train(was_training)


def _sampler(
    model: nn.Module, source: object | None
) -> Callable[[], AbstractContextManager[object]] | None:
    """What draws a posterior sample into ``model``: a Posterior's ``sampled``, or the
    ``sampled_params`` of an optimizer or of the optimizer a wrapper holds as ``.optimizer``."""
    if isinstance(source, Posterior):
        return partial(source.sampled, model)
    for _ in range(8):  # wrappers of wrappers (accelerate, Lightning)
        if source is None or hasattr(source, "sampled_params"):
            break
        source = getattr(source, "optimizer", None)
    return getattr(source, "sampled_params", None)


def _check(log_probs: Tensor, labels: Tensor) -> None:
    if log_probs.ndim != 2 or labels.shape != log_probs.shape[:1]:
        raise ValueError(
            f"expected log_probs (N, K) and labels (N,), got {tuple(log_probs.shape)} "
            f"and {tuple(labels.shape)}"
        )


def accuracy(log_probs: Tensor, labels: Tensor) -> float:
    """Fraction of examples whose most probable class is the label."""
    _check(log_probs, labels)
    return (log_probs.argmax(dim=-1) == labels).double().mean().item()


def nll(log_probs: Tensor, labels: Tensor) -> float:
    """Mean negative log-likelihood −(1/N) Σ_i log p(y_i | x_i)."""
    _check(log_probs, labels)
    return -log_probs.gather(1, labels[:, None]).double().mean().item()


def brier(log_probs: Tensor, labels: Tensor) -> float:
    """Brier score (1/N) Σ_i Σ_k (p_ik − 1[y_i = k])², between 0 and 2."""
    _check(log_probs, labels)
    probs = log_probs.double().exp()
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return (probs - onehot).square().sum(dim=1).mean().item()


def reliability_bins(log_probs: Tensor, labels: Tensor, bins: int = 20) -> dict[str, Tensor]:
    """Confidence histogram over ``bins`` equal-width bins ((b−1)/B, b/B] of [0, 1].

    The confidence of an example is max_k p_ik; a confidence of exactly b/B falls in bin
    b (the right edge is closed). Returns float64 tensors of length ``bins``: ``count``,
    mean ``confidence`` and ``accuracy`` of the examples in each bin (0 for empty bins),
    and the bin ``edges`` (length ``bins + 1``).
    """
    _check(log_probs, labels)
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    conf, pred = log_probs.detach().double().exp().max(dim=1)
    conf, correct = conf.cpu(), (pred == labels).double().cpu()
    index = (torch.ceil(conf * bins).long() - 1).clamp(0, bins - 1)

    def bin_sum(values: Tensor) -> Tensor:
        return torch.zeros(bins, dtype=torch.float64).index_add_(0, index, values)

    count, conf_sum, correct_sum = bin_sum(torch.ones_like(conf)), bin_sum(conf), bin_sum(correct)
    safe = count.clamp_min(1.0)
    return {
        "count": count,
        "confidence": conf_sum / safe,
        "accuracy": correct_sum / safe,
        "edges": torch.linspace(0.0, 1.0, bins + 1, dtype=torch.float64),
    }


def ece(log_probs: Tensor, labels: Tensor, bins: int = 20) -> float:
    r"""Expected calibration error :math:`\sum_b (n_b / N)\,|\mathrm{acc}_b - \mathrm{conf}_b|` over
    equal-width bins."""
    hist = reliability_bins(log_probs, labels, bins)
    gap = (hist["accuracy"] - hist["confidence"]).abs()
    return (hist["count"] * gap).sum().item() / labels.shape[0]


def metrics(log_probs: Tensor, labels: Tensor, bins: int = 20) -> dict[str, float]:
    """Accuracy, NLL, ECE (``bins`` equal-width bins) and Brier score as a dict."""
    return {
        "accuracy": accuracy(log_probs, labels),
        "nll": nll(log_probs, labels),
        "ece": ece(log_probs, labels, bins),
        "brier": brier(log_probs, labels),
    }
