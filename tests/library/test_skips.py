"""Skipped steps escalate: a step whose loss, gradient or updated element is not finite is
skipped, the optimizer state unchanged; only the first skip of a run warns (naming what was not
finite and for which parameter), later ones are counted in ``skipped_steps``, and
``max_consecutive_skips`` (default 20) skips in a row raise ``FloatingPointError`` naming the
likely fix."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.groups import FullAffineGroup
from tests.shared import DTYPE, FACTORIES, closure_for, make_problem, snapshot

KINDS = list(FACTORIES)


def nan_loss(opt, model, x, y):
    """A closure whose loss (and so every gradient) is NaN."""
    good = closure_for(opt, model, x, y)
    return lambda: good() * math.nan


def nan_gradient(opt, model, x, y, param: nn.Parameter):
    """A closure whose loss is finite but one entry of ``param``'s gradient NaN."""
    good = closure_for(opt, model, x, y)

    def closure():
        loss = good()
        param.grad.view(-1)[0] = math.nan  # type: ignore[union-attr]
        return loss

    return closure


def caught(steps):
    """The RuntimeWarnings ``steps()`` gives, every one recorded."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        steps()
    return [w for w in seen if issubclass(w.category, RuntimeWarning)]


def state_of(opt, params):
    """Copies of ``params`` and of their optimizer states."""
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    return [p.detach().clone() for p in params], states


def assert_same(before, after):
    for p, q in zip(before[0], after[0], strict=True):
        assert torch.equal(p, q)
    for s, t in zip(before[1], after[1], strict=True):
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


# ------------------------------------------------------------------ escalation
@pytest.mark.parametrize("kind", KINDS)
def test_twenty_skips_in_a_row_raise_by_default_naming_the_fix(kind):
    """By default the 20th skipped step in a row raises FloatingPointError naming what was not
    finite and the fixes: a lower lr (and the affine rule's scale step), a wider prior. The
    state and the parameters are as before the first skip."""
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters())
    assert opt.max_consecutive_skips == 20
    opt.step(closure_for(opt, model, x, y))
    before = snapshot(opt, model)
    bad = nan_loss(opt, model, x, y)
    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        opt.step(bad)
    for _ in range(18):
        opt.step(bad)
    with pytest.raises(FloatingPointError) as raised:
        opt.step(bad)
    message = str(raised.value)
    for words in ("20 steps in a row", "non-finite loss", "Lower lr", "next_task/set_prior"):
        assert words in message, message
    assert ("scale_lr" in message) == (kind == "affine"), message
    assert opt.skipped_steps == 20
    assert_same(before, snapshot(opt, model))


@pytest.mark.parametrize("mode", ["point", "sample"])
def test_an_escalation_leaves_the_optimizer_as_a_skip_does(mode):
    """The error is raised once the step is over (the parameters hold what they hold between
    steps, nothing is left pending): a run that goes on after it (caught) is bit for bit the
    run that was never stopped (max_consecutive_skips=None)."""
    runs = []
    for limit in (3, None):
        model, x, y = make_problem()
        opt = FACTORIES["affine"](
            model.parameters(), seed=0, between_steps=mode, max_consecutive_skips=limit
        )
        bad, good = nan_loss(opt, model, x, y), closure_for(opt, model, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step(bad)
            opt.step(bad)
        if limit is None:
            opt.step(bad)
        else:
            with pytest.raises(FloatingPointError, match="3 steps in a row"):
                opt.step(bad)
        after_skips = snapshot(opt, model)
        for _ in range(2):
            opt.step(good)
        runs.append((after_skips, snapshot(opt, model)))
    for one, other in zip(*runs, strict=True):
        assert_same(one, other)


def test_a_good_step_resets_the_count_in_a_row():
    """19 skips, a step taken, 19 skips: no error (the total is 38); the 20th in a row
    raises."""
    model, x, y = make_problem()
    opt = FACTORIES["additive"](model.parameters())
    bad, good = nan_loss(opt, model, x, y), closure_for(opt, model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(19):
            opt.step(bad)
        opt.step(good)
        for _ in range(19):
            opt.step(bad)
    assert opt.skipped_steps == 38
    with pytest.raises(FloatingPointError, match=r"20 steps in a row .* 39 skipped in all"):
        opt.step(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_none_never_raises_and_still_warns_once(kind):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), max_consecutive_skips=None)
    assert opt.max_consecutive_skips is None
    bad = nan_loss(opt, model, x, y)

    def steps():
        for _ in range(50):
            opt.step(bad)

    said = caught(steps)
    assert len(said) == 1 and "non-finite loss" in str(said[0].message)
    assert "FloatingPointError" not in str(said[0].message)
    assert opt.skipped_steps == 50


@pytest.mark.parametrize("limit", [0, -1, 2.5, True])
def test_a_limit_that_is_not_a_count_is_refused(limit):
    model, _, _ = make_problem()
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        FACTORIES["additive"](model.parameters(), max_consecutive_skips=limit)


# ---------------------------------------------------------------- one warning
def _diverging_group():
    """matrix_exp of a huge algebra step overflows: the proposed element of the full affine
    group is not finite (test_generic_rule's diverging custom group)."""
    theta = nn.Parameter(torch.randn(4, dtype=DTYPE, generator=torch.Generator().manual_seed(0)))
    opt = lgb.LieGroupBLR(
        [("theta", theta)], FullAffineGroup(), Normal(0.0, 0.1), lr=1e6, data_size=10, seed=0
    )

    def closure():
        opt.zero_grad()
        loss = 1e3 * (theta**4).sum()
        loss.backward()
        return loss

    return opt, closure, "non-finite updated element (or one not in its group) of parameter 'theta'"


@pytest.mark.parametrize("what", ["loss", "gradient", "element"])
def test_many_skips_warn_once_at_the_users_line_naming_what_and_which_parameter(what):
    """Ten skipped steps: one RuntimeWarning, at the calling line, that says whether the loss,
    a gradient or an updated element was not finite, and for which parameter (by the name the
    optimizer was given); all ten are counted, and the state is unchanged."""
    if what == "element":
        opt, closure, words = _diverging_group()
        params = opt.param_groups[0]["params"]
    else:
        model, x, y = make_problem()
        opt = FACTORIES["affine"](model.named_parameters())
        if what == "loss":
            closure, words = nan_loss(opt, model, x, y), "non-finite loss;"
        else:
            closure = nan_gradient(opt, model, x, y, model[2].bias)
            words = "non-finite gradient of parameter '2.bias';"
        opt.step(closure_for(opt, model, x, y))
        params = list(model.parameters())
    before = state_of(opt, params)

    def steps():
        for _ in range(10):
            opt.step(closure)

    said = caught(steps)
    assert len(said) == 1, [str(w.message) for w in said]
    assert words in str(said[0].message), str(said[0].message)
    assert "skipped_steps" in str(said[0].message)
    assert said[0].filename == __file__
    assert opt.skipped_steps == 10
    assert_same(before, state_of(opt, params))


def test_a_parameter_without_a_name_is_named_by_its_place_in_its_param_group():
    model, x, y = make_problem()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt = FACTORIES["generic"]([{"params": first}, {"params": second}])
    bad = nan_gradient(opt, model, x, y, model[2].bias)
    said = caught(lambda: opt.step(bad))
    assert len(said) == 1
    assert "non-finite gradient of parameter 1 of param group 1;" in str(said[0].message)


def test_skips_the_grad_scaler_expects_are_counted_not_warned_nor_escalated():
    """A GradScaler calibrating its scale skips steps: counted, never warned of, never in a
    row; a divergence after them warns as the run's first skip."""
    model, x, y = make_problem(dtype=torch.float32)
    opt = FACTORIES["additive"](model.parameters(), between_steps="sample", max_consecutive_skips=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)

    def scaled_inf():
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        model[2].bias.grad[0] = math.inf  # type: ignore[index]
        scaler.step(opt)
        scaler.update()

    def calibrating():
        for _ in range(3):
            scaled_inf()

    assert caught(calibrating) == []
    assert opt.skipped_steps == 3
    said = caught(lambda: opt.step(nan_loss(opt, model, x, y)))
    assert len(said) == 1 and "non-finite loss" in str(said[0].message)
    assert opt.skipped_steps == 4


def test_the_skip_count_survives_a_state_dict_and_the_state_dict_keeps_its_keys():
    model, x, y = make_problem()
    opt = FACTORIES["affine"](model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            opt.step(nan_loss(opt, model, x, y))
    saved = opt.state_dict()
    assert saved["skipped_steps"] == 3
    twin_model, _, _ = make_problem()
    twin = FACTORIES["affine"](twin_model.parameters())
    twin.load_state_dict(saved)
    assert twin.skipped_steps == 3
    assert twin.state_dict().keys() == saved.keys()
