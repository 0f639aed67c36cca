"""torch.optim optimizers implementing the Lie-group Bayesian learning rule."""

from .additive import AdditiveBLR
from .affine import AffineBLR
from .base import BLROptimizer, Sample
from .generic import LieGroupBLR
from .multiplicative import MultiplicativeBLR

__all__ = ["AdditiveBLR", "AffineBLR", "BLROptimizer", "LieGroupBLR", "MultiplicativeBLR", "Sample"]
