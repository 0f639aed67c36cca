"""Training over processes launched by ``torchrun``: the process group and the work split.

    torchrun --standalone --nproc_per_node 2 -m experiments.runs.train CONFIG.toml

The config is the same as for one process. With ``parallel = "data"`` (the default) every
process takes its slice of each minibatch and runs all ``mc_samples`` samples; with
``parallel = "mc"`` every process takes the whole minibatch and ``mc_samples / world``
samples. Either way the Lie-group optimizers sum their algebra-gradient accumulators over
the processes (``process_group``), and the baselines average their gradients, so the
parameters stay identical on every process. With ``parallel = "fsdp"`` the model is sharded
with FSDP2 (``fully_shard``): each process holds 1/world of the parameters and of the
optimizer state, takes its slice of each minibatch, and FSDP2 averages the gradients; one
sample per step on the global batch, each element's noise drawn by the process holding it.
Every process evaluates (the forward passes gather the shards). Only rank 0 writes the run's
files; each process keeps its own checkpoint, since its noise generator (and, sharded, its
part of the state) is its own.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from liegroup_blr.sharding import SHARDED, local

PARALLEL = ("data", "mc", "fsdp")


@dataclass(frozen=True)
class Processes:
    """This process's place among the ``world`` processes of a run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    parallel: str = "data"

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0

    @property
    def group(self) -> object | None:
        """The process group for the optimizers: None for a single process and for FSDP2."""
        return dist.group.WORLD if self.world > 1 and self.parallel != "fsdp" else None

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over the processes (FSDP2)."""
        return self.world > 1 and self.parallel == "fsdp"


def from_environment(parallel: str = "data") -> Processes:
    """The processes ``torchrun`` describes in RANK / WORLD_SIZE / LOCAL_RANK (one process
    without them), sharing the work as ``parallel`` says; joins the process group: NCCL with
    CUDA, else gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes(parallel=parallel)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    processes = Processes(rank, world, local_rank, parallel)
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
    """Samples each process draws: all of them (data parallel, FSDP2) or its share (MC
    parallel)."""
    if parallel != "mc" or processes.world == 1:
        return mc_samples
    if mc_samples % processes.world:
        raise ValueError(
            f"parallel 'mc': mc_samples {mc_samples} must be divisible by the "
            f"{processes.world} processes"
        )
    return mc_samples // processes.world


def local_batch(x: Tensor, y: Tensor, parallel: str, processes: Processes) -> tuple[Tensor, Tensor]:
    """This process's part of a minibatch: its contiguous slice (data parallel, FSDP2) or all
    of it."""
    if parallel == "mc" or processes.world == 1:
        return x, y
    if len(x) % processes.world:
        raise ValueError(
            f"parallel '{parallel}': the batch size {len(x)} must be divisible by the "
            f"{processes.world} processes"
        )
    size = len(x) // processes.world
    part = slice(processes.rank * size, (processes.rank + 1) * size)
    return x[part], y[part]


def shard(model: nn.Module, processes: Processes) -> nn.Module:
    """FSDP2 over the processes: each child module with parameters, then the root, which
    reshards after its forward too (the optimizers write the shards between steps, and FSDP2
    would go on using the gathered parameters of an unresharded module)."""
    if not processes.sharded:
        return model
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model, reshard_after_forward=True)
    return model


def _each_dtensor(state: Any, convert: Callable[[Any], Tensor]) -> Any:
    """``state`` (nested dicts and lists) with ``convert`` applied to each DTensor."""
    if isinstance(state, dict):
        return {k: _each_dtensor(v, convert) for k, v in state.items()}
    if isinstance(state, list):
        return [_each_dtensor(v, convert) for v in state]
    return convert(state) if isinstance(state, SHARDED) else state


def local_state(state: Any) -> Any:
    """A state dict with each DTensor replaced by this process's shard (what its own
    checkpoint file keeps)."""
    return _each_dtensor(state, local)


def full_state(state: Any) -> Any:
    """A state dict with each DTensor gathered whole (a collective per DTensor)."""
    return _each_dtensor(state, lambda t: t.full_tensor())


@torch.no_grad()
def load_model_state(model: nn.Module, state: dict[str, Any], processes: Processes) -> None:
    """``model.load_state_dict``, or, sharded, each entry copied into this process's shard."""
    if not processes.sharded:
        model.load_state_dict(state)
        return
    own = model.state_dict()
    if own.keys() != state.keys():
        raise KeyError(f"the model's entries differ: {sorted(own.keys() ^ state.keys())}")
    for name, value in state.items():
        local(own[name]).copy_(value)


def average_gradients(parameters: list[Tensor], group: Any) -> None:
    """Mean of ``p.grad`` over the processes of ``group`` (the deterministic baselines under
    torchrun, :class:`experiments.common.optimizers.AveragedGradients`; None: one process, or FSDP2,
    which averages them itself)."""
    if group is None:
        return
    world = dist.get_world_size(group)
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= world


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
    """Leave the process group, if this process joined one; what holds it (FSDP2's modules,
    device meshes) is collected first, or its threads may outlive it and abort the exit."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
