"""The engine's options, declared and documented once, and the engine's mutable state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor

from .._userline import warn

if TYPE_CHECKING:
    from ..noise import NoiseSource
    from ..posterior import Posterior
    from .prior import Prior
    from .tensors import Deferred, GroupTensors

__all__ = ["EngineOptions", "EngineState"]


class EngineOptions(TypedDict, total=False):
    """Keyword-only options every optimizer takes (``**engine``), for the sampling engine
    (:class:`~liegroup_blr.optim.BLROptimizer`) rather than the rule.

    Attributes:
        seed: seed of the optimizer's own noise (drawn from torch's global RNG when ``None``,
            so ``torch.manual_seed`` makes runs reproducible). Once ``torch.distributed`` is
            initialised and no ``process_group`` is given (DDP), construction is a collective:
            rank 0's seed and elements are shared, every rank draws the same noise, and an
            explicit seed that differs between ranks is refused.
        noise: ``"fresh"`` draws (default), ``"table"``
            (:class:`~liegroup_blr.noise.TableNoise`: windows of pre-drawn noise), or a
            :class:`~liegroup_blr.noise.NoiseSource` (one of the library's or your own).
        antithetic: pair consecutive training samples ξ, 2c − ξ (bases symmetric about c):
            :class:`~liegroup_blr.noise.Antithetic` around the source.
        table_size: values in each noise table (``noise="table"``).
        compile: run each update through ``torch.compile`` (one fused kernel per parameter;
            lr enters as a tensor, so schedules do not recompile).
        process_group: a ``torch.distributed`` group: every process draws its own noise, the
            algebra-gradient accumulators and sample counts are summed before the update.
        grad_scaler: a ``torch.amp.GradScaler`` whose scaled backward passes the samples
            use: each sample's gradients are unscaled before they are accumulated, and each
            step's inf check is recorded for ``scaler.update()``.
        max_consecutive_skips: raise ``FloatingPointError`` after this many consecutive
            skipped steps (default 20; ``None``: never), naming what was not finite and the
            likely fix (a lower ``lr`` or scale step ``scale_lr``, a wider prior). A step is
            skipped, the optimizer state unchanged, when the loss, a gradient or an updated
            element is not finite: the first skip warns once (a ``RuntimeWarning`` at the
            calling line) naming which, and for which parameter (its name when the optimizer
            was given ``named_parameters()``, else its position in its param group); later
            skips are only counted, in
            :attr:`~liegroup_blr.optim.BLROptimizer.skipped_steps`. Skips a
            ``GradScaler`` calibrating its scale expects are counted, never warned of, and do
            not count as in a row.
        prior: a :class:`~liegroup_blr.Posterior` used as the prior: the update takes
            (τ/N)·∇KL(q ‖ prior) in place of the N(0, 1/δ) prior and the entropy term
            (:meth:`~liegroup_blr.optim.BLROptimizer.set_prior`).
        between_steps: what the parameters hold between steps: ``"point"`` (default), the
            point estimate; ``"sample"``, a fresh posterior sample θ = g·ξ, drawn after
            every step, so any training loop's forward and backward run at a sample and
            :meth:`~liegroup_blr.optim.BLROptimizer.step` without a closure takes ``p.grad``
            as its gradient (Hugging Face Trainer, accelerate, Lightning, gradient
            accumulation, ``GradScaler.step``); ``point_estimate()`` holds the point
            estimate for a block.
    """

    seed: int | None
    noise: str | NoiseSource
    antithetic: bool
    table_size: int | None
    compile: bool
    process_group: Any
    grad_scaler: torch.amp.GradScaler | None
    max_consecutive_skips: int | None
    prior: Posterior | None
    between_steps: str


@dataclass
class EngineState:
    """What the engine changes while it runs, written by the engine alone (the optimizer
    holds the engine by reference: a wrapper that copies the optimizer's ``__dict__``, as
    Lightning's ``LightningOptimizer`` does, shares it, so a sample counted through the
    wrapper is counted for the optimizer).

    Attributes:
        samples: samples accumulated since the last update.
        skipped: updates skipped for non-finite values, in all.
        consecutive: updates skipped in a row (not counting those a GradScaler expects).
        skip_warned: whether a skipped step has been warned of (only the first is).
        pending: parameters with accumulated samples (a set, ordered).
        deferred: the deferred sample of each param group, by its index.
        tensors: each param group's tensors, gathered once per step (by index).
        marks: each trained parameter's gradient as the engine last saw it (a weak
            reference and the version counter), to tell gradients made since.
        prior: the prior that replaces the N(0, 1/δ) prior and the entropy term, if any.
        centre: each parameter's centre c of the δ-prior N(c, 1/δ) where it is not 0.
        unaveraged: with ``process_group``, whether the processes' gradients were seen to
            differ (not averaged by DistributedDataParallel).
        warned: whether a step that found no gradient has been warned of.
    """

    samples: int = 0
    skipped: int = 0
    consecutive: int = 0
    skip_warned: bool = False
    pending: dict[Tensor, None] = field(default_factory=dict)
    deferred: dict[int, Deferred] = field(default_factory=dict)
    tensors: dict[int, GroupTensors] = field(default_factory=dict)
    marks: dict[Tensor, tuple[Callable[[], Tensor | None], int]] = field(default_factory=dict)
    prior: Prior | None = None
    centre: dict[Tensor, Tensor] = field(default_factory=dict)
    unaveraged: bool = False
    warned: bool = False

    def __getstate__(self) -> dict[str, Any]:
        """A copy forgets the gradients it saw (weak references neither copy nor pickle)."""
        return {**self.__dict__, "marks": {}}

    def skip(
        self, name: str, expected: bool, limit: int | None, what: Callable[[], str], fix: str
    ) -> FloatingPointError | None:
        """Count a step of optimizer ``name`` skipped for non-finite values. Unless the skip
        was ``expected`` (a GradScaler calibrating its scale): warn of the first skip only,
        saying ``what()`` was not finite (asked only when said), and return the error to raise
        once ``limit`` steps in a row were skipped (``max_consecutive_skips``), with ``fix``."""
        self.skipped += 1
        if expected:
            return None
        self.consecutive += 1
        row = self.consecutive
        escalate = limit is not None and row >= limit
        if self.skip_warned and not escalate:
            return None
        said, self.skip_warned = what(), True
        if escalate:
            return FloatingPointError(
                f"{name}: {row} steps in a row skipped for non-finite values "
                f"(max_consecutive_skips={limit}; {self.skipped} skipped in all), the last for "
                f"a non-finite {said}: the run has diverged. {fix}; "
                "max_consecutive_skips=None never raises"
            )
        then = "" if limit is None else f"; {limit} in a row raise FloatingPointError"
        warn(  # the first skip: the later ones return above
            f"{name}: non-finite {said}; step skipped, optimizer state unchanged. Later "
            f"skipped steps are counted in skipped_steps without a warning{then} "
            "(max_consecutive_skips)",
            RuntimeWarning,
        )
        return None
