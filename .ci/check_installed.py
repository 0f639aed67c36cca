"""The installed wheel, used as a user would: from a folder outside the checkout.

    python check_installed.py README_EXAMPLE.py

Run by the fresh environment's interpreter. liegroup_blr must come from that environment's
site-packages with its metadata's version; the README's swap-in example (extracted from
README.md by the caller) must run and train; one step of each optimizer must move every
parameter and its group element to finite values.
"""

from __future__ import annotations

import importlib.metadata
import math
import runpy
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb

# The README's example trains 10 passes over 1,000 points of a 3-class task; an untrained
# network is near chance (about 1/3). Its test accuracy measured 0.945 on 200 points.
README_MIN_ACCURACY = 0.85


def fail(message: str) -> None:
    sys.exit(f"check_installed: {message}")


def check_the_installed_copy() -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    module = Path(lgb.__file__).resolve()
    if sys.prefix == sys.base_prefix or not module.is_relative_to(site):
        fail(f"liegroup_blr imported from {module}, not from this environment's {site}")
    if not (module.parent / "py.typed").is_file():
        fail("the installed package has no py.typed")
    if importlib.metadata.version("liegroup_blr") != lgb.__version__:
        fail(f"metadata {importlib.metadata.version('liegroup_blr')} ≠ {lgb.__version__}")
    print(f"check_installed: liegroup_blr {lgb.__version__} from {module.parent}")


def check_readme_example(path: str) -> None:
    scope = runpy.run_path(path, run_name="__main__")
    probs, y_test = scope["probs"], scope["y_test"]
    if probs.shape != (len(y_test), 3) or not torch.allclose(probs.sum(-1), torch.ones(())):
        fail("the README example's model average is not a probability table per test point")
    accuracy = (probs.argmax(-1) == y_test).double().mean().item()
    if accuracy < README_MIN_ACCURACY:
        fail(f"the README example reaches {accuracy:.3f} < {README_MIN_ACCURACY} test accuracy")


OPTIMIZERS: dict[str, Callable[[nn.Module], lgb.optim.BLROptimizer]] = {
    "AdditiveBLR": lambda m: lgb.AdditiveBLR(m.parameters(), lr=0.05, data_size=64),
    "MultiplicativeBLR": lambda m: lgb.MultiplicativeBLR(
        m.parameters(), lr=1.0, temperature=0.01, data_size=64, init="auto"
    ),
    "AffineBLR": lambda m: lgb.AffineBLR(m.parameters(), lr=1.0, scale_lr=0.05, data_size=64),
    "LieGroupBLR": lambda m: lgb.LieGroupBLR(
        m.parameters(), lgb.groups.DiagonalAffineGroup(), Normal(0.0, 0.01), lr=0.1, data_size=64
    ),
}


def check_one_step(name: str) -> None:
    """One closure step on a small regression: finite loss, every tensor moved and finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    opt = OPTIMIZERS[name](model)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    params = list(model.parameters())
    before = [(p.detach().clone(), opt.group_element(p)) for p in params]
    loss = opt.step(closure)
    if not math.isfinite(float(loss)):
        fail(f"{name}: the step's loss is {loss}")
    for p, (point, element) in zip(params, before, strict=True):
        after = opt.group_element(p).values()
        for new, old in [(p.detach(), point), *zip(after, element.values(), strict=True)]:
            if not new.isfinite().all() or torch.equal(new, old):
                fail(f"{name}: a step left a parameter or its group element unmoved or non-finite")


def main() -> None:
    torch.set_num_threads(1)
    check_the_installed_copy()
    check_readme_example(sys.argv[1])
    for name in OPTIMIZERS:
        check_one_step(name)
    print(f"check_installed: the README example and one step of {', '.join(OPTIMIZERS)} ran")


if __name__ == "__main__":
    main()
