r"""The sampling engine every Lie-group rule shares.

One step of every rule is the same loop; only four pieces of arithmetic differ per rule::

    for s in 1..S:                      draw():       ξ_s ~ q0 (noise.NoiseSource), θ_s = g·ξ_s
        closure()                                     forward + backward at θ_s
        accumulate(sample, defer=True)                acc += ∇_X ℓ̄(θ_s(X))|_{X=0}
    propose  M' = β M + (1 − β) P(acc/S − (τ/N)∇_X H)   (in the accumulator, in place)
    if M' is finite:  commit  M ← M',  g ← g·exp(−α M'),  θ ← point estimate
    else:             skip (state unchanged, RuntimeWarning)

The first sample of a step is deferred: the next draw accumulates it or, in a one-sample
step, the proposal itself does, in the same pass over the tensors.

:class:`BLROptimizer` owns the loop, :meth:`~BLROptimizer.sampled_params`, the skip on
non-finite values, the state dict (with the noise generators), gradient unscaling for
``torch.amp.GradScaler`` and the all-reduce over processes. A rule subclass supplies
``_new_state`` (the initial element), ``_draw``, ``_accumulate``, ``_propose`` (given the
deferred sample, if any), ``_commit`` and ``_write_point``; each gathers tensor lists and calls
its module's kernel functions.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..groups import LieGroup
from ..noise import NoiseSource
from .amp import inverse_scale, record_finite, scaler_found_inf
from .checks import check_count
from .distributed import all_reduce_accumulators, broadcast_elements, shared_seed
from .kernels import Parts, Proposal, all_finite, loss_gradients
from .sample import Deferred, Sample
from .state import GroupStateOptimizer

__all__ = ["BLROptimizer"]

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
        seed: seed of the optimizer's own noise (drawn from torch's global RNG when ``None``,
            so ``torch.manual_seed`` makes runs reproducible).
        noise: ``"fresh"`` draws or ``"table"`` (:class:`~liegroup_blr.noise.NoiseTable`).
        antithetic: pair consecutive training samples ξ, 2c − ξ (bases symmetric about c).
        table_size: values in each noise table.
        compile: run the update kernels through ``torch.compile`` (lr enters as a tensor, so
            schedules do not recompile).
        process_group: a ``torch.distributed`` group: every process draws its own noise, the
            algebra-gradient accumulators and sample counts are summed before the update.
        grad_scaler: a ``torch.amp.GradScaler`` whose scaled backward passes the samples
            use: each sample's gradients are unscaled before they are accumulated, and each
            step's inf check is recorded for ``scaler.update()``.
        max_consecutive_skips: raise ``FloatingPointError`` after this many consecutive
            skipped steps (default: never; every skip warns).
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
        self.lie_group = group
        self.mc_samples = mc_samples
        self.point_estimate = point_estimate
        self.compile = bool(compile)
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        rank = 0 if process_group is None else dist.get_rank(process_group)
        self.noise_source = NoiseSource(
            noise,
            shared_seed(seed, process_group),
            rank=rank,
            antithetic=antithetic,
            table_size=table_size,
        )
        if max_consecutive_skips is not None:
            check_count("max_consecutive_skips", max_consecutive_skips)
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self._scratch: dict[Tensor, dict[str, Tensor]] = {}
        self._views: dict[Tensor, dict[int, tuple[Tensor, Parts]]] = {}
        self._pending: dict[Tensor, None] = {}  # parameters with accumulated samples
        self._deferred: dict[int, Deferred] = {}  # by id of the param group
        self._samples = 0
        self._sampling = False
        super().__init__(params, defaults)
        if process_group is not None:
            self._broadcast_state()

    # ------------------------------------------------------------ the rule's part
    def _draw(self, group: dict[str, Any], params: list[Tensor], xi: list[Tensor]) -> list[Tensor]:
        """``params ← readout(g·ξ)``; returns what the accumulation needs of the draw (ξ, or
        a quantity the rule derives from it in its scratch buffers ``"noise"``). ``xi`` may
        be read-only views of a noise table."""
        raise NotImplementedError

    def _accumulate(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        noise: list[Tensor],
        grads: list[Tensor],
        first: bool,
    ) -> None:
        """Add one sample's algebra gradient to the accumulators ``self._scratch[p]["acc"]``
        (``first``: overwrite them)."""
        raise NotImplementedError

    def _propose(
        self, group: dict[str, Any], params: list[Tensor], n: int, sample: Deferred | None
    ) -> Proposal | None:
        """Turn the accumulators (n samples), and the deferred ``sample`` (not yet in them,
        and then the only one: ``n = 1``), into the new momenta, in the accumulators; return
        what must be finite for the step to go on (``None``: reject the step)."""
        raise NotImplementedError

    def _commit(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Move the elements along the new momenta (``state["momentum"]``; the accumulators
        now hold the old momenta and are free) and write the point estimates, or swap in
        the elements the proposal already moved (:meth:`_spares`)."""
        raise NotImplementedError

    # --------------------------------------------------------- sample protocol
    @property
    def pending_samples(self) -> int:
        """Samples accumulated since the last update."""
        return self._samples

    @torch.no_grad()
    def draw(self, train: bool = True) -> Sample:
        """Write a posterior sample θ = readout(g·ξ) into every trained parameter.

        With ``train=True`` the sample is one of the next step's (antithetic pairing counts
        it); pass the result to :meth:`accumulate` once its gradients are known.
        """
        self._settle()  # the draw rewrites the noise buffers a deferred sample reads
        self.noise_source.start_sample(train)
        sampled: list[Tensor] = []
        noise: list[Tensor] = []
        for index, group in enumerate(self.param_groups):
            params = self._active(group)
            if not params:
                continue
            self._ensure_state(group, params)
            G = self._group_of(group)
            bufs = [self._buffer(p, "noise", G.base_shape(p.shape)) for p in params]
            xi = self.noise_source.sample(bufs, group["base"], params, index)
            noise += self._draw(group, params, xi)
            sampled += params
        return Sample(sampled, sampled, noise)

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
        self._settle()
        defer = defer and not self._pending  # only the first sample of a step waits
        grads = [p.grad for p in sample.params] if grads is None else grads
        at = {p: i for i, p in enumerate(sample.params)}
        inv_scale = inverse_scale(self.grad_scaler)
        for group in self.param_groups:
            idx = [at[p] for p in self._active(group) if p in at and grads[at[p]] is not None]
            if not idx:
                continue
            G = self._group_of(group)
            for first in (True, False):
                part = [i for i in idx if (sample.params[i] not in self._pending) == first]
                if not part:
                    continue
                params = [sample.params[i] for i in part]
                for p in params:
                    self._buffer(p, "acc", G.algebra_shape(p.shape))
                total = self._loss_gradients(
                    group,
                    params,
                    [grads[i] for i in part],  # type: ignore[misc]
                    [sample.theta[i] for i in part],
                    inv_scale,
                )
                noise = [sample.noise[i] for i in part]
                if defer:  # then every parameter is on its first sample
                    versions = [t._version for t in total]
                    self._deferred[id(group)] = Deferred(params, noise, total, versions)
                else:
                    self._accumulate(group, params, noise, total, first)
            self._pending.update(dict.fromkeys(sample.params[i] for i in idx))
        self._samples += 1

    def _settle(self) -> None:
        """Accumulate the deferred sample now (the first of its parameters)."""
        if not self._deferred:
            return
        for group in self.param_groups:
            sample = self._take_deferred(group)
            if sample is not None:
                self._accumulate(group, sample.params, sample.noise, sample.grads, True)

    def _take_deferred(self, group: dict[str, Any]) -> Deferred | None:
        """The deferred sample of ``group`` (removed from the pending ones), checked."""
        sample = self._deferred.pop(id(group), None)
        if sample is not None:
            try:
                sample.check()
            except RuntimeError:
                self.discard()
                raise
        return sample

    def _loss_gradients(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        theta: list[Tensor],
        inv_scale: float,
    ) -> list[Tensor]:
        r""":math:`\nabla\bar\ell_\delta = \nabla\bar\ell + \frac{\delta}{N}\theta` at the
        sample (the loss gradient unscaled by ``1/s`` of a GradScaler); ``p.grad`` itself
        when nothing is added, never written to."""
        decay = group["prior_precision"] / group["data_size"] if group["prior_precision"] else 0
        if not decay and inv_scale == 1.0:
            return grads
        out = [self._buffer(p, "grad", p.shape) for p in params]
        return loss_gradients(grads, theta, out, inv_scale, decay)

    def _forget(self) -> None:
        self._deferred.clear()
        self._pending.clear()
        self._samples = 0
        self.noise_source.end_step()

    @torch.no_grad()
    def discard(self) -> None:
        """Abandon the pending samples: nothing is accumulated, and the parameters hold the
        point estimates again."""
        self._forget()
        self.restore()

    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold one posterior sample θ = readout(g·ξ) in the parameters for the block.

        With ``train=True`` the gradients the block leaves in ``p.grad`` are accumulated as one
        Monte-Carlo sample of the next :meth:`step` (call ``zero_grad`` inside each block). On
        exit, also on error, the parameters return to the point estimate.
        """
        if self._sampling:
            raise RuntimeError("sampled_params blocks cannot be nested")
        self._sampling = True
        try:
            sample = self.draw(train)
            yield
            if train:
                self.accumulate(sample)
        finally:
            self._sampling = False
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
        if self._sampling:
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
        elif self._samples == 0:
            raise RuntimeError(
                "step() without a closure needs gradients from at least one "
                "`with optimizer.sampled_params(train=True):` block"
            )
        finite = loss is None or bool(torch.isfinite(torch.as_tensor(loss)).all())
        self._update(finite and not scaler_found_inf(self))
        return loss

    def _update(self, finite: bool) -> None:
        n = self._samples
        work = [(g, [p for p in self._active(g) if p in self._pending]) for g in self.param_groups]
        work = [(g, params) for g, params in work if params]
        if self.process_group is not None:
            self._settle()
            accumulators = [a for _, params in work for a in self._accumulators(params)]
            n, finite = all_reduce_accumulators(accumulators, n, finite, self.process_group)
        tensors: list[Tensor] = []
        sums: list[Tensor] = []
        for group, params in work if finite else []:
            proposal = self._propose(group, params, n, self._deferred_of(group, params))
            if proposal is None:
                finite = False
                break
            tensors += proposal.tensors
            sums += proposal.sums or [t.sum() for t in proposal.tensors]
        moved: set[Tensor] = set()
        if finite and all_finite(tensors, sums):
            for group, params in work:
                self._swap(params, "momentum", "acc")  # the old momenta become scratch
                self._commit(group, params)
                moved.update(params)
        elif work:
            self._skip()
        if moved:
            self._consecutive_skips = 0
        record_finite(self.grad_scaler, bool(moved) or not work)
        self._forget()
        for group in self.param_groups:  # the rest may still hold a sample
            rest = [p for p in self._active(group) if p not in moved and p in self.state]
            if rest:
                self._write_point(group, rest)

    def _deferred_of(self, group: dict[str, Any], params: list[Tensor]) -> Deferred | None:
        """The deferred sample of ``group`` if it covers exactly ``params`` (else it is
        accumulated, e.g. after a parameter was frozen between accumulate and step)."""
        sample = self._take_deferred(group)
        if sample is None or [id(p) for p in sample.params] == [id(p) for p in params]:
            return sample
        self._accumulate(group, sample.params, sample.noise, sample.grads, True)
        return None

    def _skip(self) -> None:
        """Count a skipped step; warn (unless a GradScaler is calibrating), and raise after
        ``max_consecutive_skips`` in a row."""
        self.skipped_steps += 1
        self._consecutive_skips += 1
        row = self._consecutive_skips
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            warnings.warn(
                f"{type(self).__name__}: non-finite loss, gradient or element; step skipped, "
                f"optimizer state unchanged ({row} in a row, {self.skipped_steps} in all)",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.max_consecutive_skips is not None and row >= self.max_consecutive_skips:
            raise FloatingPointError(
                f"{type(self).__name__}: {row} consecutive steps skipped for non-finite values "
                "(max_consecutive_skips): the run has diverged; lower the learning rate"
            )

    # ------------------------------------------------------------ distribution
    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Give every process rank 0's initial elements (and parameters)."""
        broadcast_elements([s["element"] for s in self.state.values()], self.process_group)
        self.restore()
