"""What the rules' kernels share: compilation, the parts of stacked tensors, the loss
gradient a sample contributes, the finiteness check of a proposal, and e^x as 2^{x log₂e}."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["LOG2E", "Parts", "Proposal", "all_finite", "compiled", "loss_gradients", "parts"]

LOG2E = math.log2(math.e)
"""log₂e: kernels compute e^x as 2^{x log₂e} (``exp2`` is several times faster than ``exp``
on CPU, with a relative error of about |x| times the dtype's epsilon)."""

Parts = tuple[Tensor, ...]
"""A tensor as compiled kernels take it: the rows (t[0], t[1], …) of a stacked tensor, or (t,)."""

_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(kernel, fullgraph=True)``, made once per kernel and shared."""
    if kernel not in _COMPILED:
        _COMPILED[kernel] = torch.compile(kernel, fullgraph=True)
    return _COMPILED[kernel]


def parts(tensors: list[Tensor], stacked: bool = True) -> list[Parts]:
    """Each tensor as its :data:`Parts` (views). Compiled kernels take them: a write into one
    row of a stacked tensor compiles to a pass over the whole tensor, and a kernel over rows
    is one loop per parameter."""
    return [tuple(t.unbind(0)) if stacked else (t,) for t in tensors]


def loss_gradients(
    grads: list[Tensor], theta: list[Tensor], out: list[Tensor], inv_scale: float, decay: float
) -> list[Tensor]:
    r""":math:`\nabla\bar\ell_\delta = s^{-1}\nabla\bar\ell + \frac{\delta}{N}\theta` into ``out``
    (``inv_scale`` = 1/s of a GradScaler, ``decay`` = δ/N); ``grads`` are read, not written."""
    torch._foreach_copy_(out, grads)
    if inv_scale != 1.0:
        torch._foreach_mul_(out, inv_scale)
    if decay:
        torch._foreach_add_(out, theta, alpha=decay)
    return out


@dataclass
class Proposal:
    """What must be finite for a step to go on: ``tensors`` (the new momenta, and any
    proposed element), and their ``sums`` when the proposing kernel made them."""

    tensors: list[Tensor]
    sums: list[Tensor] | None = None


def all_finite(tensors: Iterable[Tensor], sums: list[Tensor] | None = None) -> bool:
    """Whether every entry of every tensor is finite (one host sync, two when a sum is not).

    A finite sum has finite terms; a sum that is not finite (an infinite or NaN entry, or an
    overflow of finite ones) is settled by the extremes, exactly. ``sums``: the tensors'
    sums, if a kernel made them in its pass."""
    tensors = list(tensors)
    sums = [t.sum() for t in tensors] if sums is None else sums
    if not sums or bool(torch.stack(sums).isfinite().all()):
        return True
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    return bool(torch.stack(extremes).isfinite().all())
