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

import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..groups import LieGroup
from ..noise import NoiseSource
from .checks import check_hyperparameters
from .distributed import SHARDED, as_dtensor, check_sharded, local, shard_of
from .options import EngineState
from .scratch import Scratch, state_dtype
from .tensors import GroupTensors

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

    def _point_mean(self, group: dict[str, Any]) -> float | None:
        """E[ξ] under ``point_estimate="mean"``, else ``None``."""
        return float(group["base"].mean) if self.point_convention == "mean" else None

    # ------------------------------------------------------------- the tensors
    def _group_of(self, group: dict[str, Any]) -> LieGroup:
        """The Lie group of a param group."""
        return self.lie_group

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
        G = self._group_of(group)
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
            mean=self._point_mean(group),
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
        self.restore()

    def restore(self, frozen: bool = False) -> None:
        """Write the point estimate into every trained parameter (``frozen``: also into those
        frozen since they were trained). With ``between_steps="sample"`` the parameters then
        hold no training sample: the next ``step(closure)`` draws one, and a closure-free
        ``step()`` refuses (its gradients would be the point estimate's)."""
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
        """Named components of ``p``'s current group element (detached copies; of a sharded
        parameter, its local shard's): ``{'m'}`` additive, ``{'g+', 'g-'}`` multiplicative,
        ``{'A', 'b'}`` affine, ``{'g'}`` for groups without named parts."""
        group = self._param_group(p)
        parts = self._group_of(group).parts(self.state[p]["element"])
        return {k: v.detach().clone() for k, v in parts.items()}

    @torch.no_grad()
    def set_group_element(self, p: Tensor, element: Tensor) -> None:
        """Replace ``p``'s group element (shape ``group.element_shape(p.shape)``; of a sharded
        parameter, its local shard's) and write the new point estimate into ``p``; momentum
        is kept."""
        group = self._param_group(p)
        if "element" not in self.state.get(p, {}):
            self._init_states(group, [p])
        state = self.state[p]
        if element.shape != state["element"].shape:
            raise ValueError(f"element: expected shape {tuple(state['element'].shape)}")
        ok, reason = self._group_of(group).check_element(element)
        if not ok:
            raise ValueError(f"element: {reason}")
        state["element"].copy_(element)
        self._write_point(group, [local(p)], [state["element"]], self._point_mean(group))

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
        """Optimizer state, plus the noise generators' states and the skip count.

        Base distributions (and per-group Lie groups) belong to the construction, like the
        parameters: they are left out (so the dict loads with ``torch.load(weights_only=True)``)
        and :meth:`load_state_dict` keeps those the optimizer was built with.
        """
        if self._engine.holding == "sampled_params" or self._engine.samples:
            raise RuntimeError("state_dict() between sampled_params(train=True) and step()")
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in enumerate(params):  # sharded like their parameters, for DCP
            if isinstance(p, SHARDED) and i in sd["state"]:
                sd["state"][i] = {k: as_dtensor(v, p) for k, v in sd["state"][i].items()}
        for group, live in zip(sd["param_groups"], self.param_groups, strict=True):
            group.pop("base", None)
            group.pop("group", None)
            group["rule"] = self._describe(live)
        now = self.noise_source.state_dict()
        noise = self._engine.resident_rng or now  # before the parameters' sample, if any
        sd["rng"], sd["seed"] = noise["rng"], noise["seed"]
        sd["predict_rng"] = now["predict_rng"]  # prediction draws: as they are now
        sd["skipped_steps"] = self._engine.skipped
        sd.update(self._extra_state())
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (after the load pre-hooks, as torch.optim does):
        states, hyperparameters, noise generators; the parameters then hold the loaded point
        estimate. Group state stays in float32 for half-precision parameters."""
        state_dict = state_dict.copy()
        hooks = self._optimizer_load_state_dict_pre_hooks
        for hook in hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        keys = ("rng", "predict_rng", "seed", "skipped_steps", *self._extra_state_keys)
        extras = {k: state_dict.pop(k) for k in keys if k in state_dict}
        for i, (saved_group, live) in enumerate(
            zip(state_dict["param_groups"], self.param_groups, strict=False)
        ):
            if saved_group.get("rule", self._describe(live)) != self._describe(live):
                raise ValueError(
                    f"state_dict: param group {i} was saved by {saved_group['rule']!r}, "
                    f"this optimizer's is {self._describe(live)!r}"
                )
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
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params, strict=True):
            if i in saved:  # undo Optimizer's cast of state to the parameter dtype
                self.state[p] = {
                    k: local(v).to(device=p.device, dtype=state_dtype(p))
                    for k, v in saved[i].items()
                }
        for group, construction in zip(self.param_groups, kept, strict=True):
            group.update(construction)
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
            warnings.warn(
                "load_state_dict: no noise state ('rng'; torch.distributed.checkpoint's "
                "get_optimizer_state_dict keeps only 'state' and 'param_groups'), so the noise "
                "goes on from this optimizer's generators; checkpoint "
                "liegroup_blr.optim.TrainingState(model, optimizer) to resume bit for bit",
                UserWarning,
                stacklevel=2,
            )
        self._engine.skipped = int(extras.get("skipped_steps", 0))
        self._load_extra_state(extras)
        self._engine.end_step()  # a loaded state starts between steps
        self._scratch.clear()
        self.noise_source.end_step()
        self._upgrade(self.param_groups)
        self._between_steps()  # the point estimate, or the saved sample drawn again
        for post_hook in post_hooks.values():
            post_hook(self)

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
