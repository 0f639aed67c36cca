"""The README's swap-in values train a small MLP and a small CNN without a skipped step, with
each of the seeds 0–9."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import liegroup_blr as lgb

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_optimizers() -> dict[str, dict[str, float]]:
    """The keyword arguments of the three optimizer lines of the README's swap-in example
    (``lgb.<Rule>(model.parameters(), ...)`` and its ``# or lgb.<Rule>(..., ...)`` lines)."""
    found = {}
    for name, args in re.findall(
        r"lgb\.(\w+BLR)\((?:model\.parameters\(\)|\.\.\.), (.*?)\)\n", README.read_text()
    ):
        call = ast.parse(f"f({args})", mode="eval").body
        assert isinstance(call, ast.Call)
        found[name] = {
            k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "data_size"
        }
    return found


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 16, 10),
    )


def test_the_readme_names_the_three_rules():
    assert set(readme_optimizers()) == {"AdditiveBLR", "MultiplicativeBLR", "AffineBLR"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("net", [mlp, cnn], ids=["mlp", "cnn"])
@pytest.mark.parametrize("rule", ["AdditiveBLR", "MultiplicativeBLR", "AffineBLR"])
def test_readme_values_train_a_small_network_without_skipped_steps(rule, net, seed):
    """Ten passes over the 8×8 digits (1,437 train / 360 test, batch 50), seeds 0–9: no step
    skipped, and the point estimate at least four times chance (10 %). The multiplicative
    rule's former step size 5 skipped steps on the CNN with seeds 5 and 7."""
    torch.manual_seed(seed)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    n = 1437
    model = net()
    options = readme_optimizers()[rule]
    if rule == "MultiplicativeBLR":
        options["init"] = "auto"  # the README's default, without its warning
    opt = getattr(lgb, rule)(model.parameters(), data_size=n, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a skipped step warns
        for _ in range(10):
            for idx in torch.randperm(n).split(50):

                def closure(idx=idx):
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                    loss.backward()
                    return loss

                opt.step(closure)
    assert opt.skipped_steps == 0
    with torch.no_grad():
        accuracy = (model(x[n:]).argmax(-1) == y[n:]).float().mean().item()
    assert accuracy > 0.4
