"""Training over processes: one seed, rank 0's elements, summed algebra-gradient accumulators.

With ``process_group``, every process draws its own noise; before the update the accumulators
(not ``p.grad``: the algebra gradients are nonlinear in each process's noise), sample counts
and non-finite flags are summed, so the group state stays identical everywhere.

Without it, once ``torch.distributed`` is initialised (DistributedDataParallel, which averages
``p.grad``), every rank draws the same noise and starts from rank 0's elements: the ranks
evaluate one sample on their parts of the batch, as one process on the global batch.
Sharded (DTensor, FSDP2) parameters: :mod:`liegroup_blr.sharding`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..sharding import SHARDED
from .tensors import Deferred

__all__ = [
    "all_reduce_accumulators",
    "broadcast_elements",
    "refuse_averaged",
    "replicas",
    "shared_seed",
]


def replicas(process_group: Any) -> Any:
    """The group whose ranks must draw the same noise: the default group when
    ``torch.distributed`` is initialised and no ``process_group`` is given (data parallelism
    on averaged gradients, e.g. DDP), else ``None``."""
    if process_group is not None or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD


def shared_seed(seed: int | None, process_group: Any, replicated: Any = None) -> int:
    """The given seed, or one drawn from torch's global RNG; rank 0's across
    ``process_group`` or ``replicated``. Across ``replicated`` ranks an explicit seed must be
    the same on every rank.

    Raises:
        ValueError: replicated ranks given different seeds.
    """
    group = process_group if process_group is not None else replicated
    if group is None:
        return int(seed if seed is not None else torch.randint(0, 2**62, ()).item())
    if replicated is not None and seed is not None:
        seeds: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seeds, int(seed), group=group)
        if len(set(seeds)) > 1:
            raise ValueError(
                f"seed: the ranks gave different seeds {seeds}; with torch.distributed "
                "initialised (DDP) every rank must draw the same noise: pass one seed on every "
                "rank (or none), or process_group= for per-rank noise with summed gradients"
            )
    box = [int(seed if seed is not None else torch.randint(0, 2**62, ()).item())]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def broadcast_elements(state: dict[Tensor, dict[str, Tensor]], process_group: Any) -> None:
    """Give every process rank 0's elements of the parameters in ``state``, in place (those of
    sharded parameters are one process's already, cut to each shard)."""
    src = dist.get_global_rank(process_group, 0)
    for p, s in state.items():
        if not isinstance(p, SHARDED):
            dist.broadcast(s["element"], src=src, group=process_group)


def all_reduce_accumulators(
    accumulators: list[Tensor], n: int, finite: bool, process_group: Any
) -> tuple[int, bool]:
    """Sum the accumulators (in place, one flat buffer per device and dtype), the sample
    counts and the non-finite flags over the group; the total count and whether all were
    finite."""
    device = accumulators[0].device if accumulators else torch.device("cpu")
    if dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    counts = torch.tensor([float(n), float(not finite)], device=device)
    dist.all_reduce(counts, group=process_group)
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in accumulators:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for bucket in buckets.values():
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=process_group)
        for t, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            t.copy_(summed)
    total, bad = counts.tolist()
    return int(total), bad == 0


def refuse_averaged(deferred: dict[int, Deferred], process_group: Any) -> bool:
    """Refuse the ``deferred`` samples' gradients when they are the same on every process of
    ``process_group`` although the processes drew different noise: averaged by
    DistributedDataParallel, which would pair each process's noise with the others' gradients
    (one all-gather of two fingerprints, at the first update).

    Returns:
        ``True``, once checked.

    Raises:
        ValueError: every process holds the same gradients, and their noise differs.
    """
    grads = [g for d in deferred.values() for g in d.raw]
    noise = [n for d in deferred.values() for n in d.noise]
    prints: list[Any] = [None] * dist.get_world_size(process_group)
    mine = None
    if grads:
        mine = tuple(float(sum(t.double().sum() for t in ts)) for ts in (grads, noise))
    dist.all_gather_object(prints, mine, group=process_group)
    same_grads = len({p and p[0] for p in prints}) == 1 and prints[0] is not None
    if len(prints) > 1 and same_grads and len({p[1] for p in prints}) > 1:
        raise ValueError(
            "process_group: every process holds the same gradients although each drew its own "
            "sample: the model is wrapped in DistributedDataParallel, which averages them; "
            "drop process_group= (DDP then trains one sample on the global batch)"
        )
    return True
