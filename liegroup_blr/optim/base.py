r"""The torch face of every Lie-group rule: :class:`BLROptimizer`.

It keeps what ``torch.optim`` users meet: param groups and each trained parameter's state
``{"element", "momentum"}`` (in float32 for half-precision parameters), ``step``, the sample
protocol (``draw``, ``accumulate``, ``discard``), the blocks that hold a sample or the point
estimate, ``posterior()`` and the prior, state dicts that resume bit for bit. It composes the
rest: the rule's arithmetic (:class:`~.rule.Rule`), the Monte-Carlo loop that runs it and owns
a step's state (:class:`~.engine.Engine`, with the noise source, the holding, the scratch
buffers and the sharded parameters; only its own operations are called here), the adoption
of writes made outside it (:class:`~.writes.Writes`, wrapped around every public method by
:func:`~.writes.adopts_writes`), and ``torch.amp.GradScaler`` unscaling (:mod:`~.amp`). What
it keeps itself is the block it is inside (:class:`Block`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributions import Distribution
from torch.optim import Optimizer

from .._userline import warn
from ..distributions import describe
from ..groups import LieGroup
from ..noise import NoiseSource, noise_source
from ..posterior import POINT_AT, Posterior, PosteriorEntry
from ..sharding import local, whole
from .amp import scaler_step
from .checks import check_choice, check_count, check_hyperparameters, check_number
from .distributed import broadcast_elements, replicas, shared_seed
from .engine import ENGINE_KEYS, Engine
from .holding import HOLDINGS
from .prior import check_next_prior, check_strength, prior_for, task_reset
from .rule import Rule
from .saved import check_saved_shapes, load_states
from .tensors import Sample
from .writes import Writes, adopts_writes

__all__ = ["BLROptimizer"]

Loss = TypeVar("Loss", bound=float | Tensor | None)
"""What a closure returns, and :meth:`BLROptimizer.step` with it."""


GROUP_KEYS = ("lr", "momentum", "base", "data_size", "temperature", "prior_precision")
"""The hyperparameters every rule's param groups hold (:class:`BLROptimizer`'s ``defaults``)."""


def optimizer_repr(optimizer: Optimizer) -> str:
    """``torch.optim.Optimizer``'s repr, each distribution as
    :func:`~liegroup_blr.distributions.describe` writes it (``scale: 0.005``)."""
    text = f"{type(optimizer).__name__} ("
    for i, group in enumerate(optimizer.param_groups):
        text += f"\nParameter Group {i}\n"
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            shown = describe(value) if isinstance(value, Distribution) else value
            text += f"    {key}: {shown}\n"
    return text + ")"


@dataclass
class Block:
    """The block an optimizer is inside, in one object its wrappers share (a wrapper that
    copies the optimizer's ``__dict__``, as Lightning's does, shares it).

    Attributes:
        name: ``"sampled_params"`` or ``"point_estimate"`` inside such a block, else ``""``.
        kept: inside a ``point_estimate`` block, what each parameter (its local tensor) holds
            after it.
    """

    name: str = ""
    kept: dict[Tensor, Tensor] = field(default_factory=dict)


class BLROptimizer(Optimizer):
    r"""The torch optimizer of a Lie-group rule: param groups, state, step and state dicts.

    Each trained parameter θ is the readout of :math:`g \cdot \xi`, :math:`\xi \sim q_0`, with
    its own group element g; outside :meth:`sampled_params` it holds the point estimate (or,
    ``between_steps="sample"``, a sample). The sample protocol (:meth:`draw`,
    :meth:`accumulate`, :meth:`restore`, :attr:`pending_samples`) is what
    :func:`~liegroup_blr.mc.mc_step` and custom loops use. The keyword-only arguments after
    ``point_at`` are the engine's options, :class:`~liegroup_blr.optim.EngineOptions`.
    The rules' classes (:class:`~liegroup_blr.AdditiveBLR`, …) compose their
    :class:`~liegroup_blr.optim.rule.Rule` with it; a new rule is a ``Rule`` passed here.

    Args:
        params: parameters or param groups.
        defaults: per-group hyperparameters (``lr``, ``momentum``, ``base``, ``data_size``,
            ``temperature``, ``prior_precision`` and the rule's own).
        rule: the rule's arithmetic, on its Lie group.
        mc_samples: S ≥ 1 samples per :meth:`step` with a closure.
        point_at: where the point estimate is read
            (:data:`~liegroup_blr.posterior.POINT_AT`): ``"g"`` (at ξ₀ of the group) or
            ``"mean"`` (at E[ξ]).
        point_estimate: deprecated, ``point_at`` (the name of the block
            :meth:`point_estimate`); taken with a DeprecationWarning for one release.
    """

    _step_supports_amp_scaling = True  # GradScaler.step(opt) drives step(): see amp.py
    __repr__ = optimizer_repr  # torch.optim's, the bases' parameters in their shortest decimals

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        rule: Rule,
        *,
        mc_samples: int = 1,
        point_at: str = "g",
        between_steps: str = "point",
        seed: int | None = None,
        noise: str | NoiseSource = "fresh",
        antithetic: bool = False,
        table_size: int | None = None,
        compile: bool = False,
        process_group: Any = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        max_consecutive_skips: int | None = 20,
        prior: Posterior | None = None,
        point_estimate: str | None = None,
    ) -> None:
        if point_estimate is not None:
            warn(
                f"{type(self).__name__}(point_estimate=...) is now point_at=...: the old "
                "keyword goes in the next release",
                DeprecationWarning,
            )
            point_at = point_estimate
        if not isinstance(rule, Rule) or not isinstance(rule.lie_group, LieGroup):
            raise ValueError(
                f"rule: expected a liegroup_blr.optim.rule.Rule on a LieGroup, got {rule!r}"
            )
        check_count("mc_samples", mc_samples)
        check_choice("point_at", point_at, POINT_AT)
        if max_consecutive_skips is not None:
            check_count("max_consecutive_skips", max_consecutive_skips)
        check_choice("between_steps", between_steps, tuple(HOLDINGS))
        self.between_steps = between_steps
        replicated = replicas(process_group)
        source = noise_source(noise, antithetic=antithetic, table_size=table_size)
        rank = 0 if process_group is None else dist.get_rank(process_group)
        source.bind(shared_seed(seed, process_group, replicated), rank)
        rule.bind(source, bool(compile))
        self._rule = rule
        self._engine = Engine(
            self,
            rule,
            source,
            between_steps,
            mc_samples=mc_samples,
            point_at=point_at,
            compile=bool(compile),
            process_group=process_group,
            grad_scaler=grad_scaler,
            max_consecutive_skips=max_consecutive_skips,
        )
        self._writes = Writes(self._engine)
        self._block = Block()
        super().__init__(params, defaults)
        if process_group is not None or replicated is not None:
            broadcast_elements(self.state, process_group if replicated is None else replicated)
            self._engine.write_points()
        if prior is not None:
            self.set_prior(prior)
        self._engine.start()  # gradients from before construction are nobody's
        self._writes.mark()

    # ------------------------------------------------------------- options
    @property
    def lie_group(self) -> LieGroup:
        """The Lie group (of every param group without its own ``"group"``)."""
        return self._rule.lie_group

    @property
    def noise_source(self) -> NoiseSource:
        """The optimizer's noise (:mod:`liegroup_blr.noise`)."""
        return self._engine.noise

    @property
    def mc_samples(self) -> int:
        """S, the samples per :meth:`step` with a closure."""
        return self._engine.mc_samples

    @property
    def point_at(self) -> str:
        """The place the point estimate is read at, ``"g"`` (ξ₀) or ``"mean"`` (E[ξ])."""
        return self._engine.point_at

    @property
    def point_convention(self) -> str:
        """The deprecated name of :attr:`point_at`."""
        warn(
            "point_convention is now point_at: the old name goes in the next release",
            DeprecationWarning,
        )
        return self._engine.point_at

    @property
    def compile(self) -> bool:
        """Whether updates run through ``torch.compile``."""
        return self._engine.compile

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` group whose accumulators are summed, if any."""
        return self._engine.process_group

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The ``torch.amp.GradScaler`` whose scale the samples' gradients carry, if any."""
        return self._engine.grad_scaler

    @property
    def max_consecutive_skips(self) -> int | None:
        """Skipped steps in a row after which a step raises ``FloatingPointError`` (default
        20; ``None``: never). Only the first skipped step warns; later ones are counted in
        :attr:`skipped_steps`."""
        return self._engine.max_consecutive_skips

    # ----------------------------------------------------------- param groups
    def _validate(self, options: dict[str, Any]) -> None:
        """Raise ValueError naming the first invalid hyperparameter of a param group."""
        if "group" in options and not self._rule.groups_per_param_group:
            raise ValueError(
                f"group: {type(self).__name__} has a fixed Lie group; use "
                "liegroup_blr.LieGroupBLR for a Lie group per param group"
            )
        G = options.get("group", self._rule.lie_group)
        if not isinstance(G, LieGroup):
            raise ValueError(f"group: expected a liegroup_blr.groups.LieGroup, got {G!r}")
        missing = [k for k in GROUP_KEYS if k not in options]
        if missing:
            raise ValueError(
                f"defaults: missing {', '.join(missing)}; a param group of every rule needs "
                f"{', '.join(GROUP_KEYS)} (and its rule's own)"
            )
        if "weight_decay" in options:  # Hugging Face's groups carry one
            check_number(options, "weight_decay", 0.0)
        check_hyperparameters(
            options,
            G,
            antithetic=self.noise_source.needs_symmetric_base,
            point_at=self.point_at,
        )
        self._rule.validate(options)

    @property
    def holds_samples(self) -> bool:
        """Whether the parameters hold a posterior sample between steps
        (``between_steps="sample"``) rather than the point estimate."""
        return self._engine.holds_samples

    @adopts_writes(take=False)
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validate its hyperparameters and initialise the state of its
        trained parameters (a parameter frozen now gets its state when first trained); with
        ``between_steps="sample"`` every trained parameter then holds a fresh sample."""
        options = {k: v for k, v in param_group.items() if k != "params"}
        self._validate({**self.defaults, **options})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            try:
                if not p.is_floating_point():
                    raise ValueError(f"params: only floating-point parameters, got {p.dtype}")
                self._engine.admit(p, self._rule.group_of(group))
            except ValueError:
                self.param_groups.pop()
                raise
        self._engine.join(group)
        self._rule.setup(group)

    def _describe(self, group: dict[str, Any]) -> str:
        """What a param group's state means: the rule and its Lie group."""
        return f"{type(self).__name__}, {self._rule.describe(group)}"

    def _param_group(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("p: not a parameter of this optimizer")

    def _params(self) -> list[Tensor]:
        """Every parameter, in the order of the param groups."""
        return [p for group in self.param_groups for p in group["params"]]

    # --------------------------------------------------------- sample protocol
    @property
    def pending_samples(self) -> int:
        """Samples accumulated since the last update."""
        return self._engine.pending

    @torch.no_grad()
    @adopts_writes()
    def draw(self, train: bool = True) -> Sample:
        """Write a posterior sample θ = readout(g·ξ) into every trained parameter.

        With ``train=True`` the sample is one of the next step's (antithetic pairing counts
        it); pass the result to :meth:`accumulate` once its gradients are known. Drawn for
        prediction (``train=False``), ξ comes from the optimizer's prediction generators.
        """
        return self._engine.draw(train)

    @torch.no_grad()
    @adopts_writes()
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
        self._engine.accumulate(sample, grads, defer)

    @torch.no_grad()
    @adopts_writes()
    def discard(self) -> None:
        """Abandon the pending samples: nothing is accumulated, and the parameters hold the
        point estimates again (between_steps="sample": a fresh sample); gradients left by
        the abandoned samples are nobody's."""
        self._engine.abandon()

    # ------------------------------------------------------------ holding blocks
    @contextmanager
    @adopts_writes()
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold one posterior sample θ = readout(g·ξ) in the parameters for the block.

        With ``train=True`` the gradients the block leaves in ``p.grad`` are one Monte-Carlo
        sample of the next :meth:`step` (call ``zero_grad`` inside each block; the optimizer
        reads them at the next draw or update, so they must not be changed in place before).
        On exit, also on error, the parameters return to what they held before the block:
        the point estimate, or with ``between_steps="sample"`` the training sample (and
        ``train=True`` is refused there: the parameters already hold a training sample).
        """
        block = self._block
        if block.name:
            raise RuntimeError(f"sampled_params() cannot be nested inside {block.name}()")
        block.name = "sampled_params"
        try:
            with self._engine.sampled(train):
                yield
        finally:
            block.name = ""

    @contextmanager
    @adopts_writes()
    def point_estimate(self) -> Iterator[None]:
        """Hold the point estimate (``point_at="g"``: at ξ₀; ``"mean"``: at E[ξ]) in every
        parameter the optimizer has trained (frozen ones too) for the block, whatever they hold
        between steps; on exit they hold what they held before (with ``between_steps="sample"``, the
        training sample), or what a :meth:`restore` or :meth:`load_state_dict` inside the block
        wrote (the block holds the new point estimate after it)."""
        block = self._block
        if block.name:
            raise RuntimeError(f"point_estimate() cannot be nested inside {block.name}()")
        block.name = "point_estimate"
        try:
            self._hold_point(frozen=True)
            yield
        finally:
            block.name = ""
            kept, block.kept = block.kept, {}
            with torch.no_grad():
                torch._foreach_copy_(list(kept), list(kept.values()))

    @torch.no_grad()
    def _hold_point(self, frozen: bool) -> None:
        """Inside a ``point_estimate`` block: keep what the trained parameters (``frozen``:
        also those frozen since) hold now, for its end, and write the point estimates."""
        if self._block.name != "point_estimate":
            return
        params = [p for p in self._params() if p in self.state and (frozen or p.requires_grad)]
        self._block.kept.update((local(p), local(p).detach().clone()) for p in params)
        self._engine.write_points(frozen=True)

    @adopts_writes()
    def restore(self, frozen: bool = False) -> None:
        """Write the point estimate into every trained parameter (``frozen``: also into those
        frozen since they were trained). With ``between_steps="sample"`` the parameters then
        hold no training sample: the next ``step(closure)`` draws one, and a closure-free
        ``step()`` refuses (its gradients would be the point estimate's). A value written into
        a parameter since the optimizer's last call is adopted first: it is the point."""
        self._engine.restore(frozen)
        self._hold_point(frozen)

    # ------------------------------------------------------------------- step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], Loss]) -> Loss: ...

    @torch.no_grad()
    @adopts_writes()
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

        A non-finite loss, algebra gradient or updated element skips the update: group
        elements and momenta are left exactly as they were (``skipped_steps`` counts). The
        first skip warns (``RuntimeWarning``) naming what was not finite and where; after
        ``max_consecutive_skips`` skips in a row (default 20) the step raises
        ``FloatingPointError`` naming the likely fix, the parameters holding what they hold
        between steps.
        An exception in the closure abandons the step: nothing is accumulated and the
        parameters hold the point estimate again (a fresh sample in sample mode). Driven
        by ``GradScaler.step(optimizer)``, a step whose gradients hold an inf is skipped
        (the scaler backs off) and the loss scale is taken off the gradients.
        """
        engine = self._engine
        if self._block.name:
            raise RuntimeError(f"step() cannot be called inside {self._block.name}()")
        if engine.grad_scaler is None and not {"grad_scale", "found_inf"} & vars(self).keys():
            inv_scale, found_inf = 1.0, False  # no GradScaler anywhere (and no call to amp)
        else:
            inv_scale, found_inf = scaler_step(self, closure)
        loss = None
        if closure is not None:
            loss = engine.closure_samples(closure)
        else:
            engine.read_gradients()
        finite = not isinstance(loss, (Tensor, float)) or bool(
            torch.as_tensor(loss).isfinite().all()
        )
        error = engine.update(finite, inv_scale, found_inf)
        if error is not None:
            raise error
        return loss

    # ------------------------------------------------------------ elements
    @adopts_writes()
    def group_element(self, p: Tensor) -> dict[str, Tensor]:
        """Named components of ``p``'s current group element (detached copies):
        ``{'m'}`` additive, ``{'g+', 'g-'}`` multiplicative, ``{'A', 'b'}`` affine, ``{'g'}``
        for groups without named parts. Of a sharded parameter, DTensors placed as ``p``
        (a stacked component keeps ``p``'s placements shifted past its leading axis)."""
        group = self._param_group(p)
        parts = self._rule.group_of(group).parts(self.state[p]["element"])
        return self._engine.placed({k: v.detach().clone() for k, v in parts.items()}, p)

    @torch.no_grad()
    @adopts_writes(take=False)
    def set_group_element(self, p: Tensor, element: Tensor) -> None:
        """Replace ``p``'s group element (shape ``group.element_shape(p.shape)``: of a sharded
        parameter, a DTensor as :meth:`group_element` places its parts, or its local shard)
        and write the new point estimate into ``p``; momentum is kept."""
        group = self._param_group(p)
        if "element" not in self.state.get(p, {}):
            self._engine.init_states(group, [p])
        state = self.state[p]
        element = self._engine.local_like(element, state["element"], p)
        if element.shape != state["element"].shape:
            raise ValueError(f"element: expected shape {tuple(state['element'].shape)}")
        ok, reason = self._rule.group_of(group).check_element(element)
        if not ok:
            raise ValueError(f"element: {reason}")
        state["element"].copy_(element)
        mean = self._engine.point_mean(group)
        self._rule.write_point(group, [local(p)], [state["element"]], mean)

    def footprint(self) -> dict[str, int]:
        """Bytes this process holds: ``"state"`` (elements and momenta; of a sharded
        parameter, its shard's), ``"scratch"`` (accumulators, noise and other per-step
        buffers, made at the first step) and ``"noise"`` (noise tables, antithetic draws)."""
        state = sum(t.nbytes for s in self.state.values() for t in s.values())
        return {"state": state, **self._engine.nbytes()}

    def memory(self) -> dict[str, int]:
        """Deprecated: :meth:`footprint` (\"memory\" names the memory maps and the
        functional memory)."""
        warn(
            "memory() is now footprint(): the old name goes in the next release", DeprecationWarning
        )
        return self.footprint()

    @property
    def seed(self) -> int:
        """Seed of the optimizer's noise."""
        return self.noise_source.seed

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for non-finite values since construction (or the loaded state's):
        every skip, warned of (the first) or not (the later ones, and those a ``GradScaler``
        calibrating its scale expects)."""
        return self._engine.skipped

    # ------------------------------------------------------- posterior and prior
    @adopts_writes()
    def posterior(self, model: nn.Module | None = None) -> Posterior:
        """The current posterior, detached from the optimizer: per trained parameter its group
        element, group and base, keyed by ``model``'s parameter names when given, else by
        position in the order of the param groups (that of ``model.parameters()`` for an
        optimizer built from it). Sharded (FSDP2) parameters' elements are gathered whole (a
        collective: call it on every rank). Parameters without state yet (never trained,
        e.g. frozen) are left out, recorded in ``missing`` and named in a warning. A value
        written into a parameter since the optimizer's last call is adopted first. It records
        the param groups' temperature and data size (``None`` where they differ).

        Raises:
            ValueError: ``model`` lacks one of the optimizer's parameters.
        """
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
                G = self._rule.group_of(group)
                entries[key] = PosteriorEntry(element, G, group["base"], p.shape)
        if missing:
            warn(
                f"Posterior: {len(missing)} parameter(s) without optimizer state (never "
                f"trained, e.g. frozen) left out: {missing}",
            )
        taus, sizes = ({g.get(k) for g in self.param_groups} for k in ("temperature", "data_size"))
        return Posterior(
            entries,
            point_at=self.point_at,
            missing=missing,
            size=position,
            temperature=taus.pop() if len(taus) == 1 else None,
            data_size=sizes.pop() if len(sizes) == 1 else None,
        )

    @adopts_writes()
    def set_prior(
        self,
        posterior: Posterior | None,
        model: nn.Module | None = None,
        *,
        strength: float = 1.0,
    ) -> None:
        r"""Use ``posterior`` as the prior: the update takes (τ/N)·∇KL(q ‖ posterior) in place
        of the N(0, 1/δ) prior and the entropy term for every parameter it covers (``None``:
        back to those, the N(0, 1/δ) prior centred on 0 again). A posterior keyed by names
        needs the ``model`` that names the parameters (else its entries are matched to the
        trained parameters in order).

        ``strength`` w > 0 tempers the prior to :math:`q_\text{prev}^w/Z` (only the
        cross-entropy weighted: :math:`E_q[\bar\ell] + \frac{\tau}{N}[-H(q) -
        w\,E_q\log q_\text{prev}]`), whose gradient is
        :math:`\frac{\tau}{N}[w\nabla\mathrm{KL}(q\|q_\text{prev}) - (1 - w)\nabla H(q)]`.
        w = 1 (the default) is exact sequential Bayes; a Gaussian
        :math:`\mathcal N(m, P^{-1})` tempers to :math:`\mathcal N(m, (wP)^{-1})`: w > 1 pulls
        back harder, w < 1 lets the new task move further (docs/lifelong.md says what each
        rule feels). Saved in :meth:`state_dict`.

        Raises:
            ValueError: in one line, for a ``strength`` that is not a finite float > 0, a
                posterior whose parameters, shapes, group or base do not match, a Dirac base
                (infinite KL), a covered parameter whose param group has
                ``prior_precision > 0`` or ``weight_decay > 0``, or a pull a step cannot take
                stably (the additive rule's: lr·wτ/(Nσ²) ≥ 2(1+β)/(1−β)), naming the
                largest stable ``lr`` and ``strength``.
        """
        strength = check_strength(strength)
        if posterior is not None and self._engine.sharded:
            raise NotImplementedError(
                "set_prior: not with sharded (DTensor, FSDP2) parameters yet; train the next "
                "task with DistributedDataParallel, or on one process"
            )
        if posterior is None:
            self._engine.set_prior(None, {})
            return
        for group in self.param_groups:
            self._rule.check_prior(group, strength)
        params = self._params()
        trained = [p for p in params if p.requires_grad]
        prior = prior_for(
            posterior,
            params,
            trained,
            model,
            self._param_group,
            self._rule.group_of,
            self.mc_samples,
            strength,
        )
        self._engine.set_prior(prior, {})

    @torch.no_grad()
    @adopts_writes()
    def next_task(
        self,
        data_size: float,
        *,
        prior: str = "posterior",
        strength: float = 1.0,
        model: nn.Module | None = None,
    ) -> Posterior:
        r"""Start the next task of a sequence: every param group's ``data_size`` becomes
        N_t = ``data_size``, the momenta are reset to 0, and the finished task enters the
        objective as ``prior`` (``optim.prior.NEXT_PRIORS``) says:
        ``"posterior"`` (the default) makes the current posterior the prior (:meth:`set_prior`,
        at ``strength`` w: the tempered :math:`q_\text{prev}^w/Z`; w = 1 is exact sequential
        Bayes) and ``prior_precision`` (and ``weight_decay``) 0; ``"delta"`` centres each
        group's N(0, 1/δ) prior on the point estimate that ends the task (the K-prior's weight
        term, δ kept); ``"none"`` sets ``prior_precision`` (and ``weight_decay``) to 0.

        Kept: the elements, step sizes and other hyperparameters, lr schedules, noise
        generators and skip count. Returns the finished task's posterior, keyed by ``model``'s
        parameter names when given (``prior["0.weight"]``), else by position.

        Raises:
            ValueError: in one line, before anything changes: an unknown ``prior``, a
                ``strength`` that is not a finite float > 0 or given with another prior, a
                ``weight_decay`` > 0 with ``"delta"``, a ``data_size`` ≤ 0, a ``model`` without
                a parameter, or a pull a step cannot take stably (``Rule.check_prior``).
            NotImplementedError: ``"delta"`` with sharded (DTensor, FSDP2) parameters.
            RuntimeError: between ``sampled_params(train=True)`` blocks and ``step()``.
        """
        strength = check_next_prior(prior, strength, self._engine.sharded)
        if self._engine.pending:
            raise RuntimeError("next_task() between sampled_params(train=True) and step()")
        resets = [task_reset(group, data_size, prior) for group in self.param_groups]
        for group, reset in zip(self.param_groups, resets, strict=True):
            self._validate({**group, **reset})
            if prior == "posterior":
                self._rule.check_prior({**group, **reset}, strength)
        posterior = self.posterior(model)  # the finished task's: its N, before N_t replaces it
        centre = {}
        if prior == "delta":
            with self.point_estimate():
                centre = {p: p.detach().clone() for p in self._params() if p in self.state}
        for group, reset in zip(self.param_groups, resets, strict=True):
            group.update(reset)
        if prior == "posterior":
            self.set_prior(posterior, model, strength=strength)
        else:
            self._engine.set_prior(None, centre)
        for state in self.state.values():
            state["momentum"].zero_()
        return posterior

    # ------------------------------------------------------------ state dicts
    @adopts_writes()
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
        engine = self._engine
        if self._block.name == "sampled_params" or engine.pending:
            raise RuntimeError("state_dict() between sampled_params(train=True) and step()")
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        params = self._params()
        for i, p in enumerate(params):  # sharded like their parameters, for DCP
            if i in sd["state"]:
                sd["state"][i] = engine.placed(sd["state"][i], p)
        for group, live in zip(sd["param_groups"], self.param_groups, strict=True):
            group.pop("base", None)
            group.pop("group", None)
            group["rule"] = self._describe(live)
        sd.update(engine.state_dict(params))
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
        extras = {k: state_dict.pop(k) for k in ENGINE_KEYS if k in state_dict}
        self._check_rules(state_dict["param_groups"])
        if not self._engine.sharded:  # a shard's state has the shard's shape
            check_saved_shapes(state_dict, self.param_groups, self._rule)
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
        load_states(self.state, state_dict, self._params())
        for group, construction in zip(self.param_groups, kept, strict=True):
            group.update(construction)
        self._engine.load_state_dict(extras, self._params())
        self._hold_point(frozen=False)
        self._writes.mark()  # before the post hooks: what they write is adopted at the next call
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

    def __getstate__(self) -> dict[str, Any]:
        """Everything a copy needs to continue exactly like this optimizer (hooks and the
        process group excepted, as torch.optim leaves hooks out)."""
        state = {k: v for k, v in self.__dict__.items() if not k.endswith("_hooks")}
        state.pop("step", None)  # an lr scheduler's wrapper: it would step the original
        return state
