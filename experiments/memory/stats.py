"""The statistics of experiments/memory/maps.py: the true changes that retraining measures
and their floors, each ranking's agreement with them (rank and linear correlations, median
ratios), the flipped labels found, and the summaries merged over seeds."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
import torch
from torch import Tensor

from experiments.memory.scores import BASELINES, RANKINGS


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1…n, ties sharing their mean rank."""
    order = values.argsort(kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson's correlation coefficient (NaN for a constant input)."""
    a, b = a - a.mean(), b - b.mean()
    denominator = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum()) / denominator if denominator > 0 else math.nan


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (ties at their mean rank)."""
    return pearson(_ranks(a), _ranks(b))


def _softmax(logits: Any) -> np.ndarray:
    return torch.tensor(np.asarray(logits, dtype=np.float64)).softmax(-1).numpy()


SPACES = {"probabilities": "", "logits": "_logits"}
"""Where changes are measured, with the suffix of their keys in :func:`changes`: the
probabilities (softmax of the mean logits) and the mean logits."""

FLOORS = {
    "drift": "retraining alone",
    "others": "another example removed",
    "permuted": "other permutations",
}
"""What the true change is measured against (:func:`changes`), with its name in reports."""


def changes(rows: list[dict[str, Any]], labels: Tensor, epoch: str) -> dict[str, Any]:
    """Per retrained example i (in the order of the rows' examples), after ``epoch`` epochs,
    of its probabilities p (keys without suffix) and of its mean logits f (suffix
    ``_logits``), as L1 distances:

    - ``truth``: ‖p(without i) − p(control)‖₁, what removing i changes;
    - the floors, with nothing of i's removed: ``drift``, ‖p(control) − p(before
      retraining)‖₁, the change that retraining alone makes (common random numbers);
      ``others``, the median over the other retrained examples j of ‖p(without j) −
      p(control)‖₁, the change that removing some other example makes (common random
      numbers); and ``permuted``, ‖p(control on other permutations) − p(control)‖₁ (no
      common random numbers);

    and ``label``, the change of the probability of i's own label when i is removed."""
    by_kind = {r["kind"]: r for r in rows if r["kind"] != "removed"}
    examples = by_kind["control"]["examples"]
    removed = {r["index"]: r["epochs"][epoch] for r in rows if r["kind"] == "removed"}
    logits = {
        "control": by_kind["control"]["epochs"][epoch],
        "start": by_kind["start"]["epochs"]["0"],
        "permuted": by_kind["permuted"]["epochs"][epoch],
        "without": [removed[i] for i in examples],  # [j removed, k example, K]
    }
    at, n = np.arange(len(examples)), len(examples)
    out: dict[str, Any] = {"examples": examples}
    for space, suffix in SPACES.items():
        v = {
            k: _softmax(f) if space == "probabilities" else np.asarray(f) for k, f in logits.items()
        }
        moved = np.abs(v["without"] - v["control"]).sum(-1)  # [j, k]
        others = np.where(np.eye(n, dtype=bool), np.nan, moved)
        out[f"truth{suffix}"] = moved[at, at]
        out[f"drift{suffix}"] = np.abs(v["control"] - v["start"]).sum(-1)
        out[f"others{suffix}"] = np.nanmedian(others, axis=0) if n > 1 else np.full(n, np.nan)
        out[f"permuted{suffix}"] = np.abs(v["permuted"] - v["control"]).sum(-1)
        if space == "probabilities":
            mine = labels[examples].numpy()
            out["label"] = v["without"][at, at, mine] - v["control"][at, mine]
    return out


def agreement(estimate: np.ndarray, truth: np.ndarray) -> dict[str, float | None]:
    """Spearman, Pearson, Pearson of the logarithms (of the positive pairs) and the median of
    estimate / truth; None where undefined (constant values, fewer than two pairs)."""
    positive = (estimate > 0) & (truth > 0)
    values = {
        "spearman": spearman(estimate, truth),
        "pearson": pearson(estimate, truth),
        "pearson_log": pearson(np.log(estimate[positive]), np.log(truth[positive]))
        if positive.sum() > 1
        else math.nan,
        "median_ratio": median_ratio(estimate, truth),
    }
    return {k: defined(v) for k, v in values.items()}


def median_ratio(a: np.ndarray, b: np.ndarray) -> float:
    """The median of a / b over the pairs with b > 0 (NaN if none)."""
    positive = b > 0
    return float(np.median(a[positive] / b[positive])) if positive.any() else math.nan


def summarise_retraining(
    score: dict[str, Any], rows: list[dict[str, Any]], top: list[int], memory: dict[str, Any]
) -> dict[str, Any]:
    """After each retraining length, over the random examples only: per space
    (:data:`SPACES`) the medians of the true changes and of the floors (:func:`changes`),
    the median ratio of the true change to each floor and how often it exceeds it, and the
    Spearman correlation of the true change with the drift; how often the own label's
    probability drops; and per ranking (:data:`~experiments.memory.scores.RANKINGS`,
    :data:`~experiments.memory.scores.BASELINES`, ``"default"``) its agreement with the true
    change in each space and its Spearman correlation with the drift. Apart
    (``top_over_random``): the median true change of the ``top`` highest-scored examples over
    that of the random ones."""
    out: dict[str, Any] = {}
    for epoch in (str(e) for e in memory["retrain_epochs"]):
        c = changes(rows, score["labels"], epoch)
        examples = np.array(c["examples"])
        is_top = np.isin(examples, top)
        r = {k: v[~is_top] for k, v in c.items() if k != "examples"}
        entry: dict[str, Any] = {
            "random": int((~is_top).sum()),
            "label_drops": float((r["label"] < 0).mean()),
        }
        for space, x in SPACES.items():
            truth = r[f"truth{x}"]
            entry[space] = {
                **{f"{k}_median": float(np.median(r[f"{k}{x}"])) for k in ("truth", *FLOORS)},
                **{f"truth_over_{k}": median_ratio(truth, r[f"{k}{x}"]) for k in FLOORS},
                **{f"above_{k}": float((truth > r[f"{k}{x}"]).mean()) for k in FLOORS},
                "truth_drift_spearman": spearman(truth, r[f"drift{x}"]),
                "top_over_random": float(np.median(c[f"truth{x}"][is_top]) / np.median(truth))
                if is_top.any()
                else math.nan,
            }
        for name in [*RANKINGS, *BASELINES, "default"]:
            est = score[name][examples[~is_top]].double().numpy()
            entry[name] = {
                space: {
                    **agreement(est, r[f"truth{x}"]),
                    "drift": spearman(est, r[f"drift{x}"]),
                }
                for space, x in SPACES.items()
            }
        out[epoch] = alldefined(entry)
    return out


def alldefined(tree: Any) -> Any:
    """``tree`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(tree, dict):
        return {k: alldefined(v) for k, v in tree.items()}
    return defined(tree) if isinstance(tree, float) else tree


def defined(value: float) -> float | None:
    return value if math.isfinite(value) else None


def summarise_flips(flip_score: dict[str, Any], flips: dict[int, int]) -> dict[str, Any]:
    """How many of the k flipped labels land among the k highest of each ranking, and the
    number expected at random (k²/N)."""
    size, k = len(flip_score["labels"]), len(flips)
    found = {
        name: sum(int(i) in flips for i in flip_score[name].argsort(descending=True)[:k].tolist())
        for name in [*RANKINGS, *BASELINES, "default"]
    }
    return {"found": found, "flipped": k, "random": k * k / size}


def against(est: np.ndarray, truth: np.ndarray) -> dict[str, Any]:
    """The estimate against the truth: their median ratio and its quartiles, Spearman, and
    Pearson of the logarithms (over the pairs both positive)."""
    ratio = est / truth
    positive = (est > 0) & (truth > 0)
    return {
        "ratio_median": float(np.median(ratio)),
        "ratio_quartiles": [float(q) for q in np.quantile(ratio, [0.25, 0.75])],
        "spearman": spearman(est, truth),
        "pearson_log": pearson(np.log(est[positive]), np.log(truth[positive])),
    }


def aggregate(values: list[Any]) -> Any:
    """Per-seed summaries of one structure merged leaf by leaf: numbers (None: undefined)
    become ``{"mean", "sd", "values"}`` over the defined ones, other leaves are kept once if
    equal, else as the list of per-seed values."""
    first = values[0]
    if isinstance(first, dict):
        return {key: aggregate([v[key] for v in values]) for key in first}
    numbers = [v for v in values if v is not None]
    if numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        numbers = [float(v) for v in numbers]
        return {
            "mean": statistics.fmean(numbers),
            "sd": statistics.stdev(numbers) if len(numbers) > 1 else None,
            "values": values,
        }
    return first if all(v == first for v in values) else values
