"""What the parameters hold between steps, chosen once at construction: the point estimate
(:class:`PointHolding`, ``between_steps="point"``) or a fresh posterior sample
(:class:`SampleHolding`, ``between_steps="sample"``).

The engine asks its holding what to write between steps, what a closure-free ``step()``
reads, whether gradients found before a closure are the step's own, and, in sample mode, keeps
the resident sample with it: the training sample the parameters hold, and the generators'
state from before its draw, so a state dict draws it again bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..noise import NoiseSource
from .tensors import GroupTensors, Sample

__all__ = ["Draws", "Holding", "PointHolding", "SampleHolding", "holding"]


@dataclass
class Draws:
    """What a holding uses of the engine: the noise source and three of its operations, bound
    by the engine (:class:`~liegroup_blr.optim.engine.Engine`) that composes the holding."""

    noise: NoiseSource
    draw: Callable[[], Sample]
    """A training sample into every trained parameter (the gathered tensors then forgotten:
    parameters may be frozen before the step)."""
    write_points: Callable[[], None]
    """The point estimates into the trained parameters."""
    restore_unmoved: Callable[[dict[int, GroupTensors], list[GroupTensors]], None]
    """The point estimates into the drawn parameters a step did not move."""


class Holding(Protocol):
    """The protocol of :class:`PointHolding` and :class:`SampleHolding`."""

    holds_samples: bool
    resident: Sample | None
    rng: dict[str, Any] | None

    def between_steps(self) -> None: ...
    def open_draw_next(self, fusable: bool) -> bool: ...
    def after_update(
        self, drawn: dict[int, GroupTensors], moved: list[GroupTensors] | None, drew_next: bool
    ) -> None: ...
    def read(self, mc_samples: int) -> Sample: ...
    def owns_outside_gradients(self, mc_samples: int) -> bool: ...
    def outside_gradients(self, verdict: str) -> str: ...
    def check_training_block(self) -> None: ...
    def keeping(self) -> Any: ...
    def forget(self) -> None: ...


class PointHolding:
    """Between steps the parameters hold the point estimate; ``step()`` without a closure
    takes the samples of ``sampled_params(train=True)`` blocks."""

    holds_samples = False
    """Whether the parameters hold a training sample between steps."""
    resident: Sample | None = None
    rng: dict[str, Any] | None = None

    def __init__(self, draws: Draws) -> None:
        self.draws = draws

    def between_steps(self) -> None:
        """Write the point estimates."""
        self.draws.write_points()

    def open_draw_next(self, fusable: bool) -> bool:
        """An update never draws the next sample: the parameters hold the point estimate."""
        return False

    def after_update(
        self, drawn: dict[int, GroupTensors], moved: list[GroupTensors] | None, drew_next: bool
    ) -> None:
        """After a step: the point estimate into every drawn parameter the step did not move
        (``moved``: the tensors it moved, ``None`` when it moved every drawn one)."""
        self.draws.noise.end_step()
        if moved is not None:
            self.draws.restore_unmoved(drawn, moved)

    def read(self, mc_samples: int) -> Sample:
        """A closure-free ``step()`` without samples: refused."""
        raise RuntimeError(
            "step() without a closure needs gradients from at least one "
            "`with optimizer.sampled_params(train=True):` block; to step on p.grad as "
            "torch.optim does (Hugging Face Trainer, accelerate, gradient accumulation), "
            "construct the optimizer with between_steps='sample'"
        )

    def owns_outside_gradients(self, mc_samples: int) -> bool:
        """Gradients made outside a step are the point estimate's: nobody's sample."""
        return False

    def outside_gradients(self, verdict: str) -> str:
        """The refusal of gradients made outside ``step(closure)``, at the point estimate."""
        fix = "construct the optimizer with between_steps='sample' and mc_samples=1"
        return refusal(verdict, "at the point estimate", fix)

    def check_training_block(self) -> None:
        """``sampled_params(train=True)`` draws the step's samples."""

    @contextmanager
    def keeping(self) -> Iterator[None]:
        """Nothing to keep through a block that writes the parameters."""
        yield

    def forget(self) -> None:
        """Nothing held."""


class SampleHolding:
    """Between steps the parameters hold a fresh posterior sample (the resident sample), so
    any loop's forward and backward run at a sample, and ``step()`` without a closure takes
    ``p.grad`` as that sample's gradient.

    Attributes:
        resident: the training sample the parameters hold (``None`` after
            :meth:`~liegroup_blr.optim.BLROptimizer.restore`).
        rng: the noise generators' state from before the resident sample's draw.
        draw_next: whether the running update draws the next sample (``open_draw_next``).
    """

    holds_samples = True

    def __init__(self, draws: Draws) -> None:
        self.draws = draws
        self.resident: Sample | None = None
        self.rng: dict[str, Any] | None = None
        self.draw_next = False

    def between_steps(self) -> None:
        """Draw the sample the parameters hold until the next step, keeping the noise
        generators' state from before it, so a state dict redraws it bit for bit."""
        self.rng = self.draws.noise.state_dict()
        self.resident = self.draws.draw()

    def open_draw_next(self, fusable: bool) -> bool:
        """Whether a compiled one-sample update draws the next sample itself (``fusable``:
        where that saves passes over the state); if so, open its draw now, keeping the
        generators' state from before it."""
        if fusable:
            noise = self.draws.noise
            self.rng = noise.state_dict()
            noise.end_step()
            noise.start_sample(True)
        self.draw_next = fusable
        return fusable

    def after_update(
        self, drawn: dict[int, GroupTensors], moved: list[GroupTensors] | None, drew_next: bool
    ) -> None:
        """After a step the next training sample is held: the one the update drew
        (``drew_next``; its noise in the noise buffers), or one drawn now from the generators'
        state before the update's (an eager step, a skipped one, a parameter without a
        sample)."""
        opened, self.draw_next = self.draw_next, False
        if drew_next:
            keys = [p for t in drawn.values() for p in t.keys]
            params = [p for t in drawn.values() for p in t.params]
            noise = [n for t in drawn.values() for n in t.noise]
            self.resident = Sample(keys, params, noise)
            return
        if opened:
            self.draws.noise.load_state_dict(self.rng or {})
        self.draws.noise.end_step()
        self.between_steps()

    def read(self, mc_samples: int) -> Sample:
        """A closure-free ``step()``: the resident sample, whose gradient is ``p.grad``."""
        if mc_samples > 1:
            raise RuntimeError(
                f"step() without a closure takes one sample, the parameters' own, in "
                f"between_steps='sample'; mc_samples={mc_samples} needs step(closure)"
            )
        if self.resident is None:
            raise RuntimeError(
                "step() without a closure after restore(): the parameters hold the point "
                "estimate, not a training sample; hold it with `with optimizer.point_estimate():` "
                "instead, or draw a sample again with optimizer.load_state_dict("
                "optimizer.state_dict())"
            )
        return self.resident

    def owns_outside_gradients(self, mc_samples: int) -> bool:
        """Gradients made outside a step are the resident sample's, which the closure adds to
        or starts afresh: with one sample per step, and a sample held."""
        return self.resident is not None and mc_samples == 1

    def outside_gradients(self, verdict: str) -> str:
        """The refusal of gradients made outside ``step(closure)``: at the resident sample
        (with several samples per step), or at the point estimate after ``restore()``."""
        if self.resident is not None:
            return refusal(verdict, "at one sample", "set mc_samples=1")
        fix = "hold the point estimate with `with optimizer.point_estimate():` instead of restore()"
        return refusal(verdict, "at the point estimate", fix)

    def check_training_block(self) -> None:
        """``sampled_params(train=True)`` is refused: the parameters hold a training sample."""
        raise RuntimeError(
            "sampled_params(train=True) with between_steps='sample': the parameters "
            "already hold a training sample; run forward and backward, then step()"
        )

    @contextmanager
    def keeping(self) -> Iterator[None]:
        """Keep the resident sample through a block that writes the parameters and the noise
        buffers, and put it back on exit."""
        resident = self.resident
        if resident is None:
            yield
            return
        kept = [t.clone() for t in resident.theta], [n.clone() for n in resident.noise]
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(resident.theta, kept[0])
                torch._foreach_copy_(resident.noise, kept[1])

    def forget(self) -> None:
        """The parameters hold no training sample (:meth:`~liegroup_blr.optim.BLROptimizer.
        restore` wrote the point estimate)."""
        self.resident = None


def refusal(verdict: str, where: str, fix: str) -> str:
    """Gradients made outside ``step(closure)`` since the last update (``where``) were added
    to by the closure (``verdict`` ``"added to"``) or left in place by a closure that computed
    none (``"left"``)."""
    if verdict == "left":
        return (
            f"step(closure) found gradients computed outside step() since the last update "
            f"({where}), and the closure computed none (no backward pass reached them): "
            f"they are not a sample's; pass a closure that zeroes the gradients and "
            f"computes the loss and its backward, or {fix}"
        )
    return (
        f"step(closure) found gradients computed outside step() since the last update "
        f"({where}) and the closure added to them (gradient accumulation over "
        f"micro-batches, Lightning's accumulate_grad_batches): they would be mixed into "
        f"the samples; zero them in the closure, or {fix}"
    )


HOLDINGS: dict[str, type[PointHolding] | type[SampleHolding]] = {
    "point": PointHolding,
    "sample": SampleHolding,
}
"""What the parameters hold between steps, by ``between_steps``."""


def holding(between_steps: str, draws: Draws) -> PointHolding | SampleHolding:
    """The holding ``between_steps`` (one of :data:`HOLDINGS`) names, on the engine's
    ``draws``."""
    return HOLDINGS[between_steps](draws)
