"""Training over processes: one seed, rank 0's elements, summed algebra-gradient accumulators;
sharded (DTensor) parameters.

With ``process_group``, every process draws its own noise; before the update the accumulators
(not ``p.grad``: the algebra gradients are nonlinear in each process's noise), sample counts
and non-finite flags are summed, so the group state stays identical everywhere.

Without it, once ``torch.distributed`` is initialised (DistributedDataParallel, which averages
``p.grad``), every rank draws the same noise and starts from rank 0's elements: the ranks
evaluate one sample on their parts of the batch, as one process on the global batch.

Sharded parameters (DTensor: FSDP2's ``fully_shard``) keep their state as local shards, sharded
like the parameter along its own dimensions (a stacked state (2, …) along the next one): the
rules run on the local shards (:func:`local`), the initial state is the one process's, cut to
the shard (:func:`shard_of`), the state dict holds DTensors again (:func:`as_dtensor`) and the
ranks agree on every skip (:func:`agree`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .tensors import Deferred

__all__ = [
    "SHARDED",
    "agree",
    "all_reduce_accumulators",
    "as_dtensor",
    "broadcast_elements",
    "check_sharded",
    "local",
    "local_grad",
    "refuse_averaged",
    "replicas",
    "shard_of",
    "shared_seed",
]

SHARDED: tuple[type[Any], ...] = ()
"""Tensor types of sharded parameters (DTensor: FSDP2's ``fully_shard``)."""
if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    SHARDED = (DTensor,)


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


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard (the tensor itself, no copy); any other tensor unchanged."""
    return t._local_tensor if isinstance(t, SHARDED) else t


def local_grad(grad: Any, p: Any) -> Tensor:
    """The local shard of a sharded parameter ``p``'s gradient, redistributed to ``p``'s
    placements first where they differ (a replicated bias added to a sharded product gets
    a sharded gradient)."""
    if isinstance(grad, SHARDED) and tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return local(grad)


def shard_of(full: Tensor, p: Any) -> Tensor:
    """The part of ``full`` (shape ``(*prefix, *p.shape)``) that the sharded parameter ``p``'s
    local shard covers, as a view: ``full`` narrowed along each of p's dimensions to the
    shard's global offset and length (uneven and empty shards included)."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    prefix = full.dim() - p.dim()
    for d, (n, start) in enumerate(zip(shape, offset, strict=True)):
        if n != p.shape[d]:
            full = full.narrow(prefix + d, start, n)
    return full


def as_dtensor(state: Tensor, p: Any) -> Any:
    """A local state tensor of the sharded parameter ``p`` (shape ``(*prefix, *local shape)``)
    as the DTensor it is a shard of: sharded like ``p`` along p's own dimensions (no copy)."""
    prefix = state.dim() - p.dim()
    placements = [Shard(q.dim + prefix) if isinstance(q, Shard) else q for q in p.placements]
    shape = torch.Size((*state.shape[:prefix], *p.shape))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        state, p.device_mesh, placements, run_check=False, shape=shape, stride=stride
    )


def check_sharded(p: Any, group: Any, process_group: Any) -> None:
    """Refuse, in one line naming the way out, a sharded parameter the rule cannot train
    shard by shard.

    Raises:
        ValueError: ``process_group`` given, a placement other than Shard and Replicate, or
            a Lie group that is not element-wise along the parameter's own dimensions.
    """
    if process_group is not None:
        raise ValueError(
            "process_group: not with sharded (DTensor, FSDP2) parameters, whose gradients "
            "FSDP2 already averages; drop process_group= (each shard then draws its own "
            "noise, one sample on the global batch)"
        )
    if any(not isinstance(q, (Shard, Replicate)) for q in p.placements):
        raise ValueError(f"params: placements {p.placements} are not supported: Shard, Replicate")
    shapes = (group.element_shape(p.shape), group.algebra_shape(p.shape), group.base_shape(p.shape))
    if not group.elementwise or any(s[len(s) - p.dim() :] != p.shape for s in shapes):
        raise ValueError(
            f"params: {type(group).__name__} does not act element-wise along the parameter's "
            "own dimensions, so a shard cannot be updated alone; sharded (DTensor, FSDP2) "
            "parameters need an element-wise group (additive, multiplicative, diagonal affine)"
        )


def agree(ok: bool, p: Any) -> bool:
    """Whether ``ok`` holds on every rank of the sharded parameter ``p``'s device mesh (one
    all-reduce per mesh dimension): every rank takes or skips a step together."""
    flag = torch.tensor(float(ok), device=p.device)
    for dim in range(p.device_mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=p.device_mesh.get_group(dim))
    return bool(flag.item())


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
