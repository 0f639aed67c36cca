"""Optimizers behind wrappers: Lightning's ``LightningOptimizer``, accelerate's
``AcceleratedOptimizer`` and anything else that holds the real optimizer as ``.optimizer``."""

from __future__ import annotations

from typing import Any

from ..posterior import wrapped
from .base import BLROptimizer

__all__ = ["unwrap"]


def unwrap(optimizer: Any) -> BLROptimizer | None:
    """The Lie-group optimizer ``optimizer`` is or wraps (following ``.optimizer`` and
    ``._optimizer`` through wrappers of wrappers), or ``None`` when it holds none (a
    deterministic optimizer such as ``torch.optim.SGD``)."""
    return next((o for o in wrapped(optimizer) if isinstance(o, BLROptimizer)), None)
