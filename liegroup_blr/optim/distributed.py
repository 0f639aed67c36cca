"""Training over processes: one seed, rank 0's elements, summed algebra-gradient accumulators.

Every process draws its own noise; before the update the accumulators (not ``p.grad``: the
algebra gradients are nonlinear in each process's noise), sample counts and non-finite flags
are summed, so the group state stays identical everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["all_reduce_accumulators", "broadcast_elements", "shared_seed"]


def shared_seed(seed: int | None, process_group: Any) -> int:
    """The given seed, or one drawn from torch's global RNG; rank 0's across a group."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    if process_group is None:
        return int(seed)
    box = [int(seed)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
    return box[0]


def broadcast_elements(elements: list[Tensor], process_group: Any) -> None:
    """Give every process rank 0's elements, in place."""
    src = dist.get_global_rank(process_group, 0)
    for element in elements:
        dist.broadcast(element, src=src, group=process_group)


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
