"""Scale-out benchmark: FSDP2 over 2 gloo processes against one process, in one run.

1. Optimizer memory per rank, counted tensor by tensor after two steps on the reference
   tanh-MLP (1,594,122 parameters): the state (elements and momenta; target with 2 processes
   ≤ 0.55 × one process's), the scratch buffers (accumulators, noise) and the noise table,
   in bytes per model parameter.
2. Step time on the same global batch (50): one process against 2 FSDP2 processes of 25 each,
   for SGD (momentum) and the three rules; ``OMP_NUM_THREADS=1`` per process, median over
   rounds of the mean of ``--steps`` steps.
3. Traffic per step and rank with 2 processes, counted at the collectives (all-gathers,
   reduce-scatters, all-reduces): FSDP2's, and what a rule adds (the skip agreed by the
   ranks); with 1, the per-parameter bytes behind the 1-billion-parameter estimate on
   docs/scaling.md.

Run: ``python -m experiments.benchmarks.scale_out [--steps 20 --rounds 5]``.
"""

from __future__ import annotations

import argparse

from experiments.common import cli


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.scale_out", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    return parser


if __name__ == "__main__" and cli.asks_help():  # before the imports of torch: --help is quick
    _parser().parse_args()

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import liegroup_blr as lgb
from experiments.common import loop
from experiments.common.models import MLP

BATCH = 50
RULES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "additive": lambda ps: lgb.AdditiveBLR(ps, lr=0.01, data_size=60000, noise="table"),
    "multiplicative": lambda ps: lgb.MultiplicativeBLR(
        ps, lr=1.0, temperature=0.006, data_size=60000, noise="table"
    ),
    "affine": lambda ps: lgb.AffineBLR(
        ps, lr=1.0, scale_lr=0.05, data_size=60000, temperature=0.006, noise="table"
    ),
}


COLLECTIVES = {
    "all_gather_single": (0, "output_tensor"),
    "reduce_scatter_single": (1, "input"),
    "all_reduce": (0, "tensor"),
}
"""The collectives FSDP2 and the rules call, and the argument (position, name) that holds the
bytes moved: the gathered output, the input reduced."""


@contextmanager
def counted(totals: dict[str, int]) -> Iterator[None]:
    """Add the bytes each collective moves to ``totals`` while the block runs."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted_call(*args: Any, **kwargs: Any) -> Any:
            position, keyword = COLLECTIVES[name]
            tensor = args[position] if len(args) > position else kwargs[keyword]
            totals[name] = totals.get(name, 0) + tensor.nbytes
            return call(*args, **kwargs)

        return counted_call

    for name, call in originals.items():
        setattr(dist, name, counting(name, call))
    try:
        yield
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)


def memory(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this process holds: state, scratch buffers, noise tables (local shards only)."""
    if isinstance(opt, lgb.optim.BLROptimizer):
        return opt.footprint()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"state": sum(t.nbytes for t in state)}


def _run(rank: int, world: int, folder: str, steps: int, rounds: int) -> None:
    torch.set_num_threads(1)
    if world > 1:
        init = f"file://{folder}/init"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name, make in RULES.items():
            torch.manual_seed(0)
            model = MLP((1, 28, 28), 10)
            params = sum(p.numel() for p in model.parameters())
            if world > 1:
                from torch.distributed.fsdp import fully_shard

                for layer in model.modules():
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer)
                fully_shard(model, reshard_after_forward=True)
            x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
            part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            x, y = x[part], y[part]
            opt = make(model.parameters())

            closure = loop.closure(opt, model, x, y)
            for _ in range(2):
                opt.step(closure)
            times = []
            for _ in range(rounds):
                if world > 1:
                    dist.barrier()
                tic = time.perf_counter()
                for _ in range(steps):
                    opt.step(closure)
                times.append((time.perf_counter() - tic) / steps)
            traffic: dict[str, int] = {}
            with counted(traffic):
                for _ in range(steps):
                    opt.step(closure)
            traffic = {k: v // steps for k, v in traffic.items()}
            results[name] = {"memory": memory(opt), "seconds": statistics.median(times)}
            results[name]["traffic"] = traffic
            results[name]["params"] = params
        torch.save(results, f"{folder}/world{world}-rank{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


def main() -> None:
    args = _parser().parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        _run(0, 1, folder, args.steps, args.rounds)
        mp.spawn(_run, args=(2, folder, args.steps, args.rounds), nprocs=2, join=True)
        one = torch.load(f"{folder}/world1-rank0.pt", weights_only=True)
        two = [torch.load(f"{folder}/world2-rank{r}.pt", weights_only=True) for r in (0, 1)]
    print(f"reference MLP, batch {BATCH} (2 processes: 25 each), {args.steps} steps, median of ")
    print(f"{args.rounds} rounds, OMP_NUM_THREADS=1 per process, gloo on CPU\n")
    print("== 1. optimizer memory per rank, bytes per model parameter ==")
    print(
        f"{'':<16}{'state 1p':>10}{'state 2p':>10}{'ratio':>8}{'scratch 1p':>12}"
        f"{'scratch 2p':>12}{'noise':>8}"
    )
    for name in RULES:
        if name == "sgd":
            continue
        params = one[name]["params"]
        m1 = one[name]["memory"]
        m2 = max((r[name]["memory"] for r in two), key=lambda m: m["state"])
        print(
            f"{name:<16}{m1['state'] / params:>10.2f}{m2['state'] / params:>10.2f}"
            f"{m2['state'] / m1['state']:>8.3f}{m1['scratch'] / params:>12.2f}"
            f"{m2['scratch'] / params:>12.2f}{m2['noise'] / params:>8.2f}"
        )
    print("\n== 2. step time, same global batch: 1 process, 2 FSDP2 processes (the slower rank) ==")
    sgd = one["sgd"]["seconds"], max(r["sgd"]["seconds"] for r in two)
    for name in RULES:
        t1, t2 = one[name]["seconds"], max(r[name]["seconds"] for r in two)
        print(
            f"{name:<16}1 process {t1 * 1e3:7.2f} ms ({t1 / sgd[0]:4.2f} x SGD)   "
            f"2 processes {t2 * 1e3:7.2f} ms ({t2 / sgd[1]:4.2f} x SGD)   2 ÷ 1: {t2 / t1:5.2f}"
        )
    print("\n== 3. traffic per step and rank, 2 processes, bytes (per model parameter) ==")
    for name in RULES:
        traffic = two[0][name]["traffic"]
        params = one[name]["params"]
        extra = sum(traffic.values()) - sum(two[0]["sgd"]["traffic"].values())
        cells = "   ".join(f"{k} {v:,} ({v / params:.2f})" for k, v in sorted(traffic.items()))
        print(f"{name:<16}{cells}   more than SGD: {extra:,} bytes")


if __name__ == "__main__":
    main()
