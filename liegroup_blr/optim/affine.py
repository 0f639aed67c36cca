r"""The diagonal affine rule: θ = A ⊙ ξ + b, a Gaussian-like posterior for any q0.

Elements stack [A, b], momenta [M_U, M_V] (shape (2, …)); the accumulators stack the sums
[Σ ∇ℓ̄_δ ⊙ ξ_s, Σ ∇ℓ̄_δ], which the proposal multiplies by A (fixed during a step).

.. math::
    \hat U = \frac1S \sum_s \nabla\bar\ell_\delta(\theta_s) \odot A\xi_s - \frac{\tau}{N},
    \qquad \hat V = A \odot \frac1S \sum_s \nabla\bar\ell_\delta(\theta_s), \\
    b \leftarrow b - \alpha_1 A \odot M_V \odot \varphi(-\alpha_1 M_U), \qquad
    A \leftarrow A \odot e^{-\alpha_2 M_U}, \qquad \varphi(x) = \frac{e^x - 1}{x}.

The optimizer class holds the hyperparameters, the rule class the initial state and the calls
the engine makes; below them the formulas, their in-place twins for eager steps, and the
dispatcher :func:`affine` at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, Normal
from typing_extensions import Unpack

from ..groups import DiagonalAffineGroup
from ..groups.affine import exprel
from .base import BLROptimizer
from .checks import REQUIRED, check_number, required
from .kernel_utils import LOG2E, Rows, compiled, momentum, rows
from .options import EngineOptions
from .rule import Rule
from .scratch import state_dtype
from .tensors import GroupTensors, Proposal, SampleGrads

__all__ = [
    "INIT_HESSIAN",
    "SCALE_STEP",
    "AffineBLR",
    "AffineRule",
    "affine",
    "affine_accumulate",
    "affine_draw",
    "affine_momentum_",
    "affine_move",
    "affine_move_",
    "affine_readout",
    "affine_readout_",
    "affine_update",
]


SCALE_STEP = 0.03
"""ρ₂, the default :class:`AffineBLR` ``scale_step``: the fraction of the way to the scale's
fixed point per step (the precision is an average over about 1/ρ₂ ≈ 33 steps)."""

INIT_HESSIAN = 1.0
"""h₀, the curvature per example the initial scale assumes: σ₀² = τ/(N h₀ + δ)."""


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
    preconditioner on the algebra: with a Gaussian q0 of scale s the Fisher metric at the
    identity is :math:`\operatorname{diag}(1/s^2, 2)` on :math:`(v, u)`. Linearised in α this
    is the Bayesian learning rule for a diagonal Gaussian (a variance-preconditioned mean
    step), and on a quadratic loss with a Gaussian q0 its fixed point is the exact Gaussian
    posterior. The parameters hold :math:`b` outside
    :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params`.

    **Step sizes in natural units.** With σ = A·s, Stein's lemma gives
    :math:`\hat U \approx \sigma^2(h + \delta/N) - \tau/N` (h the per-example Hessian
    diagonal), so the scale's fixed point is :math:`\sigma_*^2 = \tau/(Nh + \delta)` and
    :math:`\partial\hat U/\partial\log A = 2\tau/N` there. ``scale_step`` ρ₂ sets
    :math:`\alpha_2 = \rho_2 N/(2\tau)`: one step (``scale_momentum`` 0) then moves the
    precision :math:`1/\sigma^2` the fraction ρ₂ of the way to its fixed point, as IVON's
    1 − β₂ does, at every N. The shift moves by :math:`\alpha_1 A^2\nabla\bar\ell_\delta
    = \alpha_1 (N s^2/\tau)\,(N\sigma^2/\tau)\nabla\bar\ell_\delta`; with the default base
    :math:`s = \sqrt{\tau/N}` this is :math:`\alpha_1 \nabla\bar\ell_\delta/(h + \delta/N)`
    at the fixed point: ``lr`` is the fraction of a Newton step, as IVON's lr. A step of
    ``scale_step`` grows log A by at most 2ρ₂: with a positive curvature Û ≥ −τ/N in
    expectation (at most ρ₂/2 of growth), and more is Monte-Carlo noise, of size α₂σ|∇ℓ̄|,
    which grows with σ and at a new task's large gradients would feed on itself. The initial
    scale is the posterior of the prior and h₀ = 1 of curvature per example,
    :math:`\sigma_0^2 = \tau/(N h_0 + \delta)` (:math:`A_0 = 1/\sqrt{1 + \delta/N}` with the
    default base; A₀ = 1, σ₀ = √(τ/N) at δ = 0).

    ``scale_lr`` instead gives α₂ itself, the reference's parametrisation, and then the
    reference's defaults apply: ``scale_momentum`` 0.999, base ``Normal(0, 0.005)``,
    ``init_scale`` 1. The same step as ``scale_lr=α₂`` is ``scale_step = 2τα₂/N``. At the
    reference's ResNet-20 values (α₂ = 0.05, N = 50,000, τ = 1) that is ρ₂ = 2·10⁻⁶: over its
    45,000 steps the scale moves a few percent (``docs/step_sizes.md``).

    ``lr`` (α₁) is what ``torch.optim.lr_scheduler`` schedules set; α₂ keeps its ratio to it:
    the scale's step is α₂ × lr / lr₀ with lr₀ the ``lr`` the param group was created with
    (every scheduler, including those that set ``lr`` at construction such as ``CyclicLR``,
    then keeps α₂/α₁ fixed).

    Args:
        params: parameters or param groups.
        lr: α₁ > 0, step size of the shift b; required. With the default base, the fraction
            of a Newton step (0.01 is a start: the README's).
        scale_lr: α₂ > 0, the scale's raw step (the reference's ``alpha2``); ``None`` (the
            default) to use ``scale_step``.
        momentum: β₁ ∈ [0, 1) for M_V.
        scale_momentum: β₂ ∈ [0, 1) for M_U; default 0 with ``scale_step`` (the step itself
            averages), 0.999 with ``scale_lr``.
        base: q0; default ``Normal(0, √(τ/N))`` from the constructor's τ and N
            (``Normal(0, 0.005)``, the reference ResNet-20's, with ``scale_lr``).
        data_size: N, the number of training examples; keyword-only and required (``None``
            only with ``scale_lr`` and τ = δ = 0).
        temperature: τ ≥ 0 (> 0 with ``scale_step``).
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        init_scale: initial A > 0; default σ₀/std(q0) with ``scale_step`` (1 with
            ``scale_lr``).
        scale_step: ρ₂ ∈ (0, 1], the fraction of the way to the scale's fixed point per step;
            default 0.03 (``SCALE_STEP``) when ``scale_lr`` is not given.
        weight_decay: w ≥ 0, L2 as ``torch.optim.SGD``'s: adds w·θ to each sample's gradient
            (the prior N(0, 1/(wN)), δ = wN); the default of the param-group key.
        point_at: ``"g"`` (b) or ``"mean"`` (b + A·E[ξ]).
        **engine: the engine's keyword-only options, :class:`~liegroup_blr.optim.EngineOptions`.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        scale_lr: float | None = None,
        momentum: float = 0.8,
        scale_momentum: float | None = None,
        base: Distribution | None = None,
        *,
        data_size: float | object | None = REQUIRED,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        init_scale: float | None = None,
        scale_step: float | None = None,
        weight_decay: float = 0.0,
        point_at: str = "g",
        **engine: Unpack[EngineOptions],
    ) -> None:
        required(
            "AffineBLR",
            lr=(
                lr,
                "the shift's step size α₁ (with the default base the fraction of a Newton "
                "step per update: 0.01 is a start)",
            ),
            data_size=(data_size, "N, the number of training examples (τ/N weighs the entropy)"),
        )
        reference = scale_lr is not None
        if reference and scale_step is not None:
            raise ValueError(
                "scale_step: give scale_lr (α₂, the reference's raw step) or scale_step (ρ₂, "
                "the fraction of the way to the scale's fixed point per step), not both"
            )
        defaults = dict(
            lr=lr,
            scale_lr=scale_lr,
            scale_step=None if reference else (SCALE_STEP if scale_step is None else scale_step),
            momentum=momentum,
            scale_momentum=(0.999 if reference else 0.0)
            if scale_momentum is None
            else scale_momentum,
            base=_default_base(reference, data_size, temperature) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            weight_decay=weight_decay,
            init_scale=1.0 if reference and init_scale is None else init_scale,
        )
        super().__init__(
            params,
            defaults,
            AffineRule(DiagonalAffineGroup()),
            mc_samples=mc_samples,
            point_at=point_at,
            **engine,
        )


def _default_base(reference: bool, data_size: Any, temperature: float) -> Distribution:
    """``Normal(0, 0.005)`` (the reference's) with ``scale_lr``, else ``Normal(0, √(τ/N))``:
    the base that makes ``lr`` the fraction of a Newton step (or the reference's, where τ/N
    is not a positive number: validation then names what is missing)."""
    if reference or not _positive(data_size) or not _positive(temperature):
        return Normal(0.0, 0.005)
    return Normal(0.0, math.sqrt(temperature / data_size))


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf


def initial_scale(group: dict[str, Any]) -> float:
    """A₀: ``init_scale``, or σ₀/std(q0) with σ₀² = τ/(N h₀ + δ + wN), h₀ = :data:`INIT_HESSIAN`
    (the posterior of the prior and h₀ of curvature per example)."""
    if group["init_scale"] is not None:
        return group["init_scale"]
    n = group["data_size"]
    precision = n * (INIT_HESSIAN + group.get("weight_decay", 0.0)) + group["prior_precision"]
    return math.sqrt(group["temperature"] / precision) / base_std(group["base"])


def base_std(base: Distribution) -> float:
    """The standard deviation of q0 as a float (ValueError naming ``init_scale`` if it has
    none)."""
    try:
        std = float(torch.as_tensor(base.stddev).max())
    except (NotImplementedError, RuntimeError, TypeError, ValueError):
        std = math.nan
    if not 0 < std < math.inf:
        raise ValueError(
            f"init_scale: the base {type(base).__name__} has no finite standard deviation to "
            "set the initial scale σ₀/std(q0) from; pass init_scale (A₀)"
        )
    return std


class AffineRule(Rule):
    """The diagonal affine rule as the engine calls it (:class:`~.rule.Rule`)."""

    lie_group: DiagonalAffineGroup

    def validate(self, options: dict[str, Any]) -> None:
        if options["scale_lr"] is not None:
            check_number(options, "scale_lr", 0.0, closed=False)
        else:
            check_number(options, "scale_step", 0.0, closed=False)
            if options["scale_step"] > 1:
                raise ValueError(f"scale_step: must lie in (0, 1], got {options['scale_step']}")
            if not (_positive(options["temperature"]) and _positive(options["data_size"])):
                raise ValueError(
                    "scale_step: needs temperature > 0 and data_size (the scale's fixed point "
                    "is σ² = τ/(N h + δ)); at τ = 0 give the raw step scale_lr instead"
                )
        check_number(options, "scale_momentum", 0.0, 1.0)
        if options["init_scale"] is None:
            base_std(options["base"])
        else:
            check_number(options, "init_scale", 0.0, closed=False)

    def setup(self, group: dict[str, Any]) -> None:
        group.setdefault("scale_ratio", _scale(group) / group["lr"])  # α₂ / α₁ (ρ₂ / α₁)

    def upgrade(self, param_groups: list[dict[str, Any]]) -> None:
        for group in param_groups:  # state dicts made before scale_ratio kept initial_lr
            group.setdefault("scale_step", None)
            group.setdefault(
                "scale_ratio", group["scale_lr"] / group.get("initial_lr", group["lr"])
            )

    def scale_steps(self, group: dict[str, Any]) -> tuple[float, float]:
        """(α₂, γ) now, both times lr/lr₀: α₂ = ``scale_lr``, or ρ₂N/(2τ) from ``scale_step``;
        γ the most log A grows in a step: with ``scale_step`` 2ρ₂, four times the growth
        α₂τ/N = ρ₂/2 of Û = −τ/N, below which Û cannot lie in expectation when the curvature
        is positive (the entropy's −τ/N plus σ² times the data's, prior's and KL's
        curvature). The rest is Monte-Carlo noise, of size α₂σ|∇ℓ̄|: it grows with σ and, at
        the start of a new task's large gradients, would feed on itself. With ``scale_lr``,
        γ = ∞ (the reference's rule, unchanged)."""
        alpha = group["lr"] * group["scale_ratio"]
        if group["scale_lr"] is not None:
            return alpha, math.inf
        return alpha * group["data_size"] / (2 * group["temperature"]), 2 * alpha

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        theta = p.detach().to(state_dtype(p))
        element = self.lie_group.from_point(theta, initial_scale(group))
        return {"element": element, "momentum": torch.zeros_like(element)}

    def draw(self, group: dict[str, Any], t: GroupTensors, xi: list[Tensor]) -> list[Tensor]:
        affine_draw(t.elements, xi, t.params)
        return xi

    def accumulate(self, group, t, noise, grads, first) -> None:
        affine_accumulate(t.accs, noise, grads, first=first)

    def propose(self, group, t, n, sample, offset, draw_next) -> Proposal:
        scale_lr, growth = self.scale_steps(group)
        return affine(
            t,
            sample,
            draw_next=draw_next,
            n=n,
            betas=(group["scale_momentum"], group["momentum"]),
            offset=offset,
            lr=group["lr"],
            scale_lr=scale_lr,
            growth=growth,
            compile=self.compile,
        )

    def write_point(self, group, params, elements, mean) -> None:
        affine_readout_(params, elements, mean=mean)


def _scale(group: dict[str, Any]) -> float:
    return group["scale_lr"] if group["scale_lr"] is not None else group["scale_step"]


# ------------------------------------------------------------------ the formulas
def affine_move(
    g: Rows,
    u: Tensor,
    v: Tensor,
    lr: float | Tensor,
    scale_lr: float | Tensor,
    growth: float | Tensor = math.inf,
) -> tuple[Tensor, Tensor]:
    """(A e^{min(−α₂ u, γ)}, b − α₁ A v φ(−α₁ u)) for g = (A, b), both clamped to the finite
    range (A > 0) for any step; γ = ``growth`` bounds how far log A grows in a step. φ is
    the group's :func:`~liegroup_blr.groups.exprel` (a Taylor series near 0: inductor's
    vectorised ``expm1`` on CPU is exp(x) − 1, which loses every digit there); e^x as
    2^{x log₂e}, several times faster on CPU."""
    info = torch.finfo(g[0].dtype)
    phi = exprel(u * -lr).clamp(max=info.max)  # φ > 0: an overflow gives max
    b = g[1] - g[0] * (phi * v) * lr  # φ·v: finite factors, never inf·0
    A = g[0] * torch.exp2((u * (scale_lr * -LOG2E)).clamp(max=growth * LOG2E))
    return A.clamp(info.tiny, info.max), b.clamp(-info.max, info.max)


def affine_readout(A: Tensor, b: Tensor, mean: float | None) -> Tensor:
    """The point estimate b (b + A·E[ξ] under ``point_at="mean"``)."""
    return b if mean is None else b + A * mean


# ------------------------------------------------------------ eager, in place
def affine_draw(elements: list[Tensor], xi: list[Tensor], params: list[Tensor]) -> None:
    """θ = A ⊙ ξ + b (ξ itself is what the accumulation reads)."""
    for g, x, p in zip(elements, xi, params, strict=True):
        torch.addcmul(g[1], g[0], x, out=p)


def affine_accumulate(
    accs: list[Tensor], noise: list[Tensor], grads: list[Tensor], *, first: bool
) -> None:
    """acc (+)= (∇ℓ̄_δ ⊙ ξ, ∇ℓ̄_δ): the algebra gradient (∇ℓ̄_δ ⊙ Aξ, A ⊙ ∇ℓ̄_δ) of one sample
    but for the factor A, which :func:`affine_momentum_` applies to the sum."""
    for acc, xi, grad in zip(accs, noise, grads, strict=True):
        if first:
            torch.mul(xi, grad, out=acc[0])
            acc[1].copy_(grad)
        else:
            acc[0].addcmul_(xi, grad)
            acc[1].add_(grad)


def affine_momentum_(
    accs: list[Tensor],
    momenta: list[Tensor],
    elements: list[Tensor],
    *,
    n: int,
    betas: tuple[float, float],
    offset: float | list[Tensor],
    sample: SampleGrads | None = None,
) -> None:
    """:func:`~.kernel_utils.momentum` of both rows in place, into the accumulators:
    [M_U, M_V] ← [lerp(A acc_U/n + c_U, M_U, β₂), lerp(A acc_V/n + c_V, M_V, β₁)], c = (−τ/N, 0)
    from the entropy or a prior's ``offset`` per tensor; with ``sample`` = (ξ, ∇ℓ̄_δ) of a
    deferred sample, its :func:`affine_accumulate` made in the same pass."""
    for i, (acc, m, g) in enumerate(zip(accs, momenta, elements, strict=True)):
        if isinstance(offset, float):  # 0-d tensors: the out= forms allocate nothing
            c_u, c_v = acc.new_full((), offset), None
        else:
            c_u, c_v = offset[i][0], offset[i][1]
        if sample is None:
            torch.addcmul(c_u, acc[0], g[0], value=1 / n, out=acc[0])
            c = acc.new_zeros(()) if c_v is None else c_v
            torch.addcmul(c, acc[1], g[0], value=1 / n, out=acc[1])
        else:
            torch.mul(g[0], sample[1][i], out=acc[1])
            torch.addcmul(c_u, acc[1], sample[0][i], out=acc[0])
            if c_v is not None:
                acc[1].add_(c_v)
        for row, beta in enumerate(betas):
            acc[row].lerp_(m[row], beta)


def affine_move_(
    elements: list[Tensor],
    momenta: list[Tensor],
    work: list[Tensor],
    *,
    lr: float,
    scale_lr: float,
    growth: float = math.inf,
) -> None:
    """:func:`affine_move` in place, in the free buffers ``work`` (no allocation: large
    temporaries cost page faults on every eager step), with φ as expm1(x)/x."""
    for g, m, ws in zip(elements, momenta, work, strict=True):
        info = torch.finfo(g.dtype)
        x, phi = ws[0], ws[1]
        torch.mul(m[0], -lr, out=x)
        torch.expm1(x, out=phi)  # φ(x) = expm1(x)/x, ATen's expm1 exact near 0; φ(0) = 1
        phi.div_(x).nan_to_num_(nan=1.0, posinf=info.max)  # φ > 0: an overflow gives max
        phi.mul_(m[1])
        g[1].addcmul_(phi, g[0], value=-lr).clamp_(-info.max, info.max)
        torch.mul(m[0], -scale_lr * LOG2E, out=x)
        if growth < math.inf:
            x.clamp_(max=growth * LOG2E)
        g[0].mul_(x.exp2_()).clamp_(info.tiny, info.max)


def affine_readout_(params: list[Tensor], elements: list[Tensor], *, mean: float | None):
    """:func:`affine_readout` into the parameters."""
    for p, g in zip(params, elements, strict=True):
        if mean is None:
            p.copy_(g[1])
        else:
            torch.add(g[1], g[0], alpha=mean, out=p)


# ------------------------------------------------------------ the implementations
def _affine_commit(t: GroupTensors, *, lr: float, scale_lr: float, growth: float) -> None:
    # the accumulators hold the new momenta, the momenta lists the old ones: free
    affine_move_(t.elements, t.accs, t.momenta, lr=lr, scale_lr=scale_lr, growth=growth)
    affine_readout_(t.params, t.elements, mean=t.mean)


def affine_update(
    accs: list[Rows],
    momenta: list[Rows],
    elements: list[Rows],
    spares: list[Rows],
    params: list[Tensor],
    sample: SampleGrads | None,
    offset: float | list[Rows],
    noise: list[Tensor],
    *,
    n: int,
    betas: tuple[float, float],
    lr: Tensor,
    scale_lr: Tensor,
    growth: Tensor,
    mean: float | None,
    draw_next: bool = False,
) -> list[Tensor]:
    """The whole update as formulas over the rows (A, b) of each tensor, one loop per
    parameter under ``torch.compile``: the new momentum into ``accs``, the moved element
    into ``spares``, θ into ``params`` (the point estimate; with ``draw_next``, the next sample
    A'ξ' + b', ξ' read from the accumulator's first row in a one-sample step and kept in
    ``noise``, the step's ξ read from ``noise``), from the accumulators or a deferred
    ``sample`` (ξ, ∇ℓ̄_δ); returns each new momentum's sum (not finite if any entry is not)."""
    sums = []
    for i, (acc, m, g, spare, p) in enumerate(
        zip(accs, momenta, elements, spares, params, strict=True)
    ):
        if sample is None:
            x_u, x_v = acc[0] * g[0], acc[1] * g[0]
        else:
            x_v = g[0] * sample[1][i]
            x_u = x_v * (noise[i] if draw_next else sample[0][i])
        c = (offset, 0.0) if isinstance(offset, float) else offset[i]
        u = momentum(x_u, m[0], n=n, beta=betas[0], offset=c[0])
        v = momentum(x_v, m[1], n=n, beta=betas[1], offset=c[1])
        A, b = affine_move(g, u, v, lr, scale_lr, growth)
        if draw_next:  # ξ' read from the accumulator before the new momentum is written there
            xi = acc[0].clone()
            p.copy_(A * xi + b)
            noise[i].copy_(xi)
        else:
            p.copy_(affine_readout(A, b, mean))
        for row, (new_m, new_g) in enumerate(((u, A), (v, b))):
            acc[row].copy_(new_m)
            spare[row].copy_(new_g)
        sums.append(u.sum() + v.sum())
    return sums


def affine(
    t: GroupTensors,
    sample: SampleGrads | None,
    *,
    draw_next: bool,
    n: int,
    betas: tuple[float, float],
    offset: float | list[Tensor],
    lr: float,
    scale_lr: float,
    growth: float = math.inf,
    compile: bool,
) -> Proposal:
    """The affine rule's update of a param group from its accumulators (``n`` samples) or
    its one deferred ``sample`` (ξ, ∇ℓ̄_δ): eager, in place, or as one compiled kernel per
    parameter into the spares (which also draws the next sample with ``draw_next``)."""
    if not compile:
        affine_momentum_(
            t.accs, t.momenta, t.elements, n=n, betas=betas, offset=offset, sample=sample
        )
        commit = partial(_affine_commit, t, lr=lr, scale_lr=scale_lr, growth=growth)
        return Proposal(t.accs, commit=commit)
    dtype = t.elements[0].dtype  # step sizes as tensors: schedules do not recompile
    sums = compiled(affine_update)(
        *(t.rows(ts, True) for ts in (t.accs, t.momenta, t.elements, t.spares)),  # type: ignore[arg-type]
        t.params,
        sample,
        offset if isinstance(offset, float) else rows(offset),  # new each step
        t.noise,
        n=n,
        betas=betas,
        lr=torch.tensor(lr, dtype=dtype),
        scale_lr=torch.tensor(scale_lr, dtype=dtype),
        growth=torch.tensor(growth, dtype=dtype),
        mean=t.mean,
        draw_next=draw_next,
    )
    return Proposal(t.accs, sums)
