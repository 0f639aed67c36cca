"""A saved optimizer state dict as it is loaded: each element checked against its parameter's
shape, and the states loaded in their state dtype."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..sharding import local
from .rule import Rule
from .scratch import state_dtype
from .skips import param_name

__all__ = ["check_saved_shapes", "load_states"]


def check_saved_shapes(
    state_dict: dict[str, Any], param_groups: list[dict[str, Any]], rule: Rule
) -> None:
    """Refuse a saved state whose element does not fit its parameter here (a state dict of
    another architecture), naming the parameter and both shapes."""
    saved_states = state_dict.get("state", {})
    for i, (saved, live) in enumerate(zip(state_dict["param_groups"], param_groups, strict=False)):
        G = rule.group_of(live)
        for key, p in zip(saved["params"], live["params"], strict=False):
            element = saved_states.get(key, {}).get("element")
            if element is None or element.shape == G.element_shape(p.shape):
                continue
            name = param_name(param_groups, i, p)
            raise ValueError(
                f"state_dict: {name} has shape {tuple(p.shape)} here, but "
                f"its saved state is for shape {tuple(G.param_shape(element.shape))}: load a "
                "state dict saved for this model's architecture"
            )


def load_states(state: Any, state_dict: dict[str, Any], params: list[Tensor]) -> None:
    """Each parameter's loaded state into ``state``, local shards in the state dtype (undoing
    the cast of torch.optim's load to the parameter's dtype)."""
    saved = state_dict["state"]
    ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    for i, p in zip(ids, params, strict=True):
        if i in saved:
            state[p] = {
                k: local(v).to(device=p.device, dtype=state_dtype(p)) for k, v in saved[i].items()
            }
