"""The memory-map validation command on tiny synthetic data (seconds): it trains, maps,
retrains leave-one-out and flips labels, keeps every finished retraining across a kill,
retrains deterministically (same noise, same permutations), and refuses what it cannot do."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from experiments import memory_map as mm
from experiments import runfiles, train
from experiments.figures import MEMORY_MAP_SIZE, SCATTER_SIZE
from tests.test_experiments import assert_png


def tiny(**memory: Any) -> dict[str, Any]:
    """Two runs (affine, multiplicative) on 3-class 1×8×8 synthetic images, 64 train."""
    return {
        "seed": 0,
        "device": "cpu",
        "data": {"name": "synthetic", "train_size": 64, "test_size": 16, "batch_size": 16},
        "model": {"name": "mlp", "widths": [8]},
        "schedule": {"epochs": 3},
        "memory": {
            "samples": 8,
            "top": 2,
            "random": 2,
            "retrain_epochs": [1, 2],
            "flip": 4,
            "flagged": 8,
            **memory,
        },
        "runs": {
            "affine": {
                "optimizer": {
                    "name": "affine",
                    "lr": 0.1,
                    "scale_lr": 10.0,
                    "temperature": 0.1,
                    "prior_precision": 25.0,
                    "base_scale": 0.02,
                }
            },
            "multiplicative": {
                "optimizer": {"name": "multiplicative", "lr": 5.0, "temperature": 0.01}
            },
        },
    }


def test_the_command_writes_every_part_and_resumes_without_losing_a_retraining(
    tmp_path, monkeypatch
):
    out = tmp_path / "maps"
    # a kill after two retrainings of the first run: they are on disk, nothing else is
    calls = 0
    retrain = mm.Retrainer.retrain

    def dying(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return retrain(self, *args, **kwargs)

    monkeypatch.setattr(mm.Retrainer, "retrain", dying)
    with pytest.raises(KeyboardInterrupt):
        mm.memory_maps(tiny(), out)
    rows = runfiles.read_jsonl(out / "affine" / "seed0" / mm.RETRAIN)
    assert [r["kind"] for r in rows] == ["control", "permuted"]
    monkeypatch.setattr(mm.Retrainer, "retrain", retrain)
    with pytest.raises(FileExistsError, match="--resume"):
        mm.memory_maps(tiny(), out)
    results = mm.memory_maps(tiny(), out, resume=True)

    for label in ("affine", "multiplicative"):
        folder = out / label / "seed0"
        rows = runfiles.read_jsonl(folder / mm.RETRAIN)
        assert [r["kind"] for r in rows] == ["control", "permuted", *["removed"] * 4]
        if label == "affine":  # the two rows from before the kill were kept, not redone
            assert rows[:2] == runfiles.read_jsonl(folder / mm.RETRAIN)[:2]
        summary = json.loads((folder / mm.SUMMARY).read_text())
        assert summary["method"] == {"affine": "jacobian", "multiplicative": "samples"}[label]
        assert set(summary["retraining"]) == {"1", "2"}
        assert summary["flips"]["flipped"] == 4
        assert math.isclose(summary["flips"]["random"], 4 * 8 / 64)
        for name in ("memory_map.png", "flip_memory_map.png"):
            assert_png(folder / name, MEMORY_MAP_SIZE)
        assert_png(folder / "scatter.png", SCATTER_SIZE)
    written = json.loads((out / "config.json").read_text())
    assert written["memory"]["retrain_epochs"] == [1, 2]
    assert written["runs"]["affine"]["0"]["optimizer"]["scale_lr"] == 10.0
    assert "| 2 | jacobian |" in (out / "report.md").read_text()
    assert set(results) == {"affine", "multiplicative"}


def test_retraining_is_deterministic_and_leaving_out_changes_only_what_it_should(tmp_path):
    configs, memory = mm.resolve(tiny())
    cfg = configs["affine"][0]
    run = mm.trained(cfg, tmp_path / "train")
    before = copy.deepcopy(run.optimizer.state_dict())
    retrainer = mm.Retrainer(run, memory, seed=0)
    index = torch.tensor([3, 5])
    control = retrainer.retrain(None, index)
    again = retrainer.retrain(None, index)
    assert control == again  # same noise, same permutations: bit for bit
    removed = retrainer.retrain(3, index)
    assert removed != control
    assert all(g["data_size"] == 63 for g in run.optimizer.param_groups)
    permuted = retrainer.retrain(None, index, permutation=1)
    assert permuted != control
    # the trained state it starts from is never touched (load_state_dict aliases tensors)
    after = retrainer.optimizer_state
    for key, state in before["state"].items():
        assert torch.equal(state["element"], after["state"][key]["element"])


def test_a_training_killed_between_epochs_resumes_to_the_same_posterior(tmp_path, monkeypatch):
    cfg = mm.resolve(tiny())[0]["multiplicative"][0]
    whole = mm.trained(cfg, tmp_path / "whole")
    epoch_of = mm.train_epoch

    def dying(run, epoch):
        if epoch == 2:
            raise KeyboardInterrupt
        return epoch_of(run, epoch)

    monkeypatch.setattr(mm, "train_epoch", dying)
    with pytest.raises(KeyboardInterrupt):
        mm.trained(cfg, tmp_path / "cut")
    monkeypatch.setattr(mm, "train_epoch", epoch_of)
    resumed = mm.trained(cfg, tmp_path / "cut")
    for a, b in zip(whole.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert torch.equal(a["element"], b["element"])


def test_changes_read_the_rows_as_l1_distances():
    rows = [
        {
            "kind": "control",
            "index": None,
            "examples": [4, 9],
            "epochs": {"1": {"average": [[0.5, 0.5], [0.9, 0.1]]}},
        },
        {
            "kind": "permuted",
            "index": None,
            "examples": [4, 9],
            "epochs": {"1": {"average": [[0.6, 0.4], [0.9, 0.1]]}},
        },
        {
            "kind": "removed",
            "index": 9,
            "examples": [9],
            "epochs": {"1": {"average": [[0.7, 0.3]]}},
        },
        {
            "kind": "removed",
            "index": 4,
            "examples": [4],
            "epochs": {"1": {"average": [[0.5, 0.5]]}},
        },
    ]
    c = mm.changes(rows, torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0, 1]), "1")
    assert c["examples"] == [4, 9]
    np.testing.assert_allclose(c["truth"], [0.0, 0.4])
    np.testing.assert_allclose(c["floor"], [0.2, 0.0])
    np.testing.assert_allclose(c["label"], [0.0, 0.2])  # labels 0 and 1
    np.testing.assert_allclose(c["label_floor"], [0.1, 0.0])


def test_rank_correlations_match_scipy_with_ties():
    gen = np.random.default_rng(0)
    a = gen.integers(0, 5, 40).astype(float)
    b = a + gen.normal(size=40)
    assert math.isclose(mm.spearman(a, b), stats.spearmanr(a, b)[0], rel_tol=1e-12)
    assert math.isclose(mm.pearson(a, b), stats.pearsonr(a, b)[0], rel_tol=1e-12)
    assert math.isnan(mm.pearson(np.ones(4), b[:4]))
    assert mm.agreement(np.ones(4), b[:4])["spearman"] is None


def test_flipped_labels_change_every_picked_label():
    labels = torch.arange(100) % 10
    flips = mm.flipped_labels(labels, 30, 10, seed=3)
    assert len(flips) == 30
    assert all(new != int(labels[i]) and 0 <= new < 10 for i, new in flips.items())
    assert flips == mm.flipped_labels(labels, 30, 10, seed=3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"runs": {"sgd": {"optimizer": {"name": "sgd", "lr": 0.1}}}}, "no posterior"),
        ({"data": {"augment": True}}, "augment"),
        (
            {"runs": {"a": {"optimizer": {"name": "additive", "lr": 0.1, "vectorize": True}}}},
            "vectorize",
        ),
        ({"memory": {"retrain_epochs": [2, 1]}}, "retrain_epochs"),
        ({"memory": {"samples": 1}}, "samples"),
        ({"memory": {"bogus": 1}}, "bogus"),
        ({"data": {"train_size": 65}}, "batch_size 16"),
    ],
)
def test_refusals_are_one_line(tmp_path, capsys, change, message):
    cfg = tiny()
    for key, value in change.items():
        cfg[key] = value if key == "runs" else {**cfg[key], **value}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    assert mm.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert runfiles.contents(tmp_path / "out") == []  # nothing written


def test_the_map_of_a_finished_run_is_written_into_its_folder(tmp_path):
    cfg = mm.resolve(tiny())[0]["affine"][0]
    run_folder = tmp_path / "run"
    train.train(cfg, run_folder)
    assert mm.main([str(run_folder)]) == 0
    summary = json.loads((run_folder / "memory_map.json").read_text())
    assert summary["method"] == "jacobian" and len(summary["scores"]) == 64
    scores = torch.tensor(summary["scores"])
    assert [h["index"] for h in summary["highest"]] == scores.argsort(descending=True)[:50].tolist()
    assert_png(run_folder / "memory_map.png", MEMORY_MAP_SIZE)
    assert mm.main([str(tmp_path)]) == 2  # a folder without finished runs
