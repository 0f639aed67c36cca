"""Monte-Carlo steps: vectorised samples and batch splitting against the sequential loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import liegroup_blr as lgb
from liegroup_blr import mc
from tests.shared import FACTORIES, closure_for, make_problem

LOSS = nn.functional.cross_entropy


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize(("chunk_size", "batch_split"), [(None, 1), (2, 1), (3, 2)])
def test_vectorised_samples_equal_the_sequential_loop(kind, chunk_size, batch_split):
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    seq = FACTORIES[kind](model.parameters(), mc_samples=3, seed=4)
    vec = FACTORIES[kind](twin.parameters(), mc_samples=3, seed=4)
    for _ in range(3):
        l1 = lgb.mc_step(seq, model, LOSS, x, y, batch_split=batch_split)
        l2 = lgb.mc_step(
            vec, twin, LOSS, x, y, vectorize=True, chunk_size=chunk_size, batch_split=batch_split
        )
        torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-12)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        for key in ("element", "momentum"):
            torch.testing.assert_close(seq.state[p][key], vec.state[q][key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", FACTORIES)
def test_sequential_mc_step_equals_step_with_a_closure(kind):
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    a = FACTORIES[kind](model.parameters(), mc_samples=2, seed=1)
    b = FACTORIES[kind](twin.parameters(), mc_samples=2, seed=1)
    for _ in range(3):
        la = lgb.mc_step(a, model, LOSS, x, y)
        lb = b.step(closure_for(b, twin, x, y))
        assert torch.equal(la, lb)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_batch_split_gives_each_sample_its_own_slice():
    """k = 2, S = 1: two samples, the first on the first half of the batch, the second on
    the second half — the manual loop written out."""
    model, x, y = make_problem()
    twin = copy.deepcopy(model)
    a = lgb.AdditiveBLR(
        model.parameters(), lr=0.1, base=torch.distributions.Normal(0.0, 0.1), seed=2
    )
    b = lgb.AdditiveBLR(
        twin.parameters(), lr=0.1, base=torch.distributions.Normal(0.0, 0.1), seed=2
    )
    lgb.mc_step(a, model, LOSS, x, y, batch_split=2)
    for half in (slice(0, 16), slice(16, 32)):
        with b.sampled_params(train=True):
            b.zero_grad()
            LOSS(twin(x[half]), y[half]).backward()
    b.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_chunks_bound_memory(monkeypatch):
    model, x, _ = make_problem()
    assert mc.default_chunk_size(model, 32, x) == 32
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(mc, "_available_bytes", lambda device: 2 * 3 * 5 * param_bytes)
    assert mc.default_chunk_size(model, 32, x) == 1


def test_invalid_batch_split_and_pending_samples_raise():
    model, x, y = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^batch_split"):
        lgb.mc_step(opt, model, LOSS, x, y, batch_split=5)
    with opt.sampled_params(train=True):
        LOSS(model(x), y).backward()
    with pytest.raises(RuntimeError, match="pending"):
        lgb.mc_step(opt, model, LOSS, x, y)


def test_non_finite_loss_skips_the_update():
    model, x, y = make_problem()
    opt = lgb.AdditiveBLR(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        lgb.mc_step(opt, model, lambda out, t: LOSS(out, t) * float("nan"), x, y, vectorize=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
