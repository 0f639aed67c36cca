"""liegroup_blr: the Lie-group Bayesian learning rule (Kıral, Möllenhoff, Khan, AISTATS 2023).

Posteriors are a Lie group acting on a base distribution, θ = g·ξ with ξ ~ q0, updated along
the group's exponential map with reparameterised gradients. The optimizers are drop-in
``torch.optim.Optimizer`` subclasses::

    import liegroup_blr as lgb
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.05, data_size=len(train_set))
"""

from . import (
    distributions,
    fisher,
    groups,
    kl,
    mc,
    memorable,
    memory,
    noise,
    optim,
    posterior,
    predictive,
    sharding,
)
from .mc import mc_step
from .memorable import MemorablePast
from .memory import MemoryMap, loo_nll, memory_map, sensitivity
from .optim import AdditiveBLR, AffineBLR, LieGroupBLR, MultiplicativeBLR
from .posterior import Posterior

__all__ = [
    "AdditiveBLR",
    "AffineBLR",
    "LieGroupBLR",
    "MemorablePast",
    "MemoryMap",
    "MultiplicativeBLR",
    "Posterior",
    "distributions",
    "fisher",
    "groups",
    "kl",
    "loo_nll",
    "mc",
    "mc_step",
    "memorable",
    "memory",
    "memory_map",
    "noise",
    "optim",
    "posterior",
    "predictive",
    "sensitivity",
    "sharding",
]
__version__ = "0.1.0"
