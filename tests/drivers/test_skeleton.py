"""The run skeleton the drivers share (experiments/common/skeleton.py): seeding, checkpoints, the
epoch loop, the folder of a driver, the runs with their progress, and the drivers' own config
tables."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from experiments.common import config as config_module
from experiments.common import runfiles, skeleton
from experiments.common.config import ConfigError, load
from experiments.common.progress import Planned
from experiments.continual import learn as continual
from tests.shared import tiny_config

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
SMOKE = EXPERIMENTS / "configs" / "continual_smoke.toml"


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))  # noqa: NPY002


def test_seed_everything_repeats_python_numpy_and_torch_draws() -> None:
    skeleton.seed_everything(7)
    first = _draws()
    skeleton.seed_everything(8)
    other = _draws()
    skeleton.seed_everything(7)
    assert _draws() == first
    assert all(a != b for a, b in zip(first, other, strict=True))


def test_rng_state_round_trip_restores_every_stream() -> None:
    data = torch.Generator().manual_seed(3)
    skeleton.seed_everything(1)
    state = skeleton.rng_state(data)
    expected = (*_draws(), float(torch.rand((), generator=data)))
    _draws()
    skeleton.set_rng_state(data, state)
    assert (*_draws(), float(torch.rand((), generator=data))) == expected


def test_timed_epochs_yield_each_epoch_s_lr_before_its_step_and_step_the_schedule() -> None:
    param = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    trained: list[int] = []

    def train_epoch(epoch: int) -> float:
        trained.append(epoch)
        opt.step()
        return 10.0 * epoch

    rows = list(skeleton.timed_epochs(1, 4, train_epoch, scheduler))
    assert trained == [1, 2, 3]
    assert [(e, lr, loss) for e, lr, loss, _ in rows] == [
        (1, 1.0, 10.0),
        (2, 0.5, 20.0),
        (3, 0.25, 30.0),
    ]
    assert all(seconds >= 0 for *_, seconds in rows)
    assert opt.param_groups[0]["lr"] == 0.125


def test_restore_hands_entries_to_their_loaders_and_names_a_foreign_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "checkpoint.pt"
    runfiles.save_torch(path, {"a": 1, "b": 2, "epoch": 5})
    seen: dict[str, Any] = {}
    epoch = skeleton.restore(
        path, {"a": lambda v: seen.update(a=v), "b": None}, lambda s: int(s["epoch"])
    )
    assert (epoch, seen) == (5, {"a": 1})
    with pytest.raises(runfiles.CorruptFileError, match=r"checkpoint .* not of this run"):
        skeleton.restore(path, {"missing": print}, lambda s: None)


def test_clear_deletes_every_file_of_a_run_and_keeps_other_folders(tmp_path: Path) -> None:
    for name in ("config.json", "metrics.jsonl", "results.json", "a.png", "checkpoint.pt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoint.rank1.pt").write_text("x")
    (tmp_path / "inner").mkdir()
    skeleton.clear(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inner"]


def _runner(log: list[str], fail: str | None = None) -> skeleton.Runner:
    """Trains nothing: each run reports three epochs to the progress and returns its seed."""

    def train(cfg, folder, resume, progress=None, title=""):
        log.append(title)
        for done in range(4):
            if progress is not None:
                progress(done)
        return {"seed": cfg["seed"]}

    def check(configs):
        if fail in configs:
            raise ConfigError(f"[runs.{fail}]: refused")

    def planned(label, cfg, folder, resume):
        return Planned(label, 3)

    return skeleton.Runner(train, planned, lambda cfg: "rule", check)


def test_run_all_trains_every_label_and_seed_into_its_folder_with_the_time_left(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    configs = {label: {s: {"seed": s} for s in (0, 1)} for label in ("a", "b")}
    log: list[str] = []
    per_seed = skeleton.run_all(configs, tmp_path / "out", False, _runner(log))
    assert per_seed == {label: {"0": {"seed": 0}, "1": {"seed": 1}} for label in ("a", "b")}
    assert log == [f"out: {label} (rule), seed {s}" for label in ("a", "b") for s in (0, 1)]
    printed = capsys.readouterr().out
    for done in range(1, 5):
        assert f"runs {done}/4 done" in printed
    assert "left" in printed


def test_prepare_folder_restarts_a_changed_unfinished_run_and_refuses_a_finished_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = {"a": {"0": {"lr": 1}}, "b": {"0": {"lr": 1}}}
    skeleton.prepare_folder(tmp_path, runs, False)
    started, finished = tmp_path / "a" / "seed0", tmp_path / "b" / "seed0"
    for folder in (started, finished):
        folder.mkdir(parents=True)
        (folder / "checkpoint.pt").write_text("x")
    (finished / "results.json").write_text("{}")
    with pytest.raises(FileExistsError, match="pass --resume"):
        skeleton.prepare_folder(tmp_path, runs, False)
    changed = {**runs, "a": {"0": {"lr": 2}}}
    skeleton.prepare_folder(tmp_path, changed, True)
    assert "'a', seed 0: its config changed, it starts again" in capsys.readouterr().out
    assert not (started / "checkpoint.pt").exists() and (finished / "checkpoint.pt").exists()
    assert json.loads((tmp_path / "config.json").read_text()) == changed
    with pytest.raises(ConfigError, match=r"changes run.*'b' seed 0 \(finished\)"):
        skeleton.prepare_folder(tmp_path, {**changed, "b": {"0": {"lr": 3}}}, True)


def test_a_driver_with_its_own_tables_resumes_only_with_the_same_config(tmp_path: Path) -> None:
    runs = {"a": {"0": {"lr": 1}}}
    skeleton.prepare_folder(tmp_path, runs, False, {"memory": {"top": 3}})
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "runs": runs,
        "memory": {"top": 3},
    }
    skeleton.prepare_folder(tmp_path, runs, True, {"memory": {"top": 3}})
    for other_runs, memory in (({"a": {"0": {"lr": 2}}}, {"top": 3}), (runs, {"top": 4})):
        with pytest.raises(ConfigError, match="differs from the one"):
            skeleton.prepare_folder(tmp_path, other_runs, True, {"memory": memory})


RUN = tiny_config(
    seed=None,
    device=None,
    data={"test_size": 8, "batch_size": 8},
    model={"widths": [4]},
    optimizer={"name": "sgd", "lr": 0.1},
    eval=None,
)


def _check_extra(table: dict[str, Any], configs: dict[str, Any]) -> None:
    if table["count"] < 1:
        raise ConfigError(f"[extra].count must be >= 1, got {table['count']}")
    table["runs"] = sorted(configs)


def test_a_driver_s_own_table_is_filled_checked_against_the_runs_and_kept_out_of_them() -> None:
    extra = config_module.Table("extra", {"count": 2, "runs": []}, _check_extra)
    configs, tables = config_module.driver_configs({**RUN, "seeds": [0, 1]}, [extra])
    assert tables == {"extra": {"count": 2, "runs": ["sgd"]}}
    assert list(configs["sgd"]) == [0, 1]
    for given, message in (
        ({"count": 0}, r"\[extra\].count must be >= 1"),
        ({"size": 1}, r"unknown key\(s\) \['size'\] in \[extra\]"),
        (3, r"\[extra\] must be a table"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_module.driver_configs({**RUN, "extra": given}, [extra])
    required = config_module.Table("extra", {"count": 2, "runs": []}, _check_extra, True)
    with pytest.raises(ConfigError, match=r"needs a \[extra\] table"):
        config_module.driver_configs(RUN, [required])


def test_continual_checks_every_method_before_anything_is_written(tmp_path: Path) -> None:
    raw = load(SMOKE)
    raw["methods"]["bad"] = {
        "strategy": "posterior",
        "optimizer": {"name": "affine", "lr": -1.0, "scale_lr": 1.0},
    }
    with pytest.raises(ConfigError, match=r"\[methods.bad\]: .*lr"):
        continual.continual(raw, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_continual_reports_the_time_left_after_every_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    raw = load(SMOKE)
    raw["methods"] = {k: raw["methods"][k] for k in ("finetune", "affine")}
    continual.continual(raw, tmp_path / "out")
    printed = capsys.readouterr().out
    assert "task 2/2 epoch 1/1" in printed
    assert "runs 0/2 done" in printed and "runs 1/2 done" in printed
    assert "runs 2/2 done" in printed and "left" in printed


# the calls that belong to the skeleton alone among the drivers
OWN_CALLS = {
    ("random", "seed"),
    ("np.random", "seed"),
    ("torch", "manual_seed"),
    ("torch", "set_num_threads"),
    ("torch", "set_rng_state"),
    ("np.random", "set_state"),
    ("scheduler", "step"),
}


def _calls(path: Path) -> set[tuple[str, str]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value).split(".")[-2:]
            found.add((".".join(owner if owner[0] == "np" else owner[-1:]), node.func.attr))
    return found


def test_only_the_skeleton_seeds_restores_generators_or_steps_a_schedule() -> None:
    """Every driver seeds, restores RNG states and runs its epochs through the skeleton."""
    skeleton = EXPERIMENTS / "common" / "skeleton.py"
    offenders = {
        str(path.relative_to(EXPERIMENTS)): sorted(_calls(path) & OWN_CALLS)
        for path in sorted(EXPERIMENTS.rglob("*.py"))
        if path != skeleton and "benchmarks" not in path.parts and _calls(path) & OWN_CALLS
    }
    assert offenders == {}
    assert _calls(skeleton) >= OWN_CALLS - {("torch", "set_num_threads")}
