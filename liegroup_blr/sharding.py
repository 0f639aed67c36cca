"""Sharded (DTensor, FSDP2) parameters: their local shards, the state cut to them, and what the
ranks agree on. The ground floor every layer that touches a parameter uses.

A sharded parameter keeps its optimizer state as local shards, sharded like the parameter
along its own dimensions (a stacked state ``(2, …)`` along the next one): the rules run on
the local shards (:func:`local`), the initial state is the one process's, cut to the shard
(:func:`shard_of`), the state dict holds DTensors again (:func:`as_dtensor`), table noise is
served by global index and fresh noise per shard (:func:`shard_name`), and the ranks agree on
every skip (:func:`agree`). :class:`Shards` is the optimizer's component that does all of this
for its parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "SHARDED",
    "Shards",
    "agree",
    "as_dtensor",
    "check_sharded",
    "local",
    "local_grad",
    "shard_name",
    "shard_of",
    "whole",
]

SHARDED: tuple[type[Any], ...] = ()
"""The tensor types of sharded parameters, DTensor (FSDP2's ``fully_shard``) where
torch.distributed is available."""
if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    SHARDED = (DTensor,)


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


def whole(state: Tensor, p: Tensor) -> Tensor:
    """The whole tensor of a state of ``p``: gathered from the shards of a sharded parameter
    (a collective: every rank calls it), a copy of any other."""
    return as_dtensor(state, p).full_tensor() if isinstance(p, SHARDED) else state.clone()


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


def shard_name(key: Tensor) -> str:
    """The generator name of a sharded parameter's shard: ``"/shard"`` and its coordinates on
    the device-mesh dimensions it is sharded along (ranks holding replicas of one shard draw
    alike); ``""`` for any other tensor."""
    if not isinstance(key, SHARDED):
        return ""
    coordinate = key.device_mesh.get_coordinate() or []
    dims = [d for d, q in enumerate(key.placements) if q.is_shard()]
    return "/shard" + ",".join(str(coordinate[d]) for d in dims)


class Shards:
    """An optimizer's sharded parameters: admitted one by one, their local shards, their
    gradients' and their states, and the ranks' agreement on a skip.

    Attributes:
        mesh_param: a sharded parameter, whose device mesh agrees on skips (``None``: no
            parameter is sharded, and the optimizer uses the parameters themselves).
    """

    def __init__(self) -> None:
        self.mesh_param: Any = None

    def admit(self, p: Tensor, group: Any, process_group: Any) -> None:
        """Take a new parameter (:func:`check_sharded` for a sharded one)."""
        if isinstance(p, SHARDED):
            check_sharded(p, group, process_group)
            if self.mesh_param is None:
                self.mesh_param = p

    def grads(self, grads: list[Any], params: list[Tensor]) -> list[Any]:
        """The gradients of ``params`` as their local shards (:func:`local_grad`)."""
        return [None if g is None else local_grad(g, p) for g, p in zip(grads, params, strict=True)]

    def initial(self, init: Any, p: Tensor) -> dict[str, Tensor]:
        """``init(p)``, the initial state of ``p``: of a sharded one, one process's state of
        the whole parameter (gathered), cut to its shard."""
        if isinstance(p, SHARDED):
            return {k: shard_of(v, p).clone() for k, v in init(p.full_tensor()).items()}
        return init(p)

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (:func:`agree`; ``ok`` when nothing is sharded)."""
        return ok if self.mesh_param is None else agree(ok, self.mesh_param)

    def placed(self, state: dict[str, Tensor], p: Tensor) -> dict[str, Any]:
        """Tensors of ``p``'s state as the optimizer hands them out (its state dict, its
        group elements): the local shards of a sharded one as DTensors (:func:`as_dtensor`)."""
        return {k: as_dtensor(v, p) for k, v in state.items()} if isinstance(p, SHARDED) else state

    def local_like(self, value: Any, state: Tensor, p: Tensor) -> Tensor:
        """A value for ``p``'s ``state``: a DTensor placed as :meth:`placed` places the state
        becomes the local shard; any other tensor is taken as it is."""
        if not isinstance(value, SHARDED):
            return value
        placed = as_dtensor(state, p)
        return local(value.redistribute(placed.device_mesh, placed.placements))
