"""The memory-map validation command on tiny synthetic data (seconds): it trains, maps,
retrains leave-one-out and flips labels, keeps every finished retraining across a kill,
retrains with common random numbers (same noise, same batches, the removed example's term
alone missing), and refuses what it cannot do."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats
from torch.nn.functional import cross_entropy

import liegroup_blr as lgb
from experiments.common import runfiles
from experiments.common import training as train
from experiments.common.figures import ERROR_VARIANCE_SIZE, MEMORY_MAP_SIZE, SCATTER_SIZE
from experiments.memory import maps as mm
from experiments.memory.retrain import Retrainer
from experiments.memory.scores import BASELINES, RANKINGS
from experiments.memory.stats import SPACES, agreement, changes, pearson, spearman, summarise_flips
from liegroup_blr.distributions import Dirac
from tests.drivers.test_experiments import assert_png
from tests.shared import digits_affine, tiny_config


def tiny(**memory: Any) -> dict[str, Any]:
    """Two runs (affine, multiplicative) on 3-class 1×8×8 synthetic images, 64 train."""
    return tiny_config(
        data={"train_size": 64},
        schedule={"epochs": 3},
        eval=None,
        memory={
            "samples": 8,
            "top": 2,
            "random": 2,
            "retrain_epochs": [1, 2],
            "flip": 4,
            **memory,
        },
        runs={
            "affine": digits_affine(),
            "multiplicative": {
                "optimizer": {"name": "multiplicative", "lr": 5.0, "temperature": 0.01}
            },
        },
    )


def test_the_command_writes_every_part_and_resumes_without_losing_a_retraining(
    tmp_path, monkeypatch
):
    out = tmp_path / "maps"
    # a kill after two retrainings of the first run: they are on disk, nothing else is
    calls = 0
    retrain = Retrainer.retrain

    def dying(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return retrain(self, *args, **kwargs)

    monkeypatch.setattr(Retrainer, "retrain", dying)
    with pytest.raises(KeyboardInterrupt):
        mm.memory_maps(tiny(), out)
    rows = runfiles.read_jsonl(out / "affine" / "seed0" / mm.RETRAIN)
    assert [r["kind"] for r in rows] == ["start", "control", "permuted"]
    monkeypatch.setattr(Retrainer, "retrain", retrain)
    with pytest.raises(FileExistsError, match="--resume"):
        mm.memory_maps(tiny(), out)
    results = mm.memory_maps(tiny(), out, resume=True)

    for label in ("affine", "multiplicative"):
        folder = out / label / "seed0"
        rows = runfiles.read_jsonl(folder / mm.RETRAIN)
        assert [r["kind"] for r in rows] == ["start", "control", "permuted", *["removed"] * 4]
        assert all(len(r["examples"]) == 4 for r in rows)  # every row holds every example
        if label == "affine":  # the rows from before the kill were kept, not redone
            assert rows[:3] == runfiles.read_jsonl(folder / mm.RETRAIN)[:3]
        summary = json.loads((folder / mm.SUMMARY).read_text())
        assert summary["method"] == {"affine": "jacobian", "multiplicative": "samples"}[label]
        mean = ["mean"] if label == "multiplicative" else []  # E[θ] = E[ξ](g⁺ − g⁻) ≠ g
        assert list(summary["test"]) == ["point", *mean, "average"]
        assert list(summary["flip_test"]) == list(summary["test"])
        assert set(summary["retraining"]) == {"1", "2"}
        entry = summary["retraining"]["2"]
        assert entry["random"] == 2  # the correlations are over the random examples only
        assert set(entry["default"]) == set(SPACES)
        assert {"spearman", "drift", "median_ratio"} <= set(entry["default"]["logits"])
        assert {"truth_over_drift", "above_others"} <= set(entry["probabilities"])
        assert summary["flips"]["flipped"] == 4
        assert math.isclose(summary["flips"]["random"], 4 * 4 / 64)
        assert set(summary["flips"]["found"]) == {*RANKINGS, *BASELINES, "default"}
        assert sum(summary["regions"].values()) == 64
        assert set(summary["baselines"]) == set(BASELINES)
        assert sum(summary["flip_regions"]["flipped"].values()) == 4
        for name in ("memory_map.png", "flip_memory_map.png"):
            assert_png(folder / name, MEMORY_MAP_SIZE)
        for name in ("error_variance.png", "flip_error_variance.png"):
            assert_png(folder / name, ERROR_VARIANCE_SIZE)
        assert_png(folder / "scatter.png", SCATTER_SIZE)
    written = json.loads((out / "config.json").read_text())
    assert written["memory"]["retrain_epochs"] == [1, 2]
    assert written["runs"]["affine"]["0"]["optimizer"]["scale_lr"] == 10.0
    text = (out / "report.md").read_text()
    assert "| 2 | jacobian:logits |" in text and "| 2 | loss |" in text
    assert "64 train / 16 test" in text and "3 passes" in text
    assert set(results) == {"affine", "multiplicative"}


def test_retraining_is_deterministic_and_starts_from_the_trained_state(tmp_path):
    configs, memory = mm.resolve(tiny())
    cfg = configs["affine"][0]
    run = mm.trained(cfg, tmp_path / "train")
    before = copy.deepcopy(run.optimizer.state_dict())
    retrainer = Retrainer(run, memory, seed=0)
    index = torch.tensor([3, 5])
    control = retrainer.retrain(None, index)
    again = retrainer.retrain(None, index)
    assert control == again  # same noise, same permutations: bit for bit
    assert retrainer.retrain(3, index) != control
    assert all(g["data_size"] == 64 for g in run.optimizer.param_groups)
    assert retrainer.retrain(None, index, permutation=1) != control
    # the trained state it starts from is never touched (load_state_dict aliases tensors)
    after = retrainer.optimizer_state
    for key, state in before["state"].items():
        assert torch.equal(state["element"], after["state"][key]["element"])


def test_a_removed_example_takes_only_its_own_term_out_of_its_batch(tmp_path):
    configs, memory = mm.resolve(tiny())
    run = mm.trained(configs["affine"][0], tmp_path / "train")
    retrainer = Retrainer(run, memory, seed=0)
    rows = torch.arange(10, 26)  # one batch of 16
    kept = rows[rows != 13]
    with torch.no_grad():
        own = cross_entropy(run.model(retrainer.x[13:14]), retrainer.y[13:14])
    full, without = retrainer._closure(rows, 16)(), retrainer._closure(kept, 16)()
    torch.testing.assert_close(full - without, own / 16)  # the others keep their weight


def test_the_drift_floor_is_zero_where_retraining_is_deterministic_and_at_rest(tmp_path):
    """A Dirac base (the additive rule is then SGD with momentum), the whole training set in
    one batch and a linear model trained to its minimum: retraining with nothing removed
    changes nothing, retraining without an example moves its prediction."""
    cfg = tiny(retrain_epochs=[400], retrain_lr=1.0)
    cfg["data"]["batch_size"] = 64
    cfg["model"]["widths"] = []
    configs, memory = mm.resolve(cfg)
    run = mm.build(configs["affine"][0], mm.PROCESSES)
    run.optimizer = lgb.AdditiveBLR(
        run.model.parameters(), 0.5, base=Dirac(0.0), data_size=64, prior_precision=5.0
    )
    for group in run.optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    index = torch.arange(4)
    Retrainer(run, memory, seed=0).retrain(None, index)  # to the minimum: 400 GD steps
    memory = {**memory, "retrain_epochs": [5]}
    retrainer = Retrainer(run, memory, seed=0)
    rows = [
        {
            "kind": "start",
            "index": None,
            "examples": [0, 1, 2, 3],
            "epochs": {"0": retrainer.logits(index)},
        },
        *(
            {
                "kind": kind,
                "index": None,
                "examples": [0, 1, 2, 3],
                "epochs": retrainer.retrain(None, index, p),
            }
            for kind, p in (("control", 0), ("permuted", 1))
        ),
        *(
            {
                "kind": "removed",
                "index": i,
                "examples": [0, 1, 2, 3],
                "epochs": retrainer.retrain(i, index),
            }
            for i in range(4)
        ),
    ]
    c = changes(rows, run.data.train_y, "5")
    assert float(c["drift"].max()) < 1e-6  # at rest: retraining alone makes no change
    assert float(c["permuted"].max()) < 1e-6  # one batch: the order does not matter
    assert float(c["truth"].min()) > 1e3 * float(c["drift"].max())


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
    """Rows hold mean logits; two classes, so logits (0, z) give p = (1 − σ(z), σ(z))."""
    z = lambda p: math.log(p / (1 - p))  # noqa: E731 (the logit giving class 1 probability p)
    row = lambda kind, index, *ps: {  # noqa: E731
        "kind": kind,
        "index": index,
        "examples": [4, 9, 6],
        "epochs": {"1": [[0.0, z(p)] for p in ps]},
    }
    rows = [
        {**row("start", None, 0.5, 0.5, 0.5), "epochs": {"0": [[0.0, 0.0]] * 3}},
        row("control", None, 0.5, 0.9, 0.2),
        row("permuted", None, 0.6, 0.9, 0.2),
        row("removed", 9, 0.5, 0.7, 0.2),  # removing 9 moves 9 only
        row("removed", 4, 0.4, 0.8, 0.1),  # removing 4 moves all three
        row("removed", 6, 0.5, 0.9, 0.5),
    ]
    c = changes(rows, torch.tensor([0, 0, 0, 0, 0, 0, 1, 0, 0, 1]), "1")
    assert c["examples"] == [4, 9, 6]
    np.testing.assert_allclose(c["truth"], [0.2, 0.4, 0.6])
    np.testing.assert_allclose(c["truth_logits"], [abs(z(0.4)), z(0.9) - z(0.7), z(0.5) - z(0.2)])
    np.testing.assert_allclose(c["label"], [0.1, -0.2, 0.3])  # labels 0, 1, 1
    np.testing.assert_allclose(c["drift"], [0.0, 0.8, 0.6])  # control against start (0.5)
    # others: per example the median over the other removals (two: their mean)
    np.testing.assert_allclose(c["others"], [0.0, 0.1, 0.1])
    np.testing.assert_allclose(c["permuted"], [0.2, 0.0, 0.0])
    np.testing.assert_allclose(c["drift_logits"], [0.0, z(0.9), abs(z(0.2))])
    np.testing.assert_allclose(c["permuted_logits"], [z(0.6), 0.0, 0.0], atol=1e-15)


def test_flips_are_counted_among_the_k_highest():
    flips = {3: 1, 7: 0}
    score = {name: torch.arange(10.0) for name in [*RANKINGS, *BASELINES, "default"]}
    score["labels"] = torch.zeros(10)
    score["loss"] = torch.tensor([0, 0, 0, 9, 0, 0, 0, 8, 0, 0.0])  # both at the top
    score["residual"] = torch.tensor([0, 0, 0, 9, 0, 0, 0, 0, 0, 8.0])  # one
    summary = summarise_flips(score, flips)
    assert summary["found"]["loss"] == 2 and summary["found"]["residual"] == 1
    assert summary["found"]["default"] == 0  # 9 and 8 are its two highest
    assert summary["flipped"] == 2 and math.isclose(summary["random"], 2 * 2 / 10)


def test_rank_correlations_match_scipy_with_ties():
    gen = np.random.default_rng(0)
    a = gen.integers(0, 5, 40).astype(float)
    b = a + gen.normal(size=40)
    assert math.isclose(spearman(a, b), stats.spearmanr(a, b)[0], rel_tol=1e-12)
    assert math.isclose(pearson(a, b), stats.pearsonr(a, b)[0], rel_tol=1e-12)
    assert math.isnan(pearson(np.ones(4), b[:4]))
    assert agreement(np.ones(4), b[:4])["spearman"] is None


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
