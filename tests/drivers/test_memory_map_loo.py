"""Model selection by the estimated leave-one-out NLL (``experiments.memory.loo``) on tiny
synthetic data (seconds): the files written, the criteria and the δ each picks, and the
refusals."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from experiments.common import config as config_module
from experiments.common import runfiles
from experiments.memory import loo as ml
from experiments.reporting.docs_tables import flatten
from tests.shared import digits_affine, tiny_config


def tiny(**loo: Any) -> dict[str, Any]:
    """An affine run on 3-class 1×8×8 synthetic images, 48 train of which 12 held out."""
    return tiny_config(
        data={"train_size": 48, "validation": 12},
        model={"widths": [6]},
        schedule={"epochs": 2},
        eval=None,
        memory={"loo": {"prior_precisions": [1.0, 100.0], "samples": 4, **loo}},
        runs={"affine": digits_affine(prior_precision=None)},
    )


def test_the_command_writes_every_criterion_per_delta_and_resumes(tmp_path):
    out = tmp_path / "loo"
    results = ml.model_selection(tiny(), out)
    seed0 = results["affine"]["per_seed"]["seed0"]
    assert set(seed0) == {"delta1", "delta100", "picks"}
    assert set(seed0["picks"]) == set(ml.CRITERIA)
    for name, delta in (("delta1", 1.0), ("delta100", 100.0)):
        folder = out / "affine" / name / "seed0"
        s = runfiles.read_json(folder / "summary.json")
        assert s["prior_precision"] == delta  # the optimizer trained at it
        assert s["train_size"] == 36 and s["validation"]["size"] == 12
        assert s["test"]["size"] == 16
        for c in ml.CRITERIA:
            v = ml.value(s, c)
            assert math.isnan(v) or v > 0, c
    assert runfiles.read_json(out / "results.json") == results
    config = runfiles.read_json(out / "config.json")
    assert config["loo"]["prior_precisions"] == [1.0, 100.0]
    assert config["runs"]["affine"]["0"]["optimizer"]["name"] == "affine"
    assert "delta1.loo.first_order" in flatten(results["affine"]["summary"])
    docs = runfiles.read_json(out / "docs_summary.json")
    assert docs["full_config"] == config
    assert docs["labels"]["affine"]["metrics"]["delta1.test.point.nll"]["values"] == [
        seed0["delta1"]["test"]["point"]["nll"]
    ]
    assert (out / "model_selection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = ml.model_selection(tiny(), out, resume=True)  # read back, not retrained
    assert again == results


def _summary(loo: float | None, validation: float) -> dict[str, Any]:
    nll = {"nll": validation, "accuracy": 0.5}
    return {
        "loo": {"corrected": loo, "first_order": validation},
        "train": 0.1,
        "validation": {"point": nll, "average": nll},
        "test": {"point": nll, "average": nll},
    }


def test_each_criterion_picks_its_lowest_delta_where_defined():
    by_delta = {
        "delta1": _summary(None, 0.9),
        "delta4": _summary(0.5, 0.4),
        "delta16": _summary(0.3, 0.6),
    }
    chosen = ml.picks(by_delta)
    assert chosen["loo corrected"] == 16.0  # undefined at δ = 1: skipped
    assert chosen["validation (point)"] == 4.0 and chosen["loo first order"] == 4.0
    assert ml.picks({"delta1": _summary(None, 0.9)})["loo corrected"] is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"memory": {"loo": {"prior_precisions": [1.0]}}}, "at least two"),
        ({"memory": {"loo": {"prior_precisions": [1.0, 1.0]}}}, "repeats"),
        ({"data": {"validation": 0}}, "validation must hold out"),
    ],
)
def test_refusals(change, match):
    raw = copy.deepcopy(tiny())
    for key, value in change.items():
        raw[key] = {**raw[key], **value}
    with pytest.raises(config_module.ConfigError, match=match):
        ml.resolve(raw)


def test_help_runs():
    with pytest.raises(SystemExit) as exit_info:
        ml.main(["--help"])
    assert exit_info.value.code == 0
