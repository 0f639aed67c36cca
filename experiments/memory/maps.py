"""Memory maps of a trained posterior, checked against leave-one-out retraining.

    python -m experiments.memory.maps CONFIG.toml [--out DIR] [--resume] [--seeds 0,1,2]
    python -m experiments.memory.maps RUN_FOLDER

CONFIG is a run config (or a comparison config with ``[runs.LABEL]`` tables) of a Lie-group
BLR optimizer with a ``[memory]`` table (:data:`MEMORY`). For every run and seed, into
``DIR/LABEL/seedS``:

1. ``train/``: train the run (a checkpoint per epoch; ``--resume`` continues it);
2. ``scores.pt``: every score of
   :data:`~experiments.memory.scores.RANKINGS` for the training set (both forms of the
   variance; the change of the probabilities and of the logits, diagonal and with the
   cross-class terms), the library's default, and the baselines of
   :data:`~experiments.memory.scores.BASELINES`;
3. ``retrain.jsonl``: leave-one-out retraining of the ``top`` highest-scored (by the
   default) and ``random`` random examples with common random numbers: warm-started from the
   trained posterior with the same noise, on the same batches with the removed example
   taken out of its batch (:class:`~experiments.memory.retrain.Retrainer`); a control with
   nothing removed on the same batches, and one on other permutations. The mean logits over
   ``samples`` posterior samples (the same draws before and after) of every retrained
   example are kept after each of ``retrain_epochs``, and before retraining. One row per
   retraining, written atomically after each: a kill loses at most the one under way,
   ``--resume`` skips the finished;
4. ``flip/`` and ``flip_scores.pt``: the run trained again with ``flip`` random labels
   changed, and how many of those each score puts among its ``flip`` highest;
5. ``memory_map.png`` and ``flip_memory_map.png`` (the most and least sensitive examples),
   ``error_variance.png`` and ``flip_error_variance.png`` (the two-axis map: prediction error
   against prediction variance, regions named), ``scatter.png`` and ``summary.json``.

``DIR`` gets ``config.json`` (every resolved config and the ``[memory]`` table),
``results.json`` (mean ± sd over seeds) and ``report.md``.
 With a RUN_FOLDER (a finished ``experiments.runs.train`` run, or an ``experiments.runs.compare``
folder: each of its finished runs), it writes the memory map of the run's training set as
``memory_map.png``, ``error_variance.png`` and ``memory_map.json`` into the run's folder,
holding the run's lock.

The driver's parts, by concern: the rankings (:mod:`experiments.memory.scores`), the
retraining (:mod:`experiments.memory.retrain`), the statistics (:mod:`experiments.memory.stats`),
the figures (:mod:`experiments.memory.figures`) and the report (:mod:`experiments.memory.report`);
its trainings run on the loop of :mod:`experiments.common.loop` (:func:`trained`).
"""

from __future__ import annotations

from experiments.common import cli

PROG = "python -m experiments.memory.maps"
if __name__ == "__main__":  # before the imports of torch: --help is quick
    cli.answer_help(PROG, __doc__, cli.parse_seeds)

import copy
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from experiments.common import config as config_module
from experiments.common import runfiles, skeleton
from experiments.common.data import Dataset, load_dataset
from experiments.common.distributed import Processes
from experiments.common.evaluate import posterior_mean
from experiments.common.progress import Planned
from experiments.common.skeleton import CONFIG as RUN_CONFIG
from experiments.common.skeleton import ProgressHook
from experiments.common.training import (
    CHECKPOINT,
    RESULTS,
    Run,
    build,
    check_runs,
    load_checkpoint,
    save_checkpoint,
    train_epoch,
)
from experiments.memory.figures import maps, scatter
from experiments.memory.report import report
from experiments.memory.retrain import Retrainer, retrain_all
from experiments.memory.scores import (
    BASELINES,
    chosen,
    default_scores,
    memory_map,
    region_counts,
    scores,
    train_inputs,
)
from experiments.memory.stats import (
    aggregate,
    defined,
    spearman,
    summarise_flips,
    summarise_retraining,
)
from liegroup_blr import predictive

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
sibling drivers ``experiments.memory.converged`` (leave-one-out retraining to convergence)
and ``experiments.memory.loo`` (model selection by the estimated leave-one-out NLL), which
check them; this driver ignores them."""

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
    epochs = partial(train_epoch, run)
    for epoch in run.epochs(start, cfg["schedule"]["epochs"], epochs, progress):
        history.append({"epoch": epoch.done, "train_loss": epoch.loss})
        save_checkpoint(run, epoch.done, ckpt, history)
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
    (:func:`experiments.common.evaluate.posterior_mean`) and of the model average of ``samples``."""
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


# --------------------------------------------------------------------- one run
def _cached(path: Path, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The dict saved at ``path``, else ``compute()`` saved there (atomically)."""
    if path.exists():
        return runfiles.load_torch(path)
    value = compute()
    runfiles.save_torch(path, value)
    return value


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
    seed = cfg["seed"]
    title = title or f"{cfg['data']['name']}, {cfg['optimizer']['name']}, seed {seed}"
    run = trained(cfg, folder / "train", progress=progress)
    test = metrics_on_test(run, memory["samples"])
    score = _cached(folder / SCORES_FILE, lambda: scores(run, memory, seed))
    top, random = chosen(score["default"], memory["top"], memory["random"], seed)
    rows = retrain_all(Retrainer(run, memory, seed), top + random, folder / RETRAIN, title)
    maps(run.data.train_x, score, folder, "", title)
    scatter(score, rows, top, str(memory["retrain_epochs"][-1]), folder / "scatter.png", title)
    summary = {
        "method": score["auto"],
        "test": test,
        "train_size": len(score["labels"]),
        "test_size": len(run.data.test_y),
        "retrained": {"top": top, "random": random},
        "regions": region_counts(score["regions"]),
        "retraining": summarise_retraining(score, rows, top, memory),
        "baselines": {  # Spearman over the whole training set
            name: defined(spearman(score["default"].numpy(), score[name].numpy()))
            for name in BASELINES
        },
    }
    if memory["flip"]:
        epochs = cfg["schedule"]["epochs"]
        after = None if progress is None else lambda done: progress(epochs + done)
        summary.update(_flipped(cfg, memory, folder, run.data, title, after))
    runfiles.write_json(folder / SUMMARY, summary)
    return summary


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
    maps(run.data.train_x, score, folder, "flip_", flipped, marked)
    is_flipped = torch.zeros(len(labels), dtype=torch.bool)
    is_flipped[list(flips)] = True
    return {
        "flips": summarise_flips(score, flips),
        "flip_regions": {
            "all": region_counts(score["regions"]),
            "flipped": region_counts(score["regions"][is_flipped]),
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
        x, y = train_inputs(run)
        mm = memory_map(run, x, y, samples, batch_size, cfg["seed"])
        score = default_scores(mm, y)
        title = f"{cfg['optimizer']['name']} on {cfg['data']['name']}, seed {cfg['seed']}"
        maps(run.data.train_x, score, folder, "", title)
        order = mm.scores.argsort(descending=True)[:50].tolist()
        summary = {
            "method": mm.method,
            "scores": mm.scores.cpu().tolist(),
            "regions": region_counts(score["regions"]),
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
    return cli.run(PROG, __doc__, memory_maps, _show, args, cli.parse_seeds)


if __name__ == "__main__":
    sys.exit(main())
