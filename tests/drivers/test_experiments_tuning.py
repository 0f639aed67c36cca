"""Tuning on a validation split (experiments/runs/tune.py): grids, the choice, and the test set."""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from experiments.common import training as train
from experiments.common.config import ConfigError
from experiments.runs import tune
from tests.shared import tiny_config

TINY = tiny_config(
    seeds=[0, 1],
    data={"shape": [1, 8, 8], "train_size": 48, "test_batch_size": 8, "validation": 16},
    schedule={"epochs": 2},
    runs={
        "sgd": {
            "optimizer": {"name": "sgd", "lr": 0.05},
            "grid": {"lr": [0.01, 0.3], "prior_precision": [0.0, 1.0]},
        },
        "ivon": {
            "optimizer": {"name": "ivon", "lr": 0.01, "hess_init": 10.0},
            "grid": {"lr": [0.01, 0.03]},
        },
    },
)


def test_tuning_trains_every_point_on_held_out_examples_and_chooses_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_train = train.train

    def diverging(cfg: dict[str, Any], out: Path, resume: bool, **options: Any) -> dict[str, Any]:
        if "sgd.3" in str(out):  # lr 0.3, prior precision 1: made to diverge
            raise train.DivergedError("diverged")
        return real_train(cfg, out, resume, **options)

    monkeypatch.setattr(train, "RUNNER", dataclasses.replace(train.RUNNER, train=diverging))
    results = tune.tune(copy.deepcopy(TINY), tmp_path)
    sgd = results["sgd"]
    assert [p["values"] for p in sgd["points"]] == [
        {"lr": 0.01, "prior_precision": 0.0},
        {"lr": 0.01, "prior_precision": 1.0},
        {"lr": 0.3, "prior_precision": 0.0},
        {"lr": 0.3, "prior_precision": 1.0},
    ]
    assert sgd["points"][3]["score"] is None
    for label, res in results.items():
        for i, point in enumerate(res["points"]):
            folder = tmp_path / f"{label}.{i}" / "seed0"
            if point["score"] is None:
                continue
            run = json.loads((folder / "results.json").read_text())
            # 48 synthetic examples: 16 held out for validation, 32 train; no test set
            assert (run["eval_set"], run["train_size"], run["test_size"]) == ("validation", 32, 16)
            scores = [r["average"]["nll"] for r in point["runs"]]
            assert point["score"] == pytest.approx(statistics.fmean(scores))
        finite = [p["score"] for p in res["points"] if p["score"] is not None]
        assert res["points"][res["chosen"]]["score"] == min(finite)
        chosen = res["points"][res["chosen"]]["values"]
        assert {k: res["optimizer"][k] for k in chosen} == chosen
    written = json.loads((tmp_path / "tuned.json").read_text())
    assert written["ivon"]["optimizer"] == results["ivon"]["optimizer"]
    report = (tmp_path / "tuning.md").read_text()
    assert "| 3 | 0.3 | 1 | diverged |" in report
    assert report.count("| ← |") == 2


def test_tuning_refuses_a_config_that_would_see_the_test_set(tmp_path: Path) -> None:
    raw = copy.deepcopy(TINY)
    del raw["data"]["validation"]
    with pytest.raises(ConfigError, match=r"must not see the test set; set \[data\] validation"):
        tune.tune(raw, tmp_path)
    assert not tmp_path.joinpath("config.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tune": {"metric": "auroc"}}, r"unknown \[tune\].metric 'auroc'"),
        ({"tune": {"seed": 1}}, r"unknown key\(s\) \['seed'\] in \[tune\]"),
        ({"runs": {"a": {"optimizer": {"name": "sgd", "lr": 1}, "grid": {"lr": 1}}}}, r"lists"),
        ({"runs": {"a": {"optimizer": {"name": "sgd", "lr": 1}, "grid": {"lr2": [1]}}}}, "lr2"),
    ],
)
def test_bad_tuning_configs_are_clear_errors(change: dict, message: str, tmp_path: Path) -> None:
    raw = {**copy.deepcopy(TINY), **change}
    with pytest.raises(ConfigError, match=message):
        tune.tune(raw, tmp_path)
