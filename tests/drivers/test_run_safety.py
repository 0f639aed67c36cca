"""Runs that never lose or misreport a result (issue 11): kills at chosen writes and an
interruption before every write, two processes on one folder, divergence, bad input (one
line, exit status 2, nothing written), paths from configs and data files."""

from __future__ import annotations

import json
import math
import os
import pickle
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from experiments.common import cli, data, distributed, runfiles
from experiments.common import config as config_module
from experiments.common import training as train
from experiments.runs import compare, tune
from experiments.runs import train as train_command
from liegroup_blr import predictive
from tests.shared import tiny_config, with_tables

ROOT = Path(__file__).resolve().parents[2]


def _write_target(event: str, args: tuple[Any, ...]) -> tuple[str | None, bool]:
    """The file an audited event writes (an open for writing, an ``os.replace`` onto it) and
    whether the open truncates it; ``(None, False)`` for any other event."""
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        path, mode, flags = args
        if mode is None:  # os.open
            write = bool(flags & (os.O_WRONLY | os.O_RDWR))
            return (os.fspath(path), bool(flags & os.O_TRUNC)) if write else (None, False)
        return (os.fspath(path), "w" in mode) if any(c in mode for c in "wax+") else (None, False)
    if event == "os.rename" and isinstance(args[1], (str, os.PathLike)):
        return os.fspath(args[1]), False
    return None, False


def _in(folder: str, path: str) -> bool:
    return os.path.dirname(os.path.realpath(path)) == folder


def child_main(argv: list[str]) -> None:
    """A child process: ``experiments.runs.train ARGS`` killed with SIGKILL at a chosen write in
    the run folder, before it happens (an open that truncates truncates first, as it would).

    ``POINT`` is ``NAME:N``, the N-th write of the file named NAME, or ``next:NAME:N``, the
    first write after that one. With ``pause`` the child creates the file READY and sleeps
    there instead (its parent kills it).
    """
    folder, point, action, ready, *args = argv
    # Ctrl-C as a terminal delivers it: a shell that started the suite in the background
    # hands its processes SIGINT ignored, which they would pass on to this child
    signal.signal(signal.SIGINT, signal.default_int_handler)
    after = point.startswith("next:")
    name, nth = point.removeprefix("next:").rsplit(":", 1)
    seen, armed = 0, False

    def hook(event: str, hook_args: tuple[Any, ...]) -> None:
        nonlocal seen, armed
        path, truncates = _write_target(event, hook_args)
        if path is None or not _in(folder, path):
            return
        if not armed and os.path.basename(path) == name:
            seen += 1
            armed = seen == int(nth)
            if armed and after:
                return
        if armed:
            if action == "pause":
                Path(ready).touch()
                time.sleep(120)
            if truncates:
                os.truncate(path, 0)
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    sys.exit(train_command.main(args))


class Interrupted(BaseException):
    """Stands in for a kill inside one process (nothing catches a BaseException)."""


def evaluate_without_figures(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    test: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: dict[str, Any],
    out: Path,
    title: str,
) -> dict[str, Any]:
    """The final evaluation at g with one small file for the figures (matplotlib would take
    most of the time of the sweep)."""
    log_probs = predictive.predictive_log_probs(model, [x for x, _ in test])
    (out / "figure.txt").write_text("figures")
    return {"point": predictive.metrics(log_probs, torch.cat([y for _, y in test]), cfg["bins"])}


def sweep_main(argv: list[str]) -> None:
    """A child process: interrupt a run at each of its writes in turn, then resume it and
    compare with the uninterrupted run. (An audit hook cannot be removed, hence a child.)"""
    train.evaluate = evaluate_without_figures  # type: ignore[assignment]
    target = {"folder": "", "at": 0, "seen": 0}

    def hook(event: str, args: tuple[Any, ...]) -> None:
        path, truncates = _write_target(event, args)
        if not target["at"] or path is None or not _in(str(target["folder"]), path):
            return
        target["seen"] += 1
        if target["seen"] == target["at"]:
            target["at"] = 0
            if truncates and os.path.exists(path):
                os.truncate(path, 0)
            raise Interrupted

    sys.addaudithook(hook)
    root = Path(argv[0])
    ref_out = root / "reference"
    ref = {"results": train.train(tiny(), ref_out), "rows": metrics(ref_out)}
    ref["state"] = torch.load(ref_out / "checkpoint.pt", weights_only=True)
    for at in range(1, 1000):
        out = root / f"interrupted-at-{at}"
        target.update(folder=str(out.resolve()), at=at, seen=0)
        try:
            train.train(tiny(), out)
        except Interrupted:
            pass
        else:
            print(f"interrupted at each of {at - 1} writes")
            return
        assert_consistent_on_disk(out)
        assert_matches_reference(out, train.train(tiny(), out, resume=True), ref)


def tiny(**sections: Any) -> dict[str, Any]:
    """Three epochs of two steps of the additive rule on 3-class 1×8×8 synthetic data."""
    cfg = tiny_config(
        data={"test_batch_size": 16},
        optimizer={"name": "additive", "lr": 0.05, "mc_samples": 2},
        schedule={"epochs": 3},
        eval={"sparsity_samples": 1, "bins": 5},
    )
    return with_tables(cfg, **sections)


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(json.dumps(cfg))
    return path


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses the bare NaN / Infinity Python writes by default."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def metrics(out: Path) -> list[dict[str, Any]]:
    text = (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""
    return [strict_json(line) for line in text.splitlines()]


def without_times(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: without_times(v) for k, v in obj.items() if not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [without_times(v) for v in obj]
    return obj


def run_files(out: Path) -> set[str]:
    """What a folder holds besides the run lock."""
    return {p.name for p in out.iterdir()} - {".lock"} if out.exists() else set()


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def assert_consistent_on_disk(out: Path) -> None:
    """Every JSON file parses strictly and metrics.jsonl holds epochs 1..k, k <= checkpoint's."""
    for path in out.glob("*.json"):
        strict_json(path.read_text())
    epochs = [row["epoch"] for row in metrics(out)]
    assert epochs == list(range(1, len(epochs) + 1))
    if (out / "checkpoint.pt").exists():
        assert len(epochs) <= torch.load(out / "checkpoint.pt", weights_only=True)["epoch"]


def python(function: str, *args: str) -> list[str]:
    """The command running ``function(ARGS)`` of this module in a child process."""
    module = "tests.drivers.test_run_safety"
    code = f"import sys; from {module} import {function}; {function}(sys.argv[1:])"
    return [sys.executable, "-c", code, *args]


# the same threads as this process, so that the child's floating point matches the reference
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


def child(out: Path, point: str, *args: str, action: str = "kill") -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    command = python("child_main", str(out.resolve()), point, action, str(out.parent / "ready"))
    command += [*args, "--out", str(out)]
    return subprocess.Popen(command, cwd=ROOT, env=CHILD_ENV, stderr=subprocess.PIPE, text=True)


def killed_at(out: Path, point: str, *args: str) -> None:
    proc = child(out, point, *args)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err  # the chosen instant was reached


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run: results, metrics rows and final checkpoint."""
    out = tmp_path_factory.mktemp("reference") / "run"
    results = train.train(tiny(), out)
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    return {"results": results, "rows": metrics(out), "state": state}


def assert_matches_reference(out: Path, results: dict[str, Any], ref: dict[str, Any]) -> None:
    rows = metrics(out)
    assert without_times(rows) == without_times(ref["rows"])
    assert without_times(results) == without_times(ref["results"])
    assert results["train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in rows))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    for key, value in ref["state"]["model"].items():
        assert torch.equal(value, state["model"][key]), key


# ------------------------------------------------------------------ kills at chosen instants


def test_kill_after_a_checkpoint_loses_no_metrics_row(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny())
    # the third write of metrics.jsonl (empty, epoch 1, epochs 1-2) after epoch 2's checkpoint
    killed_at(out, "metrics.jsonl:3", str(cfg))
    assert_consistent_on_disk(out)
    assert list(out.glob(".metrics.jsonl.*.tmp"))  # the kill left its temporary file
    results = train.train(tiny(), out, resume=True)
    assert_matches_reference(out, results, reference)
    assert not list(out.glob("*.tmp"))  # and the resume removed it


def test_interrupting_at_every_write_loses_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        python("sweep_main", str(tmp_path)),
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    writes = int(proc.stdout.split("interrupted at each of ")[1].split()[0])
    # at least: 3 epochs × (checkpoint, metrics.jsonl) × (temporary file, rename), the lock,
    # config.json and results.json
    assert writes >= 3 * 2 * 2 + 3


def test_kill_during_a_resume_loses_nothing(tmp_path: Path, reference: dict[str, Any]) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny())
    killed_at(out, "next:checkpoint.pt:2", str(cfg))
    killed_at(out, "metrics.jsonl:1", str(cfg), "--resume")  # the resume's first metrics write
    assert_consistent_on_disk(out)
    results = train.train(tiny(), out, resume=True)
    assert_matches_reference(out, results, reference)


def test_corrupt_metrics_file_is_rebuilt_on_resume(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    train.train(tiny(), out)
    (out / "metrics.jsonl").write_text('{"epoch": 1, "lr"')
    results = train.train(tiny(), out, resume=True)
    assert_matches_reference(out, results, reference)


def test_a_checkpoint_without_rows_resumes_with_those_of_metrics_file(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    train.train(tiny(), out)  # then as written before checkpoints kept the rows
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    del state["history"]
    torch.save(state, out / "checkpoint.pt")
    results = train.train(tiny(), out, resume=True)
    assert_matches_reference(out, results, reference)


# ------------------------------------------------------------- two processes on one folder


def test_a_folder_in_use_is_refused_until_its_run_dies(
    tmp_path: Path, capsys: pytest.CaptureFixture, reference: dict[str, Any]
) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny())
    first = child(out, "next:checkpoint.pt:1", str(cfg), action="pause")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr
            time.sleep(0.1)
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        for extra in ([], ["--resume"]):
            assert train_command.main([str(cfg), "--out", str(out), *extra]) == 2
            line = one_error_line(capsys)
            assert "in use" in line and str(first.pid) in line and str(out) in line
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert_consistent_on_disk(out)
    results = train.train(tiny(), out, resume=True)  # the lock died with its process
    assert_matches_reference(out, results, reference)


# ------------------------------------------------------------------------------------ Ctrl-C


@pytest.mark.slow
def test_ctrl_c_is_one_line_with_the_command_that_resumes(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """SIGINT after the first checkpoint: exit status 130 and one line, no traceback; the
    command it names resumes and ends as the uninterrupted run."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny())
    proc = child(out, "next:checkpoint.pt:1", str(cfg), action="pause")
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    command = f"python -m experiments.runs.train {cfg} --out {out} --resume"
    assert err.splitlines() == [
        f"interrupted: {out} keeps its checkpoint after pass 1; resume with: {command}"
    ]
    assert train_command.main(shlex.split(command)[3:]) == 0
    assert without_times(metrics(out)) == without_times(reference["rows"])


def test_ctrl_c_names_the_checkpoints_and_frees_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path / "cfg.json", tiny())
    out, left = tmp_path / "run", []
    monkeypatch.setattr(distributed, "leave", lambda: left.append(True))

    def runner(raw: dict[str, Any], out: Path, resume: bool, seeds: list[int]) -> dict[str, Any]:
        with runfiles.locked(out):
            for label, done in (("sgd", 2), ("adam", 1)):
                (out / label / "seed0").mkdir(parents=True)
                torch.save({"epoch": done}, out / label / "seed0" / "checkpoint.pt")
            raise KeyboardInterrupt

    argv = [str(cfg), "--out", str(out), "--seeds", "0"]
    assert cli.run("prog", None, runner, print, argv, cli.parse_seeds) == 130
    assert capsys.readouterr().err == (
        f"interrupted: {out} keeps the checkpoints of adam/seed0 after pass 1, sgd/seed0 after "
        f"pass 2; resume with: prog {cfg} --out {out} --seeds 0 --resume\n"
    )
    assert left == [True]
    with runfiles.locked(out):  # released
        pass


def test_ctrl_c_before_anything_is_written_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the folder is made: the command that starts again; a driver without a folder
    says nothing was written; a torchrun process other than rank 0 says nothing."""

    def interrupt(*args: Any, **options: Any) -> dict[str, Any]:
        raise KeyboardInterrupt

    cfg, out = write_config(tmp_path / "cfg.json", tiny()), tmp_path / "run"
    assert cli.run("prog", None, interrupt, print, [str(cfg), "--out", str(out)]) == 130
    start = f"prog {cfg} --out {out}"
    assert (
        capsys.readouterr().err
        == f"interrupted; nothing was written to {out}; start again with: {start}\n"
    )
    assert cli.run("prog", None, interrupt, print, [], options=lambda parser: None) == 130
    assert capsys.readouterr().err == "interrupted; nothing was written\n"
    monkeypatch.setenv("RANK", "1")
    assert cli.run("prog", None, interrupt, print, [str(cfg), "--out", str(out)]) == 130
    assert capsys.readouterr().err == ""


def test_atomic_writes_from_threads_never_collide(tmp_path: Path) -> None:
    from experiments.common import runfiles

    path, errors = tmp_path / "file.json", []

    def write(i: int) -> None:
        try:
            for j in range(50):
                runfiles.write_json(path, {"writer": i, "round": j})
        except OSError as err:  # pragma: no cover (the failure this test looks for)
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert strict_json(path.read_text())["round"] == 49
    assert [p.name for p in tmp_path.iterdir()] == ["file.json"]


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"data": {"batch_size": 33}}, ["[data].batch_size", "32"]),
        ({"data": {"shape": [0, 8, 8]}}, ["[data].shape"]),
        ({"data": {"shape": [8, 8]}}, ["[data].shape"]),
        ({"model": {"widths": [0]}}, ["[model].widths"]),
        ({"model": {"widths": ["a"]}}, ["[model].widths"]),
        ({"optimizer": {"base_options": {"colour": 1}}}, ["base_options {'colour': 1}", "colour'"]),
        ({"seed": -1}, ["seed"]),
        ({"seed": 2**40}, ["seed"]),
    ],
)
def test_bad_config_is_one_line_and_writes_nothing(
    change: dict[str, Any], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = write_config(tmp_path / "cfg.json", tiny(**change))
    assert train_command.main([str(cfg), "--out", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert all(word in line for word in words), line
    assert not run_files(tmp_path / "run")


def _overflowing_logits(run: train.Run) -> None:
    """Finite parameters whose logits overflow: the last layer's bias ±3e38 gives one class
    −∞ log-probability, so every test example of that class has an infinite NLL."""
    last = [m for m in run.model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(torch.tensor([3e38, -3e38, 0.0]))


@pytest.mark.parametrize(
    ("lr", "prior_precision", "poison", "words"),
    [
        (1e38, 3200.0, None, "non-finite parameters after the update of step 1"),  # decay 100·θ
        (0.05, 0.0, _overflowing_logits, "non-finite test metrics ['test_nll']"),
    ],
)
def test_divergence_in_the_last_update_is_reported_not_saved(
    lr: float,
    prior_precision: float,
    poison: Any,
    words: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one step, one epoch: its loss is finite, what the update leaves is not
    cfg = tiny(
        data={"batch_size": 32},
        optimizer={"name": "sgd", "lr": lr, "momentum": 0.0, "prior_precision": prior_precision},
        schedule={"epochs": 1},
    )
    if poison is not None:  # finite θ after the update, overflowing logits
        real = train.train_epoch

        def poisoned(run: train.Run, epoch: int) -> float:
            loss = real(run, epoch)
            poison(run)
            return loss

        monkeypatch.setattr(train, "train_epoch", poisoned)
    out = tmp_path / "run"
    assert (
        train_command.main([str(write_config(tmp_path / "cfg.json", cfg)), "--out", str(out)]) == 2
    )
    line = one_error_line(capsys)
    assert "diverged in epoch 1" in line and words in line
    assert not (out / "checkpoint.pt").exists() and not (out / "results.json").exists()
    assert_consistent_on_disk(out)


def test_divergence_after_a_good_epoch_keeps_the_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    cfg = tiny(data={"batch_size": 32}, optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.0})
    real = train.train_epoch

    def poisoned(run: train.Run, epoch: int) -> float:
        loss = real(run, epoch)
        if epoch == 1:  # an update that leaves one weight NaN with a finite loss
            next(run.model.parameters()).data[0, 0] = math.nan
        return loss

    monkeypatch.setattr(train, "train_epoch", poisoned)
    with pytest.raises(FloatingPointError, match="epoch 2"):
        train.train(cfg, out)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert [r["epoch"] for r in metrics(out)] == [1]
    assert_consistent_on_disk(out)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_is_one_line(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny(schedule={"epochs": 1}))
    assert train_command.main([str(cfg), "--out", str(out)]) == 0
    ckpt = out / "checkpoint.pt"
    blob = ckpt.read_bytes()
    ckpt.write_bytes(blob[: len(blob) // 2] if damage == "truncate" else b"not a checkpoint")
    results = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert train_command.main([str(cfg), "--out", str(out), "--resume"]) == 2
    line = one_error_line(capsys)
    assert str(ckpt) in line and "corrupt" in line
    assert (out / "results.json").read_bytes() == results


def test_corrupt_run_config_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny(schedule={"epochs": 1}))
    assert train_command.main([str(cfg), "--out", str(out)]) == 0
    (out / "config.json").write_text('{"seed": ')
    capsys.readouterr()
    assert train_command.main([str(cfg), "--out", str(out), "--resume"]) == 2
    assert str(out / "config.json") in one_error_line(capsys)


def test_out_naming_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "cfg.json", tiny())
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out in (notes, notes / "run"):
        assert train_command.main([str(cfg), "--out", str(out)]) == 2
        assert str(notes) in one_error_line(capsys)
    assert notes.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(0o555)
    try:
        cfg = write_config(tmp_path / "cfg.json", tiny())
        assert train_command.main([str(cfg), "--out", str(out)]) == 2
        assert "Permission denied" in one_error_line(capsys)
    finally:
        out.chmod(0o755)


# ------------------------------------------------------------------------ overwrite guard


@pytest.mark.parametrize("name", ["results.json", ".notes.tmp"])
def test_an_unrelated_folder_is_never_overwritten(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text('{"mine": true}')
    cfg = write_config(tmp_path / "cfg.json", tiny())
    for extra in ([], ["--resume"]):
        assert train_command.main([str(cfg), "--out", str(out), *extra]) == 2
        assert str(out) in one_error_line(capsys)
    assert run_files(out) == {name}
    assert (out / name).read_text() == '{"mine": true}'


def test_a_finished_run_without_checkpoint_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.json", tiny(schedule={"epochs": 1}))
    assert train_command.main([str(cfg), "--out", str(out)]) == 0
    (out / "checkpoint.pt").unlink()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    for extra in ([], ["--resume"]):
        assert train_command.main([str(cfg), "--out", str(out), *extra]) == 2
        assert str(out) in one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ------------------------------------------------------------------------------- compare


def comparison(**runs: dict[str, Any]) -> dict[str, Any]:
    raw = tiny(schedule={"epochs": 1})
    del raw["optimizer"]
    raw["runs"] = {label: {"optimizer": opt} for label, opt in runs.items()}
    return raw


def test_compare_checks_before_writing_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    raw = comparison(sgd={"name": "sgd", "lr": 0.05})
    assert compare.main([str(write_config(tmp_path / "a.json", raw)), "--out", str(out)]) == 0
    written = (out / "config.json").read_bytes()
    changed = comparison(sgd={"name": "sgd", "lr": 0.1})
    capsys.readouterr()
    for cfg, extra in ((raw, []), (changed, ["--resume"]), (changed, [])):
        path = write_config(tmp_path / "b.json", cfg)
        assert compare.main([str(path), "--out", str(out), *extra]) == 2
        one_error_line(capsys)
        assert (out / "config.json").read_bytes() == written


@pytest.mark.parametrize("label", ["../escaped", "a/b", "..", ".hidden", ""])
def test_compare_labels_stay_inside_out(
    label: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = comparison(**{label: {"name": "sgd", "lr": 0.05}})
    out = tmp_path / "cmp" / "out"
    assert compare.main([str(write_config(tmp_path / "c.json", raw)), "--out", str(out)]) == 2
    assert "label" in one_error_line(capsys)
    assert not (tmp_path / "cmp").exists()


def test_compare_checks_every_run_before_any_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value only the optimizer checks, in the last run: one line naming the run, before
    the first run trains, and no folder made."""

    def no_training(*args: Any) -> float:
        raise AssertionError("a run trained before every run was checked")

    monkeypatch.setattr(train, "train_epoch", no_training)
    good = {"sgd": {"name": "sgd", "lr": 0.05}, "additive": {"name": "additive", "lr": 0.05}}
    cases = [
        (
            {"affine": {"name": "affine", "lr": -0.5, "scale_lr": 0.05}},
            "[runs.affine]: lr: must lie in (0.0, inf), got -0.5",
        ),
        (
            {"mult": {"name": "multiplicative", "lr": 1.0, "momentum": 1.0}},
            "[runs.mult]: momentum: must lie in [0.0, 1.0), got 1.0",
        ),
        (
            {"ivon": {"name": "ivon", "lr": 0.1, "beta2": 1.5}},
            "[runs.ivon]: [optimizer].beta2 of ivon must be in [0, 1), got 1.5",
        ),
    ]
    for bad, message in cases:
        path = write_config(tmp_path / "c.json", comparison(**good, **bad))
        out = tmp_path / "cmp"
        assert compare.main([str(path), "--out", str(out)]) == 2
        assert one_error_line(capsys) == f"error: {message}"
        assert not out.exists()
    raw = comparison(**good)
    raw["runs"]["big"] = {"optimizer": good["sgd"], "data": {"batch_size": 64}}  # 32 examples
    assert compare.main([str(write_config(tmp_path / "c.json", raw)), "--out", str(out)]) == 2
    assert one_error_line(capsys).startswith("error: [runs.big]: [data].batch_size 64 exceeds")
    assert not out.exists()


def test_tune_checks_every_grid_point_before_any_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train, "train_epoch", None)  # calling it fails the test
    raw = comparison(sgd={"name": "sgd"})
    raw["data"]["validation"] = 8
    raw["runs"]["sgd"]["grid"] = {"lr": [0.1, -0.5]}
    out = tmp_path / "tuning"
    assert tune.main([str(write_config(tmp_path / "t.json", raw)), "--out", str(out)]) == 2
    assert one_error_line(capsys) == "error: [runs.sgd.1]: Invalid learning rate: -0.5"
    assert not out.exists()


def two_runs(additive_lr: float = 0.05) -> dict[str, Any]:
    """SGD, then the additive rule, over three epochs."""
    raw = comparison(
        sgd={"name": "sgd", "lr": 0.05}, additive={"name": "additive", "lr": additive_lr}
    )
    raw["schedule"] = {"epochs": 3}
    return raw


def interrupted(
    raw: dict[str, Any], out: Path, epoch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compare`` of ``raw`` into ``out`` stopped in the additive rule's ``epoch`` (0-based),
    after the earlier epochs' checkpoints."""
    real = train.train_epoch

    def stopping(run: train.Run, e: int) -> float:
        if run.cfg["optimizer"]["name"] == "additive" and e == epoch:
            raise Interrupted
        return real(run, e)

    monkeypatch.setattr(train, "train_epoch", stopping)
    with pytest.raises(Interrupted):
        compare.compare(raw, out)
    monkeypatch.setattr(train, "train_epoch", real)


def fresh(raw: dict[str, Any], label: str, out: Path) -> dict[str, Any]:
    """The results and metrics rows of ``raw``'s run ``label`` trained alone into ``out``."""
    cfg = config_module.split_runs({**raw, "seed": 0})[label]
    return {"results": train.train(cfg, out), "rows": metrics(out)}


def test_resume_takes_changes_to_runs_that_have_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "cmp"
    interrupted(two_runs(), out, 0, monkeypatch)  # the additive run has not trained an epoch
    sgd = (out / "sgd" / "seed0" / "checkpoint.pt").read_bytes()
    changed = two_runs(additive_lr=0.1)
    results = compare.compare(changed, out, resume=True)
    assert (out / "sgd" / "seed0" / "checkpoint.pt").read_bytes() == sgd  # not trained again
    alone = fresh(changed, "additive", tmp_path / "alone")
    assert without_times(results["additive"]["per_seed"]["0"]) == without_times(alone["results"])
    assert without_times(metrics(out / "additive" / "seed0")) == without_times(alone["rows"])
    assert json.loads((out / "config.json").read_text())["additive"]["0"]["optimizer"]["lr"] == 0.1
    # a finished comparison takes more seeds, and keeps the runs it has
    more = compare.compare(changed, out, resume=True, seeds=[0, 1])
    assert more["sgd"]["seeds"] == [0, 1]
    assert (out / "sgd" / "seed0" / "checkpoint.pt").read_bytes() == sgd


def test_a_changed_half_finished_run_starts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    interrupted(two_runs(), out, 2, monkeypatch)  # two of the additive run's epochs saved
    assert torch.load(out / "additive" / "seed0" / "checkpoint.pt", weights_only=True)["epoch"] == 2
    changed = two_runs(additive_lr=0.1)
    capsys.readouterr()
    results = compare.compare(changed, out, resume=True)
    printed = capsys.readouterr().out
    assert "== run 'additive', seed 0: its config changed, it starts again\n" in printed
    assert "its config changed" not in printed.replace("'additive', seed 0: its config", "")
    alone = fresh(changed, "additive", tmp_path / "alone")
    assert without_times(results["additive"]["per_seed"]["0"]) == without_times(alone["results"])
    assert without_times(metrics(out / "additive" / "seed0")) == without_times(alone["rows"])


def test_resume_refuses_to_change_or_drop_what_has_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    interrupted(two_runs(), out, 2, monkeypatch)
    written = (out / "config.json").read_bytes()
    finished_changed = two_runs()
    finished_changed["runs"]["sgd"]["optimizer"]["lr"] = 0.1
    dropped = two_runs()
    del dropped["runs"]["additive"]
    for raw, named in (
        (finished_changed, "'sgd' seed 0 (finished)"),
        (dropped, "'additive' seed 0 (started, dropped)"),
    ):
        path = write_config(tmp_path / "c.json", raw)
        assert compare.main([str(path), "--out", str(out), "--resume"]) == 2
        line = one_error_line(capsys)
        assert f"the config changes run(s) {named} of {out}" in line
        assert (out / "config.json").read_bytes() == written
    assert torch.load(out / "additive" / "seed0" / "checkpoint.pt", weights_only=True)["epoch"] == 2


# ---------------------------------------------------------------------------------- data


class _Crafted:
    """Unpickling this creates the file ``path``: code runs from a data file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _cifar10_folder(root: Path, batch: Any, protocol: int = pickle.DEFAULT_PROTOCOL) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps(batch, protocol=protocol))


def test_cifar_loader_runs_no_code_from_the_data_folder(tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"x": _Crafted(sentinel)}
    _cifar10_folder(tmp_path, batch)
    with pytest.raises(ValueError, match=r"data_batch_1.*not a CIFAR batch"):
        data.load_dataset("cifar10", tmp_path)
    assert not sentinel.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_loader_reads_genuine_batches(protocol: int, tmp_path: Path) -> None:
    pixels = np.arange(2 * 3072, dtype=np.int64).reshape(2, 3072).astype(np.uint8)
    batch = {b"batch_label": b"b", b"data": pixels, b"labels": [3, 7], b"filenames": [b"a", b"b"]}
    _cifar10_folder(tmp_path, batch, protocol)
    ds = data.load_dataset("cifar10", tmp_path)
    assert ds.train_x.shape == (10, 3, 32, 32) and ds.test_y.tolist() == [3, 7]
    assert np.array_equal(ds.test_x[1].flatten().numpy(), pixels[1])


def test_cifar_loader_refuses_other_contents(tmp_path: Path) -> None:
    _cifar10_folder(tmp_path, [1, 2, 3])
    with pytest.raises(ValueError, match=r"data_batch_1.*not a CIFAR batch"):
        data.load_dataset("cifar10", tmp_path)
