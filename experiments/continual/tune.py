"""Tune the methods of a continual config on a validation split: a grid per method, the best
point chosen.

    python -m experiments.continual.tune CONFIG.toml [--out DIR] [--resume] [--seeds 0]

CONFIG is a continual config (experiments/continual/learn.py) whose ``[stream]`` holds out
``validation`` training examples, with a ``[methods.LABEL.grid]`` table per method to tune:
keys of the method (``ewc_lambda``, ``memory_strength``, …) or of its optimizer → lists of
values (a method without a grid is one point). An optional top-level ``[tune]`` table:
``metric`` (``"final_accuracy"``, the average accuracy over every task after the last, or
``"nll"``; default ``"final_accuracy"``) and ``estimate`` (``"average"``, a rule's model
average, or ``"point"``; default ``"average"``; a method without a posterior is scored at its
point estimate). Every point of a grid trains as ``DIR/LABEL.I/seedS`` on the tasks built from
the other training examples and is evaluated on the held-out ones; the test set is never
loaded. A point that diverges is recorded as such. ``DIR/tuning.md`` lists every point with its
validation metrics and marks the chosen one (the best mean of ``metric`` over the seeds),
``DIR/tuned.json`` holds each label's chosen method table and ``DIR/config.json`` every
resolved run config.
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.continual.tune"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common.config import ConfigError
from experiments.common.tables import LEFT, RIGHT, markdown
from experiments.continual import learn as continual
from experiments.runs import tune

METRICS = ("final_accuracy", "nll")
METHOD_KEYS = {key for keys in continual.STRATEGIES.values() for key in keys}
"""Grid keys that set a method's own key; any other sets its optimizer's."""


def continual_tune(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Learn the stream at every grid point of every method for every seed into ``out`` and
    choose the best per label. Returns label → ``{"chosen", "method", "points"}``."""
    out = Path(out)
    metric, estimate = tune.criterion(raw, METRICS, "final_accuracy")
    expanded, points = tune.grid_points(raw, "methods", METHOD_KEYS)
    configs = continual.run_configs(expanded, seeds)  # every point checked before training
    for label, by_seed in configs.items():
        if not all(cfg["stream"]["validation"] > 0 for cfg in by_seed.values()):
            raise ConfigError(
                f"method {label!r}: tuning must not see the test set; set [stream] validation "
                "to the number of training examples to hold out"
            )
    by = (metric, estimate)
    return tune.run_grid(configs, points, out, resume, continual.RUNNER, by, "method", report)


def _mean(runs: Sequence[dict[str, Any]], estimate: str, key: str) -> str:
    """The mean over seeds of ``key`` at ``estimate``: accuracies in %, an NLL as it is."""
    values = [r[estimate][key] for r in runs if estimate in r]
    if not values:
        return ""
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if key == "nll" else f"{100 * mean:.2f}"


def report(results: dict[str, Any], metric: str, estimate: str) -> str:
    """Markdown: per label its grid points with their validation metrics, the chosen one
    marked."""
    best = "highest" if metric in tune.HIGHER_IS_BETTER else "lowest"
    lines = [
        "# Continual tuning on the validation split",
        "",
        f"Chosen per method (←): the {best} mean {metric} over the seeds, of the {estimate} "
        "estimate (at the point estimate for a method without a posterior). Metrics are means",
        "over the seeds on the held-out training examples of every task after the last task",
        "(accuracies in %); task 1: its accuracy just after it was learned.",
        "",
    ]
    for label, res in results.items():
        keys = list(res["points"][0]["values"])
        head = ["point", *keys, "final acc. at g", "final acc. average", "task 1 at g"]
        head += ["forgetting at g", "NLL at g", "NLL average", "train (s)", ""]
        rows = []
        for i, row in enumerate(res["points"]):
            cells = [str(i), *(f"{row['values'][k]}" for k in keys)]
            runs = row["runs"]
            if row["score"] is None:
                cells += ["diverged"] + [""] * 6
            else:
                cells += [
                    _mean(runs, "point", "final_accuracy"),
                    _mean(runs, "average", "final_accuracy"),
                    _mean(runs, "point", "first_task"),
                    _mean(runs, "point", "forgetting"),
                    _mean(runs, "point", "nll"),
                    _mean(runs, "average", "nll"),
                    f"{statistics.fmean(r['train_seconds'] for r in runs):.0f}",
                ]
            cells.append("←" if i == res["chosen"] else "")
            rows.append(cells)
        align = [RIGHT] * (len(head) - 1) + [LEFT]
        lines += [f"## {label}", "", *markdown(head, rows, align), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return cli.run(
        PROG,
        __doc__,
        continual_tune,
        tune.show,
        argv,
        cli.parse_seeds,
    )


if __name__ == "__main__":
    sys.exit(main())
