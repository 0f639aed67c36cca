"""The optimizer package stays readable: a step walks few calls through few files, each rule
picks its implementation in one dispatcher, and no module grows past a page count."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import liegroup_blr as lgb

PACKAGE = Path(lgb.__file__).resolve().parent
RULES = {
    "additive": lambda ps: lgb.AdditiveBLR(ps, lr=0.05, data_size=100),
    "multiplicative": lambda ps: lgb.MultiplicativeBLR(
        ps, lr=1.0, temperature=0.006, data_size=100
    ),
    "affine": lambda ps: lgb.AffineBLR(ps, lr=1.0, scale_lr=0.05, data_size=100),
}


def _package_file(code) -> str | None:
    path = os.path.realpath(code.co_filename)
    return path if path.startswith(str(PACKAGE) + os.sep) else None


def count_calls(step) -> tuple[int, int]:
    """Calls into liegroup_blr while ``step()`` runs (comprehensions and generator expressions
    left out), and how many of them cross from one file into another: the callee's file is
    not that of the nearest enclosing liegroup_blr frame (a call from outside counts)."""
    calls = crossings = 0

    def tracer(frame, event, arg):
        nonlocal calls, crossings
        if event != "call" or frame.f_code.co_name.startswith("<"):
            return None
        callee = _package_file(frame.f_code)
        if callee is None:
            return None
        back = frame.f_back
        while back is not None and _package_file(back.f_code) is None:
            back = back.f_back
        calls += 1
        crossings += back is None or _package_file(back.f_code) != callee
        return None

    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(None)
    return calls, crossings


@pytest.mark.parametrize("rule", RULES)
def test_one_eager_step_walks_at_most_30_calls_through_15_file_crossings(rule):
    """One ``step(closure)`` with the default options (fresh noise, one sample, no antithetic
    pairs) on a small MLP: the engine gathers the lists once and each rule calls its
    dispatcher (80 calls and 51 crossings before the rebuild)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    opt = RULES[rule](model.parameters())

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)  # the first step makes the state and buffers
    before = {p: opt.state[p]["element"].clone() for p in model.parameters()}
    calls, crossings = count_calls(lambda: opt.step(closure))
    assert all(not torch.equal(before[p], opt.state[p]["element"]) for p in model.parameters())
    assert calls <= 30, f"{calls} calls into liegroup_blr"
    assert crossings <= 15, f"{crossings} file crossings"


def test_the_call_counter_counts_calls_and_crossings():
    """The counter itself: two calls from outside into the package, each calling the same
    file twice more, and the comprehension around them left out."""
    table = lgb.noise.NoiseTable(torch.distributions.Normal(0.0, 1.0), 64, seed=0)
    calls, crossings = count_calls(lambda: [table.window(8, i) for i in range(2)])
    assert (calls, crossings) == (6, 2)  # window → size, size; only the entries cross


RULE_MODULES = ["additive.py", "multiplicative.py", "affine.py", "generic.py"]


@pytest.mark.parametrize("module", RULE_MODULES)
def test_rule_classes_do_not_branch_on_compile(module):
    """The choice between the eager and the compiled implementation is the dispatcher's."""
    tree = ast.parse((PACKAGE / "optim" / module).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for test in (n.test for n in ast.walk(node) if isinstance(n, (ast.If, ast.IfExp))):
                names = {a.attr for a in ast.walk(test) if isinstance(a, ast.Attribute)}
                assert "compile" not in names, f"{module}: {node.name} branches on compile"


def test_no_module_of_the_package_is_over_450_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert not long
