r"""The multiplicative rule: positive scalings, with excitatory/inhibitory parts.

Each weight is :math:`\theta = g^+\xi^+ - g^-\xi^-` (``signed``) or :math:`g\xi`; elements,
momenta, accumulators and noise of a signed parameter stack the two parts, shape (2, …).

.. math::
    \hat X^\pm = \pm\frac1S \sum_s \nabla\bar\ell_\delta(\theta_s) \odot g^\pm \xi^\pm_s
                 - \frac{\tau}{N}, \qquad
    M^\pm \leftarrow \beta M^\pm + (1-\beta)\hat X^\pm, \qquad
    g^\pm \leftarrow g^\pm \odot e^{-\alpha M^\pm}.

The kernels act on explicit tensor lists one tensor at a time: in place for eager steps,
and :func:`multiplicative_update`, what ``compile=True`` runs, over the rows of each tensor
(one loop per parameter).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution

from ..distributions import Rayleigh
from ..groups import MultiplicativeGroup
from .base import BLROptimizer
from .checks import check_number
from .kernels import LOG2E, Parts, Proposal, compiled, parts
from .sample import Deferred
from .state import state_dtype

__all__ = [
    "MultiplicativeBLR",
    "multiplicative_accumulate",
    "multiplicative_commit_",
    "multiplicative_draw",
    "multiplicative_noise",
    "multiplicative_propose",
    "multiplicative_update",
]

INITS = ("reference", "keep")


def _readout(p: Tensor, w: Tensor, signed: bool, mean: float | None = None) -> None:
    """p ← w⁺ − w⁻ (or w), times E[ξ] when ``mean`` is given."""
    if signed:
        torch.sub(w[0], w[1], out=p)
    else:
        p.copy_(w)
    if mean is not None:
        p.mul_(mean)


def multiplicative_noise(
    elements: list[Tensor], xi: list[Tensor], out: list[Tensor], signed: bool
) -> None:
    """w = (g⁺ξ⁺, −g⁻ξ⁻) (or gξ) into ``out``: the signed noise an eager accumulation reads
    (the sign: that of the − part's algebra gradient)."""
    for g, x, w in zip(elements, xi, out, strict=True):
        torch.mul(x, g, out=w)
        if signed:
            w[1].neg_()


def multiplicative_draw(
    elements: list[Tensor],
    xi: list[Tensor],
    params: list[Tensor],
    signed: bool,
    noise: list[Tensor] | None = None,
) -> None:
    """θ = g⁺ξ⁺ − g⁻ξ⁻ (or gξ); with ``noise``, as w⁺ + (−w⁻) from the signed noise
    (:func:`multiplicative_noise`) kept there, else from ξ directly."""
    if noise is not None:
        multiplicative_noise(elements, xi, noise, signed)
        for w, p in zip(noise, params, strict=True):
            if signed:
                torch.add(w[0], w[1], out=p)
            else:
                p.copy_(w)
        return
    for g, x, p in zip(elements, xi, params, strict=True):
        if not signed:
            torch.mul(g, x, out=p)
        elif p.dtype == g.dtype:
            torch.mul(g[0], x[0], out=p).addcmul_(g[1], x[1], value=-1)
        else:  # a half-precision θ: rounded once, after the difference
            p.copy_(torch.addcmul(g[0] * x[0], g[1], x[1], value=-1))


def multiplicative_accumulate(
    accs: list[Tensor], noise: list[Tensor], grads: list[Tensor], first: bool
) -> None:
    """acc (+)= ∇ℓ̄_δ ⊙ (w⁺, −w⁻): the algebra gradient of one sample."""
    for acc, w, grad in zip(accs, noise, grads, strict=True):
        if first:
            torch.mul(w, grad, out=acc)
        else:
            acc.addcmul_(w, grad)


def multiplicative_propose(
    accs: list[Tensor],
    momenta: list[Tensor],
    n: int,
    beta: float,
    shift: float,
    sample: tuple[list[Tensor], list[Tensor]] | None = None,
) -> None:
    """acc ← β M + (1 − β)(acc/n − τ/N); with ``sample`` = (noise, grads) of a deferred
    sample, acc = its :func:`multiplicative_accumulate` is made in the same pass."""
    for i, (acc, m) in enumerate(zip(accs, momenta, strict=True)):
        offset = acc.new_full((), -shift)
        if sample is None:
            torch.add(offset, acc, alpha=1.0 / n, out=acc)
        else:
            torch.addcmul(offset, sample[0][i], sample[1][i], value=1.0 / n, out=acc)
        acc.lerp_(m, beta)


def multiplicative_commit_(
    elements: list[Tensor],
    momenta: list[Tensor],
    work: list[Tensor],
    params: list[Tensor],
    lr: float,
    signed: bool,
    mean: float | None,
) -> None:
    """g ← clamp(g ⊙ e^{−α M}) to [tiny, max] of the dtype (positive and finite for any
    step: an overflowed factor gives max, an underflowed one tiny), θ ← point estimate, in
    place, in the free buffers ``work`` (no allocation: large temporaries cost page faults on
    every eager step); e^x is computed as 2^{x log₂e} (exp2 is several times faster than exp
    on CPU)."""
    for g, m, ws, p in zip(elements, momenta, work, params, strict=True):
        info = torch.finfo(g.dtype)
        torch.mul(m, -lr * LOG2E, out=ws)
        g.mul_(ws.exp2_()).clamp_(info.tiny, info.max)
        _readout(p, g, signed, mean)


def multiplicative_update(
    accs: list[Parts],
    momenta: list[Parts],
    elements: list[Parts],
    out: list[Parts],
    params: list[Tensor],
    hp: tuple[int, float, float, float | Tensor, float | None],
    sample: tuple[list[Parts], list[Tensor]] | None = None,
) -> list[Tensor]:
    """:func:`multiplicative_propose` then :func:`multiplicative_commit_` of the proposal into
    ``out`` (``hp`` = n, β, τ/N, α, E[ξ]), in functional form over the parts (g⁺, g⁻) or (g,)
    of each tensor (:func:`~liegroup_blr.optim.kernels.parts`): what ``compile=True`` runs,
    one loop per parameter; a deferred ``sample`` is (ξ, grads), its w = ±g ⊙ ξ formed here.
    Returns each new momentum's sum (not finite if any entry is not)."""
    n, beta, shift, lr, mean = hp
    sums = []
    for i, (acc, m, g, o, p) in enumerate(zip(accs, momenta, elements, out, params, strict=True)):
        info, news, moved = torch.finfo(g[0].dtype), [], []
        for j in range(len(g)):
            if sample is None:
                x = acc[j]
            else:  # w = (g⁺ξ⁺, −g⁻ξ⁻) times the gradient
                x = g[j] * sample[0][i][j] * (-sample[1][i] if j else sample[1][i])
            news.append(torch.lerp(x * (1.0 / n) - shift, m[j], beta))
            moved.append((g[j] * torch.exp2(news[j] * (lr * -LOG2E))).clamp(info.tiny, info.max))
        for j in range(len(g)):  # the writes after all reads: one loop under inductor
            acc[j].copy_(news[j])
            o[j].copy_(moved[j])
        point = moved[0] - moved[1] if len(moved) == 2 else moved[0]
        p.copy_(point if mean is None else point * mean)
        sums.append(news[0].sum() + news[1].sum() if len(news) == 2 else news[0].sum())
    return sums


class MultiplicativeBLR(BLROptimizer):
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
    finite positive range of their dtype). Initialisation ``init="reference"``:
    :math:`g^\pm = |w^\pm| + \text{offset}` with :math:`w^+` the parameter's value and
    :math:`w^-` an independent-looking second draw of the same initialisation, made by a
    random permutation of its entries — this rewrites the weights. ``init="keep"`` keeps
    them (pretrained weights): :math:`g^\pm = \max(\pm\theta, 0) + \text{offset}`, so
    :math:`g^+ - g^- = \theta`. The parameters hold :math:`g^+ - g^-` outside
    :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params` (``point_estimate="mean"``:
    :math:`E[\xi](g^+ - g^-)`).

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
        init: ``"reference"`` or ``"keep"`` (see above).
        point_estimate: ``"g"`` or ``"mean"``.

    The keyword-only ``seed``, ``noise``, ``antithetic``, ``table_size``, ``compile``,
    ``process_group``, ``grad_scaler`` and ``max_consecutive_skips`` are those of
    :class:`~liegroup_blr.optim.BLROptimizer`.
    """

    lie_group: MultiplicativeGroup

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
        init: str = "reference",
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
        if init not in INITS:
            raise ValueError(f"init: must be one of {INITS}, got {init!r}")
        self.init = init
        self._permutations: torch.Generator | None = None  # for w⁻, apart from the noise
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=Rayleigh(1.0) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            init_offset=init_offset,
        )
        super().__init__(
            params,
            defaults,
            MultiplicativeGroup(signed=signed),
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
        check_number(hp, "init_offset", 0.0, closed=False)

    def _new_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        w = p.detach().to(state_dtype(p), copy=True)
        signed, offset = self.lie_group.signed, group["init_offset"]
        if self.init == "keep":
            g = self.lie_group.from_point(w, offset) if signed else w.abs() + offset
        else:
            if signed:
                if self._permutations is None:
                    self._permutations = torch.Generator().manual_seed(self.seed + 1)
                perm = torch.randperm(w.numel(), generator=self._permutations).to(w.device)
                w = torch.stack((w, w.flatten()[perm].view_as(w)))
            g = w.abs() + offset
        return {"element": g, "momentum": torch.zeros_like(g)}

    def _draw(self, group: dict[str, Any], params: list[Tensor], xi: list[Tensor]) -> list[Tensor]:
        """Eager steps keep the signed noise w; compiled steps keep ξ and form w in the update
        (:func:`multiplicative_update`), a draw with no w to write."""
        elements, signed = self._gather(params, "element"), self.lie_group.signed
        if self.compile:
            multiplicative_draw(elements, xi, params, signed)
            return xi
        w = [self._scratch[p]["noise"] for p in params]
        multiplicative_draw(elements, xi, params, signed, w)
        return w

    def _accumulate(self, group, params, noise, grads, first) -> None:
        if self.compile:  # noise is ξ: w formed in the spares, free until the update
            w = self._spares(params)
            multiplicative_noise(self._gather(params, "element"), noise, w, self.lie_group.signed)
            noise = w
        multiplicative_accumulate(self._accumulators(params), noise, grads, first)

    def _propose(
        self, group: dict[str, Any], params: list[Tensor], n: int, sample: Deferred | None
    ) -> Proposal:
        accs, momenta = self._accumulators(params), self._gather(params, "momentum")
        shift = group["temperature"] / group["data_size"] if group["temperature"] else 0.0
        if not self.compile:
            deferred = None if sample is None else (sample.noise, sample.grads)
            multiplicative_propose(accs, momenta, n, group["momentum"], shift, deferred)
            return Proposal(accs)
        signed = self.lie_group.signed
        hp = (n, group["momentum"], shift, self._rate(group), self._mean(group))
        tensors = (accs, momenta, self._gather(params, "element"), self._spares(params))
        rows = None if sample is None else (parts(sample.noise, signed), sample.grads)  # per step
        sums = compiled(multiplicative_update)(
            *(self._parts(params, ts, signed) for ts in tensors), params, hp, rows
        )
        return Proposal(accs, sums)

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        if self.compile:  # moved by the proposal
            self._swap(params, "element", "spare")
            return
        elements, momenta = self._gather(params, "element"), self._gather(params, "momentum")
        work = self._accumulators(params)  # the old momenta: free
        signed, mean = self.lie_group.signed, self._mean(group)
        multiplicative_commit_(elements, momenta, work, params, group["lr"], signed, mean)

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        mean, signed = self._mean(group), self.lie_group.signed
        for g, p in zip(self._gather(params, "element"), params, strict=True):
            _readout(p, g, signed, mean)
