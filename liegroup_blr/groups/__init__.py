"""Lie groups acting on parameter space: the interface, the three built-in groups and two
worked examples of groups that do not act coordinatewise (full affine) or act on pairs."""

from .additive import AdditiveGroup
from .affine import DiagonalAffineGroup, exprel
from .base import LieGroup, register_group, registered_group
from .full_affine import FullAffineGroup
from .multiplicative import MultiplicativeGroup
from .rotation_scaling import RotationScalingGroup

__all__ = [
    "AdditiveGroup",
    "DiagonalAffineGroup",
    "FullAffineGroup",
    "LieGroup",
    "MultiplicativeGroup",
    "RotationScalingGroup",
    "exprel",
    "register_group",
    "registered_group",
]
