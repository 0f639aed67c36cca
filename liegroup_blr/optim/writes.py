"""Writes to the parameters made outside the optimizer, adopted as the posterior's location
(the rules of :mod:`~liegroup_blr.optim.outside`): one component, :class:`Writes`, and the
decorator :func:`adopts_writes` that wraps the optimizer's public methods with it.

Before each public call the optimizer :meth:`~Writes.take`\\ s what changed since its last
one; after it, it :meth:`~Writes.mark`\\ s every trained parameter's version counter and
storage.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from .._userline import warn
from ..sharding import local
from .engine import Engine
from .outside import unchanged
from .scratch import state_dtype

__all__ = ["Writes", "adopts_writes"]

Method = TypeVar("Method", bound=Callable[..., Any])


def adopts_writes(take: bool = True) -> Callable[[Method], Method]:
    """Wrap a public method of the optimizer (its ``_writes``, a :class:`Writes`): first adopt
    what was written into the parameters since the optimizer's last call (``take``; outside
    its blocks, ``_block``), and on the way out, also on error, remember what they hold. A
    generator method (a block) takes on entry and marks on exit."""

    def wrap(method: Method) -> Method:
        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def block(self: Any, *args: Any, **kwargs: Any) -> Any:
                if take and not self._block.name:
                    self._writes.take()
                try:
                    return (yield from method(self, *args, **kwargs))
                finally:
                    self._writes.mark()

            return cast(Method, block)

        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if take and not self._block.name:
                self._writes.take()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._writes.mark()

        return cast(Method, call)

    return wrap


class Writes:
    """The writes made into an engine's trained parameters outside the optimizer.

    Attributes:
        written: each trained parameter's version counter and storage pointer as the
            optimizer last left them (of a sharded parameter: the DTensor's version, its
            local shard's storage).
        step: the engine's step state, read to tell whether a step is under way (the
            parameters then hold its sample: nothing is taken).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.step = engine.status
        self.written: dict[Tensor, tuple[int, int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """A copy forgets the writes it saw (a copy's parameters are other tensors)."""
        return {**self.__dict__, "written": {}}

    def take(self) -> None:
        """Adopt what was written into the trained parameters since the optimizer's last call.
        Between steps only, where the parameters hold what the optimizer last wrote: one
        comparison of version and storage per parameter, no pass over values."""
        engine, written = self.engine, self.written
        if self.step.samples or self.step.tensors:  # the parameters hold a step's sample
            return
        sharded = engine.sharded
        changed = [
            p
            for group in engine.optimizer.param_groups
            for p in group["params"]
            if p in written and written[p] != (p._version, (local(p) if sharded else p).data_ptr())
        ]
        if changed:
            self.adopt(set(changed))
            self.mark()

    def mark(self) -> None:
        """Remember each trained parameter's version counter and storage, as the optimizer
        left them."""
        engine = self.engine
        sharded = engine.sharded
        self.written = {
            p: (p._version, (local(p) if sharded else p).data_ptr())
            for group in engine.optimizer.param_groups
            for p in group["params"]
            if p.requires_grad
        }

    @torch.no_grad()
    def adopt(self, written: set[Tensor]) -> None:
        """Adopt the values of the parameters ``written`` (their version or storage moved) as
        the posterior's location, with one warning; values equal to what the optimizer wrote
        are left alone.

        Raises:
            RuntimeError: a parameter's dtype, device or shape changed (``module.to``,
                ``p.data = ...``), a non-finite value was written, or the group has no
                ``with_point``: each in one line naming the fix.
        """
        engine = self.engine
        resident, state, rule = engine.resident, engine.optimizer.state, engine.rule
        held = {} if resident is None else {p: i for i, p in enumerate(resident.params)}
        adopted, sampled = 0, {}
        for index, group in enumerate(engine.optimizer.param_groups):
            keys = [p for p in group["params"] if p in written and "element" in state.get(p, {})]
            moved = [p for p in keys if not unchanged(local(p), self.expected(group, p, held))]
            mean = engine.point_mean(group)
            for p in moved:
                element, value = state[p]["element"], local(p)
                xi0 = engine.reference(group, value, mean)
                element.copy_(self.with_point(group, element, value.to(element.dtype), xi0))
            at_point = [p for p in moved if p not in held]
            if at_point:
                elements = [state[p]["element"] for p in at_point]
                rule.write_point(group, [local(p) for p in at_point], elements, mean)
            if len(at_point) < len(moved):
                sampled.update(self.hold_at_point(index, group, set(moved) - set(at_point)))
            adopted += len(moved)
        if resident is not None:  # the held parameters' noise: their points' (ξ₀)
            for p, noise in sampled.items():
                resident.noise[held[p]] = noise
        if adopted:
            where = "; the parameters hold it as their training sample until the next step"
            warn(
                f"{engine.name}: {adopted} parameter(s) were written outside the "
                "optimizer (load_state_dict, a restored checkpoint or average, a weight "
                "constraint): the values are adopted as the posterior's location, its point "
                f"estimate{where if sampled else ''}",
            )

    def with_point(self, group: dict[str, Any], g: Tensor, theta: Tensor, xi0: Tensor) -> Tensor:
        """The rule's element with point estimate ``theta``; a group without
        ``with_point`` refused."""
        try:
            return self.engine.rule.with_point(group, g, theta, xi0)
        except NotImplementedError:
            G = self.engine.rule.group_of(group)
            raise RuntimeError(
                f"params: a parameter of {self.engine.name} was written outside the "
                f"optimizer, and {type(G).__name__} has no with_point(g, theta) to adopt the "
                "value as the posterior's location: set the element with "
                "optimizer.set_group_element(p, element), or define with_point"
            ) from None

    def expected(self, group: dict[str, Any], p: Tensor, held: dict[Tensor, int]) -> Tensor:
        """What the optimizer last wrote into ``p``: its training sample (``held``: index in
        the resident sample) or its point estimate. Refuses a parameter whose dtype, device
        or shape changed since."""
        engine = self.engine
        value, element = local(p), engine.optimizer.state[p]["element"]
        G = engine.rule.group_of(group)
        if (
            state_dtype(value) != element.dtype
            or value.device != element.device
            or G.element_shape(value.shape) != element.shape
        ):
            raise RuntimeError(
                f"params: a parameter of {engine.name} changed to {value.dtype}, "
                f"{value.device}, shape {tuple(value.shape)} after the optimizer was built "
                "(module.to(...), p.data = ...): build the optimizer after moving or converting "
                "the model"
            )
        if p in held:
            resident = engine.resident
            assert resident is not None
            expected = engine.rule.sample_value(group, element, resident.noise[held[p]])
        else:
            expected = G.point(element, engine.point_mean(group), p.shape)
        return expected.to(value.dtype)

    def hold_at_point(
        self, index: int, group: dict[str, Any], keys: set[Tensor]
    ) -> dict[Tensor, Tensor]:
        """In sample mode: the parameters ``keys`` hold their new point estimate as the
        training sample at ξ₀, so a gradient taken at the written value is that sample's;
        returns each one's noise for the resident sample."""
        engine = self.engine
        t = engine.tensors(index, group)
        assert t is not None
        t = t.subset([p in keys for p in t.keys])
        mean = engine.point_mean(group)
        noise = engine.rule.draw(group, t, [engine.reference(group, p, mean) for p in t.params])
        engine.forget_tensors()
        return dict(zip(t.keys, noise, strict=True))
