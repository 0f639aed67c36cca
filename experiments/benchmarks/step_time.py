"""Step-time benchmark: the Lie-group rules against torch.optim and IVON on the same model.

For the reference tanh-MLP, a small CNN and the digits MLP at batch 50 it times, in one run
and interleaved:

* a full training step (forward + backward + step, one MC sample) of SGD(momentum),
  Adam(foreach), IVON and the additive, multiplicative and affine rules;
* the noise floor L = SGD step + drawing the rule's noise for all parameters with torch's
  fastest sampler for that distribution (target: full step ≤ 1.15 × L);
* the update arithmetic alone, without the draw, forward or backward (targets: ≤ 2.0 ×
  Adam(foreach)'s ``step`` eager, ≤ 1.6 × compiled);
* two floors of the multiplicative update: its compiled kernel alone (one sample, no
  engine around it), and ``torch.exp2`` alone over its 2P values;
* the generic autodiff rule on the diagonal affine group against the specialised
  :class:`~liegroup_blr.AffineBLR` (also on the 64-16-10 MLP of the 8×8 digits).

Run: ``python -m experiments.benchmarks.step_time [--rounds 7] [--steps 10]``.
Numbers are medians over rounds of the mean time per call; ratios come from one run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import ivon
import torch
from torch import Tensor, nn

import liegroup_blr as lgb
from experiments.models import CNN, MLP
from liegroup_blr.optim.kernel_utils import compiled, rows
from liegroup_blr.optim.multiplicative import multiplicative_update

BATCH = 50
DATA_SIZE = 60_000
RULES: dict[str, Callable[..., lgb.optim.BLROptimizer]] = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(ps, lr=1e-3, **kw),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=1e-3, data_size=DATA_SIZE, temperature=0.006, **kw
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(ps, lr=1e-3, scale_lr=1e-5, data_size=DATA_SIZE, **kw),
}


def mean_time(fn: Callable[[], object], steps: int) -> float:
    """Mean seconds per call of ``fn`` over ``steps`` calls."""
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def _generic_affine(ps: list[Tensor], **kw: Any) -> torch.optim.Optimizer:
    """The affine rule through the generic autodiff rule: like-for-like with ``affine`` at
    α₁ = α₂ (per-component factors give the scale its own step)."""
    group, base = lgb.groups.DiagonalAffineGroup(), torch.distributions.Normal(0.0, 0.005)
    factors = {"scale": 1e-2, "shift": 1.0}
    return lgb.LieGroupBLR(
        ps, group, base, lr=1e-3, data_size=DATA_SIZE, preconditioner=factors, **kw
    )


def _model(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model: nn.Module
    if name == "mlp":
        model, shape = MLP((1, 28, 28), 10), (1, 28, 28)
    elif name == "digits":  # the 64-16-10 MLP of the 8×8 digits
        model, shape = MLP((1, 8, 8), 10, widths=(16,)), (1, 8, 8)
    else:
        model, shape = CNN((3, 32, 32), 10, width=1), (3, 32, 32)
    return model, torch.randn(BATCH, *shape), torch.randint(0, 10, (BATCH,))


def _optimizers(model: nn.Module) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    """Each optimizer on its own copy of ``model`` (same initial weights)."""
    makers: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True),
        "ivon": lambda ps: ivon.IVON(ps, lr=1e-3, ess=DATA_SIZE),
        **RULES,
    }
    for rule in RULES:  # the same rules with compile=True
        makers[f"{rule} (compiled)"] = functools.partial(RULES[rule], compile=True)
    makers["generic affine"] = _generic_affine
    makers["generic affine (compiled)"] = lambda ps: _generic_affine(ps, compile=True)
    out = {}
    for name, make in makers.items():
        twin = copy.deepcopy(model)
        out[name] = (twin, make(list(twin.parameters())))
    return out


def _set_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _full_step(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor):
    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    if isinstance(opt, lgb.optim.BLROptimizer):
        return lambda: opt.step(closure)
    if isinstance(opt, ivon.IVON):

        def ivon_step() -> None:
            with opt.sampled_params(train=True):
                closure()
            opt.step()

        return ivon_step
    return lambda: (closure(), opt.step())


def _arithmetic(opt: torch.optim.Optimizer) -> Callable[[], float]:
    """Seconds of the update alone: torch.optim's ``step`` on fixed gradients (IVON: after a
    sampled block that leaves them); for the Lie-group rules, accumulating one sample's algebra
    gradient and the update, as ``step(closure)`` does them (the sample deferred into the
    update; the draw that precedes them is excluded from the timing)."""
    if isinstance(opt, ivon.IVON):

        def ivon_step() -> float:
            with opt.sampled_params(train=True):
                pass
            start = time.perf_counter()
            opt.step()
            return time.perf_counter() - start

        return ivon_step
    if not isinstance(opt, lgb.optim.BLROptimizer):

        def torch_step() -> float:
            start = time.perf_counter()
            opt.step()
            return time.perf_counter() - start

        return torch_step

    def ours() -> float:
        sample = opt.draw(train=True)
        start = time.perf_counter()
        opt.accumulate(sample, defer=True)
        opt.step()
        return time.perf_counter() - start

    return ours


def _noise_draw(rule: str, params: list[Tensor]) -> Callable[[], None]:
    """The rule's noise for every parameter with torch's fastest sampler for it."""
    if rule in ("additive", "affine"):  # Gaussian: normal_ per parameter
        bufs = [torch.empty_like(p) for p in params]

        def gaussian() -> None:
            for b in bufs:
                b.normal_()

        return gaussian
    bufs = [torch.empty((2, *p.shape)) for p in params]  # Rayleigh for g⁺ and g⁻

    def inverse_cdf() -> None:
        for b in bufs:
            b.uniform_().neg_().log1p_().mul_(-2.0).sqrt_()

    def exponential() -> None:
        for b in bufs:
            b.exponential_().mul_(2.0).sqrt_()

    candidates = {"inverse_cdf": inverse_cdf, "exponential": exponential}
    fastest = min(candidates.values(), key=lambda f: mean_time(f, 3))
    return fastest


def _floors(params: list[Tensor]) -> dict[str, Callable[[], None]]:
    """The multiplicative rule's compiled update kernel alone (one sample, without the
    engine around it: gathering, the check, the swaps), and ``torch.exp2`` over its 2P
    values."""
    noise, momenta, elements, accs, spares = (
        rows([torch.rand(2, *p.shape) for p in params], True) for _ in range(5)
    )
    grads, outs = [torch.randn_like(p) for p in params], [torch.empty_like(p) for p in params]
    kernel = compiled(multiplicative_update)
    offset = -0.006 / DATA_SIZE

    hp = dict(n=1, beta=0.9, lr=torch.tensor(1e-3), mean=None)

    def kernel_only() -> None:
        kernel(accs, momenta, elements, spares, outs, (noise, grads), offset, [], **hp)

    def exp2_only() -> None:
        for m, out in zip(momenta, accs, strict=True):
            for part, into in zip(m, out, strict=True):
                torch.exp2(part, out=into)

    return {"multiplicative_update kernel": kernel_only, "exp2 over 2P": exp2_only}


def run(model_name: str, rounds: int, steps: int) -> None:
    model, x, y = _model(model_name)
    opts = _optimizers(model)
    params: list[Tensor] = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    full = {name: _full_step(opt, twin, x, y) for name, (twin, opt) in opts.items()}
    arithmetic = {name: _arithmetic(opt) for name, (_, opt) in opts.items()}
    draws = {rule: _noise_draw(rule, params) for rule in ("additive", "multiplicative")}
    draws["affine"] = draws["additive"]
    floors = _floors(params)

    times: dict[str, list[float]] = {}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for name, (twin, _) in opts.items():
            times.setdefault(f"full:{name}", []).append(mean_time(full[name], steps))
            _set_grads(twin)
            times.setdefault(f"arith:{name}", []).append(
                statistics.fmean(arithmetic[name]() for _ in range(steps))
            )
        for rule, draw in draws.items():
            times.setdefault(f"draw:{rule}", []).append(mean_time(draw, steps))
        for name, floor in floors.items():
            times.setdefault(f"floor:{name}", []).append(mean_time(floor, steps))
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}

    print(f"\n== {model_name}: {n_params:,} parameters, batch {BATCH}, mc 1 ==")
    print(
        f"{'optimizer':<26}{'full ms':>9}{'÷ SGD':>8}{'L ms':>8}{'÷ L':>7}{'arith ms':>10}"
        f"{'÷ Adam':>8}"
    )
    sgd, adam = med["full:sgd"], med["arith:adam"]
    for name in opts:
        f, a = med[f"full:{name}"], med[f"arith:{name}"]
        rule = name.removesuffix(" (compiled)").removeprefix("generic ")
        if rule in draws:
            noise_floor = sgd + med[f"draw:{rule}"]
            extra = f"{noise_floor:>8.2f}{f / noise_floor:>7.2f}"
        else:
            extra = f"{'':>8}{'':>7}"
        print(f"{name:<26}{f:>9.2f}{f / sgd:>8.2f}{extra}{a:>10.2f}{a / adam:>8.2f}")
    for name in floors:
        ratio = med[f"floor:{name}"] / adam
        print(f"floor, {name}: {med[f'floor:{name}']:.2f} ms, {ratio:.2f} × Adam's step")
    for mode in ("", " (compiled)"):
        ratio = med[f"full:generic affine{mode}"] / med[f"full:affine{mode}"]
        print(f"generic ÷ specialised affine rule{mode}, full step: {ratio:.2f}")
    print(
        "targets: arith ÷ Adam ≤ 2.0 eager, ≤ 1.6 compiled; full ÷ L ≤ 1.15 "
        "(L = SGD step + the rule's noise draw)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.step_time", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--steps", type=int, default=10, help="calls per round")
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "digits"], choices=["mlp", "cnn", "digits"]
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models:
        run(name, args.rounds, args.steps)


if __name__ == "__main__":
    main()
