"""The additive rule: noisy SGD with momentum, θ = m + ξ."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal

from ..groups import AdditiveGroup
from .generic import LieGroupBLR

__all__ = ["AdditiveBLR"]


class AdditiveBLR(LieGroupBLR):
    r"""Lie-group BLR with the additive group: Gaussian-perturbed ("noisy") SGD.

    Samples :math:`\theta_s = m + \xi_s`, :math:`\xi_s \sim q_0`; the entropy is constant, so
    the temperature plays no role. One step:

    .. math::
        \hat X = \frac1S \sum_s \Big(\nabla \bar\ell(\theta_s) + \frac{\delta}{N}\theta_s\Big),
        \qquad M \leftarrow \beta M + (1-\beta)\hat X, \qquad m \leftarrow m - \alpha M.

    With a ``Dirac(0)`` base this is exactly SGD with EMA momentum (M₀ = 0) and weight decay
    δ/N. The parameters hold :math:`m` outside :meth:`~LieGroupBLR.sampled_params`.

    Args:
        params: parameters or param groups.
        lr: α > 0.
        momentum: β ∈ [0, 1).
        base: q0, default ``Normal(0, 1e-3)`` (the reference MLP's).
        data_size: N, required when ``prior_precision`` > 0.
        temperature: τ ≥ 0 (no effect: the entropy of m + ξ does not depend on m).
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        **options: keyword-only optimizer-level options of :class:`LieGroupBLR`:
            ``point_estimate`` — ``"g"`` (m) or ``"mean"`` (m + E[ξ]).
            ``seed``, ``noise``, ``antithetic``, ``table_size``, ``compile``,
            ``process_group``.
    """

    _sample_buffers = ()  # the sample lives in the parameters themselves

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
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=Normal(0.0, 1e-3) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
        )
        self._init_fn = None
        self._construct(params, AdditiveGroup(), defaults, mc_samples, **options)

    def _elements(self, params: list[Tensor]) -> list[Tensor]:
        return [self.state[p]["element"] for p in params]

    def _draw(self, group: dict[str, Any], params: list[Tensor], train: bool) -> None:
        self._noise_into(group, params, params)  # θ = ξ + m, drawn straight into the parameter
        torch._foreach_add_(params, self._elements(params))

    def _accumulate(self, group: dict[str, Any], params: list[Tensor], first: bool) -> None:
        acc = [self._buffer(p, "acc", p.shape) for p in params]
        grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]
        if first:
            torch._foreach_copy_(acc, grads)
        else:
            torch._foreach_add_(acc, grads)
        if group["prior_precision"]:
            decay = group["prior_precision"] / group["data_size"]
            torch._foreach_add_(acc, params, alpha=decay)

    def _propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        acc = self._accumulators(params)
        if n > 1:
            torch._foreach_div_(acc, n)
        torch._foreach_lerp_(acc, [self.state[p]["momentum"] for p in params], group["momentum"])
        return acc

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        for p in params:  # the proposal becomes the momentum; the old one, scratch
            state, scratch = self.state[p], self._scratch[p]
            state["momentum"], scratch["acc"] = scratch["acc"], state["momentum"]
        moms = [self.state[p]["momentum"] for p in params]
        torch._foreach_add_(self._elements(params), moms, alpha=-group["lr"])
        self._write_point(group, params)

    def _fused_propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        acc = self._accumulators(params)
        for a, p in zip(acc, params, strict=True):
            a.div_(n).lerp_(self.state[p]["momentum"], group["momentum"])
        return acc

    def _fused_commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        mean = self._mean(group)
        for a, p in zip(self._accumulators(params), params, strict=True):
            state = self.state[p]
            state["momentum"].copy_(a)
            m = state["element"] - a * group["lr"]
            state["element"].copy_(m)
            p.copy_(m + mean if mean else m)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        torch._foreach_copy_(params, self._elements(params))
        mean = self._mean(group)
        if mean:
            torch._foreach_add_(params, mean)
