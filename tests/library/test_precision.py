"""Compiled updates, autocast and half-precision parameters against the eager float32 path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import liegroup_blr as lgb
from tests.shared import make_problem

RULES = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(ps, lr=0.1, **kw),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=0.3, data_size=100, temperature=0.5, **{"init": "auto", **kw}
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(
        ps, lr=0.1, scale_lr=0.05, base=torch.distributions.Normal(0.0, 0.05), data_size=100, **kw
    ),
    "generic": lambda ps, **kw: lgb.LieGroupBLR(
        ps,
        lgb.groups.DiagonalAffineGroup(),
        torch.distributions.Normal(0.0, 0.05),
        lr=0.1,
        data_size=100,
        temperature=0.5,
        **kw,
    ),
}


def run(make, model, x, y, steps, autocast=False):
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)

    def closure():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
        sched.step()
    return opt


@pytest.mark.compile
@pytest.mark.parametrize(
    "rule, samples, options",
    [
        *((rule, 1, {}) for rule in RULES),
        ("multiplicative", 3, {}),
        ("affine", 3, {}),
        ("multiplicative", 1, {"signed": False}),
        ("multiplicative", 1, {"point_at": "mean"}),
        ("multiplicative", 3, {"noise": "table"}),  # ξ: read-only views of the table
        ("affine", 2, {"noise": "table", "antithetic": True}),
    ],
)
def test_compiled_update_equals_eager_without_graph_breaks_or_recompiles(rule, samples, options):
    """``compile=True`` runs the update as fullgraph graphs (a graph break would raise); with
    recompile_limit 1 a recompilation on the changing (scheduled) lr would raise as well.
    One sample is read by the update itself; three go through the accumulators."""
    model, x, y = make_problem(dtype=torch.float32)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = run(
            lambda ps: RULES[rule](ps, seed=0, mc_samples=samples, compile=True, **options),
            model,
            x,
            y,
            6,
        )
    eager = run(lambda ps: RULES[rule](ps, seed=0, mc_samples=samples, **options), twin, x, y, 6)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in ("element", "momentum"):
            torch.testing.assert_close(
                compiled.state[p][key], eager.state[q][key], rtol=1e-5, atol=1e-6
            )


def elements(opt, model):
    return [opt.state[p]["element"].double().clone() for p in model.parameters()]


def relative_error(after, reference, before):
    """‖Δ − Δ_ref‖ / ‖Δ_ref‖ over all tensors, Δ = after − before."""
    num = den = 0.0
    for a, r, b in zip(after, reference, before, strict=True):
        num += float(((a - r) ** 2).sum())
        den += float(((r - b) ** 2).sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["autocast", "bfloat16-parameters"])
def test_half_precision_follows_the_float32_path_with_float32_state(rule, mode):
    """Same noise (seed), bf16 forward (autocast, or bf16 parameters with float32 group
    state): the group elements move as in the float32 run up to the bf16 rounding of the
    forward pass (≈ 2⁻⁸ relative, accumulated over 5 steps)."""
    model, x, y = make_problem(dtype=torch.float32)
    with torch.no_grad():  # both runs start from bf16-representable values
        for p in model.parameters():
            p.copy_(p.bfloat16())
    half = copy.deepcopy(model)
    if mode == "bfloat16-parameters":
        half, xh = half.to(torch.bfloat16), x.bfloat16()
    else:
        xh = x
    reference = run(lambda ps: RULES[rule](ps, seed=0), model, x, y, 5)
    opt = RULES[rule](half.parameters(), seed=0)
    before = elements(opt, half)
    run_opt = run(lambda ps: opt, half, xh, y, 5, autocast=mode == "autocast")
    assert run_opt is opt
    error = relative_error(elements(opt, half), elements(reference, model), before)
    assert error < 0.02  # measured ≈ 0.003
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values())


@pytest.mark.compile
@pytest.mark.parametrize("rule", ["multiplicative", "affine"])
def test_compiled_update_after_load_state_dict_and_deepcopy_equals_eager(rule):
    """The compiled kernels take row views of the state, kept between steps: after
    ``load_state_dict`` (new state tensors) and in a deep copy they are views of the tensors
    the optimizer now holds, so the steps go on as eager ones."""
    model, x, y = make_problem(dtype=torch.float32)
    twin = copy.deepcopy(model)
    compiled = run(lambda ps: RULES[rule](ps, seed=0, compile=True), model, x, y, 2)
    eager = run(lambda ps: RULES[rule](ps, seed=0), twin, x, y, 2)
    compiled.load_state_dict(copy.deepcopy(eager.state_dict()))
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            p.copy_(q)
    copied = copy.deepcopy((model, compiled))
    for m, opt in ((model, compiled), copied, (twin, eager)):
        run(lambda ps, opt=opt: opt, m, x, y, 2)
    for (p, q), r in zip(
        zip(model.parameters(), twin.parameters(), strict=True), copied[0].parameters(), strict=True
    ):
        for key in ("element", "momentum"):
            torch.testing.assert_close(
                compiled.state[p][key], eager.state[q][key], rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(
                copied[1].state[r][key], eager.state[q][key], rtol=1e-5, atol=1e-6
            )


@pytest.mark.compile
def test_compiled_steps_keep_views_of_the_state_only():
    """The row views a compiled step keeps are those of the optimizer's own tensors: a
    sample's noise from the table is a new window at every step, and keeping its views
    would hold every window ever drawn."""
    model, x, y = make_problem(dtype=torch.float32)
    opt = run(
        lambda ps: RULES["multiplicative"](ps, seed=0, noise="table", compile=True), model, x, y, 3
    )
    kept = opt._engine.scratch.kept_rows
    run(lambda ps: opt, model, x, y, 5)
    assert opt._engine.scratch.kept_rows == kept
