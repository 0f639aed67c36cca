"""Writes to the parameters made outside the optimizer stand, as with torch.optim: the written
value becomes the posterior's location (its point estimate), in point and sample mode, for
every rule; rewrites of the same values change nothing; what cannot be adopted is refused in
one line. The tests assert the location after the write (the training forwards run at
samples). Each fails on the old main, which overwrote the write at the next step."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac, Rayleigh
from liegroup_blr.groups import AdditiveGroup, LieGroup, MultiplicativeGroup
from tests.integrations.test_training_loops import assert_equal, plain_step
from tests.shared import FACTORIES, closure_for, make_problem, snapshot

KINDS = list(FACTORIES)
MODES = ["point", "sample"]
WRITTEN = "written outside the optimizer"


def point_of(opt, model) -> list[torch.Tensor]:
    with opt.point_estimate():
        return [p.detach().clone() for p in model.parameters()]


def other_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights to load: well away from the model's, and inside each part's spread for the
    multiplicative rule's split (small)."""
    gen = torch.Generator().manual_seed(9)
    return {
        k: 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        for k, v in model.state_dict().items()
    }


def step(opt, model, x, y, mode: str) -> None:
    if mode == "sample":
        plain_step(opt, model, x, y)
    else:
        opt.step(closure_for(opt, model, x, y))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_after_construction_is_the_new_location(kind, mode):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0, between_steps=mode)
    step(opt, model, x, y, mode)
    weights = other_weights(model)
    model.load_state_dict(weights)
    with pytest.warns(UserWarning, match=WRITTEN):
        points = point_of(opt, model)
    exact = kind != "multiplicative"  # its split rounds: g⁺ − g⁻ is the value to an ulp
    for p, w in zip(points, weights.values(), strict=True):
        if exact:
            assert torch.equal(p, w)
        else:
            torch.testing.assert_close(p, w, rtol=1e-12, atol=1e-15)
    before = [p.clone() for p in points]
    step(opt, model, x, y, mode)  # trains from there
    after = point_of(opt, model)
    moved = max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))
    assert 0 < moved < 0.05  # one small step from the loaded weights, not back to the old ones


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_in_point_mode_trains_as_an_optimizer_built_on_the_written_weights(kind):
    """With the momenta at 0, the step after the write equals the first step of an optimizer
    built on the written weights with the same noise (additive and affine: exactly; their
    location is the value itself)."""
    if kind == "multiplicative":
        pytest.skip("its location is a split of the value, not the value")
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0)
    weights = other_weights(model)
    model.load_state_dict(weights)
    with pytest.warns(UserWarning, match=WRITTEN):
        opt.step(closure_for(opt, model, x, y))
    fresh, _, _ = make_problem()
    fresh.load_state_dict(weights)
    built = FACTORIES[kind](fresh.parameters(), seed=0)
    built.step(closure_for(built, fresh, x, y))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_in_sample_mode_the_written_value_is_the_location_and_the_sample_at_xi0():
    """Sample mode: the write is the location, and the parameters keep it as the training
    sample at ξ₀ (for the additive rule ξ₀ = 0): a gradient taken at the written weights is
    the gradient of that sample, so the step is m ← w − α(1 − β)∇ℓ(w)."""
    model, x, y = make_problem()
    opt = lgb.AdditiveBLR(
        model.parameters(), lr=0.1, momentum=0.0, base=Normal(0.0, 0.1), between_steps="sample"
    )
    weights = other_weights(model)
    model.load_state_dict(weights)
    held = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="training sample until the next step"):
        opt.step()
    for p, w, g, h in zip(model.parameters(), weights.values(), grads, held, strict=True):
        assert torch.equal(h, w)
        torch.testing.assert_close(opt.group_element(p)["m"], w - 0.1 * g, rtol=0, atol=1e-15)


@pytest.mark.parametrize("kind", KINDS)
def test_a_constraint_applied_after_every_step_stands(kind):
    """A weight clamp to ±0.05 after each step (point mode): the location stays clamped; on
    the old main the optimizer undid it at every step."""
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0, lr=0.5)
    for _ in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            opt.step(closure_for(opt, model, x, y))
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        points = point_of(opt, model)
    assert all(float(p.abs().max()) <= 0.05 * (1 + 1e-12) for p in points)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_rewriting_the_same_values_changes_nothing_and_warns_nothing(kind, mode):
    """What DDP's broadcast or accelerate's prepare do: the version moves, the value does not."""
    runs = []
    for rewrite in (False, True):
        model, x, y = make_problem()
        opt = FACTORIES[kind](model.parameters(), seed=0, between_steps=mode)
        for _ in range(2):
            if rewrite:
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(p.clone())
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                step(opt, model, x, y, mode)
        runs.append(snapshot(opt, model))
    assert_equal(runs[1], runs[0])


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["additive", "multiplicative", "affine"])
def test_a_posteriors_sample_held_in_the_model_is_no_write_under_compile(kind):
    """``post.sampled(model)`` writes a sample and the old values back: no write of the
    user's, also where the compiled update rounded the held values otherwise than eager code
    would."""
    runs = []
    for looking in (False, True):
        model, x, y = make_problem(dtype=torch.float32)
        opt = FACTORIES[kind](model.parameters(), seed=0, between_steps="sample", compile=True)
        for _ in range(3):
            if looking:
                post = opt.posterior(model)
                with post.sampled(model, generator=torch.Generator().manual_seed(0)):
                    model(x)
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                plain_step(opt, model, x, y)
        runs.append(snapshot(opt, model))
    assert_equal(runs[1], runs[0])


def _in_point_estimate(opt, model, x, y):
    with opt.point_estimate():
        model(x)


def _in_sampled_params(opt, model, x, y):
    with opt.sampled_params():
        model(x)


ADOPTING_CALLS = {
    "step": lambda opt, model, x, y: opt.step(closure_for(opt, model, x, y)),
    "point_estimate": _in_point_estimate,
    "sampled_params": _in_sampled_params,
    "restore": lambda opt, *_: opt.restore(),
    "posterior": lambda opt, *_: opt.posterior(),
    "state_dict": lambda opt, *_: opt.state_dict(),
    "group_element": lambda opt, model, *_: opt.group_element(model[0].weight),
    "draw": lambda opt, *_: opt.draw(train=False),
    "discard": lambda opt, *_: opt.discard(),
    "set_prior": lambda opt, *_: opt.set_prior(None),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", ADOPTING_CALLS)
def test_the_write_warning_points_at_the_users_line(call, mode):
    """Whichever call finds the write, the warning names the user's file, not base.py."""
    model, x, y = make_problem()
    opt = FACTORIES["affine"](model.parameters(), seed=0, between_steps=mode)
    model.load_state_dict(other_weights(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ADOPTING_CALLS[call](opt, model, x, y)
    said = [w for w in caught if WRITTEN in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [w.filename for w in said]


def test_point_estimate_mean_divides_by_the_base_mean():
    model, _, _ = make_problem()
    opt = lgb.MultiplicativeBLR(
        model.parameters(), lr=0.1, data_size=10, point_at="mean", init="auto"
    )
    weights = other_weights(model)
    model.load_state_dict(weights)
    with pytest.warns(UserWarning, match=WRITTEN):
        points = point_of(opt, model)
    mean = float(Rayleigh(1.0).mean)
    for p, w, q in zip(points, weights.values(), model.parameters(), strict=True):
        torch.testing.assert_close(p, w, rtol=1e-12, atol=1e-15)
        parts = opt.group_element(q)
        torch.testing.assert_close(parts["g+"] - parts["g-"], w / mean, rtol=1e-12, atol=1e-15)


def test_the_multiplicative_split_keeps_the_spread_and_falls_back_where_none_has_it():
    G = MultiplicativeGroup()
    g = torch.tensor([[0.3, 0.4, 2.0, 0.01], [0.4, 0.3, 1.0, 0.02]], dtype=torch.float64)
    w = torch.tensor([0.2, -0.3, 0.5, 1.0], dtype=torch.float64)
    h = G.with_point(g, w, offset=1e-3)
    torch.testing.assert_close(h[0] - h[1], w, rtol=0, atol=1e-15)
    spread = g.square().sum(0)
    kept = w.square() < spread  # the last entry: w² = 1 ≥ 5e-4, no positive pair has it
    assert kept.tolist() == [True, True, True, False]
    torch.testing.assert_close(h.square().sum(0)[kept], spread[kept], rtol=1e-14, atol=0)
    assert h[:, 3].tolist() == pytest.approx([1.0 + 1e-3, 1e-3])  # relu(±w) + offset
    assert bool((h > 0).all())
    unsigned = MultiplicativeGroup(signed=False)
    got = unsigned.with_point(g[0], torch.tensor([0.5, -0.2, 0.0, 3.0], dtype=torch.float64))
    assert got.tolist() == [0.5, 1e-5, 1e-5, 3.0]  # a non-positive value: the offset


def test_a_group_without_with_point_is_refused_in_one_line_naming_set_group_element():
    class Translations(AdditiveGroup):  # a user's group, written without with_point
        with_point = LieGroup.with_point

    w = nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt = lgb.LieGroupBLR([w], Translations(), Normal(0.0, 0.1), lr=0.1, data_size=10)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="set_group_element") as info:
        opt.step(closure)
    assert "\n" not in str(info.value)
    opt.set_group_element(w, w.detach().clone())  # the way out: the write is the element
    assert torch.equal(opt.group_element(w)["m"], w.detach())
    opt.step(closure)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m: m.to(torch.float32), "after the optimizer was built"),
        (lambda m: m[0].weight.fill_(math.nan), "non-finite"),
    ],
    ids=["dtype", "nan"],
)
def test_what_cannot_be_a_location_is_refused_in_one_line(change, words):
    model, x, y = make_problem()
    opt = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.01, data_size=10)
    with torch.no_grad():
        change(model)
    with pytest.raises(RuntimeError, match=words) as info:
        opt.step(closure_for(opt, model, x, y))
    assert "\n" not in str(info.value)


def test_vector_to_parameters_replaces_the_storage_and_is_seen():
    model, _, _ = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1, base=Dirac(0.0))
    flat = torch.nn.utils.parameters_to_vector(model.parameters()) * 0.5
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    with pytest.warns(UserWarning, match=WRITTEN):
        points = point_of(opt, model)
    assert torch.equal(torch.nn.utils.parameters_to_vector(points), flat)


def test_writes_through_data_are_not_seen():
    """``p.data.clamp_()`` bypasses the version counter (documented): the optimizer's point
    estimate stands at the next step, as the docs say."""
    model, _, _ = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1, base=Dirac(0.0))
    before = point_of(opt, model)
    model[0].weight.data.mul_(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert torch.equal(point_of(opt, model)[0], before[0])


def test_a_closure_that_makes_no_gradient_is_warned_once():
    model, x, y = make_problem()
    opt = lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.01, data_size=10)

    def forgetful():
        opt.zero_grad()
        return nn.functional.cross_entropy(model(x), y)  # no backward

    before = snapshot(opt, model)
    with pytest.warns(UserWarning, match="loss.backward"):
        opt.step(forgetful)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(9):
            opt.step(forgetful)
    assert_equal(snapshot(opt, model), before)


RULES = ["additive", "multiplicative", "affine"]


def held(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def stepped(kind: str):
    """A sample-mode optimizer after one step: its parameters hold the next training sample."""
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0, between_steps="sample")
    plain_step(opt, model, x, y)
    return model, opt, x, y


def assert_values(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("where", ["before", "inside"])
@pytest.mark.parametrize("kind", RULES)
def test_a_sample_drawn_again_inside_point_estimate_is_held_after_it(kind, where):
    """``restore()`` (before or inside the block), then ``load_state_dict(state_dict())``
    inside ``point_estimate()``, as BLRTrainer's callback does in an evaluation during
    training: the block holds the point estimate to its end; after it the parameters hold
    the training sample drawn again, and train on, as had the block not been entered. The
    old main put back what the block found at its start (after ``restore()``: the point
    estimate, taken for the optimizer's own write) and held the sample inside it."""
    reference, twin, x, y = stepped(kind)
    twin.restore()
    twin.load_state_dict(twin.state_dict())
    sample, points = held(reference), point_of(twin, reference)
    assert not any(torch.equal(a, b) for a, b in zip(sample, points, strict=True))
    model, opt, _, _ = stepped(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no write taken for an outside one
        if where == "before":
            opt.restore()
        with opt.point_estimate():
            if where == "inside":
                opt.restore()
            opt.load_state_dict(opt.state_dict())
            assert_values(held(model), points)
        assert_values(held(model), sample)
        plain_step(opt, model, x, y)
        plain_step(twin, reference, x, y)
    assert_equal(snapshot(opt, model), snapshot(twin, reference))


@pytest.mark.parametrize("kind", RULES)
def test_restore_inside_point_estimate_leaves_the_point_estimate_after_it(kind):
    """``restore()`` inside the block: after it the parameters hold the point estimate, and a
    closure-free step refuses (no training sample); the old main put the sample back."""
    model, opt, x, y = stepped(kind)
    points = point_of(opt, model)
    with opt.point_estimate():
        opt.restore()
    assert_values(held(model), points)
    with pytest.raises(RuntimeError, match=r"after restore\(\)"):
        plain_step(opt, model, x, y)
