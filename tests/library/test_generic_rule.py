"""The generic rule for custom groups: a group per param group, guarded steps, checked inputs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac, Rayleigh
from liegroup_blr.fisher import entropy_gradient
from liegroup_blr.groups import (
    AdditiveGroup,
    DiagonalAffineGroup,
    FullAffineGroup,
    MultiplicativeGroup,
)
from tests.shared import DTYPE, closure_for, make_problem, snapshot


def _split(model):
    first, last = list(model[0].parameters()), list(model[2].parameters())
    return first, last


@pytest.mark.slow
def test_param_groups_with_their_own_groups_equal_one_optimizer_per_group():
    """One LieGroupBLR with a multiplicative first layer and a full-affine last layer steps
    exactly as two optimizers, one per group, that share each sample's forward pass."""
    model, x, y = make_problem()
    with torch.no_grad():  # unsigned multiplicative elements start from positive weights
        for p in model[0].parameters():
            p.abs_().add_(0.5)
    twin = copy.deepcopy(model)
    mult = dict(group=MultiplicativeGroup(signed=False), base=Dirac(1.0), lr=0.3)
    full = dict(group=FullAffineGroup(), base=Dirac(0.0), lr=0.1)
    first, last = _split(model)
    joint = lgb.LieGroupBLR(
        [{"params": first, **mult}, {"params": last, **full}],
        AdditiveGroup(),
        Normal(0.0, 1.0),
        lr=0.1,
        data_size=32,
        temperature=0.5,
    )
    t_first, t_last = _split(twin)
    a = lgb.LieGroupBLR(t_first, mult["group"], mult["base"], lr=0.3, data_size=32, temperature=0.5)
    b = lgb.LieGroupBLR(t_last, full["group"], full["base"], lr=0.1, data_size=32, temperature=0.5)
    closure = closure_for(joint, model, x, y)
    for _ in range(5):
        joint.step(closure)
        sa, sb = a.draw(), b.draw()
        a.zero_grad()
        b.zero_grad()
        with torch.enable_grad():
            nn.functional.cross_entropy(twin(x), y).backward()
        a.accumulate(sa)
        b.accumulate(sb)
        a.step()
        b.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert joint.state[first[0]]["element"].shape == first[0].shape
    n = last[0].numel()
    assert joint.state[last[0]]["element"].shape == (n * (n + 3) // 2,)


@pytest.mark.slow
def test_mixed_groups_state_dict_round_trip_continues_bit_identically():
    model, x, y = make_problem()
    first, last = _split(model)
    make = lambda ps: lgb.LieGroupBLR(  # noqa: E731
        ps, DiagonalAffineGroup(), Normal(0.0, 0.05), lr=0.05, data_size=32, seed=3
    )
    groups = [{"params": first}, {"params": last, "group": FullAffineGroup()}]
    opt = make(groups)
    closure = closure_for(opt, model, x, y)
    for _ in range(3):
        opt.step(closure)
    twin = copy.deepcopy(model)
    t_first, t_last = _split(twin)
    other = make([{"params": t_first}, {"params": t_last, "group": FullAffineGroup()}])
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    closure2 = closure_for(other, twin, x, y)
    for _ in range(3):
        opt.step(closure)
        other.step(closure2)
    for (p, s), (q, t) in zip(
        zip(*snapshot(opt, model), strict=True),
        zip(*snapshot(other, twin), strict=True),
        strict=True,
    ):
        assert torch.equal(p, q)
        assert all(torch.equal(s[k], t[k]) for k in s)


def test_a_diverging_custom_group_step_is_skipped_warned_once_and_can_raise():
    """matrix_exp of a huge algebra step overflows: the proposed element is not finite, so the
    step is skipped (elements and momenta unchanged), with a warning at the first skip only.
    θ is drawn from a seeded generator: for about 5 % of draws the step stays finite."""
    theta = nn.Parameter(torch.randn(4, dtype=DTYPE, generator=torch.Generator().manual_seed(0)))
    opt = lgb.LieGroupBLR(
        [theta], FullAffineGroup(), Normal(0.0, 0.1), lr=1e6, data_size=10, seed=0
    )

    def closure():
        opt.zero_grad()
        loss = 1e3 * (theta**4).sum()
        loss.backward()
        return loss

    before = {k: v.clone() for k, v in opt.state[theta].items()}
    for count in (1, 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(closure)
        said = [str(w.message) for w in caught]
        assert len(said) == (1 if count == 1 else 0), said
        assert all("non-finite updated element" in m for m in said)
        assert opt.skipped_steps == count
        assert all(torch.equal(before[k], opt.state[theta][k]) for k in before)
    strict = lgb.LieGroupBLR(
        [theta],
        FullAffineGroup(),
        Normal(0.0, 0.1),
        lr=1e6,
        data_size=10,
        seed=0,
        max_consecutive_skips=2,
    )

    def closure2():
        strict.zero_grad()
        loss = 1e3 * (theta**4).sum()
        loss.backward()
        return loss

    with pytest.warns(RuntimeWarning, match="non-finite updated element"):
        strict.step(closure2)
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        strict.step(closure2)


def test_init_returning_an_invalid_element_raises():
    w = nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match="init"):
        lgb.LieGroupBLR(
            [w],
            MultiplicativeGroup(signed=False),
            Rayleigh(1.0),
            lr=0.1,
            data_size=10,
            init=lambda theta: -theta.abs() - 1.0,
        )


def test_a_group_key_is_refused_by_the_specialised_rules_and_checked_by_the_generic_one():
    w = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="group"):
        lgb.AdditiveBLR([{"params": [w], "group": DiagonalAffineGroup()}], lr=0.1)
    with pytest.raises(ValueError, match="group"):
        lgb.LieGroupBLR([{"params": [w], "group": "affine"}], AdditiveGroup(), Normal(0, 1), lr=0.1)


@pytest.mark.parametrize(
    "change",
    [
        dict(group=MultiplicativeGroup(signed=False), base=Rayleigh(1.0)),
        dict(preconditioner=[0.5, 2.0]),
    ],
)
def test_loading_a_state_dict_of_another_group_or_preconditioner_raises(change):
    w = nn.Parameter(torch.rand(3) + 0.5)
    kwargs = dict(group=DiagonalAffineGroup(), base=Normal(0.0, 0.1))
    saved = lgb.LieGroupBLR([w], lr=0.1, data_size=10, **kwargs).state_dict()
    other = lgb.LieGroupBLR([w], lr=0.1, data_size=10, **{**kwargs, **change})
    with pytest.raises(ValueError, match="state_dict: param group 0 was saved by"):
        other.load_state_dict(saved)


def test_step_factors_by_component_name_equal_factors_by_position():
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    make = lambda ps, pre: lgb.LieGroupBLR(  # noqa: E731
        ps,
        DiagonalAffineGroup(),
        Normal(0.0, 0.1),
        lr=0.1,
        data_size=32,
        seed=1,
        preconditioner=pre,
    )
    by_name = make(model.parameters(), {"scale": 0.25, "shift": 2.0})
    by_position = make(twin.parameters(), [0.25, 2.0])
    c1, c2 = closure_for(by_name, model, x, y), closure_for(by_position, twin, x, y)
    for _ in range(3):
        by_name.step(c1)
        by_position.step(c2)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="unknown components"):
        make(model.parameters(), {"scael": 0.25})


@pytest.mark.compile
def test_compiled_generic_rule_with_a_matrix_exp_group_equals_eager():
    """compile=True traces the custom group's exp (torch.linalg.matrix_exp), vjp and grad."""
    torch.manual_seed(0)
    model, x, y = nn.Sequential(nn.Linear(4, 3)), torch.randn(16, 4), torch.randint(0, 3, (16,))
    twin = copy.deepcopy(model)
    make = lambda m, **kw: lgb.LieGroupBLR(  # noqa: E731
        m.parameters(), FullAffineGroup(), Normal(0.0, 0.05), lr=0.01, data_size=100, seed=0, **kw
    )
    compiled, eager = make(model, compile=True), make(twin)
    for _ in range(3):
        compiled.step(closure_for(compiled, model, x, y))
        eager.step(closure_for(eager, twin, x, y))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "group",
    [
        AdditiveGroup(),
        MultiplicativeGroup(signed=True),
        DiagonalAffineGroup(),
        FullAffineGroup(),
        lgb.groups.RotationScalingGroup(),
    ],
    ids=lambda g: g.name,
)
def test_entropy_gradient_is_the_same_at_every_element(group):
    """log|det J| is a homomorphism (the action's Jacobian does not depend on ξ), so its
    algebra gradient at g equals the one at the identity, which the generic rule caches."""
    shape = (4, 2)
    gen = torch.Generator().manual_seed(5)
    X = 0.5 * torch.randn(group.algebra_shape(shape), generator=gen, dtype=DTYPE)
    g = group.exp(X)
    identity = group.identity(shape, dtype=DTYPE)
    torch.testing.assert_close(entropy_gradient(group, g), entropy_gradient(group, identity))
