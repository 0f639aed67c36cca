"""Threads benchmark: a training step with 1 and with 2 intra-op threads, each rule against Adam.

For the README's example (a 20-64-3 tanh MLP, 1,000 examples) and the reference tanh-MLP
(784-1024-512-256-256-256-10), both at batch 50, it times a full training step as the
README's loop takes it (``opt.step(closure)``: the closure zeroes the gradients, runs the
forward and the backward; one MC sample) of torch's ``Adam`` and ``SGD(momentum)`` with
their defaults, the additive, multiplicative and affine rules, and the generic rule
(:class:`~liegroup_blr.LieGroupBLR` on the diagonal affine group); and the closure alone.
Each round runs one process per setting: 1 thread, 2 threads, and 2 threads whose idle
OpenMP threads sleep at once instead of spinning (``OMP_WAIT_POLICY=PASSIVE``); the
settings take turns at going first. It prints ms per step, ÷ Adam's in the same setting and
each row's time ÷ its time with 1 thread, with the load average before and after.

Run: ``python -m experiments.benchmarks.threads [--rounds 6] [--steps 20]
[--models readme mlp] [--quick]``. Numbers are medians over rounds of the mean time per call.
"""

from __future__ import annotations

import argparse

from experiments.common import cli

MODELS = ("readme", "mlp")
SETTINGS = {"1": (1, "default"), "2": (2, "default"), "2 passive": (2, "PASSIVE")}
"""Each setting's threads and ``OMP_WAIT_POLICY`` (``default``: unset, so that an idle
OpenMP thread spins a while before it sleeps)."""
QUICK = {"rounds": 1, "steps": 3, "models": ["readme"]}
"""``--quick``: one round of three steps on the README's model (a smoke run)."""
DURATIONS = (
    "Duration on the project's 2-core CPU machine under a load average of 5 to 7: 4 min 51 s "
    "with --rounds 3 --steps 10, 46 s with --quick."
)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.threads",
        description=__doc__.split("\n\n")[0],
        epilog=DURATIONS,
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every setting (median)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row and round")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round of 3 steps, README's model"
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # threads of a round
    return parser


if __name__ == "__main__" and cli.asks_help():  # before the imports of torch: --help is quick
    _parser().parse_args()

import copy
import functools
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import liegroup_blr as lgb
from experiments.benchmarks.step_time import Countdown, mean_time
from experiments.common import loop
from experiments.common.models import MLP

BATCH = 50
ROOT = Path(__file__).resolve().parents[2]
Maker = Callable[[list[Tensor]], torch.optim.Optimizer]


def _model(name: str) -> tuple[nn.Module, Tensor, Tensor, int]:
    """The model, a batch (inputs, labels) and the data size N."""
    torch.manual_seed(0)
    if name == "readme":
        model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3))
        return model, torch.randn(BATCH, 20), torch.randint(0, 3, (BATCH,)), 1000
    x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    return MLP((1, 28, 28), 10), x, y, 60_000


def _makers(name: str, n: int) -> dict[str, Maker]:
    """Each optimizer: the README's values on its model, ``step_time``'s on the MLP."""
    readme = name == "readme"
    lr = {"additive": 0.05, "multiplicative": 2.0, "affine": 0.01} if readme else {}
    affine: dict[str, Any] = {"prior_precision": 25.0} if readme else {"scale_lr": 1e-5}
    return {
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
        "additive": lambda ps: lgb.AdditiveBLR(ps, lr=lr.get("additive", 1e-3), data_size=n),
        "multiplicative": lambda ps: lgb.MultiplicativeBLR(
            ps, lr=lr.get("multiplicative", 1e-3), temperature=0.006, data_size=n, init="auto"
        ),
        "affine": lambda ps: lgb.AffineBLR(ps, lr=lr.get("affine", 1e-3), data_size=n, **affine),
        "generic affine": lambda ps: lgb.LieGroupBLR(
            ps,
            lgb.groups.DiagonalAffineGroup(),
            torch.distributions.Normal(0.0, 0.005),
            lr=lr.get("affine", 1e-3),
            data_size=n,
            preconditioner={"scale": 1e-2, "shift": 1.0},
        ),
    }


CLOSURE = "closure alone"
"""The row of the forward and backward without the optimizer's step."""


def _calls(name: str) -> dict[str, Callable[[], object]]:
    """A full step of each optimizer on its own copy of the model, and the closure alone."""
    model, x, y, n = _model(name)
    calls: dict[str, Callable[[], object]] = {}
    for row, make in _makers(name, n).items():
        twin = copy.deepcopy(model)
        opt = make(list(twin.parameters()))
        closure = loop.closure(opt, twin, x, y)
        calls[row] = functools.partial(opt.step, closure)
    calls[CLOSURE] = closure  # the last optimizer's: zero_grad, forward, backward
    return calls


def worker(threads: int, models: list[str], steps: int) -> dict[str, dict[str, float]]:
    """One round in this process at ``threads`` threads: each row's mean ms per call, after
    as many untimed calls."""
    torch.set_num_threads(threads)
    times = {}
    for name in models:
        calls = _calls(name)
        for call in calls.values():  # warm-up
            mean_time(call, steps)
        times[name] = {row: mean_time(call, steps) * 1e3 for row, call in calls.items()}
    return times


def _round(setting: str, models: list[str], steps: int) -> dict[str, dict[str, float]]:
    """:func:`worker` in a process of its own, with the threads and wait policy of
    ``setting``."""
    threads, policy = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env |= {"OMP_WAIT_POLICY": policy} if policy != "default" else {}
    argv = ["--worker", str(threads), "--steps", str(steps), "--models", *models]
    command = [sys.executable, "-m", "experiments.benchmarks.threads", *argv]
    done = subprocess.run(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def measure(rounds: int, steps: int, models: list[str]) -> dict[str, dict[str, float]]:
    """Median ms per call of every model, row and setting (key ``"ROW@SETTING"``) over
    ``rounds``, the settings taking turns at going first."""
    countdown = Countdown("threads", dict.fromkeys(SETTINGS, rounds))  # a rate per setting
    times: dict[str, dict[str, list[float]]] = {name: {} for name in models}
    order = list(SETTINGS)
    for r in range(rounds):
        for setting in order[r % len(order) :] + order[: r % len(order)]:
            for name, rows in _round(setting, models, steps).items():
                for row, ms in rows.items():
                    times[name].setdefault(f"{row}@{setting}", []).append(ms)
            countdown.tick(f"round {r + 1}/{rounds}, threads {setting}", kind=setting)
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def report(name: str, med: dict[str, float]) -> None:
    """Print one model's table: ms per step, ÷ Adam's, ÷ the row's with 1 thread."""
    n = sum(p.numel() for p in _model(name)[0].parameters())
    print(f"\n== {name}: {n:,} parameters, batch {BATCH}, ms per step (threads) ==")
    heads = "".join(f"{f'{s} ms':>13}{'÷ Adam':>8}" for s in SETTINGS)
    print(f"{'row':<16}{heads}{'2 ÷ 1':>8}{'passive ÷ 1':>12}")
    for row in (k.removesuffix("@1") for k in med if k.endswith("@1")):
        ms = {s: med[f"{row}@{s}"] for s in SETTINGS}
        cells = "".join(f"{ms[s]:>13.2f}{ms[s] / med[f'adam@{s}']:>8.2f}" for s in SETTINGS)
        print(f"{row:<16}{cells}{ms['2'] / ms['1']:>8.2f}{ms['2 passive'] / ms['1']:>12.2f}")


SMOKE = "smoke run (--quick): too few steps for the times to mean anything"


def _load() -> str:
    """The load averages over 1, 5 and 15 minutes."""
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.models, args.steps)))
        return
    if args.quick:
        vars(args).update(QUICK)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {_load()}")
    med = measure(args.rounds, args.steps, args.models)
    for name in args.models:
        report(name, med[name])
    print(f"load average after: {_load()}")
    if args.quick:
        print(SMOKE)


if __name__ == "__main__":
    main()
