"""Memory maps of a trained posterior, checked against leave-one-out retraining.

    python -m experiments.memory_map CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]
    python -m experiments.memory_map RUN_FOLDER

CONFIG is a run config (or a comparison config with ``[runs.LABEL]`` tables) of a Lie-group
BLR optimizer with a ``[memory]`` table (:data:`MEMORY`). For every run and seed, into
``DIR/LABEL/seedS``:

1. ``train/``: train the run (a checkpoint per epoch; ``--resume`` continues it);
2. ``scores.pt``: every score of :data:`RANKINGS` for the training set (both forms of the
   variance; the change of the probabilities and of the logits, diagonal and with the
   cross-class terms), the library's default, and the baselines of :data:`BASELINES`;
3. ``retrain.jsonl``: leave-one-out retraining of the ``top`` highest-scored (by the
   default) and ``random`` random examples with common random numbers: warm-started from the
   trained posterior with the same noise, on the same batches with the removed example
   taken out of its batch (:class:`Retrainer`); a control with nothing removed on the same
   batches, and one on other permutations. The mean logits over ``samples`` posterior
   samples (the same draws before and after) of every retrained example are kept after each
   of ``retrain_epochs``, and before retraining. One row per retraining, written atomically
   after each: a kill loses at most the one under way, ``--resume`` skips the finished;
4. ``flip/`` and ``flip_scores.pt``: the run trained again with ``flip`` random labels
   changed, and how many of those each score puts among its ``flip`` highest;
5. ``memory_map.png`` and ``flip_memory_map.png`` (the most and least sensitive examples),
   ``error_variance.png`` and ``flip_error_variance.png`` (the two-axis map: prediction error
   against prediction variance, regions named), ``scatter.png`` and ``summary.json``.

``DIR`` gets ``config.json`` (every resolved config and the ``[memory]`` table),
``results.json`` (mean ± sd over seeds) and ``report.md``.

With a RUN_FOLDER (a finished ``experiments.train`` run, or an ``experiments.compare`` folder:
each of its finished runs), it writes the memory map of the run's training set as
``memory_map.png``, ``error_variance.png`` and ``memory_map.json`` into the run's folder,
holding the run's lock.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn.functional import cross_entropy
from tqdm import tqdm

import liegroup_blr as lgb
from experiments import cli, figures, runfiles, skeleton
from experiments import config as config_module
from experiments.data import Dataset, load_dataset
from experiments.distributed import Processes
from experiments.evaluate import posterior_mean
from experiments.progress import Planned
from experiments.skeleton import ProgressHook
from experiments.tables import LEFT, RIGHT, markdown
from experiments.train import (
    CHECKPOINT,
    RESULTS,
    Run,
    build,
    check_runs,
    load_checkpoint,
    save_checkpoint,
    train_epoch,
)
from experiments.train import CONFIG as RUN_CONFIG
from liegroup_blr import predictive
from liegroup_blr.memory import REGIONS

MEMORY: dict[str, Any] = {
    "samples": 64,
    "batch_size": 32,
    "top": 20,
    "random": 30,
    "retrain_epochs": [2, 5, 10],
    "retrain_lr": 0.1,
    "flip": 30,
    "converged": {},
    "loo": {},
}
"""The ``[memory]`` table with its defaults: ``samples`` posterior samples (for the sample
form and for the true change), ``batch_size`` examples per batch of the memory map, ``top``
highest-scored and ``random`` random examples to retrain, the epochs of retraining after
which the change is read (``retrain_epochs``, increasing; it retrains to the last),
``retrain_lr`` its step size as a factor of the run's initial one (constant), ``flip``
labels changed for the mislabelling experiment (0: none), searched for among each score's
``flip`` highest. The sub-tables ``[memory.converged]`` and ``[memory.loo]`` belong to the
sibling drivers ``experiments.memory_converged`` (leave-one-out retraining to convergence)
and ``experiments.memory_loo`` (model selection by the estimated leave-one-out NLL), which
check them; this driver ignores them."""

SCORES: dict[str, dict[str, Any]] = {
    "probabilities": {"change": "probabilities"},
    "probabilities+cross": {"change": "probabilities", "cross_class": True},
    "logits": {"change": "logits"},
    "logits+cross": {"change": "logits", "cross_class": True},
}
"""The score variants, as options of :func:`liegroup_blr.memory_map`: the change of the
probabilities (Σₖ|eₖλₖvₖ|) or of the logits (Σₖ|vₖeₖ|), and both with the cross-class terms."""

FORMS = ("jacobian", "samples")
RANKINGS = [f"{form}:{score}" for form in FORMS for score in SCORES]
"""Every score computed, named ``FORM:SCORE`` (the form of the prediction variance)."""

BASELINES = ("loss", "residual", "variance")
"""Rankings without the estimate: the example's own loss at the point estimate (what a
network without a posterior gives), the residual size ‖eᵢ‖₁ alone (the score with the
variance removed) and the total prediction variance alone (with the residual removed)."""

ERROR_THRESHOLD, VARIANCE_QUANTILE = 1.0, 0.9
"""The region boundaries of the two-axis maps (:meth:`liegroup_blr.memory.MemoryMap.regions`)."""

BLR = ("additive", "multiplicative", "affine")
SCORES_FILE, FLIP_SCORES, RETRAIN, SUMMARY = (
    "scores.pt",
    "flip_scores.pt",
    "retrain.jsonl",
    "summary.json",
)
PROCESSES = Processes()


# -------------------------------------------------------------------- config
def _check_memory(memory: dict[str, Any], configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """The ``[memory]`` table's counts and epochs, and what each run must allow."""
    for key in ("samples", "batch_size", "top", "random"):
        least = 2 if key == "samples" else 1
        if memory[key] < least:
            raise config_module.ConfigError(f"[memory].{key} must be >= {least}, got {memory[key]}")
    epochs = memory["retrain_epochs"]
    if not epochs or any(b <= a for a, b in zip([0, *epochs], epochs, strict=False)):
        raise config_module.ConfigError(
            f"[memory].retrain_epochs must be increasing epochs >= 1, got {epochs}"
        )
    if memory["retrain_lr"] <= 0 or memory["flip"] < 0:
        raise config_module.ConfigError("[memory].retrain_lr must be > 0 and flip >= 0")
    for by_seed in configs.values():
        for cfg in by_seed.values():
            _check_run(cfg)


TABLE = config_module.Table("memory", MEMORY, _check_memory)
"""The driver's own ``[memory]`` table."""


def resolve(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """(label → seed → resolved run config, the resolved ``[memory]`` table)."""
    configs, tables = config_module.driver_configs(raw, [TABLE], seeds)
    return configs, tables["memory"]


def _check_run(cfg: dict[str, Any]) -> None:
    """What leave-one-out retraining needs of a run, refused in one line otherwise."""
    opt, data = cfg["optimizer"], cfg["data"]
    if opt["name"] not in BLR:
        raise config_module.ConfigError(
            f"[optimizer] {opt['name']!r} has no posterior; a memory map needs one of {BLR}"
        )
    if opt.get("vectorize") or opt.get("batch_split", 1) > 1:
        raise config_module.ConfigError(
            "[optimizer].vectorize and batch_split are not supported here: retraining steps "
            "with step(closure), which must draw the noise the training drew"
        )
    if data["augment"] or data["da_factor"] != 1:
        raise config_module.ConfigError(
            "[data].augment must be false and da_factor 1: leaving one example out needs "
            "the training set as it is"
        )


# ------------------------------------------------------------------ training
def _inputs(run: Run) -> tuple[Tensor, Tensor]:
    data = run.data
    return data.normalize(data.to_unit(data.train_x)).to(run.device), data.train_y.to(run.device)


def flipped_labels(labels: Tensor, count: int, classes: int, seed: int) -> dict[int, int]:
    """``count`` random examples and a new label for each, always another class: index →
    new label (drawn from a generator seeded with ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randperm(len(labels), generator=gen)[:count]
    shifts = torch.randint(1, classes, (count,), generator=gen)
    return {int(i): int((labels[i] + s) % classes) for i, s in zip(picks, shifts, strict=True)}


def trained(
    cfg: dict[str, Any],
    folder: Path,
    flips: dict[int, int] | None = None,
    progress: ProgressHook | None = None,
) -> Run:
    """The run of ``cfg`` trained into ``folder`` (``checkpoint.pt`` after every epoch; a
    partial run is continued), with the labels of ``flips`` changed; ``progress`` hears of
    the epochs done."""
    run = build(copy.deepcopy(cfg), PROCESSES)
    if flips:
        index = torch.tensor(list(flips))
        run.data.train_y[index] = torch.tensor(list(flips.values()))
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / CHECKPOINT
    start, history = load_checkpoint(run, ckpt) if ckpt.exists() else (0, [])
    if progress is not None:
        progress(start)
    epochs = cfg["schedule"]["epochs"]
    for epoch, _, loss, _ in skeleton.timed_epochs(
        start, epochs, partial(train_epoch, run), run.scheduler
    ):
        history.append({"epoch": epoch + 1, "train_loss": loss})
        save_checkpoint(run, epoch + 1, ckpt, history)
        if progress is not None:
            progress(epoch + 1)
    return run


def _check_data(configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """What only the data can tell: no augmentation by the dataset's default, and no batch
    that could hold the removed example alone (N mod batch size ≠ 1)."""
    for by_seed in configs.values():
        for cfg in by_seed.values():
            dcfg = cfg["data"]
            options = {k: v for k, v in dcfg.items() if k not in config_module.SECTIONS["data"]}
            data = load_dataset(dcfg["name"], dcfg["root"], **options)
            if dcfg["augment"] is None and data.augment:
                raise config_module.ConfigError(
                    f"[data].augment: {dcfg['name']} is augmented by default; set it to false "
                    "(leaving one example out needs the training set as it is)"
                )
            size, batch = len(data.train_y), dcfg["batch_size"]
            if size % batch == 1:
                raise config_module.ConfigError(
                    f"[data].batch_size {batch}: the last batch of the N = {size} examples "
                    "holds one, which would be empty with it removed; choose a batch size "
                    "that does not divide N − 1"
                )


def metrics_on_test(run: Run, samples: int) -> dict[str, Any]:
    """Test metrics at the point estimate, at the posterior mean where it is another point
    (:func:`experiments.evaluate.posterior_mean`) and of the model average of ``samples``."""
    data = run.data
    x = data.normalize(data.to_unit(data.test_x)).to(run.device)
    y = data.test_y.to(run.device)
    out = {"point": predictive.metrics(predictive.predictive_log_probs(run.model, [x]), y)}
    mean = posterior_mean(run.model, run.optimizer)
    if mean is not None:
        with mean.at_point_estimate(run.model):
            out["mean"] = predictive.metrics(predictive.predictive_log_probs(run.model, [x]), y)
    average = predictive.predictive_log_probs(run.model, [x], run.optimizer, samples)
    return {**out, "average": predictive.metrics(average, y)}


# --------------------------------------------------------------------- scores
def scores(run: Run, memory: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every ranking of the training set: the scores of :data:`RANKINGS`, the library's
    default (``"default"``, with its form ``"auto"`` and the regions of its map), and the
    baselines of :data:`BASELINES`; and the labels."""
    x, y = _inputs(run)

    def memory_map(**options: Any) -> lgb.MemoryMap:
        return lgb.memory_map(
            run.model,
            run.optimizer,
            x,
            y,
            samples=memory["samples"],
            batch_size=memory["batch_size"],
            generator=torch.Generator(run.device).manual_seed(seed),
            **options,
        )

    default = memory_map()
    out: dict[str, Any] = {
        "labels": y.cpu(),
        "auto": default.method,
        "default": default.scores.cpu(),
        "residual": default.prediction_error.cpu(),
        "variance": default.total_variance.cpu(),
        "regions": default.regions(ERROR_THRESHOLD, VARIANCE_QUANTILE).cpu(),
    }
    for form in FORMS:
        for name, options in SCORES.items():
            out[f"{form}:{name}"] = memory_map(method=form, **options).scores.cpu()
    log_p = predictive.predictive_log_probs(run.model, [x])
    out["loss"] = -log_p.gather(1, y[:, None])[:, 0].cpu()
    return out


def _cached(path: Path, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The dict saved at ``path``, else ``compute()`` saved there (atomically)."""
    if path.exists():
        return runfiles.load_torch(path)
    value = compute()
    runfiles.save_torch(path, value)
    return value


def chosen(score: Tensor, top: int, random: int, seed: int) -> tuple[list[int], list[int]]:
    """The ``top`` highest-scored examples and ``random`` others drawn at random."""
    order = score.argsort(descending=True)
    rest = order[top:]
    picks = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(seed))]
    return order[:top].tolist(), picks[:random].tolist()


# ---------------------------------------------------------------- retraining
class Retrainer:
    """Warm-started retraining from a trained run's state with common random numbers.

    Every retraining starts from the run's trained model and optimizer state (its noise
    generator included), at ``retrain_lr`` times the initial step size. Epoch e shuffles
    the N examples with a generator seeded ``seed + 7919·permutation + e`` and cuts batches
    of the run's batch size from that order, keeping the last partial batch. A removed
    example is taken out of its batch, whose loss is still divided by the batch's full size:
    every other example keeps its weight, the data size stays N, and the objective is
    :math:`\\frac1N[\\sum_{j\\ne i}\\ell_j + \\frac\\delta2\\|\\theta\\|^2 - \\tau\\mathcal H]`,
    the leave-one-out objective up to a constant factor. So the retraining without i and the
    control (nothing removed, same permutation) see the same batches and draw the same noise:
    they differ by example i's term alone.
    """

    def __init__(self, run: Run, memory: dict[str, Any], seed: int) -> None:
        self.run, self.memory, self.seed = run, memory, seed
        self.x, self.y = _inputs(run)
        self.model_state = copy.deepcopy(run.model.state_dict())
        self.optimizer_state = copy.deepcopy(run.optimizer.state_dict())

    def logits(self, index: Tensor) -> list[list[float]]:
        """The mean logits of the examples ``index`` over ``samples`` posterior samples
        (drawn from one fixed seed: the same draws whatever the state)."""
        run, samples = self.run, self.memory["samples"]
        post = lgb.Posterior.from_optimizer(run.optimizer, run.model)
        gen = torch.Generator(run.device).manual_seed(self.seed + 1)
        x = self.x[index.to(run.device)]
        was_training = run.model.training
        run.model.eval()
        with torch.no_grad():
            total = torch.zeros(())
            for _ in range(samples):
                with post.sampled(run.model, gen):
                    total = total + run.model(x)
        run.model.train(was_training)
        return (total / samples).double().tolist()

    def retrain(
        self, removed: int | None, index: Tensor, permutation: int = 0
    ) -> dict[str, list[list[float]]]:
        """Retrain without ``removed`` (None: nothing removed); the mean logits of ``index``
        after each of ``retrain_epochs``."""
        run, memory = self.run, self.memory
        run.model.load_state_dict(self.model_state)
        run.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))  # it aliases
        for group in run.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * memory["retrain_lr"]
        size, batch = len(self.y), run.cfg["data"]["batch_size"]
        run.model.train()
        out = {}
        for epoch in range(memory["retrain_epochs"][-1]):
            gen = torch.Generator().manual_seed(self.seed + 7919 * permutation + epoch)
            for rows in torch.randperm(size, generator=gen).split(batch):
                kept = rows if removed is None else rows[rows != removed]
                run.optimizer.step(self._closure(kept.to(run.device), len(rows)))  # type: ignore[arg-type]
            if epoch + 1 in memory["retrain_epochs"]:
                out[str(epoch + 1)] = self.logits(index)
        return out

    def _closure(self, rows: Tensor, batch: int) -> Callable[[], Tensor]:
        """The loss of ``rows``, summed and divided by the size ``batch`` of their batch."""

        def closure() -> Tensor:
            self.run.optimizer.zero_grad()
            logits = self.run.model(self.x[rows])
            loss = cross_entropy(logits, self.y[rows], reduction="sum") / batch
            loss.backward()
            return loss.detach()

        return closure


def retrain_all(
    retrainer: Retrainer, examples: list[int], path: Path, desc: str
) -> list[dict[str, Any]]:
    """The logits before retraining (``"start"``), the two controls (``"control"``: nothing
    removed, same batches; ``"permuted"``: nothing removed, other permutations) and one
    retraining per example (``"removed"``), each holding the mean logits of every example
    in ``examples``; each row appended to ``path`` (rewritten atomically) as soon as it is
    done; rows already there are kept."""
    rows = runfiles.read_jsonl(path)
    done = {(r["kind"], r["index"]) for r in rows}
    queue: list[tuple[str, int | None]] = [("start", None), ("control", None), ("permuted", None)]
    queue += [("removed", i) for i in examples]
    everyone = torch.tensor(examples)
    for kind, i in tqdm([q for q in queue if q not in done], desc=desc, unit="retraining"):
        if kind == "start":
            logits = {"0": retrainer.logits(everyone)}
        else:
            logits = retrainer.retrain(i, everyone, permutation=int(kind == "permuted"))
        rows.append({"kind": kind, "index": i, "examples": examples, "epochs": logits})
        runfiles.write_jsonl(path, rows)
    return rows


# -------------------------------------------------------------------- summary
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
        "median_ratio": _median_ratio(estimate, truth),
    }
    return {k: _defined(v) for k, v in values.items()}


def _median_ratio(a: np.ndarray, b: np.ndarray) -> float:
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
    probability drops; and per ranking (:data:`RANKINGS`, :data:`BASELINES`, ``"default"``)
    its agreement with the true change in each space and its Spearman correlation with the
    drift. Apart (``top_over_random``): the median true change of the ``top`` highest-scored
    examples over that of the random ones."""
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
                **{f"truth_over_{k}": _median_ratio(truth, r[f"{k}{x}"]) for k in FLOORS},
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
        out[epoch] = _all_defined(entry)
    return out


def _all_defined(tree: Any) -> Any:
    """``tree`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(tree, dict):
        return {k: _all_defined(v) for k, v in tree.items()}
    return _defined(tree) if isinstance(tree, float) else tree


def _defined(value: float) -> float | None:
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


# ----------------------------------------------------------------- one run
def validate(
    memory: dict[str, Any],
    cfg: dict[str, Any],
    folder: Path,
    resume: bool,
    progress: ProgressHook | None = None,
    title: str = "",
) -> dict[str, Any]:
    """Train, map, retrain and flip for one run config; writes ``folder``, returns the summary.
    Its trainings continue from their checkpoints whether or not ``resume`` is set (the
    driver's folder check decides); ``progress`` hears of the epochs of both trainings,
    ``title`` names the run in the figures."""
    seed, desc = cfg["seed"], title
    run = trained(cfg, folder / "train", progress=progress)
    test = metrics_on_test(run, memory["samples"])
    score = _cached(folder / SCORES_FILE, lambda: scores(run, memory, seed))
    top, random = chosen(score["default"], memory["top"], memory["random"], seed)
    rows = retrain_all(Retrainer(run, memory, seed), top + random, folder / RETRAIN, desc)
    title = f"{cfg['data']['name']}, {desc}"
    _maps(run.data.train_x, score, folder, "", title)
    _scatter(score, rows, top, str(memory["retrain_epochs"][-1]), folder / "scatter.png", title)
    summary = {
        "method": score["auto"],
        "test": test,
        "train_size": len(score["labels"]),
        "test_size": len(run.data.test_y),
        "retrained": {"top": top, "random": random},
        "regions": _region_counts(score["regions"]),
        "retraining": summarise_retraining(score, rows, top, memory),
        "baselines": {  # Spearman over the whole training set
            name: _defined(spearman(score["default"].numpy(), score[name].numpy()))
            for name in BASELINES
        },
    }
    if memory["flip"]:
        epochs = cfg["schedule"]["epochs"]
        after = None if progress is None else lambda done: progress(epochs + done)
        summary.update(_flipped(cfg, memory, folder, run.data, title, after))
    runfiles.write_json(folder / SUMMARY, summary)
    return summary


def _region_counts(regions: Tensor) -> dict[str, int]:
    counts = torch.bincount(regions, minlength=len(REGIONS)).tolist()
    return dict(zip(REGIONS, counts, strict=True))


def _maps(
    images: Tensor,
    score: dict[str, Any],
    folder: Path,
    prefix: str,
    title: str,
    marked: dict[int, int] | None = None,
) -> None:
    """The gallery (``memory_map.png``) and the two-axis map (``error_variance.png``) of the
    default scores, names prefixed with ``prefix``; ``marked``: index → original label."""
    name = f"default scores ({score['auto']} form)"
    figures.memory_map(
        images,
        score["labels"],
        score["default"],
        folder / f"{prefix}memory_map.png",
        f"{title}: {name}",
        marked=marked,
    )
    error, variance, default = (score[k].double() for k in ("residual", "variance", "default"))
    figures.error_variance_map(
        error.numpy(),
        variance.numpy(),
        default.numpy(),
        score["regions"].numpy(),
        (ERROR_THRESHOLD, float(torch.quantile(variance, VARIANCE_QUANTILE))),
        folder / f"{prefix}error_variance.png",
        f"{title}: {name}",
        marked=sorted(marked or {}),
    )


def _scatter(
    score: dict[str, Any],
    rows: list[dict[str, Any]],
    top: list[int],
    epoch: str,
    path: Path,
    title: str,
) -> None:
    """Estimated against true changes after ``epoch`` epochs: the paper's score against the
    change of the probabilities, the logit score against the change of the logits (the
    form the library picks)."""
    c = changes(rows, score["labels"], epoch)
    examples = c["examples"]
    form = score["auto"]
    panels = {
        f"{form}:{space} score ({epoch} epochs)": {
            "truth": c[f"truth{x}"],
            "estimate": score[f"{form}:{space}"][examples].double().numpy(),
            "floor": c[f"drift{x}"],
            "top": np.isin(np.array(examples), top),
            "xlabel": f"true change ‖{symbol}(without i) − {symbol}‖₁ (retraining)",
        }
        for (space, x), symbol in zip(SPACES.items(), "pf", strict=True)
    }
    figures.sensitivity_scatter(panels, path, title)


def _flipped(
    cfg: dict[str, Any],
    memory: dict[str, Any],
    folder: Path,
    data: Dataset,
    title: str,
    progress: ProgressHook | None,
) -> dict[str, Any]:
    """The run trained again with ``flip`` labels changed: its maps and test metrics, and
    how many flipped labels each ranking finds."""
    seed, labels = cfg["seed"], data.train_y
    flips = flipped_labels(labels, memory["flip"], data.num_classes, seed)
    run = trained(cfg, folder / "flip", flips, progress)
    score = _cached(folder / FLIP_SCORES, lambda: scores(run, memory, seed))
    marked = {i: int(labels[i]) for i in flips}
    flipped = f"{title}, {memory['flip']} labels flipped (red)"
    _maps(run.data.train_x, score, folder, "flip_", flipped, marked)
    is_flipped = torch.zeros(len(labels), dtype=torch.bool)
    is_flipped[list(flips)] = True
    return {
        "flips": summarise_flips(score, flips),
        "flip_regions": {
            "all": _region_counts(score["regions"]),
            "flipped": _region_counts(score["regions"][is_flipped]),
        },
        "flip_test": metrics_on_test(run, memory["samples"]),
    }


# ------------------------------------------------------------------ command
def memory_maps(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Validate every run and seed of ``raw`` into ``out``; returns label → summaries."""
    out = Path(out)
    configs, memory = resolve(raw, seeds)
    runner = skeleton.Runner(partial(validate, memory), partial(_planned, memory), _rule, _check)
    runner.check(configs)
    with runfiles.locked(out):
        skeleton.prepare_folder(out, skeleton.written(configs), resume, {"memory": memory})
        per_seed = skeleton.run_all(configs, out, resume, runner)
        results = {
            label: {"summary": aggregate(list(runs.values())), "per_seed": runs}
            for label, runs in per_seed.items()
        }
        skeleton.write_report(out, results, report(results, configs, memory))
    return results


def _planned(memory: dict[str, Any], label: str, cfg: dict[str, Any], *_: Any) -> Planned:
    """A run for the progress: the epochs of its training and of its training with flipped
    labels (the retraining's time is spread over them)."""
    epochs = cfg["schedule"]["epochs"] * (2 if memory["flip"] else 1)
    return Planned(label, epochs, cfg["optimizer"].get("mc_samples", 1))


def _check(configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Every run as a training checks it, and what leave-one-out retraining needs."""
    check_runs(configs)
    _check_data(configs)


def _rule(cfg: dict[str, Any]) -> str:
    return str(cfg["optimizer"]["name"])


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


def _mean_sd(leaf: dict[str, Any] | None, digits: int = 2, style: str = "f") -> str:
    if not isinstance(leaf, dict):
        return "n/a"
    if leaf["sd"] is None:
        return f"{leaf['mean']:.{digits}{style}}"
    return f"{leaf['mean']:.{digits}{style}} ± {leaf['sd']:.{digits}{style}}"


def _conditions(cfg: dict[str, Any], res: dict[str, Any], memory: dict[str, Any]) -> str:
    """The settings every number of a run's section was measured under."""
    s, one = res["summary"], next(iter(res["per_seed"].values()))
    opt, seeds = cfg["optimizer"], res["per_seed"]
    at_mean = ""
    if "mean" in s["test"]:
        at_mean = f"{_mean_sd(s['test']['mean']['accuracy'], 4)} at the posterior mean, "
    return (
        f"{cfg['model']['name']} {cfg['model'].get('widths', '')} on {cfg['data']['name']} "
        f"({one['train_size']} train / {one['test_size']} test), {cfg['schedule']['epochs']} "
        f"passes, batch {cfg['data']['batch_size']}, {opt.get('mc_samples', 1)} samples per "
        f"step; {len(seeds)} seed{'s' if len(seeds) > 1 else ''}; test accuracy "
        f"{_mean_sd(s['test']['point']['accuracy'], 4)} at the point estimate, {at_mean}"
        f"{_mean_sd(s['test']['average']['accuracy'], 4)} averaged over {memory['samples']} "
        f"posterior samples."
    )


def report(
    results: dict[str, Any],
    configs: dict[str, dict[int, dict[str, Any]]],
    memory: dict[str, Any],
) -> str:
    """Markdown: per run, the agreement of every ranking with leave-one-out retraining on the
    random examples, the floors, and the flipped labels found; mean ± sd over seeds."""
    head = ["epochs", "ranking", "Spearman, ‖Δp‖₁", "Spearman, ‖Δf‖₁", "Spearman, drift of p"]
    head += ["Spearman, drift of f", "median estimate ÷ truth"]
    lines = ["# Memory maps against leave-one-out retraining", ""]
    for label, res in results.items():
        s = res["summary"]
        cfg = next(iter(configs[label].values()))
        lines += [
            f"## {label} (seeds {', '.join(res['per_seed'])}; {s['method']} form by default)",
            "",
            _conditions(cfg, res, memory),
            f"{memory['random']} random examples retrained (common random numbers) at "
            f"{memory['retrain_lr']}× the initial step size. Spearman correlation over the "
            "random examples of each ranking with the true change of the probabilities "
            "(‖Δp‖₁) and of the logits (‖Δf‖₁), and with the drift (the change retraining "
            "alone makes); median estimate ÷ the true change it estimates.",
            "",
        ]
        rows = []
        for epoch, entry in s["retraining"].items():
            for name in [*RANKINGS, "default", *BASELINES]:
                p, f = entry[name]["probabilities"], entry[name]["logits"]
                own = f if name.split(":")[-1].startswith("logits") else p
                ratio = _mean_sd(own["median_ratio"], 3) if ":" in name else "—"
                cells = [_mean_sd(p["spearman"]), _mean_sd(f["spearman"])]
                cells += [_mean_sd(p["drift"]), _mean_sd(f["drift"])]
                rows.append([str(epoch), name, *cells, ratio])
        lines += markdown(head, rows, [RIGHT, LEFT] + [RIGHT] * 5)
        lines.append("")
        for epoch, entry in s["retraining"].items():
            for space in SPACES:
                e = entry[space]
                floors = ", ".join(
                    f"{name} {_mean_sd(e[f'{key}_median'], 2, 'e')} (truth ÷ it "
                    f"{_mean_sd(e[f'truth_over_{key}'])}, truth above it for "
                    f"{_mean_sd(e[f'above_{key}'])})"
                    for key, name in FLOORS.items()
                )
                paired = "; ".join(
                    f"minus the {b} alone's: {_paired(res, epoch, space, b)}" for b in BASELINES[:2]
                )
                lines.append(
                    f"- {space}, after {epoch} epochs, random examples: median true change "
                    f"{_mean_sd(e['truth_median'], 2, 'e')}; floors: {floors}; Spearman of "
                    f"truth and drift {_mean_sd(e['truth_drift_spearman'])}; the "
                    f"{memory['top']} highest-scored change {_mean_sd(e['top_over_random'], 1)}× "
                    f"as much (medians); per seed, the default's Spearman {paired}."
                )
            lines.append(
                f"- after {epoch} epochs the own label's probability drops for "
                f"{_mean_sd(entry['label_drops'])} of the removed random examples."
            )
        lines.append(
            "- over the whole training set the default score ranks with Spearman "
            + ", ".join(f"{_mean_sd(v)} against the {k}" for k, v in s["baselines"].items())
            + " alone."
        )
        if "flips" in s:
            f = s["flips"]
            found = ", ".join(f"{k}: {_mean_sd(v, 1)}" for k, v in f["found"].items())
            lines += [
                "",
                f"Flipped labels among each ranking's {memory['flip']} highest, of "
                f"{memory['flip']}: {found} (at random: {_mean_sd(f['random'], 2)}).",
            ]
        lines.append("")
    return "\n".join(lines)


def _paired(res: dict[str, Any], epoch: str, space: str, baseline: str) -> str:
    """Per seed, the default's Spearman correlation with the true change minus the
    ``baseline``'s (a paired difference: both ranked the same retrained examples)."""
    out = []
    for summary in res["per_seed"].values():
        entry = summary["retraining"][epoch]
        a, b = (entry[k][space]["spearman"] for k in ("default", baseline))
        out.append("n/a" if a is None or b is None else f"{a - b:+.3f}")
    return ", ".join(out)


def _show(results: dict[str, Any], out: Path) -> None:
    print((out / "report.md").read_text())
    print(f"results in {out}")


# ------------------------------------------------------- map of a finished run
def run_folders(folder: Path) -> list[Path]:
    """The finished runs in ``folder`` (itself, or the LABEL/seedS runs of a comparison)."""
    if (folder / RESULTS).exists() and (folder / CHECKPOINT).exists():
        return [folder]
    return sorted(
        p.parent for p in folder.glob("*/seed*/" + RESULTS) if (p.parent / CHECKPOINT).exists()
    )


def map_of_run(folder: Path, samples: int = 64, batch_size: int = 32) -> dict[str, Any]:
    """``memory_map.png``, ``error_variance.png`` and ``memory_map.json`` (the default
    scores, the regions' sizes and the 50 highest) of a finished run's training set,
    written into its folder under its lock."""
    with runfiles.locked(folder):
        cfg = config_module.resolve(runfiles.read_json(folder / RUN_CONFIG))
        if cfg["optimizer"]["name"] not in BLR:
            return {}
        run = build(cfg, PROCESSES)
        load_checkpoint(run, folder / CHECKPOINT)
        x, y = _inputs(run)
        mm = lgb.memory_map(
            run.model,
            run.optimizer,
            x,
            y,
            samples=samples,
            batch_size=batch_size,
            generator=torch.Generator(run.device).manual_seed(cfg["seed"]),
        )
        score: dict[str, Any] = {
            "labels": y.cpu(),
            "auto": mm.method,
            "default": mm.scores.cpu(),
            "residual": mm.prediction_error.cpu(),
            "variance": mm.total_variance.cpu(),
            "regions": mm.regions(ERROR_THRESHOLD, VARIANCE_QUANTILE).cpu(),
        }
        title = f"{cfg['optimizer']['name']} on {cfg['data']['name']}, seed {cfg['seed']}"
        _maps(run.data.train_x, score, folder, "", title)
        order = mm.scores.argsort(descending=True)[:50].tolist()
        summary = {
            "method": mm.method,
            "scores": mm.scores.cpu().tolist(),
            "regions": _region_counts(score["regions"]),
            "highest": [
                {"index": i, "label": int(y[i]), "score": float(mm.scores[i])} for i in order
            ],
        }
        runfiles.write_json(folder / "memory_map.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and Path(args[0]).is_dir():
        folders = run_folders(Path(args[0]))
        if not folders:
            print(
                f"error: {args[0]} holds no finished run (results.json and checkpoint.pt)",
                file=sys.stderr,
            )
            return 2
        try:
            for folder in folders:
                if map_of_run(folder):
                    print(f"memory maps in {folder}")
        except (ValueError, OSError, runfiles.RunError) as err:
            print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
            return 2
        return 0
    return cli.run(
        "python -m experiments.memory_map", __doc__, memory_maps, _show, args, cli.parse_seeds
    )


if __name__ == "__main__":
    sys.exit(main())
