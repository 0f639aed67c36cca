"""Training over processes: 2 gloo processes equal one process with the union of their work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel

import liegroup_blr as lgb
from tests.processes import spawn
from tests.shared import make_problem

pytestmark = pytest.mark.distributed  # every test here starts processes

STEPS = 4
CPU = torch.device("cpu")


def make_opt(params, **kw):
    return lgb.MultiplicativeBLR(
        params, lr=0.5, data_size=64, temperature=0.2, seed=5, **{"init": "auto", **kw}
    )


def batch_for(x, y, rank, mode):
    """Data parallelism: each process its half of the batch; MC parallelism: the whole batch."""
    if mode == "mc":
        return x, y
    half = len(x) // 2
    return x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]


def _worker(rank: int, folder: str, mode: str) -> None:
    torch.manual_seed(100 + rank)  # the model and noise must not depend on this
    model, x, y = make_problem()
    if rank == 1:  # a different local initialisation: rank 0's state is broadcast
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = make_opt(model.parameters(), process_group=dist.group.WORLD)
    generator_state = opt.noise_source.generator(CPU).get_state()
    xb, yb = batch_for(x, y, rank, mode)
    for _ in range(STEPS):

        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            return loss

        opt.step(closure)
    torch.save(
        {
            "generator": generator_state,
            "params": [p.detach() for p in model.parameters()],
            "states": [opt.state[p] for p in model.parameters()],
        },
        f"{folder}/rank{rank}.pt",
    )


@pytest.mark.parametrize("mode", ["data", "mc"])
def test_two_processes_equal_one_process_with_their_samples_and_noise(tmp_path, mode):
    spawn(_worker, tmp_path, mode)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # group state identical on every process
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)

    # One process, two samples per step: sample r sees rank r's batch and rank r's noise.
    model, x, y = make_problem()
    opt = make_opt(model.parameters())
    streams = [res["generator"] for res in results]
    for _ in range(STEPS):
        for r in range(2):
            opt.noise_source.generator(CPU).set_state(streams[r])
            xb, yb = batch_for(x, y, r, mode)
            with opt.sampled_params(train=True):
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
            streams[r] = opt.noise_source.generator(CPU).get_state()
        opt.step()
    for p, q in zip(model.parameters(), results[0]["params"], strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=1e-12, atol=1e-14)
    for p, state in zip(model.parameters(), results[0]["states"], strict=True):
        for key in ("element", "momentum"):
            torch.testing.assert_close(opt.state[p][key], state[key], rtol=1e-12, atol=1e-14)
    assert not torch.equal(streams[0], streams[1])  # independent noise on the two processes


# ---------------------------------------------------------------------------- DDP
DDP_RULES = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(ps, lr=0.1, base=Normal(0.0, 0.1), **kw),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=0.5, data_size=64, temperature=0.2, **{"init": "auto", **kw}
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(ps, lr=0.1, scale_lr=0.1, data_size=64, **kw),
}


def _train(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> None:
    for _ in range(STEPS):

        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)


def _ddp_worker(rank: int, folder: str) -> None:
    """What a DDP script does: a seed per rank, the model wrapped, the optimizer built on
    every rank without process_group, each rank half of every batch."""
    out = {}
    for name, make in DDP_RULES.items():
        torch.manual_seed(rank)
        model, x, y = make_problem()
        if rank == 1:  # DDP broadcasts rank 0's parameters when it wraps the model
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        ddp = DistributedDataParallel(model)
        opt = make(ddp.parameters())
        _train(ddp, opt, *batch_for(x, y, rank, "data"))
        out[name] = [p.detach().clone() for p in model.parameters()]
    try:
        DDP_RULES["affine"](model.parameters(), seed=rank)
    except ValueError as error:
        out["refused"] = str(error)
    torch.save(out, f"{folder}/ddp{rank}.pt")


def test_ddp_ranks_seeded_apart_train_as_one_process_on_the_global_batch(tmp_path):
    spawn(_ddp_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"ddp{r}.pt", weights_only=True) for r in range(2)]
    for name, make in DDP_RULES.items():
        for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
            assert torch.equal(a, b), name  # the same noise on both ranks: no drift
        torch.manual_seed(0)  # rank 0's: its seed and elements are the ones shared
        model, x, y = make_problem()
        start = [p.detach().clone() for p in model.parameters()]
        _train(model, make(model.parameters()), x, y)
        for p, q, p0 in zip(model.parameters(), ranks[0][name], start, strict=True):
            assert not torch.equal(p.detach(), p0), name  # trained
            torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12, msg=name)
    for rank in ranks:  # per-rank seeds would draw different noise: refused, naming the fix
        assert "different seeds [0, 1]" in rank["refused"]
        assert "process_group=" in rank["refused"]
