"""torch.optim optimizers implementing the Lie-group Bayesian learning rule.

Each optimizer class composes a :class:`Rule` (its arithmetic) with :class:`BLROptimizer` (the
torch interface), which runs it through the Monte-Carlo loop of
:mod:`~liegroup_blr.optim.engine`. The rule modules (:mod:`~liegroup_blr.optim.additive`,
``multiplicative``, ``affine``, ``generic``) and :mod:`~liegroup_blr.optim.kernel_utils` are
public too: each rule's formulas, their in-place twins and its compiled update, for benchmarks
and new rules.
"""

from ..posterior import unwrap
from . import additive, affine, generic, kernel_utils, multiplicative
from .additive import AdditiveBLR
from .affine import AffineBLR
from .base import BLROptimizer
from .checkpoint import TrainingState
from .generic import LieGroupBLR
from .multiplicative import MultiplicativeBLR
from .options import EngineOptions
from .rule import Rule
from .tensors import Sample

__all__ = [
    "AdditiveBLR",
    "AffineBLR",
    "BLROptimizer",
    "EngineOptions",
    "LieGroupBLR",
    "MultiplicativeBLR",
    "Rule",
    "Sample",
    "TrainingState",
    "additive",
    "affine",
    "generic",
    "kernel_utils",
    "multiplicative",
    "unwrap",
]
