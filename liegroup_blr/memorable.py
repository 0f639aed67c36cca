r"""The memorable past: a small memory of each finished task, kept beside the posterior, and a
functional regulariser that holds the network's predictions on it.

After task :math:`t` the memory keeps :math:`m` of the task's training examples: those with
the highest memory-map scores :math:`s_i` (:func:`liegroup_blr.sensitivity`, the estimated
change of an example's prediction were it removed from training: the examples the posterior
rests on, the "memorable past" of Pan et al., NeurIPS 2020), or :math:`m` drawn at random
(the control). With each it stores the posterior predictive of the task's posterior
:math:`q_t`,

.. math:: \bar p_i = \frac1S\sum_{s=1}^S \operatorname{softmax} f(x_i; \theta_s), \qquad
          \theta_s \sim q_t .

In later tasks the **functional regulariser** is the mean KL divergence from those stored
predictions to the network's,

.. math:: R(\theta) = \frac1{|B|}\sum_{i\in B}
          \mathrm{KL}\big(\bar p_i \,\big\|\, \operatorname{softmax} f(x_i;\theta)\big),

over memory rows :math:`B` (all of them, or a minibatch), added to the task's mean loss with
a weight :math:`\lambda`: a rule with the previous posterior as prior then minimises
:math:`\mathbb E_q[\bar\ell_t + \lambda R] + \frac{\tau}{N_t}\mathrm{KL}(q\,\|\,q_{t-1})`.
Unlike FROMP, which weighs the memory's function values by a Gaussian-process kernel, the
KL here compares predictive distributions directly, so it needs nothing but the logits.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor, nn

from . import posterior_io
from .memory import sensitivity
from .posterior import Posterior
from .predictive import log_mean_softmax

__all__ = ["SELECTIONS", "MemorablePast"]

SELECTIONS = ("sensitivity", "random")
"""How :meth:`MemorablePast.add_task` chooses a task's examples: ``"sensitivity"`` (the
highest :func:`~liegroup_blr.sensitivity` scores) or ``"random"`` (uniformly, without
replacement: the control)."""

_FIELDS = ("inputs", "targets", "tasks", "probabilities", "scores")


class MemorablePast:
    r"""A memory of ``per_task`` training examples of every finished task, with the posterior
    predictive on them, and the functional regulariser :math:`R(\theta)` that keeps it.

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
                        loss = loss + strength * memory.penalty(model(memory.inputs))
                    loss.backward()
                    return loss

                optimizer.step(closure)
            memory.add_task(model, optimizer, x, y)

    Args:
        per_task: examples kept of each task (at most its training set).
        selection: one of :data:`SELECTIONS`.

    Attributes:
        inputs: ``[M, ...]`` the kept inputs, task after task.
        targets: ``[M]`` their labels.
        tasks: ``[M]`` the index of the task each came from (0 for the first added).
        probabilities: ``[M, K]`` the stored posterior predictive :math:`\bar p_i`.
        scores: ``[M]`` their memory-map scores (NaN in a random memory, which scores
            nothing).

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
        self.inputs = self.targets = self.tasks = self.probabilities = self.scores = torch.empty(0)
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
        samples: int = 32,
        batch_size: int = 256,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        r"""Keep ``per_task`` examples of a finished task and the posterior predictive on them.

        ``"sensitivity"`` scores every example with :func:`~liegroup_blr.sensitivity` at its
        defaults and keeps the highest, in descending order of score; ``"random"`` keeps a
        uniform draw and scores nothing. Stores :math:`\bar p_i` from ``samples`` posterior
        samples.

        Args:
            model: the network, its outputs the logits of the task's classes (a multi-head
                network: a module giving this task's head). Run in eval mode, restored after.
            posterior: a :class:`~liegroup_blr.Posterior` of ``model``'s parameters, or the
                Lie-group BLR optimizer that trained them.
            inputs: ``[n, ...]`` the task's training inputs.
            targets: ``[n]`` their labels in ``[0, K)``.
            samples: posterior samples of the stored predictive.
            batch_size: examples per batch of the scores.
            generator: draws the scores' samples, the random choice and the predictive's
                samples (default: torch's global generator).

        Returns:
            The indices of the kept examples in ``inputs``.

        Raises:
            ValueError: naming the argument, for ``samples`` < 1, or a model whose number of
                outputs differs from the tasks already kept.
        """
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples: must be an integer >= 1, got {samples!r}")
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
        if not isinstance(posterior, Posterior):
            posterior = Posterior.from_optimizer(posterior, model)
        probabilities = _predictive(model, posterior, inputs[rows], samples, generator)
        if len(self) and probabilities.shape[1:] != self.probabilities.shape[1:]:
            raise ValueError(
                f"model: gives {probabilities.shape[1]} outputs, the memory holds predictions "
                f"over {self.probabilities.shape[1]}; give every task's head the same number of "
                "classes"
            )
        new = {
            "inputs": inputs[rows],
            "targets": targets[rows.to(targets.device)],
            "tasks": torch.full((keep,), self.num_tasks, device=inputs.device),
            "probabilities": probabilities,
            "scores": kept,
        }
        for name, value in new.items():
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, value.detach()]) if len(self) else value.detach())
        self.num_tasks += 1
        return rows

    # ---------------------------------------------------------- regulariser
    def penalty(self, logits: Tensor, rows: Tensor | None = None) -> Tensor:
        r""":math:`R(\theta) = \frac1{|B|}\sum_{i\in B}\mathrm{KL}(\bar p_i \,\|\,
        \operatorname{softmax}(\text{logits}_i))`, differentiable in ``logits``.

        Args:
            logits: ``[|B|, K]`` the network's logits on ``inputs[rows]``.
            rows: the memory rows ``B`` (default: every row, in order).

        Raises:
            ValueError: for an empty memory or logits whose shape is not the rows'.
        """
        if not len(self):
            raise ValueError("memory: empty; add_task() a finished task first")
        p = self.probabilities if rows is None else self.probabilities[rows]
        if logits.shape != p.shape:
            raise ValueError(
                f"logits: shape {tuple(logits.shape)}, the memory rows' predictions have "
                f"{tuple(p.shape)}; pass the logits of inputs[rows]"
            )
        p = p.to(logits.dtype)
        log_q = torch.log_softmax(logits, dim=-1)
        cross = torch.where(p > 0, p * log_q, 0.0)  # 0 · log 0 = 0, also where q underflows
        return (torch.xlogy(p, p) - cross).sum(-1).mean()

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


@torch.no_grad()
def _predictive(
    model: nn.Module,
    posterior: Posterior,
    inputs: Tensor,
    samples: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    r""":math:`\bar p = \frac1S\sum_s\operatorname{softmax} f(x;\theta_s)`, :math:`\theta_s\sim q`,
    over ``samples`` draws of ``posterior`` from ``generator`` in ``model`` (in eval mode,
    restored after)."""
    was_training = model.training
    model.eval()
    try:
        logits = []
        for _ in range(samples):
            with posterior.sampled(model, generator):
                logits.append(model(inputs))
    finally:
        model.train(was_training)
    return log_mean_softmax(torch.stack(logits)).exp()
