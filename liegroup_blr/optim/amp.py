"""Mixed precision with ``torch.amp.GradScaler``: unscaled samples, the scaler told of infs.

Two ways in. ``GradScaler.step(optimizer)`` (what Lightning, accelerate and most loops do)
calls :meth:`~liegroup_blr.optim.BLROptimizer.step` itself, after setting the optimizer's
``grad_scale`` and ``found_inf`` (the protocol of optimizers with
``_step_supports_amp_scaling``): the step's one sample is read with the scale taken off, and
an inf skips it; the scaler then backs off as for torch.optim. With several samples per step
an inf in an earlier sample would never reach ``scaler.update()``, so that needs the scaler
at construction (``grad_scaler=``): every sample's gradients are then unscaled as they are
read, and the step's verdict (all samples finite, or not) is recorded with the scaler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Scaled", "expected_skip", "inverse_scale", "record_finite", "scaler_step"]


class Scaled(Protocol):
    """What these functions read of an optimizer (besides the ``grad_scale`` and ``found_inf``
    a ``GradScaler.step`` sets on it)."""

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None: ...
    @property
    def mc_samples(self) -> int: ...
    @property
    def pending_samples(self) -> int: ...
    def discard(self) -> None: ...


def inverse_scale(optimizer: Scaled) -> float:
    """1 / the loss scale the gradients read now carry: that of a ``GradScaler.step``
    driving the step (1 once ``unscale_`` has taken it off), else that of the optimizer's
    enabled ``grad_scaler``, else 1."""
    state = vars(optimizer)
    if "grad_scale" in state:
        scale = state["grad_scale"]
        return 1.0 if scale is None else 1.0 / float(scale)
    scaler = optimizer.grad_scaler
    return 1.0 / scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0


def scaler_step(optimizer: Scaled, closure: Callable[[], Any] | None) -> tuple[float, bool]:
    """The inverse loss scale of the gradients this step reads (:func:`inverse_scale`) and
    whether a ``GradScaler.step(optimizer)`` driving it found inf/NaN gradients; refused, in
    one line, where an inf in an earlier sample would escape that scaler."""
    state = vars(optimizer)
    if "found_inf" not in state or optimizer.grad_scaler is not None:
        return inverse_scale(optimizer), False
    pending = optimizer.pending_samples
    if pending > 1 or (closure is not None and optimizer.mc_samples > 1):
        optimizer.discard()
        raise RuntimeError(
            f"GradScaler.step(optimizer) with {max(pending, optimizer.mc_samples)} samples in "
            "the step: an inf in an earlier sample would never reach scaler.update(); pass "
            "grad_scaler=scaler to the optimizer, or take one sample per step"
        )
    return inverse_scale(optimizer), bool(state["found_inf"].item())


def expected_skip(optimizer: Scaled) -> bool:
    """Whether a skipped step is one a GradScaler calibrating its scale expects (not warned
    of): the step is driven by ``GradScaler.step``, or the optimizer has an enabled scaler."""
    scaler = optimizer.grad_scaler
    return "found_inf" in vars(optimizer) or bool(scaler and scaler.is_enabled())


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
