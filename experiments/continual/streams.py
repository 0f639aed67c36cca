"""Task streams for continual learning: Permuted and Split digits.

A stream is a list of :class:`Task`. Every task is a classification problem over the
dataset's 10 output columns; a task may restrict its softmax to some of them (the
multi-head setting of Split MNIST: a head is the pair of columns of its two digits).

- **Permuted**: every task is the whole dataset (the same train/test split) under a fixed
  pixel permutation; the first permutation is the identity, the others are drawn from a
  generator seeded with the run's seed.
- **Split**: task t holds the digits 2t and 2t + 1. Multi-head: its softmax spans those two
  columns only (the task is known at test time); single-head: all 10 columns (the learner
  must also tell the tasks apart, the class-incremental setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from experiments.common.data import Dataset

STREAMS = ("permuted", "split")
HEADS = ("multi", "single")


@dataclass
class Task:
    """One task: normalised images ``(n, C, H, W)``, their digit labels, and the output
    columns its softmax spans (``classes``)."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    classes: tuple[int, ...]

    def to(self, device: torch.device) -> Task:
        train_x, train_y, test_x, test_y = (
            t.to(device) for t in (self.train_x, self.train_y, self.test_x, self.test_y)
        )
        return Task(self.name, train_x, train_y, test_x, test_y, self.classes)


def _inputs(data: Dataset, x: Tensor) -> Tensor:
    """Raw pixels as normalised network inputs."""
    return data.normalize(data.to_unit(x))


def permutations(pixels: int, tasks: int, seed: int) -> list[Tensor]:
    """``tasks`` permutations of ``range(pixels)``: the identity, then ``tasks − 1`` drawn
    with ``torch.randperm`` from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    rest = [torch.randperm(pixels, generator=generator) for _ in range(tasks - 1)]
    return [torch.arange(pixels), *rest]


def permuted(data: Dataset, tasks: int, seed: int) -> list[Task]:
    """Permuted digits: task t is the dataset with its pixels permuted by permutation t of
    :func:`permutations` (the same permutation for every channel)."""
    shape = data.train_x.shape[1:]
    pixels = math.prod(shape[1:])
    train, test = _inputs(data, data.train_x), _inputs(data, data.test_x)
    out = []
    for t, perm in enumerate(permutations(pixels, tasks, seed)):
        out.append(
            Task(
                f"permutation {t}" if t else "identity",
                train.flatten(2)[:, :, perm].reshape(len(train), *shape),
                data.train_y,
                test.flatten(2)[:, :, perm].reshape(len(test), *shape),
                data.test_y,
                tuple(range(data.num_classes)),
            )
        )
    return out


def split(data: Dataset, tasks: int, heads: str) -> list[Task]:
    """Split digits: task t holds the classes 2t and 2t + 1; ``heads`` is ``"multi"`` (its
    softmax spans its two columns) or ``"single"`` (all columns)."""
    if heads not in HEADS:
        raise ValueError(f"heads: must be one of {HEADS}, got {heads!r}")
    if 2 * tasks > data.num_classes:
        raise ValueError(
            f"tasks: {tasks} split tasks need {2 * tasks} classes, the dataset has "
            f"{data.num_classes}"
        )
    out = []
    for t in range(tasks):
        pair = (2 * t, 2 * t + 1)
        train = (data.train_y == pair[0]) | (data.train_y == pair[1])
        test = (data.test_y == pair[0]) | (data.test_y == pair[1])
        out.append(
            Task(
                f"{pair[0]}/{pair[1]}",
                _inputs(data, data.train_x[train]),
                data.train_y[train],
                _inputs(data, data.test_x[test]),
                data.test_y[test],
                pair if heads == "multi" else tuple(range(data.num_classes)),
            )
        )
    return out


def build_stream(name: str, data: Dataset, tasks: int, heads: str, seed: int) -> list[Task]:
    """The stream ``name`` (``"permuted"`` or ``"split"``) of ``tasks`` tasks."""
    if name == "permuted":
        return permuted(data, tasks, seed)
    if name == "split":
        return split(data, tasks, heads)
    raise ValueError(f"stream: unknown {name!r}; valid: {list(STREAMS)}")


def column_mask(classes: tuple[int, ...], outputs: int) -> Tensor:
    """0 on the task's columns and −∞ elsewhere: added to the logits, it restricts the
    softmax to the task's head."""
    mask = torch.full((outputs,), -math.inf)
    mask[list(classes)] = 0.0
    return mask


class Head(nn.Module):
    """One task's head of a network: the network's logits in the task's ``columns`` (in
    their order), the model :class:`liegroup_blr.MemorablePast` scores a task with."""

    def __init__(self, model: nn.Module, columns: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("columns", columns)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)[:, self.columns]
