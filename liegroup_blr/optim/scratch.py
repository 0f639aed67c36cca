"""The optimizer's scratch buffers, with one owner, as :class:`~liegroup_blr.noise.NoiseSource`
owns its noise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .kernel_utils import Rows, rows

__all__ = ["Scratch", "state_dtype"]


def state_dtype(p: Tensor) -> torch.dtype:
    """Group state is kept in float32 for half-precision parameters, else in their dtype."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


class Scratch:
    """Reusable per-parameter buffers of a step, and the row views compiled kernels take.

    Buffers are named (``"acc"``, ``"noise"``, ``"spare"``, ``"grad"``), made on first use in
    the parameter's state dtype and on its device, and kept: an eager step allocates nothing.
    A buffer and a state tensor can swap places (:meth:`swap`): the proposal writes the new
    momenta into the accumulators, which then become the momenta.
    """

    def __init__(self) -> None:
        self._buffers: dict[Tensor, dict[str, Tensor]] = {}
        self._rows: dict[int, tuple[Tensor, Rows]] = {}

    def take(
        self, params: list[Tensor], **shapes: Callable[[torch.Size], torch.Size]
    ) -> list[list[Tensor]]:
        """For each keyword ``key=shape_of``, each parameter's buffer ``key`` of shape
        ``shape_of(p.shape)`` (made if missing or on another device)."""
        lists: list[list[Tensor]] = []
        for key, shape_of in shapes.items():
            out = []
            for p in params:
                buffers = self._buffers.setdefault(p, {})
                buf = buffers.get(key)
                if buf is None or buf.device != p.device:
                    shape = shape_of(p.shape)
                    buf = buffers[key] = torch.empty(shape, dtype=state_dtype(p), device=p.device)
                out.append(buf)
            lists.append(out)
        return lists

    def swap(self, states: list[dict[str, Tensor]], params: list[Tensor], key: str, buf: str):
        """Exchange each ``states[i][key]`` with parameter i's buffer ``buf`` (by reference)."""
        for state, p in zip(states, params, strict=True):
            buffers = self._buffers[p]
            state[key], buffers[buf] = buffers[buf], state[key]

    def rows(self, tensors: list[Tensor], stacked: bool = True) -> list[Rows]:
        """Each tensor as its rows (:func:`~.kernel_utils.rows`), the views made once per tensor
        and kept (a compiled kernel's call would otherwise spend a dispatch per tensor per step
        on them). Only for tensors the optimizer keeps: a sample's noise may be a new table
        window at every step."""
        out = []
        for t in tensors:
            entry = self._rows.get(id(t))
            if entry is None or entry[0] is not t:
                entry = self._rows[id(t)] = (t, rows([t], stacked)[0])
            out.append(entry[1])
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held."""
        return sum(b.nbytes for kept in self._buffers.values() for b in kept.values())

    @property
    def kept_rows(self) -> int:
        """How many tensors' row views are kept."""
        return len(self._rows)

    def clear(self) -> None:
        """Drop every buffer and view (a loaded state starts afresh)."""
        self._buffers.clear()
        self._rows.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {"_buffers": self._buffers, "_rows": {}}  # views: made again on use
