r"""Continual-learning metrics over accuracy matrices, their summary over seeds, the report
and the figure of :mod:`experiments.continual.learn`.

The accuracy matrix :math:`R` of a run has :math:`R_{ij}` = test accuracy on task i after
learning task j (tasks 0 … T − 1). From it:

- average accuracy after task j, :math:`A_j = \frac1{j+1}\sum_{i\le j} R_{ij}`;
- the first task's accuracy just after learning it, :math:`R_{00}` (is a task learned at
  all in the passes given?);
- backward transfer (Lopez-Paz & Ranzato, 2017),
  :math:`\mathrm{BWT} = \frac1{T-1}\sum_{i<T-1} (R_{i,T-1} - R_{ii})` (negative: forgetting);
- forgetting (Chaudhry et al., 2018), the mean over the tasks before the last of the
  largest drop from an earlier accuracy to the final one,
  :math:`\frac1{T-1}\sum_{i<T-1} \max_{i\le l<T-1} (R_{il} - R_{i,T-1})`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from experiments.common import figures
from experiments.common.tables import LEFT, RIGHT, markdown

ESTIMATES = {"point": "at g", "mean": "at the mean", "average": "model average"}
SUMMARY_KEYS = ("final_accuracy", "first_task", "bwt", "forgetting", "nll", "ece")


def _square(matrix: ArrayLike) -> np.ndarray:
    r = np.asarray(matrix, dtype=float)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] < 1:
        raise ValueError(f"matrix: an accuracy matrix is T × T, got shape {r.shape}")
    return r


def average_accuracy(matrix: ArrayLike) -> list[float]:
    """:math:`A_j`, the mean accuracy over the tasks learned so far, after each task j."""
    r = _square(matrix)
    return [float(r[: j + 1, j].mean()) for j in range(len(r))]


def backward_transfer(matrix: ArrayLike) -> float:
    """BWT: the mean change of each earlier task's accuracy from just after learning it to
    the end of the stream (0 for a single task)."""
    r = _square(matrix)
    t = len(r)
    if t == 1:
        return 0.0
    return float(np.mean([r[i, t - 1] - r[i, i] for i in range(t - 1)]))


def forgetting(matrix: ArrayLike) -> float:
    """The mean over earlier tasks of the largest drop from an accuracy held after learning
    it to the final one (0 for a single task; negative only when every task ends at its
    best and some gained)."""
    r = _square(matrix)
    t = len(r)
    if t == 1:
        return 0.0
    return float(np.mean([r[i, i : t - 1].max() - r[i, t - 1] for i in range(t - 1)]))


def matrix(rows: Sequence[Mapping[str, Any]], estimate: str, key: str = "accuracy") -> np.ndarray:
    """:math:`R_{ij}` from a run's rows (row j holds every task's metrics after task j)."""
    return np.asarray([row[estimate][key] for row in rows], dtype=float).T


def run_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per estimate: the accuracy matrix, average accuracy after each task, final average
    accuracy, the first task's accuracy after it, BWT, forgetting, and the NLL and ECE over
    the evaluation sets of every task after the last one (pooled)."""
    out: dict[str, Any] = {}
    for estimate in ESTIMATES:
        if estimate not in rows[0]:
            continue
        r = matrix(rows, estimate)
        curve = average_accuracy(r)
        final = rows[-1][estimate]["seen"]
        out[estimate] = {
            "matrix": r.tolist(),
            "average_accuracy": curve,
            "final_accuracy": curve[-1],
            "first_task": float(r[0, 0]),
            "bwt": backward_transfer(r),
            "forgetting": forgetting(r),
            "nll": final["nll"],
            "ece": final["ece"],
        }
    out["train_seconds"] = sum(row["train_seconds"] for row in rows)
    out["eval_seconds"] = sum(row["eval_seconds"] for row in rows)
    return out


def _mean_sd(values: Sequence[float]) -> dict[str, Any]:
    numbers = [float(v) for v in values]
    sd = statistics.stdev(numbers) if len(numbers) > 1 else None
    return {"mean": statistics.fmean(numbers), "sd": sd, "values": numbers}


def over_seeds(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean, sample standard deviation and values over seeds of every number of
    :func:`run_summary` (lists and matrices entry by entry)."""
    out: dict[str, Any] = {
        key: _mean_sd([s[key] for s in summaries]) for key in ("train_seconds", "eval_seconds")
    }
    for estimate in (e for e in ESTIMATES if e in summaries[0]):
        parts = [s[estimate] for s in summaries]
        out[estimate] = {key: _mean_sd([p[key] for p in parts]) for key in SUMMARY_KEYS}
        curves = np.asarray([p["average_accuracy"] for p in parts])
        out[estimate]["average_accuracy"] = [_mean_sd(c) for c in curves.T]
        mats = np.asarray([p["matrix"] for p in parts])
        out[estimate]["matrix"] = mats.mean(axis=0).tolist()
    return out


def _cell(leaf: Mapping[str, Any], factor: float = 100.0, decimals: int = 1) -> str:
    mean = f"{factor * leaf['mean']:.{decimals}f}"
    return mean if leaf["sd"] is None else f"{mean} ± {factor * leaf['sd']:.{decimals}f}"


def _estimates(summary: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """method → estimate → its summary, for the estimates each method has."""
    return {m: {e: s[e] for e in ESTIMATES if e in s} for m, s in summary.items()}


def _trained(summary: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`_estimates` of the methods with a seed that trained (not diverged on every
    seed)."""
    return {m: by_estimate for m, by_estimate in _estimates(summary).items() if by_estimate}


def diverged_note(seeds: Sequence[int], diverged: Sequence[int]) -> str:
    """What a method's row says of its diverged seeds ("" if none diverged)."""
    if not diverged:
        return ""
    if len(diverged) == len(seeds):
        return "diverged on every seed"
    return f"seed{'s' if len(diverged) > 1 else ''} {', '.join(map(str, diverged))} diverged"


def tables(
    summary: Mapping[str, Mapping[str, Any]], samples: int, notes: Mapping[str, str] | None = None
) -> list[str]:
    """Markdown: the final metrics, then average accuracy after each task; ``notes`` (method →
    :func:`diverged_note`) mark the methods with diverged seeds, and a method that diverged on
    every seed has a row that says so."""
    notes = notes or {}
    head = ["method", "estimate", "final avg. accuracy (%)", "task 1 after task 1 (%)"]
    head += ["BWT (%)", "forgetting (%)", "NLL", "ECE"]
    final, curves = [], []
    for method, by_estimate in _estimates(summary).items():
        label = f"{method} ({notes[method]})" if notes.get(method) else method
        if not by_estimate:
            final.append([label, "—", *[""] * 6])
        for estimate, s in by_estimate.items():
            name = ESTIMATES[estimate] + (f" of {samples}" if estimate == "average" else "")
            cells = [_cell(s[k]) for k in ("final_accuracy", "first_task", "bwt", "forgetting")]
            cells += [_cell(s["nll"], 1.0, 3), _cell(s["ece"], 1.0, 3)]
            final.append([label, name, *cells])
            curves.append([label, ESTIMATES[estimate], *map(_cell, s["average_accuracy"])])
    tasks = max(len(s["point"]["average_accuracy"]) for s in _trained(summary).values())
    return [
        *markdown(head, final, [LEFT] * 2 + [RIGHT] * 6),
        "",
        "Average accuracy (%) over the tasks learned so far, after each task:",
        "",
        *markdown(
            ["method", "estimate", *(str(t + 1) for t in range(tasks))],
            curves,
            [LEFT] * 2 + [RIGHT] * tasks,
        ),
    ]


def matrix_table(mean_matrix: Sequence[Sequence[float]]) -> list[str]:
    """Markdown of a mean accuracy matrix: a row per task, a column per task learned."""
    r = np.asarray(mean_matrix)
    t = len(r)
    rows = [[str(i + 1), *(f"{100 * r[i, j]:.1f}" for j in range(t))] for i in range(t)]
    head = ["task \\ after", *(str(j + 1) for j in range(t))]
    return markdown(head, rows, [LEFT] + [RIGHT] * t)


def _notes(seeds: Sequence[int], diverged: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """method → :func:`diverged_note` of its ``diverged`` seeds among ``seeds``."""
    return {method: diverged_note(seeds, lost) for method, lost in diverged.items()}


def _label(method: str, by_estimate: Mapping[str, Any], samples: int, note: str) -> str:
    """A method's label in the figures, in words (:func:`label_words`): its estimate shown
    and its diverged seeds."""
    parts = [f"average of {samples}"] if "average" in by_estimate else []
    parts += [note] if note else []
    words = label_words(method)
    return f"{words} ({'; '.join(parts)})" if parts else words


RULES = ("affine", "additive", "multiplicative")
"""The Lie-group rules by the name their methods' labels start with (``affine``,
``affine_no_prior``, ``affine_kprior_lambda`` …): one panel each in the average-accuracy
figure, the other methods (the baselines) in grey in every panel."""

USES = {
    "kprior": "K-prior",
    "fromp": "FROMP",
    "fromp_logits": "FROMP on the logits",
    "replay": "replay",
}
"""A memory's use (``memory_use``) as a label part, in words."""

LABEL_PARTS: dict[tuple[str, ...], str] = {
    ("no", "prior"): "prior removed",
    ("posterior",): "posterior as prior",
    ("finetune",): "fine-tuning",
    ("ewc",): "EWC",
    ("joint",): "joint",
    **{tuple(use.split("_")): words for use, words in USES.items()},
    ("lambda",): "λ points",
    ("random",): "random points",
    ("score",): "memory-map score points",
    ("sensitivity",): "memory-map score points",
    ("memory",): "memory",
    ("delta",): "δ-prior at the previous mean",
    ("logits",): "on the logits",
    ("probabilities",): "on the probabilities",
    ("adam",): "Adam",
    ("sgd",): "SGD",
}
"""The parts of a method's label (split at ``_``) in words: its method or strategy, its
memory's use and its selection; :func:`label_words` composes them, and a part not here reads
as itself."""


def _parts(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """``tokens`` as (part, words), the longest part of :data:`LABEL_PARTS` first."""
    longest = max(map(len, LABEL_PARTS))
    out, i = [], 0
    while i < len(tokens):
        for n in range(min(longest, len(tokens) - i), 0, -1):
            key = tuple(tokens[i : i + n])
            if key in LABEL_PARTS or n == 1:
                out.append(("_".join(key), LABEL_PARTS.get(key, key[0])))
                i += n
                break
    return out


def label_words(label: str, rule: bool = True) -> str:
    """A method's label in words, from its parts: a rule's rows read ``affine, posterior as
    prior`` (the label is the rule alone), ``affine, prior removed`` (``_no_prior``),
    ``affine, K-prior, λ points`` (``_kprior_lambda``); a baseline's ``fine-tuning``,
    ``EWC``, ``EWC + replay, random points`` (a method, then the memory it adds).
    ``rule=False`` leaves the rule's name out (a panel of that rule)."""
    tokens = [t for t in label.split("_") if t]
    if tokens and tokens[0] in RULES:
        words = [w for _, w in _parts(tokens[1:])] or ["posterior as prior"]
        return ", ".join([tokens[0], *words] if rule else words)
    parts = _parts(tokens)
    if len(parts) > 1 and parts[1][0] in USES:
        parts[:2] = [("", f"{parts[0][1]} + {parts[1][1]}")]
    return ", ".join(w for _, w in parts) or label


def rule_of(label: str) -> str | None:
    """The rule a method's label starts with (:data:`RULES`), None for a baseline."""
    head = label.split("_", 1)[0]
    return head if head in RULES else None


def _curve(leaves: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Mean and mean ± sd over seeds (%) per task of a summary's ``average_accuracy``."""
    values = [[100 * float(v) for v in leaf["values"]] for leaf in leaves]
    mean = np.asarray([statistics.fmean(v) for v in values])
    sd = np.asarray([statistics.stdev(v) if len(v) > 1 else 0.0 for v in values])
    return {"mean": mean, "low": mean - sd, "high": mean + sd}


def _with_note(words: str, note: str) -> str:
    return f"{words} ({note})" if note else words


def _curves_of(by_estimate: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """:func:`_curve` of a method's model average if it has one (its point estimate as
    ``dashed``), else of its point estimate."""
    estimate = "average" if "average" in by_estimate else "point"
    curve = _curve(by_estimate[estimate]["average_accuracy"])
    if estimate == "average":
        curve["dashed"] = _curve(by_estimate["point"]["average_accuracy"])["mean"]
    return curve


def average_accuracy_figure(
    summary: Mapping[str, Mapping[str, Any]],
    samples: int,
    path: Path,
    title: str = "",
    seeds: Sequence[int] = (),
    diverged: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Average accuracy against tasks learned, one panel per rule (:data:`RULES`) with that
    rule's methods in colour and every other method (the baselines) in grey; a stream whose
    methods are not a rule's is one panel of them all. Per method the mean over seeds as a
    line and a band of ± sd; a rule with a posterior shows its model average of ``samples``
    (said in its panel's title), and its point estimate dashed; the rows are in words
    (:func:`label_words`) and name the ``diverged`` seeds (method → seeds) of the
    ``seeds``."""
    notes = _notes(seeds, diverged or {})
    trained = _trained(summary)
    split = any(rule_of(m) for m in trained)
    panels: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    shared: dict[str, dict[str, np.ndarray]] = {}
    for rule in [r for r in RULES if any(rule_of(m) == r for m in trained)] if split else [""]:
        methods = [m for m in trained if rule_of(m) == rule] if split else list(trained)
        name = f"{rule} rule" if split else ""
        if any("average" in trained[m] for m in methods):
            average = f"model average of {samples}"
            name = f"{name} ({average})" if name else f"a posterior's {average}"
        panels[name] = {}
        for method in methods:
            words = label_words(method, rule=not split)
            panels[name][_with_note(words, notes.get(method, ""))] = _curves_of(trained[method])
    for method in [m for m in trained if split and rule_of(m) is None]:
        words = _with_note(label_words(method), notes.get(method, ""))
        shared[words] = _curves_of(trained[method])
    figures.average_accuracy(panels, path, title, shared)


def final_bars(
    summary: Mapping[str, Mapping[str, Any]], samples: int, notes: Mapping[str, str] | None = None
) -> dict[str, list[float]]:
    """Per method, also one that diverged on every seed (no values), the final average
    accuracy (%) of each seed that trained: a rule's model average of ``samples``, the
    point estimate of a method without a posterior; ``notes`` as in the labels."""
    notes = notes or {}
    bars = {}
    for method, by_estimate in _estimates(summary).items():
        label = _label(method, by_estimate, samples, notes.get(method, ""))
        estimate = "average" if "average" in by_estimate else "point"
        leaf = by_estimate.get(estimate, {}).get("final_accuracy", {"values": []})
        bars[label] = [100 * v for v in leaf["values"]]
    return bars


def final_accuracy_figure(
    summary: Mapping[str, Mapping[str, Any]],
    samples: int,
    path: Path,
    title: str = "",
    seeds: Sequence[int] = (),
    diverged: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Final average accuracy per method, the mean as a bar, each seed that trained as a
    dot and each of the ``diverged`` seeds (method → seeds) as a cross (:func:`final_bars`)."""
    diverged = diverged or {}
    bars = final_bars(summary, samples, _notes(seeds, diverged))
    counts = dict(zip(bars, (len(diverged.get(m, ())) for m in summary), strict=True))
    figures.final_accuracy(bars, path, title, counts)


def stream_name(stream: Mapping[str, Any]) -> str:
    """E.g. ``split mnist5k, multi-head``."""
    heads = f", {stream['heads']}-head" if stream["name"] == "split" else ""
    return f"{stream['name']} {stream['dataset']}{heads}"


def figure_title(cfg: Mapping[str, Any], seeds: Sequence[int]) -> str:
    """The figure's title: the data set and stream, its passes, the network and the seeds."""
    return (
        f"{stream_name(cfg['stream'])}, {cfg['stream']['tasks']} tasks: "
        f"{cfg['train']['epochs']} passes per task, MLP {cfg['model']['widths']}, seeds "
        f"{', '.join(map(str, seeds))}"
    )


def summary_from_docs(labels: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The :func:`over_seeds` summaries (final and average accuracy) of a stream's
    ``docs/results`` summary's ``labels`` (see :mod:`experiments.reporting.docs_tables`)."""
    summary: dict[str, dict[str, Any]] = {}
    for label, entry in labels.items():
        nested: dict[str, dict[str, Any]] = {}
        for key, leaf in entry["metrics"].items():
            estimate, _, rest = key.partition(".")
            name, _, index = rest.partition(".")
            if estimate in ESTIMATES and name == "average_accuracy":
                nested.setdefault(estimate, {}).setdefault(name, {})[int(index)] = leaf
            elif estimate in ESTIMATES and name == "final_accuracy":
                nested.setdefault(estimate, {})[name] = leaf
        for parts in nested.values():
            curve = parts["average_accuracy"]
            parts["average_accuracy"] = [curve[i] for i in sorted(curve)]
        summary[label] = nested
    return summary


def docs_figures(docs_summary: Mapping[str, Any], cfg: Mapping[str, Any], out: Path) -> None:
    """``out/average_accuracy.png`` and ``out/final_accuracy.png`` of a stream from its
    ``docs/results`` summary and one resolved run config ``cfg`` of it, without training."""
    labels = docs_summary["labels"]
    summary = summary_from_docs(labels)
    seeds = next(iter(labels.values()))["seeds"]
    lost = {label: entry.get("diverged", []) for label, entry in labels.items()}
    title, samples = figure_title(cfg, seeds), cfg["eval"]["samples"]
    average_accuracy_figure(summary, samples, out / "average_accuracy.png", title, seeds, lost)
    final_accuracy_figure(summary, samples, out / "final_accuracy.png", title, seeds, lost)


def _hyperparameters(method: Mapping[str, Any]) -> str:
    opt = method["optimizer"]
    keys = [f"{k}={v}" for k, v in opt.items() if k != "name" and v != {}]
    unused = () if method.get("memory") else ("memory_selection", "memory_use", "memory_strength")
    keys += [f"{k}={v}" for k, v in method.items() if k not in ("strategy", "optimizer", *unused)]
    return ", ".join(keys)


def report(
    configs: Mapping[str, Mapping[int, Mapping[str, Any]]], results: Mapping[str, Mapping[str, Any]]
) -> str:
    """The Markdown report of a continual comparison: the setting, the final metrics and the
    average accuracy after each task (mean ± sd over seeds), the mean accuracy matrices, the
    methods and their timings, and the figure."""
    first = next(iter(next(iter(configs.values())).values()))
    stream, model, train, ev = first["stream"], first["model"], first["train"], first["eval"]
    sizes = next(
        r for res in results.values() for r in res["per_seed"].values() if "diverged" not in r
    )
    seeds = next(iter(results.values()))["seeds"]
    summary = {label: r["summary"] for label, r in results.items()}
    notes = {
        label: diverged_note(r["seeds"], r.get("diverged_seeds", []))
        for label, r in results.items()
    }
    lines = [
        f"# Continual learning: {stream_name(stream)}",
        "",
        f"{stream['tasks']} tasks of {_sizes(sizes['train_sizes'])} training and "
        f"{_sizes(sizes['test_sizes'])} {sizes['eval_set']} images; MLP {model['widths']} "
        f"({model['activation']}), {train['epochs']} epochs per task (joint training: "
        f"{train['epochs']} epochs over the union of the tasks learned), batch "
        f"{train['batch_size']}; {len(seeds)} seed(s) {seeds}. Cells are mean ± sample "
        f"standard deviation over the seeds. Accuracies on each task's {sizes['eval_set']} "
        "images; NLL and "
        f"ECE ({ev['bins']} bins) pooled over the test images of every task after the last. "
        f"A rule's model average uses {ev['samples']} posterior samples.",
        "",
        *tables(summary, ev["samples"], notes),
        "",
        "BWT: mean over tasks before the last of (final accuracy − accuracy just after "
        "learning it); forgetting: mean of (best earlier accuracy − final accuracy).",
        "",
        "![average accuracy against tasks learned](average_accuracy.png)",
        "",
        "![final average accuracy per method and seed](final_accuracy.png)",
        "",
        "## Methods",
        "",
    ]
    methods = []
    for label, by_seed in configs.items():
        method = next(iter(by_seed.values()))["method"]
        s = summary[label]
        methods.append(
            [
                label,
                method["strategy"],
                method["optimizer"]["name"],
                _hyperparameters(method),
                _cell(s["train_seconds"], 1.0, 1) if s else notes[label],
                _cell(s["eval_seconds"], 1.0, 1) if s else "",
            ]
        )
    head = ["method", "strategy", "optimizer", "hyperparameters", "train (s)", "eval (s)"]
    lines += markdown(head, methods, [LEFT] * 4 + [RIGHT] * 2)
    lines += ["", "## Accuracy matrices (mean over seeds, %)", ""]
    for label, by_estimate in _estimates(summary).items():
        for estimate, s in by_estimate.items():
            lines += [f"### {label}, {ESTIMATES[estimate]}", "", *matrix_table(s["matrix"]), ""]
    return "\n".join(lines)


def _sizes(sizes: Sequence[int]) -> str:
    low, high = min(sizes), max(sizes)
    return f"{low:,}" if low == high else f"{low:,}–{high:,}"
