"""One run of a run config, trained and evaluated into its folder (:func:`train`), and the
pieces the other drivers take from it: the run (:class:`Run`, :func:`build`), its data, checks,
checkpoint and epochs, and its :data:`RUNNER`. The command is experiments/runs/train.py."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from experiments.common import config as config_module
from experiments.common import distributed, loop, runfiles, skeleton
from experiments.common.batches import BatchOptimizer
from experiments.common.data import (
    Dataset,
    DatasetNotFoundError,
    check_inputs,
    load_dataset,
    test_batches,
    train_batches,
    validation_split,
)
from experiments.common.distributed import Processes
from experiments.common.evaluate import evaluate
from experiments.common.loop import DivergedError, Divergence, Epoch
from experiments.common.models import build_model
from experiments.common.optimizers import build_optimizer, lr_factor
from experiments.common.progress import Planned
from experiments.common.skeleton import CHECKPOINT, RESULTS, ProgressHook
from liegroup_blr import predictive
from liegroup_blr.mc import mc_step

METRICS = "metrics.jsonl"

T = TypeVar("T")


@dataclass
class Run(loop.Trainee):
    """Everything a training run holds: config, data, model, optimizer, schedule, RNG."""

    cfg: dict[str, Any]
    device: torch.device
    data: Dataset
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    data_rng: torch.Generator
    processes: Processes


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU; ``cuda`` without a GPU is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise config_module.ConfigError(
            "device 'cuda' requested but CUDA is not available; valid here: 'cpu', 'auto'"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def build(cfg: dict[str, Any], processes: Processes) -> Run:
    """Seed every RNG with ``cfg['seed']``, then build data, model, optimizer and schedule.

    ``cfg['threads']`` > 0 sets torch's intra-op threads (:func:`~experiments.common.skeleton.
    seed_everything`).

    Fills in ``cfg['data']['augment']`` with the dataset's default when unset. With
    ``[data] validation`` > 0 the run trains on the rest of the training set and evaluates on
    the held-out part (:func:`~experiments.common.data.validation_split`). The optimizer's data size
    is N = da_factor × (training-set size). Every process of a torchrun builds the same model;
    the optimizers give each its own noise.
    """
    seed = cfg["seed"]
    skeleton.seed_everything(seed, cfg["threads"])
    device = distributed.device_for(resolve_device(cfg["device"]).type, processes)
    data = load_data(cfg["data"])
    if cfg["data"]["augment"] is None:
        cfg["data"]["augment"] = data.augment
    model = distributed.shard(_model(cfg, data, device), processes)
    optimizer = _optimizer(cfg, model, data, processes, processes.group)
    schedule = partial(
        lr_factor, epochs=cfg["schedule"]["epochs"], warmup=cfg["schedule"]["warmup"]
    )
    scheduler = LambdaLR(optimizer, schedule)
    data_rng = torch.Generator().manual_seed(seed)
    return Run(cfg, device, data, model, optimizer, scheduler, data_rng, processes)


def load_data(dcfg: dict[str, Any]) -> Dataset:
    """The data of a resolved ``[data]`` table: its dataset, with ``validation`` training
    examples held out as the evaluation set when it is > 0."""
    options = {k: v for k, v in dcfg.items() if k not in config_module.SECTIONS["data"]}
    data = load_dataset(dcfg["name"], dcfg["root"], **options)
    if dcfg["validation"]:
        data = validation_split(data, dcfg["validation"], dcfg["validation_seed"])
    return data


def _optimizer(
    cfg: dict[str, Any], model: nn.Module, data: Dataset, processes: Processes, group: Any
) -> torch.optim.Optimizer:
    """The run's optimizer on ``model``: N = da_factor × (training-set size), this process's
    share of the samples, the optimizers' ``process_group`` ``group``."""
    ocfg = cfg["optimizer"]
    if processes.sharded and (ocfg["name"] == "ivon" or _vectorized(ocfg)):
        raise config_module.ConfigError(
            "parallel = 'fsdp' shards the parameters (DTensor), which ivon's optimizer and "
            "the vectorised samples (vectorize, batch_split) do not take: use parallel = 'data'"
        )
    if ocfg["name"] == "vi" and processes.world > 1:
        raise config_module.ConfigError(
            "optimizer 'vi' (posteriors' mean-field VI) trains in one process: run it without "
            "torchrun"
        )
    if ocfg["name"] == "ivon" and cfg["parallel"] == "mc" and processes.world > 1:
        raise config_module.ConfigError(
            "ivon draws its noise from torch's global generator, the same on every process: "
            "train it with parallel = 'data' (or in one process)"
        )
    local = {**ocfg}
    if "mc_samples" in ocfg:
        local["mc_samples"] = distributed.local_samples(
            ocfg["mc_samples"], cfg["parallel"], processes
        )
    data_size = cfg["data"]["da_factor"] * len(data.train_y)
    return build_optimizer(local, model.parameters(), data_size, group)


def check(cfg: dict[str, Any], data: Dataset, processes: Processes) -> None:
    """Raise what the run of the resolved config ``cfg`` on ``data`` (:func:`load_data`)
    would raise when it starts, without training: its device, a batch size that fits the
    data and the processes, and every value its optimizer checks, by building the optimizer
    on the run's model (on the CPU, without a process group). Global RNGs move; :func:`build`
    seeds them again."""
    resolve_device(cfg["device"])
    _check_data(cfg, data, processes)
    _optimizer(cfg, _model(cfg, data, torch.device("cpu")), data, processes, None)


def check_runs(configs: dict[str, dict[int, dict[str, Any]]], labelled: bool = True) -> None:
    """Raise what any run of ``configs`` would raise when it starts (:func:`check`: its data,
    device and every value its optimizer checks), before any trains or writes; the error
    names the run (``[runs.LABEL]: ...``) if the config is ``labelled`` by [runs] tables.
    Each dataset is loaded once; a label's seeds differ in the seed alone, so its first is
    checked."""
    datasets: dict[str, Dataset] = {}
    for label, by_seed in configs.items():
        cfg = next(iter(by_seed.values()))
        try:
            key = json.dumps(cfg["data"], sort_keys=True)
            if key not in datasets:
                datasets[key] = load_data(cfg["data"])
            check(cfg, datasets[key], distributed.from_environment(cfg["parallel"]))
        except (ValueError, DatasetNotFoundError) as err:
            raise config_module.ConfigError(
                f"[runs.{label}]: {err}" if labelled else str(err)
            ) from None


def _model(cfg: dict[str, Any], data: Dataset, device: torch.device) -> nn.Module:
    """The config's network for ``data``, on ``device``."""
    mcfg = cfg["model"]
    options = {k: v for k, v in mcfg.items() if k != "name"}
    return build_model(mcfg["name"], data.input_shape, data.num_classes, **options).to(device)


def _gathered(run: Run) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded run's model and optimizer whole, as one process holds them, gathered from
    the shards on every process (collectives: every process calls it)."""
    cfg = run.cfg
    model = _model(cfg, run.data, run.device)
    model.load_state_dict(distributed.full_state(run.model.state_dict()))
    data_size = cfg["data"]["da_factor"] * len(run.data.train_y)
    optimizer = build_optimizer({**cfg["optimizer"]}, model.parameters(), data_size)
    optimizer.load_state_dict(distributed.full_state(run.optimizer.state_dict()))
    return model, optimizer


def save_checkpoint(run: Run, epoch: int, path: Path, history: list[dict[str, Any]]) -> None:
    """Write model, optimizer, scheduler, RNG states, the epoch count and the metrics rows
    so far atomically (:meth:`experiments.common.loop.Trainee.save`)."""
    run.save(path, {"epoch": epoch}, history=history)


def load_checkpoint(run: Run, path: Path) -> tuple[int, list[dict[str, Any]]]:
    """Restore a checkpoint written by :func:`save_checkpoint`; returns its epoch count and
    metrics rows (a checkpoint from before the rows were kept: those of ``metrics.jsonl``)."""
    epoch, state = run.restore(path, lambda state: (int(state["epoch"]), state))
    if "history" in state:
        return epoch, state["history"]
    rows = runfiles.read_jsonl(path.with_name(METRICS))
    return epoch, [r for r in rows if r["epoch"] <= epoch]


def _step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on a minibatch; returns the loss (mean over posterior samples).

    With ``vectorize`` or ``batch_split > 1`` the samples go through
    :func:`liegroup_blr.mc.mc_step` (vmap over samples; each sample on its own slice of the
    batch, the reference's ``batchsplit``); a :class:`~experiments.common.batches.BatchOptimizer`
    takes the minibatch itself; else through ``optimizer.step`` on the mean cross-entropy's
    closure (:func:`experiments.common.loop.closure`), which every other optimizer takes alike.
    """
    ocfg = run.cfg["optimizer"]
    x, y = distributed.local_batch(x, y, run.cfg["parallel"], run.processes)
    if isinstance(run.optimizer, BatchOptimizer):
        return run.optimizer.step(batch=(run.model, x, y))
    if _vectorized(ocfg):
        options = {"vectorize": ocfg["vectorize"], "batch_split": ocfg["batch_split"]}
        return float(mc_step(run.optimizer, run.model, cross_entropy, x, y, **options))
    return float(run.optimizer.step(loop.closure(run.optimizer, run.model, x, y)))


def _vectorized(ocfg: dict[str, Any]) -> bool:
    """Whether the samples of a step go through :func:`liegroup_blr.mc.mc_step`."""
    return bool(ocfg.get("vectorize")) or ocfg.get("batch_split", 1) > 1


def train_epoch(run: Run, epoch: int) -> float:
    """One pass over the training set (:meth:`experiments.common.loop.Trainee.steps`); returns the
    mean training loss (at posterior samples). Raises :class:`DivergedError` as soon as a
    loss or, after an update, a parameter is not finite."""
    cfg = run.cfg
    size = cfg["data"]["batch_size"]
    batches = train_batches(run.data, size, run.data_rng, run.device, cfg["data"]["augment"])
    steps = (partial(_step, run, x, y) for x, y in batches)
    desc = f"epoch {epoch + 1}/{cfg['schedule']['epochs']}"
    return run.steps(epoch, steps, desc, total=len(run.data.train_y) // size, size=size)


def checkpoint_path(out: Path, processes: Processes) -> Path:
    """``checkpoint.pt`` for rank 0; each other torchrun process keeps its own (its noise)."""
    return out / (CHECKPOINT if processes.main else f"checkpoint.rank{processes.rank}.pt")


def _check_data(cfg: dict[str, Any], data: Dataset, processes: Processes) -> None:
    """What only the loaded data can tell: every epoch takes at least one step, and every
    input is finite (the error names the first in the batches of the first epoch,
    :func:`~experiments.common.data.check_inputs`)."""
    batch, size = cfg["data"]["batch_size"], len(data.train_y)
    if batch > size:
        raise config_module.ConfigError(
            f"[data].batch_size {batch} exceeds the {size} training examples: no step would "
            "run (the last partial batch is dropped)"
        )
    world = processes.world
    if cfg["parallel"] != "mc" and batch % world:
        raise config_module.ConfigError(
            f"[data].batch_size {batch} must be divisible by the {world} processes "
            f"(parallel '{cfg['parallel']}')"
        )
    first_epoch = torch.Generator().manual_seed(cfg["seed"])  # build's data_rng
    check_inputs(data, batch, cfg["data"]["test_batch_size"], first_epoch)


def _prepare(
    cfg: dict[str, Any], out: Path, resume: bool, processes: Processes, lock: contextlib.ExitStack
) -> tuple[Run, int, list[dict[str, Any]]]:
    """The run's preamble (:func:`~experiments.common.skeleton.opened_run`, rank 0 holding the lock
    in ``lock``), its data checked: (run, epochs done, metrics rows). Writes nothing."""

    def built() -> Run:
        run = build(cfg, processes)  # fills in defaults that depend on the data (augment)
        _check_data(cfg, run.data, processes)
        return run

    ckpt = checkpoint_path(out, processes)
    fresh: tuple[int, list[dict[str, Any]]] = (0, [])
    opened = skeleton.opened_run(
        out, cfg, resume, METRICS, built, load_checkpoint, fresh, ckpt, processes.main
    )
    run, (start, history) = lock.enter_context(opened)
    return run, start, history


def on_every_process(step: Callable[[], T], processes: Processes) -> T:
    """Run ``step`` on every process; if it fails on one, the others fail too (not hang)."""
    try:
        result = step()
    except BaseException:
        distributed.all_agree(False, processes)
        raise
    if not distributed.all_agree(True, processes):
        raise runfiles.RunError("another process of this torchrun could not start; see its error")
    return result


def planned(label: str, cfg: dict[str, Any], folder: Path, resume: bool) -> Planned:
    """The run of ``cfg`` in ``folder`` for the progress: its epochs, gradient evaluations per
    step as their cost, and with ``resume`` the epochs done and whether it finished."""
    return Planned(
        label,
        cfg["schedule"]["epochs"],
        cfg["optimizer"].get("mc_samples", 1),
        len(runfiles.read_jsonl(folder / METRICS)) if resume else 0,
        resume and skeleton.run_state(folder) == "finished",
    )


def train(
    raw: dict[str, Any],
    out: str | Path,
    resume: bool = False,
    progress: ProgressHook | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Train and evaluate the run of config ``raw`` into folder ``out``; returns the results
    (on rank 0; other torchrun processes train alongside and return ``{}``).

    Everything is checked before anything is written; rank 0 holds the folder's lock for
    the run's life. Each epoch's metrics row is saved inside its checkpoint, then
    ``metrics.jsonl`` is rewritten from it, so no kill loses a row. ``progress`` hears of
    every epoch; ``title`` names the run in its figures (default: ``"DATA, MODEL: RULE, seed
    S"``).
    """
    cfg = config_module.resolve(raw)
    processes = distributed.from_environment(cfg["parallel"])
    out = Path(out)
    data = skeleton.data_name(cfg, out)
    title = title or f"{data}: {cfg['optimizer']['name']}, seed {cfg['seed']}"
    with contextlib.ExitStack() as lock:
        prepare = partial(_prepare, cfg, out, resume, processes, lock)
        run, start, history = on_every_process(prepare, processes)
        if processes.main:
            skeleton.start_run(out, cfg, METRICS, history)
        distributed.barrier(processes)
        results = _train(run, out, start, history, progress, title)
    return results


def _train(
    run: Run,
    out: Path,
    start: int,
    history: list[dict[str, Any]],
    progress: ProgressHook | None,
    title: str,
) -> dict[str, Any]:
    """Epochs ``start`` .. E, each checkpointed with its metrics row, then the evaluation."""
    cfg, processes = run.cfg, run.processes
    ckpt = checkpoint_path(out, processes)
    test = test_batches(run.data, cfg["data"]["test_batch_size"], run.device)
    epochs = cfg["schedule"]["epochs"]
    for epoch in run.epochs(start, epochs, partial(train_epoch, run), progress):
        if processes.main or processes.sharded:  # sharded: the forward passes gather
            row = _epoch_row(run, test, epoch)
        if processes.main:
            if runfiles.nonfinite(row):
                what = f"non-finite test metrics {runfiles.nonfinite(row)}"
                raise Divergence(epoch.index, what).error()
            history.append(row)
        save_checkpoint(run, epoch.done, ckpt, history)
        if processes.main:
            runfiles.write_jsonl(out / METRICS, history)
    model, optimizer = run.model, run.optimizer
    if processes.sharded:  # the last collectives: every process's are done before one leaves
        model, optimizer = _gathered(run)
        distributed.barrier(processes)
    if not processes.main:
        return {}
    tic = time.perf_counter()
    results = evaluate(model, optimizer, test, cfg["eval"], out, title=title)
    results["train_seconds"] = sum(r["train_seconds"] for r in history)
    results["steps"] = epochs * (len(run.data.train_y) // cfg["data"]["batch_size"])
    results["fastest_pass_seconds"] = min(r["train_seconds"] for r in history)
    results["eval_seconds"] = time.perf_counter() - tic
    results["epochs"] = epochs
    results["train_size"], results["test_size"] = len(run.data.train_y), len(run.data.test_y)
    results["eval_set"] = run.data.eval_set
    results["data_size"] = cfg["data"]["da_factor"] * len(run.data.train_y)
    results["optimizer"] = cfg["optimizer"]["name"]
    results["processes"] = processes.world
    if runfiles.nonfinite(results):
        raise DivergedError(
            f"the final metrics {runfiles.nonfinite(results)} of {out} are not finite; "
            f"{RESULTS} was not written"
        )
    runfiles.write_json(out / RESULTS, results)
    return results


def _epoch_row(
    run: Run, test: list[tuple[torch.Tensor, torch.Tensor]], epoch: Epoch
) -> dict[str, Any]:
    """The epoch's metrics line (test accuracy and NLL at the point estimate), also printed
    (followed by what the progress said)."""
    log_probs = predictive.predictive_log_probs(run.model, [x for x, _ in test])
    labels = torch.cat([y for _, y in test])
    row = {
        "epoch": epoch.done,
        "lr": epoch.lr,
        "train_loss": epoch.loss,
        "test_accuracy": predictive.accuracy(log_probs, labels),
        "test_nll": predictive.nll(log_probs, labels),
        "train_seconds": epoch.seconds,
    }
    if run.processes.main:
        tqdm.write(
            f"epoch {epoch.done}/{run.cfg['schedule']['epochs']}: loss {epoch.loss:.4f}, test "
            f"accuracy at g {100 * row['test_accuracy']:.2f}%, NLL {row['test_nll']:.4f}, "
            f"{epoch.seconds:.1f}s" + (f" | {epoch.note}" if epoch.note else "")
        )
    return row


RUNNER = skeleton.Runner(train, planned, lambda cfg: str(cfg["optimizer"]["name"]), check_runs)
"""How the drivers train one run of a run config (:func:`train`)."""
