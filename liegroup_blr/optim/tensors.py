"""What the engine and the rules hand each other: a param group's tensors, a posterior sample,
a deferred sample, and a proposed update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from .kernel_utils import Rows
from .scratch import Scratch

__all__ = ["Deferred", "GroupTensors", "Proposal", "Sample", "SampleGrads", "Work"]

SampleGrads = tuple[list[Tensor], list[Tensor]]
"""A deferred sample as an update reads it: its noise (as :attr:`Sample.noise`) and its
gradients ∇ℓ̄_δ, one tensor per parameter."""


@dataclass
class GroupTensors:
    """A param group's tensors for one step, gathered once by the engine and handed to its
    rule as plain lists, index i for parameter i.

    Attributes:
        keys: the trained parameters (the optimizer's keys: their states, their gradients).
        params: what the rule writes, the parameters themselves or, for sharded (DTensor)
            ones, their local shards.
        elements: their group elements (state ``"element"``).
        momenta: their momenta (state ``"momentum"``).
        accs: accumulators of the algebra's shape; the proposal writes the new momenta
            into them, and once a step is taken they swap places with ``momenta``.
        noise: buffers of the base's shape that fresh noise is drawn into; the rule may
            keep what it derives from a draw there (its :attr:`Sample.noise`).
        spares: buffers of the elements' shape a compiled update moves the elements into
            (they then swap places with ``elements``); ``None`` for eager updates.
        rows: each tensor of a list as its rows (:data:`~.kernel_utils.Rows`), the views
            kept between steps, as compiled kernels take them.
        mean: E[ξ] where the point estimate is read at the base's mean
            (``point_at="mean"``), else ``None``.
    """

    keys: list[Tensor]
    params: list[Tensor]
    elements: list[Tensor]
    momenta: list[Tensor]
    accs: list[Tensor]
    noise: list[Tensor]
    spares: list[Tensor] | None
    rows: Callable[[list[Tensor], bool], list[Rows]]
    mean: float | None

    def holds(self, other: GroupTensors) -> bool:
        """Whether ``other`` holds the same parameters."""
        return self is other or [id(p) for p in self.params] == [id(p) for p in other.params]

    def subset(self, keep: list[bool]) -> GroupTensors:
        """The tensors of the parameters where ``keep`` is true."""

        def pick(ts: list[Tensor]) -> list[Tensor]:
            return [t for t, k in zip(ts, keep, strict=True) if k]

        return replace(
            self,
            keys=pick(self.keys),
            params=pick(self.params),
            elements=pick(self.elements),
            momenta=pick(self.momenta),
            accs=pick(self.accs),
            noise=pick(self.noise),
            spares=None if self.spares is None else pick(self.spares),
        )


Work = tuple[int, dict[str, Any], GroupTensors]
"""A param group with samples in an update: its index, its hyperparameters, its tensors."""


@dataclass
class Sample:
    """One posterior sample, as :meth:`~liegroup_blr.optim.BLROptimizer.draw` made it.

    Attributes:
        params: the sampled parameters (every trained parameter of every param group).
        theta: their sampled values θ = readout(g·ξ) (after ``draw``, the parameters themselves,
            or their local shards).
        noise: per parameter, the draw as the rule accumulates it: ξ (additive, affine and
            generic rules) or the products w = g ⊙ ξ (multiplicative rule). Valid until the
            next draw, unless cloned.
    """

    params: list[Tensor]
    theta: list[Tensor]
    noise: list[Tensor]

    def clone(self) -> Sample:
        """Copies of ``theta`` and ``noise``, to accumulate after further draws."""
        return Sample(
            self.params, [t.detach().clone() for t in self.theta], [n.clone() for n in self.noise]
        )


@dataclass
class Deferred:
    """A sample of one param group whose gradients are read later: at the next draw,
    accumulate or update (:meth:`~liegroup_blr.optim.BLROptimizer.accumulate` with
    ``defer=True``), when the loss scale of a ``GradScaler.step`` is known.

    Attributes:
        tensors: the param group's tensors (of the parameters the sample has gradients for).
        noise: the sample's noise (:attr:`Sample.noise`).
        raw: the gradients as the backward pass left them (references).
        decay: (δ/N)θ of the prior, from the sample's θ (``None`` when δ = 0).
        first: whether the parameters had no sample of the step before this one.
        versions: the gradients' version counters when deferred: an in-place change before
            they are read is an error.
    """

    tensors: GroupTensors
    noise: list[Tensor]
    raw: list[Tensor]
    decay: list[Tensor] | None
    first: bool
    versions: list[int] = field(default_factory=list)

    def gradients(self, inv_scale: float, scratch: Scratch) -> list[Tensor]:
        r""":math:`\nabla\bar\ell_\delta = s^{-1}\nabla\bar\ell + \frac{\delta}{N}\theta`, with
        ``inv_scale`` = 1/s of a GradScaler's loss scale: in the decay buffers or the
        ``scratch`` buffers ``"grad"``, the raw gradients read, never written (themselves
        when there is nothing to add)."""
        if self.decay is not None:
            torch._foreach_add_(self.decay, self.raw, alpha=inv_scale)
            return self.decay
        if inv_scale == 1.0:
            return self.raw
        (out,) = scratch.take(self.tensors.params, grad=torch.Size)
        torch._foreach_copy_(out, self.raw)
        torch._foreach_mul_(out, inv_scale)
        return out


@dataclass
class Proposal:
    """A rule's proposed update of one param group, checked by the engine before it is taken.

    Attributes:
        checked: what must be finite for the step to go on: the new momenta (in the
            accumulators), and new elements a rule made out of place.
        sums: their sums, when the proposing kernel made them in its pass (else the engine
            sums them).
        commit: moves the elements and writes the parameters, once the proposal is taken
            (after the new momenta have taken the old ones' place); ``None``: the proposal
            already moved the elements into the spares and wrote the parameters, and the
            engine swaps the spares in.
    """

    checked: list[Tensor]
    sums: list[Tensor] | None = None
    commit: Callable[[], None] | None = None
