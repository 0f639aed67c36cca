"""The converged leave-one-out check (``experiments.memory_converged``) on tiny synthetic
data (seconds): the objective without an example is the full one less that example's term,
retraining with nothing removed from a converged mean moves nothing while removing an
example moves its prediction, the stopping rule, the files written and kept across a
resume, and the refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.functional import cross_entropy

from experiments import config as config_module
from experiments import memory_converged as mc
from experiments import runfiles
from experiments.memory_map import trained
from tests.shared import digits_affine, tiny_config


def tiny(**converged: Any) -> dict[str, Any]:
    """An affine run on 3-class 1×8×8 synthetic images, 48 train."""
    return tiny_config(
        data={"test_size": 8},
        model={"widths": [6]},
        schedule={"epochs": 2},
        eval=None,
        memory={
            "converged": {
                "samples": 2,
                "examples": 2,
                "chunk": 5,
                "rtol": 1e-9,
                "max_iterations": 200,
                **converged,
            }
        },
        runs={"affine": digits_affine()},
    )


@pytest.fixture(scope="module")
def retrainer(tmp_path_factory) -> mc.ShiftRetrainer:
    configs, table = mc.resolve(tiny())
    run = trained(configs["affine"][0], tmp_path_factory.mktemp("run") / "train")
    return mc.ShiftRetrainer(run, table, 0)


def test_removing_an_example_takes_exactly_its_term_out_of_the_objective(retrainer):
    r = retrainer
    S, N = r.table["samples"], r.size
    keep = torch.arange(N) != 5
    with torch.no_grad():
        full = r.objective(r.mean, None)
        without = r.objective(r.mean, keep)
        own = sum(
            cross_entropy(
                torch.func.functional_call(
                    r.model, {n: m + r.noise[n][s] for n, m in r.mean.items()}, (r.x[5:6],)
                ),
                r.y[5:6],
                reduction="sum",
            )
            for s in range(S)
        )
    torch.testing.assert_close(full - without, own / (S * N), rtol=1e-12, atol=1e-14)
    # the fixed draws are antithetic pairs about the mean
    for noise in r.noise.values():
        torch.testing.assert_close(noise[: S // 2], -noise[S // 2 :], rtol=0, atol=0)


def test_converged_retraining_moves_nothing_unless_an_example_is_removed(retrainer):
    r = retrainer
    index = torch.arange(4)
    control = r.retrain(None, index)
    assert control["converged"] and control["iterations"] % r.table["chunk"] == 0
    trace = control["objective"]
    assert trace[-1] <= trace[0]
    assert abs(trace[-2] - trace[-1]) <= r.table["rtol"] * abs(trace[-1])
    converged_mean = r.last
    again = r.retrain(None, index, converged_mean)
    removed = r.retrain(2, index, converged_mean)
    floor = (torch.tensor(again["logits"]) - torch.tensor(control["logits"])).abs().sum(-1)
    truth = (torch.tensor(removed["logits"]) - torch.tensor(control["logits"])).abs().sum(-1)
    assert float(floor.max()) < 1e-5
    assert float(truth[2]) > 100 * float(floor.max())
    assert float(truth[2]) == float(truth.max())  # its own prediction moves most


def test_the_command_writes_its_files_and_resumes_without_redoing_a_retraining(tmp_path):
    out = tmp_path / "conv"
    results = mc.converged(tiny(), out)
    seed = out / "affine" / "seed0"
    for name in (mc.ESTIMATES, mc.RETRAIN, mc.SUMMARY, mc.CONTROL_MEAN):
        assert (seed / name).exists(), name
    assert (seed / "converged.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = runfiles.read_json(out / "config.json")
    assert config["converged"]["examples"] == 2 and "affine" in config["runs"]
    rows = runfiles.read_jsonl(seed / mc.RETRAIN)
    assert [r["kind"] for r in rows] == ["control", "again", "removed", "removed"]
    s = results["affine"]["per_seed"]["seed0"]
    assert s["examples"] == 2 and s["converged"] == 1.0
    assert s["f"]["above_floor"] == 1.0 and s["p"]["truth_over_floor"] > 10
    docs = runfiles.read_json(out / mc.DOCS_SUMMARY)
    assert docs["full_config"] == config and docs["labels"]["affine"]["seeds"] == [0]
    assert docs["labels"]["affine"]["metrics"]["f.ratio_median"]["values"] == [
        s["f"]["ratio_median"]
    ]
    # a resume keeps every finished row as it is
    again = mc.converged(tiny(), out, resume=True)
    assert runfiles.read_jsonl(seed / mc.RETRAIN) == rows
    assert again["affine"]["per_seed"]["seed0"]["f"] == s["f"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"memory": {"converged": {"samples": 3}}}, "samples must be even"),
        ({"memory": {"converged": {"rtol": 0}}}, "rtol"),
        ({"memory": {"converged": {"draws": 3}}}, "unknown key"),
        (
            {"runs": {"m": {"optimizer": {"name": "multiplicative", "lr": 5.0}}}},
            "needs name = 'affine'",
        ),
    ],
)
def test_refusals(change, match):
    raw = copy.deepcopy(tiny())
    for key, value in change.items():
        raw[key] = value
    with pytest.raises(config_module.ConfigError, match=match):
        mc.resolve(raw)


def test_help_runs():
    with pytest.raises(SystemExit) as exit_info:
        mc.main(["--help"])
    assert exit_info.value.code == 0
