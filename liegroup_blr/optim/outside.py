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
point estimate is the value, keeping what the group can of the spread (the optimizer's
:class:`~.writes.Writes`; :func:`unchanged` here).

**Gradients before a closure.** ``loss = closure(); optimizer.step(closure)`` (PyTorch's own
tests, L-BFGS-style code) leaves gradients at the point estimate before the step; a closure
that zeroes them first mixes nothing in. A closure that adds to them (Lightning's gradient
accumulation) would mix gradients at the point estimate into a sample's: refused.
:class:`Foreign` tells the two apart with a hook on each parameter, which sees its gradient
before the closure's backward adds to it.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import Tensor

from ..sharding import local

__all__ = ["GONE", "Foreign", "unchanged"]


def unchanged(value: Tensor, expected: Tensor) -> bool:
    """Whether a parameter's ``value`` is still the ``expected`` one the optimizer wrote, up to
    the rounding of a compiled kernel that computed it another way (2 ulps of the tensor's
    largest entry).

    Raises:
        RuntimeError: a non-finite value was written (it cannot be a posterior's location).
    """
    if torch.equal(value, expected):
        return True
    if not bool(value.isfinite().all()):
        raise RuntimeError(
            "params: a non-finite value was written into a parameter outside the optimizer; "
            "it cannot be the posterior's location"
        )
    tolerance = 2 * torch.finfo(value.dtype).eps * expected.abs().max()
    return bool((value - expected).abs().max() <= tolerance)


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

    def verdict(self) -> str:
        """What the closure did to the gradients made outside the step: ``"added to"`` (its
        backward added to one), ``"left"`` (one is still there, which its backward never
        reached: it computed none there) or ``""`` (it cleared them); removes the hooks."""
        for handle in self.handles:
            handle.remove()
        if self.mixed:
            return "added to"
        unseen = (p for p in self.before if p not in self.seen)
        return "left" if any(not _cleared(p.grad, self.before[p]) for p in unseen) else ""


def _cleared(now: Tensor | None, before: Tensor | None) -> bool:
    """Whether the gradient ``before`` is gone: set to None, replaced, or zeroed."""
    return now is None or now is not before or not bool(local(now).any())
