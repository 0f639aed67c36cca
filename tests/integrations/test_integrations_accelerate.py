"""The optimizers behind accelerate's ``AcceleratedOptimizer`` (accelerate is in the test
extra): training in sample mode after ``prepare``, the sample protocol through
:func:`~liegroup_blr.optim.unwrap`, the predictive functions given the wrapper, and
accelerate's own GradScaler path driven with a CPU scaler."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import liegroup_blr as lgb
from liegroup_blr.optim import BLROptimizer
from liegroup_blr.predictive import predictive_log_probs
from tests.integrations.training_loops import (
    BATCH,
    STEPS,
    Recorder,
    assert_moved,
    assert_same,
    batches,
    cross_entropy,
    elements,
    make_net,
    point_weights,
    task,
)


def make(params: Any, between_steps: str = "sample") -> BLROptimizer:
    # the default between_steps="point" is left out: the predictive test also runs on
    # releases that predate the option (the silent failure it catches)
    mode = {} if between_steps == "point" else {"between_steps": between_steps}
    return lgb.AffineBLR(params, lr=0.2, scale_lr=0.05, data_size=64, seed=4, **mode)


def prepared(
    scaler: torch.amp.GradScaler | None = None, between_steps: str = "sample"
) -> tuple[Any, nn.Module, Any, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if scaler is not None:  # what accelerate makes for mixed_precision="fp16" on a GPU
        accelerator.scaler = scaler
    net = make_net()
    data = DataLoader(TensorDataset(*task()), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(net, make(net.parameters(), between_steps), data)
    return accelerator, model, optimizer, data


def plain(steps: int = STEPS) -> tuple[nn.Module, BLROptimizer, list[torch.Tensor]]:
    net = make_net()
    optimizer = make(net.parameters())
    points = []
    for x, y in list(batches(*task()))[:steps]:
        points.append(point_weights(optimizer, net[0]))
        optimizer.zero_grad()
        cross_entropy(net, x, y).backward()
        optimizer.step()
    return net, optimizer, points


def test_prepare_then_train_in_sample_mode_equals_the_plain_loop():
    from liegroup_blr.optim import unwrap

    accelerator, model, optimizer, data = prepared()
    blr = unwrap(optimizer)
    assert blr is optimizer.optimizer
    initial = elements(blr, model)
    recorder = Recorder().attach(model[0])
    for x, y in data:
        optimizer.zero_grad()
        accelerator.backward(cross_entropy(model, x, y))
        optimizer.step()
    net, reference, points = plain()
    assert_same(elements(blr, model), elements(reference, net))
    assert_moved(initial, elements(blr, model))
    seen = recorder.train_weights()
    assert len(seen) == STEPS
    assert all(not torch.equal(w, p) for w, p in zip(seen, points, strict=True))


def test_sampled_params_through_unwrap_keeps_the_training_sample():
    from liegroup_blr.optim import unwrap

    _, model, optimizer, _ = prepared()
    blr = unwrap(optimizer)
    assert blr is not None
    resident = model[0].weight.detach().clone()
    with blr.sampled_params():
        sample = model[0].weight.detach().clone()
    assert torch.equal(model[0].weight, resident)  # the training sample is back
    assert not torch.equal(sample, resident)
    assert not torch.equal(sample, point_weights(blr, model[0]))


@pytest.mark.parametrize("between_steps", ["point", "sample"])
def test_the_predictive_functions_given_the_wrapper_use_the_posterior(between_steps):
    """Given accelerate's wrapper, predictive_log_probs averages posterior samples (once it
    silently predicted at the point estimate), and mc_step and Posterior.from_optimizer
    act on the optimizer inside."""
    _, model, optimizer, _ = prepared(between_steps=between_steps)
    blr = optimizer.optimizer
    x, y = task(BATCH)
    twin, posterior = copy.deepcopy((model, blr))
    through = predictive_log_probs(model, [x], optimizer, samples=4)
    direct = predictive_log_probs(twin, [x], posterior, samples=4)
    assert torch.equal(through, direct)  # the posterior's average, not the point estimate
    with blr.point_estimate():
        at_point = predictive_log_probs(model, [x])
    assert not torch.allclose(through, at_point)

    a = lgb.Posterior.from_optimizer(optimizer, model).point_estimates()
    b = lgb.Posterior.from_optimizer(blr, model).point_estimates()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    before = elements(blr, model)
    mc_twin, mc_optimizer = copy.deepcopy((model, blr))
    loss = lgb.mc_step(optimizer, model, nn.functional.cross_entropy, x, y)
    expected = lgb.mc_step(mc_optimizer, mc_twin, nn.functional.cross_entropy, x, y)
    assert torch.equal(loss, expected)
    assert_same(elements(blr, model), elements(mc_optimizer, mc_twin))
    assert_moved(before, elements(blr, model))


@pytest.mark.parametrize("inf_at", [None, 1])
def test_accelerate_grad_scaler_path_is_exact_against_unscaled_float32(inf_at):
    """accelerate's fp16 path (backward through the scaler, AcceleratedOptimizer.step calling
    scaler.step on its patched step) with a CPU GradScaler and a power-of-two scale: the
    same run as unscaled float32, and an inf skips the step and halves the scale."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accelerator, model, optimizer, data = prepared(scaler)
    blr = optimizer.optimizer
    history = []
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        accelerator.backward(cross_entropy(model, x, y))
        if step == inf_at:
            model[2].bias.grad[0] = float("inf")
        history.append(elements(blr, model))
        optimizer.step()
    net, reference, _ = plain(STEPS if inf_at is None else inf_at)
    if inf_at is None:
        assert_same(elements(blr, model), elements(reference, net))
        assert scaler.get_scale() == 2.0**10
    else:
        assert_same(history[inf_at], elements(reference, net))
        assert_same(history[inf_at], history[inf_at + 1])  # the inf step was skipped
        assert optimizer.step_was_skipped is False  # the later steps went through
        assert scaler.get_scale() == 2.0**9
        assert_moved(history[inf_at + 1], elements(blr, model))
