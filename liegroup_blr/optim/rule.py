r"""A rule as the engine calls it: its formulas on a param group's tensors, buffers in, values
out.

A rule is an object, not an optimizer: :class:`~liegroup_blr.optim.BLROptimizer` composes
one (``AdditiveBLR(...)`` builds an :class:`~liegroup_blr.optim.additive.AdditiveRule`), and
the engine (:mod:`~liegroup_blr.optim.engine`) calls it as it calls a noise source. Per sample
the engine draws ξ and calls :meth:`Rule.draw` (θ = readout(g·ξ) into the parameters), then
:meth:`Rule.accumulate` (the sample's algebra gradient into the accumulators); per step
:meth:`Rule.propose`, which returns a :class:`~.tensors.Proposal` the engine checks and
commits. Every hook takes the param group's hyperparameters (``group``) and its tensors as
plain lists (:class:`~.tensors.GroupTensors`), never the optimizer.

A new rule subclasses :class:`Rule` and fills :meth:`~Rule.init_state`, :meth:`~Rule.draw`,
:meth:`~Rule.accumulate`, :meth:`~Rule.propose` and :meth:`~Rule.write_point`; a new group
with the generic rule needs none of this (:class:`~liegroup_blr.LieGroupBLR`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..groups import LieGroup
from ..noise import NoiseSource
from .tensors import GroupTensors, Proposal, SampleGrads

__all__ = ["Rule"]


class Rule:
    """The arithmetic of one rule on its Lie group.

    Attributes:
        lie_group: the group of every param group (or of those without their own ``"group"``,
            where :attr:`groups_per_param_group`).
        compile: whether :meth:`propose` runs the compiled update (set by :meth:`bind`).
        groups_per_param_group: whether a param group may set its own Lie group.
        draw_next_from_views: whether a compiled update that draws the next sample pays off also
            when the noise source serves views.
        entropy_as_number: whether :meth:`propose` takes the entropy's part of the algebra
            gradient as the one number −τ/N (the built-in groups' log|det J| has a unit
            gradient on the components that scale), else as a tensor per parameter.
    """

    groups_per_param_group = False
    draw_next_from_views = False
    entropy_as_number = True

    def __init__(self, lie_group: LieGroup) -> None:
        self.lie_group = lie_group
        self.compile = False
        self.noise: NoiseSource | None = None

    def bind(self, noise: NoiseSource, compile: bool) -> None:
        """Take the optimizer's noise source (its seed seeds the rule's own draws) and
        whether updates are compiled."""
        self.noise, self.compile = noise, compile

    @property
    def seed(self) -> int:
        """The seed of the optimizer's noise."""
        assert self.noise is not None, "Rule.bind() first"
        return self.noise.seed

    def group_of(self, group: dict[str, Any]) -> LieGroup:
        """The Lie group of a param group (its own ``"group"``, where the rule allows one)."""
        return group.get("group", self.lie_group)

    def describe(self, group: dict[str, Any]) -> str:
        """What a param group's state means beside the rule's name: its Lie group."""
        G = self.group_of(group)
        return f"{type(G).__name__}({G.extra_repr()})"

    def validate(self, options: dict[str, Any]) -> None:
        """Raise ValueError naming the first invalid hyperparameter of the rule's own."""

    def setup(self, group: dict[str, Any]) -> None:
        """Fill in what a new param group derives from its hyperparameters."""

    def upgrade(self, param_groups: list[dict[str, Any]]) -> None:
        """Fill in what param groups of older state dicts lack."""

    def check_prior(self, group: dict[str, Any], strength: float) -> None:
        """Raise ValueError, naming the fix, if a step of ``group`` cannot take the pull of a
        posterior prior of ``strength`` stably (none by default: a learned scale sets it)."""

    def init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """Initial ``{"element", "momentum"}`` of ``p`` (state dtype, p's device)."""
        raise NotImplementedError

    def draw(self, group: dict[str, Any], t: GroupTensors, xi: list[Tensor]) -> list[Tensor]:
        """``t.params ← readout(g·ξ)``; returns the sample's noise as :meth:`accumulate` reads
        it (:attr:`~liegroup_blr.optim.Sample.noise`). ``xi`` may be read-only views of a noise
        table."""
        raise NotImplementedError

    def accumulate(
        self,
        group: dict[str, Any],
        t: GroupTensors,
        noise: list[Tensor],
        grads: list[Tensor],
        first: bool,
    ) -> None:
        """Add one sample's algebra gradient to ``t.accs`` (``first``: overwrite them)."""
        raise NotImplementedError

    def propose(
        self,
        group: dict[str, Any],
        t: GroupTensors,
        n: int,
        sample: SampleGrads | None,
        offset: float | list[Tensor],
        draw_next: bool,
    ) -> Proposal | None:
        """The update from the accumulators (n samples) and the deferred ``sample`` (its
        noise and gradients: not yet in them, and then the only one, ``n = 1``), with the
        algebra gradient's part that is not the loss's, ``offset``; ``None`` rejects the
        step. With ``draw_next`` (a compiled one-sample step in sample mode; the next sample's ξ'
        is in the accumulators) the update writes the next sample θ = readout(g'·ξ') into
        the parameters and its noise into ``t.noise`` instead of the point estimate."""
        raise NotImplementedError

    def write_point(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        elements: list[Tensor],
        mean: float | None,
    ) -> None:
        """``params ← point estimate`` of their ``elements`` (read at E[ξ] = ``mean`` when it
        is not ``None``), as the group's :meth:`~liegroup_blr.groups.LieGroup.point`."""
        raise NotImplementedError

    def sample_value(self, group: dict[str, Any], element: Tensor, noise: Tensor) -> Tensor:
        """θ of a sample with ``noise`` (its :attr:`~liegroup_blr.optim.Sample.noise`), as
        :meth:`draw` made it."""
        return self.group_of(group).theta(element, noise)

    def with_point(self, group: dict[str, Any], g: Tensor, theta: Tensor, xi0: Tensor) -> Tensor:
        """The element with point estimate ``theta`` read at ``xi0``, from ``g``
        (:meth:`~liegroup_blr.groups.LieGroup.with_point`; ``NotImplementedError`` for a group
        without it)."""
        return self.group_of(group).with_point(g, theta, xi0)
