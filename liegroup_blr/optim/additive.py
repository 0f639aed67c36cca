r"""The additive rule: noisy SGD with momentum, θ = m + ξ.

.. math::
    \hat X = \frac1S \sum_s \nabla\bar\ell_\delta(m + \xi_s), \qquad
    M \leftarrow \beta M + (1-\beta)\hat X, \qquad m \leftarrow m - \alpha M.

The kernels below act on explicit tensor lists, one tensor at a time, so that under
``torch.compile`` each parameter's update is one fused kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal

from ..groups import AdditiveGroup
from .base import BLROptimizer
from .kernels import Proposal
from .sample import Deferred
from .state import state_dtype

__all__ = ["AdditiveBLR", "additive_accumulate", "additive_commit", "additive_draw"]


def additive_draw(elements: list[Tensor], noise: list[Tensor], params: list[Tensor]) -> None:
    """θ = m + ξ."""
    for m, xi, p in zip(elements, noise, params, strict=True):
        torch.add(m, xi, out=p)


def additive_accumulate(accs: list[Tensor], grads: list[Tensor], first: bool) -> None:
    """acc (+)= ∇ℓ̄_δ(θ)."""
    for acc, grad in zip(accs, grads, strict=True):
        if first:
            acc.copy_(grad)
        else:
            acc.add_(grad)


def momentum_propose(
    accs: list[Tensor],
    momenta: list[Tensor],
    n: int,
    beta: float,
    grads: list[Tensor] | None = None,
) -> None:
    """acc ← β M + (1 − β) acc / n: the new momentum, in the accumulator; with the ``grads``
    of a deferred sample, acc = their :func:`additive_accumulate` in the same pass."""
    for i, (acc, m) in enumerate(zip(accs, momenta, strict=True)):
        x = acc if grads is None else grads[i]
        if n > 1 or x.dtype != acc.dtype:  # (half-precision gradients, float32 state)
            x = torch.mul(x, 1.0 / n, out=acc)
        torch.lerp(x, m, beta, out=acc)


def additive_commit(
    elements: list[Tensor],
    momenta: list[Tensor],
    params: list[Tensor],
    lr: float | Tensor,
    mean: float | None,
) -> None:
    """m ← m − α M; θ ← m (+ E[ξ] under ``point_estimate="mean"``)."""
    for m, mom, p in zip(elements, momenta, params, strict=True):
        if isinstance(lr, Tensor):
            m.sub_(mom * lr)
        else:
            m.add_(mom, alpha=-lr)
        p.copy_(m if mean is None else m + mean)


class AdditiveBLR(BLROptimizer):
    r"""Lie-group BLR with the additive group: Gaussian-perturbed ("noisy") SGD.

    Samples :math:`\theta_s = m + \xi_s`, :math:`\xi_s \sim q_0`; the entropy is constant, so
    the temperature plays no role. One step:

    .. math::
        \hat X = \frac1S \sum_s \Big(\nabla \bar\ell(\theta_s) + \frac{\delta}{N}\theta_s\Big),
        \qquad M \leftarrow \beta M + (1-\beta)\hat X, \qquad m \leftarrow m - \alpha M.

    With a ``Dirac(0)`` base this is exactly SGD with EMA momentum (M₀ = 0) and weight decay
    δ/N. The parameters hold :math:`m` outside
    :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params`.

    Args:
        params: parameters or param groups.
        lr: α > 0.
        momentum: β ∈ [0, 1).
        base: q0, default ``Normal(0, 1e-3)`` (the reference MLP's).
        data_size: N, required when ``prior_precision`` > 0.
        temperature: τ ≥ 0 (no effect: the entropy of m + ξ does not depend on m).
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        point_estimate: ``"g"`` (m) or ``"mean"`` (m + E[ξ]).

    The keyword-only ``seed``, ``noise``, ``antithetic``, ``table_size``, ``compile``,
    ``process_group``, ``grad_scaler`` and ``max_consecutive_skips`` are those of
    :class:`~liegroup_blr.optim.BLROptimizer`.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        base: Distribution | None = None,
        data_size: float | None = None,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        *,
        point_estimate: str = "g",
        seed: int | None = None,
        noise: str = "fresh",
        antithetic: bool = False,
        table_size: int | None = None,
        compile: bool = False,
        process_group: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        max_consecutive_skips: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=Normal(0.0, 1e-3) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
        )
        super().__init__(
            params,
            defaults,
            AdditiveGroup(),
            mc_samples=mc_samples,
            point_estimate=point_estimate,
            seed=seed,
            noise=noise,
            antithetic=antithetic,
            table_size=table_size,
            compile=compile,
            process_group=process_group,
            grad_scaler=grad_scaler,
            max_consecutive_skips=max_consecutive_skips,
        )

    def _new_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        m = p.detach().to(state_dtype(p), copy=True)
        return {"element": m, "momentum": torch.zeros_like(m)}

    def _draw(self, group: dict[str, Any], params: list[Tensor], xi: list[Tensor]) -> list[Tensor]:
        additive_draw(self._gather(params, "element"), xi, params)
        return xi

    def _accumulate(self, group, params, noise, grads, first) -> None:
        additive_accumulate(self._accumulators(params), grads, first)

    def _propose(
        self, group: dict[str, Any], params: list[Tensor], n: int, sample: Deferred | None
    ) -> Proposal:
        accs, momenta = self._accumulators(params), self._gather(params, "momentum")
        grads = None if sample is None else sample.grads
        self._kernel(momentum_propose)(accs, momenta, n, group["momentum"], grads)
        return Proposal(accs)

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        elements, momenta = self._gather(params, "element"), self._gather(params, "momentum")
        lr, mean = self._rate(group), self._mean(group)
        self._kernel(additive_commit)(elements, momenta, params, lr, mean)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        mean = self._mean(group)
        for m, p in zip(self._gather(params, "element"), params, strict=True):
            p.copy_(m if mean is None else m + mean)
