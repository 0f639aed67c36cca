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

Run: ``python -m experiments.benchmarks.scale [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
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
from experiments.benchmarks.step_time import RULES, mean_time
from experiments.models import MLP, ResNet

LOSS = nn.functional.cross_entropy


def problem(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP((1, 28, 28), 10), torch.randn(50, 1, 28, 28), torch.randint(0, 10, (50,))
    return ResNet((3, 32, 32), 10), torch.randn(200, 3, 32, 32), torch.randint(0, 10, (200,))


def interleaved(fns: dict[str, Callable[[], object]], steps: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the mean seconds per call of each callable, all timed in turn
    in every round (a drifting machine affects them alike); one warm-up call each first."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(mean_time(fn, steps))
    return {name: statistics.median(t) for name, t in times.items()}


def seconds(fn: Callable[[], object], steps: int, rounds: int) -> float:
    """Median over rounds of the mean seconds per call (one warm-up call first)."""
    return interleaved({"": fn}, steps, rounds)[""]


def sgd_step(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor, **kw) -> Callable:
    def step() -> None:
        opt.zero_grad()
        LOSS(model(x), y).backward()
        opt.step()

    return step


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)


def blr_step(opt: lgb.optim.BLROptimizer, model: nn.Module, x: Tensor, y: Tensor, **kw) -> Callable:
    return lambda: lgb.mc_step(opt, model, LOSS, x, y, **kw)


# ------------------------------------------------------------------------------ parts
def mc_samples(rounds: int, quick: bool) -> None:
    print("\n== 1. MC samples on the MLP at batch 50 (additive): ms per step, speed-up ==")
    model, x, y = problem("mlp")
    configs: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "sequential fresh": ({}, {}),
        "sequential table": ({"noise": "table"}, {}),
        "antithetic fresh": ({"antithetic": True}, {}),
        "antithetic table": ({"noise": "table", "antithetic": True}, {}),
        "vectorised fresh": ({}, {"vectorize": True}),
    }
    print(f"{'configuration':<20}" + "".join(f"{'mc ' + str(s):>18}" for s in (1, 8, 32)))
    rows: dict[str, list[float]] = {name: [] for name in configs}
    for mc in (1, 8, 32):
        steps = 2 if quick or mc == 32 else 5
        for name, (options, call) in configs.items():
            twin = copy.deepcopy(model)
            opt = lgb.AdditiveBLR(twin.parameters(), lr=1e-3, mc_samples=mc, **options)
            rows[name].append(seconds(blr_step(opt, twin, x, y, **call), steps, rounds))
    for name, times in rows.items():
        cells = "".join(
            f"{t * 1e3:>10.1f} ×{rows['sequential fresh'][i] / t:>5.2f}"
            for i, t in enumerate(times)
        )
        print(f"{name:<20}{cells}")
    best = min(rows[k][2] for k in configs if k != "vectorised fresh")
    print(
        f"mc 32: fastest base-preserving configuration ×{rows['sequential fresh'][2] / best:.2f}"
        " the sequential fresh loop (target ≥ 1.5)"
    )


def draw_cost(rounds: int) -> None:
    print("\n== 2. One noise draw over the MLP's parameters ==")
    model, _, _ = problem("mlp")
    params = [p.detach().clone() for p in model.parameters()]
    table = lgb.noise.NoiseTable(torch.distributions.Normal(0.0, 1.0), 2**24, seed=0)
    offsets = iter(range(10**9))
    fresh = seconds(lambda: [p.normal_() for p in params], 10, rounds)
    cheap = seconds(lambda: [table.fill_(p, next(offsets) * 7919) for p in params], 10, rounds)
    print(
        f"fresh normal_ {fresh * 1e3:.2f} ms, table {cheap * 1e3:.2f} ms: "
        f"{cheap / fresh:.1%} of a fresh draw (target ≤ 25%)"
    )


def full_steps(rounds: int, quick: bool) -> None:
    print("\n== 3. Full step at mc = 1 against torch.optim.SGD(momentum), interleaved ==")
    for name, noise, targets in (
        ("resnet20", "fresh", {"additive": 1.15, "multiplicative": 1.3, "affine": 1.3}),
        ("mlp", "table", {"additive": 1.3, "multiplicative": 1.5, "affine": 1.5}),
    ):
        model, x, y = problem(name)
        steps = 2 if quick or name == "resnet20" else 10
        twin = copy.deepcopy(model)
        fns = {"sgd": sgd_step(sgd(twin), twin, x, y)}
        for rule, (mode, options) in itertools.product(targets, MODES.items()):
            twin = copy.deepcopy(model)
            opt = RULES[rule](twin.parameters(), noise=noise, **options)
            step = sgd_step if "sample" in mode else blr_step  # backward, then step()
            fns[f"{rule}, {mode}"] = step(opt, twin, x, y)
        t = interleaved(fns, steps, rounds)
        print(f"{name} (noise {noise}): SGD {t['sgd'] * 1e3:.1f} ms")
        for rule, target in targets.items():
            ratios = {mode: t[f"{rule}, {mode}"] / t["sgd"] for mode in MODES}
            cells = [f"{mode} ×{ratio:.2f}" for mode, ratio in ratios.items()]
            print(f"  {rule:<16}{'   '.join(cells)}   (target ≤ {target})")


MODES: dict[str, dict[str, Any]] = {
    "eager": {},
    "compiled": {"compile": True},
    "eager sample": {"between_steps": "sample"},
    "compiled sample": {"compile": True, "between_steps": "sample"},
}
"""Eager and compiled steps, with a closure (point mode) and on p.grad (sample mode: the
compiled update draws the next sample)."""


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


def processes(quick: bool) -> None:
    print("\n== 4. MC-sample parallelism over processes (MLP, mc = 8, additive) ==")
    times = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in (1, 2):
            out = os.path.join(folder, f"t{world}.pt")
            mp.spawn(_process, args=(world, folder, 8, 2 if quick else 4, out), nprocs=world)
            times[world] = torch.load(out)
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


def memory() -> None:
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
    sgd_peak = max(results["sgd"][1], 1)
    for rule, (per_param, peak) in results.items():
        print(
            f"{rule:<16}state {per_param:5.1f} bytes/parameter   "
            f"peak training memory ×{peak / sgd_peak:.2f} SGD's"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--parts", nargs="+", type=int, default=[1, 2, 3, 4, 5], choices=[1, 2, 3, 4, 5]
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    parts = {
        1: lambda: mc_samples(args.rounds, args.quick),
        2: lambda: draw_cost(args.rounds),
        3: lambda: full_steps(args.rounds, args.quick),
        4: lambda: processes(args.quick),
        5: memory,
    }
    for part in args.parts:
        parts[part]()


if __name__ == "__main__":
    main()
