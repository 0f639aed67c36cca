"""liegroup_blr: the Lie-group Bayesian learning rule (Kıral, Möllenhoff, Khan, AISTATS 2023).

Posteriors are a Lie group acting on a base distribution, θ = g·ξ with ξ ~ q0, updated along
the group's exponential map with reparameterised gradients. The optimizers are drop-in
``torch.optim.Optimizer`` subclasses::

    import liegroup_blr as lgb
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.05, data_size=len(train_set))
"""

import warnings
from typing import Any

from . import (
    distributions,
    fisher,
    groups,
    kl,
    mc,
    memorable,
    memory_maps,
    noise,
    optim,
    posterior,
    predictive,
    sharding,
)
from .mc import mc_step
from .memorable import MemorablePast
from .memory_maps import MemoryMap, loo_nll, memory_map, sensitivity
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
    "memory_map",
    "memory_maps",
    "noise",
    "optim",
    "posterior",
    "predictive",
    "sensitivity",
    "sharding",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``liegroup_blr.memory``, the deprecated name of :mod:`liegroup_blr.memory_maps`, for
    one release (a ``DeprecationWarning``)."""
    if name == "memory":
        warnings.warn(
            "liegroup_blr.memory is deprecated: the memory maps are liegroup_blr.memory_maps",
            DeprecationWarning,
            stacklevel=2,
        )
        return memory_maps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
