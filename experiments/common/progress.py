"""The progress of runs trained one after another: runs done and to do, the time elapsed and
an estimate of the time left.

Each run has a label, ``epochs`` and a cost per epoch (its gradient evaluations per step, in
units). The time is measured per label in this session: a label's rate r_L is the seconds
its runs have taken (their epochs and the loading and evaluation around them) over the units
they have done; a label not measured yet takes the rate of all the work measured,
r = Σ seconds / Σ units. The time left is

    Σ over the runs not done of  r_L · cost · (epochs − epochs done),

unknown until a first epoch has been measured. Runs finished before this session count as
done from the start and their time (an evaluation again) is not measured.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

Key = tuple[str, int]
"""A run: (label, seed)."""


@dataclasses.dataclass
class Planned:
    """A run to train: its ``label``, ``epochs`` of ``cost`` units, ``done`` epochs so far and
    whether it had ``finished`` before this session."""

    label: str
    epochs: int
    cost: float = 1.0
    done: int = 0
    finished: bool = False


def duration(seconds: float) -> str:
    """``seconds`` as "45 s", "8 min 05 s" or "1 h 02 min"."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """Runs done / to do, elapsed time and the estimated time left of the runs of ``plan``
    (key → :class:`Planned`), timed by ``clock``.

    Call :meth:`epoch` with a run's epochs done when it has loaded and after every epoch,
    and :meth:`end` when it is evaluated; each returns :meth:`line`. The time between two
    calls is the current run's.
    """

    def __init__(
        self, plan: Mapping[Key, Planned], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.plan = {key: dataclasses.replace(run) for key, run in plan.items()}
        self.clock = clock
        self.begun = clock()
        self.mark = self.begun
        self.seconds: dict[str, float] = {}
        self.units: dict[str, float] = {}
        self.ended = {key for key, run in self.plan.items() if run.finished}
        self.seen: set[Key] = set()  # the runs whose first epoch() has been heard

    def epoch(self, key: Key, done: int) -> str:
        """Run ``key`` has done ``done`` epochs (its first call: where it starts)."""
        run = self.plan[key]
        self._measure(run, run.cost * max(done - run.done, 0) if key in self.seen else 0.0)
        self.seen.add(key)
        run.done = done
        return self.line()

    def end(self, key: Key) -> str:
        """Run ``key`` is done (trained and evaluated)."""
        self._measure(self.plan[key], 0.0)
        self.ended.add(key)
        return self.line()

    def _measure(self, run: Planned, units: float) -> None:
        """The time since the last mark, spent doing ``units`` of ``run``."""
        now = self.clock()
        if not run.finished:
            self.seconds[run.label] = self.seconds.get(run.label, 0.0) + now - self.mark
            self.units[run.label] = self.units.get(run.label, 0.0) + units
        self.mark = now

    def seconds_left(self) -> float | None:
        """Σ r_L · cost · (epochs − done) over the runs not done; None before any unit."""
        measured = [label for label, units in self.units.items() if units > 0]
        if not measured:
            return None
        overall = sum(self.seconds[m] for m in measured) / sum(self.units[m] for m in measured)
        rate = {m: self.seconds[m] / self.units[m] for m in measured}
        return sum(
            rate.get(run.label, overall) * run.cost * max(run.epochs - run.done, 0)
            for key, run in self.plan.items()
            if key not in self.ended
        )

    def times(self) -> str:
        """``E elapsed, about L left``."""
        left = self.seconds_left()
        estimate = (
            "time left known after an epoch" if left is None else f"about {duration(left)} left"
        )
        return f"{duration(self.clock() - self.begun)} elapsed, {estimate}"

    def line(self) -> str:
        """``runs D/T done, E elapsed, about L left``."""
        return f"runs {len(self.ended)}/{len(self.plan)} done, {self.times()}"
