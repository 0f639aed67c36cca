"""What the tests share: the tiny driver config, a small network with its batch, and the
optimizers by name. ``tests/conftest.py`` hands the same things out as fixtures; a module
that needs them at import time (a constant, a parametrisation) imports them from here."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.groups import DiagonalAffineGroup

# ------------------------------------------------------------------ the tiny driver config
# the order of a config's top-level entries (the others follow in the order given)
_ORDER = ("seed", "seeds", "device", "threads", "data", "model", "optimizer", "schedule", "eval")


def tiny_config(**tables: Any) -> dict[str, Any]:
    """A driver config that runs in seconds: one epoch of an MLP of 8 units on 3-class
    1×8×8 synthetic images (32 train, 16 test, batches of 16), evaluated with 2 samples;
    the keywords change it as :func:`with_tables` says."""
    default = {
        "seed": 0,
        "device": "cpu",
        "data": {"name": "synthetic", "train_size": 32, "test_size": 16, "batch_size": 16},
        "model": {"name": "mlp", "widths": [8]},
        "schedule": {"epochs": 1},
        "eval": {"samples": 2, "sparsity_samples": 2},
    }
    return with_tables(default, **tables)


def with_tables(cfg: dict[str, Any], **tables: Any) -> dict[str, Any]:
    """``cfg`` with each keyword setting a top-level entry. A table is merged into the table
    of that name, unless it names another kind (``model={"name": "cnn"}``): then it replaces
    it, as does anything that is not a table; ``None`` leaves the entry out; ``seeds`` takes
    the place of ``seed``. A new config that shares nothing with the arguments."""
    cfg = copy.deepcopy(cfg)
    if "seeds" in tables:
        cfg.pop("seed", None)
    for name, value in copy.deepcopy(tables).items():
        default = cfg.get(name)
        if value is None:
            cfg.pop(name, None)
        elif (
            isinstance(default, dict)
            and isinstance(value, dict)
            and value.get("name") in (None, default.get("name"))
        ):
            cfg[name] = {**default, **value}
        else:
            cfg[name] = value
    rank = {name: i for i, name in enumerate(_ORDER)}
    return {name: cfg[name] for name in sorted(cfg, key=lambda n: rank.get(n, len(rank)))}


# --------------------------------------------------------- a small network, optimizers by name
DTYPE = torch.float64


def digits_affine(**options: Any) -> dict[str, Any]:
    """The affine run of the memory-map drivers' tests on the digits: its optimizer table,
    ``options`` overriding its entries (``None`` drops one)."""
    optimizer = {
        "name": "affine",
        "lr": 0.1,
        "scale_lr": 10.0,
        "temperature": 0.1,
        "prior_precision": 25.0,
        "base_scale": 0.02,
        **options,
    }
    return {"optimizer": {k: v for k, v in optimizer.items() if v is not None}}


def make_problem(seed: int = 0, dtype: torch.dtype = DTYPE):
    """A small tanh network and a fixed classification batch."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.5)
    x = torch.randn(32, 5, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (32,), generator=gen)
    return model, x, y


def closure_for(opt, model, x, y):
    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return closure


def snapshot(opt, model):
    params = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    return params, states


# each rule with small hyperparameters; keywords override them
FACTORIES: dict[str, Callable[..., Any]] = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(ps, **{"lr": 0.1, "data_size": 10, **kw}),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, **{"lr": 0.1, "data_size": 10, "init": "auto", **kw}
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(
        ps, **{"lr": 0.1, "scale_lr": 0.01, "data_size": 10, **kw}
    ),
    "generic": lambda ps, **kw: lgb.LieGroupBLR(
        ps, DiagonalAffineGroup(), Normal(0.0, 0.1), **{"lr": 0.1, "data_size": 10, **kw}
    ),
}
