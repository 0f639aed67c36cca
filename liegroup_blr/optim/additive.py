r"""The additive rule: noisy SGD with momentum, θ = m + ξ.

.. math::
    \hat X = \frac1S \sum_s \nabla\bar\ell_\delta(m + \xi_s), \qquad
    M \leftarrow \beta M + (1-\beta)\hat X, \qquad m \leftarrow m - \alpha M.

The optimizer class holds the hyperparameters, the rule class the initial state and the calls
the engine makes; below them the formulas, their in-place twins for eager steps, and the
dispatcher :func:`additive` at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal
from typing_extensions import Unpack

from ..groups import AdditiveGroup
from .base import BLROptimizer
from .checks import check_momentum, former_positional, required
from .kernel_utils import compiled, momentum
from .options import EngineOptions
from .rule import Rule
from .scratch import state_dtype
from .tensors import GroupTensors, Proposal

__all__ = [
    "AdditiveBLR",
    "AdditiveRule",
    "additive",
    "additive_accumulate",
    "additive_draw",
    "additive_momentum_",
    "additive_move",
    "additive_move_",
    "additive_readout",
    "additive_readout_",
    "additive_update",
]


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

    ``lgb.AdditiveBLR(params, lr, momentum, base, *, data_size, ...)``: the arguments from
    ``data_size`` on are keyword-only. Passed by position (0.1.0 took ``data_size``,
    ``temperature``, ``prior_precision``, ``mc_samples`` there), they are taken in that order
    with a FutureWarning naming the keyword fix, for one release.

    Args:
        params: parameters or param groups.
        lr: α > 0.
        momentum: β ∈ [0, 1).
        base: q0, default ``Normal(0, 1e-3)`` (the reference MLP's).
        data_size: N, the number of training examples; keyword-only, required when
            ``prior_precision`` > 0.
        temperature: τ ≥ 0 (no effect: the entropy of m + ξ does not depend on m).
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        weight_decay: w ≥ 0, L2 as ``torch.optim.SGD``'s: adds w·θ to each sample's gradient
            (the prior N(0, 1/(wN)), δ = wN); the default of the param-group key.
        point_at: ``"g"`` (m) or ``"mean"`` (m + E[ξ]).
        **engine: the engine's keyword-only options, :class:`~liegroup_blr.optim.EngineOptions`.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        momentum: float = 0.9,
        base: Distribution | None = None,
        *deprecated: Any,
        data_size: float | None = None,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        weight_decay: float = 0.0,
        point_at: str = "g",
        **engine: Unpack[EngineOptions],
    ) -> None:
        required(
            "AdditiveBLR",
            lr=(lr, "the step size α of the mean m (0.05 with momentum 0.9 is a start)"),
        )
        data_size, temperature, prior_precision, mc_samples = former_positional(
            "AdditiveBLR", deprecated, data_size, temperature, prior_precision, mc_samples
        )
        check_momentum("AdditiveBLR", momentum)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=Normal(0.0, 1e-3) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            weight_decay=weight_decay,
        )
        rule = AdditiveRule(AdditiveGroup())
        super().__init__(params, defaults, rule, mc_samples=mc_samples, point_at=point_at, **engine)


class AdditiveRule(Rule):
    """The additive rule as the engine calls it (:class:`~.rule.Rule`)."""

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        m = p.detach().to(state_dtype(p), copy=True)
        return {"element": m, "momentum": torch.zeros_like(m)}

    def draw(self, group: dict[str, Any], t: GroupTensors, xi: list[Tensor]) -> list[Tensor]:
        additive_draw(t.elements, xi, t.params)
        return xi

    def accumulate(self, group, t, noise, grads, first) -> None:
        additive_accumulate(t.accs, grads, first=first)

    def propose(self, group, t, n, sample, offset, draw_next) -> Proposal:
        grads = None if sample is None else sample[1]
        prior = offset if isinstance(offset, list) else None  # the entropy's is 0: constant
        beta, lr, c = group["momentum"], group["lr"], self.compile
        return additive(
            t, grads, n=n, beta=beta, lr=lr, offset=prior, draw_next=draw_next, compile=c
        )

    def write_point(self, group, params, elements, mean) -> None:
        additive_readout_(params, elements, mean=mean)

    def check_prior(self, group: dict[str, Any], strength: float) -> None:
        """The posterior of m + ξ has the base's fixed covariance σ²I, so as a prior it pulls
        m back with the constant curvature c = wτ/(Nσ²); the momentum step
        M ← βM + (1 − β)c·m, m ← m − αM is stable only for αc < 2(1 + β)/(1 − β)."""
        n, variance = group["data_size"], float(torch.as_tensor(group["base"].variance).min())
        if n is None or not variance > 0:
            return
        lr, beta = group["lr"], group["momentum"]
        pull = strength * group["temperature"] / (n * variance)
        limit = 2 * (1 + beta) / (1 - beta)
        if lr * pull >= limit:
            raise ValueError(
                f"set_prior: the additive rule's posterior keeps the base's fixed variance "
                f"σ² = {variance:.3g}, so as a prior it pulls every weight back with "
                f"c = wτ/(Nσ²) = {pull:.4g}, and lr·c = {lr * pull:.4g} is past the stable "
                f"limit 2(1+β)/(1−β) = {limit:.4g}: lower lr below {limit / pull:.3g}, pass "
                f"strength below {strength * limit / (lr * pull):.3g}, or use AffineBLR, "
                "whose posterior learns its scale"
            )


# ------------------------------------------------------------------ the formulas
def additive_move(m: Tensor, mom: Tensor, lr: float | Tensor) -> Tensor:
    """m ← m − α M, the additive exp map."""
    return m - mom * lr


def additive_readout(m: Tensor, mean: float | None) -> Tensor:
    """The point estimate m (m + E[ξ] under ``point_at="mean"``)."""
    return m if mean is None else m + mean


# ------------------------------------------------------------ eager, in place
def additive_draw(elements: list[Tensor], xi: list[Tensor], params: list[Tensor]) -> None:
    """θ = m + ξ."""
    for m, x, p in zip(elements, xi, params, strict=True):
        torch.add(m, x, out=p)


def additive_accumulate(accs: list[Tensor], grads: list[Tensor], *, first: bool) -> None:
    """acc (+)= ∇ℓ̄_δ(θ), the algebra gradient of one sample."""
    for acc, grad in zip(accs, grads, strict=True):
        if first:
            acc.copy_(grad)
        else:
            acc.add_(grad)


def additive_momentum_(
    accs: list[Tensor],
    momenta: list[Tensor],
    *,
    n: int,
    beta: float,
    grads: list[Tensor] | None = None,
    offset: list[Tensor] | None = None,
) -> None:
    """:func:`~.kernel_utils.momentum` in place, into the accumulators: acc ← β M + (1 − β)
    (acc/n + c), or from the ``grads`` of a deferred sample in the same pass; c is 0 (the
    entropy is constant) or a prior's ``offset``."""
    for i, (acc, m) in enumerate(zip(accs, momenta, strict=True)):
        x = acc if grads is None else grads[i]
        if offset is not None:
            x = torch.add(offset[i], x, alpha=1.0 / n, out=acc)
        elif n > 1 or x.dtype != acc.dtype:  # (half-precision gradients, float32 state)
            x = torch.mul(x, 1.0 / n, out=acc)
        torch.lerp(x, m, beta, out=acc)


def additive_move_(elements: list[Tensor], momenta: list[Tensor], *, lr: float) -> None:
    """:func:`additive_move` in place."""
    for m, mom in zip(elements, momenta, strict=True):
        m.add_(mom, alpha=-lr)


def additive_readout_(params: list[Tensor], elements: list[Tensor], *, mean: float | None):
    """:func:`additive_readout` into the parameters."""
    for p, m in zip(params, elements, strict=True):
        if mean is None:
            p.copy_(m)
        else:
            torch.add(m, mean, out=p)


# ------------------------------------------------------------ the implementations
def _additive_commit(t: GroupTensors, *, lr: float) -> None:
    additive_move_(t.elements, t.accs, lr=lr)  # the accumulators hold the new momenta
    additive_readout_(t.params, t.elements, mean=t.mean)


def additive_update(
    accs: list[Tensor],
    momenta: list[Tensor],
    elements: list[Tensor],
    spares: list[Tensor],
    params: list[Tensor],
    grads: list[Tensor] | None,
    offset: list[Tensor] | None,
    noise: list[Tensor],
    *,
    n: int,
    beta: float,
    lr: Tensor,
    mean: float | None,
    draw_next: bool = False,
) -> list[Tensor]:
    """The whole update as formulas, one loop per parameter under ``torch.compile``: the
    new momentum into ``accs``, the moved element into ``spares``, θ into ``params`` (the
    point estimate; with ``draw_next``, the next sample m' + ξ', ξ' read from the accumulator
    of a one-sample step and kept in ``noise``); returns each new momentum's sum (not
    finite if any entry is not)."""
    sums = []
    for i, (acc, m, g, spare, p) in enumerate(
        zip(accs, momenta, elements, spares, params, strict=True)
    ):
        c = 0.0 if offset is None else offset[i]
        new = momentum(acc if grads is None else grads[i], m, n=n, beta=beta, offset=c)
        moved = additive_move(g, new, lr)
        if draw_next:  # ξ' read from the accumulator before the new momentum is written there
            noise[i].copy_(acc)  # (through a clone, inductor read acc after its overwrite)
            p.copy_(moved + noise[i])
        else:
            p.copy_(additive_readout(moved, mean))
        acc.copy_(new)
        spare.copy_(moved)
        sums.append(new.sum())
    return sums


def additive(
    t: GroupTensors,
    grads: list[Tensor] | None,
    *,
    n: int,
    beta: float,
    lr: float,
    offset: list[Tensor] | None,
    draw_next: bool,
    compile: bool,
) -> Proposal:
    """The additive rule's update of a param group from its accumulators (``n`` samples) or
    the ``grads`` of its one deferred sample, with a prior's ``offset`` of the algebra
    gradient: eager, in place, or as one compiled kernel per parameter into the spares
    (which also draws the next sample with ``draw_next``)."""
    if not compile:
        additive_momentum_(t.accs, t.momenta, n=n, beta=beta, grads=grads, offset=offset)
        return Proposal(t.accs, commit=partial(_additive_commit, t, lr=lr))
    rate = torch.tensor(lr, dtype=t.elements[0].dtype)  # a tensor: schedules do not recompile
    sums = compiled(additive_update)(
        t.accs,
        t.momenta,
        t.elements,
        t.spares,
        t.params,
        grads,
        offset,
        t.noise,
        n=n,
        beta=beta,
        lr=rate,
        mean=t.mean,
        draw_next=draw_next,
    )
    return Proposal(t.accs, sums)
