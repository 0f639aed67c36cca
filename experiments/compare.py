"""Train several runs on the same data for one or several seeds and write a report folder.

    python -m experiments.compare CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]

CONFIG holds the shared tables and one ``[runs.LABEL]`` table per run (merged over the
shared ones). The seeds are the top-level ``seeds = [0, 1, 2]`` of CONFIG, or ``--seeds``
(which overrides it), else the single ``seed``. Each run and seed trains into
``DIR/LABEL/seedS``; ``DIR/report.md`` holds the mean ± standard deviation over seeds and the
per-seed values of every metric, ``DIR/results.json`` all numbers, ``DIR/config.json`` every
resolved run config, ``DIR/learning_curves.png`` the test curves (per run the mean over the
seeds and a band of ± one standard deviation) and
``DIR/weight_magnitudes.png`` the first-layer weight magnitudes of each run (first seed).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from experiments import cli, distributed, figures, runfiles
from experiments import config as config_module
from experiments.ood import SHIFTS
from experiments.sparsity import NEAR_ZERO, init_scale
from experiments.train import CHECKPOINT, METRICS, train

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


def seed_list(raw: dict[str, Any], seeds: Sequence[int] | None = None) -> list[int]:
    """The seeds of a comparison: ``seeds`` if given, else the config's ``seeds`` list, else
    its single ``seed`` (default 0)."""
    if seeds is None:
        if "seeds" in raw and "seed" in raw:
            raise config_module.ConfigError("give either 'seed' or 'seeds', not both")
        seeds = raw.get("seeds", [raw.get("seed", 0)])
    if (
        not isinstance(seeds, (list, tuple))
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise config_module.ConfigError(
            f"seeds must be a non-empty list of distinct integers, got {seeds!r}"
        )
    return list(seeds)


def run_configs(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> dict[str, dict[int, dict[str, Any]]]:
    """The resolved config of every run label and seed: label → seed → run config."""
    seeds = seed_list(raw, seeds)
    shared = {k: v for k, v in raw.items() if k not in ("seed", "seeds")}
    per_seed = {s: config_module.split_runs({**shared, "seed": s}) for s in seeds}
    return {label: {s: per_seed[s][label] for s in seeds} for label in per_seed[seeds[0]]}


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


def _estimate_label(estimate: str, res: dict[str, Any], samples: int) -> str:
    if estimate == "point":
        return "at g"
    return f"average of {samples}" if res["has_posterior"] else "average †"


def _table(
    columns: list[Column],
    results: dict[str, dict[str, Any]],
    samples: dict[str, int],
    per_seed: bool = False,
) -> list[str]:
    """A Markdown table of ``columns``: mean ± sd per run and estimate, or one row per seed."""
    seed_col = ["seed"] if per_seed else []
    head = ["run", "estimate", *seed_col] + [h for h, _, _, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for label, res in results.items():
        for est in ("point", "average"):
            name = _estimate_label(est, res["summary"], samples[label])
            if not per_seed:
                cells = [cell(get(res["summary"], est), f, d) for _, get, f, d in columns]
                lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
                continue
            for seed, run in res["per_seed"].items():
                cells = [f"{f * get(run, est):.{d}f}" for _, get, f, d in columns]
                lines.append(f"| {label} | {name} | {seed} | " + " | ".join(cells) + " |")
    return lines


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
    lines += [
        "",
        "## Runs",
        "",
        "| run | optimizer | hyperparameters | passes | gradient evaluations per step "
        "(× SGD) | train (s) | ms per step (fastest pass) | eval (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, res in results.items():
        opt = first_cfgs[label]["optimizer"]
        hyper = ", ".join(f"{k}={v}" for k, v in opt.items() if k != "name" and v != {})
        s = res["summary"]
        lines.append(
            f"| {label} | {opt['name']} | {hyper} | {s['epochs']['mean']:g} | "
            f"{opt.get('mc_samples', 1)} | {cell(s['train_seconds'], 1.0, 1)} | "
            f"{cell(step_ms(res), 1.0, 1)} | {cell(s['eval_seconds'], 1.0, 1)} |"
        )
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
    ``{}``). Returns label → ``{"seeds", "summary", "per_seed"}``."""
    out = Path(out)
    configs = run_configs(raw, seeds)
    main = distributed.from_environment().main
    with runfiles.locked(out) if main else contextlib.nullcontext(out):
        return _compare(configs, out, resume, main)


def check_folder(out: Path, written: dict[str, Any], resume: bool) -> None:
    """Refuse a folder with files (without ``resume``) or with another comparison's config."""
    held = runfiles.contents(out)
    if held and not resume:
        raise FileExistsError(
            f"{out} already holds files {held}; pass --resume to continue the comparison "
            "there, or choose another --out"
        )
    if resume and (out / "config.json").exists():
        if runfiles.read_json(out / "config.json") != written:
            raise config_module.ConfigError(
                f"the config differs from the one {out} was run with ({out / 'config.json'}); "
                "resume with that config or choose another --out"
            )
    elif held and resume:
        raise FileExistsError(f"{out} holds {held} but no comparison to resume (no config.json)")


def _compare(
    configs: dict[str, dict[int, dict[str, Any]]], out: Path, resume: bool, main: bool
) -> dict[str, Any]:
    """:func:`compare` with the folder locked: check it, write its config, train, report."""
    if main:
        written = {
            label: {str(s): c for s, c in by_seed.items()} for label, by_seed in configs.items()
        }
        check_folder(out, written, resume)
        runfiles.remove_leftovers(out)
        runfiles.write_json(out / "config.json", written)
    per_seed: dict[str, dict[str, dict[str, Any]]] = {label: {} for label in configs}
    for label, by_seed in configs.items():
        for seed, cfg in by_seed.items():
            print(f"== run {label!r} ({cfg['optimizer']['name']}), seed {seed}", flush=True)
            tic = time.perf_counter()
            per_seed[label][str(seed)] = train(cfg, out / label / f"seed{seed}", resume)
            print(
                f"== run {label!r}, seed {seed} done in {time.perf_counter() - tic:.1f}s",
                flush=True,
            )
    if not main:
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
    figures.learning_curves(histories, out / "learning_curves.png", eval_set)
    weights = {label: _first_layer_at_g(out / label / f"seed{seed_names[0]}") for label in configs}
    first_weight = next(iter(weights.values()))
    figures.weight_magnitudes(
        weights, out / "weight_magnitudes.png", NEAR_ZERO * init_scale(first_weight)
    )
    runfiles.write_json(out / "results.json", results)
    runfiles.write_text(out / "report.md", report(configs, results, out) + "\n")
    return results


def _show(results: dict[str, Any], out: Path) -> None:
    print((out / "report.md").read_text())
    print(f"report in {out}")


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise config_module.ConfigError(
            f"--seeds takes comma-separated integers such as 0,1,2, got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    return cli.run("python -m experiments.compare", __doc__, compare, _show, argv, parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
