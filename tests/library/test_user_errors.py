"""What a user meets when a state dict or a rule does not fit: one line that names it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.optim import BLROptimizer
from liegroup_blr.optim.additive import AdditiveRule

RULES = {
    "additive": lambda ps: lgb.AdditiveBLR(ps, lr=0.1, data_size=10),
    "multiplicative": lambda ps: lgb.MultiplicativeBLR(ps, lr=0.1, data_size=10, init="keep"),
    "affine": lambda ps: lgb.AffineBLR(ps, lr=0.1, data_size=10),
}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_state_dict_of_another_architecture_names_the_parameter_and_shapes(rule, named):
    wide = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    narrow = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    saved = RULES[rule](wide.parameters()).state_dict()
    opt = RULES[rule](narrow.named_parameters() if named else narrow.parameters())
    before = {k: v.clone() for k, v in narrow.state_dict().items()}
    which = "parameter '0.weight'" if named else "parameter 0 of param group 0"
    with pytest.raises(ValueError, match=rf"{which} has shape \(8, 8\) here, but its saved "
                       r"state is for shape \(16, 8\)"):  # fmt: skip
        opt.load_state_dict(saved)
    for k, v in narrow.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k])


def test_a_rule_built_without_a_required_key_lists_them():
    with pytest.raises(ValueError, match="defaults: missing data_size, temperature, prior_"):
        BLROptimizer(
            [nn.Parameter(torch.ones(2))],
            dict(lr=0.1, momentum=0.9, base=Normal(0.0, 0.1)),
            AdditiveRule(lgb.groups.AdditiveGroup()),
        )
