r"""What users do to the parameters and gradients outside the optimizer: writes to the
parameters, adopted as the posterior's location, and gradients found before a closure, refused
only when they would enter an update.

**Writes.** A ``torch.optim`` optimizer reads ``p`` at every step, so a value written into a
parameter between steps (``model.load_state_dict``, a restored "best" checkpoint, SWA's
average, a weight constraint) stands. These optimizers hold the posterior in their state and
write θ into the parameters themselves; after each of their public calls they remember every
trained parameter's version counter and storage pointer, and at the next one a parameter whose
pair differs was written by someone else. Only then its value is compared with what the
optimizer wrote there (the point estimate, or the training sample of
``between_steps="sample"``), so a wrapper that rewrites the same values (DDP's broadcast,
accelerate's ``prepare``) changes nothing, and a changed value becomes the posterior's new
location: the element :math:`g' =` :meth:`~liegroup_blr.groups.LieGroup.with_point` of it, whose
point estimate is the value, keeping what the group can of the spread.

**Gradients before a closure.** ``loss = closure(); optimizer.step(closure)`` (PyTorch's own
tests, L-BFGS-style code) leaves gradients at the point estimate before the step; a closure
that zeroes them first mixes nothing in. A closure that adds to them (Lightning's gradient
accumulation) would mix gradients at the point estimate into a sample's: refused.
:class:`Foreign` tells the two apart with a hook on each parameter, which sees its gradient
before the closure's backward adds to it.
"""

from __future__ import annotations

import warnings
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .distributed import local
from .scratch import state_dtype

if TYPE_CHECKING:
    from .state import GroupStateOptimizer

__all__ = ["GONE", "Foreign", "adopt_writes", "mark_writes", "take_writes"]


# ------------------------------------------------------------------------- writes
def mark_writes(opt: GroupStateOptimizer) -> None:
    """Remember each trained parameter's version counter and storage, as the optimizer left
    them (of a sharded parameter: the DTensor's version, its local shard's storage)."""
    sharded = opt._mesh_param is not None
    opt._engine.written = {
        p: (p._version, (local(p) if sharded else p).data_ptr())
        for group in opt.param_groups
        for p in group["params"]
        if p.requires_grad
    }


def take_writes(opt: GroupStateOptimizer) -> None:
    """Adopt what was written into the trained parameters since the optimizer's last call
    (:func:`adopt_writes`). Between steps only, where the parameters hold what the optimizer
    last wrote: one comparison of version and storage per parameter, no pass over values."""
    engine, sharded = opt._engine, opt._mesh_param is not None
    if engine.samples or engine.tensors or engine.holding:
        return
    written = engine.written
    changed = [
        p
        for group in opt.param_groups
        for p in group["params"]
        if p in written and written[p] != (p._version, (local(p) if sharded else p).data_ptr())
    ]
    if changed:
        adopt_writes(opt, changed)
        mark_writes(opt)


@torch.no_grad()
def adopt_writes(opt: GroupStateOptimizer, changed: list[Tensor]) -> None:
    """Adopt the values written into the parameters ``changed`` (their version or storage
    moved since the optimizer's last call) as the posterior's location, with one warning;
    values equal to what the optimizer wrote are left alone.

    Raises:
        RuntimeError: a parameter's dtype, device or shape changed (``module.to``,
            ``p.data = ...``), a non-finite value was written, or the group has no
            ``with_point``: each in one line naming the fix.
    """
    written = set(changed)
    resident = opt._engine.resident
    held = {} if resident is None else {p: i for i, p in enumerate(resident.params)}
    adopted, sampled = 0, False
    for index, group in enumerate(opt.param_groups):
        keys = [p for p in group["params"] if p in written and "element" in opt.state.get(p, {})]
        moved = [p for p in keys if not _unchanged(opt, group, p, held)]
        if not moved:
            continue
        mean = opt._point_mean(group)
        for p in moved:
            state, value = opt.state[p], local(p)
            theta = value.to(state["element"].dtype)
            xi0 = opt._reference(group, value, mean)
            state["element"].copy_(opt._with_point(group, state["element"], theta, xi0))
        at_point = [p for p in moved if p not in held]
        if at_point:
            elements = [opt.state[p]["element"] for p in at_point]
            opt._write_point(group, [local(p) for p in at_point], elements, mean)
        if len(at_point) < len(moved):
            _hold_at_point(opt, index, group, set(moved) - set(at_point), held)
            sampled = True
        adopted += len(moved)
    if adopted:
        where = (
            "; the parameters hold that point as their training sample until the next step"
            if sampled
            else ""
        )
        warnings.warn(
            f"{type(opt).__name__}: {adopted} parameter(s) were written outside the optimizer "
            "(load_state_dict, a restored checkpoint or average, a weight constraint): the "
            f"values are adopted as the posterior's location, its point estimate{where}",
            UserWarning,
            stacklevel=4,
        )


def _unchanged(opt: GroupStateOptimizer, group: dict[str, Any], p: Tensor, held: dict) -> bool:
    """Whether ``p`` still holds what the optimizer wrote (up to the rounding of a compiled
    kernel, which computes it another way: 2 ulps of the tensor's largest entry); checks
    that the value can be adopted."""
    value, state = local(p), opt.state[p]
    element = state["element"]
    G = opt._group_of(group)
    if (
        state_dtype(value) != element.dtype
        or value.device != element.device
        or G.element_shape(value.shape) != element.shape
    ):
        raise RuntimeError(
            f"params: a parameter of {type(opt).__name__} changed to {value.dtype}, "
            f"{value.device}, shape {tuple(value.shape)} after the optimizer was built "
            "(module.to(...), p.data = ...): build the optimizer after moving or converting "
            "the model"
        )
    expected = torch.empty_like(value)
    if p in held:
        resident = opt._engine.resident
        assert resident is not None
        opt._sample_value(group, [element], [resident.noise[held[p]]], [expected])
    else:
        opt._write_point(group, [expected], [element], opt._point_mean(group))
    if torch.equal(value, expected):
        return True
    if not bool(value.isfinite().all()):
        raise RuntimeError(
            f"params: a non-finite value was written into a parameter of {type(opt).__name__} "
            "outside the optimizer; it cannot be the posterior's location"
        )
    tolerance = 2 * torch.finfo(value.dtype).eps * expected.abs().max()
    return bool((value - expected).abs().max() <= tolerance)


def _hold_at_point(
    opt: GroupStateOptimizer, index: int, group: dict[str, Any], keys: set[Tensor], held: dict
) -> None:
    """In sample mode: the parameters ``keys`` hold their new point estimate as the training
    sample at ξ₀ (its noise kept with the resident sample), so a gradient taken at the
    written value is the one of that sample."""
    t = opt._tensors(index, group)
    assert t is not None
    t = t.subset([p in keys for p in t.keys])
    mean = opt._point_mean(group)
    noise = opt._draw(group, t, [opt._reference(group, p, mean) for p in t.params])
    resident = opt._engine.resident
    assert resident is not None
    for p, n in zip(t.keys, noise, strict=True):
        resident.noise[held[p]] = n
    opt._engine.tensors.clear()


# ------------------------------------------------------------- foreign gradients
class _Gone:
    """Weak references to a missing gradient point here: nowhere."""


GONE = weakref.ref(_Gone())
"""What the engine remembers of a gradient that is ``None``."""


class Foreign:
    """Gradients found on ``params`` before a closure ran, and whether the closure added to
    them: a hook on each parameter sees its gradient as the backward pass reaches it, before
    the new one is accumulated; a parameter the backward never reached is looked at after
    the closure.

    Args:
        params: parameters whose gradients were made outside the step.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.before = {p: p.grad for p in params}
        self.mixed = False
        self.seen: set[Tensor] = set()
        self.handles = [p.register_hook(partial(self._reached, p)) for p in params]

    def _reached(self, p: Tensor, grad: Tensor) -> None:
        if p not in self.seen:
            self.seen.add(p)
            self.mixed = self.mixed or not _cleared(p.grad, self.before[p])

    def added_to(self) -> bool:
        """Whether the closure added to (or left in place) a gradient made outside the step;
        removes the hooks."""
        for handle in self.handles:
            handle.remove()
        unseen = (p for p in self.before if p not in self.seen)
        return self.mixed or any(not _cleared(p.grad, self.before[p]) for p in unseen)


def _cleared(now: Tensor | None, before: Tensor | None) -> bool:
    """Whether the gradient ``before`` is gone: set to None, replaced, or zeroed."""
    return now is None or now is not before or not bool(local(now).any())
