"""The progress line of the drivers: runs done / to do, time elapsed and the time left,
on constructed timings whose answer is worked out by hand (issue 32)."""

from __future__ import annotations

import pytest

from experiments.common.progress import Planned, Progress, duration


class Clock:
    """A clock that reads what the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_as_a_person_says_them() -> None:
    assert [duration(s) for s in (0, 44.6, 60, 485, 3599, 3720)] == [
        "0 s",
        "45 s",
        "1 min 00 s",
        "8 min 05 s",
        "59 min 59 s",
        "1 h 02 min",
    ]


def test_time_left_from_each_labels_own_rate_and_the_overall_one_before() -> None:
    """Label a costs 1 unit per epoch, label b 4 (four samples per step); two seeds each,
    two epochs per run."""
    clock = Clock()
    plan = {
        (label, s): Planned(label, 2, cost) for label, cost in (("a", 1), ("b", 4)) for s in (0, 1)
    }
    progress = Progress(plan, clock)
    assert progress.seconds_left() is None
    assert progress.line() == "runs 0/4 done, 0 s elapsed, time left known after an epoch"
    clock.now = 1.0  # loaded
    progress.epoch(("a", 0), 0)
    assert progress.seconds_left() is None
    clock.now = 3.0
    progress.epoch(("a", 0), 1)  # a: 3 s for 1 unit
    # a0: 1 unit, a1: 2 units at 3 s; b: 16 units at the overall rate, also 3 s
    assert progress.seconds_left() == pytest.approx(3 * 3 + 16 * 3)
    clock.now = 5.0
    progress.epoch(("a", 0), 2)
    clock.now = 6.0  # evaluated: 6 s for 2 units
    assert progress.end(("a", 0)) == "runs 1/4 done, 6 s elapsed, about 54 s left"
    assert progress.seconds_left() == pytest.approx(2 * 3 + 16 * 3)
    progress.epoch(("b", 0), 0)  # no time passed
    clock.now = 14.0
    line = progress.epoch(("b", 0), 1)  # b: 8 s for 4 units, 2 s a unit
    assert progress.seconds_left() == pytest.approx(2 * 3 + 4 * 2 + 8 * 2)
    assert line == "runs 1/4 done, 14 s elapsed, about 30 s left"


def test_resumed_runs_count_as_done_and_start_where_they_stopped() -> None:
    clock = Clock()
    plan = {
        ("a", 0): Planned("a", 4, 1.0, done=4, finished=True),
        ("a", 1): Planned("a", 4, 1.0, done=3),
        ("a", 2): Planned("a", 4, 1.0),
    }
    progress = Progress(plan, clock)
    assert progress.line().startswith("runs 1/3 done, ")
    clock.now = 30.0  # the finished run is evaluated again: not timed
    progress.epoch(("a", 0), 4)
    progress.end(("a", 0))
    assert progress.seconds_left() is None
    progress.epoch(("a", 1), 2)  # the checkpoint held 2 epochs, not the 3 of its metrics
    clock.now = 32.0
    progress.epoch(("a", 1), 3)  # one epoch: 2 s
    assert progress.seconds_left() == pytest.approx(2 * 1 + 2 * 4)
    assert progress.end(("a", 1)).startswith("runs 2/3 done, 32 s elapsed, about ")
