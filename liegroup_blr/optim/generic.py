r"""The Lie-group Bayesian learning rule for any group, by automatic differentiation.

.. math::
    \hat X = \frac1S \sum_s \nabla_X \bar\ell_\delta(\theta_s(X))\big|_{X=0}
             - \frac{\tau}{N} \nabla_X \log|\det J_{g \exp X}|\big|_{X=0}, \qquad
    M \leftarrow \beta M + (1-\beta) P(\hat X), \qquad g \leftarrow g \exp(-\alpha M),

with :math:`\theta_s(X) = \operatorname{readout}((g \exp X) \cdot \xi_s)`; the algebra
gradient is a ``torch.func.vjp`` through the group's ``exp``, ``compose`` and ``act``, the
entropy gradient a ``torch.func.grad`` of ``log_abs_det``. P is the preconditioner.

Read top to bottom: the optimizer class (hyperparameters), the rule class (initial state, the
preconditioners it caches, the calls the engine makes), the kernels written with the group's
operations, and :func:`generic`, the update, eager or compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution
from typing_extensions import Unpack

from ..fisher import algebra_gradient, inverse_metric
from ..groups import LieGroup
from .base import BLROptimizer
from .checks import check_momentum, former_positional, required
from .kernel_utils import compiled
from .options import EngineOptions
from .rule import Rule
from .scratch import state_dtype
from .tensors import GroupTensors, Proposal, SampleGrads

__all__ = [
    "GenericRule",
    "LieGroupBLR",
    "Preconditioner",
    "generic",
    "generic_accumulate",
    "generic_draw",
    "generic_update",
]

Preconditioner = (
    str | Sequence[float] | Mapping[str, float] | Tensor | Callable[[Tensor], Tensor] | None
)
"""``None``, ``"fisher"``, per-component factors (a sequence, or a mapping from the group's
component names), or a callable ``X -> P(X)``."""


class LieGroupBLR(BLROptimizer):
    r"""The Lie-group Bayesian learning rule for any :class:`~liegroup_blr.groups.LieGroup`.

    Each parameter θ is the readout of :math:`g \cdot \xi`, :math:`\xi \sim q_0` (``base``),
    with its own group element :math:`g`. One step lowers the variational objective
    :math:`E_q[\bar\ell(\theta)] + \frac{\delta}{N} E_q[\tfrac12\|\theta\|^2]
    - \frac{\tau}{N} H(q)`:

    .. math::
        \hat X &= \frac1S \sum_{s=1}^S \nabla_X\, \bar\ell_\delta(\theta_s(X))\big|_{X=0}
                 - \frac{\tau}{N} \nabla_X \log|\det J_{g \exp X}|\big|_{X=0},
        \quad \bar\ell_\delta = \bar\ell + \tfrac{\delta}{2N}\|\theta\|^2, \\
        M &\leftarrow \beta M + (1-\beta)\, P(\hat X), \qquad
        g \leftarrow g \cdot \exp(-\alpha M),

    with :math:`S` = ``mc_samples`` draws :math:`\theta_s(X) = \operatorname{readout}((g
    \exp X) \cdot \xi_s)`; the algebra gradients come from ``torch.func.vjp`` through the
    group's ``exp``, ``compose``, ``act`` (reparameterisation), the entropy gradient from
    ``torch.func.grad`` of ``log_abs_det``. :math:`P` is the preconditioner: identity (the
    built-in rules fold the constant Fisher metric into α), per-component step factors, the
    inverse Fisher metric at the identity, or any callable. A proposed element that is not
    finite or fails ``group.check_element`` skips the step like a non-finite gradient.

    Outside :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params` every parameter holds the
    point estimate ``readout(g · ξ₀)`` (ξ₀ = ``group.reference_point``, or E[ξ] with
    ``point_at="mean"``).

    ``lgb.LieGroupBLR(params, group, base, lr, momentum, *, data_size, ...)``: the arguments
    from ``data_size`` on are keyword-only. Passed by position (0.1.0 took ``data_size``,
    ``temperature``, ``prior_precision``, ``mc_samples`` there), they are taken in that order
    with a FutureWarning naming the keyword fix, for one release.

    Args:
        params: parameters or param groups. Each param group may set its own ``lr``,
            ``momentum``, ``base``, ``data_size``, ``temperature``, ``prior_precision`` and
            ``group`` (a LieGroup: different groups for different layers, one optimizer).
        group: the Lie group (of every param group that sets none).
        base: scalar base distribution q0, drawn i.i.d. per coordinate of the base space.
        lr: step size α > 0.
        momentum: β ∈ [0, 1), EMA of the algebra gradient.
        data_size: N > 0, the number of training examples; keyword-only, required when
            ``prior_precision`` > 0 or the entropy term is used (τ > 0 and an entropy that
            depends on g).
        temperature: τ ≥ 0.
        prior_precision: δ ≥ 0 of the Gaussian prior N(0, I/δ).
        mc_samples: S ≥ 1 samples per :meth:`~liegroup_blr.optim.BLROptimizer.step` with a closure.
        weight_decay: w ≥ 0, L2 as ``torch.optim.SGD``'s: adds w·θ to each sample's gradient
            (the prior N(0, 1/(wN)), δ = wN); the default of the param-group key.
        preconditioner: ``None``; per-component step factors, a sequence (one per leading
            algebra component, or one for all) or a mapping ``{component name: factor}``
            over ``group.components``; ``"fisher"`` (the inverse Fisher metric at the
            identity, :func:`liegroup_blr.fisher.inverse_metric`); or a callable
            ``X -> P(X)``.
        init: callable ``θ -> g`` giving each parameter's initial element
            (default ``group.from_point``); it must return a valid element.
        point_at: ``"g"`` or ``"mean"`` (see above).

        **engine: the engine's keyword-only options, :class:`~liegroup_blr.optim.EngineOptions`.

    Raises:
        ValueError: naming the argument, for any invalid hyperparameter.
    """

    _rule: GenericRule

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        group: LieGroup,
        base: Distribution,
        lr: float | None = None,
        momentum: float = 0.9,
        *deprecated: Any,
        data_size: float | None = None,
        temperature: float = 1.0,
        prior_precision: float = 0.0,
        mc_samples: int = 1,
        weight_decay: float = 0.0,
        preconditioner: Preconditioner = None,
        init: Callable[[Tensor], Tensor] | None = None,
        point_at: str = "g",
        **engine: Unpack[EngineOptions],
    ) -> None:
        required("LieGroupBLR", lr=(lr, "the step size α of g ← g·exp(−αM)"))
        data_size, temperature, prior_precision, mc_samples = former_positional(
            "LieGroupBLR", deprecated, data_size, temperature, prior_precision, mc_samples
        )
        check_momentum("LieGroupBLR", momentum)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            base=base,
            data_size=data_size,
            temperature=temperature,
            prior_precision=prior_precision,
            weight_decay=weight_decay,
        )
        if not isinstance(group, LieGroup):
            raise ValueError(f"group: expected a liegroup_blr.groups.LieGroup, got {group!r}")
        rule = GenericRule(group, preconditioner, init)
        super().__init__(params, defaults, rule, mc_samples=mc_samples, point_at=point_at, **engine)

    @property
    def preconditioner(self) -> Preconditioner:
        """P: ``None``, ``"fisher"``, per-component factors or a callable."""
        return self._rule.preconditioner

    @property
    def init(self) -> Callable[[Tensor], Tensor] | None:
        """The parameter's initial element from its value, if not ``group.from_point``."""
        return self._rule.init


class GenericRule(Rule):
    """The generic rule as the engine calls it (:class:`~.rule.Rule`): any Lie group, a Lie
    group per param group, preconditioner P.

    Args:
        group: the default Lie group.
        preconditioner: see :class:`LieGroupBLR`.
        init: see :class:`LieGroupBLR`.
    """

    groups_per_param_group = True
    entropy_as_number = False  # any group: −(τ/N)∇log|det J| per tensor

    def __init__(
        self,
        group: LieGroup,
        preconditioner: Preconditioner = None,
        init: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__(group)
        self.preconditioner = preconditioner
        self.init = init
        self._metrics: dict[tuple[Any, ...], Any] = {}  # preconditioners

    def validate(self, options: dict[str, Any]) -> None:
        check_preconditioner(self.preconditioner, self.group_of(options))

    def describe(self, group: dict[str, Any]) -> str:
        spec = self.preconditioner
        kind = getattr(spec, "__qualname__", None) if callable(spec) else spec
        return f"{super().describe(group)}, preconditioner={kind!r}"

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        G = self.group_of(group)
        theta = p.detach().to(state_dtype(p))
        element = (self.init(theta) if self.init else G.from_point(theta)).to(theta).clone()
        if element.shape != G.element_shape(p.shape):
            raise ValueError(f"init: element shape {tuple(element.shape)} does not fit {p.shape}")
        ok, reason = G.check_element(element)
        if not ok:
            raise ValueError(f"init: returned an invalid element: {reason}")
        return {"element": element, "momentum": theta.new_zeros(G.algebra_shape(p.shape))}

    def draw(self, group: dict[str, Any], t: GroupTensors, xi: list[Tensor]) -> list[Tensor]:
        generic_draw(self.group_of(group), t.elements, xi, t.params)
        return xi

    def accumulate(self, group, t, noise, grads, first) -> None:
        generic_accumulate(self.group_of(group), t.accs, t.elements, noise, grads, first=first)

    def propose(self, group, t, n, sample, offset, draw_next) -> Proposal | None:
        G = self.group_of(group)
        offsets = offset if isinstance(offset, list) else [offset] * len(t.params)
        return generic(
            G,
            t,
            sample,
            offsets,
            [self._precondition(group, p) for p in t.params],
            n=n,
            beta=group["momentum"],
            lr=group["lr"],
            mean=t.mean,
            compile=self.compile,
        )

    def write_point(self, group, params, elements, mean) -> None:
        generic_readout_(self.group_of(group), params, elements, mean)

    def _precondition(self, group: dict[str, Any], p: Tensor) -> Callable[[Tensor], Tensor]:
        """P for parameter ``p`` of ``group`` (made once per group, base and shape)."""
        spec, G = self.preconditioner, self.group_of(group)
        if spec is None:
            return _identity
        if callable(spec):
            return spec
        key = (id(group), p.shape, p.dtype, p.device)
        made = self._metrics.get(key)
        if made is None or made[0] is not group:
            if isinstance(spec, str):  # "fisher", from its own draws: a copy or resume agrees
                generator = torch.Generator().manual_seed(self.seed)
                made = group, inverse_metric(G, group["base"], p.shape, generator=generator)
            else:
                made = group, partial(_scale_components, factors=component_factors(spec, G))
            self._metrics[key] = made
        return made[1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_metrics": {}}  # rebuilt from the seed on use


def _identity(X: Tensor) -> Tensor:
    return X


def component_factors(spec: Sequence[float] | Mapping[str, float] | Tensor, G: LieGroup) -> Tensor:
    """Per-component step factors as a 1-d tensor (by name through ``G.components``)."""
    if isinstance(spec, Mapping):
        unknown = set(spec) - set(G.components)
        if unknown or not G.components:
            raise ValueError(
                f"preconditioner: unknown components {sorted(unknown or spec)}; "
                f"{type(G).__name__} has {list(G.components)}"
            )
        spec = [float(spec.get(name, 1.0)) for name in G.components]
    factors = torch.as_tensor(spec, dtype=torch.float64)
    if factors.ndim != 1 or not bool((factors > 0).all()):
        raise ValueError("preconditioner: per-component factors must be a 1-d positive list")
    return factors


def _scale_components(X: Tensor, factors: Tensor) -> Tensor:
    if len(factors) == 1:
        return X * float(factors[0])
    if X.shape[0] != len(factors):
        raise ValueError(
            f"preconditioner: {len(factors)} factors for {X.shape[0]} algebra components"
        )
    return X * factors.to(X).view(-1, *([1] * (X.ndim - 1)))


def check_preconditioner(spec: Preconditioner, G: LieGroup) -> None:
    """ValueError naming ``preconditioner`` for a spec that cannot work with ``G``."""
    if spec is None or callable(spec):
        return
    if isinstance(spec, str):
        if spec != "fisher":
            raise ValueError(f"preconditioner: unknown {spec!r}; use None, 'fisher', ...")
        return
    component_factors(spec, G)


# ------------------------------------------------------------------ the kernels
def generic_draw(
    G: LieGroup, elements: list[Tensor], xi: list[Tensor], params: list[Tensor]
) -> None:
    """θ = readout(g·ξ)."""
    for g, x, p in zip(elements, xi, params, strict=True):
        p.copy_(G.theta(g, x))


def generic_accumulate(
    G: LieGroup,
    accs: list[Tensor],
    elements: list[Tensor],
    noise: list[Tensor],
    grads: list[Tensor],
    *,
    first: bool,
) -> None:
    """acc (+)= ∇_X ℓ̄_δ(readout((g exp X)·ξ))|_{X=0} (a vector-Jacobian product)."""
    for acc, g, xi, grad in zip(accs, elements, noise, grads, strict=True):
        X = algebra_gradient(G, g, xi, grad)
        if first:
            acc.copy_(X)
        else:
            acc.add_(X)


def generic_readout_(
    G: LieGroup, params: list[Tensor], elements: list[Tensor], mean: float | None
) -> None:
    """θ ← the group's point estimate of each element (:meth:`~liegroup_blr.groups.LieGroup.
    point`: at the reference point, or at E[ξ] = ``mean``)."""
    for p, g in zip(params, elements, strict=True):
        p.copy_(G.point(g, mean, p.shape))


def generic_update(
    G: LieGroup,
    accs: list[Tensor],
    momenta: list[Tensor],
    elements: list[Tensor],
    sample: SampleGrads | None,
    offsets: list[Tensor | float],
    preconditioners: list[Callable[[Tensor], Tensor]],
    *,
    n: int,
    beta: float,
    lr: float | Tensor,
) -> list[Tensor]:
    """acc ← β M + (1 − β) P(acc/n + c), with acc the algebra gradient of a deferred ``sample``
    (ξ, ∇ℓ̄_δ) when there is one and c per tensor the entropy's −(τ/N)∇H or a prior's
    (τ/N)∇KL; returns the proposed g·exp(−α acc)."""
    if sample is not None:
        generic_accumulate(G, accs, elements, *sample, first=True)
    proposals = []
    for acc, m, g, c, precondition in zip(
        accs, momenta, elements, offsets, preconditioners, strict=True
    ):
        acc.copy_(torch.lerp(precondition(acc / n + c), m, beta))
        proposals.append(G.step(g, acc * -lr))
    return proposals


def _generic_commit(G: LieGroup, t: GroupTensors, moved: list[Tensor]) -> None:
    torch._foreach_copy_(t.elements, moved)
    generic_readout_(G, t.params, t.elements, t.mean)


def generic(
    G: LieGroup,
    t: GroupTensors,
    sample: SampleGrads | None,
    offsets: list[Tensor | float],
    preconditioners: list[Callable[[Tensor], Tensor]],
    *,
    n: int,
    beta: float,
    lr: float,
    mean: float | None,
    compile: bool,
) -> Proposal | None:
    """The generic rule's update of a param group (:func:`generic_update`, compiled under
    ``compile``); ``None`` rejects the step when a proposed element is not a valid one of
    ``G`` (``check_element``); the point estimates are read at E[ξ] = ``mean`` if given."""
    rate: float | Tensor = lr
    kernel = generic_update
    if compile:
        kernel = compiled(generic_update)
        rate = torch.tensor(lr, dtype=t.elements[0].dtype)  # schedules do not recompile
    moved = kernel(
        G, t.accs, t.momenta, t.elements, sample, offsets, preconditioners, n=n, beta=beta, lr=rate
    )
    if not all(G.check_element(g)[0] for g in moved):
        return None
    return Proposal(t.accs + moved, commit=partial(_generic_commit, G, t, moved))
