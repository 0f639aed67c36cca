r"""The memorable past: a small memory of each finished task, kept beside the posterior, and
its replay in the losses of later tasks.

After task :math:`t` the memory keeps :math:`m` of the task's training examples
:math:`(x_i, y_i)`: those with the highest memory-map scores :math:`s_i`
(:func:`liegroup_blr.memory.sensitivity`, the estimated change of an example's prediction
were it removed from training: the examples the posterior rests on, the "memorable past" of
Pan et al., NeurIPS 2020), or :math:`m` drawn at random (the control). In later tasks the
**replay loss** is the mean negative log-likelihood of memory rows :math:`B` (all of them,
or a minibatch),

.. math:: R(\theta) = -\frac1{|B|}\sum_{i\in B} \log \operatorname{softmax} f(x_i;\theta)_{y_i},

added to the task's mean loss with a weight :math:`\lambda`: a rule with the previous
posterior as prior then minimises
:math:`\mathbb E_q[\bar\ell_t + \lambda R] + \frac{\tau}{N_t}\mathrm{KL}(q\,\|\,q_{t-1})`.
The prior carries what the weights learned; the replayed examples put a few of the old
tasks' likelihood terms back (VCL's coreset, Nguyen et al., ICLR 2018, in a loss).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.functional import cross_entropy

from . import posterior_io
from .memory import sensitivity
from .posterior import Posterior

__all__ = ["SELECTIONS", "MemorablePast"]

SELECTIONS = ("sensitivity", "random")
"""How :meth:`~liegroup_blr.MemorablePast.add_task` chooses a task's examples:
``"sensitivity"`` (the highest :func:`~liegroup_blr.memory.sensitivity` scores) or
``"random"`` (uniformly, without replacement: the control)."""

_FIELDS = ("inputs", "targets", "tasks", "scores")


class MemorablePast:
    r"""A memory of ``per_task`` training examples of every finished task and the replay loss
    :math:`R(\theta)` on it.

    The optimizer's :meth:`~liegroup_blr.optim.BLROptimizer.next_task` carries the posterior
    over to the next task and sees no data; this object carries a few examples::

        memory = lgb.MemorablePast(per_task=200)
        for t, (x, y) in enumerate(tasks):
            if t:
                optimizer.next_task(data_size=len(y))
            for xb, yb in batches(x, y):

                def closure():
                    optimizer.zero_grad()
                    loss = cross_entropy(model(xb), yb)
                    if len(memory):
                        loss = loss + strength * memory.loss(model(memory.inputs))
                    loss.backward()
                    return loss

                optimizer.step(closure)
            memory.add_task(model, optimizer, x, y)

    Args:
        per_task: examples kept of each task (at most its training set).
        selection: one of :data:`~liegroup_blr.memorable.SELECTIONS`.

    Attributes:
        inputs: ``[M, ...]`` the kept inputs, task after task.
        targets: ``[M]`` their labels.
        tasks: ``[M]`` the index of the task each came from (0 for the first added).
        scores: ``[M]`` their memory-map scores (NaN in a random memory, which scores
            nothing).
        num_tasks: the tasks added.

    Raises:
        ValueError: naming the argument, for ``per_task`` < 1 or an unknown selection.
    """

    def __init__(self, per_task: int, selection: str = "sensitivity") -> None:
        if isinstance(per_task, bool) or not isinstance(per_task, int) or per_task < 1:
            raise ValueError(f"per_task: must be an integer >= 1, got {per_task!r}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection: must be one of {SELECTIONS}, got {selection!r}")
        self.per_task = per_task
        self.selection = selection
        self.inputs = self.targets = self.tasks = self.scores = torch.empty(0)
        self.num_tasks = 0

    def __len__(self) -> int:
        return len(self.tasks)

    def __repr__(self) -> str:
        return (
            f"MemorablePast(per_task={self.per_task}, selection={self.selection!r}): "
            f"{len(self)} examples of {self.num_tasks} task(s)"
        )

    # ---------------------------------------------------------------- filling
    def add_task(
        self,
        model: nn.Module,
        posterior: Posterior | Any,
        inputs: Tensor,
        targets: Tensor,
        *,
        batch_size: int = 256,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Keep ``per_task`` examples of a finished task.

        ``"sensitivity"`` scores every example with :func:`~liegroup_blr.memory.sensitivity` at its
        defaults and keeps the highest, in descending order of score; ``"random"`` keeps a
        uniform draw and scores nothing (``model`` and ``posterior`` unused).

        Args:
            model: the network, its outputs the logits of the task's classes (a multi-head
                network: a module giving this task's head).
            posterior: a :class:`~liegroup_blr.Posterior` of ``model``'s parameters, or the
                Lie-group BLR optimizer that trained them.
            inputs: ``[n, ...]`` the task's training inputs.
            targets: ``[n]`` their labels in ``[0, K)``.
            batch_size: examples per batch of the scores.
            generator: draws the scores' posterior samples or the random choice (default:
                torch's global generator).

        Returns:
            The indices of the kept examples in ``inputs``.
        """
        keep = min(self.per_task, len(inputs))
        if self.selection == "sensitivity":
            scores = sensitivity(
                model, posterior, inputs, targets, batch_size=batch_size, generator=generator
            )
            rows = scores.topk(keep).indices.to(inputs.device)
            kept = scores[rows.to(scores.device)].to(inputs.device)
        else:
            device = inputs.device if generator is None else generator.device
            rows = torch.randperm(len(inputs), generator=generator, device=device)[:keep]
            rows, kept = rows.to(inputs.device), torch.full((keep,), math.nan, device=inputs.device)
        new = {
            "inputs": inputs[rows],
            "targets": targets[rows.to(targets.device)],
            "tasks": torch.full((keep,), self.num_tasks, device=inputs.device),
            "scores": kept,
        }
        for name, value in new.items():
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, value.detach()]) if len(self) else value.detach())
        self.num_tasks += 1
        return rows

    # ---------------------------------------------------------------- replay
    def loss(self, logits: Tensor, rows: Tensor | None = None) -> Tensor:
        r""":math:`R(\theta) = -\frac1{|B|}\sum_{i\in B}\log\operatorname{softmax}
        (\text{logits}_i)_{y_i}`, the mean cross-entropy of memory ``rows`` with their labels,
        differentiable in ``logits``.

        Args:
            logits: ``[|B|, K]`` the network's logits on ``inputs[rows]``.
            rows: the memory rows ``B`` (default: every row, in order).

        Raises:
            ValueError: for an empty memory or logits of other rows.
        """
        if not len(self):
            raise ValueError("memory: empty; add_task() a finished task first")
        y = self.targets if rows is None else self.targets[rows]
        if logits.ndim != 2 or len(logits) != len(y):
            raise ValueError(
                f"logits: shape {tuple(logits.shape)} for {len(y)} memory rows; pass the "
                "logits [rows, classes] of inputs[rows]"
            )
        return cross_entropy(logits, y.to(logits.device))

    # ---------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """The settings and the stored tensors (loadable with ``torch.load(weights_only=True)``)."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        return {
            "per_task": self.per_task,
            "selection": self.selection,
            "num_tasks": self.num_tasks,
            **fields,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: in one line, for a state of another ``per_task`` or selection, or
                missing a field.
        """
        missing = sorted({"per_task", "selection", "num_tasks", *_FIELDS} - set(state_dict))
        if missing:
            raise ValueError(f"state_dict: not a MemorablePast's (missing {missing})")
        for key in ("per_task", "selection"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict: holds {key}={state_dict[key]!r}, this memory has "
                    f"{getattr(self, key)!r}; build it with MemorablePast.from_state_dict"
                )
        self.num_tasks = int(state_dict["num_tasks"])
        for name in _FIELDS:
            setattr(self, name, state_dict[name])

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any]) -> MemorablePast:
        """A memory rebuilt from :meth:`state_dict`."""
        if "per_task" not in state_dict or "selection" not in state_dict:
            raise ValueError("state_dict: not a MemorablePast's (no per_task or selection)")
        memory = cls(int(state_dict["per_task"]), str(state_dict["selection"]))
        memory.load_state_dict(state_dict)
        return memory

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state_dict` atomically (a temporary file moved into place)."""
        posterior_io.save(self.state_dict(), path)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu"
    ) -> MemorablePast:
        """Read a file written by :meth:`save` (``torch.load(weights_only=True)``)."""
        return cls.from_state_dict(torch.load(path, map_location=map_location, weights_only=True))
