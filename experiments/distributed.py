"""Training over processes launched by ``torchrun``: the process group and the work split.

    torchrun --standalone --nproc_per_node 2 -m experiments.train CONFIG.toml

The config is the same as for one process. With ``parallel = "data"`` (the default) every
process takes its slice of each minibatch and runs all ``mc_samples`` samples; with
``parallel = "mc"`` every process takes the whole minibatch and ``mc_samples / world``
samples. Either way the Lie-group optimizers sum their algebra-gradient accumulators over
the processes (``process_group``), and the baselines average their gradients, so the
parameters stay identical on every process. Only rank 0 writes the run's files; each
process keeps its own checkpoint, since its noise generator is its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

PARALLEL = ("data", "mc")


@dataclass(frozen=True)
class Processes:
    """This process's place among the ``world`` processes of a run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0

    @property
    def group(self) -> object | None:
        """The process group for the optimizers, or None for a single process."""
        return dist.group.WORLD if self.world > 1 else None


def from_environment() -> Processes:
    """The processes ``torchrun`` describes in RANK / WORLD_SIZE / LOCAL_RANK (one process
    without them); joins the process group: NCCL with CUDA, else gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes()
    processes = Processes(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return processes


def device_for(name: str, processes: Processes) -> torch.device:
    """One GPU per process under torchrun (``cuda:LOCAL_RANK``)."""
    device = torch.device(name)
    if device.type == "cuda" and processes.world > 1:
        return torch.device("cuda", processes.local_rank)
    return device


def local_samples(mc_samples: int, parallel: str, processes: Processes) -> int:
    """Samples each process draws: all of them (data parallel) or its share (MC parallel)."""
    if parallel == "data" or processes.world == 1:
        return mc_samples
    if mc_samples % processes.world:
        raise ValueError(
            f"parallel 'mc': mc_samples {mc_samples} must be divisible by the "
            f"{processes.world} processes"
        )
    return mc_samples // processes.world


def local_batch(x: Tensor, y: Tensor, parallel: str, processes: Processes) -> tuple[Tensor, Tensor]:
    """This process's part of a minibatch: its contiguous slice (data parallel) or all of it."""
    if parallel == "mc" or processes.world == 1:
        return x, y
    if len(x) % processes.world:
        raise ValueError(
            f"parallel 'data': the batch size {len(x)} must be divisible by the "
            f"{processes.world} processes"
        )
    size = len(x) // processes.world
    part = slice(processes.rank * size, (processes.rank + 1) * size)
    return x[part], y[part]


def average_gradients(parameters: list[Tensor], processes: Processes) -> None:
    """Mean of ``p.grad`` over the processes (the deterministic baselines under torchrun)."""
    if processes.world == 1:
        return
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= processes.world


def _device(processes: Processes) -> torch.device:
    """Where collectives run: this process's GPU under NCCL, else the CPU."""
    on_gpu = dist.get_backend() == "nccl"
    return torch.device("cuda", processes.local_rank) if on_gpu else torch.device("cpu")


def mean(value: float, processes: Processes) -> float:
    """The mean of a per-process number over the processes."""
    if processes.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device(processes))
    dist.all_reduce(t)
    return float(t) / processes.world


def all_agree(ok: bool, processes: Processes) -> bool:
    """Whether ``ok`` holds on every process (every process must call it)."""
    if processes.world == 1:
        return ok
    t = torch.tensor([int(ok)], device=_device(processes))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t)


def barrier(processes: Processes) -> None:
    """Wait for every process."""
    if processes.world > 1:
        dist.barrier()


def leave() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
