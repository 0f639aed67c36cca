"""Scale benchmark: MC samples, noise sources, vectorisation, compilation, processes, memory.

Everything is measured in one run and printed as ratios:

1. mc ∈ {1, 8, 32} on the reference tanh-MLP at batch 50 (additive rule): sequential with
   fresh draws (the baseline), the cheap noise table, antithetic pairs, both, and the
   vectorised (vmap) evaluation — seconds per step and speed-up over the baseline
   (target at mc = 32: the fastest configuration whose samples keep the base distribution
   ≥ 1.5× the baseline).
2. The cost of one noise draw: the table's copy against a fresh ``normal_`` (target ≤ 25%).
3. Full step at mc = 1 against torch.optim.SGD(momentum): ResNet-20 at batch 200 with fresh
   noise (targets ≤ 1.15 additive, ≤ 1.3 multiplicative and affine) and the MLP at batch 50
   with the noise table (targets ≤ 1.3 additive, ≤ 1.5 multiplicative and affine); eager
   against ``compile=True``, each with a closure and in ``between_steps="sample"`` (backward,
   then ``step()``).
4. 1 against 2 processes (gloo, MC-sample parallelism, mc = 8) per step.
5. Optimizer state bytes per model parameter, and peak training memory against SGD (each
   measured in a fresh process).

Run: ``python -m experiments.benchmarks.scale [--quick] [--parts 1 2 3 4 5] [--device cuda]``.
A line after every measurement gives the time elapsed and the time left. ``--device cuda``
runs parts 1 to 3 on the GPU (parts 4 and 5 measure CPU processes and memory: left out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.common import cli

TARGETS: dict[str, tuple[str, dict[str, float]]] = {
    "resnet20": ("fresh", {"additive": 1.15, "multiplicative": 1.3, "affine": 1.3}),
    "mlp": ("table", {"additive": 1.3, "multiplicative": 1.5, "affine": 1.5}),
}
"""Part 3's models: their noise and each rule's target full step ÷ SGD's."""
DURATIONS = (
    "Duration on the project's 2-core CPU machine, one thread, under load: about 32 min in "
    "full (an estimate; part 3 most of it), 41 s with --quick."
)


def _parser() -> argparse.ArgumentParser:
    """The command line; ``--parts`` takes the keys of :data:`PARTS`."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.scale",
        description=__doc__.split("\n\n")[0],
        epilog=DURATIONS,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: one round, fewer steps and samples, ResNet-20 at batch 20, one "
        "thread, nothing compiled, parts 1 to 3 unless --parts names others",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", type=int, choices=range(1, 6), help="default: all")
    parser.add_argument(
        "--models", nargs="+", default=list(TARGETS), choices=list(TARGETS), help="part 3's"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="also write part 3's ratios to this JSON file")
    return parser


if __name__ == "__main__" and cli.asks_help():  # before the imports of torch: --help is quick
    _parser().parse_args()

import copy
import dataclasses
import functools
import itertools
import json
import os
import resource
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import liegroup_blr as lgb
from experiments.benchmarks.step_time import RULES, Countdown, mean_time
from experiments.common import loop
from experiments.common.models import MLP, ResNet

LOSS = nn.functional.cross_entropy


def problem(name: str, device: str = "cpu", batch: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """The model and a batch (default: 50 for the MLP, 200 for ResNet-20) on ``device``."""
    torch.manual_seed(0)
    model: nn.Module
    if name == "mlp":
        model, shape, batch = MLP((1, 28, 28), 10), (1, 28, 28), batch or 50
    else:
        model, shape, batch = ResNet((3, 32, 32), 10), (3, 32, 32), batch or 200
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    return model.to(device), x.to(device), y.to(device)


def interleaved(
    fns: dict[str, Callable[[], object]],
    steps: int,
    rounds: int,
    done: Callable[[int, str], None] = lambda r, name: None,
) -> dict[str, float]:
    """Median over rounds of the mean seconds per call of each callable, all timed in turn
    in every round (a drifting machine affects them alike); one warm-up call each first.
    ``done(r, name)`` hears of each warm-up call (r = 0) and of every round r = 1, 2, ...
    ended (name "")."""
    for name, fn in fns.items():
        fn()
        done(0, name)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            times[name].append(mean_time(fn, steps))
        done(r + 1, "")
    return {name: statistics.median(t) for name, t in times.items()}


def seconds(fn: Callable[[], object], steps: int, rounds: int) -> float:
    """Median over rounds of the mean seconds per call (one warm-up call first)."""
    return interleaved({"": fn}, steps, rounds)[""]


def sgd_step(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor, **kw) -> Callable:
    closure = loop.closure(opt, model, x, y, LOSS)
    return lambda: opt.step(closure)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)


def blr_step(opt: lgb.optim.BLROptimizer, model: nn.Module, x: Tensor, y: Tensor, **kw) -> Callable:
    return lambda: lgb.mc_step(opt, model, LOSS, x, y, **kw)


@dataclasses.dataclass
class Setup:
    """What every part is run with: ``rounds`` interleaved, ``quick`` (a smoke run),
    ``device``, part 3's ``models``, and the ``countdown`` told of every measurement."""

    rounds: int
    quick: bool
    device: str
    models: list[str]
    countdown: Countdown

    def tick(self, part: int, what: str, units: float) -> None:
        """``what`` of ``part`` is done: ``units`` of the part's :func:`cost`."""
        self.countdown.tick(f"part {part}{what and ', '}{what}", units, kind=str(part))


MCS = {False: (1, 8, 32), True: (1, 8)}
"""Part 1's sample counts, in full and quick runs."""
COMPILE_S = 25.0
"""Seconds of compiling one optimizer's step, roughly (part 3's cost in the time left)."""


# ------------------------------------------------------------------------------ parts
def mc_samples(s: Setup) -> None:
    print("\n== 1. MC samples on the MLP at batch 50 (additive): ms per step, speed-up ==")
    model, x, y = problem("mlp", s.device)
    configs: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "sequential fresh": ({}, {}),
        "sequential table": ({"noise": "table"}, {}),
        "antithetic fresh": ({"antithetic": True}, {}),
        "antithetic table": ({"noise": "table", "antithetic": True}, {}),
        "vectorised fresh": ({}, {"vectorize": True}),
    }
    mcs = MCS[s.quick]
    print(f"{'configuration':<20}" + "".join(f"{'mc ' + str(m):>18}" for m in mcs))
    rows: dict[str, list[float]] = {name: [] for name in configs}
    for mc in mcs:
        steps = _mc_steps(mc, s.quick)
        for name, (options, call) in configs.items():
            twin = copy.deepcopy(model)
            opt = lgb.AdditiveBLR(twin.parameters(), lr=1e-3, mc_samples=mc, **options)
            rows[name].append(seconds(blr_step(opt, twin, x, y, **call), steps, s.rounds))
            s.tick(1, f"mc {mc}, {name}", _mc_cost(mc, s))
    for name, times in rows.items():
        cells = "".join(
            f"{t * 1e3:>10.1f} ×{rows['sequential fresh'][i] / t:>5.2f}"
            for i, t in enumerate(times)
        )
        print(f"{name:<20}{cells}")
    best = min(rows[k][-1] for k in configs if k != "vectorised fresh")
    print(
        f"mc {mcs[-1]}: fastest base-preserving configuration "
        f"×{rows['sequential fresh'][-1] / best:.2f} the sequential fresh loop "
        "(target at mc 32 ≥ 1.5)"
    )


def _mc_steps(mc: int, quick: bool) -> int:
    return 2 if quick or mc == 32 else 5


def _mc_cost(mc: int, s: Setup) -> float:
    """Part 1's seconds per configuration at ``mc`` samples, roughly (see :func:`cost`)."""
    return (1 + s.rounds * _mc_steps(mc, s.quick)) * (mc + 2) * 0.02


def draw_cost(s: Setup) -> None:
    print("\n== 2. One noise draw over the MLP's parameters ==")
    model, _, _ = problem("mlp", s.device)
    params = [p.detach().clone() for p in model.parameters()]
    table = lgb.noise.NoiseTable(
        torch.distributions.Normal(0.0, 1.0), 2**24, seed=0, device=s.device
    )
    offsets = iter(range(10**9))
    fresh = seconds(lambda: [p.normal_() for p in params], 10, s.rounds)
    cheap = seconds(lambda: [table.fill_(p, next(offsets) * 7919) for p in params], 10, s.rounds)
    s.tick(2, "", 1.0)
    print(
        f"fresh normal_ {fresh * 1e3:.2f} ms, table {cheap * 1e3:.2f} ms: "
        f"{cheap / fresh:.1%} of a fresh draw (target ≤ 25%)"
    )


def full_steps(s: Setup) -> dict[str, dict[str, float]]:
    """Part 3; returns per model SGD's milliseconds and every "RULE, MODE" ÷ SGD."""
    print("\n== 3. Full step at mc = 1 against torch.optim.SGD(momentum), interleaved ==")
    out = {}
    for name in s.models:
        noise, targets = TARGETS[name]
        fns, batch = _step_fns(name, s)
        tick = functools.partial(_tick_part_3, s, name)
        t = interleaved(fns, _full_steps(name, s.quick), s.rounds, tick)
        print(f"{name} (noise {noise}, batch {batch}): SGD {t['sgd'] * 1e3:.1f} ms")
        out[name] = {"sgd ms": t["sgd"] * 1e3}
        for rule, target in targets.items():
            ratios = {mode: t[f"{rule}, {mode}"] / t["sgd"] for mode in _modes(s.quick)}
            out[name] |= {f"{rule}, {mode}": ratio for mode, ratio in ratios.items()}
            cells = [f"{mode} ×{ratio:.2f}" for mode, ratio in ratios.items()]
            print(f"  {rule:<16}{'   '.join(cells)}   (target ≤ {target})")
    return out


def _step_fns(name: str, s: Setup) -> tuple[dict[str, Callable[[], object]], int]:
    """Part 3's steps on ``name``: SGD's and each "RULE, MODE"; and the batch size."""
    noise, targets = TARGETS[name]
    model, x, y = problem(name, s.device, batch=_batch(name, s.quick))
    twin = copy.deepcopy(model)
    fns = {"sgd": sgd_step(sgd(twin), twin, x, y)}
    for rule, (mode, options) in itertools.product(targets, _modes(s.quick).items()):
        twin = copy.deepcopy(model)
        opt = RULES[rule](twin.parameters(), noise=noise, **options)
        step = sgd_step if "sample" in mode else blr_step  # backward, then step()
        fns[f"{rule}, {mode}"] = step(opt, twin, x, y)
    return fns, len(y)


def _tick_part_3(s: Setup, model: str, r: int, name: str) -> None:
    """Part 3 on ``model`` has warmed up step ``name`` (r = 0) or ended round r."""
    call, per_round = _full_cost(model, s)
    if r:
        s.tick(3, f"{model}, round {r}/{s.rounds}", per_round)
    else:
        s.tick(3, f"{model}, warm-up, {name}", call + COMPILE_S * ("compiled" in name))


def _batch(name: str, quick: bool) -> int:
    """Part 3's batch: 0 for the problem's own, 20 for ResNet-20 in a quick run."""
    return 20 if quick and name == "resnet20" else 0


def _full_steps(name: str, quick: bool) -> int:
    return 2 if quick or name == "resnet20" else 10


def _full_cost(name: str, s: Setup) -> tuple[float, float]:
    """Part 3's seconds for ``name``, roughly (see :func:`cost`): of one step, and of each
    round. A step of ResNet-20 takes about 12 ms per example, one of the MLP 20 ms; the
    warm-up takes a step of each and compiles each compiled one."""
    call = 0.012 * (_batch(name, s.quick) or 200) if name == "resnet20" else 0.02
    return call, (1 + 3 * len(_modes(s.quick))) * call * _full_steps(name, s.quick)


def _warm_up_cost(name: str, s: Setup) -> float:
    modes = _modes(s.quick).values()
    call = _full_cost(name, s)[0]
    return (1 + 3 * len(modes)) * call + 3 * COMPILE_S * sum("compile" in o for o in modes)


MODES: dict[str, dict[str, Any]] = {
    "eager": {},
    "compiled": {"compile": True},
    "eager sample": {"between_steps": "sample"},
    "compiled sample": {"compile": True, "between_steps": "sample"},
}
"""Eager and compiled steps, with a closure (point mode) and on p.grad (sample mode: the
compiled update draws the next sample)."""


def _modes(quick: bool) -> dict[str, dict[str, Any]]:
    """:data:`MODES`; a quick run leaves out the compiled ones (minutes of compiling)."""
    return {m: o for m, o in MODES.items() if not (quick and o.get("compile"))}


def _process(rank: int, world: int, folder: str, mc: int, steps: int, out: str) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    if world > 1:
        init = f"file://{folder}/init"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model, x, y = problem("mlp")
    group = dist.group.WORLD if world > 1 else None
    opt = lgb.AdditiveBLR(model.parameters(), lr=1e-3, mc_samples=mc // world, process_group=group)
    t = seconds(blr_step(opt, model, x, y), steps, 3)
    if rank == 0:
        torch.save(t, out)
    if world > 1:
        dist.destroy_process_group()


def processes(s: Setup) -> None:
    print("\n== 4. MC-sample parallelism over processes (MLP, mc = 8, additive) ==")
    times = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in (1, 2):
            out = os.path.join(folder, f"t{world}.pt")
            mp.spawn(_process, args=(world, folder, 8, 2 if s.quick else 4, out), nprocs=world)
            times[world] = torch.load(out)
            s.tick(4, f"{world} process{'es' if world > 1 else ''}", 12.0)
    print(
        f"1 process {times[1] * 1e3:.1f} ms, 2 processes {times[2] * 1e3:.1f} ms per step: "
        f"×{times[1] / times[2]:.2f} (2 cores shared by both)"
    )


def _peak_rss() -> int:
    """Peak resident set of this process in bytes (VmHWM: unlike ru_maxrss, not inherited
    from the parent a spawned process was forked from)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory(name: str, steps: int, queue: mp.Queue) -> None:
    """Peak resident memory of training (model, gradients, activations, optimizer) above the
    interpreter's, and the optimizer state's bytes per model parameter."""
    base = _peak_rss()
    model, x, y = problem("mlp")
    if name == "sgd":
        opt = sgd(model)
        step = sgd_step(opt, model, x, y)
    else:
        opt = RULES[name](model.parameters())
        step = blr_step(opt, model, x, y)
    for _ in range(steps):
        step()
    peak = _peak_rss() - base
    n_params = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    queue.put((name, state / n_params, peak))


def memory(s: Setup) -> None:
    print("\n== 5. Memory (MLP, batch 50, mc 1) ==")
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    results = {}
    for name in ("sgd", *RULES):
        proc = ctx.Process(target=_memory, args=(name, 3, queue))
        proc.start()
        proc.join()
        rule, per_param, peak = queue.get()
        results[rule] = (per_param, peak)
        s.tick(5, rule, 7.0)
    sgd_peak = max(results["sgd"][1], 1)
    for rule, (per_param, peak) in results.items():
        print(
            f"{rule:<16}state {per_param:5.1f} bytes/parameter   "
            f"peak training memory ×{peak / sgd_peak:.2f} SGD's"
        )


PARTS: dict[int, Callable[[Setup], object]] = {
    1: mc_samples,
    2: draw_cost,
    3: full_steps,
    4: processes,
    5: memory,
}
CPU_ONLY = (4, 5)
"""Parts that start processes to measure CPU processes and resident memory: not run with
``--device cuda``, nor by default with ``--quick``."""


def cost(part: int, s: Setup) -> float:
    """The seconds ``part`` takes on the project's 2-core CPU machine with one thread,
    roughly, as its measurements tick them off: the countdown's weights, which it rescales
    by the speed it sees."""
    return {
        1: 5 * sum(_mc_cost(mc, s) for mc in MCS[s.quick]),
        2: 1.0,
        3: sum(_warm_up_cost(n, s) + s.rounds * _full_cost(n, s)[1] for n in s.models),
        4: 24.0,
        5: 7.0 * (1 + len(RULES)),
    }[part]


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device; run on a GPU machine")
    asked = args.parts or [p for p in PARTS if not (args.quick and p in CPU_ONLY)]
    parts = [p for p in asked if args.device == "cpu" or p not in CPU_ONLY]
    rounds = 1 if args.quick else args.rounds
    if args.quick:
        torch.set_num_threads(1)  # a loaded machine's spare threads spin, many times slower
    s = Setup(rounds, args.quick, args.device, args.models, Countdown("scale", {}))
    s.countdown = Countdown("scale", {str(p): cost(p, s) for p in parts})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    if skipped := sorted(set(asked) - set(parts)):
        print(f"parts {skipped} measure the CPU: left out with --device cuda")
    results = {p: PARTS[p](s) for p in parts}
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "part 3": results.get(3)}))


if __name__ == "__main__":
    main()
