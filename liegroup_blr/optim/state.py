"""Param groups and their group state: validation, lazy initialisation, elements, state dicts.

:class:`GroupStateOptimizer` is the half of :class:`~liegroup_blr.optim.BLROptimizer` that
knows nothing of sampling: each trained parameter's state ``{"element", "momentum"}`` (in
float32 for half-precision parameters), made when the parameter is first trained, and the
state dict that resumes it bit for bit (noise generators included) or a deep copy that
continues exactly like the original.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..groups import LieGroup
from ..noise import NoiseSource
from .checks import check_hyperparameters
from .kernels import Parts, compiled, parts

__all__ = ["GroupStateOptimizer", "state_dtype"]


def state_dtype(p: Tensor) -> torch.dtype:
    """Group state is kept in float32 for half-precision parameters, else in their dtype."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


class GroupStateOptimizer(Optimizer):
    """Param groups with a Lie-group element and a momentum per trained parameter.

    Subclasses set the attributes annotated below before ``Optimizer.__init__`` and define
    ``_new_state`` and ``_write_point``.
    """

    lie_group: LieGroup
    point_estimate: str
    compile: bool
    noise_source: NoiseSource
    skipped_steps: int
    _scratch: dict[Tensor, dict[str, Tensor]]  # per parameter: reusable buffers of a step
    _views: dict[Tensor, dict[int, tuple[Tensor, Parts]]]  # per parameter: rows by tensor id
    _pending: dict[Tensor, None]  # parameters with accumulated samples
    groups_per_param_group = False
    """Whether a param group may set its own Lie group (key ``"group"``)."""
    _samples = 0  # pending Monte-Carlo samples (none: the state is between steps)
    _sampling = False

    def _new_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Tensor]:
        """Initial ``{"element", "momentum"}`` of ``p`` (state dtype, p's device)."""
        raise NotImplementedError

    def _write_point(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """``params ← point estimate`` of their elements."""
        raise NotImplementedError

    # --------------------------------------------------------------- helpers
    def _group_of(self, group: dict[str, Any]) -> LieGroup:
        """The Lie group of a param group."""
        return self.lie_group

    def _gather(self, params: list[Tensor], key: str) -> list[Tensor]:
        return [self.state[p][key] for p in params]

    def _buffer(self, p: Tensor, key: str, shape: torch.Size) -> Tensor:
        """A reusable scratch tensor of ``shape`` in ``p``'s state dtype."""
        scratch = self._scratch.setdefault(p, {})
        buf = scratch.get(key)
        if buf is None or buf.shape != shape or buf.device != p.device:
            buf = scratch[key] = torch.empty(shape, dtype=state_dtype(p), device=p.device)
            self._views.pop(p, None)
        return buf

    def _parts(
        self, params: list[Tensor], tensors: list[Tensor], stacked: bool = True
    ) -> list[Parts]:
        """Each parameter's state or scratch tensor as its :func:`~.kernels.parts`, the views
        made once per tensor and kept (a compiled kernel's call would otherwise spend a
        dispatch per tensor per step on them). Only for tensors the optimizer keeps: a
        sample's noise may be a new table window at every step."""
        out = []
        for p, t in zip(params, tensors, strict=True):
            views = self._views.setdefault(p, {})
            entry = views.get(id(t))
            if entry is None or entry[0] is not t:
                entry = views[id(t)] = (t, parts([t], stacked)[0])
            out.append(entry[1])
        return out

    def _accumulators(self, params: list[Tensor]) -> list[Tensor]:
        return [self._scratch[p]["acc"] for p in params]

    def _spares(self, params: list[Tensor]) -> list[Tensor]:
        """Element-sized scratch buffers: a proposal moves the elements into them before
        the finiteness check (:meth:`_commit` then swaps them in)."""
        return [self._buffer(p, "spare", self.state[p]["element"].shape) for p in params]

    def _swap(self, params: list[Tensor], key: str, scratch_key: str) -> None:
        """Exchange ``state[p][key]`` and the scratch buffer ``scratch_key`` (by reference)."""
        for p in params:
            state, scratch = self.state[p], self._scratch[p]
            state[key], scratch[scratch_key] = scratch[scratch_key], state[key]

    def _kernel(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        """``kernel``, compiled under ``compile=True``."""
        return compiled(kernel) if self.compile else kernel

    def _rate(self, group: dict[str, Any], key: str = "lr") -> float | Tensor:
        """A step size of ``group``: a 0-d tensor under ``compile`` (no recompiles)."""
        if not self.compile:
            return group[key]
        return torch.tensor(float(group[key]), device=group["params"][0].device)

    def _mean(self, group: dict[str, Any]) -> float | None:
        """E[ξ] under ``point_estimate="mean"``, else ``None``."""
        return float(group["base"].mean) if self.point_estimate == "mean" else None

    @staticmethod
    def _active(group: dict[str, Any]) -> list[Tensor]:
        return [p for p in group["params"] if p.requires_grad]

    # ----------------------------------------------------------- param groups
    def _validate(self, hp: dict[str, Any]) -> None:
        """Raise ValueError naming the first invalid hyperparameter of a param group."""
        if "group" in hp and not self.groups_per_param_group:
            raise ValueError(
                f"group: {type(self).__name__} has a fixed Lie group; use "
                "liegroup_blr.LieGroupBLR for a Lie group per param group"
            )
        check_hyperparameters(
            hp,
            hp.get("group", self.lie_group),
            antithetic=self.noise_source.antithetic,
            point_estimate=self.point_estimate,
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
        self._ensure_state(group, self._active(group))

    @torch.no_grad()
    def _ensure_state(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Create the state of parameters that have none (lazily, as torch.optim does)."""
        new = [p for p in params if p not in self.state or "element" not in self.state[p]]
        for p in new:
            self.state[p] = self._new_state(group, p)
        if new:
            self._write_point(group, new)

    @torch.no_grad()
    def restore(self) -> None:
        """Write the point estimate into every trained parameter."""
        for group in self.param_groups:
            params = [p for p in self._active(group) if p in self.state]
            if params:
                self._write_point(group, params)

    # ------------------------------------------------------------ public API
    def group_element(self, p: Tensor) -> dict[str, Tensor]:
        """Named components of ``p``'s current group element (detached copies):
        ``{'m'}`` additive, ``{'g+', 'g-'}`` multiplicative, ``{'A', 'b'}`` affine,
        ``{'g'}`` for groups without named parts."""
        group = self._param_group(p)
        parts = self._group_of(group).parts(self.state[p]["element"])
        return {k: v.detach().clone() for k, v in parts.items()}

    @torch.no_grad()
    def set_group_element(self, p: Tensor, element: Tensor) -> None:
        """Replace ``p``'s group element (shape ``group.element_shape(p.shape)``) and write the
        new point estimate into ``p``; momentum is kept."""
        group = self._param_group(p)
        self._ensure_state(group, [p])
        state = self.state[p]
        if element.shape != state["element"].shape:
            raise ValueError(f"element: expected shape {tuple(state['element'].shape)}")
        ok, reason = self._group_of(group).check_element(element)
        if not ok:
            raise ValueError(f"element: {reason}")
        state["element"].copy_(element)
        self._write_point(group, [p])

    def _describe(self, group: dict[str, Any]) -> str:
        """What a param group's state means: the rule and its Lie group."""
        G = self._group_of(group)
        return f"{type(self).__name__}, {type(G).__name__}({G.extra_repr()})"

    def _param_group(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise ValueError("p: not a parameter of this optimizer")

    @property
    def seed(self) -> int:
        """Seed of the optimizer's noise."""
        return self.noise_source.seed

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, plus the noise generators' states and the skip count.

        Base distributions (and per-group Lie groups) belong to the construction, like the
        parameters: they are left out (so the dict loads with ``torch.load(weights_only=True)``)
        and :meth:`load_state_dict` keeps those the optimizer was built with.
        """
        if self._sampling or self._samples:
            raise RuntimeError("state_dict() between sampled_params(train=True) and step()")
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run on the finished dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        for group, live in zip(sd["param_groups"], self.param_groups, strict=True):
            group.pop("base", None)
            group.pop("group", None)
            group["rule"] = self._describe(live)
        noise = self.noise_source.state_dict()
        sd["rng"], sd["seed"] = noise["rng"], noise["seed"]
        sd["skipped_steps"] = self.skipped_steps
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
        extras = {k: state_dict.pop(k) for k in ("rng", "seed", "skipped_steps") if k in state_dict}
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
                    k: v.to(device=p.device, dtype=state_dtype(p)) for k, v in saved[i].items()
                }
        for group, construction in zip(self.param_groups, kept, strict=True):
            group.update(construction)
        self.noise_source.load_state_dict(
            {"seed": extras.get("seed", self.seed), "rng": extras.get("rng", {})}
        )
        self.skipped_steps = int(extras.get("skipped_steps", 0))
        self._scratch.clear()  # a loaded state starts between steps
        self._views.clear()
        self._pending.clear()
        self._samples = 0
        self.noise_source.end_step()
        self._upgrade(self.param_groups)
        self.restore()
        for post_hook in post_hooks.values():
            post_hook(self)

    def _upgrade(self, param_groups: list[dict[str, Any]]) -> None:
        """Fill in what param groups of older state dicts lack."""

    def __getstate__(self) -> dict[str, Any]:
        """Everything a copy needs to continue exactly like this optimizer (hooks and the
        process group excepted, as torch.optim leaves hooks out)."""
        state = {k: v for k, v in self.__dict__.items() if not k.endswith("_hooks")}
        state.pop("step", None)  # an lr scheduler's wrapper: it would step the original
        state["process_group"] = None
        state["_views"] = {}  # views of the tensors: made again on use
        if "_metrics" in state:  # cached preconditioners: rebuilt from the seed on use
            state["_metrics"] = {}
        return state
