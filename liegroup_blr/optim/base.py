r"""The sampling engine every Lie-group rule shares.

One step of every rule is the same loop; only the arithmetic differs per rule::

    for s in 1..S:                      draw():       ξ_s ~ q0 (noise.NoiseSource), θ_s = g·ξ_s
        closure()                                     forward + backward at θ_s
        accumulate(sample, defer=True)                acc += ∇_X ℓ̄(θ_s(X))|_{X=0}
    propose  M' = β M + (1 − β) P(acc/S − (τ/N)∇_X H)   (in the accumulator)
    if M' is finite:  commit  M ← M',  g ← g·exp(−α M'),  θ ← point estimate
    else:             skip (state unchanged, RuntimeWarning)

The first sample of a step is deferred: the next draw accumulates it or, in a one-sample
step, the proposal itself does, in the same pass over the tensors.

:class:`BLROptimizer` owns the loop, :meth:`~BLROptimizer.sampled_params`, the skip on
non-finite values, gradient unscaling for ``torch.amp.GradScaler`` and the all-reduce over
processes. It gathers each param group's tensors once per step
(:class:`~.tensors.GroupTensors`) and hands them to the rule, whose class supplies
``_init_state``, ``_draw``, ``_accumulate``, ``_propose`` and ``_write_point``, each a call
of its module's functions with the param group's hyperparameters as keywords.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..groups import LieGroup
from ..noise import NoiseSource
from .amp import inverse_scale, record_finite, scaler_found_inf
from .checks import check_count
from .distributed import all_reduce_accumulators, broadcast_elements, shared_seed
from .options import EngineState
from .scratch import Scratch
from .state import GroupStateOptimizer
from .tensors import Deferred, GroupTensors, Proposal, Sample, SampleGrads

__all__ = ["BLROptimizer", "all_finite"]

_POINT_ESTIMATES = ("g", "mean")


class BLROptimizer(GroupStateOptimizer):
    r"""Base class of the Lie-group rules: the Monte-Carlo loop and everything rules share.

    Each trained parameter θ is the readout of :math:`g \cdot \xi`, :math:`\xi \sim q_0`, with
    its own group element g; outside :meth:`sampled_params` it holds the point estimate.

    Sample protocol (what :func:`~liegroup_blr.mc.mc_step` and custom loops use):
    :meth:`draw` writes a sample into the parameters and returns a :class:`Sample`;
    :meth:`accumulate` adds that sample's algebra gradient (from ``p.grad`` or given
    gradients) to the pending step, at once or, with ``defer=True``, when the next sample is
    drawn or accumulated or the step is taken; :meth:`restore` writes the point estimates back;
    :attr:`pending_samples` counts what :meth:`step` (without a closure) will average.

    Args:
        params: parameters or param groups.
        defaults: per-group hyperparameters (``lr``, ``momentum``, ``base``, ``data_size``,
            ``temperature``, ``prior_precision`` and the rule's own).
        group: the Lie group.
        mc_samples: S ≥ 1 samples per :meth:`step` with a closure.
        point_estimate: ``"g"`` (read at ξ₀ of the group) or ``"mean"`` (at E[ξ]).
        seed, noise, antithetic, table_size, compile, process_group, grad_scaler,
            max_consecutive_skips: the engine's options, :class:`~.options.EngineOptions`.
    """

    _step_supports_amp_scaling = True  # GradScaler.step calls step() itself: see amp.py
    lie_group: LieGroup

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        group: LieGroup,
        *,
        mc_samples: int = 1,
        point_estimate: str = "g",
        seed: int | None = None,
        noise: str = "fresh",
        antithetic: bool = False,
        table_size: int | None = None,
        compile: bool = False,
        process_group: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        max_consecutive_skips: int | None = None,
    ) -> None:
        if not isinstance(group, LieGroup):
            raise ValueError(f"group: expected a liegroup_blr.groups.LieGroup, got {group!r}")
        check_count("mc_samples", mc_samples)
        if point_estimate not in _POINT_ESTIMATES:
            raise ValueError(f"point_estimate: must be one of {_POINT_ESTIMATES}")
        if max_consecutive_skips is not None:
            check_count("max_consecutive_skips", max_consecutive_skips)
        self.lie_group = group
        self.mc_samples = mc_samples
        self.point_estimate = point_estimate
        self.compile = bool(compile)
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.max_consecutive_skips = max_consecutive_skips
        rank = 0 if process_group is None else dist.get_rank(process_group)
        self.noise_source = NoiseSource(
            noise,
            shared_seed(seed, process_group),
            rank=rank,
            antithetic=antithetic,
            table_size=table_size,
        )
        self._engine = EngineState()
        self._scratch = Scratch()
        super().__init__(params, defaults)
        if process_group is not None:
            broadcast_elements([s["element"] for s in self.state.values()], process_group)
            self.restore()

    # ------------------------------------------------------------ the rule's part
    def _draw(self, group: dict[str, Any], t: GroupTensors, xi: list[Tensor]) -> list[Tensor]:
        """``t.params ← readout(g·ξ)``; returns the sample's noise as the accumulation reads
        it (:attr:`Sample.noise`). ``xi`` may be read-only views of a noise table."""
        raise NotImplementedError

    def _accumulate(
        self,
        group: dict[str, Any],
        t: GroupTensors,
        noise: list[Tensor],
        grads: list[Tensor],
        first: bool,
    ) -> None:
        """Add one sample's algebra gradient to ``t.accs`` (``first``: overwrite them)."""
        raise NotImplementedError

    def _propose(
        self,
        group: dict[str, Any],
        t: GroupTensors,
        n: int,
        sample: SampleGrads | None,
    ) -> Proposal | None:
        """The update from the accumulators (n samples) and the deferred ``sample`` (its
        noise and gradients: not yet in them, and then the only one, ``n = 1``); ``None``
        rejects the step."""
        raise NotImplementedError

    # --------------------------------------------------------- sample protocol
    @property
    def pending_samples(self) -> int:
        """Samples accumulated since the last update."""
        return self._engine.samples

    @torch.no_grad()
    def draw(self, train: bool = True) -> Sample:
        """Write a posterior sample θ = readout(g·ξ) into every trained parameter.

        With ``train=True`` the sample is one of the next step's (antithetic pairing counts
        it); pass the result to :meth:`accumulate` once its gradients are known.
        """
        if self._engine.deferred:  # the draw rewrites the noise a deferred sample reads
            self._accumulate_deferred()
        self.noise_source.start_sample(train)
        params: list[Tensor] = []
        noise: list[Tensor] = []
        for index, group in enumerate(self.param_groups):
            t = self._tensors(index, group)
            if t is None:
                continue
            xi = self.noise_source.sample(t.noise, group["base"], t.params, index)
            noise += self._draw(group, t, xi)
            params += t.params
        return Sample(params, params, noise)

    @torch.no_grad()
    def accumulate(
        self, sample: Sample, grads: list[Tensor | None] | None = None, *, defer: bool = False
    ) -> None:
        """Add ``sample``'s algebra gradient to the pending step.

        Args:
            sample: from :meth:`draw` (or its :meth:`Sample.clone`).
            grads: ∇ℓ̄ at the sample per parameter of ``sample.params`` (default: each
                ``p.grad``); parameters with no gradient are left out of this sample.
            defer: keep references to the gradients and the sample's noise and read them
                later: at the next :meth:`draw` or :meth:`accumulate`, or, for the first
                sample of a step, in the update itself (a one-sample step then reads them
                once instead of writing and re-reading an accumulator). What
                :meth:`step` with a closure and :func:`~liegroup_blr.mc.mc_step` do. A
                gradient changed in place before it is read raises ``RuntimeError``.
        """
        engine = self._engine
        if engine.deferred:
            self._accumulate_deferred()
        defer = defer and not engine.pending  # only the first sample of a step waits
        grads = [p.grad for p in sample.params] if grads is None else grads
        at = {p: i for i, p in enumerate(sample.params)}
        inv_scale = 1.0 if self.grad_scaler is None else inverse_scale(self.grad_scaler)
        for index, group in enumerate(self.param_groups):
            t = self._tensors(index, group)
            if t is None:
                continue
            idx = [at.get(p, -1) for p in t.params]
            has = [i >= 0 and grads[i] is not None for i in idx]
            for first in (True, False):
                keep = [
                    h and (p not in engine.pending) == first
                    for h, p in zip(has, t.params, strict=True)
                ]
                if not any(keep):
                    continue
                part = t if all(keep) else t.subset(keep)
                rows = [i for i, k in zip(idx, keep, strict=True) if k]
                noise = [sample.noise[i] for i in rows]
                total = cast(list[Tensor], [grads[i] for i in rows])
                if group["prior_precision"] or inv_scale != 1.0:
                    theta = [sample.theta[i] for i in rows]
                    total = self._loss_gradients(group, part.params, total, theta, inv_scale)
                if defer:  # then every parameter is on its first sample
                    versions = [g._version for g in total]
                    engine.deferred[index] = Deferred(part, noise, total, versions)
                else:
                    self._accumulate(group, part, noise, total, first)
            engine.pending.update(dict.fromkeys(p for p, h in zip(t.params, has, strict=True) if h))
        engine.samples += 1

    def _accumulate_deferred(self) -> None:
        """Accumulate the deferred samples now (each the first of its parameters)."""
        for index, group in enumerate(self.param_groups):
            deferred = self._take_deferred(index)
            if deferred is not None:
                self._accumulate(group, deferred.tensors, deferred.noise, deferred.grads, True)

    def _take_deferred(self, index: int) -> Deferred | None:
        """Param group ``index``'s deferred sample, removed from the pending step; checked."""
        deferred = self._engine.deferred.pop(index, None)
        if deferred is not None and any(
            g._version != v for g, v in zip(deferred.grads, deferred.versions, strict=True)
        ):
            self.discard()
            raise RuntimeError(
                "accumulate(..., defer=True): a gradient was changed in place before the "
                "optimizer read it; the pending samples are discarded (change gradients "
                "before accumulating them, or accumulate without defer)"
            )
        return deferred

    def _loss_gradients(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        theta: list[Tensor],
        inv_scale: float,
    ) -> list[Tensor]:
        r""":math:`\nabla\bar\ell_\delta = s^{-1}\nabla\bar\ell + \frac{\delta}{N}\theta` at the
        sample (``inv_scale`` = 1/s of a GradScaler), in scratch buffers; ``grads`` are read,
        never written."""
        (out,) = self._scratch.take(params, grad=torch.Size)
        torch._foreach_copy_(out, grads)
        if inv_scale != 1.0:
            torch._foreach_mul_(out, inv_scale)
        if group["prior_precision"]:
            torch._foreach_add_(out, theta, alpha=group["prior_precision"] / group["data_size"])
        return out

    @torch.no_grad()
    def discard(self) -> None:
        """Abandon the pending samples: nothing is accumulated, and the parameters hold the
        point estimates again."""
        self._engine.end_step()
        self.noise_source.end_step()
        self.restore()

    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold one posterior sample θ = readout(g·ξ) in the parameters for the block.

        With ``train=True`` the gradients the block leaves in ``p.grad`` are accumulated as one
        Monte-Carlo sample of the next :meth:`step` (call ``zero_grad`` inside each block). On
        exit, also on error, the parameters return to the point estimate.
        """
        engine = self._engine
        if engine.sampling:
            raise RuntimeError("sampled_params blocks cannot be nested")
        engine.sampling = True
        try:
            sample = self.draw(train)
            yield
            if train:
                self.accumulate(sample)
        finally:
            engine.sampling = False
            if not engine.samples:
                engine.tensors.clear()  # parameters may be frozen before the next step
            self.restore()

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group element.

        Args:
            closure: zeroes the gradients, evaluates the loss ℓ̄, calls ``backward`` and
                returns the loss (or ``None``); called ``mc_samples`` times, each at a fresh
                sample θ. Without a closure, the samples accumulated by
                ``sampled_params(train=True)`` blocks (or :meth:`accumulate`) are used.

        Returns:
            the mean closure loss over samples (``None`` without a closure or when the
            closure returns ``None``).

        A non-finite loss or algebra gradient skips the update with a ``RuntimeWarning``:
        group elements and momenta are left exactly as they were (``skipped_steps`` counts).
        An exception in the closure abandons the step: nothing is accumulated and the
        parameters hold the point estimate again.
        """
        if self._engine.sampling:
            raise RuntimeError("step() cannot be called inside sampled_params()")
        loss = None
        if closure is not None:
            losses = []
            try:
                for _ in range(self.mc_samples):
                    sample = self.draw(train=True)
                    with torch.enable_grad():
                        value = closure()
                    self.accumulate(sample, defer=True)
                    losses.append(value.detach() if isinstance(value, Tensor) else value)
            except BaseException:
                self.discard()
                raise
            if all(v is not None for v in losses):
                loss = sum(losses) / len(losses)
        elif not self._engine.samples:
            raise RuntimeError(
                "step() without a closure needs gradients from at least one "
                "`with optimizer.sampled_params(train=True):` block"
            )
        finite = loss is None or bool(torch.isfinite(torch.as_tensor(loss)).all())
        self._update(finite and not scaler_found_inf(self))
        return loss

    def _update(self, finite: bool) -> None:
        """Propose every param group's update from the pending samples, check, and commit
        all of them or skip; the parameters then hold the point estimates."""
        engine = self._engine
        drawn = dict(engine.tensors)
        work: list[tuple[int, dict[str, Any], GroupTensors]] = []  # parameters with samples
        for index, t in drawn.items():
            keep = [p.requires_grad and p in engine.pending for p in t.params]
            if any(keep):
                work.append((index, self.param_groups[index], t if all(keep) else t.subset(keep)))
        n = engine.samples
        if self.process_group is not None:
            self._accumulate_deferred()
            accs = [a for _, _, t in work for a in t.accs]
            n, finite = all_reduce_accumulators(accs, n, finite, self.process_group)
        proposals: list[Proposal] = []
        for index, group, t in work if finite else []:
            deferred, sample = self._take_deferred(index), None
            if deferred is not None and (deferred.tensors is t or _same(deferred.tensors, t)):
                sample = deferred.noise, deferred.grads
            elif deferred is not None:  # e.g. a parameter frozen between accumulate and step
                self._accumulate(group, deferred.tensors, deferred.noise, deferred.grads, True)
            proposal = self._propose(group, t, n, sample)
            if proposal is None:
                break
            proposals.append(proposal)
        checked = [t for proposal in proposals for t in proposal.checked]
        sums = [s for pr in proposals for s in (pr.sums or [t.sum() for t in pr.checked])]
        moved = len(proposals) == len(work) and finite and all_finite(checked, sums)
        if moved:
            for (_, _, t), proposal in zip(work, proposals, strict=True):
                self._commit(t, proposal)
            engine.consecutive = 0
        elif work:
            self._skip()
        if self.grad_scaler is not None:
            record_finite(self.grad_scaler, moved or not work)
        engine.end_step()
        self.noise_source.end_step()
        done = [t for _, _, t in work] if moved else []
        if len(done) < len(drawn) or any(t is not drawn[index] for index, _, t in work):
            self._restore_unmoved(drawn, done)

    def _commit(self, t: GroupTensors, proposal: Proposal) -> None:
        """Take a checked proposal: the new momenta (in the accumulators) swap places with
        the old ones, then the elements move."""
        states = [self.state[p] for p in t.params]
        self._scratch.swap(states, t.params, "momentum", "acc")
        if proposal.commit is None:  # moved into the spares by the proposal
            self._scratch.swap(states, t.params, "element", "spare")
        else:
            proposal.commit()

    def _restore_unmoved(self, drawn: dict[int, GroupTensors], moved: list[GroupTensors]) -> None:
        """Write the point estimate into drawn parameters the step did not move."""
        done = {p for t in moved for p in t.params}
        for index, t in drawn.items():
            keep = [p not in done for p in t.params]
            if any(keep):
                rest = t.subset(keep)
                group = self.param_groups[index]
                self._write_point(group, rest.params, rest.elements, rest.mean)

    def _skip(self) -> None:
        """Count a skipped step; warn (unless a GradScaler is calibrating), and raise after
        ``max_consecutive_skips`` in a row."""
        engine = self._engine
        engine.skipped += 1
        engine.consecutive += 1
        row = engine.consecutive
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            warnings.warn(
                f"{type(self).__name__}: non-finite loss, gradient or element; step skipped, "
                f"optimizer state unchanged ({row} in a row, {engine.skipped} in all)",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.max_consecutive_skips is not None and row >= self.max_consecutive_skips:
            raise FloatingPointError(
                f"{type(self).__name__}: {row} consecutive steps skipped for non-finite values "
                "(max_consecutive_skips): the run has diverged; lower the learning rate"
            )


def _same(a: GroupTensors, b: GroupTensors) -> bool:
    """Whether ``a`` and ``b`` hold the same parameters."""
    return [id(p) for p in a.params] == [id(p) for p in b.params]


def all_finite(tensors: list[Tensor], sums: list[Tensor] | None = None) -> bool:
    """Whether every entry of every tensor is finite (one host sync, two when a sum is not).

    A finite sum has finite terms; a sum that is not finite (an infinite or NaN entry, or an
    overflow of finite ones) is settled by the extremes, exactly. ``sums``: the tensors'
    sums, if a kernel made them in its pass."""
    sums = [t.sum() for t in tensors] if sums is None else sums
    if not sums or bool(torch.stack(sums).isfinite().all()):
        return True
    extremes = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]
    return bool(torch.stack(extremes).isfinite().all())
