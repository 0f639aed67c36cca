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

Every run is checked before the first one trains (an error names it: ``[runs.LABEL]: ...``);
after every epoch and run the command prints the runs done, the time elapsed and an estimate
of the time left. ``--resume`` continues the runs in DIR, counts the finished ones as done,
and takes changes to runs that have not finished (a started one starts again from scratch).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from experiments import cli, distributed, figures, runfiles
from experiments import config as config_module
from experiments import train as train_module
from experiments.data import Dataset, DatasetNotFoundError
from experiments.ood import SHIFTS
from experiments.progress import Planned, Progress
from experiments.sparsity import NEAR_ZERO, init_scale
from experiments.tables import LEFT, RIGHT, markdown
from experiments.train import CHECKPOINT, METRICS, RESULTS, train

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
    lines += ["", "## Runs", "", *markdown([*head, "eval (s)"], runs, [LEFT] * 3 + [RIGHT] * 5)]
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
    ``{}``). Every run is checked before the first trains (:func:`check_runs`). Returns label
    → ``{"seeds", "summary", "per_seed"}``."""
    out = Path(out)
    configs = run_configs(raw, seeds)
    processes = distributed.from_environment()
    train_module.on_every_process(partial(check_runs, configs, "runs" in raw), processes)
    with runfiles.locked(out) if processes.main else contextlib.nullcontext(out):
        return _compare(configs, out, resume, processes)


def check_runs(configs: dict[str, dict[int, dict[str, Any]]], labelled: bool = True) -> None:
    """Raise what any run of ``configs`` would raise when it starts (:func:`train.check
    <experiments.train.check>`: its data, device and every value its optimizer checks),
    before any trains or writes; the error names the run (``[runs.LABEL]: ...``) if the
    config is ``labelled`` by [runs] tables. Each dataset is loaded once; a label's seeds
    differ in the seed alone, so its first is checked."""
    datasets: dict[str, Dataset] = {}
    for label, by_seed in configs.items():
        cfg = next(iter(by_seed.values()))
        try:
            key = json.dumps(cfg["data"], sort_keys=True)
            if key not in datasets:
                datasets[key] = train_module.load_data(cfg["data"])
            train_module.check(cfg, datasets[key], distributed.from_environment(cfg["parallel"]))
        except (ValueError, DatasetNotFoundError) as err:
            raise config_module.ConfigError(
                f"[runs.{label}]: {err}" if labelled else str(err)
            ) from None


def _refuse_other_files(out: Path, resume: bool) -> None:
    """Refuse a folder with files without ``resume``, or with files but no config.json."""
    held = runfiles.contents(out)
    if held and not resume:
        raise FileExistsError(
            f"{out} already holds files {held}; pass --resume to continue the comparison "
            "there, or choose another --out"
        )
    if held and not (out / "config.json").exists():
        raise FileExistsError(f"{out} holds {held} but no comparison to resume (no config.json)")


def check_folder(out: Path, written: dict[str, Any], resume: bool) -> None:
    """Refuse a folder with files (without ``resume``) or with another comparison's config."""
    _refuse_other_files(out, resume)
    if resume and (out / "config.json").exists():
        if runfiles.read_json(out / "config.json") != written:
            raise config_module.ConfigError(
                f"the config differs from the one {out} was run with ({out / 'config.json'}); "
                "resume with that config or choose another --out"
            )


def _state(folder: Path) -> str:
    """``"finished"`` (its results written), ``"started"`` (a checkpoint) or ``"new"``."""
    if (folder / RESULTS).exists():
        return "finished"
    started = (folder / CHECKPOINT).exists() or any(folder.glob("checkpoint.rank*.pt"))
    return "started" if started else "new"


def changed_runs(out: Path, before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str]]:
    """The runs (label, seed) of ``now`` whose config differs from ``before`` (label → seed →
    config, as in config.json); refuses a finished run among them, and a started run that
    ``now`` drops."""
    keys = {(label, seed) for runs in (before, now) for label in runs for seed in runs[label]}
    changed, refused = [], []
    for label, seed in sorted(keys):
        old, new = before.get(label, {}).get(seed), now.get(label, {}).get(seed)
        if old == new:
            continue
        state = _state(out / label / f"seed{seed}")
        if state == "finished" or (new is None and state == "started"):
            refused.append(f"{label!r} seed {seed} ({state}{', dropped' if new is None else ''})")
        elif new is not None:
            changed.append((label, seed))
    if refused:
        raise config_module.ConfigError(
            f"the config changes run(s) {', '.join(refused)} of {out}: a run may change only "
            f"until it finishes (a started one starts again); resume with the config in "
            f"{out / 'config.json'} for those runs, or choose another --out"
        )
    return changed


def prepare_folder(out: Path, written: dict[str, Any], resume: bool) -> None:
    """Check ``out`` for the runs of ``written`` (label → seed → config) and write its
    config.json (call with the folder locked).

    Without ``resume`` the folder must be empty. With it, a run may change its config only
    if it has not finished: one that has started begins again from scratch (said in one
    line), one that has not loses any files it left.
    """
    _refuse_other_files(out, resume)
    if resume and (out / "config.json").exists():
        for label, seed in changed_runs(out, runfiles.read_json(out / "config.json"), written):
            folder = out / label / f"seed{seed}"
            if _state(folder) == "started":
                print(
                    f"== run {label!r}, seed {seed}: its config changed, it starts again",
                    flush=True,
                )
            train_module.clear(folder)
    runfiles.remove_leftovers(out)
    runfiles.write_json(out / "config.json", written)


def plan(
    configs: dict[str, dict[int, dict[str, Any]]], out: Path, resume: bool
) -> dict[tuple[str, int], Planned]:
    """The runs ahead (:class:`~experiments.progress.Planned`): their epochs, gradient
    evaluations per step as their cost, and with ``resume`` the epochs done in ``out``."""
    runs = {}
    for label, by_seed in configs.items():
        for seed, cfg in by_seed.items():
            folder = out / label / f"seed{seed}"
            runs[label, seed] = Planned(
                label,
                cfg["schedule"]["epochs"],
                cfg["optimizer"].get("mc_samples", 1),
                len(runfiles.read_jsonl(folder / METRICS)) if resume else 0,
                resume and _state(folder) == "finished",
            )
    return runs


def train_all(
    configs: dict[str, dict[int, dict[str, Any]]],
    out: Path,
    resume: bool,
    main: bool = True,
    trainer: Callable[..., Any] = train,
) -> dict[str, dict[str, Any]]:
    """Train every run and seed of ``configs`` in turn into ``out/LABEL/seedS`` with
    ``trainer`` (:func:`~experiments.train.train` or one like it); the ``main`` process
    prints the runs done, the time elapsed and the time left after every epoch and run.
    Returns label → seed → results."""
    progress = Progress(plan(configs, out, resume))
    per_seed: dict[str, dict[str, Any]] = {label: {} for label in configs}
    for label, by_seed in configs.items():
        for seed, cfg in by_seed.items():
            rule = cfg["optimizer"]["name"]
            print(f"== run {label!r} ({rule}), seed {seed}", flush=True)
            tic = time.perf_counter()
            per_seed[label][str(seed)] = trainer(
                cfg,
                out / label / f"seed{seed}",
                resume,
                progress=partial(progress.epoch, (label, seed)) if main else None,
                title=f"{out.name}: {label}{f' ({rule})' if rule != label else ''}, seed {seed}",
            )
            done = f"== run {label!r}, seed {seed} done in {time.perf_counter() - tic:.1f}s"
            print(done + (f"; {progress.end((label, seed))}" if main else ""), flush=True)
    return per_seed


def _compare(
    configs: dict[str, dict[int, dict[str, Any]]],
    out: Path,
    resume: bool,
    processes: distributed.Processes,
) -> dict[str, Any]:
    """:func:`compare` with the folder locked: check it, write its config, train, report."""
    written = {label: {str(s): c for s, c in by_seed.items()} for label, by_seed in configs.items()}
    prepare = partial(prepare_folder, out, written, resume) if processes.main else lambda: None
    train_module.on_every_process(prepare, processes)  # no process trains before it is done
    per_seed = train_all(configs, out, resume, processes.main)
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
    figures.learning_curves(
        histories, out / "learning_curves.png", f"{out.name}, {seeds}", eval_set
    )
    weights = {label: _first_layer_at_g(out / label / f"seed{seed_names[0]}") for label in configs}
    first_weight = next(iter(weights.values()))
    figures.weight_magnitudes(
        weights,
        out / "weight_magnitudes.png",
        f"{out.name}: first-layer weight magnitudes at g, seed {seed_names[0]}",
        NEAR_ZERO * init_scale(first_weight),
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
