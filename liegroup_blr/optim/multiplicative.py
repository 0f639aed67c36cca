r"""The multiplicative rule: positive scalings, with excitatory/inhibitory parts.

Each weight is :math:`\theta = g^+\xi^+ - g^-\xi^-` (``signed``) or :math:`g\xi`; elements,
momenta and accumulators of a signed parameter stack the two parts, shape (2, …), and so does
what a sample keeps of its draw, the products :math:`w = g \odot \xi`.

.. math::
    \hat X^\pm = \pm\frac1S \sum_s \nabla\bar\ell_\delta(\theta_s) \odot w^\pm_s
                 - \frac{\tau}{N}, \qquad
    M^\pm \leftarrow \beta M^\pm + (1-\beta)\hat X^\pm, \qquad
    g^\pm \leftarrow g^\pm \odot e^{-\alpha M^\pm}.

The optimizer class holds the hyperparameters, the rule class the initial state and the calls
the engine makes; below them the formulas, their in-place twins for eager steps, and the
dispatcher :func:`multiplicative` at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution
from typing_extensions import Unpack

from .._userline import warn
from ..distributions import Rayleigh
from ..groups import MultiplicativeGroup
from .base import BLROptimizer
from .checks import REQUIRED, check_number, required
from .kernel_utils import LOG2E, Rows, compiled, momentum, rows
from .options import EngineOptions
from .rule import Rule
from .scratch import state_dtype
from .tensors import GroupTensors, Proposal, SampleGrads

__all__ = [
    "MultiplicativeBLR",
    "MultiplicativeRule",
    "multiplicative",
    "multiplicative_accumulate",
    "multiplicative_draw",
    "multiplicative_momentum_",
    "multiplicative_move",
    "multiplicative_move_",
    "multiplicative_readout",
    "multiplicative_readout_",
    "multiplicative_update",
]

INITS = ("auto", "reference", "keep")


class MultiplicativeBLR(BLROptimizer):
    r"""Lie-group BLR with the multiplicative group: excitatory/inhibitory networks.

    By default (``init=None``: ``"auto"``, with one warning) construction rewrites the
    model's weights as :math:`g^+ - g^-` from :math:`|w|` and a random permutation of w (the
    reference initialisation). Pass ``init="keep"`` to keep them (pretrained weights), or
    ``init="auto"`` or ``"reference"`` to rewrite them without the warning.

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
    :math:`g^+ - g^- = \theta`. ``init="auto"`` (the default's) is ``"reference"``, except for a
    tensor whose entries are all equal (a norm layer's weights, a constant bias): a
    permutation of it is itself, so ``"reference"`` would give :math:`g^+ = g^-` and θ = 0;
    such a tensor is kept (on tensors that are not constant, and on constant ones equal to 0,
    ``"auto"`` and ``"reference"`` give the same elements). The parameters hold
    :math:`g^+ - g^-` outside :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params`
    (``point_at="mean"``: :math:`E[\xi](g^+ - g^-)`).

    Args:
        params: parameters or param groups.
        lr: α > 0 (reference MLP: 50).
        momentum: β ∈ [0, 1).
        base: q0 on (0, ∞), default ``Rayleigh(1)``.
        data_size: N, keyword-only and required (``None`` only with τ = δ = 0).
        temperature: τ ≥ 0 (reference MLP: 0.006).
        prior_precision: δ ≥ 0.
        mc_samples: S ≥ 1.
        init_offset: offset > 0 added to :math:`|w^\pm|` at initialisation.
        weight_decay: w ≥ 0, L2 as ``torch.optim.SGD``'s: adds w·θ to each sample's gradient
            (the prior N(0, 1/(wN)), δ = wN); the default of the param-group key.
        signed: excitatory/inhibitory parts (default) or a single positive part.
        init: ``"keep"``, ``"auto"`` or ``"reference"`` (see above); ``None``: ``"auto"``,
            warning once if it rewrites a weight.
        point_at: ``"g"`` or ``"mean"``.
        **engine: the engine's keyword-only options, :class:`~liegroup_blr.optim.EngineOptions`.
    """

    _rule: MultiplicativeRule

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        momentum: float = 0.9,
        base: Distribution | None = None,
        *,
        data_size: float | object | None = REQUIRED,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        init_offset: float = 1e-5,
        weight_decay: float = 0.0,
        signed: bool = True,
        init: str | None = None,
        point_at: str = "g",
        **engine: Unpack[EngineOptions],
    ) -> None:
        required(
            "MultiplicativeBLR",
            lr=(lr, "the step size α of log g± (2 on a small MLP, 50 on the reference's)"),
            data_size=(data_size, "N, the number of training examples (τ/N weighs the entropy)"),
        )
        if init is not None and init not in INITS:
            raise ValueError(f"init: must be one of {INITS}, got {init!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=Rayleigh(1.0) if base is None else base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            weight_decay=weight_decay,
            init_offset=init_offset,
        )
        rule = MultiplicativeRule(signed, init)
        super().__init__(params, defaults, rule, mc_samples=mc_samples, point_at=point_at, **engine)

    @property
    def signed(self) -> bool:
        """Whether elements have excitatory and inhibitory parts (g⁺, g⁻)."""
        return self._rule.signed

    @property
    def init(self) -> str:
        """How elements start from the weights: ``"keep"``, ``"auto"`` or ``"reference"``."""
        return self._rule.init


class MultiplicativeRule(Rule):
    """The multiplicative rule as the engine calls it (:class:`~.rule.Rule`).

    Args:
        signed: elements (g⁺, g⁻) with θ = g⁺ξ⁺ − g⁻ξ⁻, else g with θ = g ξ.
        init: ``"keep"``, ``"auto"`` or ``"reference"``; ``None``: ``"auto"``, warning once
            if it rewrites a weight.
    """

    lie_group: MultiplicativeGroup
    draw_next_from_views = True  # w = g ⊙ ξ is written either way

    def __init__(self, signed: bool, init: str | None) -> None:
        super().__init__(MultiplicativeGroup(signed=signed))
        self.signed = signed
        self.init = init or "auto"
        self._warn_rewrite = init is None  # the default rewrites weights: say so, once
        self._permutations: torch.Generator | None = None  # for w⁻, apart from the noise

    def validate(self, options: dict[str, Any]) -> None:
        check_number(options, "init_offset", 0.0, closed=False)

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        w = p.detach().to(state_dtype(p), copy=True)
        offset = group["init_offset"]
        flat = w.flatten()
        keep = self.init == "keep" or (self.init == "auto" and bool((flat == flat[:1]).all()))
        if self.signed and self.init != "keep":  # "auto" draws it too: the same stream
            if self._permutations is None:
                self._permutations = torch.Generator().manual_seed(self.seed + 1)
            perm = torch.randperm(w.numel(), generator=self._permutations).to(w.device)
            if not keep:
                w = torch.stack((w, flat[perm].view_as(w)))
                self._rewrote_weights()
        if keep and self.signed:
            g = self.lie_group.from_point(w, offset)
        else:
            g = w.abs() + offset
        return {"element": g, "momentum": torch.zeros_like(g)}

    def _rewrote_weights(self) -> None:
        """Warn, the first time only, that the default ``init`` rewrote a weight."""
        if self._warn_rewrite:
            self._warn_rewrite = False
            warn(
                "MultiplicativeBLR: init=None ('auto') rewrote the model's weights as "
                "g⁺ − g⁻ from |w| and a permutation of w; pass init='keep' to keep them "
                "(pretrained weights), or init='auto' to rewrite them without this warning"
            )

    def draw(self, group: dict[str, Any], t: GroupTensors, xi: list[Tensor]) -> list[Tensor]:
        multiplicative_draw(t.elements, xi, t.params, t.noise, signed=self.signed)
        return t.noise

    def sample_value(self, group, element, noise) -> Tensor:
        return self.lie_group.readout(noise)  # a sample's noise is w = g ⊙ ξ

    def with_point(self, group, g, theta, xi0) -> Tensor:
        return self.lie_group.with_point(g, theta, xi0, offset=group["init_offset"])

    def accumulate(self, group, t, noise, grads, first) -> None:
        multiplicative_accumulate(t.accs, noise, grads, first=first, signed=self.signed)

    def propose(self, group, t, n, sample, offset, draw_next) -> Proposal:
        return multiplicative(
            t,
            sample,
            draw_next=draw_next,
            n=n,
            beta=group["momentum"],
            offset=offset,
            lr=group["lr"],
            signed=self.signed,
            compile=self.compile,
        )

    def write_point(self, group, params, elements, mean) -> None:
        multiplicative_readout_(params, elements, mean=mean, signed=self.signed)


# ------------------------------------------------------------------ the formulas
def multiplicative_move(g: Tensor, m: Tensor, lr: float | Tensor) -> Tensor:
    """g ⊙ e^{−α M}, clamped to [tiny, max] of the dtype (positive and finite for any step:
    an overflowed factor gives max, an underflowed one tiny); e^x is computed as
    2^{x log₂e}, several times faster than exp on CPU."""
    info = torch.finfo(g.dtype)
    return (g * torch.exp2(m * (lr * -LOG2E))).clamp(info.tiny, info.max)


def multiplicative_readout(g: Rows, mean: float | None) -> Tensor:
    """The point estimate g⁺ − g⁻ (or g) of the rows of an element, times E[ξ] under
    ``point_at="mean"``."""
    point = g[0] - g[1] if len(g) == 2 else g[0]
    return point if mean is None else point * mean


# ------------------------------------------------------------ eager, in place
def multiplicative_draw(
    elements: list[Tensor],
    xi: list[Tensor],
    params: list[Tensor],
    noise: list[Tensor],
    *,
    signed: bool,
) -> None:
    """w = g ⊙ ξ into ``noise`` (what the sample keeps; ξ may be that buffer itself) and
    θ = w⁺ − w⁻ (or w), the readout of w."""
    for g, x, w in zip(elements, xi, noise, strict=True):
        torch.mul(g, x, out=w)
    multiplicative_readout_(params, noise, mean=None, signed=signed)


def multiplicative_accumulate(
    accs: list[Tensor], noise: list[Tensor], grads: list[Tensor], *, first: bool, signed: bool
) -> None:
    """acc (+)= (w⁺ ⊙ ∇ℓ̄_δ, −w⁻ ⊙ ∇ℓ̄_δ) (or w ⊙ ∇ℓ̄_δ): the algebra gradient of one sample."""
    for acc, w, grad in zip(accs, noise, grads, strict=True):
        if first:
            torch.mul(w, grad, out=acc)
            if signed:
                acc[1].neg_()
        elif signed:
            acc[0].addcmul_(w[0], grad)
            acc[1].addcmul_(w[1], grad, value=-1)
        else:
            acc.addcmul_(w, grad)


def multiplicative_momentum_(
    accs: list[Tensor],
    momenta: list[Tensor],
    *,
    n: int,
    beta: float,
    offset: float | list[Tensor],
    signed: bool,
    sample: SampleGrads | None = None,
) -> None:
    """:func:`~.kernel_utils.momentum` in place, into the accumulators: acc ← β M + (1 − β)
    (acc/n + c), c the entropy's −τ/N or a prior's ``offset`` per tensor; with ``sample`` =
    (w, ∇ℓ̄_δ) of a deferred sample, its :func:`multiplicative_accumulate` made in the same
    pass."""
    signs = (1.0, -1.0) if signed else (1.0,)
    for i, (acc, m) in enumerate(zip(accs, momenta, strict=True)):
        # a 0-d tensor for a number: the out= forms allocate nothing
        c = acc.new_full((), offset) if isinstance(offset, float) else offset[i]
        if sample is None:
            torch.add(c, acc, alpha=1.0 / n, out=acc)
        else:
            w, grad = sample[0][i], sample[1][i]
            for j, sign in enumerate(signs):
                out, wj, cj = (acc[j], w[j], c[j] if c.dim() else c) if signed else (acc, w, c)
                torch.addcmul(cj, wj, grad, value=sign / n, out=out)
        acc.lerp_(m, beta)


def multiplicative_move_(
    elements: list[Tensor], momenta: list[Tensor], work: list[Tensor], *, lr: float
) -> None:
    """:func:`multiplicative_move` in place, in the free buffers ``work`` (no allocation:
    large temporaries cost page faults on every eager step)."""
    for g, m, ws in zip(elements, momenta, work, strict=True):
        info = torch.finfo(g.dtype)
        torch.mul(m, -lr * LOG2E, out=ws)
        g.mul_(ws.exp2_()).clamp_(info.tiny, info.max)


def multiplicative_readout_(
    params: list[Tensor], elements: list[Tensor], *, mean: float | None, signed: bool
) -> None:
    """:func:`multiplicative_readout` into the parameters (of elements, or of products w)."""
    for p, g in zip(params, elements, strict=True):
        if mean is not None and p.dtype != g.dtype:  # a half-precision θ: rounded once
            p.copy_((g[0] - g[1] if signed else g) * mean)
            continue
        if signed:
            torch.sub(g[0], g[1], out=p)  # a half-precision θ: rounded once, after the difference
        else:
            p.copy_(g)
        if mean is not None:
            p.mul_(mean)


# ------------------------------------------------------------ the implementations
def _multiplicative_commit(t: GroupTensors, *, lr: float, signed: bool) -> None:
    # the accumulators hold the new momenta, the momenta lists the old ones: free
    multiplicative_move_(t.elements, t.accs, t.momenta, lr=lr)
    multiplicative_readout_(t.params, t.elements, mean=t.mean, signed=signed)


def multiplicative_update(
    accs: list[Rows],
    momenta: list[Rows],
    elements: list[Rows],
    spares: list[Rows],
    params: list[Tensor],
    sample: tuple[list[Rows], list[Tensor]] | None,
    offset: float | list[Rows],
    noise: list[Rows],
    *,
    n: int,
    beta: float,
    lr: Tensor,
    mean: float | None,
    draw_next: bool = False,
) -> list[Tensor]:
    """The whole update as formulas over the rows (g⁺, g⁻) or (g,) of each tensor, one loop
    per parameter under ``torch.compile``: the new momentum into ``accs``, the moved element
    into ``spares``, θ into ``params`` (the point estimate; with ``draw_next``, the next sample's
    readout of w' = g' ⊙ ξ', ξ' read from the accumulator of a one-sample step, w' kept in
    ``noise``), from the accumulators or a deferred ``sample`` (w, ∇ℓ̄_δ); returns each new
    momentum's sum (not finite if any entry is not)."""
    sums = []
    for i, (acc, m, g, spare, p) in enumerate(
        zip(accs, momenta, elements, spares, params, strict=True)
    ):
        news, moved = [], []
        for j in range(len(g)):
            x = (
                acc[j]
                if sample is None
                else sample[0][i][j] * (-sample[1][i] if j else sample[1][i])
            )
            c = offset if isinstance(offset, float) else offset[i][j]
            news.append(momentum(x, m[j], n=n, beta=beta, offset=c))
            moved.append(multiplicative_move(g[j], news[j], lr))
        if draw_next:  # ξ' read from the accumulator before the new momentum is written there
            w = [moved[j] * acc[j] for j in range(len(g))]
            p.copy_(multiplicative_readout(tuple(w), None))
            for j in range(len(g)):
                noise[i][j].copy_(w[j])
        else:
            p.copy_(multiplicative_readout(tuple(moved), mean))
        for j in range(len(g)):  # the writes after all reads: one loop under inductor
            acc[j].copy_(news[j])
            spare[j].copy_(moved[j])
        sums.append(news[0].sum() + news[1].sum() if len(news) == 2 else news[0].sum())
    return sums


def multiplicative(
    t: GroupTensors,
    sample: SampleGrads | None,
    *,
    draw_next: bool,
    n: int,
    beta: float,
    offset: float | list[Tensor],
    lr: float,
    signed: bool,
    compile: bool,
) -> Proposal:
    """The multiplicative rule's update of a param group from its accumulators (``n``
    samples) or its one deferred ``sample`` (w, ∇ℓ̄_δ): eager, in place, or as one compiled
    kernel per parameter into the spares (which also draws the next sample with ``draw_next``)."""
    if not compile:
        multiplicative_momentum_(
            t.accs, t.momenta, n=n, beta=beta, offset=offset, signed=signed, sample=sample
        )
        return Proposal(t.accs, commit=partial(_multiplicative_commit, t, lr=lr, signed=signed))
    deferred = None if sample is None else (t.rows(sample[0], signed), sample[1])
    sums = compiled(multiplicative_update)(
        *(t.rows(ts, signed) for ts in (t.accs, t.momenta, t.elements, t.spares)),  # type: ignore[arg-type]
        t.params,
        deferred,
        offset if isinstance(offset, float) else rows(offset, signed),  # new each step
        t.rows(t.noise, signed),
        n=n,
        beta=beta,
        lr=torch.tensor(lr, dtype=t.elements[0].dtype),  # a tensor: schedules do not recompile
        mean=t.mean,
        draw_next=draw_next,
    )
    return Proposal(t.accs, sums)
