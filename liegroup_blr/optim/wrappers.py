"""Optimizers behind wrappers: Lightning's ``LightningOptimizer``, accelerate's
``AcceleratedOptimizer`` and anything else that holds the real optimizer as ``.optimizer``."""

from __future__ import annotations

from typing import Any

from .base import BLROptimizer

__all__ = ["unwrap"]


def unwrap(optimizer: Any) -> BLROptimizer | None:
    """The Lie-group optimizer ``optimizer`` is or wraps (following ``.optimizer`` and
    ``._optimizer`` through wrappers of wrappers), or ``None`` when it holds none (a
    deterministic optimizer such as ``torch.optim.SGD``)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if isinstance(optimizer, BLROptimizer):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    return None
