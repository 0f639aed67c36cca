"""The diagonal affine rule: θ = A ⊙ ξ + b, a Gaussian-like posterior for any q0."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal

from ..groups import DiagonalAffineGroup, exprel
from .generic import LieGroupBLR, _number, state_dtype
from .multiplicative import clamp_finite_positive_, exp_step_

__all__ = ["AffineBLR"]


class AffineBLR(LieGroupBLR):
    r"""Lie-group BLR with the diagonal affine group :math:`\theta = A \odot \xi + b`, A > 0.

    With :math:`\bar\ell_\delta = \bar\ell + \frac{\delta}{2N}\|\theta\|^2` and samples
    :math:`\theta_s = A\xi_s + b`:

    .. math::
        \hat U &= \frac1S \sum_s \nabla\bar\ell_\delta(\theta_s) \odot A\xi_s - \frac{\tau}{N},
        \qquad \hat V = A \odot \frac1S \sum_s \nabla\bar\ell_\delta(\theta_s), \\
        M_U &\leftarrow \beta_2 M_U + (1-\beta_2)\hat U, \qquad
        M_V \leftarrow \beta_1 M_V + (1-\beta_1)\hat V, \\
        b &\leftarrow b + A \odot M_V \odot \frac{e^{-\alpha_1 M_U} - 1}{M_U}, \qquad
        A \leftarrow A \odot e^{-\alpha_2 M_U}.

    For α₁ = α₂ and β₁ = β₂ this is :math:`g \leftarrow g \cdot \exp(-\alpha M)` with
    :math:`\exp(u, v) = (e^u, v\,\varphi(u))`. Two step sizes amount to a diagonal
    preconditioner on the algebra: with a Gaussian q0 of scale σ the Fisher metric at the
    identity is :math:`\operatorname{diag}(1/\sigma^2, 2)` on :math:`(v, u)`, so natural-gradient
    steps :math:`\alpha\,\sigma^2` on v and :math:`\alpha/2` on u are the ratio
    α₁ : α₂ = 2σ² : 1 that the rule leaves free. Linearised in α this is the Bayesian learning
    rule for a diagonal Gaussian (a variance-preconditioned mean step), and on a quadratic loss
    with a Gaussian q0 its fixed point is the exact Gaussian posterior.
    :math:`(e^{x}-1)/x` is evaluated as :math:`e^{\max(x,0)}\,(1 - e^{-|x|})/|x|`, finite and
    exact at :math:`M_U = 0`. The parameters hold :math:`b` outside
    :meth:`~LieGroupBLR.sampled_params`.

    ``lr`` (α₁) is what ``torch.optim.lr_scheduler`` schedules set; α₂ follows the same
    relative schedule: the scale's step is ``scale_lr * lr / initial_lr``.

    Args:
        params: parameters or param groups.
        lr: α₁ > 0, step size of the shift b.
        scale_lr: α₂ > 0, step size of the scale A.
        momentum: β₁ ∈ [0, 1) for M_V.
        scale_momentum: β₂ ∈ [0, 1) for M_U.
        base: q0, default ``Normal(0, 0.005)`` (the reference ResNet-20's).
        data_size: N, required when τ > 0 or δ > 0.
        temperature: τ ≥ 0.
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        init_scale: initial A > 0.
        **options: keyword-only optimizer-level options of :class:`LieGroupBLR`:
            ``point_estimate`` — ``"g"`` (b) or ``"mean"`` (b + A·E[ξ]).
            ``seed``, ``noise``, ``antithetic``, ``table_size``, ``compile``,
            ``process_group``.
    """

    lie_group: DiagonalAffineGroup

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        scale_lr: float,
        momentum: float = 0.8,
        scale_momentum: float = 0.999,
        base: Distribution | None = None,
        data_size: float | None = None,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        init_scale: float = 1.0,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            scale_lr=scale_lr,
            momentum=momentum,
            scale_momentum=scale_momentum,
            base=Normal(0.0, 0.005) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            init_scale=init_scale,
        )
        group = DiagonalAffineGroup()
        self._construct(params, group, defaults, mc_samples, **options)

    def _check_hyperparameters(self, hp: dict[str, Any]) -> None:
        super()._check_hyperparameters(hp)
        _number(hp, "scale_lr", 0.0, closed=False)
        _number(hp, "scale_momentum", 0.0, 1.0)
        _number(hp, "init_scale", 0.0, closed=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("initial_lr", group["lr"])

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        theta = p.detach().to(state_dtype(p))
        self.state[p] = {
            "element": self.lie_group.from_point(theta, group["init_scale"]),
            "momentum": theta.new_zeros((2, *theta.shape)),
        }

    def _scales(self, params: list[Tensor]) -> list[Tensor]:
        return [self.state[p]["element"][0] for p in params]

    def _shifts(self, params: list[Tensor]) -> list[Tensor]:
        return [self.state[p]["element"][1] for p in params]

    def _draw(self, group: dict[str, Any], params: list[Tensor], train: bool) -> None:
        xi = [self._buffer(p, "xi", p.shape) for p in params]
        self._noise_into(group, params, xi)
        torch._foreach_mul_(xi, self._scales(params))  # A ⊙ ξ
        if params[0].dtype == xi[0].dtype:
            torch._foreach_copy_(params, xi)
            torch._foreach_add_(params, self._shifts(params))
        else:
            torch._foreach_copy_(params, torch._foreach_add(xi, self._shifts(params)))

    def _accumulate(self, group: dict[str, Any], params: list[Tensor], first: bool) -> None:
        grads = self._loss_gradients(group, params)
        xi = [self._scratch[p]["xi"] for p in params]
        torch._foreach_mul_(xi, grads)  # ∇ℓ ⊙ Aξ
        acc_v = [self._buffer(p, "acc_v", p.shape) for p in params]
        if first:  # this sample's buffer becomes the U accumulator
            self._rename(params, "xi", "acc_u")
            torch._foreach_copy_(acc_v, grads)
        else:
            torch._foreach_add_([self._scratch[p]["acc_u"] for p in params], xi)
            torch._foreach_add_(acc_v, grads)

    def _accumulators(self, params: list[Tensor]) -> list[Tensor]:
        return [self._scratch[p][key] for key in ("acc_u", "acc_v") for p in params]

    def _propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        acc_u = [self._scratch[p]["acc_u"] for p in params]
        acc_v = [self._scratch[p]["acc_v"] for p in params]
        torch._foreach_mul_(acc_v, self._scales(params))  # V̂ = A ⊙ mean ∇ℓ
        if n > 1:
            torch._foreach_div_(acc_u, n)
            torch._foreach_div_(acc_v, n)
        if group["temperature"]:
            torch._foreach_sub_(acc_u, group["temperature"] / group["data_size"])
        moms = [self.state[p]["momentum"] for p in params]
        torch._foreach_lerp_(acc_u, [m[0] for m in moms], group["scale_momentum"])
        torch._foreach_lerp_(acc_v, [m[1] for m in moms], group["momentum"])
        return acc_u + acc_v

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        lr = group["lr"]
        scale_lr = group["scale_lr"] * lr / group["initial_lr"]
        u = [self._scratch[p]["acc_u"] for p in params]
        v = [self._scratch[p]["acc_v"] for p in params]
        moms = [self.state[p]["momentum"] for p in params]
        torch._foreach_copy_([m[0] for m in moms], u)
        torch._foreach_copy_([m[1] for m in moms], v)
        A, b = self._scales(params), self._shifts(params)
        info = torch.finfo(u[0].dtype)
        # b ← b + α₁·W, W = A·M_V·e^{max(x,0)}·expm1(−|x|)/|x| = −A·M_V·φ(x), x = −α₁M_U,
        # in the workspaces u (holding M_U), v (holding M_V) and y.
        torch._foreach_mul_(u, -lr)  # x
        y = [self._buffer(p, "xi", p.shape) for p in params]
        torch._foreach_copy_(y, u)
        torch._foreach_abs_(y)
        torch._foreach_clamp_min_(y, info.tiny)  # |x|, kept away from 0
        torch._foreach_clamp_min_(u, 0.0)
        torch._foreach_clamp_max_(u, math.log(info.max))
        torch._foreach_exp_(u)  # e^{max(x,0)}
        torch._foreach_div_(u, y)
        torch._foreach_neg_(y)
        torch._foreach_expm1_(y)  # −(1 − e^{−|x|})
        torch._foreach_mul_(u, y)
        torch._foreach_mul_(u, A)
        torch._foreach_addcmul_(b, u, v, value=lr)
        torch._foreach_clamp_min_(b, -info.max)
        torch._foreach_clamp_max_(b, info.max)
        torch._foreach_copy_(v, [m[0] for m in moms])
        torch._foreach_mul_(A, exp_step_(v, scale_lr))
        clamp_finite_positive_(A)
        self._write_point(group, params)

    def _fused_propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        shift = group["temperature"] / group["data_size"] if group["temperature"] else 0.0
        out = []
        for p in params:
            scratch, state = self._scratch[p], self.state[p]
            u, v, m = scratch["acc_u"], scratch["acc_v"], state["momentum"]
            u.copy_(torch.lerp(u / n - shift, m[0], group["scale_momentum"]))
            v.copy_(torch.lerp(v * state["element"][0] / n, m[1], group["momentum"]))
            out += [u, v]
        return out

    def _fused_commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        lr, mean = group["lr"], self._mean(group)
        scale_lr = group["scale_lr"] * lr / group["initial_lr"]
        for p in params:
            scratch, state = self._scratch[p], self.state[p]
            u, v, (A, b) = scratch["acc_u"], scratch["acc_v"], state["element"]
            state["momentum"].copy_(torch.stack((u, v)))
            info = torch.finfo(u.dtype)
            x = (u * -lr).clamp(max=math.log(info.max))  # capped where e^x overflows anyway
            b_new = (b - A * v * exprel(x) * lr).clamp(-info.max, info.max)
            A_new = (A * torch.exp(u * -scale_lr)).clamp(info.tiny, info.max)
            state["element"].copy_(torch.stack((A_new, b_new)))
            p.copy_(b_new + A_new * mean if mean else b_new)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        torch._foreach_copy_(params, self._shifts(params))
        mean = self._mean(group)
        if mean:
            torch._foreach_add_(params, torch._foreach_mul(self._scales(params), mean))
