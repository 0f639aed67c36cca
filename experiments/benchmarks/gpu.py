"""The GPU run: the CUDA tests, the step-time benchmarks and the paper's CNN on one NVIDIA GPU,
offline, in one command of under 9 minutes that writes one results folder.

    python -m experiments.benchmarks.gpu WHEELS [--out DIR] [--dry-run]

Run it from the repository root on a machine whose Python holds torch with CUDA (and numpy,
matplotlib, scikit-learn, scipy, pandas, tqdm, pillow and pytest, as a CUDA image's does).
WHEELS is a folder of the wheels of the rest, built beside the repository (never committed)
on any machine with internet:

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d ../wheels \\
        geoopt mlxtend ivon-opt

The run installs them into a temporary folder (pip, offline), then runs each part in its own
process within its budget (a part over it is stopped and the run goes on): the CUDA tests,
``step_time`` on the MLP and ``scale`` part 3 on ResNet-20 on the GPU, and
``mnist5k_cnn.toml`` on CUDA for its three rules with one seed, its passes shrunk to the time
left. DIR (default ``results/gpu``, new) receives ``results.json`` (every measurement and
each part's status, seconds and last line), ``report.md``, each part's log and the CNN's
run folder ``cnn/``. ``--dry-run`` prints the plan and checks the config, the test ids, the
modules and WHEELS without training (it needs no GPU).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from experiments.common.progress import duration
from experiments.common.tables import LEFT, RIGHT, markdown

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DEADLINE_S = 510.0
"""The whole run's budget: 8 min 30 s, inside the 9 minutes of one call."""
CNN_CONFIG = Path("experiments/configs/mnist5k_cnn.toml")
CNN_SEED = 0
CUDA_TESTS = ("tests/library/test_optim.py::test_cuda_matches_cpu_in_float64",)
WHEELS = ("geoopt", "mlxtend", "ivon-opt")
"""Distributions the folder must hold: the project's needs a CUDA image lacks."""
MODULES = {
    "torch": "torch",
    "geoopt": "geoopt",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "mlxtend": "mlxtend",
    "scikit-learn": "sklearn",
    "pillow": "PIL",
    "ivon-opt": "ivon",
    "tomli": "tomllib",
    "pytest": "pytest",
}
"""Distribution → module of every package the run imports (the project's dependencies and
its ``experiments`` extra, and pytest); ``tomli`` is needed only before Python 3.11."""

CPU_PASS_S = {"sgd": 7.5, "additive": 7.9, "multiplicative": 43.9}
"""Seconds of one pass (80 steps at batch 50 and the test at g) of each rule of the CNN on
the project's 2-core CPU machine, one thread, under load (28 November 2026)."""
CPU_EVAL_S = 90.0
"""Seconds of the three rules' final evaluations there (8-sample average and sparsity)."""
GPU_SPEEDUP = 5.0
"""Assumed GPU speed-up over that CPU thread for the CNN: conservative, since at batch 50 the
small CNN's steps are bound by kernel launches on a GPU."""
CNN_START_S = 30.0
"""Assumed start-up of the CNN part: CUDA, the data, the first kernels."""
MARGIN_S = 20.0
"""Kept free at the end for the report."""


@dataclasses.dataclass
class Part:
    """A part of the run: ``name``, its command, its budget in seconds and what it gives."""

    name: str
    argv: list[str]
    budget_s: float
    gives: str


def plan(out: Path) -> list[Part]:
    """The parts before the CNN, in order, with their commands and budgets."""
    step_time = ("--models", "mlp", "--rounds", "5", "--steps", "20")
    scale = ("--parts", "3", "--models", "resnet20")
    return [
        Part(
            "check",
            [sys.executable, "-c", CHECK, str(out / "device.json"), *_modules()],
            20,
            "the imports and the GPU",
        ),
        Part(
            "cuda tests",
            _module("pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS),
            45,
            "CPU-against-CUDA agreement of every rule in float64",
        ),
        Part(
            "step_time",
            _module("experiments.benchmarks.step_time", *step_time, *_on_gpu(out, "step_time")),
            150,
            "full step ÷ SGD and ÷ Adam, update ÷ Adam, compiled updates' GB/s (MLP)",
        ),
        Part(
            "scale part 3",
            _module("experiments.benchmarks.scale", *scale, *_on_gpu(out, "scale")),
            150,
            "full step ÷ SGD, eager and compiled, closure and sample mode (ResNet-20)",
        ),
    ]


def _module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def _on_gpu(out: Path, name: str) -> tuple[str, ...]:
    """A benchmark's options: on CUDA, its numbers into ``out/NAME.json``."""
    return ("--device", "cuda", "--json", str(out / f"{name}.json"))


def _modules() -> list[str]:
    """The modules to import (tomllib is Python's own from 3.11)."""
    return sorted(set(MODULES.values()) - ({"tomllib"} if sys.version_info >= (3, 11) else set()))


CHECK = """
import importlib.util, json, sys, torch
missing = [m for m in sys.argv[2:] if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: cannot import {missing}: add their wheels to WHEELS (see --help)")
if not torch.cuda.is_available():
    sys.exit("error: torch sees no CUDA device: run on a GPU machine (--dry-run needs none)")
p = torch.cuda.get_device_properties(0)
info = {"gpu": p.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "memory GiB": round(p.total_memory / 2**30, 1)}
open(sys.argv[1], "w").write(json.dumps(info))
print(info)
"""
"""Checks the imports and the GPU; writes the device's description (``-c CHECK OUT MODULE...``)."""


def cnn_passes(seconds_left: float) -> int:
    """The CNN's passes that fit in ``seconds_left`` at the assumed speed-up (at least 1, at
    most the config's)."""
    per_pass = sum(CPU_PASS_S.values()) / GPU_SPEEDUP
    fit = (seconds_left - MARGIN_S - CNN_START_S - CPU_EVAL_S / GPU_SPEEDUP) / per_pass
    return int(max(1, min(config_passes(), fit)))


def config_passes() -> int:
    """The passes of ``mnist5k_cnn.toml``."""
    return int(tomllib.loads(CNN_CONFIG.read_text())["schedule"]["epochs"])


def cnn_config(passes: int) -> dict[str, Any]:
    """``mnist5k_cnn.toml`` on CUDA, seed 0, ``passes`` passes, its warm-up scaled along."""
    raw = tomllib.loads(CNN_CONFIG.read_text())
    epochs = raw["schedule"]["epochs"]
    raw |= {"device": "cuda", "seeds": [CNN_SEED]}
    warmup = min(round(raw["schedule"]["warmup"] * passes / epochs), passes - 1)
    raw["schedule"] = {**raw["schedule"], "epochs": passes, "warmup": warmup}
    return raw


def show_plan(out: Path) -> None:
    """Print the parts, their budgets and the assumptions behind them."""
    parts = plan(out)
    fixed = sum(p.budget_s for p in parts)
    print(f"GPU run into {out}, {duration(DEADLINE_S)} in all:")
    for p in parts:
        print(f"  {p.name:<14}{duration(p.budget_s):>10}  {p.gives}")
    passes = cnn_passes(DEADLINE_S - fixed)
    print(
        f"  {'cnn':<14}{'the rest':>10}  {CNN_CONFIG.name} on CUDA, seed {CNN_SEED}, three rules,"
        f" {passes} of {config_passes()} passes if the parts above take their whole budgets"
    )
    passes_s = ", ".join(f"{rule} {s:g} s" for rule, s in CPU_PASS_S.items())
    print(
        f"CNN sizing: one pass (80 steps) on one CPU thread took {passes_s}, the final"
        f" evaluations {CPU_EVAL_S:g} s; assumed: GPU speed-up ×{GPU_SPEEDUP:g}, start-up"
        f" {CNN_START_S:g} s, {MARGIN_S:g} s kept for the report"
    )


def check(wheels: Path) -> list[str]:
    """What the run needs and lacks: the config, the test ids, the modules, the wheels, the
    mapping of every dependency in pyproject.toml to its module."""
    problems = []
    if not CNN_CONFIG.is_file():
        problems.append(f"config {CNN_CONFIG} not found: run from the repository root")
    for test in CUDA_TESTS:
        path, _, name = test.partition("::")
        if not Path(path).is_file() or name not in _functions(Path(path)):
            problems.append(f"test {test} not found: update CUDA_TESTS")
    for module in (
        "experiments.benchmarks.step_time",
        "experiments.benchmarks.scale",
        "experiments.runs.compare",
    ):
        if importlib.util.find_spec(module) is None:
            problems.append(f"module {module} not found")
    problems += [
        f"dependency {name} has no module in MODULES: add it"
        for name in _dependencies()
        if name not in MODULES
    ]
    missing = [w for w in WHEELS if not list(wheels.glob(f"{_wheel_name(w)}-*.whl"))]
    if missing:
        problems.append(f"{wheels} has no wheel of {', '.join(missing)}: {BUILD}")
    return problems


BUILD = (
    "build it on a machine with internet with pip download --no-deps --only-binary=:all: "
    f"--python-version {sys.version_info.major}.{sys.version_info.minor} -d WHEELS "
    + " ".join(WHEELS)
)
"""How to build WHEELS, for the Python that runs this command (wheels are per version)."""


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def _wheel_name(distribution: str) -> str:
    """A distribution's name as wheel files spell it."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


def _dependencies() -> list[str]:
    """The names of the dependencies and the ``experiments`` extra of pyproject.toml."""
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["experiments"]
    return [re.match(r"[A-Za-z0-9_.-]+", spec)[0].lower() for spec in specs]  # type: ignore[index]


def run_part(part: Part, out: Path, env: dict[str, str], limit_s: float) -> dict[str, Any]:
    """Run ``part`` for at most ``limit_s`` seconds, its output into ``out/NAME.log`` and
    echoed; returns its status and seconds."""
    print(f"\n== {part.name} (budget {duration(limit_s)}) ==", flush=True)
    log = out / f"{part.name.replace(' ', '_')}.log"
    start = time.perf_counter()
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    with log.open("w") as f, subprocess.Popen(part.argv, env=env, **pipe) as proc:  # type: ignore[call-overload]
        watchdog = threading.Timer(limit_s, proc.kill)
        watchdog.start()
        for line in proc.stdout:
            print(line, end="", flush=True)
            f.write(line)
        watchdog.cancel()
    seconds = time.perf_counter() - start
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    if seconds >= limit_s:
        status = "stopped at its budget"
    last = ["", *log.read_text().strip().splitlines()][-1]
    return {
        "status": status,
        "seconds": round(seconds, 1),
        "budget_s": round(limit_s),
        "last": last,
    }


def install(wheels: Path, site: Path) -> dict[str, str] | None:
    """Install every wheel of ``wheels`` into ``site`` offline; the environment with it and
    the repository on the path, or None where pip failed."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--upgrade", "--target", str(site), *map(str, wheels.glob("*.whl"))]
    if subprocess.run(cmd).returncode != 0:
        return None
    path = os.pathsep.join([str(site), str(Path.cwd()), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def gpu_run(env: dict[str, str], out: Path, begun: float) -> dict[str, Any]:
    """Every part in turn, then the CNN in the time left (the run began at ``begun``);
    writes and returns the results."""
    out.mkdir(parents=True)
    results: dict[str, Any] = {"parts": {}}
    for part in plan(out):
        results["parts"][part.name] = run_part(part, out, env, part.budget_s)
        if part.name == "check" and results["parts"]["check"]["status"] != "ok":
            break
    else:
        left = DEADLINE_S - (time.perf_counter() - begun)
        passes = cnn_passes(left)
        config = out / "cnn_config.json"
        config.write_text(json.dumps(cnn_config(passes), indent=1))
        argv = [
            sys.executable,
            "-m",
            "experiments.runs.compare",
            str(config),
            "--out",
            str(out / "cnn"),
        ]
        gives = f"{passes} of {config_passes()} passes"
        part = Part("cnn", argv, left - MARGIN_S, gives)
        cnn = run_part(part, out, env, part.budget_s)
        results["parts"]["cnn"] = cnn | {"passes": passes, "of": config_passes()}
    results |= _collect(out)
    results["seconds"] = round(time.perf_counter() - begun, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    return results


def _collect(out: Path) -> dict[str, Any]:
    """The parts' own JSON files, where they were written."""
    files = {
        "device": out / "device.json",
        "step_time": out / "step_time.json",
        "scale": out / "scale.json",
        "cnn": out / "cnn" / "results.json",
    }
    return {k: json.loads(f.read_text()) for k, f in files.items() if f.is_file()}


def report(results: dict[str, Any]) -> str:
    """A short Markdown report: the device, each part's status, the headline ratios."""
    lines = ["# GPU run", "", f"Device: {results.get('device', 'not found')}", ""]
    parts = results["parts"]
    rows = [(n, p["status"], str(p["seconds"]), str(p["budget_s"])) for n, p in parts.items()]
    lines += markdown(("part", "status", "seconds", "budget"), rows, (LEFT, LEFT, RIGHT, RIGHT))
    if "passes" in results["parts"].get("cnn", {}):
        cnn = results["parts"]["cnn"]
        lines += ["", f"The CNN ran {cnn['passes']} of the config's {cnn['of']} passes."]
    for model, m in results.get("step_time", {}).get("models", {}).items():
        lines += ["", f"step_time, {model}:", ""]
        lines += [f"- {k}: {v:.2f}" for k, v in m["ratios"].items()]
    for model, ratios in (results.get("scale", {}).get("part 3") or {}).items():
        lines += ["", f"scale part 3, {model}:", ""]
        lines += [f"- {k}: {v:.2f}" for k, v in ratios.items()]
    if results.get("cnn"):
        lines += ["", f"CNN, seed {CNN_SEED}:", ""]
    for label, res in results.get("cnn", {}).items():
        run = next(iter(res["per_seed"].values()))
        ms = 1000 * run["fastest_pass_seconds"] * run["epochs"] / run["steps"]
        accuracy, nll = run["point"]["accuracy"], run["point"]["nll"]
        lines.append(f"- {label}: {ms:.1f} ms a step, accuracy {accuracy:.2%}, NLL {nll:.4f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("wheels", type=Path, help="folder of wheels: geoopt, mlxtend, ivon-opt")
    parser.add_argument("--out", type=Path, default=Path("results/gpu"), help="results folder")
    parser.add_argument("--dry-run", action="store_true", help="plan and checks, no training")
    args = parser.parse_args(argv)
    if not args.wheels.is_dir():
        print(f"error: wheel folder {args.wheels} not found: {BUILD}", file=sys.stderr)
        return 2
    if problems := check(args.wheels):
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        return 2
    show_plan(args.out)
    if args.dry_run:
        print("dry run: the config, the test ids, the modules and the wheels are there")
        return 0
    if args.out.exists():
        print(f"error: results folder {args.out} exists: pass another --out", file=sys.stderr)
        return 2
    begun = time.perf_counter()
    with tempfile.TemporaryDirectory() as site:
        if (env := install(args.wheels, Path(site))) is None:
            print(f"error: pip could not install {args.wheels}: {BUILD}", file=sys.stderr)
            return 2
        results = gpu_run(env, args.out, begun)
    print(f"\nresults in {args.out} ({duration(results['seconds'])})")
    if failed := [name for name, p in results["parts"].items() if p["status"] != "ok"]:
        print(f"error: {', '.join(failed)} not ok: see {args.out}/report.md", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
