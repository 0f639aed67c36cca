r"""The sampling engine every Lie-group rule shares: the torch face and the Monte-Carlo loop.

One step of every rule is the same loop; only the arithmetic differs per rule::

    for s in 1..S:                      draw():       ξ_s ~ q0 (noise.NoiseSource), θ_s = g·ξ_s
        closure()                                     forward + backward at θ_s
        accumulate(sample, defer=True)                acc += ∇_X ℓ̄(θ_s(X))|_{X=0}
    propose  M' = β M + (1 − β) P(acc/S + c)            (in the accumulator)
    if M' is finite:  commit  M ← M',  g ← g·exp(−α M'),  θ ← what the parameters hold
    else:             skip (state unchanged, RuntimeWarning)

with c the part of the algebra gradient that is not the loss's — the entropy's −(τ/N)∇log|det J|
or a prior's (τ/N)∇KL — which the engine computes once per param group and hands to the rule;
the prior N(0, 1/δ) and a param group's ``weight_decay`` enter each sample's gradient as
(δ/N + weight_decay)θ. The first sample of a step is deferred: the next draw accumulates it
or, in a one-sample step, the proposal itself does, in the same pass over the tensors.

:class:`BLROptimizer` owns the loop and everything around it: param groups and each trained
parameter's state ``{"element", "momentum"}`` (in float32 for half-precision parameters),
gathered once per step for its rule (:class:`~.tensors.GroupTensors`); the skip on non-finite
values; gradient unscaling for ``torch.amp.GradScaler`` and the all-reduce over processes;
what the parameters hold between steps (a :mod:`~liegroup_blr.optim.holding` chosen once);
writes to the parameters made outside it (:mod:`~liegroup_blr.optim.outside`); the prior;
state dicts that resume bit for bit. Its components: the noise source
(:mod:`liegroup_blr.noise`), the scratch buffers (:class:`~.scratch.Scratch`), the engine's
counters (:class:`~.options.EngineState`). A rule's class supplies ``_init_state``, ``_draw``,
``_accumulate``, ``_propose`` and ``_write_point``, each a call of its module's functions with
the param group's hyperparameters as keywords.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .._userline import warn
from ..fisher import entropy_gradient
from ..groups import LieGroup
from ..noise import NoiseSource, noise_source
from ..posterior import Posterior, PosteriorEntry
from ..sharding import SHARDED, agree, as_dtensor, check_sharded, local, local_grad, shard_of, whole
from .amp import inverse_scale, record_finite, scaler_step
from .checks import check_choice, check_count, check_hyperparameters, check_number
from .distributed import (
    all_reduce_accumulators,
    broadcast_elements,
    refuse_averaged,
    replicas,
    shared_seed,
)
from .holding import Holding, holding
from .options import EngineState
from .outside import GONE, Foreign, unchanged
from .prior import Prior, check_strength, prior_for
from .scratch import Scratch, state_dtype
from .tensors import Deferred, GroupTensors, Proposal, Sample, SampleGrads, all_finite

__all__ = ["BLROptimizer"]

Loss = TypeVar("Loss", bound=float | Tensor | None)
"""What a closure returns, and :meth:`BLROptimizer.step` with it."""

POINT_ESTIMATES = ("g", "mean")
"""Where the point estimate is read: at the group's reference point ξ₀, or at E[ξ]."""


class BLROptimizer(Optimizer):
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
    lie_group: LieGroup
    groups_per_param_group = False
    """Whether a param group may set its own Lie group (key ``"group"``)."""
    fuses_view_draws = False
    """Whether a compiled update that draws the next sample pays off also when the noise
    source serves views (the multiplicative rule writes w = g ⊙ ξ either way)."""
    entropy_as_number = True
    """Whether the rule's kernels take the entropy's part of the algebra gradient as the one
    number −τ/N (on the components that scale; the built-in groups' log|det J| has a unit
    gradient there), else as a tensor per parameter."""
    _mesh_param: Tensor | None = None
    """A sharded parameter, whose device mesh agrees on skips (``None``: no sharded one)."""

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
        noise: str | NoiseSource = "fresh",
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
        if max_consecutive_skips is not None:
            check_count("max_consecutive_skips", max_consecutive_skips)
        self.lie_group = group
        self.mc_samples = mc_samples
        self.point_convention = point_estimate
        self.between_steps = between_steps
        self._holding: Holding = holding(between_steps)
        self.compile = bool(compile)
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self.max_consecutive_skips = max_consecutive_skips
        replicated = replicas(process_group)
        self.noise_source = noise_source(noise, antithetic=antithetic, table_size=table_size)
        rank = 0 if process_group is None else dist.get_rank(process_group)
        self.noise_source.bind(shared_seed(seed, process_group, replicated), rank)
        self._engine = EngineState()
        self._scratch = Scratch()
        self._entropies: dict[tuple[Any, ...], Tensor] = {}  # ∇log|det J| at the identity
        super().__init__(params, defaults)
        if process_group is not None or replicated is not None:
            broadcast_elements(self.state, process_group if replicated is None else replicated)
            self._write_points()
        self._fresh_gradients()  # gradients from before construction are nobody's sample
        if prior is not None:
            self.set_prior(prior)
        self._holding.between_steps(self)
        self._mark_writes()

    # ------------------------------------------------------------ the rule's part
    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """Initial ``{"element", "momentum"}`` of ``p`` (state dtype, p's device)."""
        raise NotImplementedError

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
        offset: float | list[Tensor],
        draw: bool,
    ) -> Proposal | None:
        """The update from the accumulators (n samples) and the deferred ``sample`` (its
        noise and gradients: not yet in them, and then the only one, ``n = 1``), with the
        algebra gradient's part that is not the loss's, ``offset`` (:meth:`_offsets`);
        ``None`` rejects the step. With ``draw`` (a compiled one-sample step in sample mode;
        the next sample's ξ' is in the accumulators) the update writes the next sample
        θ = readout(g'·ξ') into the parameters and its noise into ``t.noise`` instead of the
        point estimate."""
        raise NotImplementedError

    def _write_point(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        elements: list[Tensor],
        mean: float | None,
    ) -> None:
        """``params ← point estimate`` of their ``elements`` (read at E[ξ] = ``mean`` when it
        is not ``None``), as the group's :meth:`~liegroup_blr.groups.LieGroup.point`."""
        raise NotImplementedError

    def _sample_value(self, group: dict[str, Any], element: Tensor, noise: Tensor) -> Tensor:
        """θ of a sample with ``noise`` (its :attr:`Sample.noise`), as :meth:`_draw` made it."""
        return self._group_of(group).theta(element, noise)

    def _with_point(self, group: dict[str, Any], g: Tensor, theta: Tensor, xi0: Tensor) -> Tensor:
        """The element with point estimate ``theta`` read at ``xi0``, from ``g``
        (:meth:`~liegroup_blr.groups.LieGroup.with_point`); a group without it refused."""
        G = self._group_of(group)
        try:
            return G.with_point(g, theta, xi0)
        except NotImplementedError:
            raise RuntimeError(
                f"params: a parameter of {type(self).__name__} was written outside the "
                f"optimizer, and {type(G).__name__} has no with_point(g, theta) to adopt the "
                "value as the posterior's location: set the element with "
                "optimizer.set_group_element(p, element), or define with_point"
            ) from None

    # ----------------------------------------------------------- param groups
    def _validate(self, options: dict[str, Any]) -> None:
        """Raise ValueError naming the first invalid hyperparameter of a param group."""
        if "group" in options and not self.groups_per_param_group:
            raise ValueError(
                f"group: {type(self).__name__} has a fixed Lie group; use "
                "liegroup_blr.LieGroupBLR for a Lie group per param group"
            )
        if "weight_decay" in options:  # Hugging Face's groups carry one
            check_number(options, "weight_decay", 0.0)
        check_hyperparameters(
            options,
            options.get("group", self.lie_group),
            antithetic=self.noise_source.needs_symmetric_base,
            point_estimate=self.point_convention,
        )

    @property
    def holds_samples(self) -> bool:
        """Whether the parameters hold a posterior sample between steps
        (``between_steps="sample"``) rather than the point estimate."""
        return self._holding.samples

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validate its hyperparameters and initialise the state of its
        trained parameters (a parameter frozen now gets its state when first trained); with
        ``between_steps="sample"`` every trained parameter then holds a fresh sample."""
        options = {k: v for k, v in param_group.items() if k != "params"}
        self._validate({**self.defaults, **options})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if not p.is_floating_point():
                self.param_groups.pop()
                raise ValueError(f"params: only floating-point parameters, got {p.dtype}")
            if isinstance(p, SHARDED):
                try:
                    check_sharded(p, self._group_of(group), self.process_group)
                except ValueError:
                    self.param_groups.pop()
                    raise
                if self._mesh_param is None:
                    self._mesh_param = p
        self._engine.tensors.clear()
        trained = [p for p in group["params"] if p.requires_grad]
        if trained:
            self._init_states(group, trained)
        if self._holding.resident is not None:  # the new parameters join the held sample
            self._holding.between_steps(self)
        self._mark_writes()

    def _group_of(self, group: dict[str, Any]) -> LieGroup:
        """The Lie group of a param group (its own ``"group"``, where the rule allows one)."""
        return group.get("group", self.lie_group)

    def _point_mean(self, group: dict[str, Any]) -> float | None:
        """E[ξ] under ``point_estimate="mean"``, else ``None``."""
        return float(group["base"].mean) if self.point_convention == "mean" else None

    def _reference(self, group: dict[str, Any], p: Tensor, mean: float | None) -> Tensor:
        """ξ₀ at which the point estimate of ``p`` is read: E[ξ] when ``mean`` is given."""
        G, dtype = self._group_of(group), state_dtype(p)
        if mean is not None:
            return torch.full(G.base_shape(p.shape), mean, dtype=dtype, device=p.device)
        return G.reference_point(p.shape, dtype=dtype, device=p.device)

    def _describe(self, group: dict[str, Any]) -> str:
        """What a param group's state means: the rule and its Lie group."""
        G = self._group_of(group)
        return f"{type(self).__name__}, {type(G).__name__}({G.extra_repr()})"

    def _param_group(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("p: not a parameter of this optimizer")

    def _params(self) -> list[Tensor]:
        """Every parameter, in the order of the param groups."""
        return [p for group in self.param_groups for p in group["params"]]

    # ------------------------------------------------------------- the tensors
    def _tensors(self, index: int, group: dict[str, Any]) -> GroupTensors | None:
        """The tensors of param group ``index`` (its trained parameters'), gathered once per
        step; the state of a parameter trained for the first time is made here. ``None``
        when the group trains no parameter."""
        tensors = self._engine.tensors.get(index)
        if tensors is not None:
            return tensors
        keys = [p for p in group["params"] if p.requires_grad]
        if not keys:
            return None
        new = [p for p in keys if "element" not in self.state.get(p, {})]
        if new:
            self._init_states(group, new)
        states = [self.state[p] for p in keys]
        params = keys if self._mesh_param is None else [local(p) for p in keys]
        G = group.get("group", self.lie_group)  # _group_of, inline: once per step
        shapes = {"acc": G.algebra_shape, "noise": G.base_shape}
        if self.compile:
            shapes["spare"] = G.element_shape
        accs, noise, *spares = self._scratch.take(params, **shapes)
        tensors = self._engine.tensors[index] = GroupTensors(
            keys=keys,
            params=params,
            elements=[s["element"] for s in states],
            momenta=[s["momentum"] for s in states],
            accs=accs,
            noise=noise,
            spares=spares[0] if spares else None,
            rows=self._scratch.rows,
            mean=float(group["base"].mean) if self.point_convention == "mean" else None,
        )
        return tensors

    def _clear_tensors(self) -> None:
        """Forget the gathered tensors (parameters may be frozen before the next step)."""
        self._engine.tensors.clear()

    @torch.no_grad()
    def _init_states(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Create the state of ``params`` (lazily, as torch.optim does); they then hold their
        point estimate. A sharded parameter's is one process's state of the whole parameter
        (gathered), cut to its shard."""
        for p in params:
            if isinstance(p, SHARDED):
                full = self._init_state(group, p.full_tensor())
                self.state[p] = {k: shard_of(v, p).clone() for k, v in full.items()}
            else:
                self.state[p] = self._init_state(group, p)
        elements = [self.state[p]["element"] for p in params]
        self._write_point(group, [local(p) for p in params], elements, self._point_mean(group))
        self.noise_source.make_generators(params)  # before any draw: a state dict lists them

    @torch.no_grad()
    def _write_points(self, frozen: bool = False) -> None:
        """Write the point estimates into the trained parameters (``frozen``: also into those
        frozen since they were trained)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if (frozen or p.requires_grad) and p in self.state]
            if params:
                elements = [self.state[p]["element"] for p in params]
                params = [local(p) for p in params]
                self._write_point(group, params, elements, self._point_mean(group))

    def _restore_unmoved(self, drawn: dict[int, GroupTensors], moved: list[GroupTensors]) -> None:
        """Write the point estimate into drawn parameters the step did not move."""
        done = {p for t in moved for p in t.params}
        for index, t in drawn.items():
            keep = [p not in done for p in t.params]
            if any(keep):
                rest = t.subset(keep)
                group = self.param_groups[index]
                self._write_point(group, rest.params, rest.elements, rest.mean)

    # --------------------------------------------------------- sample protocol
    @property
    def pending_samples(self) -> int:
        """Samples accumulated since the last update."""
        return self._engine.samples

    @torch.no_grad()
    def draw(self, train: bool = True) -> Sample:
        """Write a posterior sample θ = readout(g·ξ) into every trained parameter.

        With ``train=True`` the sample is one of the next step's (antithetic pairing counts
        it); pass the result to :meth:`accumulate` once its gradients are known. Drawn for
        prediction (``train=False``), ξ comes from the optimizer's prediction generators.
        """
        self._take_writes()
        sample = self._draw_sample(train)
        self._mark_writes()
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
            xi = self.noise_source.draw(t.noise, group["base"], t.keys, index, predict=not train)
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
                if rate:  # (δ/N + weight_decay)θ while θ is the sample's
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

    def _accumulate_deferred(self) -> None:
        """Accumulate the deferred samples now."""
        for index, group in enumerate(self.param_groups):
            deferred = self._take_deferred(index)
            if deferred is not None:
                grads = deferred.gradients(inverse_scale(self), self._scratch)
                self._accumulate(group, deferred.tensors, deferred.noise, grads, deferred.first)

    @torch.no_grad()
    def discard(self) -> None:
        """Abandon the pending samples: nothing is accumulated, and the parameters hold the
        point estimates again (between_steps="sample": a fresh sample); gradients left by
        the abandoned samples are nobody's."""
        self._end_step()
        self.noise_source.end_step()
        self._fresh_gradients()
        self._holding.between_steps(self)
        self._mark_writes()

    def _end_step(self) -> None:
        """Forget the step's samples and tensors: the next training sample starts a new step."""
        engine = self._engine
        engine.samples = 0
        engine.pending.clear()
        engine.deferred.clear()
        engine.tensors.clear()

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

    # ------------------------------------------------------------ holding blocks
    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold one posterior sample θ = readout(g·ξ) in the parameters for the block.

        With ``train=True`` the gradients the block leaves in ``p.grad`` are one Monte-Carlo
        sample of the next :meth:`step` (call ``zero_grad`` inside each block; the optimizer
        reads them at the next draw or update, so they must not be changed in place before).
        On exit, also on error, the parameters return to what they held before the block:
        the point estimate, or with ``between_steps="sample"`` the training sample (and
        ``train=True`` is refused there: the parameters already hold a training sample).
        """
        engine = self._engine
        if engine.block:
            raise RuntimeError(f"sampled_params() cannot be nested inside {engine.block}()")
        if train:
            self._holding.check_training_block()
        self._take_writes()
        engine.block = "sampled_params"
        try:
            with self._holding.keeping():
                sample = self._draw_sample(train)
                yield
                if train:
                    self.accumulate(sample, defer=True)
        finally:
            engine.block = ""
            if not engine.samples:
                engine.tensors.clear()  # parameters may be frozen before the next step
            if self._holding.resident is None:
                self._write_points()
            self._mark_writes()

    @contextmanager
    def point_estimate(self) -> Iterator[None]:
        """Hold the point estimate (``point_estimate="g"``: at ξ₀; ``"mean"``: at E[ξ]) in
        every parameter the optimizer has trained (frozen ones too) for the block, whatever
        they hold between steps; on exit they hold what they held before (with
        ``between_steps="sample"``, the training sample), or what a :meth:`restore` or
        :meth:`load_state_dict` inside the block wrote (the block holds the new point estimate
        after it)."""
        engine = self._engine
        if engine.block:
            raise RuntimeError(f"point_estimate() cannot be nested inside {engine.block}()")
        self._take_writes()
        engine.block = "point_estimate"
        try:
            self._hold_point(frozen=True)
            yield
        finally:
            engine.block = ""
            kept, engine.kept = engine.kept, {}
            with torch.no_grad():
                torch._foreach_copy_(list(kept), list(kept.values()))
            self._mark_writes()

    @torch.no_grad()
    def _hold_point(self, frozen: bool) -> None:
        """Inside a ``point_estimate`` block: keep what the trained parameters (``frozen``:
        also those frozen since) hold now, for its end, and write the point estimates."""
        if self._engine.block != "point_estimate":
            return
        params = [p for p in self._params() if p in self.state and (frozen or p.requires_grad)]
        self._engine.kept.update((local(p), local(p).detach().clone()) for p in params)
        self._write_points(frozen=True)

    def restore(self, frozen: bool = False) -> None:
        """Write the point estimate into every trained parameter (``frozen``: also into those
        frozen since they were trained). With ``between_steps="sample"`` the parameters then
        hold no training sample: the next ``step(closure)`` draws one, and a closure-free
        ``step()`` refuses (its gradients would be the point estimate's). A value written into
        a parameter since the optimizer's last call is adopted first: it is the point."""
        self._take_writes()
        self._write_points(frozen)
        self._holding.forget()
        self._hold_point(frozen)
        self._mark_writes()

    # ------------------------------------------------------------------- step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], Loss]) -> Loss: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], Loss] | None = None) -> Loss | None:
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
        if engine.block:
            raise RuntimeError(f"step() cannot be called inside {engine.block}()")
        self._take_writes()
        if self.grad_scaler is None and not {"grad_scale", "found_inf"} & vars(self).keys():
            inv_scale, found_inf = 1.0, False  # no GradScaler anywhere
        else:
            inv_scale, found_inf = scaler_step(self, closure)
        loss = None
        if closure is not None:
            loss = self._closure_samples(closure)
        elif not engine.samples:
            self._holding.read(self)
        finite = not isinstance(loss, (Tensor, float)) or bool(
            torch.as_tensor(loss).isfinite().all()
        )
        self._update(finite and not found_inf, inv_scale)
        self._mark_writes()
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
        if made_outside and not self._holding.owns_outside_gradients(self.mc_samples):
            foreign, made_outside = Foreign(fresh), False
        values, losses = [], []
        resident = self._holding.resident
        try:
            for s in range(self.mc_samples):
                rng = self.noise_source.state_dict() if engine.samples else None
                sample = resident if s == 0 and resident else self._draw_sample(True)
                with torch.enable_grad():
                    values.append(closure())
                if foreign is not None:
                    verdict, foreign = foreign.verdict(), None
                    if verdict:
                        self._refuse_outside_gradients(verdict)
                if self._fresh_gradients() or (s == 0 and made_outside):
                    self._accumulate_sample(sample, None, defer=True)
                    value = values[-1]
                    losses.append(value.detach() if isinstance(value, Tensor) else value)
                elif rng is not None:  # a closure that made no gradient takes no sample (a
                    self.noise_source.load_state_dict(rng)  # do-nothing one after blocks)
        except BaseException:
            if foreign is not None:
                foreign.verdict()  # its hooks removed
            self.discard()
            raise
        if self.mc_samples == 1:
            return values[0]
        return sum(losses) / len(losses) if losses and None not in losses else None

    def _refuse_outside_gradients(self, verdict: str) -> None:
        """Gradients made outside ``step(closure)`` since the last update (at the point
        estimate, or, with several samples, only at the first) were added to by the closure
        (``verdict`` ``"added to"``) or left in place by a closure that computed none
        (``"left"``)."""
        held = self._holding.resident is not None
        where = "at one sample" if held else "at the point estimate"
        fix = (
            "set mc_samples=1"
            if held
            else "hold the point estimate with `with optimizer.point_estimate():` instead of "
            "restore()"
            if self._holding.samples
            else "construct the optimizer with between_steps='sample' and mc_samples=1"
        )
        self.discard()
        if verdict == "left":
            raise RuntimeError(
                f"step(closure) found gradients computed outside step() since the last update "
                f"({where}), and the closure computed none (no backward pass reached them): "
                f"they are not a sample's; pass a closure that zeroes the gradients and "
                f"computes the loss and its backward, or {fix}"
            )
        raise RuntimeError(
            f"step(closure) found gradients computed outside step() since the last update "
            f"({where}) and the closure added to them (gradient accumulation over "
            f"micro-batches, Lightning's accumulate_grad_batches): they would be mixed into "
            f"the samples; zero them in the closure, or {fix}"
        )

    def _offsets(self, group: dict[str, Any], t: GroupTensors) -> float | list[Tensor]:
        r"""The part of param group ``group``'s algebra gradient that is not the loss's, with
        w = τ/N: a prior's :math:`w\nabla_X\mathrm{KL}(q\|\text{prior})` where it covers a
        parameter, the entropy's :math:`-w\nabla_X\log|\det J|` elsewhere; the entropy's as
        the number −w where the rule takes it so (:attr:`entropy_as_number`)."""
        G, prior, tau = group.get("group", self.lie_group), self._engine.prior, group["temperature"]
        covered = prior is not None and prior.covers(t.keys)
        if not covered and (G.constant_entropy or not tau):
            return 0.0  # N may be unset: nothing divides by it
        weight = tau / group["data_size"] if tau else 0.0
        if prior is not None and covered:
            generator, base = self.noise_source.generator, group["base"]
            entropy = partial(self._entropy, G)
            return prior.gradients(G, base, t.keys, t.elements, weight, entropy, generator)
        if self.entropy_as_number:
            return -weight
        return [self._entropy(G, g).mul(-weight) for g in t.elements]

    def _entropy(self, G: LieGroup, g: Tensor) -> Tensor:
        r""":math:`\nabla_X \log|\det J_{g \exp X}|` at 0 for an element shaped as ``g`` of the
        group ``G``: the same for every g (the Jacobian of the
        action does not depend on ξ, so :math:`\log|\det J_{gh}| = \log|\det J_g| +
        \log|\det J_h|`); computed once at the identity per group, shape, dtype and device."""
        key = (id(G), g.shape, g.dtype, g.device)
        grad = self._entropies.get(key)
        if grad is None:
            shape = G.param_shape(g.shape)
            grad = entropy_gradient(G, G.identity(shape, dtype=g.dtype, device=g.device))
            self._entropies[key] = grad
        return grad

    def _update(self, finite: bool, inv_scale: float) -> None:
        """Propose every param group's update from the pending samples, check, and commit
        all of them or skip; then the parameters hold what the holding wants between steps
        (the point estimates, or the next sample)."""
        engine = self._engine
        work: list[tuple[int, dict[str, Any], GroupTensors]] = []  # parameters with samples
        for index, t in engine.tensors.items():
            keep = [p.requires_grad and p in engine.pending for p in t.keys]
            if any(keep):
                work.append((index, self.param_groups[index], t if all(keep) else t.subset(keep)))
        if not work and engine.tensors and not engine.warned:
            engine.warned = True
            warn(
                f"{type(self).__name__}.step(): no trained parameter has a gradient, so the "
                "step changed nothing (does the closure call loss.backward()?)",
            )
        n = engine.samples
        if self.process_group is not None:
            if not engine.unaveraged:  # a DDP-wrapped model: refused
                engine.unaveraged = refuse_averaged(engine.deferred, self.process_group)
            self._accumulate_deferred()
            accs = [a for _, _, t in work for a in t.accs]
            n, finite = all_reduce_accumulators(accs, n, finite, self.process_group)
        drawn = dict(engine.tensors)
        fused = started = (
            self.compile
            and n == 1
            and len(work) == len(drawn)
            and self._holding.start_draw(self, not self.noise_source.views or self.fuses_view_draws)
        )
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
            fused = fused and sample is not None and t is drawn[index]
            if fused:
                self._next_noise(index, group, t, sample[0])  # type: ignore[index]
            proposal = self._propose(group, t, n, sample, self._offsets(group, t), fused)
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
        self._end_step()
        unmoved = len(work) < len(drawn) or not moved or any(t is not drawn[i] for i, _, t in work)
        done = [t for _, _, t in work] if moved else []
        self._holding.after_update(self, drawn, done if unmoved else None, started, fused and moved)

    def _next_noise(
        self, index: int, group: dict[str, Any], t: GroupTensors, current: list[Tensor]
    ) -> None:
        """Draw the next sample's ξ of param group ``index`` into the accumulators (the first
        entries of each: the base's shape), which a one-sample update reads nothing else
        from and writes the new momenta into after it read ξ; and make ``t.noise`` hold the
        step's sample's noise, which that update reads and overwrites."""
        outs = [a.view(-1)[: b.numel()].view(b.shape) for a, b in zip(t.accs, t.noise, strict=True)]
        xi = self.noise_source.draw(outs, group["base"], t.keys, index, predict=False)
        if xi is not outs:  # windows of a noise table
            torch._foreach_copy_(outs, xi)
        if any(c is not n for c, n in zip(current, t.noise, strict=True)):
            torch._foreach_copy_(t.noise, current)  # the step's ξ was a table window

    # ------------------------------------------------- writes to the parameters
    def _take_writes(self) -> None:
        """Adopt what was written into the trained parameters since the optimizer's last call
        (:mod:`~liegroup_blr.optim.outside`). Between steps only, where the parameters hold
        what the optimizer last wrote: one comparison of version and storage per parameter,
        no pass over values."""
        engine, sharded = self._engine, self._mesh_param is not None
        if engine.samples or engine.tensors or engine.block:
            return
        written = engine.written
        changed = [
            p
            for group in self.param_groups
            for p in group["params"]
            if p in written and written[p] != (p._version, (local(p) if sharded else p).data_ptr())
        ]
        if changed:
            self._adopt_writes(set(changed))
            self._mark_writes()

    def _mark_writes(self) -> None:
        """Remember each trained parameter's version counter and storage, as the optimizer left
        them (of a sharded parameter: the DTensor's version, its local shard's storage)."""
        sharded = self._mesh_param is not None
        self._engine.written = {
            p: (p._version, (local(p) if sharded else p).data_ptr())
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad
        }

    @torch.no_grad()
    def _adopt_writes(self, written: set[Tensor]) -> None:
        """Adopt the values of the parameters ``written`` (their version or storage moved) as
        the posterior's location, with one warning; values equal to what the optimizer wrote
        are left alone.

        Raises:
            RuntimeError: a parameter's dtype, device or shape changed (``module.to``,
                ``p.data = ...``), a non-finite value was written, or the group has no
                ``with_point``: each in one line naming the fix.
        """
        resident = self._holding.resident
        held = {} if resident is None else {p: i for i, p in enumerate(resident.params)}
        adopted, sampled = 0, {}
        for index, group in enumerate(self.param_groups):
            keys = [
                p for p in group["params"] if p in written and "element" in self.state.get(p, {})
            ]
            moved = [p for p in keys if not unchanged(local(p), self._expected(group, p, held))]
            mean = self._point_mean(group)
            for p in moved:
                state, value = self.state[p], local(p)
                xi0 = self._reference(group, value, mean)
                theta = value.to(state["element"].dtype)
                state["element"].copy_(self._with_point(group, state["element"], theta, xi0))
            at_point = [p for p in moved if p not in held]
            if at_point:
                elements = [self.state[p]["element"] for p in at_point]
                self._write_point(group, [local(p) for p in at_point], elements, mean)
            if len(at_point) < len(moved):
                sampled.update(self._hold_at_point(index, group, set(moved) - set(at_point)))
            adopted += len(moved)
        if resident is not None:  # the held parameters' noise: their points' (ξ₀)
            for p, noise in sampled.items():
                resident.noise[held[p]] = noise
        if adopted:
            where = "; the parameters hold it as their training sample until the next step"
            warn(
                f"{type(self).__name__}: {adopted} parameter(s) were written outside the "
                "optimizer (load_state_dict, a restored checkpoint or average, a weight "
                "constraint): the values are adopted as the posterior's location, its point "
                f"estimate{where if sampled else ''}",
            )

    def _expected(self, group: dict[str, Any], p: Tensor, held: dict[Tensor, int]) -> Tensor:
        """What the optimizer last wrote into ``p``: its training sample (``held``: index in
        the resident sample) or its point estimate. Refuses a parameter whose dtype, device
        or shape changed since."""
        value, element = local(p), self.state[p]["element"]
        if (
            state_dtype(value) != element.dtype
            or value.device != element.device
            or self._group_of(group).element_shape(value.shape) != element.shape
        ):
            raise RuntimeError(
                f"params: a parameter of {type(self).__name__} changed to {value.dtype}, "
                f"{value.device}, shape {tuple(value.shape)} after the optimizer was built "
                "(module.to(...), p.data = ...): build the optimizer after moving or converting "
                "the model"
            )
        if p in held:
            resident = self._holding.resident
            assert resident is not None
            expected = self._sample_value(group, element, resident.noise[held[p]])
        else:
            expected = self._group_of(group).point(element, self._point_mean(group), p.shape)
        return expected.to(value.dtype)

    def _hold_at_point(
        self, index: int, group: dict[str, Any], keys: set[Tensor]
    ) -> dict[Tensor, Tensor]:
        """In sample mode: the parameters ``keys`` hold their new point estimate as the
        training sample at ξ₀, so a gradient taken at the written value is that sample's;
        returns each one's noise for the resident sample."""
        t = self._tensors(index, group)
        assert t is not None
        t = t.subset([p in keys for p in t.keys])
        mean = self._point_mean(group)
        noise = self._draw(group, t, [self._reference(group, p, mean) for p in t.params])
        self._engine.tensors.clear()
        return dict(zip(t.keys, noise, strict=True))

    # ------------------------------------------------------------ elements
    def group_element(self, p: Tensor) -> dict[str, Tensor]:
        """Named components of ``p``'s current group element (detached copies):
        ``{'m'}`` additive, ``{'g+', 'g-'}`` multiplicative, ``{'A', 'b'}`` affine, ``{'g'}``
        for groups without named parts. Of a sharded parameter, DTensors placed as ``p``
        (a stacked component keeps ``p``'s placements shifted past its leading axis)."""
        self._take_writes()
        group = self._param_group(p)
        parts = self._group_of(group).parts(self.state[p]["element"])
        if isinstance(p, SHARDED):
            return {k: as_dtensor(v.detach().clone(), p) for k, v in parts.items()}
        return {k: v.detach().clone() for k, v in parts.items()}

    @torch.no_grad()
    def set_group_element(self, p: Tensor, element: Tensor) -> None:
        """Replace ``p``'s group element (shape ``group.element_shape(p.shape)``: of a sharded
        parameter, a DTensor as :meth:`group_element` places its parts, or its local shard)
        and write the new point estimate into ``p``; momentum is kept."""
        group = self._param_group(p)
        if "element" not in self.state.get(p, {}):
            self._init_states(group, [p])
        state = self.state[p]
        if isinstance(element, SHARDED):  # placed as group_element places it: its local shard
            placed = as_dtensor(state["element"], p)
            element = local(element.redistribute(placed.device_mesh, placed.placements))
        if element.shape != state["element"].shape:
            raise ValueError(f"element: expected shape {tuple(state['element'].shape)}")
        ok, reason = self._group_of(group).check_element(element)
        if not ok:
            raise ValueError(f"element: {reason}")
        state["element"].copy_(element)
        self._write_point(group, [local(p)], [state["element"]], self._point_mean(group))
        self._mark_writes()

    def memory(self) -> dict[str, int]:
        """Bytes this process holds: ``"state"`` (elements and momenta; of a sharded
        parameter, its shard's), ``"scratch"`` (accumulators, noise and other per-step
        buffers, made at the first step) and ``"noise"`` (noise tables, antithetic draws)."""
        state = sum(t.nbytes for s in self.state.values() for t in s.values())
        return {"state": state, "scratch": self._scratch.nbytes, "noise": self.noise_source.nbytes}

    @property
    def seed(self) -> int:
        """Seed of the optimizer's noise."""
        return self.noise_source.seed

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for non-finite values since construction (or the loaded state's)."""
        return self._engine.skipped

    # ------------------------------------------------------- posterior and prior
    def posterior(self, model: nn.Module | None = None) -> Posterior:
        """The current posterior, detached from the optimizer: per trained parameter its group
        element, group and base, keyed by ``model``'s parameter names when given, else by
        position in the order of the param groups (that of ``model.parameters()`` for an
        optimizer built from it). Sharded (FSDP2) parameters' elements are gathered whole (a
        collective: call it on every rank). Parameters without state yet (never trained,
        e.g. frozen) are left out, recorded in ``missing`` and named in a warning. A value
        written into a parameter since the optimizer's last call is adopted first.

        Raises:
            ValueError: ``model`` lacks one of the optimizer's parameters.
        """
        self._take_writes()
        names = None if model is None else {id(p): n for n, p in model.named_parameters()}
        entries: dict[str | int, PosteriorEntry] = {}
        missing: list[str | int] = []
        position = 0
        for group in self.param_groups:
            for p in group["params"]:
                key: str | int = position if names is None else names.get(id(p), -1)
                if key == -1:
                    raise ValueError(
                        f"model: the optimizer's parameter {position} (shape {tuple(p.shape)}) "
                        "is not among model.named_parameters(); pass the model the optimizer "
                        "was built from"
                    )
                state, position = self.state.get(p, {}), position + 1
                if "element" not in state:
                    missing.append(key)
                    continue
                element = whole(state["element"].detach(), p)
                G = self._group_of(group)
                entries[key] = PosteriorEntry(element, G, group["base"], p.shape)
        if missing:
            warn(
                f"Posterior: {len(missing)} parameter(s) without optimizer state (never "
                f"trained, e.g. frozen) left out: {missing}",
            )
        return Posterior(
            entries, point_estimate=self.point_convention, missing=missing, size=position
        )

    def set_prior(
        self,
        posterior: Posterior | None,
        model: nn.Module | None = None,
        *,
        strength: float = 1.0,
    ) -> None:
        r"""Use ``posterior`` as the prior: the update takes (τ/N)·∇KL(q ‖ posterior) in place
        of the N(0, 1/δ) prior and the entropy term for every parameter it covers (``None``:
        back to those). A posterior keyed by names needs the ``model`` that names the
        parameters (else its entries are matched to the trained parameters in order).

        ``strength`` w > 0 tempers the prior to :math:`q_\text{prev}^w/Z`: only the
        cross-entropy is weighted, the entropy keeps weight 1,

        .. math::
            E_q[\bar\ell] + \frac{\tau}{N}\big[-H(q) - w\,E_q\log q_\text{prev}\big]
            = E_q[\bar\ell] + \frac{\tau}{N}\,\mathrm{KL}(q\,\|\,q_\text{prev}^w/Z)
            + \text{const},

        whose gradient is :math:`\frac{\tau}{N}[w\nabla\mathrm{KL}(q\|q_\text{prev})
        - (1 - w)\nabla H(q)]`. w = 1 (the default) is exact sequential Bayes; for a Gaussian
        :math:`\mathcal N(m, P^{-1})` the tempered prior is :math:`\mathcal N(m, (wP)^{-1})`,
        so w > 1 pulls back harder (with :class:`~liegroup_blr.AffineBLR`'s Gaussian base the
        penalty on the mean is :math:`w(N_\text{prev}H + \delta)/N`, EWC's at λ = w) and
        w < 1 lets the new task move further; :class:`~liegroup_blr.AdditiveBLR` (fixed
        covariance σ²I) feels it as the pull :math:`w\tau/(N\sigma^2)\,(m - m_\text{prev})`.
        Saved in :meth:`state_dict`.

        Raises:
            ValueError: in one line, for a ``strength`` that is not a finite float > 0, a
                posterior whose parameters, shapes, group or base do not match, a Dirac base
                (infinite KL), or a covered parameter whose param group has
                ``prior_precision > 0`` or ``weight_decay > 0``.
        """
        strength = check_strength(strength)
        if posterior is not None and self._mesh_param is not None:
            raise NotImplementedError(
                "set_prior: not with sharded (DTensor, FSDP2) parameters yet; train the next "
                "task with DistributedDataParallel, or on one process"
            )
        if posterior is None:
            self._engine.prior = None
            return
        params = self._params()
        trained = [p for p in params if p.requires_grad]
        self._engine.prior = prior_for(
            posterior,
            params,
            trained,
            model,
            self._param_group,
            self._group_of,
            self.mc_samples,
            strength,
        )

    @torch.no_grad()
    def next_task(self, data_size: float, *, strength: float = 1.0) -> Posterior:
        r"""Start the next task of a sequence: the current posterior becomes the prior
        (:meth:`set_prior`), every param group's ``data_size`` becomes N_t = ``data_size`` and
        its ``prior_precision`` (and ``weight_decay``) 0 (the posterior replaces the N(0, 1/δ)
        prior), and the momenta are reset to 0. Kept: the elements (the task starts from the
        posterior), the step sizes and other hyperparameters, lr schedules, the noise
        generators and the skip count. Returns the new prior.

        ``strength`` w > 0 makes the prior the tempered posterior :math:`q_\text{prev}^w/Z`
        (:meth:`set_prior`): the objective is
        :math:`E_q[\bar\ell] + \frac{\tau}{N}[-H(q) - w\,E_q\log q_\text{prev}]`, only the
        cross-entropy weighted. w = 1 (the default): exact sequential Bayes; w > 1: a stronger
        pull back to the previous posterior; w < 1: a weaker one.

        Raises:
            ValueError: in one line, for a ``strength`` that is not a finite float > 0
                (before anything changes).
            RuntimeError: between ``sampled_params(train=True)`` blocks and ``step()``.
        """
        strength = check_strength(strength)
        if self._engine.samples:
            raise RuntimeError("next_task() between sampled_params(train=True) and step()")
        for group in self.param_groups:
            group["data_size"] = data_size
            group["prior_precision"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
            self._validate(group)
        posterior = self.posterior()
        self.set_prior(posterior, strength=strength)
        for state in self.state.values():
            state["momentum"].zero_()
        return posterior

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, plus the noise generators' states (training and prediction draws),
        the skip count and the prior.

        The dict holds each parameter's ``{"element", "momentum"}`` (DTensors for sharded
        parameters, for ``torch.distributed.checkpoint``), the param groups without their
        base distributions and Lie groups (they belong to the construction, like the
        parameters, so the dict loads with ``torch.load(weights_only=True)``, and
        :meth:`load_state_dict` keeps those the optimizer was built with) but with the rule
        that made them, ``"seed"``, ``"rng"`` (the training generators, as they were before
        the parameters' resident sample, which loading draws again), ``"predict_rng"``,
        ``"skipped_steps"`` and the prior's elements by position (``"prior"``) and strength
        (``"prior_strength"``).
        """
        if self._engine.block == "sampled_params" or self._engine.samples:
            raise RuntimeError("state_dict() between sampled_params(train=True) and step()")
        self._take_writes()
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        params = self._params()
        for i, p in enumerate(params):  # sharded like their parameters, for DCP
            if isinstance(p, SHARDED) and i in sd["state"]:
                sd["state"][i] = {k: as_dtensor(v, p) for k, v in sd["state"][i].items()}
        for group, live in zip(sd["param_groups"], self.param_groups, strict=True):
            group.pop("base", None)
            group.pop("group", None)
            group["rule"] = self._describe(live)
        now = self.noise_source.state_dict()
        noise = self._holding.rng or now  # before the parameters' sample, if any
        sd["rng"], sd["seed"] = noise["rng"], noise["seed"]
        sd["predict_rng"] = now["predict_rng"]  # prediction draws: as they are now
        sd["skipped_steps"] = self._engine.skipped
        if self._engine.prior is not None:
            sd["prior"] = self._engine.prior.state_dict(params)
            sd["prior_strength"] = self._engine.prior.strength
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (after the load pre-hooks, as torch.optim does):
        states, hyperparameters, noise generators, the prior; the parameters then hold the
        loaded point estimate (or the saved training sample, drawn again). Group state stays in
        float32 for half-precision parameters."""
        state_dict = state_dict.copy()
        hooks = self._optimizer_load_state_dict_pre_hooks
        for hook in hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        keys = ("rng", "predict_rng", "seed", "skipped_steps", "prior", "prior_strength")
        extras = {k: state_dict.pop(k) for k in keys if k in state_dict}
        self._check_rules(state_dict["param_groups"])
        state_dict["param_groups"] = [
            {k: v for k, v in g.items() if k != "rule"} for g in state_dict["param_groups"]
        ]
        kept: list[dict[str, Any]] = [
            {k: g[k] for k in ("base", "group") if k in g} for g in self.param_groups
        ]
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # applied above
        self._optimizer_load_state_dict_post_hooks = OrderedDict()  # run once loaded
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        self._load_states(state_dict)
        for group, construction in zip(self.param_groups, kept, strict=True):
            group.update(construction)
        self._load_engine(extras)
        self._end_step()  # a loaded state starts between steps
        self._scratch.clear()
        self.noise_source.end_step()
        self._upgrade(self.param_groups)
        self._holding.between_steps(self)  # the point estimate, or the saved sample drawn again
        self._hold_point(frozen=False)
        self._mark_writes()
        for post_hook in post_hooks.values():
            post_hook(self)

    def _check_rules(self, saved_groups: list[dict[str, Any]]) -> None:
        """Refuse param groups saved by another rule or group."""
        for i, (saved, live) in enumerate(zip(saved_groups, self.param_groups, strict=False)):
            if saved.get("rule", self._describe(live)) != self._describe(live):
                raise ValueError(
                    f"state_dict: param group {i} was saved by {saved['rule']!r}, this "
                    f"optimizer's is {self._describe(live)!r}"
                )

    def _load_states(self, state_dict: dict[str, Any]) -> None:
        """Each parameter's loaded state, local shards in the state dtype (undoing the cast
        of torch.optim's load to the parameter's dtype)."""
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for i, p in zip(ids, self._params(), strict=True):
            if i in saved:
                self.state[p] = {
                    k: local(v).to(device=p.device, dtype=state_dtype(p))
                    for k, v in saved[i].items()
                }

    def _load_engine(self, extras: dict[str, Any]) -> None:
        """The noise generators, skip count and prior of a state dict (a prior saved without
        ``"prior_strength"``, before it could be set, has strength 1)."""
        if "rng" in extras:
            self.noise_source.load_state_dict(
                {
                    "seed": extras.get("seed", self.seed),
                    "rng": extras["rng"],
                    "predict_rng": extras.get("predict_rng", {}),
                }
            )
            self.noise_source.make_generators(list(self.state))
        else:
            warn(
                "load_state_dict: no noise state ('rng'; torch.distributed.checkpoint's "
                "get_optimizer_state_dict keeps only 'state' and 'param_groups'), so the noise "
                "goes on from this optimizer's generators; checkpoint "
                "liegroup_blr.optim.TrainingState(model, optimizer) to resume bit for bit",
            )
        self._engine.skipped = int(extras.get("skipped_steps", 0))
        saved = extras.get("prior")
        strength = extras.get("prior_strength", 1.0)
        self._engine.prior = (
            None
            if saved is None
            else Prior.from_state_dict(saved, self._params(), self.mc_samples, strength)
        )

    def _upgrade(self, param_groups: list[dict[str, Any]]) -> None:
        """Fill in what param groups of older state dicts lack."""

    def __getstate__(self) -> dict[str, Any]:
        """Everything a copy needs to continue exactly like this optimizer (hooks and the
        process group excepted, as torch.optim leaves hooks out)."""
        state = {k: v for k, v in self.__dict__.items() if not k.endswith("_hooks")}
        state.pop("step", None)  # an lr scheduler's wrapper: it would step the original
        state["process_group"] = None
        return state
