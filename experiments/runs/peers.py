"""The peers a practitioner would pick: post-hoc Laplace (laplace-torch) on trained networks,
and mean-field VI (posteriors), beside the like-for-like runs.

    python -m experiments.runs.peers CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]

Needs the peers' environment (the command in experiments/requirements-peers.txt). CONFIG is a
comparison config (experiments/runs/compare.py) whose ``[runs]`` are trained first, exactly as
``experiments.runs.compare`` trains them, into ``DIR/networks`` (its report, learning curves and
run folders); the optimizer ``vi`` is posteriors' mean-field VI (experiments/common/meanfield.py).
A ``[laplace]`` table then fits laplace-torch's ``Laplace`` post hoc on each of its
``networks`` (run labels) for every seed, once per ``[laplace.fits.NAME]`` table
(``subset_of_weights``, ``hessian_structure``, optional curvature ``backend``), on the whole
training set, with the prior precision that maximises the marginal likelihood
(``optimize_prior_precision(method="marglik")``, one scalar), and predicts with the GLM
predictive and ``link_approx`` (``"probit"``: laplace-torch's default; ``"mc"``: ``[eval]
samples`` samples of the linearised network). ``batch_size`` inputs go into each
laplace-torch call: the all-weights Jacobians of the GLM predictive take batch × classes ×
parameters floats. Each fit writes ``DIR/laplace/NETWORK.NAME/seedS/results.json``:
metrics at the network's point estimate and of the Laplace predictive, out-of-distribution
AUROC, the prior precision chosen and the fit's wall time. ``DIR/report.md`` holds every row
as mean ± sd over the seeds and per seed, ``DIR/results.json`` all numbers,
``DIR/config.json`` the resolved configs. ``--resume`` continues the trainings from their
checkpoints and keeps every finished fit.
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.runs.peers"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import copy
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from experiments.common import config as config_module
from experiments.common import ood, runfiles, skeleton
from experiments.common.data import test_batches
from experiments.common.distributed import Processes
from experiments.common.tables import LEFT, RIGHT, markdown
from experiments.common.training import CHECKPOINT, RESULTS, Run, build, load_checkpoint
from experiments.runs import compare
from liegroup_blr import predictive

LAPLACE: dict[str, Any] = {
    "networks": config_module.Required(list),
    "link_approx": "probit",
    "batch_size": 50,
    "fits": config_module.Required(dict),
}
FIT: dict[str, Any] = {
    "subset_of_weights": config_module.NAME,
    "hessian_structure": config_module.NAME,
    "backend": config_module.Unset(str),  # None: laplace-torch's default (CurvlinopsGGN)
}
SUBSETS, HESSIANS = ("last_layer", "all"), ("kron", "diag", "full")
LINKS = ("probit", "bridge", "mc")
PEERS = {"laplace": "laplace-torch", "posteriors": "posteriors"}


def resolve(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """(label → seed → resolved run config, the resolved ``[laplace]`` table)."""
    configs, tables = config_module.driver_configs(raw, [TABLE], seeds)
    return configs, tables["laplace"]


def _check_laplace(laplace: dict[str, Any], configs: dict[str, Any]) -> None:
    """Fits name known subsets, structures and backends (each fit's table completed with
    its defaults); networks name runs."""
    laplace["fits"] = {
        name: config_module.fill(f"[laplace.fits.{name}]", fit, FIT)
        for name, fit in laplace["fits"].items()
    }
    unknown = sorted(set(laplace["networks"]) - set(configs))
    if unknown or not laplace["networks"]:
        raise config_module.ConfigError(
            f"[laplace].networks must name runs of [runs], got {laplace['networks']}; "
            f"valid: {sorted(configs)}"
        )
    if not laplace["fits"]:
        raise config_module.ConfigError("[laplace.fits] needs at least one [laplace.fits.NAME]")
    if laplace["link_approx"] not in LINKS:
        raise config_module.ConfigError(
            f"unknown [laplace].link_approx {laplace['link_approx']!r}; valid: {list(LINKS)}"
        )
    if laplace["batch_size"] < 1:
        raise config_module.ConfigError(
            f"[laplace].batch_size must be >= 1, got {laplace['batch_size']}"
        )
    for name, fit in laplace["fits"].items():
        if not config_module.LABEL.fullmatch(name):
            raise config_module.ConfigError(f"fit name {name!r} is not a plain folder name")
        for key, valid in (("subset_of_weights", SUBSETS), ("hessian_structure", HESSIANS)):
            if fit[key] not in valid:
                raise config_module.ConfigError(
                    f"unknown [laplace.fits.{name}].{key} {fit[key]!r}; valid: {list(valid)}"
                )


TABLE = config_module.Table("laplace", LAPLACE, _check_laplace, required=True)
"""The driver's own ``[laplace]`` table."""


def require_peers(configs: dict[str, dict[int, dict[str, Any]]], laplace: dict[str, Any]) -> None:
    """The peers' libraries must import here (laplace-torch, and posteriors for a ``vi`` run)
    and know the fits' curvature backends."""
    names = ["laplace"]
    if any(c["optimizer"]["name"] == "vi" for by in configs.values() for c in by.values()):
        names.append("posteriors")
    missing = [PEERS[n] for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise runfiles.RunError(
            f"experiments.runs.peers needs {', '.join(missing)}: make the peers' environment with "
            "the command in experiments/requirements-peers.txt and run it there"
        )
    from laplace import curvature

    for name, fit in laplace["fits"].items():
        if fit["backend"] is not None and not hasattr(curvature, fit["backend"]):
            raise config_module.ConfigError(
                f"unknown [laplace.fits.{name}].backend {fit['backend']!r}; valid: a class of "
                f"laplace.curvature, such as {sorted(curvature.__all__)}"
            )


# ---------------------------------------------------------------------- Laplace
def trained_network(cfg: dict[str, Any], folder: Path) -> Run:
    """The run of ``cfg`` as its training left it in ``folder`` (data, model at g)."""
    run = build(copy.deepcopy(cfg), Processes())
    load_checkpoint(run, folder / CHECKPOINT)
    return run


def fit_laplace(run: Run, fit: dict[str, Any], batch_size: int) -> tuple[Any, float]:
    """laplace-torch's ``Laplace`` of ``fit`` on the run's training set, its prior precision
    maximising the marginal likelihood; returns it and the seconds taken."""
    from laplace import Laplace, curvature

    data = run.data
    train = TensorDataset(data.normalize(data.to_unit(data.train_x)), data.train_y)
    backend = None if fit["backend"] is None else getattr(curvature, fit["backend"])
    tic = time.perf_counter()
    la = Laplace(
        run.model,
        "classification",
        subset_of_weights=fit["subset_of_weights"],
        hessian_structure=fit["hessian_structure"],
        backend=backend,
    )
    la.fit(DataLoader(train, batch_size=batch_size), progress_bar=True)
    la.optimize_prior_precision(method="marglik", pred_type="glm")
    return la, time.perf_counter() - tic


def laplace_log_probs(
    la: Any, inputs: Sequence[Tensor], laplace: dict[str, Any], samples: int
) -> Tensor:
    """Log of laplace-torch's GLM predictive on every batch of ``inputs``, ``batch_size``
    inputs per call; probabilities that underflow to 0 count as the smallest float."""
    chunks = [c for x in inputs for c in x.split(laplace["batch_size"])]
    probs = torch.cat(
        [
            la(c, pred_type="glm", link_approx=laplace["link_approx"], n_samples=samples)
            for c in chunks
        ]
    ).detach()
    return probs.clamp_min(torch.finfo(probs.dtype).tiny).log()


def entropy_aurocs(
    test: Tensor, predict: Callable[[Sequence[Tensor]], Tensor], inputs: list[Tensor]
) -> dict[str, float]:
    """AUROC of the predictive entropy: the log probabilities ``test`` of ``inputs`` against
    ``predict``'s of each shift of :func:`experiments.common.ood.shifted_inputs` (the shifts of the
    drivers' evaluation)."""
    negatives = ood.entropy(test)
    shifted = ood.shifted_inputs(inputs)
    return {name: ood.auroc(negatives, ood.entropy(predict(x))) for name, x in shifted.items()}


def laplace_results(
    cfg: dict[str, Any],
    network: dict[str, Any],
    fit: dict[str, Any],
    laplace: dict[str, Any],
    folder: Path,
) -> dict[str, Any]:
    """Fit one Laplace on the trained network in ``folder`` and evaluate it on the test set:
    ``point`` is the network's own (``network``, its results), ``average`` the predictive's."""
    run = trained_network(cfg, folder)
    la, fit_seconds = fit_laplace(run, fit, laplace["batch_size"])
    test = test_batches(run.data, cfg["data"]["test_batch_size"], run.device)
    inputs, labels = [x for x, _ in test], torch.cat([y for _, y in test])
    samples = cfg["eval"]["samples"]
    tic = time.perf_counter()
    log_probs = laplace_log_probs(la, inputs, laplace, samples)
    aurocs = entropy_aurocs(log_probs, lambda x: laplace_log_probs(la, x, laplace, samples), inputs)
    return {
        "point": network["point"],
        "average": predictive.metrics(log_probs, labels, cfg["eval"]["bins"]),
        "ood": {k: {"point": network["ood"][k]["point"], "average": v} for k, v in aurocs.items()},
        "prior_precision": float(la.prior_precision),
        "fit_seconds": fit_seconds,
        "predict_seconds": time.perf_counter() - tic,
        "test_size": len(labels),
    }


# ---------------------------------------------------------------------- command
def peers(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Train the runs into ``out/networks``, fit every Laplace on every network and seed,
    write the report. Returns row → ``{"seeds", "summary", "per_seed"}``."""
    out = Path(out)
    configs, laplace = resolve(raw, seeds)
    require_peers(configs, laplace)
    with runfiles.locked(out):
        skeleton.prepare_folder(out, skeleton.written(configs), resume, {"laplace": laplace})
        runs = {k: v for k, v in raw.items() if k != "laplace"}
        results = compare.compare(runs, out / "networks", resume, seeds)
        for label in laplace["networks"]:
            for name in laplace["fits"]:
                per_seed = {
                    str(seed): _laplace_seed(out, label, name, cfg, results[label], laplace)
                    for seed, cfg in configs[label].items()
                }
                results[f"{label}.{name}"] = {
                    "seeds": list(configs[label]),
                    "summary": compare.summarise(list(per_seed.values())),
                    "per_seed": per_seed,
                }
        skeleton.write_report(out, results, report(configs, laplace, results))
    return results


def _laplace_seed(
    out: Path,
    label: str,
    name: str,
    cfg: dict[str, Any],
    network: dict[str, Any],
    laplace: dict[str, Any],
) -> dict[str, Any]:
    """Fit ``name`` on the network ``label`` of ``cfg``'s seed, or read the finished fit."""
    seed = cfg["seed"]
    path = out / "laplace" / f"{label}.{name}" / f"seed{seed}" / RESULTS
    if path.exists():
        return runfiles.read_json(path)
    print(f"== Laplace {name!r} on run {label!r}, seed {seed}", flush=True)
    folder = out / "networks" / label / f"seed{seed}"
    fit = laplace["fits"][name]
    results = laplace_results(cfg, network["per_seed"][str(seed)], fit, laplace, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    runfiles.write_json(path, results)
    return results


# ----------------------------------------------------------------------- report
COLUMNS = (
    compare.TABLES["Predictive metrics"]
    + compare.TABLES["Out-of-distribution detection (AUROC of the predictive entropy)"]
)
HEAD = ["run", "estimate"] + [h for h, _, _, _ in COLUMNS]


def rows(
    configs: dict[str, dict[int, dict[str, Any]]], laplace: dict[str, Any], results: dict[str, Any]
) -> list[tuple[str, str, str, str]]:
    """(result label, estimate, run name, estimate name) of the report's rows: each run at
    its point estimate (the mean for ``vi``) and, with a posterior, its model average; each
    Laplace fit's predictive."""
    table = []
    for label, by_seed in configs.items():
        cfg = next(iter(by_seed.values()))
        vi = cfg["optimizer"]["name"] == "vi"
        table.append((label, "point", label, "at the mean" if vi else "at g"))
        if results[label]["summary"]["has_posterior"]:
            table.append((label, "average", label, f"average of {cfg['eval']['samples']}"))
    link = laplace["link_approx"]
    samples = next(iter(next(iter(configs.values())).values()))["eval"]["samples"]
    predictive_name = f"Laplace, GLM {link}" + (f" ({samples} samples)" if link == "mc" else "")
    for network in laplace["networks"]:
        for name, fit in laplace["fits"].items():
            subset = "last layer" if fit["subset_of_weights"] == "last_layer" else "all weights"
            run = f"{network} + {subset}, {fit['hessian_structure']}"
            table.append((f"{network}.{name}", "average", run, predictive_name))
    return table


def report(
    configs: dict[str, dict[int, dict[str, Any]]], laplace: dict[str, Any], results: dict[str, Any]
) -> str:
    """The Markdown report: every row as mean ± sd over the seeds, the fits, the runs, then
    every row per seed."""
    first = next(iter(next(iter(configs.values())).values()))
    table = rows(configs, laplace, results)
    lines = [
        "# Peers: post-hoc Laplace and mean-field VI",
        "",
        _setting(first, next(iter(results.values()))),
        "",
    ]
    means, per_seed = [], []
    for label, est, run, name in table:
        res = results[label]["summary"]
        means.append([run, name, *(compare.cell(get(res, est), f, d) for _, get, f, d in COLUMNS)])
        for seed, one in results[label]["per_seed"].items():
            cells = [f"{f * get(one, est):.{d}f}" for _, get, f, d in COLUMNS]
            per_seed.append([run, name, str(seed), *cells])
    lines += markdown(HEAD, means, [LEFT] * 2 + [RIGHT] * (len(HEAD) - 2))
    lines += ["", *_fits(table, laplace, results), "", *_runs(configs, results), ""]
    lines += ["## Per-seed values", ""]
    lines += markdown(
        [*HEAD[:2], "seed", *HEAD[2:]], per_seed, [LEFT] * 3 + [RIGHT] * (len(HEAD) - 2)
    )
    lines += ["", "Training curves and per-run figures: [networks/report.md](networks/report.md)."]
    return "\n".join(lines)


def _setting(cfg: dict[str, Any], res: dict[str, Any]) -> str:
    """The paragraph that says what every row shares."""
    s, seeds = res["summary"], res["seeds"]
    model = ", ".join(f"{k}={v}" for k, v in cfg["model"].items() if k != "name")
    return (
        f"Dataset `{cfg['data']['name']}` ({s['train_size']['mean']:g} train / "
        f"{s['test_size']['mean']:g} {s['eval_set']}), model `{cfg['model']['name']}` ({model}), "
        f"{cfg['schedule']['epochs']} passes at batch {cfg['data']['batch_size']}; "
        f"{len(seeds)} seed(s) {seeds}. Cells are mean ± sample standard deviation over the "
        "seeds; the per-seed values follow below. Each Laplace is fitted post hoc on the "
        "network of the run it names (its point estimate is that run's row), on the whole "
        "training set, with the prior precision of the largest marginal likelihood. ECE uses "
        f"{cfg['eval']['bins']} bins; out-of-distribution AUROC of the predictive entropy "
        "against the test inputs rotated by 90°, pixel-permuted, and uniform noise."
    )


def _fits(
    table: list[tuple[str, str, str, str]], laplace: dict[str, Any], results: dict[str, Any]
) -> list[str]:
    """The Laplace fits (the rows whose label is ``NETWORK.FIT``): backend, prior precision
    chosen, wall times."""
    fits = {
        f"{n}.{name}": fit for n in laplace["networks"] for name, fit in laplace["fits"].items()
    }
    rows = []
    for label, _, run, _ in table:
        if label not in fits:
            continue
        s, fit = results[label]["summary"], fits[label]
        times = [compare.cell(s[k], 1.0, 1) for k in ("fit_seconds", "predict_seconds")]
        backend = fit["backend"] or "laplace-torch default"
        rows.append([run, backend, compare.cell(s["prior_precision"], 1.0, 2), *times])
    head = ["fit", "backend", "prior precision (marginal likelihood)", "fit (s)"]
    head += ["predictive on the test and shifted inputs (s)"]
    return ["## Laplace fits", "", *markdown(head, rows, [LEFT] * 2 + [RIGHT] * 3)]


def _runs(configs: dict[str, dict[int, dict[str, Any]]], results: dict[str, Any]) -> list[str]:
    """The trained runs: hyperparameters, passes, wall time, step time."""
    rows = []
    for label, by_seed in configs.items():
        opt = next(iter(by_seed.values()))["optimizer"]
        hyper = ", ".join(f"{k}={v}" for k, v in opt.items() if k != "name" and v != {})
        s = results[label]["summary"]
        times = [compare.cell(s["train_seconds"], 1.0, 1)]
        times.append(compare.cell(compare.step_ms(results[label]), 1.0, 1))
        rows.append([label, opt["name"], hyper, f"{s['epochs']['mean']:g}", *times])
    head = ["run", "optimizer", "hyperparameters", "passes", "train (s)"]
    head += ["ms per step (fastest pass)"]
    return ["## Runs", "", *markdown(head, rows, [LEFT] * 3 + [RIGHT] * 3)]


def _show(results: dict[str, Any], out: Path) -> None:
    print((out / "report.md").read_text())
    print(f"report in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, peers, _show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
