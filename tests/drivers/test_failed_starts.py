"""Starts that fail (issue 50): every driver leaves no folder of its own behind and never
touches an earlier run's, and a non-finite input is refused, named, before any step."""

from __future__ import annotations

import errno
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from experiments.common import data, runfiles
from experiments.common import training as train
from experiments.continual import learn as continual
from experiments.memory import converged as memory_converged
from experiments.memory import loo as memory_loo
from experiments.memory import maps as memory_map
from experiments.runs import compare, tune
from experiments.runs import train as train_command
from tests.shared import digits_affine, tiny_config, with_tables

TINY = tiny_config(optimizer={"name": "sgd", "lr": 0.05})
RUNS = {"affine": digits_affine(prior_precision=None)}
MEMORY = {
    "memory_map": {"samples": 4, "top": 2, "random": 2, "retrain_epochs": [1], "flip": 2},
    "memory_converged": {"converged": {"samples": 2, "examples": 2, "chunk": 5}},
    "memory_loo": {"loo": {"prior_precisions": [1.0, 100.0], "samples": 4}},
}
STREAM = {
    "seeds": [0],
    "stream": {"name": "permuted", "tasks": 2, "dataset": "synthetic"},
    "model": {"widths": [8]},
    "train": {"epochs": 1, "batch_size": 16},
    "eval": {"samples": 2},
    "methods": {"finetune": {"strategy": "finetune", "optimizer": {"name": "adam", "lr": 1e-3}}},
}


def config(driver: str, batch_size: int = 16) -> dict[str, Any]:
    """A tiny config of ``driver`` whose batches hold ``batch_size`` examples."""
    if driver == "continual":
        return {**STREAM, "train": {**STREAM["train"], "batch_size": batch_size}}
    cfg = with_tables(TINY, data={"batch_size": batch_size})
    if driver == "compare":
        return with_tables(cfg, optimizer=None, runs={"sgd": {"optimizer": TINY["optimizer"]}})
    if driver == "tune":
        grid = {"optimizer": TINY["optimizer"], "grid": {"lr": [0.01, 0.05]}}
        return with_tables(cfg, data={"validation": 8}, optimizer=None, runs={"sgd": grid})
    if driver in MEMORY:
        cfg = with_tables(cfg, optimizer=None, eval=None, memory=MEMORY[driver], runs=RUNS)
        return with_tables(cfg, data={"validation": 8}) if driver == "memory_loo" else cfg
    return cfg


DRIVERS: dict[str, Callable[[list[str] | None], int]] = {
    "train": train_command.main,
    "compare": compare.main,
    "tune": tune.main,
    "continual": continual.main,
    "memory_map": memory_map.main,
    "memory_converged": memory_converged.main,
    "memory_loo": memory_loo.main,
}


def start(driver: str, cfg: dict[str, Any], out: Path, *extra: str) -> int:
    """``python -m experiments.DRIVER CONFIG --out OUT EXTRA`` on ``cfg``, written beside
    the folder ``runs`` that holds ``out``."""
    runs = next(p for p in out.parents if p.name == "runs")
    path = runs.with_name(f"{driver}.json")
    path.write_text(json.dumps(cfg))
    return DRIVERS[driver]([str(path), "--out", str(out), *extra])


def error_line(capsys: pytest.CaptureFixture) -> str:
    """The one line a driver's error printed."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def disk_full(path: Path, obj: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


# ------------------------------------------------------------------------ no folder left
@pytest.mark.parametrize("driver", list(DRIVERS))
@pytest.mark.parametrize("failure", ["batch_size", "disk full"])
def test_a_failed_start_leaves_no_folder(
    driver: str,
    failure: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch larger than the data (refused before or after the lock), or a disk that is
    full at the first write (under the lock): nothing is left, the parents made neither."""
    if failure == "disk full":
        monkeypatch.setattr(runfiles, "write_json", disk_full)
    cfg = config(driver, 5000 if failure == "batch_size" else 16)
    runs = tmp_path / "runs"
    runs.mkdir()
    assert start(driver, cfg, runs / "new" / "out") == 2
    assert ("5000" if failure == "batch_size" else "No space left") in error_line(capsys)
    assert not list(runs.iterdir())


def test_a_failed_start_in_a_folder_of_ones_own_keeps_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "runs" / "mine"
    out.mkdir(parents=True)
    assert start("train", config("train", 5000), out) == 2
    assert "5000" in error_line(capsys)
    assert out.is_dir() and not list(out.iterdir())


@pytest.mark.parametrize(
    ("driver", "failure"),
    [("train", "batch_size"), ("train", "disk full"), ("compare", "disk full")],
)
def test_a_failed_resume_leaves_the_earlier_run_intact(
    driver: str,
    failure: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "runs" / "run"
    assert start(driver, config(driver), out) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert out / runfiles.LOCK in before
    capsys.readouterr()
    if failure == "disk full":
        monkeypatch.setattr(runfiles, "write_json", disk_full)
    batch_size = 5000 if failure == "batch_size" else 16
    assert start(driver, config(driver, batch_size), out, "--resume") == 2
    assert ("5000" if failure == "batch_size" else "No space left") in error_line(capsys)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_lock_taken_back_by_a_failed_start_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start that opened the lock file just as a failed start took it back locks a file
    that is no longer the folder's: it is refused, not run beside the next start."""
    real = runfiles._open_lock

    def taken_back(path: Path) -> tuple[int, bool]:
        opened = real(path)
        path.unlink()
        return opened

    monkeypatch.setattr(runfiles, "_open_lock", taken_back)
    with pytest.raises(runfiles.FolderInUseError, match="another run was starting"):
        with runfiles.locked(tmp_path / "run"):
            pass


# ------------------------------------------------------------------- non-finite inputs
def poison(monkeypatch: pytest.MonkeyPatch, split: str, index: int, value: float) -> data.Dataset:
    """Make the synthetic dataset's ``split`` input ``index`` hold ``value``; returns it."""

    @functools.wraps(data.load_synthetic)
    def poisoned(*args: Any, **options: Any) -> data.Dataset:
        loaded = data.load_synthetic(*args, **options)
        getattr(loaded, f"{split}_x")[index, 0, 0, 0] = value
        return loaded

    monkeypatch.setitem(data.DATASETS, "synthetic", poisoned)
    monkeypatch.setattr(continual, "_dataset", continual._dataset.__wrapped__)  # not cached
    return poisoned(Path("data"), train_size=32, test_size=16)


def no_step(*args: Any) -> None:
    raise AssertionError("an optimizer step ran")


def first_batch_with_nan(poisoned: data.Dataset) -> int:
    """The training batch of the run's first epoch that holds the non-finite input."""
    order = torch.Generator().manual_seed(TINY["seed"])
    batches = data.train_batches(poisoned, 16, order, torch.device("cpu"))
    return next(k for k, (x, _) in enumerate(batches, 1) if not x.isfinite().all())


def test_a_nan_training_input_is_named_before_any_step(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = first_batch_with_nan(poison(monkeypatch, "train", 17, float("nan")))
    monkeypatch.setattr(train, "_step", no_step)
    out = tmp_path / "runs" / "run"
    assert start("train", config("train"), out) == 2
    assert error_line(capsys) == (
        f"error: training input 17 (in batch {batch}) holds NaN; clean or impute the data"
    )
    assert not out.exists()


def test_an_infinite_test_input_is_named_by_every_driver_before_any_step(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison(monkeypatch, "test", 9, float("inf"))
    monkeypatch.setattr(train, "_step", no_step)
    monkeypatch.setattr(continual, "train_epoch", no_step)
    said = "input 9 (in batch 1) holds an infinity; clean or impute the data"
    runs = tmp_path / "runs"
    runs.mkdir()
    for driver, where in [("train", "test"), ("compare", "[runs.sgd]: test")]:
        assert start(driver, config(driver), runs / driver) == 2
        assert error_line(capsys) == f"error: {where} {said}"
    assert start("continual", config("continual"), runs / "continual") == 2
    said = "task 1 test input 9 holds an infinity; clean or impute the data"
    assert error_line(capsys) == f"error: [methods.finetune]: {said}"
    assert not list(runs.iterdir())


def test_the_batch_named_is_the_epochs_or_the_partial_one_it_leaves_out() -> None:
    x = torch.zeros(5, 2)
    x[3, 1] = float("nan")
    order = torch.tensor([4, 0, 2, 1, 3])
    with pytest.raises(data.NonFiniteInputError, match=r"^training input 3 \(in batch 3\)"):
        data.check_finite(x, "training", 2, order)
    left_out = r"input 3 \(in the partial batch the epoch leaves out\) holds NaN"
    with pytest.raises(data.NonFiniteInputError, match=left_out):
        data.check_finite(x, "training", 2, order, drop_last=True)
    data.check_finite(x.to(torch.uint8), "training", 2, order)  # pixels: always finite
