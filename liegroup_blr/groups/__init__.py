"""Lie groups acting on parameter space: the interface and the three built-in groups."""

from .additive import AdditiveGroup
from .affine import DiagonalAffineGroup, exprel
from .base import LieGroup
from .multiplicative import MultiplicativeGroup

__all__ = ["AdditiveGroup", "DiagonalAffineGroup", "LieGroup", "MultiplicativeGroup", "exprel"]
