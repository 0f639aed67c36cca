"""What the rules' kernels share: compilation, the rows of stacked tensors, e^x as 2^{x log₂e},
the momentum."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["LOG2E", "Rows", "compiled", "momentum", "rows"]

LOG2E = math.log2(math.e)
"""log₂e: kernels compute e^x as 2^{x log₂e} (``exp2`` is several times faster than ``exp``
on CPU, with a relative error of about |x| times the dtype's epsilon)."""

Rows = tuple[Tensor, ...]
"""A tensor as compiled kernels take it, the rows (t[0], t[1], …) of a stacked tensor or
(t,)."""

_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(kernel, fullgraph=True)``, made once per kernel and shared."""
    if kernel not in _COMPILED:
        _COMPILED[kernel] = torch.compile(kernel, fullgraph=True)
    return _COMPILED[kernel]


def rows(tensors: list[Tensor], stacked: bool = True) -> list[Rows]:
    """Each tensor as its :data:`Rows` (views). Compiled kernels take them: a write into one
    row of a stacked tensor compiles to a pass over the whole tensor, and a kernel over rows
    is one loop per parameter."""
    return [tuple(t.unbind(0)) if stacked else (t,) for t in tensors]


def momentum(x: Tensor, m: Tensor, *, n: int, beta: float, offset: float | Tensor = 0.0) -> Tensor:
    r""":math:`M' = \beta M + (1 - \beta)(x/n + c)`: the new momentum from the sum x of n
    samples' algebra gradients and the part c of the algebra gradient that is not the loss's:
    the entropy's −τ/N, or the prior's (τ/N)∇KL(q ‖ prior)."""
    return torch.lerp(x * (1.0 / n) + offset, m, beta)
