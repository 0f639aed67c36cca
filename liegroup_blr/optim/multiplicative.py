"""The multiplicative rule: positive scalings, with excitatory/inhibitory parts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution

from ..distributions import Rayleigh
from ..groups import MultiplicativeGroup
from .generic import LieGroupBLR, _number, state_dtype

__all__ = ["MultiplicativeBLR"]


def clamp_finite_positive_(tensors: list[Tensor]) -> None:
    """Clamp in place to [tiny, max] of the dtype: positive and finite for any step."""
    if tensors:
        info = torch.finfo(tensors[0].dtype)
        torch._foreach_clamp_min_(tensors, info.tiny)
        torch._foreach_clamp_max_(tensors, info.max)


def exp_step_(workspace: list[Tensor], rate: float | Tensor) -> list[Tensor]:
    """``workspace ← exp(−rate · workspace)`` in place. It may overflow to inf or underflow
    to 0: multiplied into an element ≥ tiny and clamped, that is max or tiny, never NaN."""
    torch._foreach_mul_(workspace, -rate)
    torch._foreach_exp_(workspace)
    return workspace


class MultiplicativeBLR(LieGroupBLR):
    r"""Lie-group BLR with the multiplicative group: excitatory/inhibitory networks.

    Each weight is :math:`\theta = g^+ \odot \xi^+ - g^- \odot \xi^-` with positive
    :math:`g^\pm` and fresh independent :math:`\xi^\pm \sim q_0` on (0, ∞) at every sample
    (``signed=False``: :math:`\theta = g \odot \xi`). With :math:`\bar\ell_\delta = \bar\ell
    + \frac{\delta}{2N}\|\theta\|^2`:

    .. math::
        \hat X^\pm = \pm\frac1S \sum_s \nabla\bar\ell_\delta(\theta_s) \odot g^\pm \xi^\pm_s
                     - \frac{\tau}{N}, \qquad
        M^\pm \leftarrow \beta M^\pm + (1-\beta)\hat X^\pm, \qquad
        g^\pm \leftarrow g^\pm \odot e^{-\alpha M^\pm}.

    The exponential keeps :math:`g^\pm` positive for any step (and they are clamped to the
    finite positive range of their dtype). Initialisation (reference):
    :math:`g^\pm = |w^\pm| + \text{offset}` with :math:`w^+` the parameter's value and
    :math:`w^-` an independent-looking second draw of the same initialisation, made by a
    random permutation of its entries. The parameters hold :math:`g^+ - g^-` outside
    :meth:`~LieGroupBLR.sampled_params` (``point_estimate="mean"``: :math:`E[\xi](g^+ - g^-)`).

    Args:
        params: parameters or param groups.
        lr: α > 0 (reference MLP: 50).
        momentum: β ∈ [0, 1).
        base: q0 on (0, ∞), default ``Rayleigh(1)``.
        data_size: N, required when τ > 0 or δ > 0.
        temperature: τ ≥ 0 (reference MLP: 0.006).
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        init_offset: offset > 0 added to :math:`|w^\pm|` at initialisation.
        signed: excitatory/inhibitory parts (default) or a single positive part.
        **options: keyword-only optimizer-level options of :class:`LieGroupBLR`:
            ``point_estimate`` — ``"g"`` or ``"mean"``.
            ``seed``, ``noise``, ``antithetic``, ``table_size``, ``compile``,
            ``process_group``.
    """

    lie_group: MultiplicativeGroup
    _sample_buffers = ("w",)

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
        init_offset: float = 1e-5,
        *,
        signed: bool = True,
        **options: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=Rayleigh(1.0) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            init_offset=init_offset,
        )
        group = MultiplicativeGroup(signed=signed)
        self._permutations: torch.Generator | None = None  # for w⁻, apart from the noise
        self._construct(params, group, defaults, mc_samples, **options)

    def _check_hyperparameters(self, hp: dict[str, Any]) -> None:
        super()._check_hyperparameters(hp)
        _number(hp, "init_offset", 0.0, closed=False)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        w = p.detach().to(state_dtype(p))
        if self.lie_group.signed:
            if self._permutations is None:
                self._permutations = torch.Generator().manual_seed(self.seed + 1)
            perm = torch.randperm(w.numel(), generator=self._permutations)
            w = torch.stack((w, w.flatten()[perm.to(w.device)].view_as(w)))
        self.state[p] = {
            "element": w.abs() + group["init_offset"],
            "momentum": torch.zeros_like(w),
        }

    # Views of the two parts: index 0 is g⁺ (or g), index 1 is g⁻.
    def _parts(self, tensors: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        if not self.lie_group.signed:
            return tensors, []
        return [t[0] for t in tensors], [t[1] for t in tensors]

    def _readout_into(self, params: list[Tensor], tensors: list[Tensor]) -> None:
        """params ← t⁺ − t⁻ (or t when unsigned)."""
        plus, minus = self._parts(tensors)
        if not minus:
            torch._foreach_copy_(params, plus)
        elif params[0].dtype == plus[0].dtype:
            torch._foreach_copy_(params, plus)
            torch._foreach_sub_(params, minus)
        else:
            torch._foreach_copy_(params, torch._foreach_sub(plus, minus))

    def _draw(self, group: dict[str, Any], params: list[Tensor], train: bool) -> None:
        shape = self.lie_group.base_shape
        w = [self._buffer(p, "w", shape(p.shape)) for p in params]
        self._noise_into(group, params, w)
        torch._foreach_mul_(w, [self.state[p]["element"] for p in params])  # w = g ⊙ ξ
        self._readout_into(params, w)

    def _accumulate(self, group: dict[str, Any], params: list[Tensor], first: bool) -> None:
        grads = self._loss_gradients(group, params)
        w = [self._scratch[p]["w"] for p in params]
        for part in self._parts(w):
            if part:
                torch._foreach_mul_(part, grads)  # ∇ℓ ⊙ g ⊙ ξ, sign applied in _propose
        if first:  # this sample's buffer becomes the accumulator
            self._rename(params, "w", "acc")
        else:
            torch._foreach_add_(self._accumulators(params), w)

    def _propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        acc = self._accumulators(params)
        plus, minus = self._parts(acc)
        if n > 1:
            torch._foreach_div_(plus, n)
        if minus:
            torch._foreach_div_(minus, -n)
        if group["temperature"]:
            torch._foreach_sub_(acc, group["temperature"] / group["data_size"])
        torch._foreach_lerp_(acc, [self.state[p]["momentum"] for p in params], group["momentum"])
        return acc

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        acc = self._accumulators(params)
        torch._foreach_copy_([self.state[p]["momentum"] for p in params], acc)
        elements = [self.state[p]["element"] for p in params]
        torch._foreach_mul_(elements, exp_step_(acc, group["lr"]))
        clamp_finite_positive_(elements)
        self._write_point(group, params)

    def _fused_propose(self, group: dict[str, Any], params: list[Tensor], n: int) -> list[Tensor]:
        acc = self._accumulators(params)
        shift = group["temperature"] / group["data_size"] if group["temperature"] else 0.0
        for a, p in zip(acc, params, strict=True):
            scale: float | Tensor = 1.0 / n
            if self.lie_group.signed:  # X̂⁺ = acc⁺/n − τ/N, X̂⁻ = −acc⁻/n − τ/N
                signs = torch.tensor([1.0, -1.0], dtype=a.dtype).view(2, *[1] * (a.ndim - 1))
                scale = signs / n
            a.copy_(torch.lerp(a * scale - shift, self.state[p]["momentum"], group["momentum"]))
        return acc

    def _fused_commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        mean = self._mean(group) or 1.0
        for a, p in zip(self._accumulators(params), params, strict=True):
            state, info = self.state[p], torch.finfo(a.dtype)
            state["momentum"].copy_(a)
            g = (state["element"] * torch.exp(a * -group["lr"])).clamp(info.tiny, info.max)
            state["element"].copy_(g)
            p.copy_(((g[0] - g[1]) if self.lie_group.signed else g) * mean)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        self._readout_into(params, [self.state[p]["element"] for p in params])
        if self.point_estimate == "mean":
            torch._foreach_mul_(params, self._mean(group))
