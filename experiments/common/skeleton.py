"""The run skeleton every driver stands on: seeding, checkpoints, the epoch loop, and the runs
of a config trained one after another into ``OUT/LABEL/seedS`` with the time left.

A driver (train, compare, tune, continual, memory_map, peers) resolves its config into
label → seed → run config (:mod:`experiments.common.config`), then::

    RUNNER.check(configs)                              # every run, before anything is written
    with runfiles.locked(out):
        prepare_folder(out, written, resume)          # check the folder, write config.json
        per_seed = run_all(configs, out, resume, RUNNER)
        write_report(out, results, report_text)       # results.json, report.md

where ``RUNNER`` (:class:`Runner`) trains one run into its folder. That trainer seeds with
:func:`seed_everything`, checks its folder with :func:`check_run_folder` and
:func:`check_same_config`, and trains on the loop of experiments/common/loop.py
(:class:`~experiments.common.loop.Trainee`: its epochs on :func:`timed_epochs`, its checkpoint
after every epoch with every RNG state of :func:`rng_state`, restored by :func:`restore`).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler

from experiments.common import runfiles
from experiments.common.config import ConfigError
from experiments.common.progress import Planned, Progress

CONFIG = "config.json"
RESULTS = "results.json"
CHECKPOINT = "checkpoint.pt"

T = TypeVar("T")
R = TypeVar("R")

ProgressHook = Callable[[int], str]
"""Told the epochs a run has done when it starts and after every epoch; what it returns
after an epoch ends that epoch's line (:class:`experiments.common.progress.Progress`)."""


# ----------------------------------------------------------------------------- one run
def seed_everything(seed: int, threads: int = 0) -> None:
    """Seed python's, numpy's and torch's global generators with ``seed``.

    ``threads`` > 0 sets torch's intra-op threads: matrix products split over a different
    number of threads round differently, so one fixed count makes a run's numbers the same on
    every machine with the same torch build.
    """
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 (the global numpy RNG is seeded and checkpointed)
    torch.manual_seed(seed)


def rng_state(data_rng: torch.Generator) -> dict[str, Any]:
    """Every RNG state a run draws from (torch, numpy, python, CUDA) and ``data_rng``'s."""
    _, keys, pos, has_gauss, gauss = cast(tuple, np.random.get_state())  # noqa: NPY002
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "python": random.getstate(),
        "data": data_rng.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(data_rng: torch.Generator, state: dict[str, Any]) -> None:
    """Restore the states of :func:`rng_state` (``data_rng``'s into ``data_rng``)."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, npy["pos"], npy["has_gauss"], npy["gauss"]))  # noqa: NPY002
    random.setstate(state["python"])
    data_rng.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore(
    path: Path, loaders: Mapping[str, Callable[[Any], object] | None], read: Callable[[Any], T]
) -> T:
    """Load checkpoint ``path``, hand each entry named in ``loaders`` to its loader (None:
    nothing to restore) and return ``read(state)`` (where the run stands); a checkpoint that is
    not of this run raises :class:`~experiments.common.runfiles.CorruptFileError` naming it."""
    state = runfiles.load_torch(path)
    try:
        for key, load in loaders.items():
            if load is not None:
                load(state[key])
        return read(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise runfiles.CorruptFileError(
            f"checkpoint {path} is corrupt or not of this run ({reason})"
        ) from None


def timed_epochs(
    start: int, stop: int, train_epoch: Callable[[int], float], scheduler: LRScheduler
) -> Iterator[tuple[int, float, float, float]]:
    """Epochs ``start`` … ``stop − 1``: each trains (``train_epoch(epoch)`` → its mean loss)
    and steps the ``scheduler``; yields (epoch, its learning rate, loss, seconds it trained)."""
    for epoch in range(start, stop):
        tic = time.perf_counter()
        lr = scheduler.optimizer.param_groups[0]["lr"]
        loss = train_epoch(epoch)
        scheduler.step()
        yield epoch, lr, loss, time.perf_counter() - tic


def check_run_folder(out: Path, resume: bool, ckpt: Path, progress: str) -> None:
    """Refuse a run folder that holds anything but this run's own resumable state.

    Without ``resume`` the folder must be new or empty. With it, the folder must hold a run's
    ``config.json`` and either its checkpoint ``ckpt`` or nothing yet trained (no rows in its
    ``progress`` file).
    """
    held = runfiles.contents(out)
    if not held:
        return
    if not resume:
        raise FileExistsError(
            f"{out} already holds files {held}; pass --resume to continue the run there, "
            "or choose another --out"
        )
    untrained = set(held) <= {CONFIG, progress} and not runfiles.read_jsonl(out / progress)
    if CONFIG not in held or not (ckpt.exists() or untrained):
        raise FileExistsError(
            f"{out} holds {held} but no {ckpt.name} to resume from; nothing was changed, "
            "choose another --out"
        )


def check_same_config(out: Path, cfg: dict[str, Any], resume: bool) -> None:
    """On ``resume``, the resolved ``cfg`` must be the one the run in ``out`` trained with;
    the error names the keys that differ, with both values."""
    if not (resume and (out / CONFIG).exists()):
        return
    saved = runfiles.read_json(out / CONFIG)
    if saved != cfg:
        changes = config_changes(saved, cfg)
        shown = "; ".join(f"{key}: {old!r} then, {new!r} now" for key, old, new in changes[:5])
        more = f" and {len(changes) - 5} more" if len(changes) > 5 else ""
        raise ConfigError(
            f"the config differs from the one {out} was trained with ({out / CONFIG}): "
            f"{shown}{more}; resume with that config or train into another folder"
        )


@contextlib.contextmanager
def opened_run(
    out: Path,
    cfg: dict[str, Any],
    resume: bool,
    rows: str,
    build: Callable[[], R],
    restore: Callable[[R, Path], T],
    fresh: T,
    ckpt: Path | None = None,
    lock: bool = True,
) -> Iterator[tuple[R, T]]:
    """The preamble of one run in folder ``out``: lock it (unless not ``lock``: a torchrun
    process other than rank 0), check it (:func:`check_run_folder`, ``rows`` its progress
    file), ``build`` the run, check ``cfg`` against the stored config (after ``build``, which
    may fill in defaults) and ``restore(run, ckpt)`` on resume; yields (run, where it stands:
    ``fresh`` when there is no checkpoint ``ckpt``, default ``out/checkpoint.pt``) with the
    folder locked. Writes nothing (:func:`start_run` does)."""
    with runfiles.locked(out) if lock else contextlib.nullcontext():
        ckpt = out / CHECKPOINT if ckpt is None else ckpt
        check_run_folder(out, resume, ckpt, rows)
        run = build()
        check_same_config(out, cfg, resume)
        yield run, restore(run, ckpt) if resume and ckpt.exists() else fresh


def start_run(out: Path, cfg: dict[str, Any], rows: str, kept: list[dict[str, Any]]) -> None:
    """A run's first files in ``out``: leftovers removed, its ``config.json`` and its progress
    file ``rows`` holding the rows ``kept`` so far."""
    runfiles.remove_leftovers(out)
    runfiles.write_json(out / CONFIG, cfg)
    runfiles.write_jsonl(out / rows, kept)


def config_changes(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """The dotted keys whose values differ between two configs, with both values (a key one
    of them lacks shows as ``None`` there)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            out += config_changes(old.get(key), new.get(key), path)
        return out
    return [] if old == new else [(prefix, old, new)]


def clear(out: Path) -> None:
    """Delete a run's files from its folder ``out``: everything but its checkpoints, then the
    checkpoints (a kill in between leaves a run that still has its checkpoint)."""
    if not out.is_dir():
        return
    held = [out / name for name in runfiles.contents(out)]
    checkpoints = [p for p in held if p.name.startswith("checkpoint") and p.suffix == ".pt"]
    for path in [p for p in held if p.is_file() and p not in checkpoints] + checkpoints:
        path.unlink(missing_ok=True)
    runfiles.remove_leftovers(out)


# ----------------------------------------------------------------------------- the folder
Configs = dict[str, dict[int, dict[str, Any]]]
"""label → seed → resolved run config."""


def written(configs: Configs) -> dict[str, dict[str, Any]]:
    """``configs`` as ``config.json`` holds them (seeds as strings)."""
    return {label: {str(s): c for s, c in by_seed.items()} for label, by_seed in configs.items()}


def _refuse_other_files(out: Path, resume: bool) -> None:
    """Refuse a folder with files without ``resume``, or with files but no config.json."""
    held = runfiles.contents(out)
    if held and not resume:
        raise FileExistsError(
            f"{out} already holds files {held}; pass --resume to continue there, or choose "
            "another --out"
        )
    if held and not (out / CONFIG).exists():
        raise FileExistsError(f"{out} holds {held} but no runs to resume (no {CONFIG})")


def run_state(folder: Path) -> str:
    """``"finished"`` (its results written), ``"started"`` (a checkpoint) or ``"new"``."""
    if (folder / RESULTS).exists():
        return "finished"
    started = (folder / CHECKPOINT).exists() or any(folder.glob("checkpoint.rank*.pt"))
    return "started" if started else "new"


def changed_runs(out: Path, before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str]]:
    """The runs (label, seed) of ``now`` whose config differs from ``before`` (label → seed →
    config, as in config.json); refuses a finished run among them, and a started run that
    ``now`` drops."""
    keys = {(label, seed) for runs in (before, now) for label in runs for seed in runs[label]}
    changed, refused = [], []
    for label, seed in sorted(keys):
        old, new = before.get(label, {}).get(seed), now.get(label, {}).get(seed)
        if old == new:
            continue
        state = run_state(out / label / f"seed{seed}")
        if state == "finished" or (new is None and state == "started"):
            refused.append(f"{label!r} seed {seed} ({state}{', dropped' if new is None else ''})")
        elif new is not None:
            changed.append((label, seed))
    if refused:
        raise ConfigError(
            f"the config changes run(s) {', '.join(refused)} of {out}: a run may change only "
            f"until it finishes (a started one starts again); resume with the config in "
            f"{out / CONFIG} for those runs, or choose another --out"
        )
    return changed


def prepare_folder(
    out: Path, runs: dict[str, Any], resume: bool, shared: dict[str, Any] | None = None
) -> None:
    """Check ``out`` for the runs ``runs`` (label → seed → config, :func:`written`) and write
    its config.json (call with the folder locked).

    Without ``resume`` the folder must be empty. With it, a run may change its config only if
    it has not finished: one that has started begins again from scratch (said in one line),
    one that has not loses any files it left. ``shared`` holds a driver's own tables (its
    ``[memory]``, ``[laplace]``): config.json is then ``{"runs": runs, **shared}``, and such
    a driver resumes only with the same config (a run folder holds several trainings).
    """
    _refuse_other_files(out, resume)
    whole = runs if shared is None else {"runs": runs, **shared}
    if resume and (out / CONFIG).exists():
        before = runfiles.read_json(out / CONFIG)
        if shared is not None and before != whole:
            raise ConfigError(
                f"the config differs from the one {out} was run with ({out / CONFIG}); "
                "resume with that config or choose another --out"
            )
        for label, seed in changed_runs(out, before, runs) if shared is None else []:
            folder = out / label / f"seed{seed}"
            if run_state(folder) == "started":
                print(
                    f"== run {label!r}, seed {seed}: its config changed, it starts again",
                    flush=True,
                )
            clear(folder)
    runfiles.remove_leftovers(out)
    runfiles.write_json(out / CONFIG, whole)


def write_report(
    out: Path, results: dict[str, Any], report: str, files: tuple[str, str] = (RESULTS, "report.md")
) -> None:
    """A driver's ``results`` as JSON and its Markdown ``report``, into the ``files`` of
    ``out``."""
    runfiles.write_json(out / files[0], results)
    runfiles.write_text(out / files[1], report + "\n")


def data_name(cfg: dict[str, Any], out: Path) -> str:
    """What a figure's title calls a run's data: the data set and the model (``mnist5k,
    cnn``), else the output folder's name (a driver whose config has no ``[data]``)."""
    data, model = cfg.get("data", {}).get("name"), cfg.get("model", {}).get("name")
    return f"{data}, {model}" if data and model else out.name


# ----------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Runner:
    """How a driver trains one run.

    ``train(cfg, folder, resume, progress=, title=)`` trains the run config ``cfg`` into
    ``folder`` and returns its results; ``planned(label, cfg, folder, resume)`` is the run for
    the progress (:class:`~experiments.common.progress.Planned`: its epochs, their cost in gradient
    evaluations, the epochs done and whether it finished); ``kind(cfg)`` names what it trains
    (an optimizer, a strategy); ``check(configs)`` raises, before any run trains or the
    driver writes, what any run of ``configs`` would raise when it starts, naming the run.
    """

    train: Callable[..., dict[str, Any] | None]
    planned: Callable[[str, dict[str, Any], Path, bool], Planned]
    kind: Callable[[dict[str, Any]], str]
    check: Callable[[Configs], None]


def run_all(
    configs: Configs, out: Path, resume: bool, runner: Runner, main: bool = True
) -> dict[str, dict[str, Any]]:
    """Train every run and seed of ``configs`` in turn into ``out/LABEL/seedS`` with
    ``runner``; the ``main`` process prints the runs done, the time elapsed and the time left
    after every epoch and run. Returns label → seed (a string) → results."""
    plan = {
        (label, seed): runner.planned(label, cfg, out / label / f"seed{seed}", resume)
        for label, by_seed in configs.items()
        for seed, cfg in by_seed.items()
    }
    progress = Progress(plan)
    per_seed: dict[str, dict[str, Any]] = {label: {} for label in configs}
    for label, by_seed in configs.items():
        for seed, cfg in by_seed.items():
            kind = runner.kind(cfg)
            print(f"== run {label!r} ({kind}), seed {seed}", flush=True)
            tic = time.perf_counter()
            per_seed[label][str(seed)] = runner.train(
                cfg,
                out / label / f"seed{seed}",
                resume,
                progress=partial(progress.epoch, (label, seed)) if main else None,
                title=f"{data_name(cfg, out)}: {label}{f' ({kind})' if kind != label else ''}, "
                f"seed {seed}",
            )
            done = f"== run {label!r}, seed {seed} done in {time.perf_counter() - tic:.1f}s"
            print(done + (f"; {progress.end((label, seed))}" if main else ""), flush=True)
    return per_seed
