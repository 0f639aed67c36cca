"""Optimizer state dicts: torch's, plus what resumes a Lie-group optimizer bit for bit.

The dict holds each parameter's ``{"element", "momentum"}`` (DTensors for sharded
parameters, for ``torch.distributed.checkpoint``), the param groups without their base
distributions and Lie groups (they belong to the construction, so the dict loads with
``torch.load(weights_only=True)``) but with the rule that made them, the seed and the
generators of the training noise (``"rng"``: as they were before the parameters' resident
sample, which loading draws again) and of prediction draws (``"predict_rng"``), the skip
count, and a subclass's entries (the prior's elements).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from .distributed import SHARDED, as_dtensor, local
from .outside import mark_writes, take_writes
from .scratch import state_dtype

if TYPE_CHECKING:
    from .state import GroupStateOptimizer

__all__ = ["load", "save"]


def save(opt: GroupStateOptimizer) -> dict[str, Any]:
    """``opt.state_dict()``: torch's, with the base distributions and Lie groups left out,
    each param group's rule named, sharded state as DTensors, and the noise, skip and
    subclass entries added."""
    if opt._engine.holding == "sampled_params" or opt._engine.samples:
        raise RuntimeError("state_dict() between sampled_params(train=True) and step()")
    take_writes(opt)
    post_hooks = opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_post_hooks = OrderedDict()  # run on the finished dict
    try:
        sd = Optimizer.state_dict(opt)
    finally:
        opt._optimizer_state_dict_post_hooks = post_hooks
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):  # sharded like their parameters, for DCP
        if isinstance(p, SHARDED) and i in sd["state"]:
            sd["state"][i] = {k: as_dtensor(v, p) for k, v in sd["state"][i].items()}
    for group, live in zip(sd["param_groups"], opt.param_groups, strict=True):
        group.pop("base", None)
        group.pop("group", None)
        group["rule"] = opt._describe(live)
    now = opt.noise_source.state_dict()
    noise = opt._engine.resident_rng or now  # before the parameters' sample, if any
    sd["rng"], sd["seed"] = noise["rng"], noise["seed"]
    sd["predict_rng"] = now["predict_rng"]  # prediction draws: as they are now
    sd["skipped_steps"] = opt._engine.skipped
    sd.update(opt._extra_state())
    for hook in post_hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def load(opt: GroupStateOptimizer, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict(state_dict)``: torch's, after the pre-hooks, with the rules
    checked, the construction's bases and groups kept, the state in its own dtype, the noise
    generators restored; then what the parameters hold between steps is written."""
    state_dict = state_dict.copy()
    hooks = opt._optimizer_load_state_dict_pre_hooks
    for hook in hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    keys = ("rng", "predict_rng", "seed", "skipped_steps", *opt._extra_state_keys)
    extras = {k: state_dict.pop(k) for k in keys if k in state_dict}
    for i, (saved_group, live) in enumerate(
        zip(state_dict["param_groups"], opt.param_groups, strict=False)
    ):
        if saved_group.get("rule", opt._describe(live)) != opt._describe(live):
            raise ValueError(
                f"state_dict: param group {i} was saved by {saved_group['rule']!r}, "
                f"this optimizer's is {opt._describe(live)!r}"
            )
    state_dict["param_groups"] = [
        {k: v for k, v in g.items() if k != "rule"} for g in state_dict["param_groups"]
    ]
    kept: list[dict[str, Any]] = [
        {k: g[k] for k in ("base", "group") if k in g} for g in opt.param_groups
    ]
    post_hooks = opt._optimizer_load_state_dict_post_hooks
    opt._optimizer_load_state_dict_pre_hooks = OrderedDict()  # applied above
    opt._optimizer_load_state_dict_post_hooks = OrderedDict()  # run once loaded
    try:
        Optimizer.load_state_dict(opt, state_dict)
    finally:
        opt._optimizer_load_state_dict_pre_hooks = hooks
        opt._optimizer_load_state_dict_post_hooks = post_hooks
    saved = state_dict["state"]
    ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in zip(ids, params, strict=True):
        if i in saved:  # undo Optimizer's cast of state to the parameter dtype
            opt.state[p] = {
                k: local(v).to(device=p.device, dtype=state_dtype(p)) for k, v in saved[i].items()
            }
    for group, construction in zip(opt.param_groups, kept, strict=True):
        group.update(construction)
    if "rng" in extras:
        opt.noise_source.load_state_dict(
            {
                "seed": extras.get("seed", opt.seed),
                "rng": extras["rng"],
                "predict_rng": extras.get("predict_rng", {}),
            }
        )
        opt.noise_source.make_generators(list(opt.state))
    else:
        warnings.warn(
            "load_state_dict: no noise state ('rng'; torch.distributed.checkpoint's "
            "get_optimizer_state_dict keeps only 'state' and 'param_groups'), so the noise "
            "goes on from this optimizer's generators; checkpoint "
            "liegroup_blr.optim.TrainingState(model, optimizer) to resume bit for bit",
            UserWarning,
            stacklevel=2,
        )
    opt._engine.skipped = int(extras.get("skipped_steps", 0))
    opt._load_extra_state(extras)
    opt._engine.end_step()  # a loaded state starts between steps
    opt._scratch.clear()
    opt.noise_source.end_step()
    opt._upgrade(opt.param_groups)
    opt._between_steps()  # the point estimate, or the saved sample drawn again
    mark_writes(opt)
    for post_hook in post_hooks.values():
        post_hook(opt)
