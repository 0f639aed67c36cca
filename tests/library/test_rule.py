"""A rule written from the :class:`~liegroup_blr.optim.Rule` protocol alone, passed to
:class:`~liegroup_blr.optim.BLROptimizer` without subclassing it, trains as the built-in rule
with the same formulas does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.groups import AdditiveGroup
from liegroup_blr.optim import BLROptimizer, Rule
from liegroup_blr.optim.tensors import Proposal
from tests.shared import closure_for, make_problem


class PlainAdditive(Rule):
    """The additive rule in plain torch: θ = m + ξ, M ← βM + (1 − β)X̂, m ← m − αM."""

    def init_state(self, group, p):
        m = p.detach().clone()
        return {"element": m, "momentum": torch.zeros_like(m)}

    def draw(self, group, t, xi):
        for m, x, p in zip(t.elements, xi, t.params, strict=True):
            torch.add(m, x, out=p)
        return xi

    def accumulate(self, group, t, noise, grads, first):
        for acc, g in zip(t.accs, grads, strict=True):
            acc.copy_(g) if first else acc.add_(g)

    def propose(self, group, t, n, sample, offset, draw_next):
        grads = t.accs if sample is None else sample[1]
        for acc, m, g in zip(t.accs, t.momenta, grads, strict=True):
            torch.lerp(g * (1.0 / n), m, group["momentum"], out=acc)

        def commit():
            for m, acc, p in zip(t.elements, t.accs, t.params, strict=True):
                m.add_(acc, alpha=-group["lr"])
                p.copy_(m)

        return Proposal(t.accs, commit=commit)

    def write_point(self, group, params, elements, mean):
        for p, m in zip(params, elements, strict=True):
            p.copy_(m)


DEFAULTS = dict(
    lr=0.05,
    momentum=0.9,
    base=Normal(0.0, 0.01),
    data_size=32,
    temperature=1.0,
    prior_precision=1.0,
    weight_decay=0.0,
)


def _pair(mc_samples, between_steps):
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    options = dict(mc_samples=mc_samples, between_steps=between_steps, seed=3)
    rule = PlainAdditive(AdditiveGroup())
    ours = BLROptimizer(model.parameters(), dict(DEFAULTS), rule, **options)
    built_in = lgb.AdditiveBLR(twin.parameters(), **DEFAULTS, **options)
    return (model, ours), (twin, built_in), (x, y)


@pytest.mark.parametrize("between_steps", ["point", "sample"])
@pytest.mark.parametrize("mc_samples", [1, 3])
def test_a_rule_passed_to_the_optimizer_trains_as_the_built_in_rule(mc_samples, between_steps):
    *runs, (x, y) = _pair(mc_samples, between_steps)
    start = [p.detach().clone() for p in runs[0][0].parameters()]
    for model, opt in runs:
        for _ in range(5):
            opt.step(closure_for(opt, model, x, y))
    (model, ours), (twin, built_in) = runs
    for p, q, p0 in zip(model.parameters(), twin.parameters(), start, strict=True):
        assert not torch.equal(p, p0)  # trained, through the samples
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(
            ours.state[p]["element"], built_in.state[q]["element"], rtol=1e-12, atol=1e-14
        )


def test_a_rule_passed_to_the_optimizer_resumes_and_names_itself():
    (model, ours), _, _ = _pair(1, "point")
    saved = ours.state_dict()
    assert saved["param_groups"][0]["rule"] == "BLROptimizer, AdditiveGroup()"
    again = BLROptimizer(model.parameters(), dict(DEFAULTS), PlainAdditive(AdditiveGroup()))
    again.load_state_dict(saved)
    assert again.seed == ours.seed
    with pytest.raises(ValueError, match="saved by 'BLROptimizer, AdditiveGroup\\(\\)'"):
        lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.1, data_size=32).load_state_dict(saved)


def test_a_rule_must_be_a_rule():
    with pytest.raises(ValueError, match=r"rule: expected a liegroup_blr\.optim\.rule\.Rule"):
        BLROptimizer([nn.Parameter(torch.zeros(2))], dict(DEFAULTS), AdditiveGroup())
