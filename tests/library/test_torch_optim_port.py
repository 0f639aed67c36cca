"""PyTorch's generic optimizer tests, ported to the closure-taking Lie-group rules.

A port of pytorch's ``test/test_optim.py`` (with ``torch/testing/_internal/common_optimizers.py``)
written, as torch writes it for LBFGS, for optimizers whose ``step`` takes a closure: every step
below is ``opt.step(closure)`` (or ``sampled_params(train=True)`` blocks then ``opt.step()``).
The problem is torch's own, ``‖W x + b‖²`` with W of shape (10, 5), as an ``nn.Module`` so that
``copy.deepcopy((model, opt))`` copies a model together with the optimizer that points at it.

Tests of torch's that have no meaning here are left out: sparse and complex gradients (the rules
reject complex parameters), ``maximize``, ``foreach``/``fused``/``capturable`` variants, and
"a zero gradient is a no-op" (the Bayesian rules still move through momentum and entropy).
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributions import Normal
from torch.optim import lr_scheduler as sched
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.optim.swa_utils import SWALR, AveragedModel

import liegroup_blr as lgb
from liegroup_blr.groups import AdditiveGroup, DiagonalAffineGroup


# ------------------------------------------------------------------ the problem
class Quadratic(nn.Module):
    """torch's test problem, the loss ‖W x + b‖² (``contiguous=False``: strided W and b)."""

    def __init__(self, dtype: torch.dtype = torch.float32, contiguous: bool = True, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        shapes = [(10, 5), (10,)] if contiguous else [(10, 5, 2), (10, 2)]
        w, b = (torch.randn(s, generator=gen, dtype=dtype) for s in shapes)
        if not contiguous:
            w, b = w[..., 0], b[..., 0]
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(b)
        x = torch.randn(5, generator=torch.Generator().manual_seed(100), dtype=dtype)
        self.register_buffer("x", x)  # the same input for every seed

    def forward(self) -> torch.Tensor:
        return (self.weight @ self.x + self.bias).float().pow(2).sum()


SHARED = {"lr": 0.01, "momentum": 0.5, "data_size": 100, "seed": 0}
"""Hyperparameters of every rule here (the base is Normal(0, 0.01) where the rule takes any)."""


def additive(params, **kw):
    return lgb.AdditiveBLR(params, **{**SHARED, "base": Normal(0.0, 0.01), **kw})


def multiplicative(params, **kw):
    return lgb.MultiplicativeBLR(params, **{**SHARED, "init": "auto", **kw})


def affine(params, **kw):
    kw = {"scale_lr": 0.002, "scale_momentum": 0.9, "base": Normal(0.0, 0.01), **kw}
    return lgb.AffineBLR(params, **{**SHARED, **kw})


def generic(params, **kw):
    kw = {"group": DiagonalAffineGroup(), "base": Normal(0.0, 0.01), **kw}
    return lgb.LieGroupBLR(params, **{**SHARED, **kw})


def generic_additive(params, **kw):
    return generic(params, **{"group": AdditiveGroup(), **kw})


FACTORIES: dict[str, Callable[..., lgb.optim.BLROptimizer]] = {
    "additive": additive,
    "multiplicative": multiplicative,
    "affine": affine,
    "generic": generic,
}
KINDS = list(FACTORIES)


def closure_for(opt, model, set_to_none: bool = True):
    """torch's closure: zero the gradients, evaluate, backward, return the loss."""

    def closure():
        opt.zero_grad(set_to_none=set_to_none)
        loss = model()
        loss.backward()
        return loss

    return closure


def setup(kind: str, dtype=torch.float32, contiguous=True, named=False, **kw):
    model = Quadratic(dtype, contiguous)
    params = model.named_parameters() if named else model.parameters()
    return model, FACTORIES[kind](params, **kw)


def run(opt, model, steps: int, **kw) -> list[float]:
    closure = closure_for(opt, model, **kw)
    return [float(opt.step(closure)) for _ in range(steps)]


def snapshot(opt, model) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    return params, states


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical nested structures (tensors with ``torch.equal``)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} vs {b.keys()}"
        for k in a:
            assert_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_continue_alike(opt, model, opt2, model2, steps: int = 3) -> None:
    """Both pairs take ``steps`` further steps with bit-identical results."""
    for _ in range(steps):
        loss, loss2 = opt.step(closure_for(opt, model)), opt2.step(closure_for(opt2, model2))
        assert torch.equal(loss, loss2)
        assert_equal(snapshot(opt, model), snapshot(opt2, model2))


# ------------------------------------------------- basics: direction, printing
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_goes_right_direction(kind, dtype, contiguous):
    model, opt = setup(kind, dtype, contiguous)
    assert model.weight.is_contiguous() == contiguous
    losses = run(opt, model, 30)
    assert float(model().detach()) < 0.5 * losses[0]
    assert model.weight.is_contiguous() == contiguous and model.weight.dtype == dtype
    for p in model.parameters():
        assert all(v.dtype == dtype for v in opt.state[p].values())


@pytest.mark.parametrize("scheduled", [False, True], ids=["", "lr_scheduler"])
@pytest.mark.parametrize("mc_samples", [1, 2])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("kind", KINDS)
def test_forloop_goes_right_direction(kind, contiguous, mc_samples, scheduled):
    """torch's test as torch writes it: the initial loss taken with ``closure()`` outside the
    step (leaving gradients at the point estimate, which the next closure zeroes), then
    ``loss = optimizer.step(closure)``, and the final loss with ``closure()`` again."""
    model, opt = setup(kind, contiguous=contiguous, mc_samples=mc_samples)
    scheduler = sched.StepLR(opt, step_size=10, gamma=0.9) if scheduled else None
    closure = closure_for(opt, model)
    initial_value = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor)
        if scheduler is not None:
            scheduler.step()
    assert closure().item() < initial_value


@pytest.mark.parametrize("kind", KINDS)
def test_step_returns_what_the_closure_returned(kind):
    """torch returns the closure's value unchanged: a tensor (with its graph), a float, or a
    value of a closure that computed no gradient at all."""
    model, opt = setup(kind)

    def as_float():
        opt.zero_grad()
        loss = model()
        loss.backward()
        return loss.item()

    for closure in (closure_for(opt, model), as_float):
        value: list[Any] = []

        def recording(closure=closure, value=value):
            value.append(closure())
            return value[-1]

        assert opt.step(recording) is value[-1]
    with pytest.warns(UserWarning, match="no trained parameter has a gradient"):
        assert opt.step(lambda: 1.0) == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_can_be_printed(kind):
    _, opt = setup(kind)
    text = repr(opt)
    assert text.startswith(type(opt).__name__) and "Parameter Group 0" in text
    assert "lr: 0.01" in text


@pytest.mark.parametrize("kind", KINDS)
def test_errors(kind):
    """torch's ``test_errors`` for what every Optimizer checks of its params."""
    model = Quadratic()
    with pytest.raises(ValueError, match="empty parameter list"):
        FACTORIES[kind]([])
    with pytest.raises(TypeError, match="iterable of Tensors"):
        FACTORIES[kind](model.weight)
    with pytest.raises(ValueError, match="more than one parameter group"):
        FACTORIES[kind]([{"params": [model.weight]}, {"params": [model.weight, model.bias]}])
    with pytest.raises(ValueError, match="non-leaf"):
        FACTORIES[kind]([model.weight * 2])
    with pytest.raises(ValueError, match="with/without names"):
        FACTORIES[kind]([{"params": [("weight", model.weight)]}, {"params": [model.bias]}])


# ------------------------------------------------------------------ state dicts
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_and_determinism(kind):
    """torch's ``_test_state_dict``: prime, load a deep copy into an optimizer of equal but not
    identical parameters, run both in parallel; the loaded dict is not modified and both
    optimizers' state dicts are equal."""
    model, opt = setup(kind, mc_samples=2)
    run(opt, model, 5)
    model_c = Quadratic(seed=1)
    opt_c = FACTORIES[kind](model_c.parameters(), mc_samples=2, seed=3)
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict_c = copy.deepcopy(opt.state_dict())
    opt_c.load_state_dict(state_dict_c)
    assert_equal(state_dict, state_dict_c, "loaded dict modified")
    assert_continue_alike(opt, model, opt_c, model_c, steps=5)
    assert_equal(opt.state_dict(), opt_c.state_dict(), "state_dict")
    # repeated parameters have identical representation in the state dict
    opt_c.param_groups.extend(opt_c.param_groups)
    assert_equal(opt.state_dict()["param_groups"][-1], opt_c.state_dict()["param_groups"][-1])


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_equality_with_weights_only(kind):
    model, opt = setup(kind)
    run(opt, model, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_equal(loaded, opt.state_dict())
    model2, opt2 = setup(kind, seed=9)
    opt2.load_state_dict(loaded)
    model2.load_state_dict(model.state_dict())
    assert_continue_alike(opt, model, opt2, model2)


@pytest.mark.parametrize("kind", KINDS)
def test_can_load_older_state_dict(kind):
    """torch loads dicts without the keys newer releases added (``foreach``, ``maximize``).
    Here: no ``skipped_steps`` and no ``rule``, and AffineBLR's lr₀ saved as ``initial_lr``
    instead of ``scale_ratio`` (releases before the ratio rule); the lr was scheduled since,
    so the ratio must come from lr₀, not from the current lr."""
    model, opt = setup(kind)
    run(opt, model, 2)
    opt.param_groups[0]["lr"] *= 0.5  # as a schedule would
    run(opt, model, 1)
    state_dict = copy.deepcopy(opt.state_dict())  # state_dict() returns references
    state_dict.pop("skipped_steps")
    for group in state_dict["param_groups"]:
        group.pop("rule", None)
        if "scale_ratio" in group:
            group["initial_lr"] = group["scale_lr"] / group.pop("scale_ratio")  # lr₀
    model2, opt2 = setup(kind)
    opt2.load_state_dict(state_dict)
    model2.load_state_dict(model.state_dict())
    assert_continue_alike(opt, model, opt2, model2, steps=2)


@pytest.mark.parametrize(("named", "named_c"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("kind", KINDS)
def test_can_load_from_to_named_state_dict(kind, named, named_c):
    """Param groups made from ``named_parameters()`` save their ``param_names``; dicts load
    across named and unnamed optimizers, the names of the dict winning when it has them."""
    model, opt = setup(kind, named=named)
    run(opt, model, 2)
    state_dict = copy.deepcopy(opt.state_dict())
    if named:
        assert state_dict["param_groups"][0]["param_names"] == ["weight", "bias"]
    else:
        assert "param_names" not in state_dict["param_groups"][0]
    model_c = Quadratic(seed=1)
    params_c = model_c.named_parameters() if named_c else model_c.parameters()
    opt_c = FACTORIES[kind](params_c)
    if named_c:
        opt_c.param_groups[0]["param_names"] = ["w", "b"]  # the dict's names must win
    opt_c.load_state_dict(state_dict)
    expected = ["weight", "bias"] if named else ["w", "b"]
    assert opt_c.param_groups[0].get("param_names") == (expected if named or named_c else None)
    model_c.load_state_dict(model.state_dict())
    assert_continue_alike(opt, model, opt_c, model_c)


# ----------------------------------------------------------- deepcopy, pickle
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("additive", {"mc_samples": 2, "antithetic": True}),
        ("additive", {"noise": "table", "table_size": 4096}),
        ("multiplicative", {"mc_samples": 2}),
        ("affine", {"mc_samples": 2}),
        ("generic", {"mc_samples": 2, "preconditioner": "fisher"}),
    ],
)
def test_copy_continues_exactly_like_the_original(kind, options, how):
    model, opt = setup(kind, **options)
    run(opt, model, 3)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert all(q in opt2.state for q in model2.parameters())
    assert_continue_alike(opt, model, opt2, model2)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", KINDS)
def test_copy_with_an_lr_scheduler_attached_steps_itself(kind, how):
    """An lr scheduler wraps its optimizer's ``step`` in an instance attribute that calls
    the original; a copy leaves the wrapper out (as torch.optim's state does), so the copy
    steps itself and pickles."""
    model, opt = setup(kind)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    run(opt, model, 2)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert_continue_alike(opt, model, opt2, model2)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_copies_all_public_attrs(kind):
    _, opt = setup(kind)

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    copied = copy.deepcopy(opt)
    assert public(opt) == public(copied)
    for key in public(opt) - {"state", "param_groups", "defaults", "noise_source", "lie_group"}:
        assert getattr(copied, key) == getattr(opt, key), key


@pytest.mark.parametrize("kind", KINDS)
def test_averaged_model_averages_point_estimates(kind):
    """SWA/EMA copies: between steps the parameters hold the point estimate, so
    ``AveragedModel`` averages point estimates (never a Monte-Carlo sample)."""
    model, opt = setup(kind, mc_samples=2)
    swa = AveragedModel(model)
    points = []
    for _ in range(4):
        opt.step(closure_for(opt, model))
        swa.update_parameters(model)
        points.append(opt.lie_group.point_estimate(opt.state[model.weight]["element"]))
    torch.testing.assert_close(swa.module.weight.detach(), torch.stack(points).mean(0))


# ----------------------------------------------------------------- param groups
def _one_step(kind, groups: Callable[[Quadratic], list[dict[str, Any]]], **kw):
    model = Quadratic()
    opt = FACTORIES[kind](groups(model), **kw)
    opt.step(closure_for(opt, model))
    return model


@pytest.mark.parametrize(
    ("key", "value", "default"),
    [
        ("lr", 0.03, 0.01),
        ("prior_precision", 50.0, 0.0),
        ("momentum", 0.9, 0.5),
        ("weight_decay", 0.5, 0.0),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_param_group_hyperparameters_are_its_own(kind, key, value, default):
    """torch's ``test_param_groups_lr`` / ``_weight_decay`` (prior precision is the weight
    decay): with the bias group's own value, the first step moves W as an optimizer with the
    default everywhere and b as one with that value everywhere (same seed, same noise)."""

    def groups(bias_options):
        return lambda m: [{"params": [m.weight]}, {"params": [m.bias], **bias_options}]

    mixed = _one_step(kind, groups({key: value}), **{key: default})
    low = _one_step(kind, groups({}), **{key: default})
    high = _one_step(kind, groups({}), **{key: value})
    assert torch.equal(mixed.weight, low.weight)
    assert torch.equal(mixed.bias, high.bias)
    assert not torch.equal(low.bias, high.bias)


@pytest.mark.parametrize("kind", KINDS)
def test_weight_decay_is_the_prior_of_precision_weight_decay_times_data_size(kind):
    """``weight_decay=w`` (constructor or param-group key) adds w·θ to each sample's
    gradient: the prior N(0, 1/(wN)), the same step as ``prior_precision=wN``."""
    decayed = _one_step(kind, lambda m: list(m.parameters()), weight_decay=0.5)
    prior = _one_step(kind, lambda m: list(m.parameters()), prior_precision=0.5 * 100)
    plain = _one_step(kind, lambda m: list(m.parameters()))
    assert_equal([*decayed.parameters()], [*prior.parameters()])
    assert not torch.equal(decayed.weight, plain.weight)


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_dtypes_per_param_group(kind):
    model = Quadratic()
    extra = nn.Parameter(torch.full((3,), 0.5, dtype=torch.float64))
    opt = FACTORIES[kind]([{"params": model.parameters()}, {"params": [extra]}])

    def closure():
        opt.zero_grad()
        loss = model() + extra.pow(2).sum().float()
        loss.backward()
        return loss

    first = float(opt.step(closure))
    for _ in range(30):
        opt.step(closure)
    assert float(closure().detach()) < 0.5 * first
    assert extra.dtype == torch.float64 and model.weight.dtype == torch.float32
    assert all(v.dtype == torch.float64 for v in opt.state[extra].values())
    assert all(v.dtype == torch.float32 for v in opt.state[model.weight].values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_parameters_keep_float32_state(kind, dtype):
    model, opt = setup(kind, dtype=dtype)
    first = float(model().detach())
    run(opt, model, 30)
    assert float(model().detach()) < 0.5 * first
    for p in model.parameters():
        assert p.dtype == dtype
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
        point = opt.lie_group.point_estimate(opt.state[p]["element"])
        assert torch.equal(p.detach(), point.to(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_complex_parameters_are_rejected(kind):
    with pytest.raises(ValueError, match="params"):
        FACTORIES[kind]([nn.Parameter(torch.randn(3, dtype=torch.complex64))])


@pytest.mark.parametrize("in_group", [False, True], ids=["defaults", "param_group"])
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_lr_is_rejected_with_torch_message(kind, in_group):
    model = Quadratic()
    with pytest.raises(ValueError, match="lr as a Tensor is not supported"):
        if in_group:
            FACTORIES[kind]([{"params": [model.weight], "lr": torch.tensor(0.01)}])
        else:
            FACTORIES[kind](model.parameters(), lr=torch.tensor(0.01))


def test_affine_tensor_scale_lr_is_rejected():
    with pytest.raises(ValueError, match="scale_lr as a Tensor is not supported"):
        affine(Quadratic().parameters(), scale_lr=torch.tensor(0.002))


# --------------------------------------------------------- no gradient, frozen
@pytest.mark.parametrize("kind", KINDS)
def test_step_is_noop_when_params_have_no_grad(kind):
    model, opt = setup(kind)
    run(opt, model, 2)
    before = snapshot(opt, model)

    def closure():
        opt.zero_grad()
        return model().detach()  # no backward: no parameter has a gradient

    with pytest.warns(UserWarning, match="no trained parameter has a gradient"):
        opt.step(closure)
    assert_equal(snapshot(opt, model), before)
    unused = nn.Parameter(torch.ones(4))
    opt.add_param_group({"params": [unused]})
    unused_state = {k: v.clone() for k, v in opt.state[unused].items()}
    value = unused.detach().clone()  # the point estimate of its new state
    run(opt, model, 2)
    assert unused.grad is None and torch.equal(unused.detach(), value)
    assert_equal(dict(opt.state[unused]), unused_state)


@pytest.mark.parametrize("kind", KINDS)
def test_param_group_of_frozen_params_constructs_and_is_never_written(kind):
    model = Quadratic()
    backbone = nn.Parameter(torch.randn(6, 4), requires_grad=False)
    also_frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    opt = FACTORIES[kind](
        [{"params": [backbone]}, {"params": [*model.parameters(), also_frozen], "lr": 0.02}]
    )
    values = [backbone.detach().clone(), also_frozen.detach().clone()]
    assert backbone not in opt.state and also_frozen not in opt.state
    closure = closure_for(opt, model)
    for _ in range(3):
        opt.step(closure)
        with opt.sampled_params(train=True):
            assert torch.equal(backbone, values[0]) and torch.equal(also_frozen, values[1])
            closure()
        opt.step()
    assert torch.equal(backbone, values[0]) and torch.equal(also_frozen, values[1])
    assert backbone not in opt.state and also_frozen not in opt.state
    opt.load_state_dict(opt.state_dict())
    assert torch.equal(backbone, values[0]) and torch.equal(also_frozen, values[1])


@pytest.mark.parametrize("kind", KINDS)
def test_param_frozen_at_construction_gets_state_at_first_draw(kind):
    """Gradual unfreezing: a parameter frozen when the optimizer is built and unfrozen later
    gets its state lazily, from its value at that time, and is then trained."""
    options = {"init": "keep"} if kind == "multiplicative" else {}
    model = Quadratic()
    model.weight.requires_grad_(False)
    opt = FACTORIES[kind](model.parameters(), **options)
    run(opt, model, 2)
    assert model.weight not in opt.state
    with torch.no_grad():
        model.weight.mul_(0.5)  # e.g. a newly loaded value
    value = model.weight.detach().clone()
    model.weight.requires_grad_(True)
    with opt.sampled_params():
        assert not torch.equal(model.weight, value)  # a posterior sample around the value
    assert model.weight in opt.state
    torch.testing.assert_close(model.weight.detach(), value)  # the point estimate is the value
    losses = run(opt, model, 20)
    assert not torch.equal(model.weight.detach(), value)
    assert float(model().detach()) < losses[0]


@pytest.mark.parametrize("kind", KINDS)
def test_unfrozen_param_first_step_equals_optimizer_built_on_its_value(kind):
    """The lazily made state is the state a fresh optimizer makes for the same value: the first
    step (a single-parameter model, same seed, same noise) is identical."""
    weight = nn.Parameter(torch.randn(10, 5), requires_grad=False)
    x = torch.randn(5)
    opt = FACTORIES[kind]([weight])
    weight.requires_grad_(True)
    twin = nn.Parameter(weight.detach().clone())
    fresh = FACTORIES[kind]([twin])

    def closure_of(o, w):
        def closure():
            o.zero_grad()
            loss = (w @ x).pow(2).sum()
            loss.backward()
            return loss

        return closure

    opt.step(closure_of(opt, weight))
    fresh.step(closure_of(fresh, twin))
    assert_equal(dict(opt.state[weight]), dict(fresh.state[twin]))
    assert torch.equal(weight, twin)


@pytest.mark.parametrize("kind", KINDS)
def test_add_param_group_mid_training(kind):
    """torch's documented fine-tuning path: frozen layers added as a param group later."""
    model = Quadratic()
    head = nn.Parameter(torch.randn(10))
    opt = FACTORIES[kind]([model.weight])

    def closure():
        opt.zero_grad()
        loss = (model.weight @ model.x + head).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    assert head.grad is not None and head not in opt.state
    opt.add_param_group({"params": [head], "lr": 0.005})
    value = head.detach().clone()
    first = float(opt.step(closure))
    for _ in range(20):
        opt.step(closure)
    assert not torch.equal(head.detach(), value) and float(closure().detach()) < first


# -------------------------------------------------------------------- closures
@pytest.mark.parametrize("kind", KINDS)
def test_closure_returning_none_is_accepted(kind):
    model, opt = setup(kind, mc_samples=2)
    model2, opt2 = copy.deepcopy((model, opt))

    def closure():
        opt.zero_grad()
        model().backward()

    for _ in range(3):
        assert opt.step(closure) is None
        opt2.step(closure_for(opt2, model2))
        assert_equal(snapshot(opt, model), snapshot(opt2, model2))


@pytest.mark.parametrize("exception", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("kind", KINDS)
def test_exception_in_closure_abandons_the_step(kind, exception):
    model, opt = setup(kind, mc_samples=3)
    run(opt, model, 2)
    before = snapshot(opt, model)
    saved = copy.deepcopy(opt.state_dict())
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model()
        loss.backward()
        if len(calls) == 2:
            raise exception("in the closure")
        return loss

    with pytest.raises(exception):
        opt.step(closure)
    assert opt.pending_samples == 0
    assert_equal(snapshot(opt, model), before)
    state_dict = opt.state_dict()
    for key in ("state", "param_groups", "seed", "skipped_steps"):
        assert_equal(state_dict[key], saved[key], key)
    assert math.isfinite(float(opt.step(closure_for(opt, model))))


@pytest.mark.parametrize(
    ("kind", "factory"),
    [*[(k, FACTORIES[k]) for k in KINDS], ("generic_additive", generic_additive)],
)
def test_results_do_not_depend_on_how_the_closure_zeroes_gradients(kind, factory):
    results = []
    for set_to_none in (True, False):
        model = Quadratic()
        opt = factory(model.parameters(), mc_samples=3)
        run(opt, model, 3, set_to_none=set_to_none)
        for _ in range(2):  # and the manual loop
            for _ in range(2):
                with opt.sampled_params(train=True):
                    opt.zero_grad(set_to_none=set_to_none)
                    model().backward()
            opt.step()
        results.append(snapshot(opt, model))
    assert_equal(results[0], results[1])


# ------------------------------------------------------------------------ hooks
@pytest.mark.parametrize("kind", KINDS)
def test_step_pre_and_post_hooks(kind):
    model, opt = setup(kind)
    calls: list[str] = []
    closure = closure_for(opt, model)

    def pre(optimizer, args, kwargs):
        assert optimizer is opt and args == (opt, closure)
        calls.append("pre")

    def post(optimizer, args, kwargs):
        assert optimizer is opt
        calls.append("post")

    pre_handle = opt.register_step_pre_hook(pre)
    post_handle = opt.register_step_post_hook(post)
    global_handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global"))
    try:
        opt.step(closure)
    finally:
        global_handle.remove()
    assert calls == ["global", "pre", "post"]
    pre_handle.remove()
    post_handle.remove()
    opt.step(closure)
    assert calls == ["global", "pre", "post"]


@pytest.mark.parametrize("kind", KINDS)
def test_step_pre_hook_may_replace_the_arguments(kind):
    """A pre-hook returning ``(args, kwargs)`` replaces step's arguments, here the closure."""
    model, opt = setup(kind, mc_samples=3)
    calls = []
    closure = closure_for(opt, model)

    def counted():
        calls.append(1)
        return closure()

    opt.register_step_pre_hook(lambda optimizer, args, kwargs: ((optimizer, counted), kwargs))
    opt.step(closure)
    assert len(calls) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_pre_and_post_hooks(kind):
    model, opt = setup(kind)
    run(opt, model, 1)
    seen: dict[str, Any] = {}

    def pre(optimizer):
        seen["pre"] = optimizer.param_groups[0]["lr"]

    def post(optimizer, state_dict):
        seen["post_keys"] = set(state_dict)
        seen["post_group_keys"] = set(state_dict["param_groups"][0])
        state_dict["extra"] = "post"  # in place

    def post_returning(optimizer, state_dict):
        return {**state_dict, "returned": True}

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    opt.register_state_dict_post_hook(post_returning)
    state_dict = opt.state_dict()
    assert seen["pre"] == 0.01
    assert state_dict["extra"] == "post" and state_dict["returned"] is True
    # a post hook sees the dict that state_dict() returns, as in torch.optim
    assert {"state", "param_groups", "rng", "seed", "skipped_steps"} <= seen["post_keys"]
    assert "rule" in seen["post_group_keys"] and "base" not in seen["post_group_keys"]


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_pre_hook_and_prepend(kind):
    model, opt = setup(kind)
    run(opt, model, 1)
    state_dict = opt.state_dict()

    def set_lr(optimizer, sd):
        sd["param_groups"][0]["lr"] = 0.002

    def times_ten(optimizer, sd):
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] *= 10
        return sd

    for prepend, expected in [(False, 0.02), (True, 0.002)]:
        _, opt2 = setup(kind)
        opt2.register_load_state_dict_pre_hook(set_lr)
        opt2.register_load_state_dict_pre_hook(times_ten, prepend=prepend)
        opt2.load_state_dict(copy.deepcopy(state_dict))  # set_lr writes into the dict
        assert opt2.param_groups[0]["lr"] == pytest.approx(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_pre_hook_result_is_used_for_everything(kind):
    """A pre-hook returning another dict (the documented way to remap checkpoints) decides the
    per-parameter state and the noise generators (``rng``, ``seed``) too."""
    model_a, opt_a = setup(kind, mc_samples=2)
    run(opt_a, model_a, 2)
    decoy = opt_a.state_dict()
    model_b, opt_b = setup(kind, mc_samples=2, seed=5)
    run(opt_b, model_b, 4)
    wanted = opt_b.state_dict()

    model_c, opt_c = setup(kind, mc_samples=2)
    opt_c.register_load_state_dict_pre_hook(lambda optimizer, sd: copy.deepcopy(wanted))
    opt_c.load_state_dict(decoy)
    assert opt_c.seed == opt_b.seed
    model_c.load_state_dict(model_b.state_dict())
    assert_continue_alike(opt_b, model_b, opt_c, model_c)


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_post_hook_sees_the_loaded_optimizer(kind):
    model, opt = setup(kind, seed=5)
    run(opt, model, 2)
    state_dict = copy.deepcopy(opt.state_dict())
    model2, opt2 = setup(kind)
    seen: dict[str, Any] = {}
    order: list[str] = []

    def post(optimizer):
        seen["seed"] = optimizer.seed
        seen["base"] = "base" in optimizer.param_groups[0]
        seen["weight"] = model2.weight.detach().clone()

    opt2.register_load_state_dict_post_hook(post)
    opt2.register_load_state_dict_post_hook(lambda o: order.append("appended"))
    opt2.register_load_state_dict_post_hook(lambda o: order.append("prepended"), prepend=True)
    opt2.load_state_dict(state_dict)
    assert order == ["prepended", "appended"]
    assert seen["seed"] == 5 and seen["base"]
    assert torch.equal(seen["weight"], model.weight.detach())


# ------------------------------------------------------------------- schedulers
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda epoch: 0.8**epoch),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda epoch: 0.8),
    "StepLR": lambda o: sched.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[1, 3], gamma=0.5),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.3, total_iters=4),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.7),
    "SequentialLR": lambda o: sched.SequentialLR(
        o,
        [sched.ConstantLR(o, factor=0.5, total_iters=2), sched.ExponentialLR(o, gamma=0.7)],
        milestones=[2],
    ),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=20, power=2.0),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=2), sched.ExponentialLR(o, gamma=0.7)]
    ),
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=0.002, max_lr=0.02, step_size_up=2),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=0.02, total_steps=8),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "SWALR": lambda o: SWALR(o, swa_lr=0.004, anneal_epochs=3),
}


def test_every_torch_scheduler_is_covered():
    found = {
        name
        for name, obj in vars(sched).items()
        if isinstance(obj, type)
        and issubclass(obj, (sched.LRScheduler, sched.ReduceLROnPlateau))
        and not name.startswith("_")
        and obj is not sched.LRScheduler
    }
    assert found, "no schedulers found"
    assert found <= set(SCHEDULERS), f"not covered: {sorted(found - set(SCHEDULERS))}"


def _phi(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = (eˣ − 1)/x."""
    return torch.where(x == 0, torch.ones_like(x), torch.expm1(x) / x)


def _expected_element(kind, old, momentum, lr: float, scale_lr: float) -> torch.Tensor:
    """The element one step with rates (lr, scale_lr) makes from ``old`` and the new momentum:
    additive m − α M; multiplicative g e^{−α M}; affine (A e^{−α₂ M_U}, b − α₁ A M_V φ(−α₁ M_U)),
    with α₁ = α₂ = lr for the generic rule (g · exp(−α M))."""
    if kind == "additive":
        return old - lr * momentum
    if kind == "multiplicative":
        return old * torch.exp(-lr * momentum)
    (A, b), (u, v) = old, momentum
    return torch.stack((A * torch.exp(-scale_lr * u), b - lr * A * v * _phi(-lr * u)))


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_scheduler_sets_the_rates_of_every_step(kind, name):
    """At every step the rule moves with the scheduled lr; AffineBLR's scale step is
    scale_lr · lr / lr₀ (lr₀ the constructor's lr, also under schedulers that set lr at
    construction such as CyclicLR and OneCycleLR): α₂/α₁ stays scale_lr/lr₀."""
    model, opt = setup(kind, dtype=torch.float64)
    ratio = 0.002 / opt.param_groups[0]["lr"]  # affine: scale_lr / lr₀
    scheduler = SCHEDULERS[name](opt)
    used = set()
    for step in range(8):
        lr = opt.param_groups[0]["lr"]
        used.add(round(lr, 12))
        old = opt.state[model.weight]["element"].clone()
        opt.step(closure_for(opt, model))
        new = opt.state[model.weight]
        scale_lr = lr * ratio if kind == "affine" else lr
        expected = _expected_element(kind, old, new["momentum"], lr, scale_lr)
        torch.testing.assert_close(new["element"], expected, rtol=1e-10, atol=1e-14)
        assert not torch.equal(new["element"], old), f"step {step} did not move"
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(float(step))  # a worsening metric: lr falls every step
        else:
            scheduler.step()
    assert len(used) > 1, "the schedule never changed lr"


@pytest.mark.parametrize("kind", KINDS)
def test_scheduled_optimizer_goes_right_direction(kind):
    model, opt = setup(kind)
    schedulers = [sched.StepLR(opt, step_size=5, gamma=0.9), sched.ReduceLROnPlateau(opt)]
    first = float(model().detach())
    for _ in range(30):
        loss = opt.step(closure_for(opt, model))
        schedulers[0].step()
        schedulers[1].step(float(loss))
    assert float(model().detach()) < 0.5 * first


# -------------------------------------------------------------------------- AMP
def _amp_run(kind, recipe: str, scaler, steps=3, inf_at: int | None = None):
    """Three steps with mc_samples=2 by recipe A (closure) or B (sampled_params blocks),
    with the loss scaled by ``scaler`` (None: no scaling); returns model, opt, losses."""
    model = Quadratic()
    opt = FACTORIES[kind](model.parameters(), mc_samples=2, grad_scaler=scaler)
    scale = scaler.scale if scaler is not None else (lambda t: t)
    calls = []

    def sample_loss():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            loss = model()
        scale(loss).backward()
        calls.append(1)
        if inf_at is not None and len(calls) == inf_at:
            model.weight.grad[0, 0] = math.inf
        return loss

    for _ in range(steps):
        if recipe == "A":
            opt.step(sample_loss)
        else:
            for _ in range(2):
                with opt.sampled_params(train=True):
                    sample_loss()
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
        if scaler is not None:
            scaler.update()
    return model, opt


@pytest.mark.parametrize("recipe", ["A", "B"])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_updates_match_the_unscaled_run(kind, recipe):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model, opt = _amp_run(kind, recipe, scaler)
    reference, ref_opt = _amp_run(kind, recipe, None)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        for key in opt.state[p]:
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key])
    assert scaler.get_scale() == 2.0**12
    assert opt.skipped_steps == 0


@pytest.mark.parametrize("recipe", ["A", "B"])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_inf_skips_the_step_and_backs_off(kind, recipe):
    """An inf gradient in the second sample of the second step: that step is skipped (state
    as after the first step) and the scale halves; the other steps go on."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    one_model, one_opt = _amp_run(kind, recipe, torch.amp.GradScaler("cpu", init_scale=2.0**12), 1)
    model, opt = _amp_run(kind, recipe, scaler, steps=2, inf_at=4)
    assert scaler.get_scale() == 2.0**11
    assert opt.skipped_steps == 1
    assert_equal(snapshot(opt, model), snapshot(one_opt, one_model))


@pytest.mark.parametrize("recipe", ["A", "B"])
@pytest.mark.parametrize("kind", KINDS)
def test_autocast_with_grad_scaler_trains(kind, recipe):
    """The documented recipes with a bfloat16 autocast forward (the CPU's low precision)."""
    model = Quadratic()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = FACTORIES[kind](model.parameters(), mc_samples=2, grad_scaler=scaler)

    def sample_loss():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (nn.functional.linear(model.x, model.weight) + model.bias).pow(2).sum()
        scaler.scale(loss).backward()
        return loss

    first = float(model().detach())
    for _ in range(30):
        if recipe == "A":
            opt.step(sample_loss)
        else:
            for _ in range(2):
                with opt.sampled_params(train=True):
                    sample_loss()
            scaler.step(opt)
        scaler.update()
    assert float(model().detach()) < 0.5 * first
    assert model.weight.dtype == torch.float32 and opt.skipped_steps == 0


def test_grad_scaler_step_with_several_samples_needs_the_grad_scaler_argument():
    """Two sampled_params blocks, then scaler.step(opt) without grad_scaler=: an inf in the
    first sample would never reach scaler.update(), so the step is refused, naming the fix;
    the pending samples are discarded."""
    model, opt = setup("additive")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    before = snapshot(opt, model)
    for _ in range(2):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            scaler.scale(model()).backward()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaler.step(opt)
    assert opt.pending_samples == 0
    assert_equal(snapshot(opt, model), before)


# ------------------------------------------------------- skips, multiplicative init
@pytest.mark.parametrize("kind", KINDS)
def test_max_consecutive_skips_raises_after_k_skips_and_the_first_skip_warns(kind):
    model, opt = setup(kind, max_consecutive_skips=2)
    good = closure_for(opt, model)

    def bad():
        return good() * math.nan

    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        opt.step(bad)
    opt.step(good)  # a step that goes through resets the count
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # later skips are counted, not warned of
        opt.step(bad)
        with pytest.raises(FloatingPointError, match="2 steps in a row"):
            opt.step(bad)
    assert opt.skipped_steps == 3


@pytest.mark.parametrize("kind", KINDS)
def test_non_empty_state_a_closure_that_computes_nothing_is_refused_naming_both_fixes(kind):
    """torch's ``test_non_empty_state``: a backward at the point estimate, then
    ``step(lambda: 1.0)``. The gradients are not a sample's, and the closure computed none:
    refused, saying so; with ``between_steps="sample"`` they are the held sample's."""
    model, opt = setup(kind)
    model().backward()
    before = snapshot(opt, model)
    with pytest.raises(RuntimeError) as refused:
        opt.step(lambda: 1.0)
    message = str(refused.value)
    assert "the closure computed none" in message and "added to them" not in message
    assert "computes the loss" in message and "between_steps='sample'" in message
    assert_equal(snapshot(opt, model), before)
    model, opt = setup(kind, between_steps="sample")
    model().backward()
    assert opt.step(lambda: 1.0) == 1.0
    assert all(opt.state[p] for p in model.parameters())


def test_the_multiplicative_default_init_says_once_that_it_rewrote_the_weights():
    """The default ``init`` rewrites the weights: one warning at the user's line, and the
    class docstring's opening says so and names ``init="keep"``; an explicit ``init`` gives
    the same elements without it, and a model it keeps is not warned of."""
    lead = inspect.getdoc(lgb.MultiplicativeBLR).split("\n\n")[1]  # type: ignore[union-attr]
    assert "rewrites the" in lead and 'init="keep"' in lead
    elements = {}
    for init in (None, "auto", "keep"):
        model = Quadratic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = multiplicative(model.parameters(), init=init)
            opt.step(closure_for(opt, model))
        said = [w for w in caught if "init='keep'" in str(w.message)]
        assert len(said) == (init is None), init
        assert all(w.category is UserWarning and w.filename == __file__ for w in said)
        elements[init] = snapshot(opt, model)
    assert_equal(elements["auto"], elements[None])
    constant = nn.Linear(3, 2)
    nn.init.constant_(constant.weight, 0.3)
    nn.init.zeros_(constant.bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lgb.MultiplicativeBLR(constant.parameters(), lr=0.01, data_size=100)


def test_multiplicative_init_keep_keeps_the_weights_reference_rewrites_them():
    model = Quadratic()
    value = model.weight.detach().clone()
    opt = lgb.MultiplicativeBLR(model.parameters(), lr=0.01, data_size=100, init="keep")
    torch.testing.assert_close(model.weight.detach(), value)
    parts = opt.group_element(model.weight)
    torch.testing.assert_close(parts["g+"] - parts["g-"], value)
    assert bool((parts["g+"] > 0).all() and (parts["g-"] > 0).all())
    lgb.MultiplicativeBLR(model.parameters(), lr=0.01, data_size=100, init="reference")
    assert not torch.allclose(model.weight.detach(), value)
    with pytest.raises(ValueError, match="init"):
        lgb.MultiplicativeBLR(model.parameters(), lr=0.01, data_size=100, init="pretrained")


@pytest.mark.parametrize("kind", KINDS)
def test_the_closure_called_before_step_is_torchs_idiom(kind):
    """torch's tests write ``loss = closure(); opt.step(closure)``: the closure zeroes the
    gradients, so what it left before ``step`` is not accumulated into a sample. No refusal,
    no warning, and the steps are those of ``opt.step(closure)`` alone."""
    ends = []
    for call_first in (True, False):
        model, opt = setup(kind)
        closure = closure_for(opt, model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                if call_first:
                    closure()
                opt.step(closure)
        ends.append(snapshot(opt, model))
    assert_equal(ends[0], ends[1])
