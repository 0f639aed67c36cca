"""FSDP2 (DTensor) parameters on 2 gloo processes: the rules on the shards are the rules on the
whole parameters, the noise does not depend on the sharding, the ranks skip together, and DCP
checkpoints resume bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributions import Normal

import liegroup_blr as lgb
from liegroup_blr.groups import DiagonalAffineGroup
from liegroup_blr.optim import TrainingState
from tests.processes import spawn

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed"),
    pytest.mark.distributed,  # every test here starts processes or a process group
]

STEPS = 3
DTYPE = torch.float64
RULES = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(
        ps, lr=0.1, base=Normal(0.0, 0.1), data_size=64, **kw
    ),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=0.5, data_size=64, temperature=0.2, **{"init": "auto", **kw}
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(ps, lr=0.1, scale_lr=0.1, data_size=64, **kw),
    "generic": lambda ps, **kw: lgb.LieGroupBLR(
        ps, DiagonalAffineGroup(), Normal(0.0, 1.0), lr=0.1, data_size=64, init=_affine_init, **kw
    ),
}
CASES = [(rule, "point", False) for rule in RULES] + [
    ("affine", "sample", False),
    ("multiplicative", "sample", True),  # compiled: the update draws the next sample
]


def _affine_init(theta):
    return torch.stack((torch.full_like(theta, 0.05), theta))


def make_problem():
    """A network whose shards over 2 ranks are even (8 rows), uneven (3 rows: 2 and 1) and
    empty (1 row: 1 and 0), and a fixed batch."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 1))
    model = model.to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=DTYPE) * 0.5)
    x = torch.randn(32, 5, generator=gen, dtype=DTYPE)
    y = torch.randint(0, 2, (32, 1), generator=gen).to(DTYPE)
    return model, x, y


def half(t, rank):
    return t[rank * 16 : (rank + 1) * 16]


def train(model, opt, x, y, steps=STEPS, between_steps="point", nan_at=None):
    """``steps`` updates (sample mode: a closure-free step on ``p.grad``, as torch.optim
    loops do); with ``nan_at`` a step whose loss is NaN on this process only."""
    for step in range(steps):

        def closure(step=step):
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            return loss.detach() * float("nan") if step == nan_at else loss

        if between_steps == "sample":
            closure()
            opt.step()
        else:
            opt.step(closure)


def elements(opt, model):
    """The whole group elements (gathered from the shards), by name."""
    post = lgb.Posterior.from_optimizer(opt, model)
    return {name: post[name].element for name in post}


def _sharded(make, rank, **kw):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)  # what a script seeded per rank does: must not matter
    model, x, y = make_problem()
    fully_shard(model)
    return model, make(model.parameters(), **kw), half(x, rank), half(y, rank)


def _fsdp_worker(rank: int, folder: str) -> None:
    out = {}
    for rule, mode, compiled in CASES:
        options = dict(between_steps=mode, compile=compiled)
        model, opt, xb, yb = _sharded(
            RULES[rule], rank, noise="table", table_size=5000, seed=3, **options
        )
        train(model, opt, xb, yb, between_steps=mode)
        out[f"{rule}-{mode}"] = elements(opt, model)
        out[f"{rule}-{mode}-local"] = [
            {k: v.shape for k, v in opt.state[p].items()} for p in model.parameters()
        ]
    torch.save(out, f"{folder}/fsdp{rank}.pt")


def test_fsdp_over_two_processes_equals_one_process_on_the_whole_batch(tmp_path):
    """Table noise addressed by global index: the shards' rules give the one process's group
    elements, for every element-wise rule, also with the sample held between steps; each
    rank keeps the state of its shard only (uneven and empty shards included)."""
    spawn(_fsdp_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"fsdp{r}.pt", weights_only=True) for r in range(2)]
    for rule, mode, compiled in CASES:
        model, x, y = make_problem()
        options = dict(between_steps=mode, compile=compiled)
        opt = RULES[rule](model.parameters(), noise="table", table_size=5000, seed=3, **options)
        start = elements(opt, model)
        train(model, opt, x, y, between_steps=mode)
        one = elements(opt, model)
        for name, expected in one.items():
            assert not torch.equal(expected, start[name]), (rule, name)  # trained
            for r in range(2):
                got = ranks[r][f"{rule}-{mode}"][name]
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9, msg=(rule, name))
        for i, p in enumerate(model.parameters()):  # each rank holds its shard's rows
            n = p.shape[0]
            mine = [(n + 1) // 2, n - (n + 1) // 2]  # Shard(0): 8 → 4, 4; 3 → 2, 1; 1 → 1, 0
            for r in range(2):
                for shape in ranks[r][f"{rule}-{mode}-local"][i].values():
                    assert shape[-p.dim()] == mine[r], (rule, i, r, shape)


def _fresh_worker(rank: int, folder: str) -> None:
    """Fresh draws of the shards of one large parameter, and the ranks' skip of a step whose
    loss is NaN on rank 1 only."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)
    layer = nn.Linear(400, 50, bias=False).to(DTYPE)
    fully_shard(layer)
    opt = RULES["additive"](layer.parameters(), seed=7)
    point = layer.weight.full_tensor()
    draws = []
    for _ in range(2):
        with opt.sampled_params():
            draws.append(layer.weight.full_tensor() - point)
    memory = opt.footprint()
    model, opt, xb, yb = _sharded(RULES["multiplicative"], rank, seed=3)
    before = elements(opt, model)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        train(model, opt, xb, yb, steps=2, nan_at=1)
    out = {"draws": draws, "memory": memory, "before": before, "after": elements(opt, model)}
    out["skipped"] = opt.skipped_steps
    torch.save(out, f"{folder}/fresh{rank}.pt")


def test_fresh_noise_draws_each_element_once_per_sample_and_ranks_skip_together(tmp_path):
    """Fresh noise on CPU: every element of a sharded parameter is drawn once per sample, by
    the rank holding it, from the base (N(0, 0.1²)), the shards' draws independent of each
    other and of the next sample's (a CPU generator cannot skip ahead: not one process's
    values, as table noise is). A step whose loss is NaN on one rank is skipped by both."""
    spawn(_fresh_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"fresh{r}.pt", weights_only=True) for r in range(2)]
    a, b = ranks[0]["draws"]
    n = a[:25].numel()  # the shards: rows 0-24 on rank 0, 25-49 on rank 1
    bound = 4 / n**0.5  # correlations of independent draws: sd 1/√n
    for draw in (a, b):
        assert abs(float(draw.mean())) < 4 * 0.1 / draw.numel() ** 0.5
        assert abs(float(draw.std()) / 0.1 - 1) < 4 * (0.5 / draw.numel()) ** 0.5
        halves = draw[:25].flatten(), draw[25:].flatten()
        assert abs(float(torch.corrcoef(torch.stack(halves))[0, 1])) < bound
    assert abs(float(torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1])) < bound
    whole = RULES["additive"](nn.Linear(400, 50, bias=False).to(DTYPE).parameters())
    with whole.sampled_params():  # the draw makes the scratch buffers
        pass
    for rank in ranks:  # each rank holds the state of its half of the rows
        assert rank["memory"]["state"] == whole.footprint()["state"] // 2
        assert rank["memory"]["scratch"] == whole.footprint()["scratch"] // 2 > 0
    for rank in ranks:  # step 1 (NaN on rank 1 only) skipped on both; step 0 taken
        assert rank["skipped"] == 1
        for name, element in rank["after"].items():
            assert not torch.equal(element, rank["before"][name])
            assert torch.equal(element, ranks[0]["after"][name])


def _checkpoint_worker(rank: int, folder: str) -> None:
    """Train 2 steps, save with DCP, train 2 more; then a new optimizer loaded from the
    checkpoint trains the same 2 steps; and one loaded through DCP's optimizer state dict
    alone (its noise state dropped)."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    results = {}
    for mode in ("point", "sample"):
        model, opt, xb, yb = _sharded(RULES["affine"], rank, seed=3, between_steps=mode)
        train(model, opt, xb, yb, steps=2, between_steps=mode)
        dcp.save({"train": TrainingState(model, opt)}, checkpoint_id=f"{folder}/{mode}")
        saved_rng = opt.state_dict()["rng"]
        train(model, opt, xb, yb, steps=2, between_steps=mode)
        straight = elements(opt, model)

        model, opt, xb, yb = _sharded(RULES["affine"], rank, seed=3, between_steps=mode)
        dcp.load({"train": TrainingState(model, opt)}, checkpoint_id=f"{folder}/{mode}")
        loaded_rng = opt.state_dict()["rng"]
        train(model, opt, xb, yb, steps=2, between_steps=mode)
        resumed = elements(opt, model)

        model, opt, xb, yb = _sharded(RULES["affine"], rank, seed=3, between_steps=mode)
        osd = get_optimizer_state_dict(model, opt)
        dcp.load({"train": {"optim": osd}}, checkpoint_id=f"{folder}/{mode}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_optimizer_state_dict(model, opt, osd)
        results[mode] = {
            "straight": straight,
            "resumed": resumed,
            "saved_rng": saved_rng,
            "loaded_rng": loaded_rng,
            "dropped": [str(w.message) for w in caught],
            "sharded_state": type(osd["state"]["0.weight"]["element"]).__name__,
        }
    torch.save(results, f"{folder}/ckpt{rank}.pt")


def test_dcp_checkpoint_of_a_sharded_run_resumes_bit_for_bit(tmp_path):
    spawn(_checkpoint_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"ckpt{r}.pt", weights_only=True) for r in range(2)]
    for mode in ("point", "sample"):
        for rank in ranks:
            res = rank[mode]
            assert res["sharded_state"] == "DTensor"  # saved sharded like the parameter
            for name, element in res["straight"].items():
                assert torch.equal(res["resumed"][name], element), (mode, name)
            assert res["loaded_rng"].keys() == res["saved_rng"].keys()
            for key, state in res["saved_rng"].items():  # each rank's own generators
                assert torch.equal(res["loaded_rng"][key], state)
            assert any("TrainingState" in message for message in res["dropped"])
        states = [r[mode]["saved_rng"][f"cpu/shard{i}"] for i, r in enumerate(ranks)]
        assert not torch.equal(*states)  # per-rank states: DCP must not collapse them


def _refusal_worker(rank: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    from liegroup_blr.groups import FullAffineGroup, RotationScalingGroup

    mesh = init_device_mesh("cpu", (2,))
    weight = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    messages = {}
    cases = {
        "process_group": lambda: RULES["affine"]([weight], process_group=dist.group.WORLD),
        "full_affine": lambda: lgb.LieGroupBLR(
            [weight], FullAffineGroup(), Normal(0, 1), 0.1, data_size=64
        ),
        "rotation": lambda: lgb.LieGroupBLR(
            [weight], RotationScalingGroup(), Normal(1, 1), 0.1, data_size=64
        ),
    }
    for name, make in cases.items():
        try:
            make()
        except ValueError as error:
            messages[name] = str(error)
    model, opt, xb, yb = _sharded(RULES["additive"], rank, seed=3)
    loss = nn.functional.binary_cross_entropy_with_logits
    try:
        lgb.mc_step(opt, model, loss, xb, yb, vectorize=True)
    except ValueError as error:
        messages["vectorize"] = str(error)
    torch.manual_seed(0)
    model, x, y = make_problem()
    ddp = DistributedDataParallel(model)
    opt = RULES["multiplicative"](ddp.parameters(), seed=3, process_group=dist.group.WORLD)
    try:
        train(ddp, opt, half(x, rank), half(y, rank), steps=1)
    except ValueError as error:
        messages["ddp"] = str(error)
    torch.save(messages, f"{folder}/refused{rank}.pt")


def test_what_cannot_work_on_shards_or_with_ddp_is_refused_in_one_line(tmp_path):
    """process_group with sharded parameters, groups that act across coordinates, and a
    DDP-wrapped model given process_group (each process's noise paired with averaged
    gradients: the multiplicative rule's first update was 30 % off)."""
    spawn(_refusal_worker, tmp_path)
    for rank in range(2):
        messages = torch.load(tmp_path / f"refused{rank}.pt", weights_only=True)
        assert "drop process_group=" in messages["process_group"]
        assert "element-wise group" in messages["full_affine"]
        assert "element-wise group" in messages["rotation"]
        assert "DistributedDataParallel" in messages["ddp"]
        assert "drop process_group=" in messages["ddp"]
        assert "vectorize=False" in messages["vectorize"]
        assert all("\n" not in m for m in messages.values())


# ------------------------------------------------------ DTensor parameters placed by hand
PLACED = ("additive", "multiplicative", "affine")


def _placed_problem():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(10, 5, generator=gen, dtype=DTYPE) * 0.5
    b = torch.randn(10, generator=gen, dtype=DTYPE) * 0.5
    x = torch.randn(16, 5, generator=gen, dtype=DTYPE)
    y = torch.randint(0, 10, (16,), generator=gen)
    return w, b, x, y


def _placed_train(opt, w, b, x, y, forward) -> None:
    for _ in range(STEPS):

        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(forward(x, w, b), y)
            loss.backward()
            return loss

        opt.step(closure)


def _placed_worker(rank: int, folder: str) -> None:
    """A weight sharded by rows, a replicated bias, a forward in DTensor ops: the bias's
    gradient arrives sharded (crashed on the old main); the group elements come back as
    DTensors placed like their parameters, go in again, and a write into a DTensor parameter
    is adopted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for rule in PLACED:
        w0, b0, x, y = _placed_problem()
        w = nn.Parameter(distribute_tensor(w0, mesh, [Shard(0)]))
        b = nn.Parameter(distribute_tensor(b0, mesh, [Replicate()]))
        xr = distribute_tensor(x, mesh, [Replicate()])
        opt = RULES[rule]([w, b], noise="table", table_size=5000, seed=3)
        _placed_train(opt, w, b, xr, y, lambda x, w, b: nn.functional.linear(x, w, b).full_tensor())
        parts = {n: opt.group_element(p) for n, p in (("w", w), ("b", b))}
        out[rule] = {f"{n}.{k}": v.full_tensor() for n, ps in parts.items() for k, v in ps.items()}
        out[f"{rule}-placements"] = {
            f"{n}.{k}": str(v.placements) for n, ps in parts.items() for k, v in ps.items()
        }
        if rule != "additive":  # the stacked element as a DTensor goes in again unchanged
            before = opt.group_element(w)
            opt.set_group_element(w, torch.stack(list(before.values())))
            after = opt.group_element(w)
            out[f"{rule}-again"] = all(
                torch.equal(before[k].full_tensor(), after[k].full_tensor()) for k in before
            )
        with opt.point_estimate():
            point = w.full_tensor().clone()
        with torch.no_grad():
            w.mul_(0.5)  # a write through the DTensor: adopted as the location
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opt.point_estimate():
                out[f"{rule}-written"] = (w.full_tensor() - 0.5 * point).abs().max().item()
        out[f"{rule}-warned"] = any("written outside" in str(c.message) for c in caught)
    torch.save(out, f"{folder}/placed{rank}.pt")


def test_dtensor_parameters_placed_by_hand_train_as_one_process(tmp_path):
    spawn(_placed_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"placed{r}.pt", weights_only=True) for r in range(2)]
    for rule in PLACED:
        w0, b0, x, y = _placed_problem()
        w, b = nn.Parameter(w0), nn.Parameter(b0)
        opt = RULES[rule]([w, b], noise="table", table_size=5000, seed=3)
        _placed_train(opt, w, b, x, y, nn.functional.linear)
        expected = {
            f"{n}.{k}": v for n, p in (("w", w), ("b", b)) for k, v in opt.group_element(p).items()
        }
        for r in range(2):
            assert ranks[r][rule].keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(ranks[r][rule][key], value, rtol=1e-10, atol=1e-12)
            placements = ranks[r][f"{rule}-placements"]
            assert all(placements[k] == "(Shard(dim=0),)" for k in placements if k[0] == "w")
            assert all(placements[k] == "(Replicate(),)" for k in placements if k[0] == "b")
            assert ranks[r].get(f"{rule}-again", True)
            assert ranks[r][f"{rule}-written"] < 1e-12 and ranks[r][f"{rule}-warned"]
