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
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..groups import LieGroup
from ..noise import NoiseSource
from ..posterior import Posterior
from .amp import inverse_scale, record_finite, scaler_step
from .checks import check_choice, check_count
from .distributed import (
    agree,
    all_reduce_accumulators,
    broadcast_elements,
    local,
    local_grad,
    refuse_averaged,
    replicas,
    shared_seed,
)
from .holding import SampleHolding
from .options import EngineState
from .outside import GONE, Foreign, mark_writes, take_writes
from .scratch import Scratch
from .tensors import Deferred, GroupTensors, Proposal, Sample, all_finite

__all__ = ["BLROptimizer"]

POINT_ESTIMATES = ("g", "mean")
"""Where the point estimate is read: at the group's reference point ξ₀, or at E[ξ]."""
BETWEEN_STEPS = ("point", "sample")
"""What the parameters hold between steps: the point estimate, or a fresh sample."""


class BLROptimizer(SampleHolding):
    r"""Base class of the Lie-group rules: the Monte-Carlo loop and everything rules share.

    Each trained parameter θ is the readout of :math:`g \cdot \xi`, :math:`\xi \sim q_0`, with
    its own group element g; outside :meth:`sampled_params` it holds the point estimate (or,
    ``between_steps="sample"``, a sample). The sample protocol (:meth:`draw`,
    :meth:`accumulate`, :meth:`restore`, :attr:`pending_samples`) is what
    :func:`~liegroup_blr.mc.mc_step` and custom loops use. The keyword-only arguments after
    ``point_estimate`` are the engine's options, :class:`~liegroup_blr.optim.EngineOptions`.

    Args:
        params: parameters or param groups.
        defaults: per-group hyperparameters (``lr``, ``momentum``, ``base``, ``data_size``,
            ``temperature``, ``prior_precision`` and the rule's own).
        group: the Lie group.
        mc_samples: S ≥ 1 samples per :meth:`step` with a closure.
        point_estimate: ``"g"`` (read at ξ₀ of the group) or ``"mean"`` (at E[ξ]).
    """

    _step_supports_amp_scaling = True  # GradScaler.step(opt) drives step(): see amp.py
    draws_in_update: tuple[str, ...] = ()  # noise sources with which the compiled update
    # draws the next sample (``draw``): where that saves passes over the state
    lie_group: LieGroup

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        group: LieGroup,
        *,
        mc_samples: int = 1,
        point_estimate: str = "g",
        between_steps: str = "point",
        seed: int | None = None,
        noise: str = "fresh",
        antithetic: bool = False,
        table_size: int | None = None,
        compile: bool = False,
        process_group: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        max_consecutive_skips: int | None = None,
        prior: Posterior | None = None,
    ) -> None:
        if not isinstance(group, LieGroup):
            raise ValueError(f"group: expected a liegroup_blr.groups.LieGroup, got {group!r}")
        check_count("mc_samples", mc_samples)
        check_choice("point_estimate", point_estimate, POINT_ESTIMATES)
        check_choice("between_steps", between_steps, BETWEEN_STEPS)
        if max_consecutive_skips is not None:
            check_count("max_consecutive_skips", max_consecutive_skips)
        self.lie_group = group
        self.mc_samples = mc_samples
        self.point_convention = point_estimate
        self.between_steps = between_steps
        self.compile = bool(compile)
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.max_consecutive_skips = max_consecutive_skips
        rank = 0 if process_group is None else dist.get_rank(process_group)
        replicated = replicas(process_group)
        self.noise_source = NoiseSource(
            noise,
            shared_seed(seed, process_group, replicated),
            rank=rank,
            antithetic=antithetic,
            table_size=table_size,
        )
        self._engine = EngineState()
        self._scratch = Scratch()
        super().__init__(params, defaults)
        if process_group is not None or replicated is not None:
            broadcast_elements(self.state, process_group if replicated is None else replicated)
            self._restore()
        self._fresh_gradients()  # gradients from before construction are nobody's sample
        if prior is not None:
            self.set_prior(prior)
        if between_steps == "sample":
            self._draw_resident()
        mark_writes(self)

    # --------------------------------------------------------- sample protocol
    @torch.no_grad()
    def draw(self, train: bool = True) -> Sample:
        """Write a posterior sample θ = readout(g·ξ) into every trained parameter.

        With ``train=True`` the sample is one of the next step's (antithetic pairing counts
        it); pass the result to :meth:`accumulate` once its gradients are known. Drawn for
        prediction (``train=False``), ξ comes from the optimizer's prediction generators.
        """
        take_writes(self)
        sample = self._draw_sample(train)
        mark_writes(self)
        return sample

    @torch.no_grad()
    def _draw_sample(self, train: bool) -> Sample:
        """:meth:`draw`, inside the optimizer's own calls."""
        if self._engine.deferred:  # the draw rewrites the noise a deferred sample reads
            self._accumulate_deferred()
        self.noise_source.start_sample(train)
        keys: list[Tensor] = []
        params: list[Tensor] = []
        noise: list[Tensor] = []
        for index, group in enumerate(self.param_groups):
            t = self._tensors(index, group)
            if t is None:
                continue
            xi = self.noise_source.sample(t.noise, group["base"], t.keys, index)
            noise += self._draw(group, t, xi)
            keys += t.keys
            params += t.params
        return Sample(keys, params, noise)

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
                later: at the next :meth:`draw` or :meth:`accumulate`, or in the update
                itself (a one-sample step then reads them once instead of writing and
                re-reading an accumulator, and a ``GradScaler.step`` that drives the update
                unscales them). What :meth:`step` with a closure, ``sampled_params(train=True)``
                and :func:`~liegroup_blr.mc.mc_step` do. A gradient changed in place before
                it is read raises ``RuntimeError``.
        """
        self._accumulate_sample(sample, grads, defer)
        self._fresh_gradients()  # the engine has seen them: not made outside a step

    def _accumulate_sample(
        self, sample: Sample, grads: list[Tensor | None] | None, defer: bool
    ) -> None:
        engine = self._engine
        if engine.deferred:
            self._accumulate_deferred()
        grads = [p.grad for p in sample.params] if grads is None else grads
        if self._mesh_param is not None:  # sharded parameters' gradients: their local shards
            pairs = zip(grads, sample.params, strict=True)
            grads = [None if g is None else local_grad(g, p) for g, p in pairs]
        at = {p: i for i, p in enumerate(sample.params)}
        for index, group in enumerate(self.param_groups):
            t = engine.tensors.get(index) or self._tensors(index, group)  # gathered by the draw
            if t is None:
                continue
            idx = [at.get(p, -1) for p in t.keys]
            has = [i >= 0 and grads[i] is not None for i in idx]
            for first in (True, False):
                keep = [
                    h and (p not in engine.pending) == first
                    for h, p in zip(has, t.keys, strict=True)
                ]
                if not any(keep):
                    continue
                part = t if all(keep) else t.subset(keep)
                rows = [i for i, k in zip(idx, keep, strict=True) if k]
                raw = cast(list[Tensor], [grads[i] for i in rows])
                decay, rate = None, group.get("weight_decay", 0.0)
                if group["prior_precision"]:
                    rate += group["prior_precision"] / group["data_size"]
                if rate:  # (δ/N)θ while θ is the sample's
                    (decay,) = self._scratch.take(part.params, grad=torch.Size)
                    torch._foreach_copy_(decay, [sample.theta[i] for i in rows])
                    torch._foreach_mul_(decay, rate)
                deferred = Deferred(part, [sample.noise[i] for i in rows], raw, decay, first)
                if defer:
                    deferred.versions = [g._version for g in raw]
                    engine.deferred[index] = deferred
                else:
                    total = deferred.gradients(inverse_scale(self), self._scratch)
                    self._accumulate(group, part, deferred.noise, total, first)
            engine.pending.update(dict.fromkeys(p for p, h in zip(t.keys, has, strict=True) if h))
        engine.samples += 1

    def _take_deferred(self, index: int) -> Deferred | None:
        """Param group ``index``'s deferred sample, removed from the pending step; checked."""
        deferred = self._engine.deferred.pop(index, None)
        if deferred is not None and any(
            g._version != v for g, v in zip(deferred.raw, deferred.versions, strict=True)
        ):
            self.discard()
            raise RuntimeError(
                "a gradient was changed in place before the optimizer read it (accumulate("
                "defer=True), a sampled_params(train=True) block); the pending samples are "
                "discarded: change gradients inside the block, or use between_steps='sample', "
                "whose step() reads p.grad as it finds it"
            )
        return deferred

    def _fresh_gradients(self) -> list[Tensor]:
        """The trained parameters whose gradients were made or changed since the engine last
        looked, remembered now: by a weak reference (a new tensor where a freed one was is
        not taken for it) and the version counter (every in-place change bumps it). A
        parameter the engine never looked at (added later, or in a copy) is only
        remembered."""
        marks, fresh = self._engine.marks, []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                version = -1 if g is None else g._version
                mark = marks.get(p)
                if not p.requires_grad or (mark and mark[0]() is g and mark[1] == version):
                    continue
                marks[p] = (GONE if g is None else weakref.ref(g), version)  # type: ignore[assignment]
                if g is not None and mark is not None:
                    fresh.append(p)
        return fresh

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group element.

        Args:
            closure: zeroes the gradients, evaluates the loss ℓ̄, calls ``backward`` and
                returns the loss (or ``None``); called ``mc_samples`` times, each at a fresh
                sample θ (with ``between_steps="sample"`` the first is the sample the
                parameters hold). Without a closure: the samples of
                ``sampled_params(train=True)`` blocks (or :meth:`accumulate`), or, with
                ``between_steps="sample"``, ``p.grad`` as the gradient at the parameters'
                sample.

        Returns:
            the closure's value, as it returned it (with ``mc_samples > 1``: the mean of its
            values at the samples taken; ``None`` without a closure).

        A non-finite loss or algebra gradient skips the update with a ``RuntimeWarning``:
        group elements and momenta are left exactly as they were (``skipped_steps`` counts).
        An exception in the closure abandons the step: nothing is accumulated and the
        parameters hold the point estimate again (a fresh sample in sample mode). Driven
        by ``GradScaler.step(optimizer)``, a step whose gradients hold an inf is skipped
        (the scaler backs off) and the loss scale is taken off the gradients.
        """
        engine = self._engine
        if engine.holding:
            raise RuntimeError(f"step() cannot be called inside {engine.holding}()")
        take_writes(self)
        if self.grad_scaler is None and not {"grad_scale", "found_inf"} & vars(self).keys():
            inv_scale, found_inf = 1.0, False  # no GradScaler anywhere
        else:
            inv_scale, found_inf = scaler_step(self, closure)
        loss = None
        if closure is not None:
            loss = self._closure_samples(closure)
        elif self.between_steps == "sample" and not engine.samples:
            self._read_resident()
        elif not engine.samples:
            raise RuntimeError(
                "step() without a closure needs gradients from at least one "
                "`with optimizer.sampled_params(train=True):` block; to step on p.grad as "
                "torch.optim does (Hugging Face Trainer, accelerate, gradient accumulation), "
                "construct the optimizer with between_steps='sample'"
            )
        finite = not isinstance(loss, (Tensor, float)) or bool(
            torch.as_tensor(loss).isfinite().all()
        )
        self._update(finite and not found_inf, inv_scale)
        mark_writes(self)
        return loss

    def _closure_samples(self, closure: Callable[[], Any]) -> Any:
        """Call ``closure`` at ``mc_samples`` samples and accumulate each; its value (one
        sample) or the mean of its values at the samples taken."""
        engine = self._engine
        fresh = self._fresh_gradients()
        made_outside = bool(fresh) and bool(
            torch.stack([local(p.grad).ne(0).any() for p in fresh]).any()  # type: ignore[arg-type]
        )
        foreign = None  # gradients found before the closure that it must clear
        if made_outside and not self._outside_allowed():
            foreign, made_outside = Foreign(fresh), False
        values, losses = [], []
        try:
            for s in range(self.mc_samples):
                rng = self.noise_source.state_dict() if engine.samples else None
                sample = engine.resident if s == 0 and engine.resident else self._draw_sample(True)
                with torch.enable_grad():
                    values.append(closure())
                if foreign is not None:
                    added, foreign = foreign.added_to(), None
                    if added:
                        self._refuse_outside_gradients()
                if self._fresh_gradients() or (s == 0 and made_outside):
                    self._accumulate_sample(sample, None, defer=True)
                    value = values[-1]
                    losses.append(value.detach() if isinstance(value, Tensor) else value)
                elif rng is not None:  # a closure that made no gradient takes no sample (a
                    self.noise_source.load_state_dict(rng)  # do-nothing one after blocks)
        except BaseException:
            if foreign is not None:
                foreign.added_to()  # its hooks removed
            self.discard()
            raise
        if self.mc_samples == 1:
            return values[0]
        return sum(losses) / len(losses) if losses and None not in losses else None

    def _update(self, finite: bool, inv_scale: float) -> None:
        """Propose every param group's update from the pending samples, check, and commit
        all of them or skip; then the parameters hold the point estimates (or, with
        ``between_steps="sample"``, the next sample)."""
        engine = self._engine
        work: list[tuple[int, dict[str, Any], GroupTensors]] = []  # parameters with samples
        for index, t in engine.tensors.items():
            keep = [p.requires_grad and p in engine.pending for p in t.keys]
            if any(keep):
                work.append((index, self.param_groups[index], t if all(keep) else t.subset(keep)))
        if not work and engine.tensors and not engine.warned:
            engine.warned = True
            warnings.warn(
                f"{type(self).__name__}.step(): no trained parameter has a gradient, so the "
                "step changed nothing (does the closure call loss.backward()?)",
                UserWarning,
                stacklevel=5,
            )
        n = engine.samples
        if self.process_group is not None:
            if not engine.unaveraged:  # a DDP-wrapped model: refused
                engine.unaveraged = refuse_averaged(engine.deferred, self.process_group)
            self._accumulate_deferred()
            accs = [a for _, _, t in work for a in t.accs]
            n, finite = all_reduce_accumulators(accs, n, finite, self.process_group)
        drawn = dict(engine.tensors)
        fused = self.compile and self.noise_source.kind in self.draws_in_update
        fused = started = (
            fused and self.between_steps == "sample" and n == 1 and len(work) == len(drawn)
        )
        if started:
            self._start_next_sample()
        proposals: list[Proposal] = []
        for index, group, t in work if finite else []:
            deferred, sample = self._take_deferred(index), None
            if deferred is not None:  # the gradients as the step sees them
                grads = deferred.raw
                if deferred.decay is not None or inv_scale != 1.0:
                    grads = deferred.gradients(inv_scale, self._scratch)
                if deferred.first and (deferred.tensors is t or deferred.tensors.holds(t)):
                    sample = deferred.noise, grads  # the step's one sample
                else:  # e.g. a parameter frozen between accumulate and step
                    self._accumulate(group, deferred.tensors, deferred.noise, grads, deferred.first)
            prior = None if engine.prior is None else engine.prior.gradients(self, group, t)
            fused = fused and sample is not None and t is drawn[index]
            if fused:
                self._next_noise(index, group, t, sample[0])  # type: ignore[index]
            proposal = self._propose(group, t, n, sample, prior, fused)
            if proposal is None:
                break
            proposals.append(proposal)
        checked = [t for proposal in proposals for t in proposal.checked]
        sums = [s for pr in proposals for s in (pr.sums or [t.sum() for t in pr.checked])]
        moved = len(proposals) == len(work) and finite and all_finite(checked, sums)
        if self._mesh_param is not None:  # the shards' ranks take or skip the step together
            moved = agree(moved, self._mesh_param)
        if moved:
            for (_, _, t), proposal in zip(work, proposals, strict=True):
                states = [self.state[p] for p in t.keys]  # the new momenta take the old
                self._scratch.swap(states, t.params, "momentum", "acc")  # ones' place
                if proposal.commit is None:  # moved into the spares by the proposal
                    self._scratch.swap(states, t.params, "element", "spare")
                else:
                    proposal.commit()
            engine.consecutive = 0
        elif work:  # a skip a GradScaler calibrating its scale expects is not warned of
            expected = "found_inf" in vars(self) or bool(
                self.grad_scaler and self.grad_scaler.is_enabled()
            )
            engine.skip(type(self).__name__, expected, self.max_consecutive_skips)
        if self.grad_scaler is not None:
            record_finite(self.grad_scaler, moved or not work)
        engine.end_step()
        if self.between_steps == "sample":
            self._hold_next_sample(drawn, started, fused and moved)
            return
        self.noise_source.end_step()
        if len(work) < len(drawn) or not moved or any(t is not drawn[i] for i, _, t in work):
            self._restore_unmoved(drawn, [t for _, _, t in work] if moved else [])
