"""What the integration tests share: a small task, a network that records the weights its
training forward passes ran at, and the plain loops the stacks are compared with."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from liegroup_blr.optim import BLROptimizer

BATCH = 16
STEPS = 4


def task(n: int = BATCH * STEPS, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Inputs (n, 4) and labels in {0, 1, 2}."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y


def batches(x: Tensor, y: Tensor, size: int = BATCH) -> Iterator[tuple[Tensor, Tensor]]:
    """The batches in order (every loop here reads the data unshuffled)."""
    for i in range(0, len(x), size):
        yield x[i : i + size], y[i : i + size]


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


@dataclass
class Recorder:
    """The first layer's weight at every forward pass, with whether it ran in training
    mode with gradients (a training pass) and the dtype it computed in."""

    training: list[bool] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)

    def hook(self, module: nn.Module, inputs: object, output: Tensor) -> None:
        self.training.append(module.training and torch.is_grad_enabled())
        self.weights.append(module.weight.detach().clone())
        self.dtypes.append(output.dtype)

    def attach(self, layer: nn.Module) -> Recorder:
        layer.register_forward_hook(self.hook)
        return self

    def train_weights(self) -> list[Tensor]:
        return [w for w, t in zip(self.weights, self.training, strict=True) if t]

    def eval_weights(self) -> list[Tensor]:
        return [w for w, t in zip(self.weights, self.training, strict=True) if not t]


def elements(optimizer: BLROptimizer, model: nn.Module) -> dict[str, Tensor]:
    """Every trained parameter's group element, by parameter and component name."""
    return {
        f"{name}.{part}": value
        for name, p in model.named_parameters()
        for part, value in optimizer.group_element(p).items()
    }


def assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    """Bit for bit."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_moved(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    """Every group element changed."""
    for key in a:
        assert not torch.equal(a[key], b[key]), key


def point_weights(optimizer: BLROptimizer, layer: nn.Linear) -> Tensor:
    """The layer's weight at the point estimate, whatever the parameters hold."""
    with optimizer.point_estimate():
        return layer.weight.detach().clone()


def cross_entropy(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(model(x), y)


def closure_loop(
    model: nn.Module,
    optimizer: BLROptimizer,
    data: list[tuple[Tensor, Tensor]],
    clip: float | None = None,
    scheduler: Callable[[], object] | None = None,
) -> list[Tensor]:
    """The reference: ``optimizer.step(closure)`` per batch, clipping each sample's gradient;
    the first layer's point-estimate weight before each step."""
    points = []
    for x, y in data:
        points.append(point_weights(optimizer, model[0]))  # type: ignore[index]

        def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
            optimizer.zero_grad()
            loss = cross_entropy(model, x, y)
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            return loss

        optimizer.step(closure)
        if scheduler is not None:
            scheduler()
    return points
