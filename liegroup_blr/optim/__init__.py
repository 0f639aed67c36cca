"""torch.optim optimizers implementing the Lie-group Bayesian learning rule."""

from .additive import AdditiveBLR
from .affine import AffineBLR
from .base import BLROptimizer
from .checkpoint import TrainingState
from .generic import LieGroupBLR
from .multiplicative import MultiplicativeBLR
from .options import EngineOptions
from .tensors import Sample
from .wrappers import unwrap

__all__ = [
    "AdditiveBLR",
    "AffineBLR",
    "BLROptimizer",
    "EngineOptions",
    "LieGroupBLR",
    "MultiplicativeBLR",
    "Sample",
    "TrainingState",
    "unwrap",
]
