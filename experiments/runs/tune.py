"""Tune the runs of a comparison on a validation split: a grid per run, the best point chosen.

    python -m experiments.runs.tune CONFIG.toml [--out DIR] [--resume] [--seeds 0]

CONFIG is a comparison config (experiments/runs/compare.py) whose ``[data]`` holds out
``validation`` training examples, with a ``[runs.LABEL.grid]`` table per run: optimizer
keys → lists of values, and an optional top-level ``[tune]`` table: ``metric`` (``"nll"``,
``"accuracy"``, ``"ece"`` or ``"brier"``; default ``"nll"``) and ``estimate`` (``"average"``,
the model average, or ``"point"``; default ``"average"``). Every point of a grid (the
product of its lists, in order) trains as ``DIR/LABEL.I/seedS`` and is evaluated on the
held-out examples; the test set is never loaded into a tuning run. A point that diverges
is recorded as such. ``DIR/tuning.md`` lists every point with its validation metrics and
marks the chosen one (the best mean of ``metric`` over the seeds), ``DIR/tuned.json`` holds
each label's chosen optimizer table and ``DIR/config.json`` every resolved run config.
Every point is checked before the first trains, progress and ``--resume`` are those of
experiments.runs.compare.
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.runs.tune"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import dataclasses
import itertools
import statistics
import sys
from collections.abc import Callable, Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from experiments.common import config as config_module
from experiments.common import runfiles, skeleton
from experiments.common import training as train_module
from experiments.common.tables import LEFT, RIGHT, markdown
from experiments.common.training import DivergedError
from experiments.runs import compare

METRICS = ("nll", "accuracy", "ece", "brier")
ESTIMATES = ("average", "point")
HIGHER_IS_BETTER = {"accuracy", "final_accuracy"}


def grid_points(
    raw: dict[str, Any], table: str = "runs", outer: Collection[str] = ()
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """The config with one entry ``LABEL.I`` of ``[table]`` per grid point, and label → the
    values of each point (in the order of the product of the grid's lists). A grid key in
    ``outer`` sets the entry's own key (a continual method's ``ewc_lambda``), any other its
    optimizer's."""
    runs = raw.get(table)
    if not isinstance(runs, dict) or not runs:
        raise config_module.ConfigError(f"a tuning config needs [{table}.LABEL] tables")
    expanded, points = {}, {}
    for label, run in runs.items():
        grid = dict(run.get("grid", {}))
        if not all(isinstance(v, list) and v for v in grid.values()):
            raise config_module.ConfigError(
                f"[{table}.{label}.grid] must map keys to non-empty lists, got {grid}"
            )
        base = {k: v for k, v in run.items() if k != "grid"}
        products = itertools.product(*grid.values())
        points[label] = [dict(zip(grid, values, strict=True)) for values in products]
        for i, point in enumerate(points[label]):
            own = {k: v for k, v in point.items() if k in outer}
            optimizer = {k: v for k, v in point.items() if k not in outer}
            expanded[f"{label}.{i}"] = config_module.merge(base, {**own, "optimizer": optimizer})
    shared = {k: v for k, v in raw.items() if k not in (table, "tune")}
    return {**shared, table: expanded}, points


def criterion(
    raw: dict[str, Any], metrics: Sequence[str] = METRICS, default: str = "nll"
) -> tuple[str, str]:
    """(metric, estimate) of the ``[tune]`` table, checked: a metric of ``metrics``
    (``default`` if not given) and an estimate of :data:`ESTIMATES`."""
    table = raw.get("tune", {})
    unknown = sorted(set(table) - {"metric", "estimate"})
    if unknown:
        raise config_module.ConfigError(
            f"unknown key(s) {unknown} in [tune]; valid keys: ['estimate', 'metric']"
        )
    metric, estimate = table.get("metric", default), table.get("estimate", "average")
    for key, value, valid in (("metric", metric, metrics), ("estimate", estimate, ESTIMATES)):
        if value not in valid:
            raise config_module.ConfigError(
                f"unknown [tune].{key} {value!r}; valid choices: {list(valid)}"
            )
    return metric, estimate


def tune(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Train every grid point of every run for every seed into ``out`` and choose the best
    per label. Returns label → ``{"chosen", "optimizer", "points"}``."""
    out = Path(out)
    metric, estimate = criterion(raw)
    expanded, points = grid_points(raw)
    configs = config_module.run_configs(expanded, seeds)
    for label, by_seed in configs.items():
        if not all(cfg["data"]["validation"] > 0 for cfg in by_seed.values()):
            raise config_module.ConfigError(
                f"run {label!r}: tuning must not see the test set; set [data] validation to "
                "the number of training examples to hold out"
            )
    return run_grid(configs, points, out, resume, train_module.RUNNER, (metric, estimate))


def run_grid(
    configs: dict[str, dict[int, dict[str, Any]]],
    points: dict[str, list[dict[str, Any]]],
    out: Path,
    resume: bool,
    runner: skeleton.Runner,
    by: tuple[str, str],
    table: str = "optimizer",
    write: Callable[[dict[str, Any], str, str], str] | None = None,
) -> dict[str, Any]:
    """Check, then train every resolved grid point (``LABEL.I`` → seed → config) with
    ``runner`` into ``out/LABEL.I/seedS`` (:func:`experiments.common.skeleton.run_all`: progress
    with the time left), choose per label by (metric, estimate) ``by`` (:func:`choose`), and write
    ``config.json``, ``tuned.json`` and ``tuning.md`` (``write``, default :func:`report`)."""
    runner.check(configs)  # every point, before any trains
    diverging = dataclasses.replace(runner, train=partial(train_point, runner.train))
    with runfiles.locked(out):
        skeleton.prepare_folder(out, skeleton.written(configs), resume)
        outcomes = skeleton.run_all(configs, out, resume, diverging)
        results = choose(points, outcomes, configs, *by, table)
        text = (write or report)(results, *by)
        skeleton.write_report(out, results, text, ("tuned.json", "tuning.md"))
    return results


def train_point(
    runner: Callable[..., dict[str, Any] | None],
    cfg: dict[str, Any],
    folder: Path,
    resume: bool,
    **options: Any,
) -> dict[str, Any] | None:
    """The results of ``runner(cfg, folder, resume, **options)``, or None if it diverged."""
    try:
        return runner(cfg, folder, resume, **options)
    except DivergedError as err:
        print(f"== {folder} diverged: {err}", flush=True)
        return None


def score(runs: Sequence[dict[str, Any] | None], metric: str, estimate: str) -> float | None:
    """Mean of ``metric`` at ``estimate`` (at the point estimate for a run without that
    estimate) over the seeds; None if any seed diverged."""
    if any(r is None for r in runs):
        return None
    return statistics.fmean(r.get(estimate, r["point"])[metric] for r in runs if r is not None)


def choose(
    points: dict[str, list[dict[str, Any]]],
    outcomes: dict[str, dict[str, dict[str, Any] | None]],
    configs: dict[str, dict[int, dict[str, Any]]],
    metric: str,
    estimate: str,
    table: str = "optimizer",
) -> dict[str, Any]:
    """Per label the point with the best mean ``metric`` (lowest, highest for an accuracy)
    and its resolved ``table`` (the optimizer's, or a continual method's)."""
    sign = -1.0 if metric in HIGHER_IS_BETTER else 1.0
    chosen: dict[str, Any] = {}
    for label, values in points.items():
        rows: list[dict[str, Any]] = []
        for i, point in enumerate(values):
            runs = list(outcomes[f"{label}.{i}"].values())
            rows.append({"values": point, "score": score(runs, metric, estimate), "runs": runs})
        finite = [i for i, r in enumerate(rows) if r["score"] is not None]
        if not finite:
            raise runfiles.RunError(f"every grid point of run {label!r} diverged")
        best = min(finite, key=lambda i: sign * rows[i]["score"])
        resolved = next(iter(configs[f"{label}.{best}"].values()))[table]
        chosen[label] = {"chosen": best, table: resolved, "points": rows}
    return chosen


def report(results: dict[str, Any], metric: str, estimate: str) -> str:
    """Markdown: per label a table of its grid points with their validation metrics."""
    lines = [
        "# Tuning on the validation split",
        "",
        f"Chosen per run: the lowest mean {metric} of the {estimate} estimate over the seeds"
        if metric not in HIGHER_IS_BETTER
        else f"Chosen per run: the highest mean {metric} of the {estimate} estimate",
        "(marked ←). Metrics are means over the seeds on the held-out training examples;",
        "the average of a deterministic optimizer is its point estimate.",
        "",
    ]
    for label, res in results.items():
        keys = list(res["points"][0]["values"])
        head = ["point", *keys]
        head += [f"{m} {e}" for e in ESTIMATES for m in METRICS]
        head += ["ms per step (fastest pass)", ""]
        rows = []
        for i, row in enumerate(res["points"]):
            cells = [
                str(i),
                *(
                    f"{row['values'][k]:g}"
                    if isinstance(row["values"][k], float)
                    else str(row["values"][k])
                    for k in keys
                ),
            ]
            if row["score"] is None:
                cells += ["diverged"] + [""] * (2 * len(METRICS))
            else:
                runs = row["runs"]
                cells += [
                    f"{statistics.fmean(r[e][m] for r in runs):.4f}"
                    for e in ESTIMATES
                    for m in METRICS
                ]
                cells.append(f"{statistics.fmean(compare.ms_per_step(r) for r in runs):.1f}")
            cells.append("←" if i == res["chosen"] else "")
            rows.append(cells)
        align = [RIGHT] * (len(head) - 1) + [LEFT]
        lines += [f"## {label}", "", *markdown(head, rows, align), ""]
    return "\n".join(lines)


def show(results: dict[str, Any], out: Path) -> None:
    """Print a tuning's report and where it is."""
    print((out / "tuning.md").read_text())
    print(f"tuning in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, tune, show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
