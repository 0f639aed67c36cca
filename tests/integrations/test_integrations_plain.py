"""Mixed precision the way the stacks do it, in a plain loop: ``scaler.step(optimizer)`` with
``torch.amp.GradScaler("cpu")`` and no ``grad_scaler=`` at construction, in sample mode; and
what the engine does for the stacks in a plain loop (a closure that makes no gradients in
sample mode, ``step()`` inside ``point_estimate()``)."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.optim import BLROptimizer
from tests.integrations.training_loops import (
    assert_moved,
    assert_same,
    batches,
    cross_entropy,
    elements,
    make_net,
    point_weights,
    task,
)

RULES = {
    "additive": lambda p: lgb.AdditiveBLR(p, lr=0.5, base=Normal(0.0, 0.1), **SAMPLE),
    "multiplicative": lambda p: lgb.MultiplicativeBLR(
        p, lr=0.5, data_size=64, init="auto", **SAMPLE
    ),
    "affine": lambda p: lgb.AffineBLR(p, lr=0.2, scale_lr=0.05, data_size=64, **SAMPLE),
}
SAMPLE: dict[str, Any] = {"between_steps": "sample", "seed": 5}


def scaled_step(optimizer: BLROptimizer, scaler: torch.amp.GradScaler, net, x, y) -> None:
    optimizer.zero_grad()
    scaler.scale(cross_entropy(net, x, y)).backward()
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("rule", RULES)
def test_scaler_step_in_sample_mode_equals_the_unscaled_float32_run(rule):
    """A power-of-two scale multiplies every gradient exactly, so taking it off gives the
    unscaled float32 gradients bit for bit."""
    make = RULES[rule]
    net, optimizer = (n := make_net()), make(n.parameters())
    twin, unscaled = copy.deepcopy((net, optimizer))
    initial = elements(optimizer, net)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    for x, y in batches(*task()):
        scaled_step(optimizer, scaler, net, x, y)
        unscaled.zero_grad()
        cross_entropy(twin, x, y).backward()
        unscaled.step()
    assert_same(elements(optimizer, net), elements(unscaled, twin))
    assert_moved(initial, elements(optimizer, net))
    assert scaler.get_scale() == 2.0**14  # no inf: grown after every two clean steps


def test_an_inf_gradient_skips_the_step_and_backs_the_scale_off():
    net = make_net()
    optimizer = RULES["additive"](net.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    (x, y), *_ = batches(*task())
    before = elements(optimizer, net)
    sample = net[0].weight.detach().clone()
    optimizer.zero_grad()
    scaler.scale(cross_entropy(net, x, y)).backward()
    net[2].bias.grad[0] = float("inf")  # type: ignore[index]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scaler calibrating is not a divergence
        scaler.step(optimizer)
    scaler.update()
    assert_same(before, elements(optimizer, net))  # the posterior did not move
    assert scaler.get_scale() == 2.0**11
    assert optimizer.skipped_steps == 1
    assert not torch.equal(net[0].weight, sample)  # a fresh sample for the next try
    scaled_step(optimizer, scaler, net, x, y)
    assert_moved(before, elements(optimizer, net))


def test_scaler_step_with_several_samples_names_grad_scaler():
    net = make_net()
    optimizer = lgb.AdditiveBLR(net.parameters(), lr=0.5, mc_samples=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    (x, y), *_ = batches(*task())
    for _ in range(2):
        with optimizer.sampled_params(train=True):
            optimizer.zero_grad()
            scaler.scale(cross_entropy(net, x, y)).backward()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaler.step(optimizer)


# ------------------------------------------------------ what the stacks rely on
def test_sample_mode_step_with_an_empty_closure_uses_the_gradients_already_there():
    net = make_net()
    optimizer = RULES["additive"](net.parameters())
    twin, reference = copy.deepcopy((net, optimizer))
    initial = elements(optimizer, net)
    (x, y), *_ = batches(*task())
    for model, opt, closure in ((net, optimizer, lambda: None), (twin, reference, None)):
        opt.zero_grad()
        cross_entropy(model, x, y).backward()
        opt.step(closure)
    assert_same(elements(optimizer, net), elements(reference, twin))
    assert_moved(initial, elements(optimizer, net))


def test_step_inside_point_estimate_is_refused_in_sample_mode():
    net = make_net()
    optimizer = RULES["additive"](net.parameters())
    (x, y), *_ = batches(*task())
    with pytest.raises(RuntimeError, match="point_estimate"), optimizer.point_estimate():
        optimizer.zero_grad()
        cross_entropy(net, x, y).backward()
        optimizer.step()
    assert not torch.equal(net[0].weight, point_weights(optimizer, net[0]))


def test_a_scaler_driven_skip_is_calibration_not_divergence():
    net = make_net()
    optimizer = lgb.AdditiveBLR(
        net.parameters(), lr=0.5, between_steps="sample", max_consecutive_skips=2
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    (x, y), *_ = batches(*task())
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(cross_entropy(net, x, y)).backward()
        net[2].bias.grad[0] = float("inf")  # type: ignore[index]
        scaler.step(optimizer)  # not a divergence: no FloatingPointError
        scaler.update()
    assert scaler.get_scale() == 2.0**9


def test_importing_the_library_imports_no_training_stack():
    """The stacks are optional extras: only the integration submodules import them."""
    code = (
        "import sys, liegroup_blr, liegroup_blr.integrations, liegroup_blr.predictive\n"
        "loaded = {'lightning', 'transformers', 'accelerate'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
