"""What the parameters hold between steps — the point estimate, or (``between_steps="sample"``)
a fresh posterior sample — and the blocks that hold something else for a while."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .amp import inverse_scale
from .distributed import local
from .outside import mark_writes, take_writes
from .prior import PriorHolding
from .tensors import GroupTensors, Sample

if TYPE_CHECKING:
    from .tensors import Deferred

__all__ = ["SampleHolding"]


class SampleHolding(PriorHolding):
    """The part of :class:`~liegroup_blr.optim.BLROptimizer` that decides what the parameters
    hold: :meth:`~liegroup_blr.optim.BLROptimizer.sampled_params`,
    :meth:`~liegroup_blr.optim.BLROptimizer.point_estimate`, and the training sample that
    ``between_steps="sample"`` keeps in them between steps."""

    if TYPE_CHECKING:  # the sampling engine's, in BLROptimizer

        def _draw_sample(self, train: bool) -> Sample: ...
        def accumulate(self, sample: Sample, *, defer: bool = False) -> None: ...
        def _fresh_gradients(self) -> list[Tensor]: ...
        def _take_deferred(self, index: int) -> Deferred | None: ...
        def _accumulate(
            self,
            group: dict[str, Any],
            t: GroupTensors,
            noise: list[Tensor],
            grads: list[Tensor],
            first: bool,
        ) -> None: ...

    @property
    def pending_samples(self) -> int:
        """Samples accumulated since the last update."""
        return self._engine.samples

    @torch.no_grad()
    def discard(self) -> None:
        """Abandon the pending samples: nothing is accumulated, and the parameters hold the
        point estimates again (between_steps="sample": a fresh sample); gradients left by
        the abandoned samples are nobody's."""
        self._end_step()
        self._fresh_gradients()
        self._between_steps()
        mark_writes(self)

    def _between_steps(self) -> None:
        """Write what the parameters hold between steps: the point estimates, or
        (between_steps="sample") a fresh sample."""
        if self.between_steps == "sample":
            self._draw_resident()
        else:
            self._restore()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``GroupStateOptimizer.add_param_group``; with ``between_steps="sample"`` every
        trained parameter then holds a fresh sample (the new ones included)."""
        super().add_param_group(param_group)
        if self._engine.resident is not None:
            self._draw_resident()
        mark_writes(self)

    def _start_next_sample(self) -> None:
        """Open the next training sample before the update that draws it (a compiled update
        in sample mode), keeping the generators' state from before it."""
        self._engine.resident_rng = self.noise_source.state_dict()
        self.noise_source.end_step()
        self.noise_source.start_sample(True)

    def _next_noise(
        self, index: int, group: dict[str, Any], t: GroupTensors, current: list[Tensor]
    ) -> None:
        """Draw the next sample's ξ of param group ``index`` into the accumulators (the first
        entries of each: the base's shape), which a one-sample update reads nothing else
        from and writes the new momenta into after it read ξ; and make ``t.noise`` hold the
        step's sample's noise, which that update reads and overwrites."""
        outs = [a.view(-1)[: b.numel()].view(b.shape) for a, b in zip(t.accs, t.noise, strict=True)]
        xi = self.noise_source.sample(outs, group["base"], t.keys, index)
        if xi is not outs:  # windows of a noise table
            torch._foreach_copy_(outs, xi)
        if any(c is not n for c, n in zip(current, t.noise, strict=True)):
            torch._foreach_copy_(t.noise, current)  # the step's ξ was a table window

    def _hold_next_sample(
        self, drawn: dict[int, GroupTensors], started: bool, drawn_by_update: bool
    ) -> None:
        """After a step in sample mode: the sample the update drew is the parameters' (its
        noise in the noise buffers), or, when it did not (an eager step, a skipped one, a
        parameter without a sample), one is drawn now from the same generators' state."""
        if drawn_by_update:
            keys = [p for t in drawn.values() for p in t.keys]
            params = [p for t in drawn.values() for p in t.params]
            noise = [n for t in drawn.values() for n in t.noise]
            self._engine.resident = Sample(keys, params, noise)
            return
        if started:
            self.noise_source.load_state_dict(self._engine.resident_rng or {})
        self.noise_source.end_step()
        self._draw_resident()

    def _draw_resident(self) -> None:
        """Draw the sample the parameters hold until the next step, keeping the noise
        generators' state from before it, so a state dict redraws it bit for bit."""
        engine = self._engine
        engine.resident_rng = self.noise_source.state_dict()
        engine.resident = self._draw_sample(True)
        engine.tensors.clear()  # parameters may be frozen before the step

    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold one posterior sample θ = readout(g·ξ) in the parameters for the block.

        With ``train=True`` the gradients the block leaves in ``p.grad`` are one Monte-Carlo
        sample of the next :meth:`step` (call ``zero_grad`` inside each block; the optimizer
        reads them at the next draw or update, so they must not be changed in place before).
        On exit, also on error, the parameters return to what they held before the block:
        the point estimate, or with ``between_steps="sample"`` the training sample (and
        ``train=True`` is refused there: the parameters already hold a training sample).
        """
        engine = self._engine
        if engine.holding:
            raise RuntimeError(f"sampled_params() cannot be nested inside {engine.holding}()")
        if train and self.between_steps == "sample":
            raise RuntimeError(
                "sampled_params(train=True) with between_steps='sample': the parameters "
                "already hold a training sample; run forward and backward, then step()"
            )
        take_writes(self)
        engine.holding = "sampled_params"
        try:
            with self._holding_resident():
                sample = self._draw_sample(train)
                yield
                if train:
                    self.accumulate(sample, defer=True)
        finally:
            engine.holding = ""
            if not engine.samples:
                engine.tensors.clear()  # parameters may be frozen before the next step
            if self.between_steps == "point" or engine.resident is None:
                self._write_points()
            mark_writes(self)

    @contextmanager
    def point_estimate(self) -> Iterator[None]:
        """Hold the point estimate (``point_estimate="g"``: at ξ₀; ``"mean"``: at E[ξ]) in
        every parameter the optimizer has trained (frozen ones too) for the block, whatever
        they hold between steps; on exit they hold what they held before (with
        ``between_steps="sample"``, the training sample)."""
        engine = self._engine
        if engine.holding:
            raise RuntimeError(f"point_estimate() cannot be nested inside {engine.holding}()")
        take_writes(self)
        params = [
            local(p) for group in self.param_groups for p in group["params"] if p in self.state
        ]
        kept = [p.detach().clone() for p in params]
        engine.holding = "point_estimate"
        try:
            self._write_points(frozen=True)
            yield
        finally:
            engine.holding = ""
            with torch.no_grad():
                torch._foreach_copy_(params, kept)
            mark_writes(self)

    @contextmanager
    def _holding_resident(self) -> Iterator[None]:
        """Keep the parameters' training sample (between_steps="sample") through a block
        that writes the parameters and the noise buffers, and put it back on exit."""
        resident = self._engine.resident
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

    def _end_step(self) -> None:
        """Forget the step's samples: the next training sample starts a new step."""
        self._engine.end_step()
        self.noise_source.end_step()

    def _restore_unmoved(self, drawn: dict[int, GroupTensors], moved: list[GroupTensors]) -> None:
        """Write the point estimate into drawn parameters the step did not move."""
        done = {p for t in moved for p in t.params}
        for index, t in drawn.items():
            keep = [p not in done for p in t.params]
            if any(keep):
                rest = t.subset(keep)
                group = self.param_groups[index]
                self._write_point(group, rest.params, rest.elements, rest.mean)

    def _read_resident(self) -> None:
        """The parameters' sample (between_steps="sample") with ``p.grad`` as its gradient."""
        if self.mc_samples > 1:
            raise RuntimeError(
                f"step() without a closure takes one sample, the parameters' own, in "
                f"between_steps='sample'; mc_samples={self.mc_samples} needs step(closure)"
            )
        if self._engine.resident is None:
            raise RuntimeError(
                "step() without a closure after restore(): the parameters hold the point "
                "estimate, not a training sample; hold it with `with optimizer.point_estimate():` "
                "instead, or draw a sample again with optimizer.load_state_dict("
                "optimizer.state_dict())"
            )
        self.accumulate(self._engine.resident, defer=True)

    def _outside_allowed(self) -> bool:
        """Whether gradients made outside ``step(closure)`` since the last update are the
        step's own: those of the parameters' sample (``between_steps="sample"``, one sample),
        which the closure adds to or starts afresh."""
        at_point = self.between_steps == "point" or self._engine.resident is None  # restore()
        return not at_point and self.mc_samples == 1

    def _refuse_outside_gradients(self) -> None:
        """Gradients made outside ``step(closure)`` since the last update (at the point
        estimate, or, with several samples, only at the first) were added to by the closure."""
        at_point = self.between_steps == "point" or self._engine.resident is None
        where = "at the point estimate" if at_point else "at one sample"
        fix = (
            "construct the optimizer with between_steps='sample' and mc_samples=1"
            if self.between_steps == "point"
            else "set mc_samples=1"
            if not at_point
            else "hold the point estimate with `with optimizer.point_estimate():` instead of "
            "restore()"
        )
        self.discard()
        raise RuntimeError(
            f"step(closure) found gradients computed outside step() since the last update "
            f"({where}) and the closure added to them (gradient accumulation over "
            f"micro-batches, Lightning's accumulate_grad_batches): they would be mixed into "
            f"the samples; zero them in the closure, or {fix}"
        )

    def _accumulate_deferred(self) -> None:
        """Accumulate the deferred samples now."""
        for index, group in enumerate(self.param_groups):
            deferred = self._take_deferred(index)
            if deferred is not None:
                grads = deferred.gradients(inverse_scale(self), self._scratch)
                self._accumulate(group, deferred.tensors, deferred.noise, grads, deferred.first)
