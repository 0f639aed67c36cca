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
  :class:`~liegroup_blr.AffineBLR` (also on the 64-16-10 MLP of the 8×8 digits);
* the affine rule with a Student-t base (``student-t``, 3 degrees of freedom) against its
  Gaussian base, with fresh draws and with windows of the noise table (``noise="table"``);
* the compiled updates' achieved memory bandwidth (bytes the update must read and write:
  its state twice, the parameters twice and the gradients once) against the card's peak.

Run: ``python -m experiments.benchmarks.step_time [--rounds 7] [--steps 10] [--quick]
[--eager] [--device cuda]``. A line after every round gives the time elapsed and the time left.
Numbers are medians over rounds of the mean time per call; ratios come from one run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.common import cli

DURATIONS = (
    "Duration on the project's 2-core CPU machine, one thread, under load: 24 min in full "
    "(most of it compiling), 17 s with --quick."
)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.step_time",
        description=__doc__.split("\n\n")[0],
        epilog=DURATIONS,
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--steps", type=int, default=10, help="calls per round")
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "digits"], choices=["mlp", "cnn", "digits"]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: --rounds 1 --steps 2 --models digits, one thread, nothing compiled",
    )
    parser.add_argument(
        "--eager", action="store_true", help="time no compiled optimizer (no compiling wait)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser


if __name__ == "__main__" and cli.asks_help():  # before the imports of torch: --help is quick
    _parser().parse_args()

import copy
import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import ivon
import torch
from torch import Tensor, nn

import liegroup_blr as lgb
from experiments.common import loop
from experiments.common.models import CNN, MLP
from experiments.common.optimizers import IVON
from experiments.common.progress import Planned, Progress
from liegroup_blr.optim.kernel_utils import compiled, rows
from liegroup_blr.optim.multiplicative import multiplicative_update

BATCH = 50
DATA_SIZE = 60_000
RULES: dict[str, Callable[..., lgb.optim.BLROptimizer]] = {
    "additive": lambda ps, **kw: lgb.AdditiveBLR(ps, lr=1e-3, **kw),
    "multiplicative": lambda ps, **kw: lgb.MultiplicativeBLR(
        ps, lr=1e-3, data_size=DATA_SIZE, temperature=0.006, init="auto", **kw
    ),
    "affine": lambda ps, **kw: lgb.AffineBLR(ps, lr=1e-3, scale_lr=1e-5, data_size=DATA_SIZE, **kw),
}


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing on a CPU run)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def mean_time(fn: Callable[[], object], steps: int) -> float:
    """Mean seconds per call of ``fn`` over ``steps`` calls (a GPU's work included)."""
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize()
    return (time.perf_counter() - start) / steps


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn`` (a GPU's work included)."""
    return mean_time(fn, 1)


class Countdown:
    """Prints ``[PROG] WHAT: E elapsed, about L left`` after each piece of work of a plan of
    ``totals`` units per kind of work: the drivers' time left
    (:class:`experiments.common.progress.Progress`), each kind of work a run of its units at its own
    seconds per unit (a kind not begun: all the work's)."""

    def __init__(
        self, prog: str, totals: dict[str, float], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.prog = prog
        plan = {(kind, 0): Planned(kind, total) for kind, total in totals.items()}  # type: ignore[arg-type]
        self.progress = Progress(plan, clock)
        for key in plan:  # every kind starts now, at 0 units done
            self.progress.epoch(key, 0)

    def tick(self, what: str, units: float = 1.0, kind: str = "") -> str:
        """``units`` more of ``kind`` are done (the last: ``what``); prints and returns the
        line."""
        key = (kind, 0)
        self.progress.epoch(key, self.progress.plan[key].done + units)  # type: ignore[arg-type]
        line = f"[{self.prog}] {what}: {self.progress.times()}"
        print(line, flush=True)
        return line


def _generic_affine(ps: list[Tensor], **kw: Any) -> torch.optim.Optimizer:
    """The affine rule through the generic autodiff rule: like-for-like with ``affine`` at
    α₁ = α₂ (per-component factors give the scale its own step)."""
    group, base = lgb.groups.DiagonalAffineGroup(), torch.distributions.Normal(0.0, 0.005)
    factors = {"scale": 1e-2, "shift": 1.0}
    return lgb.LieGroupBLR(
        ps, group, base, lr=1e-3, data_size=DATA_SIZE, preconditioner=factors, **kw
    )


TABLE = " (table)"
"""The suffix of the rows whose noise is served by the noise table."""


def _student_t_affine(ps: list[Tensor], **kw: Any) -> torch.optim.Optimizer:
    """The affine rule with a Student-t base of the Gaussian's scale (3 degrees of freedom)."""
    return RULES["affine"](ps, base=lgb.distributions.from_name("student-t", 0.005), **kw)


def _model(name: str, device: str = "cpu") -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model: nn.Module
    if name == "mlp":
        model, shape = MLP((1, 28, 28), 10), (1, 28, 28)
    elif name == "digits":  # the 64-16-10 MLP of the 8×8 digits
        model, shape = MLP((1, 8, 8), 10, widths=(16,)), (1, 8, 8)
    else:
        model, shape = CNN((3, 32, 32), 10, width=1), (3, 32, 32)
    x, y = torch.randn(BATCH, *shape), torch.randint(0, 10, (BATCH,))
    return model.to(device), x.to(device), y.to(device)


def _optimizers(
    model: nn.Module, compile: bool = True
) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    """Each optimizer on its own copy of ``model`` (same initial weights); the Lie-group
    rules also with ``compile=True`` unless ``compile`` is false."""
    makers: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True),
        "ivon": lambda ps: IVON(ps, lr=1e-3, ess=DATA_SIZE),
        **RULES,
        "affine student-t": _student_t_affine,
        f"affine{TABLE}": functools.partial(RULES["affine"], noise="table"),
        f"affine student-t{TABLE}": functools.partial(_student_t_affine, noise="table"),
        "generic affine": _generic_affine,
    }
    if compile:
        eager = [n for n in makers if n not in ("sgd", "adam", "ivon") and TABLE not in n]
        for name in eager:
            makers[f"{name} (compiled)"] = functools.partial(makers[name], compile=True)
    out = {}
    for name, make in makers.items():
        twin = copy.deepcopy(model)
        out[name] = (twin, make(list(twin.parameters())))
    return out


def _set_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _full_step(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor):
    """One training step as the drivers take it: ``step`` on the loss's closure, which every
    optimizer takes alike (IVON evaluates it at its posterior sample)."""
    closure = loop.closure(opt, model, x, y)
    return lambda: opt.step(closure)


def _arithmetic(opt: torch.optim.Optimizer) -> Callable[[], float]:
    """Seconds of the update alone: torch.optim's ``step`` on fixed gradients (IVON: after a
    sampled block that leaves them); for the Lie-group rules, accumulating one sample's algebra
    gradient and the update, as ``step(closure)`` does them (the sample deferred into the
    update; the draw that precedes them is excluded from the timing)."""
    if isinstance(opt, ivon.IVON):

        def ivon_step() -> float:
            with opt.sampled_params(train=True):
                pass
            return timed(opt.step)

        return ivon_step
    if not isinstance(opt, lgb.optim.BLROptimizer):
        return lambda: timed(opt.step)

    def ours() -> float:
        sample = opt.draw(train=True)
        return timed(lambda: (opt.accumulate(sample, defer=True), opt.step()))

    return ours


def _noise_draw(rule: str, params: list[Tensor]) -> Callable[[], None]:
    """The rule's noise for every parameter with torch's fastest sampler for it."""
    if rule in ("additive", "affine"):  # Gaussian: normal_ per parameter
        bufs = [torch.empty_like(p) for p in params]

        def gaussian() -> None:
            for b in bufs:
                b.normal_()

        return gaussian
    if rule == "affine student-t":  # the library's exact sampler (a normal over a χ²'s root)
        t = lgb.distributions.from_name("student-t", 0.005)
        outs = [torch.empty_like(p) for p in params]

        def student_t() -> None:
            lgb.distributions.sample_each(t, outs)

        return student_t
    bufs = [torch.empty((2, *p.shape), device=p.device) for p in params]  # Rayleigh: g⁺, g⁻

    def inverse_cdf() -> None:
        for b in bufs:
            b.uniform_().neg_().log1p_().mul_(-2.0).sqrt_()

    def exponential() -> None:
        for b in bufs:
            b.exponential_().mul_(2.0).sqrt_()

    candidates = {"inverse_cdf": inverse_cdf, "exponential": exponential}
    fastest = min(candidates.values(), key=lambda f: mean_time(f, 3))
    return fastest


def _floors(params: list[Tensor], compile: bool = True) -> dict[str, Callable[[], None]]:
    """The multiplicative rule's compiled update kernel alone (one sample, without the
    engine around it: gathering, the check, the swaps; left out unless ``compile``), and
    ``torch.exp2`` over its 2P values."""
    noise, momenta, elements, accs, spares = (
        rows([torch.rand(2, *p.shape, device=p.device) for p in params], True) for _ in range(5)
    )
    grads, outs = [torch.randn_like(p) for p in params], [torch.empty_like(p) for p in params]
    kernel = compiled(multiplicative_update)
    offset = -0.006 / DATA_SIZE

    hp = dict(n=1, beta=0.9, lr=torch.tensor(1e-3, device=params[0].device), mean=None)

    def kernel_only() -> None:
        kernel(accs, momenta, elements, spares, outs, (noise, grads), offset, [], **hp)

    def exp2_only() -> None:
        for m, out in zip(momenta, accs, strict=True):
            for part, into in zip(m, out, strict=True):
                torch.exp2(part, out=into)

    floors = {"multiplicative_update kernel": kernel_only, "exp2 over 2P": exp2_only}
    return floors if compile else {"exp2 over 2P": exp2_only}


def _update_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes an update must move at least: its state read and written, the parameters read
    and written, the gradients read."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = sum(
        t.numel() * t.element_size()
        for p in params
        for t in opt.state[p].values()
        if isinstance(t, Tensor)
    )
    weights = sum(p.numel() * p.element_size() for p in params)
    return 2 * state + 3 * weights


def peak_bandwidth(device: str) -> dict[str, float]:
    """The card's memory bandwidth in GB/s: ``spec`` from its clock and bus width where torch
    reports them, ``copy`` as a 1 GiB device-to-device copy achieves it (bytes read and
    written); nothing on a CPU."""
    if device != "cuda":
        return {}
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = (getattr(props, k, 0) for k in ("memory_clock_rate", "memory_bus_width"))
    src = torch.empty(2**28, device=device)
    dst = torch.empty_like(src)
    seconds = mean_time(lambda: dst.copy_(src), 10)
    peak = {"copy": 2 * src.numel() * src.element_size() / seconds / 1e9}
    return peak | ({"spec": 2 * clock_khz * bus_bits / 8 / 1e6} if clock_khz and bus_bits else {})


@dataclasses.dataclass
class Settings:
    """``rounds`` timed after a warm-up round, ``steps`` calls per round, the ``device``,
    whether the ``compile=True`` optimizers are timed too, the ``countdown`` to tell, and
    whether this is a ``smoke`` run (``--quick``: its ratios mean nothing)."""

    rounds: int
    steps: int
    device: str
    compile: bool
    countdown: Countdown
    smoke: bool = False


def _measure(model_name: str, s: Settings) -> tuple[dict[str, float], dict[str, int], int]:
    """Median milliseconds of every timing ("full:NAME", "arith:NAME", "draw:RULE",
    "floor:NAME"), each optimizer's update bytes, and the model's parameter count."""
    model, x, y = _model(model_name, s.device)
    opts = _optimizers(model, s.compile)
    params: list[Tensor] = list(model.parameters())
    full = {name: _full_step(opt, twin, x, y) for name, (twin, opt) in opts.items()}
    arithmetic = {name: _arithmetic(opt) for name, (_, opt) in opts.items()}
    draws = {rule: _noise_draw(rule, params) for rule in DRAWS}
    floors = _floors(params, s.compile)

    times: dict[str, list[float]] = {}
    for r in range(s.rounds + 1):  # the first round warms up and is dropped
        for name, (twin, _) in opts.items():
            times.setdefault(f"full:{name}", []).append(mean_time(full[name], s.steps))
            _set_grads(twin)
            times.setdefault(f"arith:{name}", []).append(
                statistics.fmean(arithmetic[name]() for _ in range(s.steps))
            )
        for rule, draw in draws.items():
            times.setdefault(f"draw:{rule}", []).append(mean_time(draw, s.steps))
        for name, floor in floors.items():
            times.setdefault(f"floor:{name}", []).append(mean_time(floor, s.steps))
        what = f"{model_name} round {r + 1}/{s.rounds + 1}" + (" (warm-up)" if r == 0 else "")
        s.countdown.tick(what, kind="round" if r else "warm-up")
    med = {k: statistics.median(v[1:] or v) * 1e3 for k, v in times.items()}
    nbytes = {name: _update_bytes(opt) for name, (_, opt) in opts.items()}
    return med, nbytes, sum(p.numel() for p in params)


DRAWS = ("additive", "multiplicative", "affine student-t")
"""The rules whose noise floor is drawn; the affine rule's is the additive's (Gaussian)."""


def _draw_of(name: str) -> str | None:
    """The key of ``DRAWS`` whose draw is optimizer ``name``'s noise floor, if any."""
    rule = name.removesuffix(" (compiled)").removeprefix("generic ")
    rule = "additive" if rule == "affine" else rule
    return rule if rule in DRAWS else None  # the table's rows draw no noise: no floor


def _report(med: dict[str, float], nbytes: dict[str, int], device: str) -> dict[str, float]:
    """Print the table and the summary lines of one model; returns the ratios printed."""
    print(
        f"{'optimizer':<28}{'full ms':>9}{'÷ SGD':>8}{'÷ Adam':>8}{'L ms':>8}{'÷ L':>7}"
        f"{'arith ms':>10}{'÷ Adam':>8}"
    )
    sgd, adam_full, adam = med["full:sgd"], med["full:adam"], med["arith:adam"]
    ratios: dict[str, float] = {}
    for name in nbytes:
        f, a = med[f"full:{name}"], med[f"arith:{name}"]
        extra = f"{'':>8}{'':>7}"
        if (draw := _draw_of(name)) is not None:
            noise_floor = sgd + med[f"draw:{draw}"]
            extra = f"{noise_floor:>8.2f}{f / noise_floor:>7.2f}"
        ratios |= {f"full ÷ SGD:{name}": f / sgd, f"full ÷ Adam:{name}": f / adam_full}
        ratios[f"arith ÷ Adam:{name}"] = a / adam
        print(
            f"{name:<28}{f:>9.2f}{f / sgd:>8.2f}{f / adam_full:>8.2f}{extra}{a:>10.2f}"
            f"{a / adam:>8.2f}"
        )
    for name in (n for n in med if n.startswith("floor:")):
        ratio = med[name] / adam
        print(f"floor, {name[6:]}: {med[name]:.2f} ms, {ratio:.2f} × Adam's step")
    for mode in (m for m in ("", " (compiled)") if f"full:affine{m}" in med):
        ratio = med[f"full:generic affine{mode}"] / med[f"full:affine{mode}"]
        print(f"generic ÷ specialised affine rule{mode}, full step: {ratio:.2f}")
    for mode in (m for m in ("", " (compiled)", TABLE) if f"full:affine{m}" in med):
        ratios[f"student-t ÷ gaussian affine{mode}"] = t = (
            med[f"full:affine student-t{mode}"] / med[f"full:affine{mode}"]
        )
        print(f"student-t ÷ gaussian base, affine rule{mode}, full step: {t:.2f}")
    peak = peak_bandwidth(device)
    ratios |= {f"card GB/s:{kind}": gbs for kind, gbs in peak.items()}
    for name in (n for n in ALL_RULES_COMPILED if n in nbytes):
        gbs = ratios[f"GB/s:{name}"] = nbytes[name] / med[f"arith:{name}"] / 1e6
        shares = "".join(f", {gbs / v:.1%} of the card's {k} {v:.0f} GB/s" for k, v in peak.items())
        print(f"{name} update: {nbytes[name] / 1e6:.1f} MB moved, {gbs:.1f} GB/s{shares}")
    return ratios


TARGETS = (
    "targets: arith ÷ Adam ≤ 2.0 eager, ≤ 1.6 compiled; full ÷ L ≤ 1.15 "
    "(L = SGD step + the rule's noise draw)"
)
SMOKE = (
    "smoke run (--quick): sizes too small for the ratios to mean anything; the targets are "
    "checked only in a full run"
)


ALL_RULES_COMPILED = tuple(f"{rule} (compiled)" for rule in (*RULES, "affine student-t"))


def run(model_name: str, s: Settings) -> dict[str, Any]:
    """Measure and print one model; returns its milliseconds and ratios."""
    med, nbytes, n_params = _measure(model_name, s)
    print(f"\n== {model_name}: {n_params:,} parameters, batch {BATCH}, mc 1, {s.device} ==")
    ratios = _report(med, nbytes, s.device)
    print(SMOKE if s.smoke else TARGETS)
    return {"parameters": n_params, "ms": med, "update_bytes": nbytes, "ratios": ratios}


QUICK = {"rounds": 1, "steps": 2, "models": ["digits"]}
"""``--quick``: one timed round of two calls on the digits MLP, nothing compiled (a smoke
run)."""


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
        torch.set_num_threads(1)  # a loaded machine's spare threads spin, many times slower
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device; run on a GPU machine")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}")
    runs = {"warm-up": len(args.models), "round": len(args.models) * args.rounds}
    countdown = Countdown("step_time", runs)
    compile = not (args.quick or args.eager)
    s = Settings(args.rounds, args.steps, args.device, compile, countdown, args.quick)
    results = {name: run(name, s) for name in args.models}
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "models": results}, indent=1))


if __name__ == "__main__":
    main()
