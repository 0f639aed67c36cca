"""Any training loop: the closure-free sample mode, gradients made outside a step, GradScaler.step
without a construction-time scaler, wrappers, and the multiplicative rule's default init."""

from __future__ import annotations

import copy
import io
import math
import re

import pytest
import torch
from torch import nn

import liegroup_blr as lgb
from tests.shared import FACTORIES, closure_for, make_problem, snapshot

KINDS = list(FACTORIES)


def assert_equal(a, b):
    (pa, sa), (pb, sb) = a, b
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(sa, sb, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def elements(opt, model):
    return [opt.state[p]["element"].clone() for p in model.parameters()]


def point_of(opt, model):
    with opt.point_estimate():
        return [p.detach().clone() for p in model.parameters()]


def plain_step(opt, model, x, y):
    """What torch.optim loops (Hugging Face, accelerate) do: backward, then step()."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


# ------------------------------------------------------------------ sample mode
@pytest.mark.parametrize("kind", KINDS)
def test_sample_mode_steps_on_p_grad_exactly_as_point_mode_steps_with_a_closure(kind):
    """between_steps="sample": the parameters hold the step's sample before its forward pass,
    so backward + step() is step(closure) of point mode, the same noise stream and all."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    ref = FACTORIES[kind](model.parameters(), seed=3, temperature=0.5)
    opt = FACTORIES[kind](twin.parameters(), seed=3, temperature=0.5, between_steps="sample")
    for _ in range(4):
        ref.step(closure_for(ref, model, x, y))
        plain_step(opt, twin, x, y)
    for a, b in zip(elements(opt, twin), elements(ref, model), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(point_of(opt, twin), model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_mode_parameters_hold_a_fresh_sample_and_point_estimate_gives_it_back(kind):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0, between_steps="sample")
    for _ in range(2):
        held = [p.detach().clone() for p in model.parameters()]
        point = point_of(opt, model)
        assert any(not torch.equal(h, q) for h, q in zip(held, point, strict=True))
        for p, h in zip(model.parameters(), held, strict=True):  # given back after the block
            assert torch.equal(p, h)
        plain_step(opt, model, x, y)
        after = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(h, a) for h, a in zip(held, after, strict=True))
    with opt.sampled_params():  # a prediction sample in between keeps the training sample
        predicted = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, predicted, strict=True))
    for p, a in zip(model.parameters(), after, strict=True):
        assert torch.equal(p, a)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_in_sample_mode_is_one_sample_on_the_whole_batch(kind):
    """Two micro-batches' backward passes, then step(): the update of one sample on both
    (their mean loss), as step(closure) on the whole batch in point mode."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    ref = FACTORIES[kind](model.parameters(), seed=1, temperature=0.5)
    opt = FACTORIES[kind](twin.parameters(), seed=1, temperature=0.5, between_steps="sample")
    for _ in range(3):
        ref.step(closure_for(ref, model, x, y))
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            (nn.functional.cross_entropy(twin(xs), ys) / 2).backward()
        opt.step()
    for a, b in zip(elements(opt, twin), elements(ref, model), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_mode_with_a_closure_takes_the_resident_sample_first(kind):
    """mc_samples = 2 with a closure: the first sample is the one the parameters hold, so the
    step equals point mode's (which draws both), with the same seed."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    ref = FACTORIES[kind](model.parameters(), seed=2, mc_samples=2, temperature=0.5)
    opt = FACTORIES[kind](
        twin.parameters(), seed=2, mc_samples=2, temperature=0.5, between_steps="sample"
    )
    seen = []
    hook = twin[0].register_forward_pre_hook(lambda m, i: seen.append(m.weight.detach().clone()))
    for _ in range(2):
        ref.step(closure_for(ref, model, x, y))
        resident = twin[0].weight.detach().clone()
        opt.step(closure_for(opt, twin, x, y))
        assert torch.equal(seen[-2], resident)  # the closure's first call ran at it
    hook.remove()
    for a, b in zip(elements(opt, twin), elements(ref, model), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_sample_mode_resumes_bit_for_bit_from_a_state_dict(kind):
    """The state dict keeps the generators' state from before the parameters' sample, so a
    new optimizer loading it holds the same sample and goes on with the same steps."""
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=4, between_steps="sample")
    for _ in range(2):
        plain_step(opt, model, x, y)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    held = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        plain_step(opt, model, x, y)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, _, _ = make_problem()
    resumed_model.load_state_dict(saved["model"])
    resumed = FACTORIES[kind](resumed_model.parameters(), seed=99, between_steps="sample")
    resumed.load_state_dict(saved["opt"])
    for p, h in zip(resumed_model.parameters(), held, strict=True):
        assert torch.equal(p, h)
    for _ in range(2):
        plain_step(resumed, resumed_model, x, y)
    assert_equal(snapshot(resumed, resumed_model), snapshot(opt, model))


@pytest.mark.parametrize("kind", KINDS)
def test_sample_mode_copy_continues_like_the_original(kind):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=5, between_steps="sample")
    plain_step(opt, model, x, y)
    model_copy, opt_copy = copy.deepcopy((model, opt))
    for _ in range(2):
        plain_step(opt, model, x, y)
        plain_step(opt_copy, model_copy, x, y)
    assert_equal(snapshot(opt_copy, model_copy), snapshot(opt, model))


def test_sample_mode_new_param_group_and_frozen_parameter():
    """A param group added later holds a sample too; a parameter frozen after training keeps
    the sample it last held (point_estimate() and restore(frozen=True) read its point)."""
    model, x, y = make_problem()
    extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = lgb.AffineBLR(
        model.parameters(), lr=0.1, scale_lr=0.01, data_size=32, seed=0, between_steps="sample"
    )
    opt.add_param_group({"params": [extra]})
    assert not torch.equal(extra.detach(), torch.ones(3, dtype=torch.float64))
    plain_step(opt, model, x, y)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    plain_step(opt, model, x, y)
    assert torch.equal(model[0].weight, frozen)
    point = opt.state[model[0].weight]["element"][1]
    assert not torch.equal(frozen, point)
    with opt.point_estimate():
        assert torch.equal(model[0].weight, point)
    assert torch.equal(model[0].weight, frozen)
    opt.restore(frozen=True)
    assert torch.equal(model[0].weight, point)


def test_after_restore_in_sample_mode_a_closure_free_step_refuses_and_a_closure_draws():
    """restore() writes the point estimate: gradients computed there are nobody's sample."""
    model, x, y = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1, seed=0, between_steps="sample")
    plain_step(opt, model, x, y)
    opt.restore()
    point = [p.detach().clone() for p in model.parameters()]
    with opt.sampled_params():
        pass
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), point, strict=True))
    with pytest.raises(RuntimeError, match="after restore"):
        plain_step(opt, model, x, y)

    def adding():  # a closure that adds to those gradients instead of zeroing them
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="at the point estimate"):
        opt.step(adding)
    opt.step(closure_for(opt, model, x, y))  # zeroes them: draws a sample for its closure
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), point, strict=True))
    plain_step(opt, model, x, y)  # and holds one again


@pytest.mark.parametrize(
    ("options", "call", "words"),
    [
        (dict(between_steps="sample", mc_samples=2), "plain", "mc_samples=2 needs step(closure)"),
        (dict(between_steps="sample"), "train block", "already hold a training sample"),
        ({}, "plain", "between_steps='sample'"),
        (dict(between_steps="points"), None, "between_steps: must be one of"),
    ],
)
def test_what_cannot_work_fails_in_one_line_naming_the_fix(options, call, words):
    model, x, y = make_problem()
    if call is None:
        with pytest.raises(ValueError, match=words):
            lgb.AdditiveBLR(model.parameters(), lr=0.1, **options)
        return
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1, **options)
    with pytest.raises(RuntimeError, match=re.escape(words)) as info:
        if call == "plain":
            plain_step(opt, model, x, y)
        else:
            with opt.sampled_params(train=True):
                pass
    assert "\n" not in str(info.value)


# ------------------------------------------- gradients made outside a step (point mode)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_accumulated_at_the_point_estimate_are_refused_with_a_closure(kind):
    """Lightning's accumulate_grad_batches=2 with a closure: the first micro-batch's backward
    runs outside step(), at the point estimate, and its closure adds to those gradients. On the
    old main a third of the forward passes ran at the point estimate without a word."""
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0)
    opt.step(closure_for(opt, model, x, y))
    before = snapshot(opt, model)
    nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()  # micro-batch 1, outside

    def closure():  # micro-batch 2: no zero_grad, as Lightning's when accumulating
        loss = nn.functional.cross_entropy(model(x[16:]), y[16:])
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="between_steps='sample'"):
        opt.step(closure)
    assert_equal(snapshot(opt, model), before)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation_with_several_samples_is_refused_in_sample_mode(kind):
    model, x, y = make_problem()
    opt = FACTORIES[kind](model.parameters(), seed=0, mc_samples=2, between_steps="sample")
    before = snapshot(opt, model)
    nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()

    def closure():  # micro-batch 2 added to micro-batch 1's gradients
        loss = nn.functional.cross_entropy(model(x[16:]), y[16:])
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="set mc_samples=1"):
        opt.step(closure)
    states, held = snapshot(opt, model)[1], before[1]  # a fresh sample is held again
    assert all(torch.equal(a[k], b[k]) for a, b in zip(states, held, strict=True) for k in a)


@pytest.mark.parametrize("kind", KINDS)
def test_a_closure_that_makes_no_gradient_takes_no_sample(kind):
    """Lightning's manual optimization: sampled_params(train=True) blocks, then step() through
    LightningOptimizer, which passes a closure that does nothing. The blocks' samples are the
    step's; on the old main the do-nothing closure counted as one more sample at the blocks'
    gradients (the first update was exactly 3.00 times the right one)."""
    runs = []
    for closure in (None, lambda: None):
        model, x, y = make_problem()
        opt = FACTORIES[kind](model.parameters(), seed=6, temperature=0.5)
        for _ in range(2):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step(closure)
        runs.append(snapshot(opt, model))
    (params, states), (ref_params, ref_states) = runs
    torch.testing.assert_close(params, ref_params, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(states, ref_states, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("zero", ["optimizer", "optimizer, to zero", "model"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_closure_that_zeroes_gradients_made_outside_steps_as_if_they_were_never_made(kind, zero):
    """PyTorch's own idiom, ``loss = closure(); optimizer.step(closure)``: the first call
    leaves gradients at the point estimate, the closure zeroes them before its backward, so
    nothing is mixed. On the old main it was refused before the closure ran."""

    def run(outside: bool):
        model, x, y = make_problem()
        opt = FACTORIES[kind](model.parameters(), seed=2, mc_samples=2)

        def closure():
            if zero == "model":
                model.zero_grad()
            else:
                opt.zero_grad(set_to_none=zero == "optimizer")
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        for _ in range(2):
            if outside:
                initial = closure()  # the idiom's first call, outside the step
                assert initial.requires_grad
            opt.step(closure)
        return snapshot(opt, model)

    runs = [run(False), run(True)]
    assert_equal(runs[1], runs[0])


# ------------------------------------------------------------------------ AMP
def _scaled_run(kind, scaler, *, mode, inf_at=None, prior_precision=0.0):
    """Three steps with one sample each, the loss scaled by ``scaler`` (None: not scaled);
    sample mode (backward, scaler.step) or point mode (one block, scaler.step)."""
    model, x, y = make_problem(dtype=torch.float32)
    opt = FACTORIES[kind](
        model.parameters(),
        seed=7,
        temperature=0.5,
        prior_precision=prior_precision,
        between_steps=mode,
    )
    scale = (lambda t: t) if scaler is None else scaler.scale

    def backward(step):
        opt.zero_grad()
        scale(nn.functional.cross_entropy(model(x), y)).backward()
        if step == inf_at:
            next(model.parameters()).grad[0, 0] = math.inf

    for step in range(3):
        if mode == "sample":
            backward(step)
        else:
            with opt.sampled_params(train=True):
                backward(step)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return model, opt


@pytest.mark.parametrize("prior_precision", [0.0, 2.0])
@pytest.mark.parametrize("mode", ["sample", "point"])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_step_without_the_argument_equals_the_unscaled_run(kind, mode, prior_precision):
    """One sample per step: GradScaler.step(opt) drives the step, whose gradients are read
    with the scale taken off (a power of two: exact); the prior's term is added to the
    unscaled gradients. On the old main scaler.step without grad_scaler= raised."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, opt = _scaled_run(kind, scaler, mode=mode, prior_precision=prior_precision)
    ref_model, ref = _scaled_run(kind, None, mode=mode, prior_precision=prior_precision)
    assert_equal(snapshot(opt, model), snapshot(ref, ref_model))
    assert scaler.get_scale() == 2.0**10 and opt.skipped_steps == 0


@pytest.mark.parametrize("mode", ["sample", "point"])
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaler_step_inf_skips_the_step_and_halves_the_scale(kind, mode):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _, opt = _scaled_run(kind, scaler, mode=mode, inf_at=1)
    assert scaler.get_scale() == 2.0**9
    assert opt.skipped_steps == 1  # counted, without a warning: the scaler is calibrating
    assert all(torch.isfinite(s["element"]).all() for s in opt.state.values())


# -------------------------------------------------------------------- wrappers
class Wrapper:
    """A stand-in for accelerate's AcceleratedOptimizer: holds the optimizer, forwards step."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_unwrap_finds_the_optimizer_behind_wrappers_and_functions_use_it():
    model, x, y = make_problem()
    opt = lgb.MultiplicativeBLR(model.parameters(), lr=0.1, data_size=32, seed=0, init="auto")
    wrapped = Wrapper(Wrapper(opt))
    assert lgb.optim.unwrap(wrapped) is opt
    assert lgb.optim.unwrap(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    lgb.mc_step(wrapped, model, nn.functional.cross_entropy, x, y)
    assert (
        lgb.Posterior.from_optimizer(wrapped, model).keys() == dict(model.named_parameters()).keys()
    )
    with pytest.raises(TypeError, match="liegroup_blr optimizer"):
        lgb.mc_step(
            torch.optim.SGD(model.parameters(), lr=0.1), model, nn.functional.cross_entropy, x, y
        )


def test_optimizer_state_is_shared_with_a_wrapper_that_copies_its_dict():
    """LightningOptimizer copies the optimizer's __dict__ and subclasses its class: counts
    made through the wrapper are the optimizer's (on the old main they landed on the wrapper)."""
    model, x, y = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1, seed=0)
    wrapper = copy.copy(opt)  # a new object with the same __dict__ entries, as Lightning's
    with wrapper.sampled_params(train=True):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    assert opt.pending_samples == 1 and wrapper.pending_samples == 1
    wrapper.step()
    assert opt.pending_samples == 0


# ------------------------------------------------------- multiplicative initialisation
def test_multiplicative_default_init_keeps_constant_tensors_such_as_layer_norm_weights():
    """A LayerNorm's weights (all 1) and biases (all 0): the reference init's permutation of a
    constant tensor gives g⁺ = g⁻, so on the old main every LayerNorm weight became 0 and the
    model output constants. init="auto" keeps them; other tensors as "reference"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"init=None \('auto'\) rewrote"):  # the default's
        lgb.MultiplicativeBLR(model.parameters(), lr=0.1, data_size=10, seed=0)
    lgb.MultiplicativeBLR(twin.parameters(), lr=0.1, data_size=10, seed=0, init="reference")
    assert torch.allclose(model[1].weight, torch.ones(8), atol=1e-4)
    assert torch.equal(twin[1].weight, torch.zeros(8))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if not name.startswith("1."):
            assert torch.equal(p, q)  # the same permutation stream as "reference"
    assert not torch.equal(model[0].weight, weights["0.weight"])
    x = torch.randn(5, 4)
    assert model(x).std(0).max() > 1e-3


# ------------------------------------------ the compiled update draws the next sample
COMPILED = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(
        ps, lr=0.1, base=torch.distributions.Normal(0.0, 0.05), **kw
    ),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=0.3, data_size=100, temperature=0.5, **{"init": "auto", **kw}
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(
        ps, lr=0.1, scale_lr=0.05, base=torch.distributions.Normal(0.0, 0.05), data_size=100, **kw
    ),
}


@pytest.mark.compile
@pytest.mark.parametrize("noise", ["fresh", "table"])
@pytest.mark.parametrize("kind", COMPILED)
def test_compiled_sample_mode_draws_the_next_sample_in_the_update_as_eager_steps_draw_it(
    kind, noise
):
    """In sample mode a compiled one-sample step draws the next sample inside its update
    kernel (ξ' into the accumulators, or table windows); the samples and the steps equal the
    eager ones, which draw after the update, and a state dict taken then resumes exactly."""
    model, x, y = make_problem(dtype=torch.float32)
    twin = copy.deepcopy(model)
    runs = []
    for net, compile in ((model, True), (twin, False)):
        opt = COMPILED[kind](
            net.parameters(), seed=0, noise=noise, compile=compile, between_steps="sample"
        )
        held = []
        for _ in range(4):
            plain_step(opt, net, x, y)
            held.append([p.detach().clone() for p in net.parameters()])
        runs.append((opt, held))
    (compiled, held_c), (eager, held_e) = runs
    for a, b in zip(held_c, held_e, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key in ("element", "momentum"):
            torch.testing.assert_close(
                compiled.state[p][key], eager.state[q][key], rtol=1e-5, atol=1e-6
            )
    saved = copy.deepcopy(compiled.state_dict())
    resumed = COMPILED[kind](
        copy.deepcopy(model).parameters(), seed=9, noise=noise, between_steps="sample"
    )
    resumed.load_state_dict(saved)  # redraws the sample from the state before it: the same one
    for p, q in zip(resumed.param_groups[0]["params"], model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
