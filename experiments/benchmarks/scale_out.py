"""Scale-out benchmark: FSDP2 over 2 gloo processes against one process, in one run.

1. Optimizer memory per rank, counted tensor by tensor after two steps on the reference
   tanh-MLP (1,594,122 parameters): the state (elements and momenta; target with 2 processes
   ≤ 0.55 × one process's), the scratch buffers (accumulators, noise) and the noise table,
   in bytes per model parameter.
2. Step time on the same global batch (50): one process against 2 FSDP2 processes of 25 each,
   for SGD (momentum) and the three rules; ``OMP_NUM_THREADS=1`` per process, median over
   rounds of the mean of ``--steps`` steps.
3. What a rule adds to FSDP2's traffic per step: one all-reduce of one number per device mesh
   dimension (the skip agreed by all ranks); the per-parameter bytes behind the 1-billion-
   parameter estimate on docs/scaling.md.

Run: ``python -m experiments.benchmarks.scale_out [--steps 20 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import liegroup_blr as lgb
from experiments.models import MLP

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


def memory(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this process holds: state, scratch buffers, noise tables (local shards only)."""
    if isinstance(opt, lgb.optim.BLROptimizer):
        return opt.memory()
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

            def closure(opt=opt, model=model, x=x, y=y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss

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
            results[name] = {"memory": memory(opt), "seconds": statistics.median(times)}
            results[name]["params"] = params
        torch.save(results, f"{folder}/world{world}-rank{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
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
    print("\n== 2. step time, same global batch: 2 FSDP2 processes ÷ 1 process ==")
    for name in RULES:
        t1, t2 = one[name]["seconds"], max(r[name]["seconds"] for r in two)
        print(
            f"{name:<16}1 process {t1 * 1e3:7.2f} ms   2 processes {t2 * 1e3:7.2f} ms   "
            f"ratio {t2 / t1:5.2f}   ÷ SGD's ratio "
            f"{(t2 / t1) / (max(r['sgd']['seconds'] for r in two) / one['sgd']['seconds']):5.2f}"
        )
    print(
        "\n== 3. traffic a rule adds to FSDP2's per step: one all-reduce of one float32 per "
        "mesh dimension (the skip); FSDP2 itself all-gathers the parameters (forward, and "
        "backward when resharded) and reduce-scatters the gradients =="
    )


if __name__ == "__main__":
    main()
