"""Leave-one-out retraining for experiments/memory/maps.py: warm-started from a trained run's
posterior with common random numbers, each removed example's retraining and two controls,
one row per retraining kept as soon as it is done."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.functional import cross_entropy
from tqdm import tqdm

import liegroup_blr as lgb
from experiments.common import runfiles
from experiments.memory.scores import train_inputs

if TYPE_CHECKING:
    from experiments.common.training import Run


class Retrainer:
    """Warm-started retraining from a trained run's state with common random numbers.

    Every retraining starts from the run's trained model and optimizer state (its noise
    generator included), at ``retrain_lr`` times the initial step size. Epoch e shuffles
    the N examples with a generator seeded ``seed + 7919·permutation + e`` and cuts batches
    of the run's batch size from that order, keeping the last partial batch. A removed
    example is taken out of its batch, whose loss is still divided by the batch's full size:
    every other example keeps its weight, the data size stays N, and the objective is
    :math:`\\frac1N[\\sum_{j\\ne i}\\ell_j + \\frac\\delta2\\|\\theta\\|^2 - \\tau\\mathcal H]`,
    the leave-one-out objective up to a constant factor. So the retraining without i and the
    control (nothing removed, same permutation) see the same batches and draw the same noise:
    they differ by example i's term alone.
    """

    def __init__(self, run: Run, memory: dict[str, Any], seed: int) -> None:
        self.run, self.memory, self.seed = run, memory, seed
        self.x, self.y = train_inputs(run)
        self.model_state = copy.deepcopy(run.model.state_dict())
        self.optimizer_state = copy.deepcopy(run.optimizer.state_dict())

    def logits(self, index: Tensor) -> list[list[float]]:
        """The mean logits of the examples ``index`` over ``samples`` posterior samples
        (drawn from one fixed seed: the same draws whatever the state)."""
        run, samples = self.run, self.memory["samples"]
        post = lgb.Posterior.from_optimizer(run.optimizer, run.model)
        gen = torch.Generator(run.device).manual_seed(self.seed + 1)
        x = self.x[index.to(run.device)]
        was_training = run.model.training
        run.model.eval()
        with torch.no_grad():
            total = torch.zeros(())
            for _ in range(samples):
                with post.sampled(run.model, gen):
                    total = total + run.model(x)
        run.model.train(was_training)
        return (total / samples).double().tolist()

    def retrain(
        self, removed: int | None, index: Tensor, permutation: int = 0
    ) -> dict[str, list[list[float]]]:
        """Retrain without ``removed`` (None: nothing removed); the mean logits of ``index``
        after each of ``retrain_epochs``."""
        run, memory = self.run, self.memory
        run.model.load_state_dict(self.model_state)
        run.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))  # it aliases
        for group in run.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * memory["retrain_lr"]
        size, batch = len(self.y), run.cfg["data"]["batch_size"]
        run.model.train()
        out = {}
        for epoch in range(memory["retrain_epochs"][-1]):
            gen = torch.Generator().manual_seed(self.seed + 7919 * permutation + epoch)
            for rows in torch.randperm(size, generator=gen).split(batch):
                kept = rows if removed is None else rows[rows != removed]
                run.optimizer.step(self._closure(kept.to(run.device), len(rows)))  # type: ignore[arg-type]
            if epoch + 1 in memory["retrain_epochs"]:
                out[str(epoch + 1)] = self.logits(index)
        return out

    def _closure(self, rows: Tensor, batch: int) -> Callable[[], Tensor]:
        """The loss of ``rows``, summed and divided by the size ``batch`` of their batch."""

        def closure() -> Tensor:
            self.run.optimizer.zero_grad()
            logits = self.run.model(self.x[rows])
            loss = cross_entropy(logits, self.y[rows], reduction="sum") / batch
            loss.backward()
            return loss.detach()

        return closure


def retrain_all(
    retrainer: Retrainer, examples: list[int], path: Path, desc: str
) -> list[dict[str, Any]]:
    """The logits before retraining (``"start"``), the two controls (``"control"``: nothing
    removed, same batches; ``"permuted"``: nothing removed, other permutations) and one
    retraining per example (``"removed"``), each holding the mean logits of every example
    in ``examples``; each row appended to ``path`` (rewritten atomically) as soon as it is
    done; rows already there are kept."""
    rows = runfiles.read_jsonl(path)
    done = {(r["kind"], r["index"]) for r in rows}
    queue: list[tuple[str, int | None]] = [("start", None), ("control", None), ("permuted", None)]
    queue += [("removed", i) for i in examples]
    everyone = torch.tensor(examples)
    for kind, i in tqdm([q for q in queue if q not in done], desc=desc, unit="retraining"):
        if kind == "start":
            logits = {"0": retrainer.logits(everyone)}
        else:
            logits = retrainer.retrain(i, everyone, permutation=int(kind == "permuted"))
        rows.append({"kind": kind, "index": i, "examples": examples, "epochs": logits})
        runfiles.write_jsonl(path, rows)
    return rows
