"""What the integrations share: the Lie-group optimizers behind a stack's wrappers, and what
their parameters hold around training: the point estimate, the model average of S posterior
samples, or (between_steps="sample") the training sample."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor

from ..optim import BLROptimizer, unwrap
from ..predictive import log_mean_softmax

__all__ = ["EVALUATE", "averaged", "blr_optimizers", "check_evaluate", "park", "point", "resume"]

EVALUATE = ("point", "average")
"""Where evaluation runs: at the point estimate, or the model average of S samples."""


def check_evaluate(evaluate: str, samples: int) -> None:
    """ValueError naming the argument for an unknown ``evaluate`` or ``samples < 1``."""
    if evaluate not in EVALUATE:
        raise ValueError(f"evaluate: expected one of {EVALUATE}, got {evaluate!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: expected an int >= 1, got {samples!r}")


def blr_optimizers(optimizers: Iterable[Any]) -> list[BLROptimizer]:
    """The Lie-group optimizers among ``optimizers`` or behind their wrappers, each once."""
    found: dict[int, BLROptimizer] = {}
    for optimizer in optimizers:
        blr = unwrap(optimizer, BLROptimizer)
        if blr is not None:
            found.setdefault(id(blr), blr)
    return list(found.values())


@contextmanager
def _each(holds: Iterable[AbstractContextManager[Any]]) -> Iterator[None]:
    """Enter every context of ``holds``, in order, for the block."""
    with ExitStack() as stack:
        for hold in holds:
            stack.enter_context(hold)
        yield


def point(optimizers: Iterable[BLROptimizer]) -> AbstractContextManager[None]:
    """Hold every optimizer's point estimate in its parameters for the block."""
    return _each(optimizer.point_estimate() for optimizer in optimizers)


def _sample(optimizers: Iterable[BLROptimizer]) -> AbstractContextManager[None]:
    """Hold one posterior sample of every optimizer in its parameters for the block."""
    return _each(optimizer.sampled_params() for optimizer in optimizers)


def averaged(
    forward: Callable[..., Tensor], optimizers: list[BLROptimizer], samples: int
) -> Callable[..., Tensor]:
    r"""``forward`` as the model average of ``samples`` posterior samples: it returns
    :math:`\log \frac1S \sum_s \operatorname{softmax}(f(x; \theta_s))` over the last axis (log
    probabilities: their cross-entropy with the labels is the average's NLL)."""

    def average(*args: Any, **kwargs: Any) -> Tensor:
        outputs = []
        for _ in range(samples):
            with _sample(optimizers):
                output = forward(*args, **kwargs)
            if not isinstance(output, Tensor):
                raise TypeError(
                    f"evaluate='average' averages the softmax of the forward pass's logits, a "
                    f"Tensor; the forward returned {type(output).__name__}"
                )
            outputs.append(output)
        return log_mean_softmax(torch.stack(outputs))

    return average


def park(optimizers: Iterable[BLROptimizer]) -> list[BLROptimizer]:
    """Write the point estimate into the parameters of the ``between_steps="sample"``
    optimizers, whose parameters hold a training sample (for what follows training: saving,
    evaluating, serving); returns them, for :func:`resume`."""
    parked = [o for o in optimizers if o.holds_samples]
    for optimizer in parked:
        optimizer.restore()
    return parked


def resume(optimizers: Iterable[BLROptimizer]) -> None:
    """Put back the training sample that :func:`park` replaced: the state dict redraws it bit
    for bit (it keeps the noise generators' state from before the draw)."""
    for optimizer in optimizers:
        optimizer.load_state_dict(optimizer.state_dict())
