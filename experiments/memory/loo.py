"""Model selection by the leave-one-out NLL estimated from one training run.

    python -m experiments.memory.loo CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]

CONFIG is a run config (or a comparison config with ``[runs.LABEL]`` tables) of a Lie-group
BLR optimizer whose ``[data]`` holds out ``validation`` training examples, with a ``[memory.loo]``
table (:data:`LOO`): a grid of prior precisions δ. For every run, δ and seed, into
``DIR/LABEL/deltaD/seedS``, the run trains once on the rest of the training set
(:func:`experiments.memory.maps.trained`; ``--resume`` continues its checkpoint), then
``summary.json`` holds, each as a mean NLL per example:

- ``loo``: the leave-one-out NLL of the training examples estimated from the posterior alone
  (:func:`liegroup_blr.loo_nll`), in both forms (``corrected``, ``first_order``), and
  ``train``: the same NLL without the shift (the training NLL at that prediction);
  ``loo_sources``: the estimate from every variance source of :data:`SOURCES` (the rule's
  posterior, a diagonal GGN, K-FAC and the exact GGN at the mean; cross-class terms), both
  forms, None where undefined, and ``loo_seconds``, what each source took;
- ``validation`` and ``test``: the NLL of the held-out training examples and of the test
  set, at the posterior mean (``point``, the prediction the estimate shifts) and averaged
  over ``samples`` posterior samples (``average``), with their accuracies.

``DIR`` gets ``config.json`` (every resolved config and the ``[memory.loo]`` table),
``results.json`` (per run: ``per_seed``, per seed the summary of every δ, ``deltaD``, and
the δ each criterion picks, ``picks``; ``summary``, their mean ± sd over seeds, and
``selection``: per criterion its target (:data:`TARGETS`), picks, how many seeds pick within
one grid step of the target's pick, and the NLL cost of its pick),
``docs_summary.json`` (:func:`experiments.memory.converged.write_docs_summary`: what
``docs/results/NAME.json`` holds) and ``model_selection.png`` (the criteria against δ).
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.memory.loo"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import copy
import functools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import liegroup_blr as lgb
from experiments.common import config as config_module
from experiments.common import runfiles, skeleton
from experiments.common.data import load_dataset
from experiments.common.training import check_runs
from experiments.memory import maps as memory_map
from experiments.memory.converged import write_docs_summary
from experiments.memory.maps import trained
from experiments.memory.scores import train_inputs
from experiments.memory.stats import aggregate
from liegroup_blr import predictive

LOO: dict[str, Any] = {
    "prior_precisions": [1.0, 4.0, 16.0, 64.0, 256.0],
    "samples": 64,
    "batch_size": 256,
}
"""The ``[memory.loo]`` table with its defaults: the grid of prior precisions δ (each a training
run), ``samples`` posterior samples for the model average (and for a sample-form variance),
``batch_size`` examples per batch of the estimate."""

SOURCES = ("posterior", "diagonal_ggn", "kfac", "ggn")
"""The variance sources of :func:`liegroup_blr.loo_nll` (``variance=``) whose estimates
``loo_sources`` holds, each with the cross-class terms (the whole Λ_i and V_i); the
library's ``"hessian"`` is left out (170 s for one digits run, and at δ = 1, seed 0 its
N·H + δ was not positive definite at the trained mean)."""
EXACT_LIMIT = 5_000
"""The most parameters for which the exact sources (``ggn``, ``hessian``) are computed (each
run inverts a P × P matrix); above, their entries are None."""

CRITERIA: dict[str, tuple[str, Any]] = {
    "loo corrected": ("loo", "corrected"),
    "loo first order": ("loo", "first_order"),
    **{
        f"loo {source} {form.replace('_', ' ')}": ("loo_sources", (source, form))
        for source in SOURCES
        for form in ("corrected", "first_order")
    },
    "train": ("train", None),
    "validation (point)": ("validation", "point"),
    "validation (average)": ("validation", "average"),
    "test (point)": ("test", "point"),
    "test (average)": ("test", "average"),
}
"""The criteria compared, by name: where each lies in a summary. ``loo corrected`` and ``loo
first order`` are the rule's posterior's estimate without the cross-class terms (the
memory-perturbation paper's diagonal form); ``loo SOURCE FORM`` each source's with them."""

TARGETS = {
    **{c: "validation (point)" for c in CRITERIA if c.startswith("loo")},
    "train": "validation (point)",
    "validation (point)": "test (point)",
    "validation (average)": "test (average)",
}
"""What each criterion estimates, by the criterion that measures it on held-out data from the
training distribution: every leave-one-out form shifts the logits at the posterior mean and
takes the plug-in softmax there, so it estimates the held-out NLL of the prediction at the
mean (``validation (point)``, the validation split being drawn from the training set); the
validation NLLs estimate the test NLLs of the same predictive (where the test set is drawn
as the training set is)."""


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
    runs as :func:`experiments.memory.maps.resolve` takes them, whose ``[memory]`` table
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

    def sources() -> tuple[dict[str, Any], dict[str, float]]:
        """Every source's estimate in both forms (None where undefined), with cross-class
        terms (:func:`liegroup_blr.loo_nll`); and the seconds each source took, both forms."""
        size = sum(p.numel() for p in run.model.parameters())
        out_: dict[str, Any] = {}
        seconds: dict[str, float] = {}
        for source in SOURCES:
            start = time.perf_counter()
            out_[source] = {"corrected": None, "first_order": None}
            if source in ("ggn", "hessian") and size > EXACT_LIMIT:
                continue
            for form in lgb.memory_maps.LOO_FORMS:
                try:
                    value = lgb.loo_nll(
                        run.model,
                        run.optimizer,
                        x,
                        y,
                        form=form,
                        variance=source,
                        cross_class=True,
                        samples=table["samples"],
                        batch_size=table["batch_size"],
                        generator=torch.Generator(run.device).manual_seed(seed),
                    )
                except ValueError as err:  # undefined: the corrected form, a Hessian not PD
                    if not str(err).startswith(("form: the corrected", "variance: the 'hessian'")):
                        raise
                    continue
                out_[source][form] = float(value)
            seconds[source] = time.perf_counter() - start
        return out_, seconds

    post = lgb.Posterior.from_optimizer(run.optimizer, run.model).with_point_at("mean")
    loo_sources, seconds = sources()
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
        "loo": {form: estimate(form) for form in lgb.memory_maps.LOO_FORMS},
        "loo_sources": loo_sources,
        "loo_seconds": seconds,
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
    """The NLL of ``criterion`` (:data:`CRITERIA`) in a summary (NaN where it is undefined or
    the summary does not hold it)."""
    where, key = CRITERIA[criterion]
    if where == "loo_sources":  # absent from summaries written before the sources
        got = summary.get(where, {}).get(key[0], {}).get(key[1])
        return math.nan if got is None else float(got)
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


def selection(per_seed: dict[str, dict[str, Any]], grid: Sequence[float]) -> dict[str, Any]:
    """Per criterion with a target (:data:`TARGETS`): its picks per seed, its target's, on how
    many seeds it lies within one step of the grid of its target's pick (``within_one``), and
    what its pick costs in the target's NLL against the target's best δ (``cost``), and in
    the test NLL at the mean against the best δ for it (``test_cost``), means over the
    seeds where it picks a δ."""
    order = sorted(float(d) for d in grid)
    out: dict[str, Any] = {}
    for c, target in TARGETS.items():
        rows: dict[str, Any] = {"target": target, "picks": [], "target_picks": [], "within_one": 0}
        costs, test_costs = [], []
        for summaries in per_seed.values():
            chosen, best = summaries["picks"][c], summaries["picks"][target]
            rows["picks"].append(chosen)
            rows["target_picks"].append(best)
            if chosen is None or best is None:
                continue
            rows["within_one"] += abs(order.index(chosen) - order.index(best)) <= 1
            at = {
                float(d.removeprefix("delta")): s
                for d, s in summaries.items()
                if d.startswith("delta")
            }
            costs.append(value(at[chosen], target) - value(at[best], target))
            test_best = summaries["picks"]["test (point)"]
            test_costs.append(
                value(at[chosen], "test (point)") - value(at[test_best], "test (point)")
            )
        rows["seeds"] = len(per_seed)
        rows["picks"] = aggregate(rows["picks"])  # {"mean", "sd", "values"}: docs quote values
        rows["target_picks"] = aggregate(rows["target_picks"])
        rows["cost"] = statistics.fmean(costs) if costs else None
        rows["test_cost"] = statistics.fmean(test_costs) if test_costs else None
        out[key(c)] = rows
    return out


def key(criterion: str) -> str:
    """A criterion's name as a key without spaces or brackets (``docs/results`` keys):
    ``"loo ggn corrected"`` → ``"loo_ggn_corrected"``, ``"validation (point)"`` →
    ``"validation_point"``."""
    return criterion.replace(" (", "_").replace(")", "").replace(" ", "_")


STYLES: dict[str, tuple[str, Any, str]] = {
    "loo corrected": ("tab:blue", "-", "o"),
    "loo first order": ("tab:cyan", (0, (1, 1)), "P"),
    "train": ("0.45", "--", "x"),
    "validation (point)": ("tab:orange", "-", "s"),
    "validation (average)": ("tab:orange", (0, (3, 1, 1, 1)), "D"),
    "test (point)": ("tab:red", "-.", "^"),
    "test (average)": ("tab:red", ":", "v"),
}
"""Colour, line style and marker of each criterion in :func:`figure`: a marker of its own
each, and no two criteria of one colour share a line style; a criterion not here takes
the next of :data:`MORE_MARKERS` (:func:`styles`)."""
MORE_MARKERS = ("<", ">", "p", "h", "d", "8", "H", "1", "2", "3", "4", "+", "|", "_")
DODGE, SPREAD = 0.04, 0.3
"""How far apart (in decades of δ) :func:`figure` draws the criteria at one δ, so that
values that coincide (every criterion at the largest δ) stay apart, and the widest the
criteria of one δ may spread (many criteria: closer together)."""


def styles(criteria: Sequence[str]) -> dict[str, tuple[Any, Any, str]]:
    """Colour, line style and marker of each of ``criteria``: :data:`STYLES`, else a marker
    of :data:`MORE_MARKERS` each (distinct for up to that many more criteria)."""
    import matplotlib.pyplot as plt

    out: dict[str, tuple[Any, Any, str]] = {}
    more = [c for c in criteria if c not in STYLES]
    for c in criteria:
        if c in STYLES:
            out[c] = STYLES[c]
            continue
        k = more.index(c)
        dashes = ("-", "--", "-.", ":")[k % 4]
        out[c] = (plt.get_cmap("tab20")(k % 20), dashes, MORE_MARKERS[k % len(MORE_MARKERS)])
    return out


def figure(results: dict[str, Any], path: Path, data: str) -> None:
    """Per run, the criteria's mean over seeds against δ (log axis), ± sd as error bars, the
    δ each picks marked; ``data`` names the data set and model in the titles. Each criterion
    has its own marker and line style (:func:`styles`) and is drawn a little to the side
    of δ (:data:`DODGE`), so that none hides another where their values coincide; the
    criteria drawn are those of :data:`CRITERIA` the summaries hold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, axes = plt.subplots(1, len(labels), figsize=(8.0 * len(labels), 5.0), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        per_seed = results[label]["per_seed"]
        deltas = [d for d in next(iter(per_seed.values())) if d.startswith("delta")]
        deltas.sort(key=lambda d: float(d.removeprefix("delta")))
        first = next(iter(per_seed.values()))[deltas[0]]
        drawn = styles([c for c in CRITERIA if CRITERIA[c][0] in first])
        step = min(DODGE, SPREAD / max(1, len(drawn) - 1))
        for k, (c, (colour, ls, marker)) in enumerate(drawn.items()):
            shift = 10 ** (step * (k - (len(drawn) - 1) / 2))
            xs = [float(d.removeprefix("delta")) * shift for d in deltas]
            means, sds = [], []
            for d in deltas:
                vals = [value(summaries[d], c) for summaries in per_seed.values()]
                if any(math.isnan(v) for v in vals):  # undefined for a seed: not drawn
                    means.append(math.nan)
                    sds.append(0.0)
                    continue
                means.append(statistics.fmean(vals))
                sds.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
            ax.errorbar(
                xs,
                means,
                yerr=sds,
                color=colour,
                ls=ls,
                marker=marker,
                ms=5,
                lw=1.3,
                mfc="none" if marker not in ("x", "P") else colour,
                mew=1.3,
                capsize=2,
                label=c,
            )
            defined = [k for k in range(len(xs)) if not math.isnan(means[k])]
            if defined:
                best = min(defined, key=means.__getitem__)
                ax.plot(xs[best], means[best], marker="*", ms=12, color=colour, mec="k", zorder=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prior precision δ (each criterion drawn slightly to the side of its δ)")
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


def _seed_value(metrics: dict[str, Any], delta: str, i: int, key: str) -> float | None:
    """The ``i``-th seed's value of ``delta.key`` in a docs summary's metrics (None: none)."""
    leaf = metrics.get(f"{delta}.{key}")
    return None if leaf is None else leaf["values"][i]


def _sources_from_docs(metrics: dict[str, Any], at: Any) -> dict[str, Any]:
    """``loo_sources`` (per variance source and form) if the docs summary holds it."""
    keys = [k.split(".loo_sources.", 1)[1] for k in metrics if ".loo_sources." in k]
    if not keys:
        return {}
    sources = dict.fromkeys(k.split(".", 1)[0] for k in keys)
    forms = ("corrected", "first_order")
    return {"loo_sources": {s: {f: at(f"loo_sources.{s}.{f}") for f in forms} for s in sources}}


def results_from_docs(docs_summary: dict[str, Any]) -> dict[str, Any]:
    """The ``per_seed`` summaries (every criterion of :data:`CRITERIA` per δ) of a
    ``docs/results`` summary (:func:`experiments.memory.converged.write_docs_summary`),
    for :func:`figure` without training; a criterion a seed lacks at a δ (the corrected
    estimate where it is undefined) is None there."""
    out: dict[str, Any] = {}
    for label, entry in docs_summary["labels"].items():
        seeds = entry["seeds"]
        per_seed: dict[str, dict[str, Any]] = {f"seed{s}": {} for s in seeds}
        deltas = {k.removesuffix(".train") for k in entry["metrics"] if k.endswith(".train")}
        deltas |= {k.split(".loo.", 1)[0] for k in entry["metrics"] if ".loo." in k}
        for delta in sorted(d for d in deltas if d.startswith("delta")):
            for i, seed in enumerate(seeds):
                at = functools.partial(_seed_value, entry["metrics"], delta, i)
                per_seed[f"seed{seed}"][delta] = {
                    "loo": {form: at(f"loo.{form}") for form in ("corrected", "first_order")},
                    "train": at("train"),
                    **_sources_from_docs(entry["metrics"], at),
                    **{
                        split: {e: {"nll": at(f"{split}.{e}.nll")} for e in ("point", "average")}
                        for split in ("validation", "test")
                    },
                }
        out[label] = {"seeds": seeds, "per_seed": per_seed}
    return out


def docs_figure(docs_summary: dict[str, Any], path: Path) -> None:
    """:func:`figure` of a ``docs/results`` summary (its ``full_config`` names the data)."""
    runs = docs_summary["full_config"]["runs"]
    first = next(iter(next(iter(runs.values())).values()))
    figure(results_from_docs(docs_summary), path, skeleton.data_name(first, path.parent))


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
                "summary": {
                    **aggregate(list(per_seed.values())),
                    "selection": selection(per_seed, list(grid.values())),
                },
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
        for c, row in res["summary"]["selection"].items():
            chosen_, best_ = (
                v["values"] if isinstance(v, dict) else v
                for v in (row["picks"], row["target_picks"])
            )
            print(
                f"{label} {c}: picks {chosen_}, target {row['target']} "
                f"{best_}, within one step on {row['within_one']} of "
                f"{row['seeds']}, cost {row['cost']}, test cost {row['test_cost']}"
            )
    print(f"results in {out}")


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, __doc__, model_selection, _show, argv, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
