"""Optimizers that take the minibatch itself (a functional library's update, as posteriors'
is) in place of a closure: the interface the training loop steps them through. A leaf of
the drivers: it imports nothing of the project."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Batch = tuple[nn.Module, torch.Tensor, torch.Tensor]
"""A model and a minibatch (inputs, labels)."""


class BatchOptimizer(torch.optim.Optimizer):
    """An optimizer that computes its own gradients from the minibatch, as a functional
    library's update does (posteriors'): the training loop calls ``step(batch=(model, x, y))``
    in place of ``step(closure)``."""

    def step(self, closure: Any = None, *, batch: Batch | None = None) -> float:  # type: ignore[override]
        """One update on the minibatch ``(x, y)`` of ``model``; returns its loss."""
        raise NotImplementedError
