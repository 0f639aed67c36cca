"""Param groups and their group state: validation, lazy initialisation, the tensors of a step,
elements, state dicts.

:class:`GroupStateOptimizer` is the half of :class:`~liegroup_blr.optim.BLROptimizer` that
knows nothing of sampling: each trained parameter's state ``{"element", "momentum"}`` (in
float32 for half-precision parameters), made when the parameter is first trained; each param
group's tensors gathered once per step for its rule (:class:`~.tensors.GroupTensors`); and the
state dict that resumes it bit for bit (noise generators included) or a deep copy that
continues exactly like the original.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..groups import LieGroup
from ..noise import NoiseSource
from . import statedicts
from .checks import check_hyperparameters, check_number
from .distributed import SHARDED, as_dtensor, check_sharded, local, shard_of
from .options import EngineState
from .outside import mark_writes, take_writes
from .scratch import Scratch, state_dtype
from .tensors import GroupTensors, Proposal, SampleGrads

__all__ = ["GroupStateOptimizer", "state_dtype"]


class GroupStateOptimizer(Optimizer):
    """Param groups with a Lie-group element and a momentum per trained parameter.

    Subclasses set the attributes annotated below before ``Optimizer.__init__`` and define
    ``_init_state`` and ``_write_point``.
    """

    lie_group: LieGroup
    mc_samples: int
    point_convention: str
    between_steps: str
    compile: bool
    grad_scaler: torch.amp.GradScaler | None
    noise_source: NoiseSource
    process_group: Any
    _engine: EngineState
    _scratch: Scratch
    _mesh_param: Tensor | None = None
    """A sharded parameter, whose device mesh agrees on skips (``None``: no sharded one)."""
    groups_per_param_group = False
    """Whether a param group may set its own Lie group (key ``"group"``)."""

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
        prior: list[Tensor] | None,
        draw: bool,
    ) -> Proposal | None:
        """The update from the accumulators (n samples) and the deferred ``sample`` (its
        noise and gradients: not yet in them, and then the only one, ``n = 1``), with the
        prior's part of the algebra gradient, (τ/N)∇KL(q ‖ prior) per tensor, in place of the
        entropy's when the optimizer has a prior; ``None`` rejects the step. With ``draw``
        (a compiled one-sample step, ``between_steps="sample"``; the next sample's ξ' is in
        the accumulators) the update writes the next sample θ = readout(g'·ξ') into the
        parameters and its noise into ``t.noise`` instead of the point estimate."""
        raise NotImplementedError

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """Initial ``{"element", "momentum"}`` of ``p`` (state dtype, p's device)."""
        raise NotImplementedError

    def _write_point(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        elements: list[Tensor],
        mean: float | None,
    ) -> None:
        """``params ← point estimate`` of their ``elements`` (read at E[ξ] = ``mean`` when it
        is not ``None``)."""
        raise NotImplementedError

    def _sample_value(
        self,
        group: dict[str, Any],
        elements: list[Tensor],
        noise: list[Tensor],
        out: list[Tensor],
    ) -> None:
        """``out ← θ`` of a sample with the given ``noise`` (:attr:`Sample.noise`), computed as
        :meth:`_draw` computes it (to compare with what the parameters hold)."""
        raise NotImplementedError

    def _point_mean(self, group: dict[str, Any]) -> float | None:
        """E[ξ] under ``point_estimate="mean"``, else ``None``."""
        return float(group["base"].mean) if self.point_convention == "mean" else None

    def _reference(self, group: dict[str, Any], p: Tensor, mean: float | None) -> Tensor:
        """ξ₀ at which the point estimate of ``p`` is read: E[ξ] when ``mean`` is given."""
        G, dtype = self._group_of(group), state_dtype(p)
        if mean is not None:
            return torch.full(G.base_shape(p.shape), mean, dtype=dtype, device=p.device)
        return G.reference_point(p.shape, dtype=dtype, device=p.device)

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

    # ------------------------------------------------------------- the tensors
    def _group_of(self, group: dict[str, Any]) -> LieGroup:
        """The Lie group of a param group (its own ``"group"``, where the rule allows one)."""
        return group.get("group", self.lie_group)

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

    def _between_steps(self) -> None:
        """Write what the parameters hold between steps (here: the point estimates)."""
        self._restore()

    def restore(self, frozen: bool = False) -> None:
        """Write the point estimate into every trained parameter (``frozen``: also into those
        frozen since they were trained). With ``between_steps="sample"`` the parameters then
        hold no training sample: the next ``step(closure)`` draws one, and a closure-free
        ``step()`` refuses (its gradients would be the point estimate's). A value written into
        a parameter since the optimizer's last call is adopted first: it is the point."""
        take_writes(self)
        self._restore(frozen)
        mark_writes(self)

    def _restore(self, frozen: bool = False) -> None:
        """:meth:`restore`, inside the optimizer's own calls."""
        self._write_points(frozen)
        self._engine.resident = None

    @torch.no_grad()
    def _write_points(self, frozen: bool = False) -> None:
        """Write the point estimates (as :meth:`restore`), keeping any training sample's
        bookkeeping."""
        for group in self.param_groups:
            params = [p for p in group["params"] if (frozen or p.requires_grad) and p in self.state]
            if params:
                elements = [self.state[p]["element"] for p in params]
                params = [local(p) for p in params]
                self._write_point(group, params, elements, self._point_mean(group))

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
            antithetic=self.noise_source.antithetic,
            point_estimate=self.point_convention,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validate its hyperparameters and initialise the state of its
        trained parameters (a parameter frozen now gets its state when first trained)."""
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

    # ------------------------------------------------------------ public API
    def group_element(self, p: Tensor) -> dict[str, Tensor]:
        """Named components of ``p``'s current group element (detached copies):
        ``{'m'}`` additive, ``{'g+', 'g-'}`` multiplicative, ``{'A', 'b'}`` affine, ``{'g'}``
        for groups without named parts. Of a sharded parameter, DTensors placed as ``p``
        (a stacked component keeps ``p``'s placements shifted past its leading axis)."""
        take_writes(self)
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
        mark_writes(self)

    def _describe(self, group: dict[str, Any]) -> str:
        """What a param group's state means: the rule and its Lie group."""
        G = self._group_of(group)
        return f"{type(self).__name__}, {type(G).__name__}({G.extra_repr()})"

    def _param_group(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("p: not a parameter of this optimizer")

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

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, plus the noise generators' states (training and prediction draws)
        and the skip count.

        Base distributions (and per-group Lie groups) belong to the construction, like the
        parameters: they are left out (so the dict loads with ``torch.load(weights_only=True)``)
        and :meth:`load_state_dict` keeps those the optimizer was built with.
        """
        return statedicts.save(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (after the load pre-hooks, as torch.optim does):
        states, hyperparameters, noise generators; the parameters then hold the loaded point
        estimate. Group state stays in float32 for half-precision parameters."""
        statedicts.load(self, state_dict)

    _extra_state_keys: tuple[str, ...] = ()
    """Top-level state-dict entries of a subclass (:meth:`_extra_state`)."""

    def _extra_state(self) -> dict[str, Any]:
        """A subclass's top-level state-dict entries."""
        return {}

    def _load_extra_state(self, extras: dict[str, Any]) -> None:
        """Restore :meth:`_extra_state` (absent keys: a state dict saved without them)."""

    def _upgrade(self, param_groups: list[dict[str, Any]]) -> None:
        """Fill in what param groups of older state dicts lack."""

    def __getstate__(self) -> dict[str, Any]:
        """Everything a copy needs to continue exactly like this optimizer (hooks and the
        process group excepted, as torch.optim leaves hooks out)."""
        state = {k: v for k, v in self.__dict__.items() if not k.endswith("_hooks")}
        state.pop("step", None)  # an lr scheduler's wrapper: it would step the original
        state["process_group"] = None
        return state
