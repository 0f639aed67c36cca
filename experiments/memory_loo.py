"""Model selection by the leave-one-out NLL estimated from one training run.

    python -m experiments.memory_loo CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]

CONFIG is a run config (or a comparison config with ``[runs.LABEL]`` tables) of a Lie-group
BLR optimizer whose ``[data]`` holds out ``validation`` training examples, with a ``[memory.loo]``
table (:data:`LOO`): a grid of prior precisions δ. For every run, δ and seed, into
``DIR/LABEL/deltaD/seedS``, the run trains once on the rest of the training set
(:func:`experiments.memory_map.trained`; ``--resume`` continues its checkpoint), then
``summary.json`` holds, each as a mean NLL per example:

- ``loo``: the leave-one-out NLL of the training examples estimated from the posterior alone
  (:func:`liegroup_blr.loo_nll`), in both forms (``corrected``, ``first_order``), and
  ``train``: the same NLL without the shift (the training NLL at that prediction);
- ``validation`` and ``test``: the NLL of the held-out training examples and of the test
  set, at the posterior mean (``point``, the prediction the estimate shifts) and averaged
  over ``samples`` posterior samples (``average``), with their accuracies.

``DIR`` gets ``config.json`` (every resolved config and the ``[memory.loo]`` table),
``results.json`` (per run: ``per_seed``, per seed the summary of every δ, ``deltaD``, and
the δ each criterion picks, ``picks``; ``summary``, their mean ± sd over seeds),
``docs_summary.json`` (:func:`experiments.memory_converged.write_docs_summary`: what
``docs/results/NAME.json`` holds) and ``model_selection.png`` (the criteria against δ).
"""

from __future__ import annotations

from experiments import cli

PROG = "python -m experiments.memory_loo"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import copy
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import liegroup_blr as lgb
from experiments import config as config_module
from experiments import memory_map, runfiles, skeleton
from experiments.data import load_dataset
from experiments.memory_converged import write_docs_summary
from experiments.memory_map import trained
from experiments.memory_scores import train_inputs
from experiments.memory_stats import aggregate
from experiments.train import check_runs
from liegroup_blr import predictive

LOO: dict[str, Any] = {
    "prior_precisions": [1.0, 4.0, 16.0, 64.0, 256.0],
    "samples": 64,
    "batch_size": 256,
}
"""The ``[memory.loo]`` table with its defaults: the grid of prior precisions δ (each a training
run), ``samples`` posterior samples for the model average (and for a sample-form variance),
``batch_size`` examples per batch of the estimate."""

CRITERIA = {
    "loo corrected": ("loo", "corrected"),
    "loo first order": ("loo", "first_order"),
    "train": ("train", None),
    "validation (point)": ("validation", "point"),
    "validation (average)": ("validation", "average"),
    "test (point)": ("test", "point"),
    "test (average)": ("test", "average"),
}
"""The criteria compared, by name: where each lies in a summary."""


def _check(table: dict[str, Any], configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    grid = table["prior_precisions"]
    if len(grid) < 2 or any(not isinstance(d, (int, float)) or d < 0 for d in grid):
        raise config_module.ConfigError(
            f"[memory.loo].prior_precisions must hold at least two numbers >= 0, got {grid}"
        )
    if len(set(grid)) != len(grid):
        raise config_module.ConfigError(f"[memory.loo].prior_precisions repeats a value: {grid}")
    for key, least in (("samples", 2), ("batch_size", 1)):
        if table[key] < least:
            raise config_module.ConfigError(
                f"[memory.loo].{key} must be >= {least}, got {table[key]}"
            )
    for by_seed in configs.values():
        for cfg in by_seed.values():
            if cfg["optimizer"]["name"] not in ("additive", "multiplicative", "affine"):
                raise config_module.ConfigError(
                    f"[optimizer] {cfg['optimizer']['name']!r} has no posterior"
                )
            if not cfg["data"]["validation"]:
                raise config_module.ConfigError(
                    "[data].validation must hold out training examples (e.g. 20% of them): "
                    "the estimate is compared with a validation split's NLL"
                )


def resolve(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """(label → seed → resolved run config, the resolved ``[memory.loo]`` table): the
    runs as :func:`experiments.memory_map.resolve` takes them, whose ``[memory]`` table
    holds this driver's sub-table."""
    configs, memory = memory_map.resolve(raw, seeds)
    table = config_module.fill("[memory.loo]", memory["loo"], LOO)
    _check(table, configs)
    return configs, table


def with_delta(cfg: dict[str, Any], delta: float) -> dict[str, Any]:
    """``cfg`` with the prior precision ``delta``."""
    out = copy.deepcopy(cfg)
    out["optimizer"]["prior_precision"] = float(delta)
    return out


def _nll(log_p: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    m = predictive.metrics(log_p, y)
    return {"nll": float(m["nll"]), "accuracy": float(m["accuracy"])}


def evaluate(run: Any, table: dict[str, Any], seed: int) -> dict[str, Any]:
    """The summary of one trained run (module docstring)."""
    x, y = train_inputs(run)
    data = run.data
    held_x = data.normalize(data.to_unit(data.test_x)).to(run.device)
    held_y = data.test_y.to(run.device)
    dcfg = run.cfg["data"]
    options = {k: v for k, v in dcfg.items() if k not in config_module.SECTIONS["data"]}
    full = load_dataset(dcfg["name"], dcfg["root"], **options)
    test_x = full.normalize(full.to_unit(full.test_x)).to(run.device)
    test_y = full.test_y.to(run.device)

    def estimate(form: str) -> float | None:
        """The estimate, None where the corrected form is undefined (λv ≥ 1)."""
        try:
            value = lgb.loo_nll(
                run.model,
                run.optimizer,
                x,
                y,
                form=form,
                samples=table["samples"],
                batch_size=table["batch_size"],
                generator=torch.Generator(run.device).manual_seed(seed),
            )
        except ValueError as err:
            if not str(err).startswith("form: the corrected"):
                raise
            return None
        return float(value)

    post = lgb.Posterior.from_optimizer(run.optimizer, run.model).with_point_estimate("mean")
    mm = lgb.memory_map(
        run.model,
        run.optimizer,
        x,
        y,
        samples=table["samples"],
        batch_size=table["batch_size"],
        generator=torch.Generator(run.device).manual_seed(seed),
    )
    p_label = mm.predictions.gather(1, y[:, None])[:, 0]
    leverage = (mm.predictions - mm.predictions.square()) * mm.variances  # λv
    out: dict[str, Any] = {
        "loo": {form: estimate(form) for form in lgb.memory.LOO_FORMS},
        "train": float(-p_label.log().mean()),
        "leverage_max": float(leverage.max()),
        "leverage_at_least_1": int((leverage >= 1).any(-1).sum()),
        "method": mm.method,
        "prior_precision": float(run.optimizer.param_groups[0]["prior_precision"]),
        "train_size": len(y),
    }
    for name, (xs, ys) in (("validation", (held_x, held_y)), ("test", (test_x, test_y))):
        with post.at_point_estimate(run.model):
            point = predictive.predictive_log_probs(run.model, [xs])
        average = predictive.predictive_log_probs(run.model, [xs], run.optimizer, table["samples"])
        out[name] = {"point": _nll(point, ys), "average": _nll(average, ys), "size": len(ys)}
    return out


def value(summary: dict[str, Any], criterion: str) -> float:
    """The NLL of ``criterion`` (:data:`CRITERIA`) in a summary."""
    where, key = CRITERIA[criterion]
    entry = summary[where]
    if where == "loo":
        return math.nan if entry[key] is None else float(entry[key])
    return float(entry) if key is None else float(entry[key]["nll"])


def picks(by_delta: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The δ of the lowest value of each criterion (over the δ where it is defined):
    criterion → δ (None if it is defined nowhere)."""
    out: dict[str, float | None] = {}
    for c in CRITERIA:
        defined = [d for d in by_delta if not math.isnan(value(by_delta[d], c))]
        best = min(defined, key=lambda d: value(by_delta[d], c)) if defined else None
        out[c] = None if best is None else float(best.removeprefix("delta"))
    return out


def figure(results: dict[str, Any], path: Path, data: str) -> None:
    """Per run, the criteria's mean over seeds against δ (log axis), ± sd as error bars, the
    δ each picks marked; ``data`` names the data set and model in the titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 4.6), squeeze=False)
    styles = {
        "loo corrected": ("tab:blue", "-", "o"),
        "loo first order": ("tab:cyan", ":", "."),
        "train": ("0.6", "--", "."),
        "validation (point)": ("tab:orange", "-", "s"),
        "validation (average)": ("tab:orange", ":", "D"),
        "test (point)": ("tab:red", "-", "^"),
        "test (average)": ("tab:red", ":", "v"),
    }
    for ax, label in zip(axes[0], labels, strict=True):
        per_seed = results[label]["per_seed"]
        deltas = [d for d in next(iter(per_seed.values())) if d.startswith("delta")]
        deltas.sort(key=lambda d: float(d.removeprefix("delta")))
        xs = [float(d.removeprefix("delta")) for d in deltas]
        for c, (colour, ls, marker) in styles.items():
            means, sds = [], []
            for d in deltas:
                vals = [value(summaries[d], c) for summaries in per_seed.values()]
                if any(math.isnan(v) for v in vals):  # undefined for a seed: not drawn
                    means.append(math.nan)
                    sds.append(0.0)
                    continue
                means.append(statistics.fmean(vals))
                sds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
            ax.errorbar(xs, means, yerr=sds, color=colour, ls=ls, marker=marker, label=c)
            defined = [k for k in range(len(xs)) if not math.isnan(means[k])]
            if defined:
                best = min(defined, key=means.__getitem__)
                ax.plot(xs[best], means[best], marker="*", ms=14, color=colour, mec="k")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prior precision δ")
        ax.set_ylabel("NLL per example (point: at the posterior mean)")
        seeds = len(per_seed)
        ax.set_title(
            f"{data}, {label} rule: mean ± sd over {seeds} seed(s); ★ the lowest\n"
            "(a line stops where the corrected estimate is undefined, λv ≥ 1)",
            fontsize=10,
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_selection(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Train every run, δ and seed of ``raw`` into ``out`` and compare the criteria."""
    out = Path(out)
    configs, table = resolve(raw, seeds)
    grid = {f"delta{d:g}": float(d) for d in table["prior_precisions"]}
    expanded = {
        label: {s: [with_delta(cfg, d) for d in grid.values()] for s, cfg in by_seed.items()}
        for label, by_seed in configs.items()
    }
    check_runs(
        {
            f"{lab}/{i}": {s: c[i] for s, c in b.items()}
            for lab, b in expanded.items()
            for i in range(len(grid))
        }
    )
    with runfiles.locked(out):
        skeleton.prepare_folder(out, skeleton.written(configs), resume, {"loo": table})
        results: dict[str, Any] = {}
        for label, by_seed in expanded.items():
            per_seed: dict[str, Any] = {}
            for seed, cfgs in by_seed.items():
                summaries = {}
                for name, cfg in zip(grid, cfgs, strict=True):
                    folder = out / label / name / f"seed{seed}"
                    path = folder / "summary.json"
                    if path.exists():
                        summaries[name] = runfiles.read_json(path)
                    else:
                        run = trained(cfg, folder / "train")
                        summaries[name] = evaluate(run, table, seed)
                        runfiles.write_json(path, summaries[name])
                per_seed[f"seed{seed}"] = {**summaries, "picks": picks(summaries)}
            results[label] = {
                "seeds": list(by_seed),
                "summary": aggregate(list(per_seed.values())),
                "per_seed": per_seed,
            }
        runfiles.write_json(out / "results.json", results)
        write_docs_summary(out)
        first = next(iter(next(iter(configs.values())).values()))
        figure(results, out / "model_selection.png", skeleton.data_name(first, out))
    return results


def _show(results: dict[str, Any], out: Path) -> None:
    for label, res in results.items():
        for seed, summaries in res["per_seed"].items():
            chosen = summaries["picks"]
            print(f"{label} {seed}: " + ", ".join(f"{c} δ={d}" for c, d in chosen.items()))
    print(f"results in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, model_selection, _show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
