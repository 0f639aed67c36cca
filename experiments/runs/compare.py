"""Train several runs on the same data for one or several seeds and write a report folder.

    python -m experiments.runs.compare CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]

CONFIG holds the shared tables and one ``[runs.LABEL]`` table per run (merged over the
shared ones). The seeds are the top-level ``seeds = [0, 1, 2]`` of CONFIG, or ``--seeds``
(which overrides it), else the single ``seed``. Each run and seed trains into
``DIR/LABEL/seedS``; ``DIR/report.md`` holds the mean ± standard deviation over seeds and the
per-seed values of every metric, ``DIR/results.json`` all numbers, ``DIR/config.json`` every
resolved run config, ``DIR/learning_curves.png`` the test curves (per run the mean over the
seeds and a band of ± one standard deviation) and
``DIR/weight_magnitudes.png`` the first-layer weight magnitudes of each run (first seed).

Every run is checked before the first one trains (an error names it: ``[runs.LABEL]: ...``);
after every epoch and run the command prints the runs done, the time elapsed and an estimate
of the time left. ``--resume`` continues the runs in DIR, counts the finished ones as done,
and takes changes to runs that have not finished (a started one starts again from scratch).
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.runs.compare"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import contextlib
import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from experiments.common import config as config_module
from experiments.common import distributed, figures, runfiles, skeleton
from experiments.common import training as train_module
from experiments.common.ood import SHIFTS
from experiments.common.skeleton import CHECKPOINT
from experiments.common.sparsity import NEAR_ZERO, init_scale
from experiments.common.tables import LEFT, RIGHT, markdown
from experiments.common.training import METRICS

# A report column: header, how to read the number from a run's results at an estimate
# ("point" or "average"), the factor it is shown with and its decimals.
Column = tuple[str, Callable[[dict[str, Any], str], Any], float, int]


def _metric(key: str) -> Callable[[dict[str, Any], str], Any]:
    return lambda res, est: res[est][key]


def _sparsity(key: str) -> Callable[[dict[str, Any], str], Any]:
    return lambda res, est: res["sparsity"][est][key]


def _ood(shift: str) -> Callable[[dict[str, Any], str], Any]:
    return lambda res, est: res["ood"][shift][est]


TABLES: dict[str, list[Column]] = {
    "Predictive metrics": [
        ("accuracy (%)", _metric("accuracy"), 100.0, 2),
        ("NLL", _metric("nll"), 1.0, 4),
        ("ECE", _metric("ece"), 1.0, 4),
        ("Brier", _metric("brier"), 1.0, 4),
    ],
    "First-layer sparsity": [
        ("max abs w", _sparsity("max_abs"), 1.0, 3),
        ("median abs w", _sparsity("median_abs"), 1.0, 4),
        ("near 0 (%)", _sparsity("near_zero"), 100.0, 2),
        ("below 1e-3·max (%)", _sparsity("near_zero_max"), 100.0, 2),
        ("Hoyer", _sparsity("hoyer"), 1.0, 3),
    ],
    "Out-of-distribution detection (AUROC of the predictive entropy)": [
        (shift, _ood(shift), 1.0, 3) for shift in SHIFTS
    ],
}


def summarise(values: Sequence[Any]) -> Any:
    """Mean, sample standard deviation (None for one value) and the values, leaf by leaf.

    ``values`` are per-seed results of the same structure: numbers become
    ``{"mean", "sd", "values"}``, dicts are summarised key by key, and anything else must
    be equal across seeds and is kept once.
    """
    first = values[0]
    if isinstance(first, dict):
        return {key: summarise([v[key] for v in values]) for key in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        numbers = [float(v) for v in values]
        sd = statistics.stdev(numbers) if len(numbers) > 1 else None
        return {"mean": statistics.fmean(numbers), "sd": sd, "values": numbers}
    if any(v != first for v in values[1:]):
        raise ValueError(f"per-seed values differ where they must agree: {values!r}")
    return first


def cell(leaf: dict[str, Any], factor: float, decimals: int) -> str:
    """A summarised number as ``mean ± sd`` (the mean alone for one seed)."""
    mean = f"{factor * leaf['mean']:.{decimals}f}"
    return mean if leaf["sd"] is None else f"{mean} ± {factor * leaf['sd']:.{decimals}f}"


ESTIMATES = ("point", "mean", "average")
"""The estimates a run's results hold: at g, at the posterior mean E[θ] (where it is another
point), the model average."""


def _estimate_label(estimate: str, res: dict[str, Any], samples: int) -> str:
    if estimate == "point":
        return "at g"
    if estimate == "mean":
        return "at the mean"
    return f"average of {samples}" if res["has_posterior"] else "average †"


def _has(summary: dict[str, Any], columns: list[Column], estimate: str) -> bool:
    """Whether the results hold ``estimate`` for every column (the mean only where it is
    another point than g, and not for the sparsity measures)."""
    try:
        for _, get, _, _ in columns:
            get(summary, estimate)
    except KeyError:
        return False
    return True


def _table(
    columns: list[Column],
    results: dict[str, dict[str, Any]],
    samples: dict[str, int],
    per_seed: bool = False,
) -> list[str]:
    """A Markdown table of ``columns``: mean ± sd per run and estimate, or one row per seed."""
    seed_col = ["seed"] if per_seed else []
    head = ["run", "estimate", *seed_col] + [h for h, _, _, _ in columns]
    rows = []
    for label, res in results.items():
        for est in ESTIMATES:
            if not _has(res["summary"], columns, est):
                continue
            name = _estimate_label(est, res["summary"], samples[label])
            if not per_seed:
                cells = [cell(get(res["summary"], est), f, d) for _, get, f, d in columns]
                rows.append([label, name, *cells])
                continue
            for seed, run in res["per_seed"].items():
                cells = [f"{f * get(run, est):.{d}f}" for _, get, f, d in columns]
                rows.append([label, name, str(seed), *cells])
    return markdown(head, rows, [LEFT] * 2 + [RIGHT] * (len(head) - 2))


def report(
    configs: dict[str, dict[int, dict[str, Any]]], results: dict[str, dict[str, Any]], out: Path
) -> str:
    """The Markdown report: every metric as mean ± sd over seeds, then per seed; run details.

    Figures are linked relative to the report folder ``out``.
    """
    first_cfgs = {label: next(iter(by_seed.values())) for label, by_seed in configs.items()}
    first = next(iter(first_cfgs.values()))
    summary = next(iter(results.values()))["summary"]
    seeds = next(iter(results.values()))["seeds"]
    data, model = first["data"], first["model"]
    model_desc = ", ".join(f"{k}={v}" for k, v in model.items() if k != "name")
    differ = [
        key
        for key in first
        if key not in ("optimizer", "seed")
        and any(c[key] != first[key] for c in first_cfgs.values())
    ]
    shared = f"runs differ in {differ}" if differ else "runs share data order and initialisation"
    samples = {label: cfg["eval"]["samples"] for label, cfg in first_cfgs.items()}
    lines = [
        "# Comparison of learning rules",
        "",
        f"Dataset `{data['name']}` ({summary['train_size']['mean']:g} train / "
        f"{summary['test_size']['mean']:g} {summary['eval_set']}, "
        f"N = {summary['data_size']['mean']:g}), metrics on the {summary['eval_set']} set, model "
        f"`{model['name']}` ({model_desc}), {first['schedule']['epochs']} passes; "
        f"{len(seeds)} seed(s) {seeds} ({shared} within a seed). Cells are mean ± sample "
        "standard deviation over the seeds; the per-seed values follow below.",
        "",
    ]
    for title, columns in TABLES.items():
        lines += [f"## {title}", "", *_table(columns, results, samples), ""]
    lines += [
        f"ECE uses {first['eval']['bins']} equal-width confidence bins. Sparsity is of the "
        "first-layer weights: max and median of |w|; near 0 is the share of weights with "
        f"|w| < {NEAR_ZERO:g}·σ₀, σ₀ = 1/√n the initialisation scale of a filter of n "
        "entries; below 1e-3·max is the reference code's share |w| < 10⁻³·max|w| (a few large "
        "weights drive it towards 100%); Hoyer is (√n − ‖w‖₁/‖w‖₂)/(√n − 1) averaged over "
        "filters. In the average rows the sparsity measures are means over posterior samples "
        "θ = g·ξ. Out-of-distribution AUROC: the predictive entropy separating the test inputs "
        "from the same inputs rotated by 90°, with pixels permuted, and from uniform noise "
        "(0.5: no separation, 1: perfect).",
    ]
    if not all(r["summary"]["has_posterior"] for r in results.values()):
        lines += [
            "",
            "† deterministic baseline without a posterior: its average row repeats the point "
            "estimate.",
        ]
    head = ["run", "optimizer", "hyperparameters", "passes"]
    head += ["gradient evaluations per step (× SGD)", "train (s)", "ms per step (fastest pass)"]
    head += ["eval (s)"]
    runs = []
    for label, res in results.items():
        opt = first_cfgs[label]["optimizer"]
        hyper = ", ".join(f"{k}={v}" for k, v in opt.items() if k != "name" and v != {})
        s = res["summary"]
        runs.append(
            [
                label,
                opt["name"],
                hyper,
                f"{s['epochs']['mean']:g}",
                str(opt.get("mc_samples", 1)),
                cell(s["train_seconds"], 1.0, 1),
                cell(step_ms(res), 1.0, 1),
                cell(s["eval_seconds"], 1.0, 1),
            ]
        )
    lines += ["", "## Runs", "", *markdown(head, runs, [LEFT] * 3 + [RIGHT] * 5)]
    lines += ["", "## Per-seed values", ""]
    for title, columns in TABLES.items():
        lines += [f"### {title}", "", *_table(columns, results, samples, per_seed=True), ""]
    lines += ["## Figures", "", "![learning curves](learning_curves.png)", ""]
    lines += ["![first-layer weight magnitudes](weight_magnitudes.png)", ""]
    for label in results:
        folder = f"{label}/seed{seeds[0]}"
        pngs = sorted(p.name for p in (out / folder).glob("*.png"))
        lines += [f"### {label} (seed {seeds[0]})", ""]
        lines += [f"![{label} {p[:-4]}]({folder}/{p})" for p in pngs] + [""]
    return "\n".join(lines)


def ms_per_step(run: dict[str, Any]) -> float:
    """Milliseconds per training step of a run's fastest pass (forward, backward, the update
    and batching): the pass least slowed by other work on a shared machine."""
    return 1000.0 * run["fastest_pass_seconds"] * run["epochs"] / run["steps"]


def step_ms(res: dict[str, Any]) -> dict[str, Any]:
    """:func:`ms_per_step` of a label's runs, summarised over its seeds."""
    return summarise([ms_per_step(r) for r in res["per_seed"].values()])


def _first_layer_at_g(folder: Path) -> torch.Tensor:
    """The first weight with ndim ≥ 2 in the model state of a run's checkpoint."""
    state = torch.load(folder / CHECKPOINT, map_location="cpu", weights_only=True)["model"]
    return next(t for t in state.values() if t.ndim >= 2)


def compare(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Train every run of a comparison config for every seed into ``out/LABEL/seedS`` and write
    the report (rank 0 of a torchrun writes; the other processes train alongside and return
    ``{}``). Every run is checked before the first trains
    (:func:`experiments.common.training.check_runs`). Returns label
    → ``{"seeds", "summary", "per_seed"}``."""
    out = Path(out)
    configs = config_module.run_configs(raw, seeds)
    processes = distributed.from_environment()
    check = partial(train_module.check_runs, configs, "runs" in raw)
    train_module.on_every_process(check, processes)
    with runfiles.locked(out) if processes.main else contextlib.nullcontext(out):
        return _compare(configs, out, resume, processes)


def _compare(
    configs: dict[str, dict[int, dict[str, Any]]],
    out: Path,
    resume: bool,
    processes: distributed.Processes,
) -> dict[str, Any]:
    """:func:`compare` with the folder locked: check it, write its config, train, report."""
    written = skeleton.written(configs)
    prepare = partial(skeleton.prepare_folder, out, written, resume)
    train_module.on_every_process(
        prepare if processes.main else lambda: None, processes
    )  # no process trains before it is done
    per_seed = skeleton.run_all(configs, out, resume, train_module.RUNNER, processes.main)
    if not processes.main:
        return {}
    seed_names = [int(s) for s in per_seed[next(iter(configs))]]
    results = {
        label: {
            "seeds": seed_names,
            "summary": summarise(list(runs.values())),
            "per_seed": runs,
        }
        for label, runs in per_seed.items()
    }
    histories = {
        label: [runfiles.read_jsonl(out / label / f"seed{seed}" / METRICS) for seed in seed_names]
        for label in configs
    }
    eval_set = next(iter(per_seed[next(iter(configs))].values()))["eval_set"]
    seeds = f"seed{'s' if len(seed_names) > 1 else ''} {', '.join(map(str, seed_names))}"
    data = skeleton.data_name(next(iter(configs.values()))[seed_names[0]], out)
    figures.learning_curves(histories, out / "learning_curves.png", f"{data}, {seeds}", eval_set)
    weights = {label: _first_layer_at_g(out / label / f"seed{seed_names[0]}") for label in configs}
    first_weight = next(iter(weights.values()))
    figures.weight_magnitudes(
        weights,
        out / "weight_magnitudes.png",
        f"{data}: first-layer weight magnitudes at g, seed {seed_names[0]} (of {seeds})",
        NEAR_ZERO * init_scale(first_weight),
    )
    skeleton.write_report(out, results, report(configs, results, out))
    return results


def _show(results: dict[str, Any], out: Path) -> None:
    print((out / "report.md").read_text())
    print(f"report in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, compare, _show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
