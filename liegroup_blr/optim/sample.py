"""A posterior sample as the sample protocol hands it out, and a deferred one."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Deferred", "Sample"]


@dataclass
class Deferred:
    """A sample of one param group whose accumulation waits for the next draw, accumulate or
    proposal (:meth:`~liegroup_blr.optim.BLROptimizer.accumulate` with ``defer=True``)."""

    params: list[Tensor]
    noise: list[Tensor]
    grads: list[Tensor]
    versions: list[int]  # of the gradients: changed in place before they are read, an error

    def check(self) -> None:
        """Raise ``RuntimeError`` if a gradient was changed in place since it was deferred."""
        if any(g._version != v for g, v in zip(self.grads, self.versions, strict=True)):
            raise RuntimeError(
                "accumulate(..., defer=True): a gradient was changed in place before the "
                "optimizer read it; the pending samples are discarded (change gradients "
                "before accumulating them, or accumulate without defer)"
            )


@dataclass
class Sample:
    """One posterior sample, as :meth:`~liegroup_blr.optim.BLROptimizer.draw` made it.

    Attributes:
        params: the sampled parameters (every trained parameter of every param group).
        theta: their sampled values θ = readout(g·ξ) (after ``draw``, the parameters themselves).
        noise: per parameter, what the rule keeps of the draw to accumulate it (ξ, or a
            product such as g·ξ).
    """

    params: list[Tensor]
    theta: list[Tensor]
    noise: list[Tensor]

    def clone(self) -> Sample:
        """Copies of ``theta`` and ``noise``, to accumulate after further draws."""
        return Sample(
            self.params, [t.detach().clone() for t in self.theta], [n.clone() for n in self.noise]
        )
