"""Checkpoints of sharded runs with ``torch.distributed.checkpoint`` (DCP).

DCP's ``get_optimizer_state_dict`` keeps only an optimizer's ``state`` and ``param_groups``:
the noise generators, the seed and the skip count would be dropped, and DCP keeps one copy of
any plain tensor saved under the same name on every rank, so per-rank generator states would
collapse into rank 0's. :class:`TrainingState` checkpoints the model, the optimizer (its state
sharded like the parameters) and these top-level entries, under a name per rank::

    state = {"train": TrainingState(model, optimizer)}
    dcp.save(state, checkpoint_id=folder)     # every rank
    dcp.load(state, checkpoint_id=folder)     # every rank: a bit-exact resume
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

__all__ = ["TrainingState"]

PARTS = ("state", "param_groups")
"""What DCP's optimizer state dict keeps."""


class TrainingState(Stateful):
    """A model and its Lie-group BLR optimizer as one DCP ``Stateful``.

    Args:
        model: the (FSDP2-sharded, DDP-wrapped or plain) model.
        optimizer: its optimizer, built on ``model``'s parameters.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    @staticmethod
    def _name() -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim", "engine": {"rank<r>": the optimizer's other entries}}``."""
        whole = self.optimizer.state_dict()
        engine = {k: v for k, v in whole.items() if k not in PARTS}
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
            "engine": {self._name(): engine},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the model, then the optimizer with this rank's own entries."""
        set_model_state_dict(self.model, state_dict["model"])
        engine = state_dict["engine"][self._name()]
        hook = self.optimizer.register_load_state_dict_pre_hook(lambda _, sd: {**sd, **engine})
        try:
            set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"])
        finally:
            hook.remove()
