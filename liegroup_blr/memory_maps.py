r"""Memory maps: how much each training example's prediction would change if it were removed.

The memory-perturbation equation (Nickl, Xu, Tailor, Möllenhoff, Khan, NeurIPS 2023): under a
posterior with covariance :math:`\Sigma`, leaving example :math:`i` out of training moves its
logits :math:`f_i` by about

.. math:: f_i^{\setminus i} - f_i \approx V_i\, e_i, \qquad
          V_i = J_i \Sigma J_i^\top, \qquad e_i = \nabla_{f}\, \ell_i ,

(:math:`J_i` the Jacobian of the logits, :math:`e_i = p_i - y_i` for a softmax likelihood), and
its probabilities by :math:`\Lambda_i V_i e_i` with :math:`\Lambda_i = \operatorname{diag}(p_i)
- p_i p_i^\top`. The scores keep the diagonals, :math:`v_i = \operatorname{diag} V_i` (the
prediction variance) and :math:`\lambda_i = p_i - p_i^2`: by default the change of the logits,
prediction error times prediction variance,

.. math:: s_i = \sum_k |v_{ik}\, e_{ik}| ,

or (``change="probabilities"``) the paper's change of the probabilities,
:math:`\sum_k |e_{ik}\lambda_{ik}v_{ik}|`, which vanishes where the softmax saturates.

:func:`loo_nll` turns the same quantities into the leave-one-out NLL of the training set,
estimated from the posterior alone (the paper's model-selection criterion).

The prediction variance :math:`v_i` comes from the Jacobian form or from posterior samples
(:data:`METHODS`), or from a Laplace posterior at the mean (:data:`VARIANCES`). A rule
trained at temperature :math:`\tau` learns about :math:`\tau` times the posterior covariance;
the equation needs the untempered one, so :math:`V_i` is divided by :math:`\tau`.
``docs/memory_maps.md`` says which method fits which group and why, and how
the scores compare with leave-one-out retraining.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ._laplace import jacobian_batch, laplace_moments, laplace_prior
from .posterior import Posterior, PosteriorEntry, unwrap

__all__ = [
    "LIKELIHOODS",
    "METHODS",
    "REGIONS",
    "VARIANCES",
    "MemoryMap",
    "loo_nll",
    "memory_map",
    "prediction_variance",
    "sensitivity",
]

METHODS = ("auto", "jacobian", "samples")
"""Estimates of the prediction variance. ``"jacobian"`` (:math:`\\operatorname{diag}
J\\Sigma J^\\top` at the posterior mean, for the additive, diagonal affine and multiplicative
groups), ``"samples"`` (the sample variance of the logits, any group), ``"auto"`` (the
Jacobian form for the additive and diagonal affine groups, else samples)."""

REGIONS = ("regular", "unpredictable", "uncertain")
"""The regions of a memory map (:meth:`MemoryMap.regions`), by index: ``"regular"`` (small
prediction error and variance), ``"unpredictable"`` (large error, small variance: the model
is sure and wrong), ``"uncertain"`` (large variance, whatever the error)."""

LOO_FORMS = ("corrected", "first_order")
"""Forms of the leave-one-out prediction of :func:`loo_nll`: ``"corrected"`` (the default,
:math:`f_i + V_i(I - \\Lambda_i V_i)^{-1}e_i`, exact for Bayesian linear regression) and
``"first_order"`` (the memory-perturbation equation's :math:`f_i + V_i e_i`)."""

VARIANCES = ("posterior", "diagonal_ggn", "kfac", "ggn", "hessian")
"""Sources of the prediction variance :math:`V_i = J_i\\Sigma J_i^\\top` of :func:`loo_nll` and
:func:`memory_map` (``variance=``): ``"posterior"`` (the rule's own posterior divided by τ, by
``method``), or a Laplace posterior at the trained mean with precision :math:`N\\bar H +
\\delta I`, :math:`\\bar H` the mean over the inputs given (the training set) of
``"diagonal_ggn"`` (the diagonal of the GGN :math:`J_i^\\top\\Lambda_iJ_i`), ``"kfac"`` (its
K-FAC per ``nn.Linear`` layer), ``"ggn"`` (the whole GGN, inverted) or ``"hessian"`` (the
Hessian of the loss, inverted); ``"ggn"`` and ``"hessian"`` for nets of at most 20,000
parameters."""

DEFAULT_VARIANCE = "posterior"
"""The variance source :func:`loo_nll` takes by default."""
REDUCTIONS = ("mean", "sum", "none")
LIKELIHOODS = ("categorical", "gaussian")
"""Likelihoods of the outputs (``likelihood=`` here and of
:class:`~liegroup_blr.MemorablePast`): ``"categorical"`` (softmax over the logits) and
``"gaussian"`` (the predicted mean, noise variance σ²)."""
CHANGES = ("probabilities", "logits")


@dataclass(frozen=True)
class MemoryMap:
    """A memory map of ``n`` examples with ``K`` outputs (:func:`memory_map`).

    Attributes:
        scores: ``[n]``, the estimated change of each example's prediction if it were
            removed from training: :math:`\\sum_k |v_{ik}e_{ik}|`, the L1 change of its
            logits (of its predicted mean for a Gaussian likelihood), or with
            ``change="probabilities"`` :math:`\\sum_k |e_{ik}\\lambda_{ik}v_{ik}|`, of its
            probabilities; with ``cross_class`` the L1 norm of :math:`V_i e_i` (of
            :math:`\\Lambda_i V_i e_i`).
        variances: ``[n, K]`` prediction variances :math:`v_i` of the logits (untempered:
            divided by τ), or ``[n, K, K]`` covariances :math:`V_i` with ``cross_class``.
        residuals: ``[n, K]`` :math:`e_i = \\nabla_f \\ell_i`: :math:`p_i - y_i`, or
            :math:`(f_i - y_i)/\\sigma^2` for a Gaussian likelihood of noise variance σ².
        predictions: ``[n, K]`` the prediction the residuals are taken at: the
            probabilities :math:`p_i` (softmax of the mean logits), or the mean :math:`f_i`.
        method: ``"jacobian"`` or ``"samples"``, the one used.
    """

    scores: Tensor
    variances: Tensor
    residuals: Tensor
    predictions: Tensor
    method: str

    @property
    def prediction_error(self) -> Tensor:
        r"""``[n]`` the size of each residual, :math:`\|e_i\|_1`: the map's horizontal axis.
        With one-hot labels it is :math:`2(1 - p_{i,y_i})`, so 1 is where the label gets
        half the probability."""
        return self.residuals.abs().sum(-1)

    @property
    def total_variance(self) -> Tensor:
        r"""``[n]`` the total prediction variance :math:`\operatorname{tr} V_i = \sum_k
        v_{ik}`: the map's vertical axis."""
        v = self.variances
        return (v.diagonal(dim1=-2, dim2=-1) if v.ndim == 3 else v).sum(-1)

    def regions(self, error_threshold: float = 1.0, variance_quantile: float = 0.9) -> Tensor:
        """``[n]`` each example's region, an index into :data:`REGIONS`: ``"uncertain"`` where
        :attr:`total_variance` exceeds its ``variance_quantile`` over the map's examples,
        else ``"unpredictable"`` where :attr:`prediction_error` exceeds ``error_threshold``
        (default 1: the label gets less than half the probability), else ``"regular"``."""
        if not 0 < variance_quantile < 1:
            raise ValueError(f"variance_quantile: must lie in (0, 1), got {variance_quantile!r}")
        if not error_threshold > 0:
            raise ValueError(f"error_threshold: must be > 0, got {error_threshold!r}")
        variance = self.total_variance.double()
        uncertain = variance > torch.quantile(variance, variance_quantile)
        unpredictable = self.prediction_error > error_threshold
        region = torch.where(unpredictable, REGIONS.index("unpredictable"), 0)
        return torch.where(uncertain, REGIONS.index("uncertain"), region)


# ------------------------------------------------------------------------ public
def sensitivity(
    model: nn.Module, posterior: Posterior | Any, inputs: Tensor, targets: Tensor, **options: Any
) -> Tensor:
    r"""Memory-map scores: per example, the estimated change of its logits if it were removed
    from training, :math:`\sum_k |v_{ik}e_{ik}|`: prediction variance times prediction error
    (a tensor ``[n]``; ``change="probabilities"`` for the change of its probabilities).

    The scores of :func:`memory_map`, which takes the same arguments and also returns the
    prediction variances and residuals they are built from: ``memory_map(model, posterior,
    inputs, targets, **options).scores``.

    Args:
        options: the keywords of :func:`memory_map`: ``samples``, ``batch_size``,
            ``generator``, ``temperature``, ``method``, ``cross_class``, ``change``,
            ``likelihood``, ``noise_variance``, ``variance``, ``prior_precision``.
    """
    return memory_map(model, posterior, inputs, targets, **options).scores


def memory_map(
    model: nn.Module,
    posterior: Posterior | Any,
    inputs: Tensor,
    targets: Tensor,
    *,
    samples: int = 64,
    batch_size: int = 256,
    generator: torch.Generator | None = None,
    temperature: float | None = None,
    method: str = "auto",
    cross_class: bool = False,
    change: str = "logits",
    likelihood: str = "categorical",
    noise_variance: float = 1.0,
    variance: str = "posterior",
    prior_precision: float | None = None,
) -> MemoryMap:
    r"""The memory map of ``(inputs, targets)`` under ``posterior``: scores, prediction
    variances, residuals and predictions (:class:`MemoryMap`).

    Batches of ``batch_size`` examples go through the model at once (no loop per example);
    memory grows with ``batch_size`` times the number of parameters (``"jacobian"``, times
    the number of outputs K with ``cross_class``) or times ``samples × K`` (``"samples"``),
    not with ``n``. Every batch sees the same ``samples`` posterior samples, so the result
    does not depend on ``batch_size``. Computed on the device of the model's parameters
    (batches are moved there); returned there.

    Args:
        model: the network; its parameters are the posterior's (by name, or by position
            for a posterior taken without a model). Run in eval mode, restored after.
        posterior: a :class:`~liegroup_blr.Posterior`, or a Lie-group BLR optimizer (or a
            wrapper of one, see :func:`liegroup_blr.optim.unwrap`), read with
            :meth:`Posterior.from_optimizer <liegroup_blr.Posterior.from_optimizer>`.
        inputs: ``[n, ...]`` model inputs.
        targets: ``[n]`` integer labels (categorical), or ``[n]`` / ``[n, K]`` values
            (Gaussian).
        samples: posterior samples for ``method="samples"`` (at least 2); the relative
            standard error of a sample variance is about √(2/(samples − 1)).
        batch_size: examples per batch.
        generator: draws the samples (default: a generator seeded from torch's global one,
            so ``torch.manual_seed`` makes the result reproducible).
        temperature: τ the posterior was trained at; the covariance is divided by it. Default:
            the one the optimizer's param groups hold, or the one the Posterior recorded
            (:attr:`Posterior.temperature <liegroup_blr.Posterior.temperature>`: the same
            value, also after a save and load). Given, it wins. Rankings do not depend on it,
            magnitudes do.
        method: ``"jacobian"``, ``"samples"`` or ``"auto"``: the Jacobian form where every
            entry is additive or diagonal affine with a finite-variance base, else samples.
        cross_class: keep the cross-class terms: :math:`\|V_i e_i\|_1` (or
            :math:`\|\Lambda_i V_i e_i\|_1`) with the full :math:`V_i` and :math:`\Lambda_i`
            instead of their diagonals.
        change: what the score measures: ``"logits"`` (the default,
            :math:`\sum_k |v_{ik}e_{ik}|`, the estimated change of the logits) or
            ``"probabilities"`` (the paper's score, through λ = p − p², which vanishes where
            the softmax saturates: a confidently misclassified example scores about 0). For
            a Gaussian likelihood the prediction is the mean f and both are
            :math:`\sum_k |v_{ik}e_{ik}|`.
        likelihood: ``"categorical"`` (softmax over the last output axis) or ``"gaussian"``
            (loss :math:`(f - y)^2/2\sigma^2`).
        noise_variance: σ² of the Gaussian likelihood.
        variance: where :math:`V_i` comes from, one of :data:`VARIANCES`: ``"posterior"``
            (the default, the rule's own divided by τ) or a Laplace posterior at the mean
            (see :func:`loo_nll`; ``inputs`` are then the training set the GGN is summed over).
        prior_precision: δ of a Laplace source (default: the optimizer's).

    Raises:
        ValueError: naming the argument, for a deterministic optimizer, a model that does not
            hold the posterior's parameters, an unknown method or likelihood, a group or base
            the Jacobian form cannot take, τ ≤ 0, too few samples, or targets that do not fit.
    """
    batches, method, source = _batches(
        model, posterior, inputs, targets, temperature, method, variance
    )
    _check_options(inputs, targets, samples, batch_size, likelihood, noise_variance, change)
    options = (samples, batch_size, generator, cross_class, likelihood, noise_variance)
    parts: list[tuple[Tensor, ...]] = []
    for y, f, V in batches(*options, prior_precision):
        parts.append((*_score(f, V, y, likelihood, noise_variance, change), V))
    scores, residuals, predictions, variances = (torch.cat(t) for t in zip(*parts, strict=True))
    return MemoryMap(
        scores, variances, residuals, predictions, method if source == "posterior" else "jacobian"
    )


def prediction_variance(
    model: nn.Module,
    posterior: Posterior | Any,
    inputs: Tensor,
    *,
    samples: int = 64,
    batch_size: int = 256,
    generator: torch.Generator | None = None,
    temperature: float | None = None,
    method: str = "auto",
    cross_class: bool = False,
) -> Tensor:
    r"""The prediction variance of the logits under the untempered posterior, ``[n, K]``
    (:math:`v_i = \operatorname{diag} J_i\Sigma J_i^\top / \tau` or the sample variance over
    posterior samples, divided by τ), or ``[n, K, K]`` covariances with ``cross_class``.
    Arguments as :func:`memory_map`; needs no targets (test inputs too)."""
    post, tau = resolve_posterior(posterior, model, temperature)
    method = _method(post, method)
    _check_options(inputs, None, samples, batch_size, "categorical", 1.0, "probabilities")
    with evaluating(model):
        moments = _moments(model, post, inputs, method, samples, batch_size, generator, cross_class)
        return torch.cat([V for _, _, V in moments]) / tau


def loo_nll(
    model: nn.Module,
    posterior: Posterior | Any,
    inputs: Tensor,
    targets: Tensor,
    *,
    form: str = "corrected",
    reduction: str = "mean",
    samples: int = 64,
    batch_size: int = 256,
    generator: torch.Generator | None = None,
    temperature: float | None = None,
    method: str = "auto",
    cross_class: bool = False,
    likelihood: str = "categorical",
    noise_variance: float = 1.0,
    variance: str = DEFAULT_VARIANCE,
    prior_precision: float | None = None,
) -> Tensor:
    r"""The leave-one-out negative log-likelihood estimated from the posterior alone: for every
    example, the NLL of its target under the prediction it would get were it left out of
    training, estimated without retraining (the memory-perturbation paper's leave-one-out
    estimate, Nickl et al. 2023, its Eq. for :math:`f_i^{\setminus i}` and Figs 1b, 4, 5).

    With the mean logits :math:`f_i`, the residual :math:`e_i = \nabla_f\ell_i`, the
    untempered prediction (co)variance :math:`V_i` and the likelihood's curvature in the
    logits :math:`\Lambda_i` (as in :func:`memory_map`: diagonal, :math:`v_i` and
    :math:`\lambda_i`, unless ``cross_class``), the leave-one-out prediction is

    - ``form="corrected"`` (the default): :math:`f_i^{\setminus i} = f_i + V_i(I - \Lambda_i
      V_i)^{-1} e_i` (diagonal: :math:`f_{ik} + v_{ik}e_{ik}/(1 - \lambda_{ik}v_{ik})`),
      with the variance :math:`V_i^{\setminus i} = V_i(I - \Lambda_i V_i)^{-1}`: removing
      the example's curvature :math:`J_i^\top\Lambda_iJ_i` from the posterior precision
      (Sherman–Morrison) and one Newton step of the mean. For Bayesian linear regression
      (Gaussian likelihood, exact Gaussian posterior) both are exact: the mean and the
      variance of the leave-one-out posterior predictive.
    - ``form="first_order"``: the memory-perturbation equation as in :func:`memory_map`,
      :math:`f_i^{\setminus i} \approx f_i + V_i e_i`, with the variance :math:`V_i`. It
      misses the exact leave-one-out mean of Bayesian linear regression by its second-order
      term :math:`v e\,\lambda v/(1 - \lambda v)` and the variance by :math:`\lambda
      v^2/(1 - \lambda v)`: small where the example's leverage :math:`\lambda v` is small.

    The NLL: for a Gaussian likelihood of noise variance σ², that of the leave-one-out
    predictive :math:`\mathcal N(y_i;\, f_i^{\setminus i},\, V_i^{\setminus i} + \sigma^2
    I)` (summed over the outputs; a multivariate normal with ``cross_class``); for a
    categorical likelihood, :math:`-\log \operatorname{softmax}(f_i^{\setminus i})_{y_i}`:
    the predicted probabilities at the shifted logits (a plug-in, as the paper; the variance
    enters only through the shift). The prediction :math:`f_i` is the logits at the
    posterior mean (``method="jacobian"``, and every Laplace source) or their mean over
    posterior samples (``"samples"``), as in :func:`memory_map`; :math:`V_i` is divided by τ.

    What it estimates (the target). With a Gaussian posterior of precision :math:`P`, leaving
    :math:`i` out removes :math:`J_i^\top\Lambda_iJ_i` from :math:`P`, and one Newton step
    from the trained mean :math:`m` moves it to :math:`m^{\setminus i} = m +
    (P - J_i^\top\Lambda_iJ_i)^{-1}J_i^\top e_i`; linearised, the logits move by
    :math:`J_i(P - J_i^\top\Lambda_iJ_i)^{-1}J_i^\top e_i = V_i(I - \Lambda_iV_i)^{-1}e_i`
    (Woodbury): the corrected shift. So for a categorical likelihood both forms estimate
    the leave-one-out NLL of the **plug-in prediction at the mean**, the softmax of the
    logits at the mean of the posterior fitted without :math:`i` (the first-order form with
    :math:`V_i` in place of :math:`V_i^{\setminus i}`, a shift too small by
    :math:`(I - \Lambda_iV_i)^{-1}`), not that of the model average, whose leave-one-out
    predictive would integrate the softmax over :math:`V_i^{\setminus i}`. Its held-out
    counterpart is the NLL at the posterior mean on a validation split drawn from the
    training distribution (a test set drawn otherwise measures something else as well). For
    a Gaussian likelihood it is the leave-one-out NLL of the posterior predictive (the model
    average; exact for Bayesian linear regression with an exact posterior).

    Where :math:`V_i` comes from (``variance``, :data:`VARIANCES`): ``"posterior"``, the
    rule's posterior divided by τ (by ``method``); or a Laplace posterior at the trained
    mean, whose precision is :math:`N\bar G + \delta I` with :math:`\bar G` the mean over
    ``inputs`` (the training set) of the GGN :math:`J_i^\top\Lambda_iJ_i` (``"ggn"``,
    inverted), its diagonal (``"diagonal_ggn"``), its K-FAC per ``nn.Linear`` layer
    (``"kfac"``: :math:`\frac1n\sum_i\bar a_i\bar a_i^\top \otimes \sum_iG_i`,
    :math:`\bar a_i` the layer's input with a 1 for the bias, :math:`G_i` the output
    curvature, block-diagonal over layers; exact where :math:`G_i` is the same for every
    example, e.g. one linear layer under a Gaussian likelihood), or the Hessian of the
    summed loss (``"hessian"``, inverted; refused where :math:`N\bar H + \delta` is not
    positive definite). N is the posterior's recorded data size (else ``len(inputs)``), δ
    ``prior_precision`` (else the optimizer's param groups' ``prior_precision`` +
    ``weight_decay``·N). The convention is the rules': at temperature τ a rule targets
    :math:`\exp(-(N\bar\ell + \tfrac\delta2\|\theta\|^2)/\tau)`, whose Laplace covariance
    is :math:`\tau(N\bar G + \delta)^{-1}`; divided by τ as the rule's own, it is
    :math:`(N\bar G + \delta)^{-1}`, untempered, so no τ enters a Laplace source, and for the
    diagonal affine rule at convergence on a GLM with a Gaussian likelihood (Hessian = GGN,
    orthogonal design) ``"posterior"``, ``"diagonal_ggn"`` and ``"ggn"`` agree. With the
    whole GGN and ``cross_class=True``, the eigenvalues of :math:`\Lambda_iV_i` stay below
    1 (:math:`P` holds :math:`J_i^\top\Lambda_iJ_i`), so the corrected form is defined at
    every δ; the diagonal :math:`\lambda_{ik}v_{ik}` may still reach 1.

    Args:
        form: ``"corrected"`` or ``"first_order"``.
        variance: the source of :math:`V_i`, one of :data:`VARIANCES` (default
            ``DEFAULT_VARIANCE``).
        prior_precision: δ of a Laplace source (default: the optimizer's; required with a
            :class:`~liegroup_blr.Posterior`, which does not record it).
        reduction: ``"mean"`` (a scalar, the leave-one-out NLL of the data set), ``"sum"``
            or ``"none"`` (``[n]``, one value per example).
        others: as :func:`memory_map`.

    Returns:
        The mean (or sum) NLL as a 0-dim tensor, or ``[n]`` per-example values, on the
        device of the model's parameters, in the dtype of its outputs.

    Raises:
        ValueError: naming the argument, as :func:`memory_map`; ``form`` if the corrected
            form is undefined for an example (:math:`\lambda_{ik}v_{ik} \ge 1`, or
            :math:`I - \Lambda_iV_i` singular: the example's own curvature exceeds the
            posterior's, which an exact Gaussian posterior rules out; use
            ``form="first_order"``); ``variance`` for an unknown source, a model ``"kfac"``
            or the exact sources cannot take, or a precision that is not positive definite;
            ``prior_precision`` where a Laplace source has no δ (a Posterior) or δ < 0.
    """
    if form not in LOO_FORMS:
        raise ValueError(f"form: must be one of {LOO_FORMS}, got {form!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: must be one of {REDUCTIONS}, got {reduction!r}")
    batches, _, _ = _batches(model, posterior, inputs, targets, temperature, method, variance)
    _check_options(inputs, targets, samples, batch_size, likelihood, noise_variance, "logits")
    options = (samples, batch_size, generator, cross_class, likelihood, noise_variance)
    parts = [
        _loo_nll(f, V, y, likelihood, noise_variance, form)
        for y, f, V in batches(*options, prior_precision)
    ]
    nll = torch.cat(parts)
    if reduction == "none":
        return nll
    return nll.mean() if reduction == "mean" else nll.sum()


# ------------------------------------------------------------------- arguments
def resolve_posterior(
    source: Any, model: nn.Module, temperature: float | None
) -> tuple[Posterior, float]:
    """The posterior and τ of a ``posterior=`` argument (here and of
    :class:`~liegroup_blr.MemorablePast`): a Posterior as it is, an optimizer (or a wrapper of
    one) read with ``Posterior.from_optimizer``; τ = ``temperature`` if given, else the one
    the posterior records (the optimizer's param groups'). ValueError naming the argument for
    a deterministic optimizer, a τ that differs between param groups, or τ ≤ 0."""
    if isinstance(source, Posterior):
        post = source
    else:
        optimizer = unwrap(source)
        if optimizer is None:
            raise ValueError(
                f"posterior: expected a liegroup_blr.Posterior or a Lie-group BLR optimizer, got "
                f"{type(source).__name__} (a deterministic optimizer has no posterior)"
            )
        post = Posterior.from_optimizer(optimizer, model)
    tau = post.temperature if temperature is None else temperature
    if tau is None:
        raise ValueError(
            "temperature: the posterior's param groups were trained at different temperatures; "
            "pass the one to divide the covariance by"
        )
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(
            f"temperature: must be a number > 0, got {tau!r} (τ = 0 learns a point mass, which "
            "has no memory map)"
        )
    return post, float(tau)


def jacobian_obstacle(entry: PosteriorEntry) -> str | None:
    """Why the Jacobian form (a diagonal covariance of finite variances) cannot take
    ``entry``, in words, or None if it can; what :class:`~liegroup_blr.MemorablePast`'s
    posterior kernels need too."""
    if not entry.group.elementwise:
        return f"its group {type(entry.group).__name__} gives no diagonal covariance"
    if not math.isfinite(float(entry.base.variance)):
        return f"its base {type(entry.base).__name__} has an infinite variance"
    return None


def _method(post: Posterior, method: str) -> str:
    """The method to use: ``"auto"`` resolved, ``"jacobian"`` checked against every entry."""
    if method not in METHODS:
        raise ValueError(f"method: must be one of {METHODS}, got {method!r}")
    if not len(post):
        raise ValueError("posterior: holds no entries (no parameter was trained)")
    if method == "samples":
        return method
    reasons = {k: jacobian_obstacle(e) for k, e in post.items()}
    if method == "auto":
        gaussian_like = all(e.group.gaussian_like for e in post.values())
        return "jacobian" if gaussian_like and not any(reasons.values()) else "samples"
    for key, reason in reasons.items():
        if reason is not None:
            raise ValueError(
                f"method: 'jacobian' cannot take entry {key!r}: {reason}; use 'samples'"
            )
    return method


def _check_options(
    inputs: Tensor,
    targets: Tensor | None,
    samples: int,
    batch_size: int,
    likelihood: str,
    noise_variance: float,
    change: str,
) -> None:
    for name, value, least in (("samples", samples, 2), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: must be an integer >= {least}, got {value!r}")
    if change not in CHANGES:
        raise ValueError(f"change: must be one of {CHANGES}, got {change!r}")
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood: must be one of {LIKELIHOODS}, got {likelihood!r}")
    if likelihood == "categorical" and noise_variance != 1.0:
        raise ValueError("noise_variance: only the Gaussian likelihood has one")
    if not noise_variance > 0:
        raise ValueError(f"noise_variance: must be > 0, got {noise_variance!r}")
    if len(inputs) == 0:
        raise ValueError("inputs: no examples")
    if targets is not None and len(targets) != len(inputs):
        raise ValueError(f"targets: {len(targets)} targets for {len(inputs)} inputs")
    if targets is not None and likelihood == "categorical":
        if targets.ndim != 1 or targets.is_floating_point() or targets.is_complex():
            raise ValueError(
                f"targets: a categorical likelihood takes integer labels [n], got "
                f"{targets.dtype} of shape {tuple(targets.shape)}"
            )


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, in its previous mode after it (also on error);
    what the memory maps and :class:`~liegroup_blr.MemorablePast` run the model in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# --------------------------------------------------------------------- moments
def _moments(
    model: nn.Module,
    post: Posterior,
    inputs: Tensor,
    method: str,
    samples: int,
    batch_size: int,
    generator: torch.Generator | None,
    cross_class: bool,
) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Per batch of ``batch_size`` inputs: its rows, the mean logits ``[B, K]`` and their
    (co)variance under the posterior (tempered: not yet divided by τ)."""
    device = next(iter(post.values())).element.device
    if method == "jacobian":
        at_mean = post.with_point_at("mean")
        with at_mean.at_point_estimate(model):  # ValueError if names or shapes differ
            named = dict(model.named_parameters())
            order = list(named)
            names = {k: order[k] if isinstance(k, int) else k for k in post}
            params = {names[k]: named[names[k]].detach().clone() for k in post}
        variances = {
            names[k]: e.group.coordinate_variance(e.element, e.base) for k, e in post.items()
        }
        batch = jacobian_batch(model, params, variances, cross_class)
    else:
        if generator is None:
            seed = int(torch.randint(0, 2**63 - 1, ()).item())  # from torch's global RNG
            generator = torch.Generator(device).manual_seed(seed)
        batch = _samples_batch(model, post, samples, generator, cross_class)
    for start in range(0, len(inputs), batch_size):
        rows = slice(start, start + batch_size)
        yield rows, *batch(inputs[rows].to(device))


def _samples_batch(
    model: nn.Module,
    post: Posterior,
    samples: int,
    generator: torch.Generator,
    cross_class: bool,
) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """Mean logits and their sample (co)variance over ``samples`` posterior samples; every
    batch replays the same samples (the generator restarts from its state at the first)."""
    start = generator.get_state()

    @torch.no_grad()
    def batch(x: Tensor) -> tuple[Tensor, Tensor]:
        generator.set_state(start)
        logits = []
        for _ in range(samples):
            with post.sampled(model, generator):
                logits.append(model(x).reshape(len(x), -1))
        f = torch.stack(logits)  # [S, B, K]
        mean = f.mean(0)
        centred = f - mean
        if cross_class:
            return mean, torch.einsum("sbk,sbl->bkl", centred, centred) / (samples - 1)
        return mean, centred.square().sum(0) / (samples - 1)

    return batch


# ------------------------------------------------------------- Laplace sources
def _untempered(
    model: nn.Module,
    given: Any,
    post: Posterior,
    tau: float,
    inputs: Tensor,
    targets: Tensor | None,
    source: str,
    method: str,
    samples: int,
    batch_size: int,
    generator: torch.Generator | None,
    cross_class: bool,
    likelihood: str,
    noise_variance: float,
    prior_precision: float | None,
) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """Per batch: rows, logits, and the untempered prediction (co)variance from ``source``
    (:data:`VARIANCES`): the rule's posterior's divided by τ, or a Laplace posterior's."""
    if source == "posterior":
        for rows, f, V in _moments(
            model, post, inputs, method, samples, batch_size, generator, cross_class
        ):
            yield rows, f, V / tau
        return
    delta, data_size = laplace_prior(given, post, prior_precision)
    yield from laplace_moments(
        model,
        post,
        inputs,
        targets,
        source,
        batch_size,
        cross_class,
        likelihood,
        noise_variance,
        delta,
        data_size,
    )


def _batches(
    model: nn.Module,
    posterior: Any,
    inputs: Tensor,
    targets: Tensor,
    temperature: float | None,
    method: str,
    variance: str,
) -> tuple[Callable[..., Iterator[tuple[Tensor, Tensor, Tensor]]], str, str]:
    """The posterior, its τ, the method and the variance source resolved (errors naming the
    argument, now); returns the function that then yields, per batch, its targets, the logits
    at the mean and their untempered (co)variance (:func:`_untempered`, the model in eval
    mode), with the method and the source."""
    post, tau = resolve_posterior(posterior, model, temperature)
    method = _method(post, method)
    source = _source(variance)

    def batches(*options: Any) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        with evaluating(model):
            for rows, f, V in _untempered(
                model, posterior, post, tau, inputs, targets, source, method, *options
            ):
                yield targets[rows].to(f.device), f, V

    return batches, method, source


def _source(variance: str) -> str:
    if variance not in VARIANCES:
        raise ValueError(f"variance: must be one of {VARIANCES}, got {variance!r}")
    return variance


def _score(
    f: Tensor, V: Tensor, y: Tensor, likelihood: str, noise_variance: float, change: str
) -> tuple[Tensor, Tensor, Tensor]:
    r"""(scores, residuals, predictions) of a batch from the mean logits ``f`` and the
    untempered (co)variance ``V``: the L1 norm of the logits' change :math:`V e` (diagonal:
    :math:`v \odot e`), or of the probabilities' :math:`\Lambda V e` (diagonal:
    :math:`\lambda \odot v \odot e`, λ = p − p²)."""
    if likelihood == "gaussian":
        pred, e = f, (f - y.reshape(f.shape).to(f.dtype)) / noise_variance
    else:
        K = f.shape[-1]
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= K):
            raise ValueError(f"targets: labels must lie in [0, {K}) for a model with {K} outputs")
        pred = torch.softmax(f, dim=-1)
        e = pred - nn.functional.one_hot(y.long(), K).to(pred.dtype)
    full = V.ndim == 3
    moved = (V @ e[..., None])[..., 0] if full else V * e
    if likelihood == "categorical" and change == "probabilities":
        if full:
            Lam = torch.diag_embed(pred) - pred[:, :, None] * pred[:, None, :]
            moved = (Lam @ moved[..., None])[..., 0]
        else:
            moved = (pred - pred.square()) * moved
    return moved.abs().sum(-1), e, pred


def _loo_nll(
    f: Tensor, V: Tensor, y: Tensor, likelihood: str, noise_variance: float, form: str
) -> Tensor:
    """Per example of a batch, the NLL of ``y`` at the leave-one-out prediction (:func:`loo_nll`)
    from the mean logits ``f`` ``[B, K]`` and the untempered (co)variance ``V``."""
    _, e, pred = _score(f, V, y, likelihood, noise_variance, "logits")
    full = V.ndim == 3
    K = f.shape[-1]
    if likelihood == "gaussian":
        lam = torch.full_like(f, 1 / noise_variance)
    else:
        lam = pred - pred.square()
    if full:
        Lam = (
            torch.diag_embed(lam)
            if likelihood == "gaussian"
            else (torch.diag_embed(pred) - pred[:, :, None] * pred[:, None, :])
        )
        if form == "corrected":
            eye = torch.eye(K, dtype=V.dtype, device=V.device)
            inner = eye - Lam @ V  # (I − ΛV); V(I − ΛV)⁻¹ = (I − VΛ)⁻¹V
            # ΛV has real eigenvalues ≥ 0 (a product of two PSD matrices); all must be < 1
            if bool((torch.linalg.eigvals(Lam @ V).real >= 1).any()):
                raise ValueError(_UNDEFINED)
            z = torch.linalg.solve(inner, e[..., None])[..., 0]
            V_loo = torch.linalg.solve(eye - V @ Lam, V)
        else:
            z, V_loo = e, V
        shift = (V @ z[..., None])[..., 0]
    else:
        if form == "corrected":
            keep = 1 - lam * V
            if bool((keep <= 0).any()):
                raise ValueError(_UNDEFINED)
            shift, V_loo = V * e / keep, V / keep
        else:
            shift, V_loo = V * e, V
    f_loo = f + shift
    if likelihood == "gaussian":
        target = y.reshape(f.shape).to(f.dtype)
        if full:
            cov = V_loo + noise_variance * torch.eye(K, dtype=V.dtype, device=V.device)
            dist = torch.distributions.MultivariateNormal(f_loo, covariance_matrix=cov)
            return -dist.log_prob(target)
        var = V_loo + noise_variance
        return 0.5 * (torch.log(2 * math.pi * var) + (target - f_loo).square() / var).sum(-1)
    return -torch.log_softmax(f_loo, dim=-1).gather(-1, y.long()[:, None])[:, 0]


_UNDEFINED = (
    "form: the corrected leave-one-out prediction is undefined for some example (its own "
    "curvature times its prediction variance, λv, reaches 1: the posterior is narrower than "
    "that example alone would make it); use form='first_order'"
)
