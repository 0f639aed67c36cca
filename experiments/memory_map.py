"""Memory maps of a trained posterior, checked against leave-one-out retraining.

    python -m experiments.memory_map CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]
    python -m experiments.memory_map RUN_FOLDER

CONFIG is a run config (or a comparison config with ``[runs.LABEL]`` tables) of a Lie-group
BLR optimizer with a ``[memory]`` table (:data:`MEMORY`). For every run and seed, into
``DIR/LABEL/seedS``:

1. ``train/``: train the run (a checkpoint per epoch; ``--resume`` continues it);
2. ``scores.pt``: the memory map of the training set with the Jacobian and the sample forms,
   diagonal and with the cross-class terms (:func:`liegroup_blr.memory_map`);
3. ``retrain.jsonl``: leave-one-out retraining of the ``top`` highest-scored and ``random``
   random examples, warm-started from the trained posterior with the same noise, on the same
   permutation per epoch with the example removed (batches re-cut from it, the last partial
   batch kept, N − 1 as data size); a control on the full set, and a second control on other
   permutations (the noise of retraining). The true change of example i after e epochs is
   ‖p_removed − p_control‖₁ of the softmax of its mean logits over ``samples`` posterior
   samples (the same draws before and after). One row per retraining, written atomically
   after each: a kill loses at most the one under way, ``--resume`` skips the finished;
4. ``flip/`` and ``flip_scores.pt``: the run trained again with ``flip`` random labels
   changed, and how many of those land among the ``flagged`` highest scores;
5. ``memory_map.png``, ``flip_memory_map.png``, ``scatter.png`` and ``summary.json``.

``DIR`` gets ``config.json`` (every resolved config and the ``[memory]`` table),
``results.json`` (mean ± sd over seeds) and ``report.md``.

With a RUN_FOLDER (a finished ``experiments.train`` run, or an ``experiments.compare`` folder:
each of its finished runs), it writes the memory map of the run's training set as
``memory_map.png`` and ``memory_map.json`` into the run's folder, holding the run's lock.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn.functional import cross_entropy
from tqdm import tqdm

import liegroup_blr as lgb
from experiments import cli, compare, figures, runfiles
from experiments import config as config_module
from experiments.data import Dataset, load_dataset
from experiments.distributed import Processes
from experiments.train import (
    CHECKPOINT,
    RESULTS,
    Run,
    build,
    load_checkpoint,
    save_checkpoint,
    train_epoch,
)
from experiments.train import CONFIG as RUN_CONFIG
from liegroup_blr import predictive

MEMORY: dict[str, Any] = {
    "samples": 64,
    "batch_size": 32,
    "top": 20,
    "random": 30,
    "retrain_epochs": [2, 5, 10],
    "retrain_lr": 0.1,
    "flip": 30,
    "flagged": 60,
}
"""The ``[memory]`` table with its defaults: ``samples`` posterior samples (for the sample
form and for the true change), ``batch_size`` examples per batch of the memory map, ``top``
highest-scored and ``random`` random examples to retrain, the epochs of retraining after
which the change is read (``retrain_epochs``, increasing; it retrains to the last),
``retrain_lr`` its step size as a factor of the run's initial one (constant), ``flip``
labels changed for the mislabelling experiment (0: none), ``flagged`` highest scores to
search them in."""

VARIANTS: dict[str, dict[str, Any]] = {
    "jacobian": {"method": "jacobian"},
    "samples": {"method": "samples"},
    "jacobian+cross": {"method": "jacobian", "cross_class": True},
    "samples+cross": {"method": "samples", "cross_class": True},
}
"""The scores computed for every run: both forms of the variance, with and without the
cross-class terms; each diagonal one also as the change of the logits (``NAME.logits``)."""

RANKINGS = [*VARIANTS, "jacobian.logits", "samples.logits"]
"""The scores compared with retraining."""

BLR = ("additive", "multiplicative", "affine")
SCORES, FLIP_SCORES, RETRAIN, SUMMARY = (
    "scores.pt",
    "flip_scores.pt",
    "retrain.jsonl",
    "summary.json",
)
PROCESSES = Processes()


# -------------------------------------------------------------------- config
def resolve(
    raw: dict[str, Any], seeds: Sequence[int] | None = None
) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """(label → seed → resolved run config, the resolved ``[memory]`` table)."""
    given = raw.get("memory", {})
    if not isinstance(given, dict):
        raise config_module.ConfigError(f"[memory] must be a table, got {given!r}")
    memory = config_module.fill("[memory]", given, MEMORY)
    for key in ("samples", "batch_size", "top", "random", "flagged"):
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
    configs = compare.run_configs({k: v for k, v in raw.items() if k != "memory"}, seeds)
    for by_seed in configs.values():
        for cfg in by_seed.values():
            _check_run(cfg)
    return configs, memory


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


def trained(cfg: dict[str, Any], folder: Path, flips: dict[int, int] | None = None) -> Run:
    """The run of ``cfg`` trained into ``folder`` (``checkpoint.pt`` after every epoch; a
    partial run is continued), with the labels of ``flips`` changed."""
    run = build(copy.deepcopy(cfg), PROCESSES)
    if flips:
        index = torch.tensor(list(flips))
        run.data.train_y[index] = torch.tensor(list(flips.values()))
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / CHECKPOINT
    start, history = load_checkpoint(run, ckpt) if ckpt.exists() else (0, [])
    for epoch in range(start, cfg["schedule"]["epochs"]):
        loss = train_epoch(run, epoch)
        run.scheduler.step()
        history.append({"epoch": epoch + 1, "train_loss": loss})
        save_checkpoint(run, epoch + 1, ckpt, history)
    return run


def _check_data(configs: dict[str, dict[int, dict[str, Any]]]) -> None:
    """What only the data can tell: no augmentation by the dataset's default, and leaving
    one of N examples out does not take a batch away (N mod batch size ≠ 1)."""
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
                    f"[data].batch_size {batch}: N − 1 = {size - 1} examples would make one "
                    "batch fewer than N; choose a batch size that does not divide N − 1"
                )


def metrics_on_test(run: Run, samples: int) -> dict[str, Any]:
    """Test metrics at the point estimate and of the model average of ``samples``."""
    data = run.data
    x = data.normalize(data.to_unit(data.test_x)).to(run.device)
    y = data.test_y.to(run.device)
    point = predictive.predictive_log_probs(run.model, [x])
    average = predictive.predictive_log_probs(run.model, [x], run.optimizer, samples)
    return {"point": predictive.metrics(point, y), "average": predictive.metrics(average, y)}


# --------------------------------------------------------------------- scores
def scores(run: Run, memory: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every variant's scores of the training set, the variant ``"auto"`` picks, the NLL at
    the point estimate and the residual norm Σ|e| (baselines), and the labels."""
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

    auto = memory_map()
    out: dict[str, Any] = {"labels": y.cpu(), "auto": auto.method}
    for name, options in VARIANTS.items():
        mm = auto if name == auto.method else memory_map(**options)
        out[name] = mm.scores.cpu()
        if not options.get("cross_class"):
            out[f"{name}.residual"] = mm.residuals.abs().sum(1).cpu()
            out[f"{name}.logits"] = (mm.variances * mm.residuals).abs().sum(1).cpu()
    log_p = predictive.predictive_log_probs(run.model, [x])
    out["nll"] = -log_p.gather(1, y[:, None])[:, 0].cpu()
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
    """Warm-started retraining from a trained run's state with the same noise.

    Epoch e of a retraining shuffles the N examples with a generator seeded
    ``seed + 7919·permutation + e``, drops the removed example from that order and cuts
    batches of the run's batch size from it, keeping the last partial batch. The rows it
    gives hold, per example, ``"average"``: the softmax of the mean logits over ``samples``
    posterior samples (drawn from one fixed seed, so the same ξ before and after), and
    ``"point"``: the softmax at the point estimate.
    """

    def __init__(self, run: Run, memory: dict[str, Any], seed: int) -> None:
        self.run, self.memory, self.seed = run, memory, seed
        self.x, self.y = _inputs(run)
        self.model_state = copy.deepcopy(run.model.state_dict())
        self.optimizer_state = copy.deepcopy(run.optimizer.state_dict())

    def probabilities(self, index: Tensor) -> dict[str, list[list[float]]]:
        """Softmax of the mean logits over the posterior samples (the same draws whatever the
        state), and at the point estimate, of the examples ``index``."""
        run, samples = self.run, self.memory["samples"]
        post = lgb.Posterior.from_optimizer(run.optimizer, run.model)
        gen = torch.Generator(run.device).manual_seed(self.seed + 1)
        x = self.x[index]
        was_training = run.model.training
        run.model.eval()
        with torch.no_grad():
            total = torch.zeros(())
            for _ in range(samples):
                with post.sampled(run.model, gen):
                    total = total + run.model(x)
            point = torch.softmax(run.model(x), -1)
        run.model.train(was_training)
        mean = torch.softmax(total / samples, -1)
        return {"average": mean.double().tolist(), "point": point.double().tolist()}

    def retrain(
        self, removed: int | None, index: Tensor, permutation: int = 0
    ) -> dict[str, dict[str, list[list[float]]]]:
        """Retrain without ``removed`` (None: the full set); the probabilities of ``index``
        after each of ``retrain_epochs``."""
        run, memory = self.run, self.memory
        run.model.load_state_dict(self.model_state)
        run.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))  # it aliases
        size = len(self.y)
        for group in run.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * memory["retrain_lr"]
            group["data_size"] = size - (removed is not None)
        batch = run.cfg["data"]["batch_size"]
        run.model.train()
        out = {}
        for epoch in range(memory["retrain_epochs"][-1]):
            gen = torch.Generator().manual_seed(self.seed + 7919 * permutation + epoch)
            order = torch.randperm(size, generator=gen)
            if removed is not None:
                order = order[order != removed]
            for start in range(0, len(order), batch):
                rows = order[start : start + batch].to(run.device)
                run.optimizer.step(self._closure(rows))  # type: ignore[arg-type]
            if epoch + 1 in memory["retrain_epochs"]:
                out[str(epoch + 1)] = self.probabilities(index)
        return out

    def _closure(self, rows: Tensor) -> Callable[[], Tensor]:
        def closure() -> Tensor:
            self.run.optimizer.zero_grad()
            loss = cross_entropy(self.run.model(self.x[rows]), self.y[rows])
            loss.backward()
            return loss.detach()

        return closure


def retrain_all(
    retrainer: Retrainer, examples: list[int], path: Path, desc: str
) -> list[dict[str, Any]]:
    """The two controls and one retraining per example, each row appended to ``path``
    (rewritten atomically) as soon as it is done; rows already there are kept."""
    rows = runfiles.read_jsonl(path)
    done = {(r["kind"], r["index"]) for r in rows}
    queue: list[tuple[str, int | None]] = [("control", None), ("permuted", None)]
    queue += [("removed", i) for i in examples]
    everyone = torch.tensor(examples)
    for kind, i in tqdm([q for q in queue if q not in done], desc=desc, unit="retraining"):
        if kind == "removed":
            assert i is not None
            probs = retrainer.retrain(i, torch.tensor([i]))
        else:
            probs = retrainer.retrain(None, everyone, permutation=int(kind == "permuted"))
        rows.append(
            {
                "kind": kind,
                "index": i,
                "examples": [i] if i is not None else examples,
                "epochs": probs,
            }
        )
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


def changes(
    rows: list[dict[str, Any]], labels: Tensor, epoch: str, which: str = "average"
) -> dict[str, Any]:
    """Per retrained example (in the order of the control's examples), against the control
    after ``epoch`` epochs: the true change ‖p_removed − p_control‖₁ and the change of the
    probability of the example's own label (``label``), and the same for the retraining on
    other permutations with nothing removed (``floor``, ``label_floor``)."""
    by_kind = {r["kind"]: r for r in rows if r["kind"] != "removed"}
    control = np.array(by_kind["control"]["epochs"][epoch][which])
    permuted = np.array(by_kind["permuted"]["epochs"][epoch][which])
    removed = {
        r["index"]: np.array(r["epochs"][epoch][which][0]) for r in rows if r["index"] is not None
    }
    examples = by_kind["control"]["examples"]
    mine = labels[examples].numpy()
    moved = np.stack([removed[i] for i in examples]) - control
    noise = permuted - control
    at = np.arange(len(examples))
    return {
        "examples": examples,
        "truth": np.abs(moved).sum(1),
        "floor": np.abs(noise).sum(1),
        "label": moved[at, mine],
        "label_floor": noise[at, mine],
    }


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
        "median_ratio": float(np.median(estimate[positive] / truth[positive]))
        if positive.any()
        else math.nan,
    }
    return {k: _defined(v) for k, v in values.items()}


def summarise_retraining(
    score: dict[str, Any], rows: list[dict[str, Any]], top: list[int], memory: dict[str, Any]
) -> dict[str, Any]:
    """After each retraining length: the agreement of every ranking's scores with the true
    changes, over all retrained examples and over the random ones; its Spearman correlation
    with the drop of the own label's probability, and with the retraining noise (nothing
    removed, other permutations: a score that only marks examples that move under any
    perturbation correlates with it as well); how often the own label's probability drops,
    with the example removed and with nothing removed."""
    out: dict[str, Any] = {}
    for epoch in (str(e) for e in memory["retrain_epochs"]):
        c = changes(rows, score["labels"], epoch)
        examples = np.array(c["examples"])
        random = ~np.isin(examples, top)
        entry: dict[str, Any] = {
            "truth_median": float(np.median(c["truth"])),
            "floor_median": float(np.median(c["floor"])),
            "above_floor": float((c["truth"] > c["floor"]).mean()),
            "label_drops": float((c["label"] < 0).mean()),
            "label_drops_floor": float((c["label_floor"] < 0).mean()),
        }
        for name in RANKINGS:
            est = score[name][examples].double().numpy()
            entry[name] = {
                "all": agreement(est, c["truth"]),
                "random": agreement(est[random], c["truth"][random]),
                "label": _defined(spearman(est, -c["label"])),
                "label_floor": _defined(spearman(est, -c["label_floor"])),
                "floor": _defined(spearman(est, c["floor"])),
            }
        out[epoch] = entry
    return out


def _defined(value: float) -> float | None:
    return value if math.isfinite(value) else None


def summarise_flips(
    flip_score: dict[str, Any], flips: dict[int, int], memory: dict[str, Any]
) -> dict[str, Any]:
    """How many flipped labels land among the ``flagged`` highest of each ranking, and the
    number expected at random."""
    size = len(flip_score["labels"])
    flagged = memory["flagged"]
    keys = [*RANKINGS, "nll", "jacobian.residual"]
    found = {
        k: sum(int(i) in flips for i in flip_score[k].argsort(descending=True)[:flagged].tolist())
        for k in keys
    }
    return {
        "found": found,
        "flipped": len(flips),
        "flagged": flagged,
        "random": len(flips) * flagged / size,
    }


# ----------------------------------------------------------------- one run
def validate(
    cfg: dict[str, Any], memory: dict[str, Any], folder: Path, desc: str
) -> dict[str, Any]:
    """Train, map, retrain and flip for one run config; writes ``folder``, returns the summary."""
    seed = cfg["seed"]
    run = trained(cfg, folder / "train")
    test = metrics_on_test(run, memory["samples"])
    score = _cached(folder / SCORES, lambda: scores(run, memory, seed))
    primary = score[score["auto"]]
    top, random = chosen(primary, memory["top"], memory["random"], seed)
    rows = retrain_all(Retrainer(run, memory, seed), top + random, folder / RETRAIN, desc)
    title = f"{cfg['data']['name']}, {desc}"
    figures.memory_map(
        run.data.train_x,
        score["labels"],
        primary,
        folder / "memory_map.png",
        f"{title}: {score['auto']} scores",
    )
    _scatter(score, rows, top, str(memory["retrain_epochs"][-1]), folder / "scatter.png")
    summary = {
        "method": score["auto"],
        "test": test,
        "train_size": len(score["labels"]),
        "retrained": {"top": top, "random": random},
        "retraining": summarise_retraining(score, rows, top, memory),
    }
    if memory["flip"]:
        summary.update(_flipped(cfg, memory, folder, run.data, title))
    runfiles.write_json(folder / SUMMARY, summary)
    return summary


def _scatter(
    score: dict[str, Any], rows: list[dict[str, Any]], top: list[int], epoch: str, path: Path
) -> None:
    """Estimated against true changes after ``epoch`` epochs, both forms of the variance."""
    c = changes(rows, score["labels"], epoch)
    is_top = np.isin(np.array(c["examples"]), top)
    panels = {
        f"{name} ({epoch} epochs)": {
            "truth": c["truth"],
            "floor": c["floor"],
            "estimate": score[name][c["examples"]].double().numpy(),
            "top": is_top,
        }
        for name in ("jacobian", "samples")
    }
    figures.sensitivity_scatter(panels, path)


def _flipped(
    cfg: dict[str, Any], memory: dict[str, Any], folder: Path, data: Dataset, title: str
) -> dict[str, Any]:
    """The run trained again with ``flip`` labels changed: its map, figure and test metrics,
    and how many flipped labels each ranking finds."""
    seed, labels = cfg["seed"], data.train_y
    flips = flipped_labels(labels, memory["flip"], data.num_classes, seed)
    run = trained(cfg, folder / "flip", flips)
    score = _cached(folder / FLIP_SCORES, lambda: scores(run, memory, seed))
    figures.memory_map(
        run.data.train_x,
        score["labels"],
        score[score["auto"]],
        folder / "flip_memory_map.png",
        f"{title}: {memory['flip']} labels flipped (red: flipped, 'was' the true label)",
        marked={i: int(labels[i]) for i in flips},
    )
    return {
        "flips": summarise_flips(score, flips, memory),
        "flip_test": metrics_on_test(run, memory["samples"]),
    }


# ------------------------------------------------------------------ command
def memory_maps(
    raw: dict[str, Any], out: str | Path, resume: bool = False, seeds: Sequence[int] | None = None
) -> dict[str, Any]:
    """Validate every run and seed of ``raw`` into ``out``; returns label → summaries."""
    out = Path(out)
    configs, memory = resolve(raw, seeds)
    written = {
        "runs": {
            label: {str(s): c for s, c in by_seed.items()} for label, by_seed in configs.items()
        },
        "memory": memory,
    }
    with runfiles.locked(out):
        compare.check_folder(out, written, resume)
        _check_data(configs)
        runfiles.remove_leftovers(out)
        runfiles.write_json(out / "config.json", written)
        results: dict[str, Any] = {}
        for label, by_seed in configs.items():
            per_seed = {
                str(s): validate(cfg, memory, out / label / f"seed{s}", f"{label} seed {s}")
                for s, cfg in by_seed.items()
            }
            results[label] = {"summary": aggregate(list(per_seed.values())), "per_seed": per_seed}
        runfiles.write_json(out / "results.json", results)
        runfiles.write_text(out / "report.md", report(results, memory) + "\n")
    return results


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


def _mean_sd(leaf: dict[str, Any] | None, digits: int = 2) -> str:
    if not isinstance(leaf, dict):
        return "n/a"
    if leaf["sd"] is None:
        return f"{leaf['mean']:.{digits}f}"
    return f"{leaf['mean']:.{digits}f} ± {leaf['sd']:.{digits}f}"


def report(results: dict[str, Any], memory: dict[str, Any]) -> str:
    """Markdown: agreement with retraining and flipped labels found, mean ± sd over seeds."""
    lines = ["# Memory maps against leave-one-out retraining", ""]
    for label, res in results.items():
        s = res["summary"]
        seeds = list(res["per_seed"])
        lines += [
            f"## {label} (seeds {', '.join(seeds)}; {s['method']} form by default)",
            "",
            f"Test accuracy {_mean_sd(s['test']['point']['accuracy'], 4)} at the point estimate, "
            f"{_mean_sd(s['test']['average']['accuracy'], 4)} averaged over {memory['samples']} "
            f"samples; {memory['top']} highest-scored and {memory['random']} random examples "
            f"retrained at {memory['retrain_lr']}× the initial step size.",
            "",
            "Spearman and Pearson correlations of the scores with the true change "
            "‖p_removed − p_control‖₁ over all retrained examples (all) and the random ones; "
            "Spearman with the drop of the example's own label probability (label drop), and "
            "with the same two changes from retraining on other permutations with nothing "
            "removed (noise, label noise): a score that only marks examples that move under "
            "any perturbation correlates with these as well.",
            "",
            "| epochs | scores | Spearman (all) | Spearman (random) | Pearson (all) | "
            "Pearson of logs | Spearman, label drop | Spearman, noise | Spearman, label noise | "
            "median estimate / truth |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for epoch, entry in s["retraining"].items():
            for name in RANKINGS:
                a, r = entry[name]["all"], entry[name]["random"]
                ratio = "—" if name.endswith(".logits") else _mean_sd(a["median_ratio"], 3)
                lines.append(
                    f"| {epoch} | {name} | {_mean_sd(a['spearman'])} | "
                    f"{_mean_sd(r['spearman'])} | {_mean_sd(a['pearson'])} | "
                    f"{_mean_sd(a['pearson_log'])} | {_mean_sd(entry[name]['label'])} | "
                    f"{_mean_sd(entry[name]['floor'])} | {_mean_sd(entry[name]['label_floor'])} | "
                    f"{ratio} |"
                )
        lines.append("")
        for epoch, entry in s["retraining"].items():
            lines.append(
                f"- after {epoch} epochs the own label's probability drops for "
                f"{_mean_sd(entry['label_drops'])} of the removed examples "
                f"({_mean_sd(entry['label_drops_floor'])} with nothing removed); the true change "
                f"exceeds the permutation noise for {_mean_sd(entry['above_floor'])}."
            )
        if "flips" in s:
            f = s["flips"]
            found = ", ".join(f"{k}: {_mean_sd(v, 1)}" for k, v in f["found"].items())
            lines += [
                "",
                f"Flipped labels among the {memory['flagged']} highest of {memory['flip']}: "
                f"{found} (at random: {_mean_sd(f['random'], 2)}).",
            ]
        lines.append("")
    return "\n".join(lines)


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
    """``memory_map.png`` and ``memory_map.json`` (the auto scores and the 50 highest) of a
    finished run's training set, written into its folder under its lock."""
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
        title = f"{cfg['optimizer']['name']} on {cfg['data']['name']}: {mm.method} scores"
        figures.memory_map(
            run.data.train_x, y.cpu(), mm.scores.cpu(), folder / "memory_map.png", title
        )
        order = mm.scores.argsort(descending=True)[:50].tolist()
        summary = {
            "method": mm.method,
            "scores": mm.scores.cpu().tolist(),
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
                    print(f"memory map in {folder / 'memory_map.png'}")
        except (ValueError, OSError, runfiles.RunError) as err:
            print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
            return 2
        return 0
    return cli.run(
        "python -m experiments.memory_map", __doc__, memory_maps, _show, args, compare.parse_seeds
    )


if __name__ == "__main__":
    sys.exit(main())
