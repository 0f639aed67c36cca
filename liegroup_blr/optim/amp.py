"""Mixed precision with ``torch.amp.GradScaler``: unscaled samples, the scaler told of infs.

The rules consume each sample's gradients as it is drawn (the algebra gradient is nonlinear
in the sample), so the loss scale is taken off every sample's gradients before they are
accumulated, and the step's verdict (all samples finite, or not) is recorded with the
scaler so that ``scaler.update()`` backs off or grows the scale as it does for torch.optim.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["inverse_scale", "record_finite", "scaler_found_inf"]


def inverse_scale(scaler: torch.amp.GradScaler | None) -> float:
    """1 / loss scale of an enabled scaler, else 1."""
    return 1.0 / scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0


class _Flag:
    """The smallest thing ``GradScaler.unscale_`` reads: param groups whose one tensor's
    gradient is 0 (finite step) or inf."""

    def __init__(self, finite: bool) -> None:
        flag = torch.zeros(())  # on the CPU: the scaler moves its verdicts to its own device
        flag.grad = torch.full((), 0.0 if finite else math.inf)
        self.param_groups: list[dict[str, Any]] = [{"params": [flag]}]


def record_finite(scaler: torch.amp.GradScaler | None, finite: bool) -> None:
    """Record the step's inf check with an enabled ``scaler`` for its next ``update()``."""
    if scaler is None or not scaler.is_enabled():
        return
    scaler.unscale_(_Flag(finite))  # type: ignore[arg-type]


def scaler_found_inf(optimizer: Any) -> bool:
    """Whether ``GradScaler.step(optimizer)`` found inf/NaN gradients: it sets the
    optimizer's ``grad_scale`` and ``found_inf`` before calling its ``step`` (for optimizers
    with ``_step_supports_amp_scaling``)."""
    state = vars(optimizer)
    if state.get("grad_scale") is not None and optimizer.grad_scaler is None:
        raise RuntimeError(
            "GradScaler.step(optimizer): pass grad_scaler=scaler to the optimizer so each "
            "sample's gradients are unscaled before they are accumulated"
        )
    found = state.get("found_inf")
    return found is not None and bool(found.item())
