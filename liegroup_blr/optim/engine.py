r"""The Monte-Carlo loop every rule shares.

One step of every rule is the same loop; only the arithmetic differs per rule::

    for s in 1..S:                      draw():       ξ_s ~ q0 (noise.NoiseSource), θ_s = g·ξ_s
        closure()                                     forward + backward at θ_s
        accumulate(sample, defer=True)                acc += ∇_X ℓ̄(θ_s(X))|_{X=0}
    propose  M' = β M + (1 − β) P(acc/S + c)            (in the accumulator)
    if M' is finite:  commit  M ← M',  g ← g·exp(−α M'),  θ ← what the parameters hold
    else:             skip (state unchanged; the first skip warns, max_consecutive_skips in a
                            row raise FloatingPointError)

with c the part of the algebra gradient that is not the loss's — the entropy's −(τ/N)∇log|det J|
or a prior's (τ/N)∇KL — which the engine computes once per param group and hands to the rule;
the prior N(0, 1/δ) and a param group's ``weight_decay`` enter each sample's gradient as
(δ/N + weight_decay)θ. The first sample of a step is deferred: the next draw accumulates it
or, in a one-sample step, the proposal itself does, in the same pass over the tensors.

:class:`Engine` runs it from its parts: the rule (:class:`~.rule.Rule`), the noise source
(:mod:`liegroup_blr.noise`), what the parameters hold between steps
(:mod:`~liegroup_blr.optim.holding`), the scratch buffers (:class:`~.scratch.Scratch`), the
sharded parameters (:class:`~liegroup_blr.sharding.Shards`) and its state
(:class:`~.options.EngineState`). Of the optimizer it reads only what torch's interface holds:
``param_groups``, ``state``, and the ``grad_scale`` a ``GradScaler.step`` sets on it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from .._userline import warn
from ..fisher import entropy_gradient
from ..groups import LieGroup
from ..noise import NoiseSource
from ..sharding import Shards, local
from .amp import Scaled, expected_skip, inverse_scale, record_finite
from .distributed import all_reduce_accumulators, refuse_averaged
from .holding import Draws, Holding, holding
from .options import EngineState
from .outside import GONE, Foreign
from .prior import Prior
from .rule import Rule
from .scratch import Scratch, state_dtype
from .skips import non_finite, skip_fix
from .tensors import Deferred, GroupTensors, Proposal, Sample, Work

__all__ = ["ENGINE_KEYS", "Engine", "all_finite"]

ENGINE_KEYS = (
    "rng",
    "predict_rng",
    "seed",
    "skipped_steps",
    "prior",
    "prior_strength",
    "prior_centre",
)
"""What an optimizer's state dict holds of the engine (:meth:`Engine.state_dict`)."""


class Stepped(Scaled, Protocol):
    """What the engine reads of its optimizer: torch's interface (and what :mod:`~.amp` reads,
    :class:`~.amp.Scaled`)."""

    param_groups: list[dict[str, Any]]
    state: Any


class Engine:
    """The Monte-Carlo loop of one optimizer: draws, accumulation, the update.

    Args:
        optimizer: the optimizer whose ``param_groups`` and ``state`` it steps.
        rule: the rule's arithmetic.
        noise: the noise source.
        between_steps: what the parameters hold between steps (``"point"`` or
            ``"sample"``: the holding, ``liegroup_blr.optim.holding``).
        mc_samples: S samples per step with a closure.
        point_at: ``"g"`` or ``"mean"`` (where the point estimate is read).
        compile: whether updates run compiled.
        process_group: summed accumulators over these processes, if given.
        grad_scaler: a ``torch.amp.GradScaler`` whose scale the samples carry, if given.
        max_consecutive_skips: raise after this many skipped steps in a row (``None``: never).
    """

    def __init__(
        self,
        optimizer: Stepped,
        rule: Rule,
        noise: NoiseSource,
        between_steps: str,
        *,
        mc_samples: int,
        point_at: str,
        compile: bool,
        process_group: Any,
        grad_scaler: torch.amp.GradScaler | None,
        max_consecutive_skips: int | None,
    ) -> None:
        self.optimizer = optimizer
        self.name = type(optimizer).__name__
        self.rule = rule
        self.noise = noise
        self.mc_samples = mc_samples
        self.point_at = point_at
        self.compile = compile
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.scratch = Scratch()
        self.status = EngineState()
        self.shards = Shards()
        self.sharded = False
        """Whether the parameters are sharded (DTensors)."""
        self.entropies: dict[tuple[Any, ...], Tensor] = {}  # ∇log|det J| at the identity
        draw = partial(self.draw, True, forget=True)
        draws = Draws(noise, draw, self.write_points, self.restore_unmoved)
        self.holding: Holding = holding(between_steps, draws)

    def __getstate__(self) -> dict[str, Any]:
        """A copy runs on no process group (as torch.optim leaves hooks out, it leaves the
        group out)."""
        return {**self.__dict__, "process_group": None}

    # --------------------------------------------------- what the interface asks
    def start(self) -> None:
        """Start between steps: gradients made before are nobody's, and the parameters hold
        what the holding holds."""
        self.fresh_gradients()
        self.holding.between_steps()

    @property
    def pending(self) -> int:
        """Samples accumulated since the last update."""
        return self.status.samples

    @property
    def skipped(self) -> int:
        """Updates skipped for non-finite values, in all."""
        return self.status.skipped

    @property
    def holds_samples(self) -> bool:
        """Whether the parameters hold a training sample between steps."""
        return self.holding.holds_samples

    @property
    def resident(self) -> Sample | None:
        """The training sample the parameters hold between steps, if any."""
        return self.holding.resident

    def admit(self, p: Tensor, G: LieGroup) -> None:
        """Admit parameter ``p`` of Lie group ``G`` (a DTensor's mesh and placements checked:
        :meth:`~liegroup_blr.sharding.Shards.admit`)."""
        self.shards.admit(p, G, self.process_group)
        self.sharded = self.shards.mesh_param is not None

    def placed(self, value: Any, p: Tensor) -> Any:
        """``value`` (a tensor or a dict of them) placed as parameter ``p`` is sharded."""
        return self.shards.placed(value, p)

    def local_like(self, element: Tensor, like: Tensor, p: Tensor) -> Tensor:
        """``element`` given for parameter ``p`` as the local tensor its state ``like`` is."""
        return self.shards.local_like(element, like, p)

    def join(self, group: dict[str, Any]) -> None:
        """A new param group: the state of its trained parameters made (they hold the point
        estimate), and with a resident sample a fresh one that holds them too."""
        self.forget_tensors()
        trained = [p for p in group["params"] if p.requires_grad]
        if trained:
            self.init_states(group, trained)
        if self.holding.resident is not None:
            self.holding.between_steps()

    def accumulate(self, sample: Sample, grads: list[Tensor | None] | None, defer: bool) -> None:
        """:meth:`accumulate_sample`, its gradients then seen (not made outside a step)."""
        self.accumulate_sample(sample, grads, defer)
        self.fresh_gradients()

    @contextmanager
    def sampled(self, train: bool) -> Iterator[None]:
        """Hold one posterior sample for the block (``train``: a training sample whose
        gradients the block leaves are accumulated, deferred, on exit); then what the
        parameters held before (the resident sample, or the point estimates)."""
        if train:
            self.holding.check_training_block()
        try:
            with self.holding.keeping():
                sample = self.draw(train)
                yield
                if train:
                    self.accumulate(sample, None, defer=True)
        finally:
            if not self.status.samples:
                self.forget_tensors()  # parameters may be frozen before the next step
            if self.holding.resident is None:
                self.write_points()

    def restore(self, frozen: bool) -> None:
        """The point estimates into the trained parameters (``frozen``: also those frozen
        since); they then hold no training sample."""
        self.write_points(frozen)
        self.holding.forget()

    def set_prior(self, prior: Prior | None, centre: dict[Tensor, Tensor]) -> None:
        """The prior that replaces N(0, 1/δ) and the entropy term (``None``: none), and each
        parameter's centre c of the δ-prior N(c, 1/δ) where it is not 0."""
        self.status.prior, self.status.centre = prior, centre

    def nbytes(self) -> dict[str, int]:
        """Bytes of the scratch buffers (``"scratch"``) and the noise (``"noise"``)."""
        return {"scratch": self.scratch.nbytes, "noise": self.noise.nbytes}

    # ------------------------------------------------------------- state dicts
    def state_dict(self, params: list[Tensor]) -> dict[str, Any]:
        """The engine's part of the optimizer's state dict: ``"seed"``, ``"rng"`` (the
        training generators, as they were before the parameters' resident sample, which
        loading draws again), ``"predict_rng"``, ``"skipped_steps"``, the prior's elements
        by position in ``params`` (``"prior"``) and strength (``"prior_strength"``), and the
        δ-prior's centres by position (``"prior_centre"``)."""
        now = self.noise.state_dict()
        noise = self.holding.rng or now  # before the parameters' sample, if any
        saved = {"rng": noise["rng"], "seed": noise["seed"], "predict_rng": now["predict_rng"]}
        saved["skipped_steps"] = self.status.skipped
        if self.status.prior is not None:
            saved["prior"] = self.status.prior.state_dict(params)
            saved["prior_strength"] = self.status.prior.strength
        if self.status.centre:
            centre = self.status.centre
            saved["prior_centre"] = {i: centre[p] for i, p in enumerate(params) if p in centre}
        return saved

    def load_state_dict(self, saved: dict[str, Any], params: list[Tensor]) -> None:
        """Restore :meth:`state_dict` (a prior saved without ``"prior_strength"``, before it
        could be set, has strength 1) into the optimizer's loaded states: the step starts
        afresh and the parameters hold what they hold between steps."""
        if "rng" in saved:
            self.noise.load_state_dict(
                {
                    "seed": saved.get("seed", self.noise.seed),
                    "rng": saved["rng"],
                    "predict_rng": saved.get("predict_rng", {}),
                }
            )
            self.noise.make_generators(list(self.optimizer.state))
        else:
            warn(
                "load_state_dict: no noise state ('rng'; torch.distributed.checkpoint's "
                "get_optimizer_state_dict keeps only 'state' and 'param_groups'), so the noise "
                "goes on from this optimizer's generators; checkpoint "
                "liegroup_blr.optim.TrainingState(model, optimizer) to resume bit for bit",
            )
        self.status.skipped = int(saved.get("skipped_steps", 0))
        prior, strength = saved.get("prior"), saved.get("prior_strength", 1.0)
        self.status.prior = (
            None
            if prior is None
            else Prior.from_state_dict(prior, params, self.mc_samples, strength)
        )
        centre = saved.get("prior_centre", {})
        self.status.centre = {
            params[i]: c.to(params[i].device, params[i].dtype) for i, c in centre.items()
        }
        self.end_step()  # a loaded state starts between steps
        self.scratch.clear()
        self.noise.end_step()
        self.rule.upgrade(self.optimizer.param_groups)
        self.holding.between_steps()  # the point estimate, or the saved sample again

    # ------------------------------------------------------------- param groups
    def point_mean(self, group: dict[str, Any]) -> float | None:
        """E[ξ] under ``point_at="mean"``, else ``None``."""
        return float(group["base"].mean) if self.point_at == "mean" else None

    def reference(self, group: dict[str, Any], p: Tensor, mean: float | None) -> Tensor:
        """ξ₀ at which the point estimate of ``p`` is read: E[ξ] when ``mean`` is given."""
        G, dtype = self.rule.group_of(group), state_dtype(p)
        if mean is not None:
            return torch.full(G.base_shape(p.shape), mean, dtype=dtype, device=p.device)
        return G.reference_point(p.shape, dtype=dtype, device=p.device)

    def tensors(self, index: int, group: dict[str, Any]) -> GroupTensors | None:
        """The tensors of param group ``index`` (its trained parameters'), gathered once per
        step; the state of a parameter trained for the first time is made here. ``None``
        when the group trains no parameter."""
        tensors = self.status.tensors.get(index)
        if tensors is not None:
            return tensors
        keys = [p for p in group["params"] if p.requires_grad]
        if not keys:
            return None
        state = self.optimizer.state
        new = [p for p in keys if "element" not in state.get(p, {})]
        if new:
            self.init_states(group, new)
        states = [state[p] for p in keys]
        params = [local(p) for p in keys] if self.sharded else keys
        G = self.rule.group_of(group)
        shapes = {"acc": G.algebra_shape, "noise": G.base_shape}
        if self.compile:
            shapes["spare"] = G.element_shape
        accs, noise, *spares = self.scratch.take(params, **shapes)
        tensors = self.status.tensors[index] = GroupTensors(
            keys=keys,
            params=params,
            elements=[s["element"] for s in states],
            momenta=[s["momentum"] for s in states],
            accs=accs,
            noise=noise,
            spares=spares[0] if spares else None,
            rows=self.scratch.rows,
            mean=float(group["base"].mean) if self.point_at == "mean" else None,
        )
        return tensors

    @torch.no_grad()
    def init_states(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Create the state of ``params`` (lazily, as torch.optim does); they then hold their
        point estimate. A sharded parameter's is one process's state of the whole parameter
        (gathered), cut to its shard."""
        state = self.optimizer.state
        for p in params:
            state[p] = self.shards.initial(partial(self.rule.init_state, group), p)
        elements = [state[p]["element"] for p in params]
        self.rule.write_point(group, [local(p) for p in params], elements, self.point_mean(group))
        self.noise.make_generators(params)  # before any draw: a state dict lists them

    @torch.no_grad()
    def write_points(self, frozen: bool = False) -> None:
        """Write the point estimates into the trained parameters (``frozen``: also into those
        frozen since they were trained)."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if (frozen or p.requires_grad) and p in state]
            if params:
                elements = [state[p]["element"] for p in params]
                params = [local(p) for p in params]
                self.rule.write_point(group, params, elements, self.point_mean(group))

    def restore_unmoved(self, drawn: dict[int, GroupTensors], moved: list[GroupTensors]) -> None:
        """Write the point estimate into drawn parameters the step did not move."""
        done = {p for t in moved for p in t.params}
        for index, t in drawn.items():
            keep = [p not in done for p in t.params]
            if any(keep):
                rest = t.subset(keep)
                group = self.optimizer.param_groups[index]
                self.rule.write_point(group, rest.params, rest.elements, rest.mean)

    # --------------------------------------------------------------- samples
    @torch.no_grad()
    def draw(self, train: bool, forget: bool = False) -> Sample:
        """θ = readout(g·ξ) into every trained parameter (``train``: a sample of the next
        step; else drawn from the prediction generators); ``forget``: then forget the
        gathered tensors (parameters may be frozen before the step)."""
        if self.status.deferred:  # the draw rewrites the noise a deferred sample reads
            self.accumulate_deferred()
        self.noise.start_sample(train)
        keys: list[Tensor] = []
        params: list[Tensor] = []
        noise: list[Tensor] = []
        for index, group in enumerate(self.optimizer.param_groups):
            t = self.tensors(index, group)
            if t is None:
                continue
            xi = self.noise.draw(t.noise, group["base"], t.keys, index, predict=not train)
            noise += self.rule.draw(group, t, xi)
            keys += t.keys
            params += t.params
        if forget:
            self.status.tensors.clear()
        return Sample(keys, params, noise)

    def accumulate_sample(
        self, sample: Sample, grads: list[Tensor | None] | None, defer: bool
    ) -> None:
        """Add ``sample``'s algebra gradient to the pending step (``grads``: per parameter of
        ``sample.params``, default each ``p.grad``); ``defer``: keep references and read them
        at the next draw, accumulation or update."""
        status = self.status
        if status.deferred:
            self.accumulate_deferred()
        grads = [p.grad for p in sample.params] if grads is None else grads
        if self.sharded:
            grads = self.shards.grads(grads, sample.params)
        at = {p: i for i, p in enumerate(sample.params)}
        for index, group in enumerate(self.optimizer.param_groups):
            t = status.tensors.get(index) or self.tensors(index, group)  # gathered by the draw
            if t is None:
                continue
            idx = [at.get(p, -1) for p in t.keys]
            has = [i >= 0 and grads[i] is not None for i in idx]
            for first in (True, False):
                keep = [
                    h and (p not in status.pending) == first
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
                if rate:  # (δ/N + weight_decay)θ while θ is the sample's
                    (decay,) = self.scratch.take(part.params, grad=torch.Size)
                    torch._foreach_copy_(decay, [sample.theta[i] for i in rows])
                    torch._foreach_mul_(decay, rate)
                    if status.centre:  # the δ-prior centred on c: (δ/N)(θ − c)
                        self.centre(decay, part.keys, group)
                deferred = Deferred(part, [sample.noise[i] for i in rows], raw, decay, first)
                if defer:
                    deferred.versions = [g._version for g in raw]
                    status.deferred[index] = deferred
                else:
                    total = deferred.gradients(inverse_scale(self.optimizer), self.scratch)
                    self.rule.accumulate(group, part, deferred.noise, total, first)
            status.pending.update(dict.fromkeys(p for p, h in zip(t.keys, has, strict=True) if h))
        status.samples += 1

    def centre(self, decay: list[Tensor], keys: list[Tensor], group: dict[str, Any]) -> None:
        """Subtract (δ/N)·c from ``decay`` where a parameter's δ-prior is centred on c
        (:meth:`~liegroup_blr.optim.BLROptimizer.next_task` with ``prior="delta"``)."""
        centres = self.status.centre
        pairs = [(d, centres[p]) for d, p in zip(decay, keys, strict=True) if p in centres]
        if pairs:
            ds, cs = (list(x) for x in zip(*pairs, strict=True))
            torch._foreach_add_(ds, cs, alpha=-group["prior_precision"] / group["data_size"])

    def refuse_changed(self) -> None:
        """A deferred gradient was changed in place before it was read: the step is abandoned."""
        self.abandon()
        raise RuntimeError(
            "a gradient was changed in place before the optimizer read it (accumulate("
            "defer=True), a sampled_params(train=True) block); the pending samples are "
            "discarded: change gradients inside the block, or use between_steps='sample', "
            "whose step() reads p.grad as it finds it"
        )

    def accumulate_deferred(self) -> None:
        """Accumulate the deferred samples now."""
        for index, group in enumerate(self.optimizer.param_groups):
            deferred = self.status.deferred.pop(index, None)
            if deferred is None:
                continue
            if deferred.versions != [g._version for g in deferred.raw]:
                self.refuse_changed()
            grads = deferred.gradients(inverse_scale(self.optimizer), self.scratch)
            self.rule.accumulate(group, deferred.tensors, deferred.noise, grads, deferred.first)

    def forget_tensors(self) -> None:
        """Forget the gathered tensors (parameters may be frozen before the next step)."""
        self.status.tensors.clear()

    def end_step(self) -> None:
        """Forget the step's samples and tensors: the next training sample starts a new step."""
        status = self.status
        status.samples = 0
        status.pending.clear()
        status.deferred.clear()
        status.tensors.clear()

    def abandon(self) -> None:
        """Abandon the pending samples: nothing is accumulated, the parameters hold what they
        hold between steps, and gradients left by the abandoned samples are nobody's."""
        self.end_step()
        self.noise.end_step()
        self.fresh_gradients()
        self.holding.between_steps()

    def fresh_gradients(self) -> list[Tensor]:
        """The trained parameters whose gradients were made or changed since the engine last
        looked, remembered now: by a weak reference (a new tensor where a freed one was is
        not taken for it) and the version counter (every in-place change bumps it). A
        parameter the engine never looked at (added later, or in a copy) is only
        remembered."""
        marks, fresh = self.status.marks, []
        for group in self.optimizer.param_groups:
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

    # ------------------------------------------------------------------ step
    def closure_samples(self, closure: Callable[[], Any]) -> Any:
        """Call ``closure`` at ``mc_samples`` samples and accumulate each; its value (one
        sample) or the mean of its values at the samples taken. An exception abandons the
        step."""
        status = self.status
        fresh = self.fresh_gradients()
        made_outside = bool(fresh) and bool(
            torch.stack([local(p.grad).ne(0).any() for p in fresh]).any()  # type: ignore[arg-type]
        )
        foreign = None  # gradients found before the closure that it must clear
        if made_outside and not self.holding.owns_outside_gradients(self.mc_samples):
            foreign, made_outside = Foreign(fresh), False
        values, losses = [], []
        resident = self.holding.resident
        try:
            for s in range(self.mc_samples):
                rng = self.noise.state_dict() if status.samples else None
                sample = resident if s == 0 and resident else self.draw(True)
                with torch.enable_grad():
                    values.append(closure())
                if foreign is not None:
                    verdict, foreign = foreign.verdict(), None
                    if verdict:
                        raise RuntimeError(self.holding.outside_gradients(verdict))
                if self.fresh_gradients() or (s == 0 and made_outside):
                    self.accumulate_sample(sample, None, defer=True)
                    value = values[-1]
                    losses.append(value.detach() if isinstance(value, Tensor) else value)
                elif rng is not None:  # a closure that made no gradient takes no sample (a
                    self.noise.load_state_dict(rng)  # do-nothing one after blocks)
        except BaseException:
            if foreign is not None:
                foreign.verdict()  # its hooks removed
            self.abandon()
            raise
        if self.mc_samples == 1:
            return values[0]
        return sum(losses) / len(losses) if losses and None not in losses else None

    def offsets(self, group: dict[str, Any], t: GroupTensors) -> float | list[Tensor]:
        r"""The part of param group ``group``'s algebra gradient that is not the loss's, with
        w = τ/N: a prior's :math:`w\nabla_X\mathrm{KL}(q\|\text{prior})` where it covers a
        parameter, the entropy's :math:`-w\nabla_X\log|\det J|` elsewhere; the entropy's as
        the number −w where the rule takes it so (:attr:`~.rule.Rule.entropy_as_number`)."""
        G, prior = group.get("group", self.rule.lie_group), self.status.prior
        tau = group["temperature"]
        covered = prior is not None and prior.covers(t.keys)
        if not covered and (G.constant_entropy or not tau):
            return 0.0  # N may be unset: nothing divides by it
        weight = tau / group["data_size"] if tau else 0.0
        if prior is not None and covered:
            generator, base = self.noise.generator, group["base"]
            entropy = partial(self.entropy, G)
            return prior.gradients(G, base, t.keys, t.elements, weight, entropy, generator)
        if self.rule.entropy_as_number:
            return -weight
        return [self.entropy(G, g).mul(-weight) for g in t.elements]

    def entropy(self, G: LieGroup, g: Tensor) -> Tensor:
        r""":math:`\nabla_X \log|\det J_{g \exp X}|` at 0 for an element shaped as ``g`` of the
        group ``G``: the same for every g (the Jacobian of the
        action does not depend on ξ, so :math:`\log|\det J_{gh}| = \log|\det J_g| +
        \log|\det J_h|`); computed once at the identity per group, shape, dtype and device."""
        key = (id(G), g.shape, g.dtype, g.device)
        grad = self.entropies.get(key)
        if grad is None:
            shape = G.param_shape(g.shape)
            grad = entropy_gradient(G, G.identity(shape, dtype=g.dtype, device=g.device))
            self.entropies[key] = grad
        return grad

    def read_gradients(self) -> None:
        """A closure-free ``step()``: the samples accumulated since the last one, or else the
        holding's (with ``between_steps="sample"``, the parameters' own, whose gradient is
        ``p.grad``)."""
        if not self.status.samples:
            self.accumulate_sample(self.holding.read(self.mc_samples), None, defer=True)
            self.fresh_gradients()  # the engine has seen them: not made outside a step

    def update(
        self, loss_finite: bool, inv_scale: float, found_inf: bool = False
    ) -> FloatingPointError | None:
        """Propose every param group's update from the pending samples, check, and commit
        all of them or skip; then the parameters hold what the holding wants between steps
        (the point estimates, or the next sample). ``loss_finite``: whether the step's loss
        is finite; ``found_inf``: whether a ``GradScaler.step`` driving it found an inf.
        Returns the error to raise once the step is over, after ``max_consecutive_skips``
        skips in a row."""
        finite = loss_finite and not found_inf
        work, n, finite = self.gather(finite)
        drawn = dict(self.status.tensors)
        proposals, draw_next = self.propose(work, drawn, n, inv_scale, finite)
        moved = self.check(work, proposals, finite)
        error = None
        if moved:
            self.commit(work, proposals)
        elif work:
            error = self.skip(work, proposals, loss_finite, found_inf, finite)
        if self.grad_scaler is not None:
            record_finite(self.grad_scaler, moved or not work)
        self.end_step()
        unmoved = len(work) < len(drawn) or not moved or any(t is not drawn[i] for i, _, t in work)
        done = [t for _, _, t in work] if moved else []
        self.holding.after_update(drawn, done if unmoved else None, draw_next and moved)
        return error

    def gather(self, finite: bool) -> tuple[list[Work], int, bool]:
        """The param groups' parameters with samples, the number of samples and whether the
        step is finite (with ``process_group``: summed and agreed over the processes)."""
        status, groups = self.status, self.optimizer.param_groups
        work: list[Work] = []
        for index, t in status.tensors.items():
            keep = [p.requires_grad and p in status.pending for p in t.keys]
            if any(keep):
                work.append((index, groups[index], t if all(keep) else t.subset(keep)))
        if not work and status.tensors and not status.warned:
            status.warned = True
            warn(
                f"{self.name}.step(): no trained parameter has a gradient, so the "
                "step changed nothing (does the closure call loss.backward()?)",
            )
        n = status.samples
        if self.process_group is not None:
            if not status.unaveraged:  # a DDP-wrapped model: refused
                status.unaveraged = refuse_averaged(status.deferred, self.process_group)
            self.accumulate_deferred()
            accs = [a for _, _, t in work for a in t.accs]
            n, finite = all_reduce_accumulators(accs, n, finite, self.process_group)
        return work, n, finite

    def propose(
        self,
        work: list[Work],
        drawn: dict[int, GroupTensors],
        n: int,
        inv_scale: float,
        finite: bool,
    ) -> tuple[list[Proposal], bool]:
        """Each param group's proposal from its accumulators and its deferred sample (none
        once a rule rejects one, or where the step is not ``finite``), and whether the
        update draws the next sample (a compiled one-sample step whose holding opens it)."""
        deferreds = self.status.deferred
        draw_next = (
            self.compile
            and n == 1
            and len(work) == len(drawn)
            and self.holding.open_draw_next(not self.noise.views or self.rule.draw_next_from_views)
        )
        proposals: list[Proposal] = []
        for index, group, t in work if finite else []:
            deferred, sample = deferreds.pop(index, None), None
            if deferred is not None:  # the gradients as the step sees them
                if deferred.versions != [g._version for g in deferred.raw]:
                    self.refuse_changed()
                grads = deferred.raw
                if deferred.decay is not None or inv_scale != 1.0:
                    grads = deferred.gradients(inv_scale, self.scratch)
                if deferred.first and (deferred.tensors is t or deferred.tensors.holds(t)):
                    sample = deferred.noise, grads  # the step's one sample
                else:  # e.g. a parameter frozen between accumulate and step
                    self.rule.accumulate(
                        group, deferred.tensors, deferred.noise, grads, deferred.first
                    )
            draw_next = draw_next and sample is not None and t is drawn[index]
            if draw_next:
                self.draw_next_noise(index, group, t, sample[0])  # type: ignore[index]
            proposal = self.rule.propose(group, t, n, sample, self.offsets(group, t), draw_next)
            if proposal is None:
                break
            proposals.append(proposal)
        return proposals, draw_next

    def check(self, work: list[Work], proposals: list[Proposal], finite: bool) -> bool:
        """Whether every param group proposed and every proposal is finite: the sums first,
        one host sync where they are finite (``all_finite``'s test); the shards' ranks
        agree."""
        checked = [t for proposal in proposals for t in proposal.checked]
        sums = [s for pr in proposals for s in (pr.sums or [t.sum() for t in pr.checked])]
        moved = (
            len(proposals) == len(work)
            and finite
            and (not sums or bool(torch.stack(sums).isfinite().all()) or all_finite(checked, sums))
        )
        if self.sharded:  # the shards' ranks take or skip it together
            moved = self.shards.agree(moved)
        return moved

    def commit(self, work: list[Work], proposals: list[Proposal]) -> None:
        """Take the proposals: the new momenta (and a compiled update's moved elements, in
        the spares) swap places with the old."""
        state = self.optimizer.state
        for (_, _, t), proposal in zip(work, proposals, strict=True):
            states = [state[p] for p in t.keys]
            self.scratch.swap(states, t.params, "momentum", "acc")
            if proposal.commit is None:  # moved into the spares by the proposal
                self.scratch.swap(states, t.params, "element", "spare")
            else:
                proposal.commit()
        self.status.consecutive = 0

    def skip(
        self,
        work: list[Work],
        proposals: list[Proposal],
        loss_finite: bool,
        found_inf: bool,
        finite: bool,
    ) -> FloatingPointError | None:
        """Count a skipped step (a skip a GradScaler calibrating its scale expects is not
        warned of); the error to raise after ``max_consecutive_skips`` in a row."""
        expected = expected_skip(self.optimizer)
        groups = self.optimizer.param_groups
        what = partial(non_finite, groups, loss_finite, found_inf, finite, work, proposals)
        limit = self.max_consecutive_skips
        return self.status.skip(self.name, expected, limit, what, skip_fix(groups))

    def draw_next_noise(
        self, index: int, group: dict[str, Any], t: GroupTensors, current: list[Tensor]
    ) -> None:
        """Draw the next sample's ξ of param group ``index`` into the accumulators (the first
        entries of each: the base's shape), which a one-sample update reads nothing else
        from and writes the new momenta into after it read ξ; and make ``t.noise`` hold the
        step's sample's noise, which that update reads and overwrites."""
        outs = [a.view(-1)[: b.numel()].view(b.shape) for a, b in zip(t.accs, t.noise, strict=True)]
        xi = self.noise.draw(outs, group["base"], t.keys, index, predict=False)
        if xi is not outs:  # windows of a noise table
            torch._foreach_copy_(outs, xi)
        if any(c is not n for c, n in zip(current, t.noise, strict=True)):
            torch._foreach_copy_(t.noise, current)  # the step's ξ was a table window


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
