"""The drivers under torchrun: the same config trains over 2 gloo processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
seed = 0
device = "cpu"
parallel = "{parallel}"

[data]
name = "synthetic"
shape = [1, 8, 8]
train_size = 64
test_size = 32
batch_size = 16
test_batch_size = 32

[model]
name = "mlp"
widths = [16]

[optimizer]
{optimizer}

[schedule]
epochs = 6

[eval]
samples = 2
sparsity_samples = 2
"""
SGD = 'name = "sgd"\nlr = 0.1'
MULTIPLICATIVE = 'name = "multiplicative"\nlr = 1.0\ntemperature = 0.1\nmc_samples = 2'


def run(
    tmp_path: Path, name: str, optimizer: str, parallel: str, processes: int, *options: str
) -> dict:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(CONFIG.format(parallel=parallel, optimizer=optimizer))
    out = tmp_path / name
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command = [sys.executable, *(launcher if processes > 1 else []), "-m", "experiments.runs.train"]
    done = subprocess.run(
        [*command, str(cfg), "--out", str(out), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_data_parallel_sgd_equals_one_process(tmp_path: Path) -> None:
    """Two processes on halves of each batch with averaged gradients = one full-batch run."""
    one = run(tmp_path, "one", SGD, "data", 1)
    two = run(tmp_path, "two", SGD, "data", 2)
    assert two["processes"] == 2
    for estimate in ("point", "average"):
        for key in ("accuracy", "nll", "ece", "brier"):
            assert two[estimate][key] == pytest.approx(one[estimate][key], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("parallel", ["data", "mc"])
def test_lie_group_rule_trains_over_two_processes(tmp_path: Path, parallel: str) -> None:
    results = run(tmp_path, parallel, MULTIPLICATIVE, parallel, 2)
    assert results["processes"] == 2 and results["has_posterior"]
    assert results["point"]["accuracy"] > 0.8  # 3 balanced classes: chance is 1/3
    out = tmp_path / parallel
    main = torch.load(out / "checkpoint.pt", weights_only=True)
    other = torch.load(out / "checkpoint.rank1.pt", weights_only=True)
    for key, value in main["model"].items():  # the same parameters on both processes
        assert torch.equal(value, other["model"][key])
    assert not torch.equal(main["optimizer"]["rng"]["cpu"], other["optimizer"]["rng"]["cpu"])


TABLE = MULTIPLICATIVE.replace("mc_samples = 2", 'noise = "table"')


def test_fsdp_from_the_cli_equals_one_process(tmp_path: Path) -> None:
    """``parallel = "fsdp"``: two processes, each half of every batch and half of every
    parameter and its state, evaluate as one process does (table noise, addressed by
    global index, makes even the model average's samples the same)."""
    one = run(tmp_path, "one", TABLE, "data", 1)
    two = run(tmp_path, "fsdp", TABLE, "fsdp", 2)
    assert two["processes"] == 2 and two["point"]["accuracy"] > 0.8
    for estimate in ("point", "average"):
        for key in ("accuracy", "nll", "ece", "brier"):
            assert two[estimate][key] == pytest.approx(one[estimate][key], rel=1e-5, abs=1e-7)
        for kind, value in one["ood"].items():  # out-of-distribution inputs alike
            assert two["ood"][kind][estimate] == pytest.approx(value[estimate], rel=1e-5)
    again = run(tmp_path, "fsdp", TABLE, "fsdp", 2, "--resume")  # each rank loads its shards
    for estimate in ("point", "average"):
        assert again[estimate] == two[estimate]
    whole = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    shards = [
        torch.load(tmp_path / "fsdp" / name, weights_only=True)
        for name in ("checkpoint.pt", "checkpoint.rank1.pt")
    ]
    for key, value in whole["model"].items():  # each process keeps its rows: FSDP2's Shard(0)
        rows = [s["model"][key] for s in shards]
        torch.testing.assert_close(torch.cat(rows), value, rtol=1e-5, atol=1e-7)
        assert rows[0].shape[0] == (value.shape[0] + 1) // 2
    for i, state in whole["optimizer"]["state"].items():  # and its rows of the state
        for name, value in state.items():
            parts = [s["optimizer"]["state"][i][name] for s in shards]
            torch.testing.assert_close(torch.cat(parts, dim=1), value, rtol=1e-5, atol=1e-7)
