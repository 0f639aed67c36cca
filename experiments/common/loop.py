"""The training loop every driver runs: epochs of optimizer steps with the divergence checks,
the learning-rate schedule, the progress count, and a run's checkpoint.

A driver's run type (a dataclass with ``model``, ``optimizer``, ``scheduler`` and
``data_rng``) inherits :class:`Trainee`, and names what else its checkpoint keeps in
:meth:`Trainee.extra_state` (EWC's penalty, a memory). The driver supplies one epoch as its
steps, each ``optimizer.step`` on its closure (:func:`closure`, or one of its own)::

    def train_epoch(run, epoch):
        steps = (partial(run.optimizer.step, loop.closure(run.optimizer, run.model, x, y))
                 for x, y in batches(run.data_rng))
        return run.steps(epoch, steps, f"epoch {epoch + 1}/{epochs}")

    start, rows = run.restore(ckpt, read) if resume else (0, [])
    for epoch in run.epochs(start, epochs, partial(train_epoch, run), progress):
        rows.append({"epoch": epoch.done, "loss": epoch.loss})
        run.save(ckpt, {"epoch": epoch.done}, rows=rows)

Every optimizer of :func:`experiments.common.optimizers.build_optimizer` steps on such a plain
closure: IVON evaluates it at its posterior samples, and under torchrun each optimizer
combines what the processes computed itself (experiments/common/optimizers.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.functional import cross_entropy
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from experiments.common import distributed, runfiles, skeleton
from experiments.common.distributed import Processes

T = TypeVar("T")

ADVICE = "Lower [optimizer].lr (or raise the prior precision) and train into a new folder"


class DivergedError(runfiles.RunError, FloatingPointError):
    """Training produced a non-finite loss, parameter, optimizer state or metric."""


@dataclass(frozen=True)
class Divergence:
    """What went non-finite in ``epoch`` (0-based): ``what`` (``"loss nan at step 3"``), at
    ``step`` (1-based) with its ``loss``, or at the end of the epoch (``step`` None)."""

    epoch: int
    what: str
    step: int | None = None
    loss: float | None = None

    def error(self, where: str | None = None, advice: str = ADVICE) -> DivergedError:
        """``training diverged in WHERE: WHAT; nothing of this epoch was saved. ADVICE``
        (``where`` defaults to ``epoch E``)."""
        where = where or f"epoch {self.epoch + 1}"
        return DivergedError(
            f"training diverged in {where}: {self.what}; nothing of this epoch was saved. " + advice
        )


Diverged = Callable[[Divergence], Exception]
"""How a driver words a divergence (default :meth:`Divergence.error`); None: no checks."""


@dataclass(frozen=True)
class Epoch:
    """An epoch trained and its schedule stepped: its ``index`` (0-based), the learning rate
    it trained at, its mean ``loss``, the ``seconds`` it trained, and what the progress hook
    said after it (``note``, empty without one)."""

    index: int
    lr: float
    loss: float
    seconds: float
    note: str = ""

    @property
    def done(self) -> int:
        """The epochs done with this one."""
        return self.index + 1


def closure(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor] = cross_entropy,
) -> Callable[[], Any]:
    """The closure ``optimizer.step`` calls at each sample: the gradients zeroed, the mean
    ``loss`` of the minibatch (``x``, ``y``), backward; returns the loss, a detached tensor
    (torch types a closure's value as a float, the optimizers take either)."""

    def evaluate() -> Tensor:
        optimizer.zero_grad()
        value = loss(model(x), y)
        value.backward()
        return value.detach()

    return evaluate


class Trainee:
    """What the loop trains, inherited by a driver's run type (a dataclass with these
    attributes): the ``model``, its ``optimizer`` and learning-rate ``scheduler``, the
    generator of the data order ``data_rng``, and the torchrun ``processes`` (None: a driver
    of one process, which checkpoints its state dicts as they are)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    data_rng: torch.Generator
    processes: Processes | None = None

    def extra_state(self) -> dict[str, Any]:
        """The driver's own state, checkpointed after the loop's: name → an object with
        ``state_dict`` and ``load_state_dict``, or None (nothing to keep)."""
        return {}

    # ------------------------------------------------------------------- the loop
    def steps(
        self,
        epoch: int,
        steps: Iterable[Callable[[], Any]],
        desc: str,
        *,
        total: int | None = None,
        size: int | None = None,
        diverged: Diverged | None = Divergence.error,
    ) -> float:
        """One epoch: each of ``steps`` (an optimizer step on a minibatch, returning its
        loss) in turn, with a progress bar (``desc``, ``total`` steps, the images per second
        at ``size`` per batch); returns the mean loss (over the processes).

        Unless ``diverged`` is None, raises what it makes of the first non-finite loss,
        after an update non-finite parameter (a last update can break the parameters while
        every loss was finite), or ``FloatingPointError`` of the optimizer (a BLR optimizer's
        ``max_consecutive_skips`` steps skipped in a row)."""
        main = self.processes is None or self.processes.main
        bar = tqdm(
            steps, total=total, desc=desc, unit="batch", disable=None if main else True, leave=False
        )
        losses: list[float] = []
        start = time.perf_counter()
        self.model.train()
        for step, take in enumerate(bar, 1):
            try:
                loss = float(take())
            except FloatingPointError as err:  # a BLR optimizer's skips in a row: diverged
                if diverged is None or isinstance(err, DivergedError):
                    raise
                raise diverged(Divergence(epoch, f"at step {step}, {err}")) from err
            if diverged is not None:
                if not math.isfinite(loss):
                    raise diverged(Divergence(epoch, f"loss {loss} at step {step}", step, loss))
                if not self._parameters_finite():
                    what = f"non-finite parameters after the update of step {step}"
                    raise diverged(Divergence(epoch, what, step, loss))
            losses.append(loss)
            shown = {"loss": f"{loss:.4f}"}
            if size:
                shown["img_per_s"] = f"{len(losses) * size / (time.perf_counter() - start):.0f}"
            bar.set_postfix(shown)
        mean = float(np.mean(losses))
        return mean if self.processes is None else distributed.mean(mean, self.processes)

    def epochs(
        self,
        start: int,
        stop: int,
        train_epoch: Callable[[int], float],
        progress: Callable[[int], str] | None = None,
        diverged: Diverged | None = Divergence.error,
    ) -> Iterator[Epoch]:
        """Epochs ``start`` … ``stop − 1``: each trains (``train_epoch(epoch)``, its mean
        loss), steps the schedule, has its parameters and optimizer state checked (unless
        ``diverged`` is None) and is told to ``progress`` (the epochs done; told ``start``
        first); yields it before the next begins, for the driver to record and checkpoint."""
        if progress is not None:
            progress(start)
        for epoch, lr, loss, seconds in skeleton.timed_epochs(
            start, stop, train_epoch, self.scheduler
        ):
            if diverged is not None:
                self._check_state(epoch, diverged)
            note = progress(epoch + 1) if progress is not None else ""
            yield Epoch(epoch, lr, loss, seconds, note)

    def _parameters_finite(self) -> bool:
        return runfiles.all_finite([distributed.local(p) for p in self.model.parameters()])

    def _check_state(self, epoch: int, diverged: Diverged) -> None:
        """Parameters and optimizer state must be finite before they are checkpointed."""
        if not self._parameters_finite():
            raise diverged(Divergence(epoch, "non-finite parameters at the end of the epoch"))
        opt = self.optimizer
        state = [t for s in opt.state.values() if isinstance(s, dict) for t in s.values()]
        state += [v for g in opt.param_groups for k, v in g.items() if k != "params"]
        if not runfiles.all_finite([t for t in state if isinstance(t, Tensor)]):
            raise diverged(Divergence(epoch, "non-finite optimizer state at the end of the epoch"))

    # ------------------------------------------------------------ the checkpoint
    def save(self, path: Path, position: dict[str, Any], **kept: Any) -> None:
        """Atomically, checkpoint ``path``: ``position`` (where the run stands: the epochs
        done, ...), the model, optimizer and schedule, every RNG state
        (:func:`~experiments.common.skeleton.rng_state`), the driver's :meth:`extra_state`, then the
        values ``kept`` (the metrics rows, which live here so that no kill can lose them).
        Under torchrun each process keeps its own part (its noise, its shard)."""
        local = distributed.local_state if self.processes is not None else _as_is
        state = {
            **position,
            "model": local(self.model.state_dict()),
            "optimizer": local(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": skeleton.rng_state(self.data_rng),
            **{k: None if v is None else v.state_dict() for k, v in self.extra_state().items()},
            **kept,
        }
        runfiles.save_torch(path, state)

    def restore(self, path: Path, read: Callable[[dict[str, Any]], T]) -> T:
        """Restore checkpoint ``path`` (of :meth:`save`) and return ``read(state)``, where the
        run stands; a checkpoint that is not of this run raises
        :class:`~experiments.common.runfiles.CorruptFileError`
        (:func:`~experiments.common.skeleton.restore`)."""
        model = (
            self.model.load_state_dict
            if self.processes is None
            else partial(distributed.load_model_state, self.model, processes=self.processes)
        )
        loaders = {
            "model": model,
            "optimizer": self.optimizer.load_state_dict,
            "scheduler": self.scheduler.load_state_dict,
            "rng": partial(skeleton.set_rng_state, self.data_rng),
            **{k: None if v is None else v.load_state_dict for k, v in self.extra_state().items()},
        }
        return skeleton.restore(path, loaders, read)


def _as_is(state: T) -> T:
    return state
