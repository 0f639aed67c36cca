r"""The diagonal affine rule: θ = A ⊙ ξ + b, a Gaussian-like posterior for any q0.

Elements stack [A, b], momenta [M_U, M_V] (shape (2, …)); the accumulators stack the sums
[Σ ∇ℓ̄_δ ⊙ ξ_s, Σ ∇ℓ̄_δ], which the proposal multiplies by A (fixed during a step).

.. math::
    \hat U = \frac1S \sum_s \nabla\bar\ell_\delta(\theta_s) \odot A\xi_s - \frac{\tau}{N},
    \qquad \hat V = A \odot \frac1S \sum_s \nabla\bar\ell_\delta(\theta_s), \\
    b \leftarrow b - \alpha_1 A \odot M_V \odot \varphi(-\alpha_1 M_U), \qquad
    A \leftarrow A \odot e^{-\alpha_2 M_U}, \qquad \varphi(x) = \frac{e^x - 1}{x}.

The kernels act on explicit tensor lists one tensor at a time: in place for eager steps, and
:func:`affine_update`, what ``compile=True`` runs, over the rows of each tensor (one loop per
parameter).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal

from ..groups import DiagonalAffineGroup
from ..groups.affine import exprel
from .base import BLROptimizer
from .checks import check_number
from .kernels import LOG2E, Parts, Proposal, compiled
from .sample import Deferred
from .state import state_dtype

__all__ = [
    "AffineBLR",
    "affine_accumulate",
    "affine_commit_",
    "affine_draw",
    "affine_move",
    "affine_propose",
    "affine_update",
]


def affine_draw(elements: list[Tensor], xi: list[Tensor], params: list[Tensor]) -> None:
    """θ = A ⊙ ξ + b (ξ itself is what the accumulation reads)."""
    for g, x, p in zip(elements, xi, params, strict=True):
        torch.addcmul(g[1], g[0], x, out=p)


def affine_accumulate(
    accs: list[Tensor], noise: list[Tensor], grads: list[Tensor], first: bool
) -> None:
    """acc (+)= (∇ℓ̄_δ ⊙ ξ, ∇ℓ̄_δ): the algebra gradient (∇ℓ̄_δ ⊙ Aξ, A ⊙ ∇ℓ̄_δ) of one sample
    but for the factor A, which :func:`affine_propose` applies to the sum."""
    for acc, xi, grad in zip(accs, noise, grads, strict=True):
        if first:
            torch.mul(xi, grad, out=acc[0])
            acc[1].copy_(grad)
        else:
            acc[0].addcmul_(xi, grad)
            acc[1].add_(grad)


def affine_propose(
    accs: list[Tensor],
    momenta: list[Tensor],
    elements: list[Tensor],
    n: int,
    betas: tuple[float, float],
    shift: float,
    sample: tuple[list[Tensor], list[Tensor]] | None = None,
) -> None:
    """[M_U, M_V] ← [lerp(A acc_U/n − τ/N, M_U, β₂), lerp(A acc_V/n, M_V, β₁)], in place row by
    row; with ``sample`` = (noise, grads) of a deferred sample, acc = its
    :func:`affine_accumulate`, made in the same pass."""
    for i, (acc, m, g) in enumerate(zip(accs, momenta, elements, strict=True)):
        if sample is None:
            for row, offset in enumerate((-shift, 0.0)):
                torch.addcmul(acc.new_full((), offset), acc[row], g[0], value=1 / n, out=acc[row])
        else:
            torch.mul(g[0], sample[1][i], out=acc[1])
            torch.addcmul(acc.new_full((), -shift), acc[1], sample[0][i], out=acc[0])
        for row, beta in enumerate(betas):
            acc[row].lerp_(m[row], beta)


def _point(p: Tensor, A: Tensor, b: Tensor, mean: float | None) -> None:
    """p ← b, or b + A·E[ξ] under ``point_estimate="mean"``."""
    if mean is None:
        p.copy_(b)
    else:
        torch.add(b, A, alpha=mean, out=p)


def affine_move(
    g: Tensor | Parts, u: Tensor, v: Tensor, lr: float | Tensor, scale_lr: float | Tensor
) -> tuple[Tensor, Tensor]:
    """(A e^{−α₂ u}, b − α₁ A v φ(−α₁ u)) for g = (A, b) (φ = :func:`~liegroup_blr.groups.
    affine.exprel`, exact at u = 0; e^x as 2^{x log₂e}, several times faster on CPU), both
    clamped to the finite range (A > 0) for any step."""
    info = torch.finfo(g[0].dtype)
    phi = exprel((u * -lr).clamp(max=math.log(info.max)))
    b = (g[1] - g[0] * v * phi * lr).clamp(-info.max, info.max)
    A = (g[0] * torch.exp2(u * (scale_lr * -LOG2E))).clamp(info.tiny, info.max)
    return A, b


def affine_commit_(
    elements: list[Tensor],
    momenta: list[Tensor],
    work: list[Tensor],
    params: list[Tensor],
    lr: float,
    scale_lr: float,
    mean: float | None,
) -> None:
    """g ← :func:`affine_move` (g, M_U, M_V) in place, in the free buffers ``work`` (no
    allocation: large temporaries cost page faults on every eager step); φ(x) = expm1(x)/x,
    with the 0/0 at x = 0 replaced by its limit 1. What eager steps run."""
    for g, m, ws, p in zip(elements, momenta, work, params, strict=True):
        info = torch.finfo(g.dtype)
        x, phi = ws[0], ws[1]
        torch.mul(m[0], -lr, out=x)
        torch.expm1(x, out=phi)
        phi.div_(x).nan_to_num_(nan=1.0, posinf=info.max)  # φ > 0: an overflow gives max
        phi.mul_(m[1])  # φ·M_V: finite factors, so never inf·0
        g[1].addcmul_(phi, g[0], value=-lr).clamp_(-info.max, info.max)
        torch.mul(m[0], -scale_lr * LOG2E, out=x)
        g[0].mul_(x.exp2_()).clamp_(info.tiny, info.max)
        _point(p, g[0], g[1], mean)


def affine_update(
    accs: list[Parts],
    momenta: list[Parts],
    elements: list[Parts],
    out: list[Parts],
    params: list[Tensor],
    hp: tuple[int, tuple[float, float], float, float | Tensor, float | Tensor, float | None],
    sample: tuple[list[Tensor], list[Tensor]] | None = None,
) -> list[Tensor]:
    """:func:`affine_propose` and :func:`affine_move` into ``out`` in functional form over the
    rows of each tensor (:func:`~liegroup_blr.optim.kernels.parts`; ``hp`` = n, (β₂, β₁),
    τ/N, α₁, α₂, E[ξ]): what ``compile=True`` runs, one loop per parameter; returns each new
    momentum's sum (not finite if any entry is not)."""
    n, betas, shift, lr, scale_lr, mean = hp
    sums = []
    for i, (acc, m, g, o, p) in enumerate(zip(accs, momenta, elements, out, params, strict=True)):
        if sample is None:
            x_u, x_v = acc[0] * g[0] / n, acc[1] * g[0] / n
        else:
            x_v = g[0] * sample[1][i]
            x_u = x_v * sample[0][i]
        u, v = torch.lerp(x_u - shift, m[0], betas[0]), torch.lerp(x_v, m[1], betas[1])
        A, b = affine_move(g, u, v, lr, scale_lr)
        for row, (new_m, new_g) in enumerate(((u, A), (v, b))):
            acc[row].copy_(new_m)
            o[row].copy_(new_g)
        _point(p, A, b, mean)
        sums.append(u.sum() + v.sum())
    return sums


class AffineBLR(BLROptimizer):
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
    with a Gaussian q0 its fixed point is the exact Gaussian posterior. The parameters hold
    :math:`b` outside :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params`.

    ``lr`` (α₁) is what ``torch.optim.lr_scheduler`` schedules set; α₂ keeps its ratio to it:
    the scale's step is ``scale_lr × lr / lr₀`` with lr₀ the ``lr`` the param group was
    created with (every scheduler, including those that set ``lr`` at construction such as
    ``CyclicLR``, then keeps α₂/α₁ = scale_lr/lr₀).

    Args:
        params: parameters or param groups.
        lr: α₁ > 0, step size of the shift b.
        scale_lr: α₂ > 0, step size of the scale A (at ``lr``).
        momentum: β₁ ∈ [0, 1) for M_V.
        scale_momentum: β₂ ∈ [0, 1) for M_U.
        base: q0, default ``Normal(0, 0.005)`` (the reference ResNet-20's).
        data_size: N, required when τ > 0 or δ > 0.
        temperature: τ ≥ 0.
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        init_scale: initial A > 0.
        point_estimate: ``"g"`` (b) or ``"mean"`` (b + A·E[ξ]).

    The keyword-only ``seed``, ``noise``, ``antithetic``, ``table_size``, ``compile``,
    ``process_group``, ``grad_scaler`` and ``max_consecutive_skips`` are those of
    :class:`~liegroup_blr.optim.BLROptimizer`.
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
            scale_lr=scale_lr,
            momentum=momentum,
            scale_momentum=scale_momentum,
            base=Normal(0.0, 0.005) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            init_scale=init_scale,
        )
        super().__init__(
            params,
            defaults,
            DiagonalAffineGroup(),
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

    def _validate(self, hp: dict[str, Any]) -> None:
        super()._validate(hp)
        check_number(hp, "scale_lr", 0.0, closed=False)
        check_number(hp, "scale_momentum", 0.0, 1.0)
        check_number(hp, "init_scale", 0.0, closed=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("scale_ratio", group["scale_lr"] / group["lr"])  # α₂ / α₁

    def _upgrade(self, param_groups: list[dict[str, Any]]) -> None:
        for group in param_groups:  # state dicts made before scale_ratio kept initial_lr
            group.setdefault(
                "scale_ratio", group["scale_lr"] / group.get("initial_lr", group["lr"])
            )

    def _new_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        theta = p.detach().to(state_dtype(p))
        element = self.lie_group.from_point(theta, group["init_scale"])
        return {"element": element, "momentum": torch.zeros_like(element)}

    def _draw(self, group: dict[str, Any], params: list[Tensor], xi: list[Tensor]) -> list[Tensor]:
        affine_draw(self._gather(params, "element"), xi, params)
        return xi

    def _accumulate(self, group, params, noise, grads, first) -> None:
        affine_accumulate(self._accumulators(params), noise, grads, first)

    def _propose(
        self, group: dict[str, Any], params: list[Tensor], n: int, sample: Deferred | None
    ) -> Proposal:
        accs, momenta = self._accumulators(params), self._gather(params, "momentum")
        shift = group["temperature"] / group["data_size"] if group["temperature"] else 0.0
        betas = (group["scale_momentum"], group["momentum"])
        elements = self._gather(params, "element")
        deferred = None if sample is None else (sample.noise, sample.grads)
        if not self.compile:
            affine_propose(accs, momenta, elements, n, betas, shift, deferred)
            return Proposal(accs)
        rate, mean = self._rate(group), self._mean(group)
        hp = (n, betas, shift, rate, rate * group["scale_ratio"], mean)
        tensors = [
            self._parts(params, ts) for ts in (accs, momenta, elements, self._spares(params))
        ]
        sums = compiled(affine_update)(*tensors, params, hp, deferred)
        return Proposal(accs, sums)

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        if self.compile:  # moved by the proposal
            self._swap(params, "element", "spare")
            return
        elements, momenta = self._gather(params, "element"), self._gather(params, "momentum")
        lr, mean = group["lr"], self._mean(group)
        work = self._accumulators(params)  # the old momenta: free
        affine_commit_(elements, momenta, work, params, lr, lr * group["scale_ratio"], mean)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        mean = self._mean(group)
        for g, p in zip(self._gather(params, "element"), params, strict=True):
            _point(p, g[0], g[1], mean)
