"""The continual-learning driver: metrics on constructed accuracy matrices, the online EWC
baseline on a case with a closed form, the task streams, and short runs of the driver
(CLI, resume after an interruption, config errors)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import liegroup_blr as lgb
from experiments.common import figures
from experiments.common.config import ConfigError, load
from experiments.common.data import Dataset, NonFiniteInputError, load_dataset
from experiments.common.training import DivergedError
from experiments.continual import learn as continual
from experiments.continual import report as continual_report
from experiments.continual import tune as continual_tune
from experiments.continual.ewc import OnlineEWC, diagonal_fisher, diagonal_ggn
from experiments.continual.streams import build_stream, column_mask, permutations, permuted, split
from experiments.runs import tune

CONFIGS = Path(__file__).parents[2] / "experiments" / "configs"
SMOKE = CONFIGS / "continual_smoke.toml"
ADAM = {"optimizer": {"name": "adam", "lr": 1e-3}}
AFFINE = {"optimizer": {"name": "affine", "lr": 0.05, "scale_lr": 1.0}}


# ---------------------------------------------------------------------------- metrics
# R[i][j]: accuracy on task i after learning task j
FORGETFUL = [
    [0.9, 0.8, 0.7],
    [0.1, 0.95, 0.9],
    [0.1, 0.2, 0.85],
]
# task 1 improves after it was learned, then drops: forgetting counts from its best
RISE_AND_FALL = [
    [0.6, 0.9, 0.7],
    [0.0, 0.8, 0.8],
    [0.0, 0.0, 1.0],
]


def test_average_accuracy_on_constructed_matrices() -> None:
    assert continual_report.average_accuracy(FORGETFUL) == pytest.approx(
        [0.9, (0.8 + 0.95) / 2, (0.7 + 0.9 + 0.85) / 3]
    )
    assert continual_report.average_accuracy([[0.5]]) == [0.5]


def test_backward_transfer_and_forgetting_on_constructed_matrices() -> None:
    assert continual_report.backward_transfer(FORGETFUL) == pytest.approx(
        ((0.7 - 0.9) + (0.9 - 0.95)) / 2
    )
    assert continual_report.forgetting(FORGETFUL) == pytest.approx(((0.9 - 0.7) + 0.05) / 2)
    # BWT compares with the accuracy just after learning, forgetting with the best one
    assert continual_report.backward_transfer(RISE_AND_FALL) == pytest.approx((0.1 + 0.0) / 2)
    assert continual_report.forgetting(RISE_AND_FALL) == pytest.approx((0.2 + 0.0) / 2)
    perfect = np.triu(np.ones((4, 4)))
    assert continual_report.backward_transfer(perfect) == 0.0
    assert continual_report.forgetting(perfect) == 0.0
    assert continual_report.backward_transfer([[0.7]]) == 0.0
    assert continual_report.forgetting([[0.7]]) == 0.0
    with pytest.raises(ValueError, match="T × T"):
        continual_report.forgetting([[0.5, 0.4]])


def _row(task: int, accuracies: list[float]) -> dict[str, Any]:
    seen = {"accuracy": 0.0, "nll": 0.1 * task, "ece": 0.01 * task, "brier": 0.0}
    per_task = {"accuracy": accuracies, "nll": [0.0] * 3, "ece": [0.0] * 3, "seen": seen}
    return {"task": task, "point": per_task, "train_seconds": 2.0, "eval_seconds": 1.0}


def test_run_summary_reads_the_matrix_from_rows_and_averages_over_seeds() -> None:
    rows = [_row(j + 1, [FORGETFUL[i][j] for i in range(3)]) for j in range(3)]
    summary = continual_report.run_summary(rows)
    assert summary["point"]["matrix"] == FORGETFUL
    assert summary["point"]["final_accuracy"] == pytest.approx((0.7 + 0.9 + 0.85) / 3)
    assert summary["point"]["nll"] == pytest.approx(0.3)  # pooled, after the last task
    assert summary["train_seconds"] == 6.0 and "average" not in summary

    other = continual_report.run_summary(
        [_row(j + 1, [RISE_AND_FALL[i][j] for i in range(3)]) for j in range(3)]
    )
    over = continual_report.over_seeds([summary, other])
    bwt = [continual_report.backward_transfer(m) for m in (FORGETFUL, RISE_AND_FALL)]
    assert over["point"]["bwt"]["values"] == pytest.approx(bwt)
    assert over["point"]["bwt"]["mean"] == pytest.approx(np.mean(bwt))
    assert over["point"]["bwt"]["sd"] == pytest.approx(np.std(bwt, ddof=1))
    assert np.allclose(over["point"]["matrix"], (np.array(FORGETFUL) + RISE_AND_FALL) / 2)
    curve = over["point"]["average_accuracy"]
    assert [c["values"][1] for c in curve] == pytest.approx(
        continual_report.average_accuracy(RISE_AND_FALL)
    )


# ---------------------------------------------------------------------------- EWC
def _linear_case(classes: int = 4) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3, classes))
    return model, torch.randn(7, 1, 3)


@pytest.mark.parametrize("head", [(0, 1, 2, 3), (1, 3)])
def test_diagonal_fisher_of_a_softmax_regression_is_p_times_one_minus_p(head: tuple) -> None:
    """For logits Wx + b, ∂ log p_y/∂W_kd = (1[y = k] − p_k) x_d, so the expected Fisher is
    E_x[p_k(1 − p_k) x_d²] (and p_k(1 − p_k) for b_k); 0 for columns outside the head."""
    model, x = _linear_case()
    mask = column_mask(head, 4)
    fisher = diagonal_fisher(model, x, mask)
    with torch.no_grad():
        p = torch.softmax(model(x) + mask, dim=-1)  # 0 outside the head
    var = p * (1 - p)
    flat = x.flatten(1)
    assert torch.allclose(fisher["1.weight"], (var[:, :, None] * flat[:, None, :] ** 2).mean(0))
    assert torch.allclose(fisher["1.bias"], var.mean(0))
    outside = [k for k in range(4) if k not in head]
    assert torch.all(fisher["1.weight"][outside] == 0)


def test_diagonal_fisher_matches_a_loop_over_examples_and_classes() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(9, 1, 5)
    mask = torch.zeros(3)
    fisher = diagonal_fisher(model, x, mask)
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for xn in x:
        log_p = torch.log_softmax(model(xn[None])[0], dim=-1)
        for k in range(3):
            grads = torch.autograd.grad(log_p[k], list(model.parameters()), retain_graph=True)
            for (n, _), g in zip(model.named_parameters(), grads, strict=True):
                expected[n] += log_p[k].exp().detach() * g**2 / len(x)
    for n, f in fisher.items():
        assert torch.allclose(f, expected[n], atol=1e-7), n


def test_online_ewc_penalty_and_its_consolidation() -> None:
    model, _ = _linear_case(2)
    ewc = OnlineEWC(strength=3.0, decay=0.5)
    assert float(ewc.penalty(model)) == 0.0  # nothing consolidated yet
    first = {n: torch.rand_like(p) for n, p in model.named_parameters()}
    ewc.consolidate(model, first)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert float(ewc.penalty(model)) == 0.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    penalty = ewc.penalty(model)
    params = dict(model.named_parameters())
    expected = sum(0.5 * 3.0 * (first[n] * (params[n] - anchor[n]) ** 2).sum() for n in first)
    assert torch.allclose(penalty, expected)
    penalty.backward()
    for n, p in params.items():  # ∇ = λ F (θ − θ*)
        assert torch.allclose(p.grad, 3.0 * first[n] * (p - anchor[n]))
    second = {n: torch.rand_like(p) for n, p in model.named_parameters()}
    ewc.consolidate(model, second)
    for n, p in params.items():
        assert torch.allclose(ewc.fisher[n], 0.5 * first[n] + second[n])  # γF̃ + F
        assert torch.equal(ewc.anchor[n], p.detach())
    again = OnlineEWC(3.0, 0.5)
    again.load_state_dict(ewc.state_dict())
    assert torch.equal(again.penalty(model), ewc.penalty(model))


@pytest.mark.parametrize(
    ("strength", "decay", "name"), [(0.0, 1.0, "ewc_lambda"), (1.0, 1.5, "ewc_gamma")]
)
def test_online_ewc_refuses_bad_hyperparameters(strength: float, decay: float, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        OnlineEWC(strength, decay)


# ---------------------------------------------------------------------------- streams
@pytest.fixture(scope="module")
def digits5k() -> Dataset:
    return load_dataset("mnist5k")


def test_permutations_are_permutations_from_the_seed_and_the_first_is_the_identity() -> None:
    perms = permutations(784, 10, seed=3)
    assert torch.equal(perms[0], torch.arange(784))
    for perm in perms:
        assert torch.equal(perm.sort().values, torch.arange(784))
    assert len({tuple(p.tolist()) for p in perms}) == 10
    assert all(torch.equal(a, b) for a, b in zip(perms, permutations(784, 10, seed=3), strict=True))
    assert not torch.equal(perms[1], permutations(784, 10, seed=4)[1])


def test_permuted_tasks_are_the_same_split_with_permuted_pixels(digits5k: Dataset) -> None:
    tasks = permuted(digits5k, 3, seed=0)
    perms = permutations(784, 3, seed=0)
    base = tasks[0]
    assert base.name == "identity" and base.classes == tuple(range(10))
    assert len(base.train_y) == 4000 and len(base.test_y) == 1000
    for task, perm in zip(tasks, perms, strict=True):
        assert torch.equal(task.train_y, base.train_y) and torch.equal(task.test_y, base.test_y)
        assert torch.equal(task.train_x.flatten(1), base.train_x.flatten(1)[:, perm])
        assert torch.equal(task.test_x.flatten(1), base.test_x.flatten(1)[:, perm])
    assert not torch.equal(tasks[1].train_x, tasks[2].train_x)


@pytest.mark.parametrize("heads", ["multi", "single"])
def test_split_tasks_hold_exactly_their_two_digits(digits5k: Dataset, heads: str) -> None:
    tasks = split(digits5k, 5, heads)
    for t, task in enumerate(tasks):
        assert set(task.train_y.tolist()) == {2 * t, 2 * t + 1}
        assert set(task.test_y.tolist()) == {2 * t, 2 * t + 1}
        assert len(task.train_y) == 800 and len(task.test_y) == 200
        assert task.classes == ((2 * t, 2 * t + 1) if heads == "multi" else tuple(range(10)))
    assert sum(len(task.train_y) for task in tasks) == len(digits5k.train_y)
    with pytest.raises(ValueError, match="tasks"):
        split(digits5k, 6, heads)


def _fingerprints(images: torch.Tensor) -> set[str]:
    return {hashlib.sha1(x.numpy().tobytes()).hexdigest() for x in images}


def test_no_test_image_is_a_training_image(digits5k: Dataset) -> None:
    assert not _fingerprints(digits5k.train_x) & _fingerprints(digits5k.test_x)
    for name, heads in [("permuted", "single"), ("split", "multi")]:
        for task in build_stream(name, digits5k, 3, heads, seed=0):
            assert not _fingerprints(task.train_x) & _fingerprints(task.test_x), task.name


def test_column_mask_restricts_the_softmax_to_the_head() -> None:
    mask = column_mask((2, 3), 10)
    probs = torch.softmax(torch.randn(4, 10) + mask, dim=-1)
    assert torch.all(probs[:, [2, 3]].sum(-1).sub(1).abs() < 1e-6)
    assert torch.all(probs[:, :2] == 0) and torch.all(probs[:, 4:] == 0)


# ---------------------------------------------------------------------------- the driver
def smoke(**changes: Any) -> dict[str, Any]:
    """The shipped smoke config (2 tasks, 1 epoch) with sections updated by ``changes``."""
    raw = load(SMOKE)
    for section, table in changes.items():
        merge = section in continual.SECTIONS
        raw[section] = {**raw.get(section, {}), **table} if merge else table
    return raw


def without_times(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: without_times(v) for k, v in obj.items() if not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [without_times(v) for v in obj]
    return obj


def read_rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / continual.TASKS).read_text().splitlines()]


def test_smoke_config_runs_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    raw = load(SMOKE)
    assert continual.main([str(SMOKE), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "final avg. accuracy" in printed
    results = json.loads((out / "results.json").read_text())
    methods = list(raw["methods"])
    assert list(results) == methods
    seeds = raw["seeds"]
    for method in methods:
        assert results[method]["seeds"] == seeds
        for seed in seeds:
            folder = out / method / f"seed{seed}"
            rows = read_rows(folder)
            assert [r["task"] for r in rows] == [1, 2]
            cfg = json.loads((folder / "config.json").read_text())
            assert cfg == continual.resolve(raw, method, seed)
            posterior = cfg["method"]["strategy"] == "posterior"
            assert (folder / continual.POSTERIOR).exists() is posterior
            assert ("average" in rows[0]) is posterior
            for estimate in ("point", "average") if posterior else ("point",):
                r = continual_report.matrix(rows, estimate)
                assert r.shape == (2, 2) and np.all((0 <= r) & (r <= 1))
                assert r[0, 0] > 0.8  # 0 vs 1 after one epoch: far above chance (0.5)
    assert (out / "report.md").read_text().startswith("# Continual learning: split mnist5k")
    image = plt_image(out / "average_accuracy.png")
    rules = {continual_report.rule_of(m) for m in methods}
    columns = [[m for m in methods if continual_report.rule_of(m) == r] for r in rules - {None}]
    columns = columns or [methods]  # a column per rule, or one of every method
    entries = max(map(len, columns))
    sizes = [figures.average_accuracy_size(len(columns), entries, zoom) for zoom in (0, 1)]
    assert image.shape[:2] in [figures.pixel_size(size) for size in sizes]
    bars = plt_image(out / "final_accuracy.png")
    assert bars.shape[1] == figures.pixel_size(figures.CURVES_SIZE)[1]
    written = json.loads((out / "config.json").read_text())
    assert set(written) == set(methods)


def plt_image(path: Path) -> np.ndarray:
    from matplotlib import image

    return image.imread(path)


class Interrupt(Exception):
    pass


@pytest.mark.parametrize("label", ["ewc", "joint", "affine", "affine_memory"])
@pytest.mark.parametrize("where", ["mid-task", "before the boundary"])
def test_resume_after_an_interruption_reaches_the_uninterrupted_result(
    label: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = continual.resolve(smoke(train={"epochs": 2}), label, 0)
    full = continual.run(cfg, tmp_path / "full")

    real_epoch, real_next = continual.train_epoch, continual._next_task
    if where == "mid-task":  # task 2 has trained one epoch, its second one dies

        def crashing(learner: continual.Learner, data: Any, t: int, epoch: int) -> float:
            if (t, epoch) == (1, 1):
                raise Interrupt
            return real_epoch(learner, data, t, epoch)

        monkeypatch.setattr(continual, "train_epoch", crashing)
    else:  # task 1 is trained and evaluated, its boundary dies

        def crashing_boundary(learner: continual.Learner, t: int) -> None:
            raise Interrupt

        monkeypatch.setattr(continual, "_next_task", crashing_boundary)
    with pytest.raises(Interrupt):
        continual.run(cfg, tmp_path / "resumed")
    state = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    if where == "mid-task":  # the finished task and the finished epoch are kept
        assert (state["task"], state["epoch"]) == (1, 1)
        assert [r["task"] for r in read_rows(tmp_path / "resumed")] == [1]
    else:
        assert (state["task"], state["epoch"]) == (0, 2)
    monkeypatch.setattr(continual, "train_epoch", real_epoch)
    monkeypatch.setattr(continual, "_next_task", real_next)
    with pytest.raises(FileExistsError, match="--resume"):
        continual.run(cfg, tmp_path / "resumed")
    resumed = continual.run(cfg, tmp_path / "resumed", resume=True)
    assert without_times(resumed) == without_times(full)
    assert without_times(read_rows(tmp_path / "resumed")) == without_times(
        read_rows(tmp_path / "full")
    )
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    if a["memory"] is not None:
        assert torch.equal(a["memory"]["inputs"], b["memory"]["inputs"])
    with pytest.raises(ConfigError, match="config differs"):
        continual.run({**cfg, "seed": 5}, tmp_path / "resumed", resume=True)


def test_ewc_penalty_changes_the_trajectory(tmp_path: Path) -> None:
    """A strong penalty keeps task 1 better than fine-tuning does, with the same data order."""
    raw = smoke(stream={"name": "permuted", "heads": "single"})
    raw["methods"]["ewc"]["ewc_lambda"] = 1e4
    fine = continual.run(continual.resolve(raw, "finetune", 0), tmp_path / "f")
    ewc = continual.run(continual.resolve(raw, "ewc", 0), tmp_path / "e")
    assert fine["point"]["matrix"][0][0] == ewc["point"]["matrix"][0][0]  # same task 1
    assert ewc["point"]["matrix"][0][1] > fine["point"]["matrix"][0][1]
    assert ewc["point"]["matrix"][1][1] < fine["point"]["matrix"][1][1]


def test_the_posterior_of_a_rule_is_saved_and_becomes_the_prior(tmp_path: Path) -> None:
    raw = smoke()
    label = next(k for k, v in raw["methods"].items() if v["strategy"] == "posterior")
    cfg = continual.resolve(raw, label, 0)
    continual.run(cfg, tmp_path)
    post = lgb.Posterior.load(tmp_path / continual.POSTERIOR)
    learner = continual.build(cfg)
    assert list(post) == [n for n, _ in learner.model.named_parameters()]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    learner.optimizer.load_state_dict(state["optimizer"])
    assert learner.optimizer.param_groups[0]["data_size"] == len(learner.tasks[1].train_y)
    assert learner.optimizer.param_groups[0]["prior_precision"] == 0.0


def test_the_multiplicative_rule_is_also_evaluated_at_its_posterior_mean() -> None:
    """At the mean E[θ] = E[ξ](g⁺ − g⁻), √(π/2)·g for Rayleigh(1): the row's "mean" metrics
    are those of the network scaled by √(π/2), and the parameters are restored bit for bit;
    the affine rule's mean is g, so its rows have no "mean"."""
    raw = smoke()
    raw["methods"]["mult"] = {
        "strategy": "posterior",
        "optimizer": {"name": "multiplicative", "lr": 1.0, "temperature": 0.01},
    }
    learner = continual.build(continual.resolve(raw, "mult", 0))
    before = [p.detach().clone() for p in learner.model.parameters()]
    row = continual.evaluate(learner, 0)
    assert all(torch.equal(a, p) for a, p in zip(before, learner.model.parameters(), strict=True))
    with torch.no_grad():
        for p in learner.model.parameters():
            p.mul_(math.sqrt(math.pi / 2))
    scaled = continual._metrics(learner, continual._log_probs(learner), 0)
    assert row["mean"]["accuracy"] == pytest.approx(scaled["accuracy"])
    assert row["mean"]["seen"]["nll"] == pytest.approx(scaled["seen"]["nll"], rel=1e-5)
    assert row["mean"]["seen"]["nll"] != pytest.approx(row["point"]["seen"]["nll"], rel=1e-3)
    affine = continual.build(continual.resolve(raw, "affine", 0))
    assert set(continual.evaluate(affine, 0)) == {"task", "point", "average"}
    rows = [{**r, "train_seconds": 1.0, "eval_seconds": 1.0} for r in (row, row)]
    assert list(continual_report.run_summary(rows))[:3] == ["point", "mean", "average"]


def test_the_prior_removed_keeps_the_first_task_s_regularisers(tmp_path: Path) -> None:
    """prior = "initial": after the boundary no prior is set and the param groups hold the
    configured δ again; the default carries the posterior over (the optimizer's state dict
    holds a prior)."""
    raw = smoke()
    raw["methods"]["initial"] = {**raw["methods"]["affine"], "prior": "initial"}
    for label, has_prior in (("affine", True), ("initial", False)):
        cfg = continual.resolve(raw, label, 0)
        continual.run(cfg, tmp_path / label)
        state = torch.load(tmp_path / label / "checkpoint.pt", weights_only=True)["optimizer"]
        assert ("prior" in state) is has_prior
        delta = 0.0 if has_prior else cfg["method"]["optimizer"]["prior_precision"]
        assert state["param_groups"][0]["prior_precision"] == delta == (0.0 if has_prior else 100.0)
        assert state["param_groups"][0]["data_size"] == 800  # the second task's


def test_the_k_prior_s_weight_term_and_no_prior_reach_the_optimizer(tmp_path: Path) -> None:
    """prior = "delta": after the boundary δ is kept and the δ-prior is centred on the point
    estimate that ended the first task (the memory's old outputs are that model's); "none":
    δ is 0 and nothing is centred; neither sets the posterior as prior, and a prior strength
    with either is refused."""
    raw = smoke()
    memory = {"memory": 10, "memory_use": "kprior"}
    raw["methods"]["kprior"] = {**raw["methods"]["affine"], "prior": "delta", **memory}
    raw["methods"]["none"] = {**raw["methods"]["affine"], "prior": "none"}
    checked = {}
    for label in ("kprior", "none"):
        cfg = continual.resolve(raw, label, 0)
        learner = continual.build(cfg)
        for epoch in range(cfg["train"]["epochs"]):
            continual.train_epoch(learner, continual._training_set(learner, 0), 0, epoch)
        with learner.optimizer.point_estimate():  # type: ignore[attr-defined]
            end = [p.detach().clone() for p in learner.model.parameters()]
        continual._next_task(learner, 0)
        state = learner.optimizer.state_dict()
        assert "prior" not in state
        delta = state["param_groups"][0]["prior_precision"]
        checked[label] = (delta, sorted(state.get("prior_centre", {})))
        if label == "kprior":
            centres = [state["prior_centre"][i] for i in range(len(end))]
            assert all(torch.equal(c, e) for c, e in zip(centres, end, strict=True))
    assert checked == {"kprior": (100.0, [0, 1, 2, 3, 4, 5]), "none": (0.0, [])}
    raw["methods"]["bad"] = {**raw["methods"]["none"], "prior_strength": 2.0}
    with pytest.raises(ConfigError, match='prior = "none" does not use; drop prior_strength'):
        continual.resolve(raw, "bad", 0)


def test_each_memory_example_counts_as_one_of_the_task_and_the_prior_strength_is_passed_on(
    tmp_path: Path,
) -> None:
    """The closure adds ``memory_strength`` × (M/|B|)/N × Σ r_j over the memory rows B (each
    memory example one of the task's N, the K-prior's KL from the old predictions), an EWC
    baseline keeps a functional memory from its point estimate, and ``prior_strength``
    reaches the optimizer's prior."""
    raw = smoke(stream={"tasks": 3})
    raw["methods"]["ewc_kprior"] = {**raw["methods"]["ewc"], "memory": 10, "memory_strength": 7.0}
    raw["methods"]["strong_prior"] = {**raw["methods"]["affine"], "prior_strength": 5.0}
    for label in ("ewc_kprior", "strong_prior"):
        continual.run(continual.resolve(raw, label, 0), tmp_path / label)
    state = torch.load(tmp_path / "strong_prior" / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["prior_strength"] == 5.0
    learner = continual.build(continual.resolve(raw, "ewc_kprior", 0))
    continual._restore(learner, tmp_path / "ewc_kprior" / continual.CHECKPOINT)
    memory = learner.memory
    assert memory is not None and (memory.selection, memory.use, len(memory)) == (
        "lambda",
        "kprior",
        20,
    )
    task = learner.tasks[2]
    x, y, size = task.train_x[:8], task.train_y[:8], len(task.train_y)
    rows = torch.tensor([3, 15])
    closure = continual._closure(learner, x, y, learner.masks[2].expand(8, -1), rows, size)
    with torch.no_grad():
        now = learner.model(memory.inputs[rows]).gather(1, learner.columns[memory.tasks[rows]])
        data_term = torch.nn.functional.cross_entropy(learner.model(x) + learner.masks[2], y)
        p_old = memory.outputs_old[rows].softmax(-1)
        kl = (p_old * (p_old.log() - now.log_softmax(-1))).sum(-1)
        penalty = learner.ewc.penalty(learner.model)  # type: ignore[union-attr]
    expected = data_term + penalty + 7.0 * (20 / 2) * kl.sum() / size
    torch.testing.assert_close(closure(), expected, rtol=1e-5, atol=1e-7)


def test_a_memory_keeps_examples_of_every_finished_task_on_its_head(tmp_path: Path) -> None:
    raw = smoke(stream={"tasks": 3})
    cfg = continual.resolve(raw, "affine_memory", 0)
    continual.run(cfg, tmp_path)
    memory = lgb.MemorablePast.load(tmp_path / continual.MEMORY)
    assert (memory.per_task, memory.selection, memory.num_tasks) == (20, "sensitivity", 2)
    assert memory.tasks.tolist() == [0] * 20 + [1] * 20
    tasks = continual.build(cfg).tasks
    for t in (0, 1):
        kept = memory.inputs[memory.tasks == t].flatten(1)
        train = tasks[t].train_x.flatten(1)
        rows = (kept[:, None] == train[None]).all(-1).int().argmax(1)
        assert torch.equal(train[rows], kept)  # task t's own training examples
        labels = tasks[t].train_y[rows] - 2 * t  # digit 2t + c is class c of the head
        assert torch.equal(memory.targets[memory.tasks == t], labels)
        scores = memory.scores[memory.tasks == t]
        assert torch.all(scores[:-1] >= scores[1:])  # the highest first


def test_replaying_the_memory_keeps_the_first_task(tmp_path: Path) -> None:
    """Class-incremental digits (one head): with a weak replay task 2 overwrites task 1; a
    strong one keeps the memory fitted (a smaller replay loss at the end) and with it task 1,
    from the same first task and data order."""
    raw = smoke(stream={"heads": "single"})
    memory = {**raw["methods"]["affine_memory"], "memory_use": "replay"}
    raw["methods"] = {
        "weak": {**memory, "memory_strength": 1e-3},
        "strong": {**memory, "memory_strength": 100.0},
    }
    matrices, replay = {}, {}
    for label in raw["methods"]:
        cfg = continual.resolve(raw, label, 0)
        matrices[label] = continual.run(cfg, tmp_path / label)["point"]["matrix"]
        learner = continual.build(cfg)
        learner.model.load_state_dict(torch.load(tmp_path / label / "checkpoint.pt")["model"])
        kept = lgb.MemorablePast.load(tmp_path / label / continual.MEMORY)
        with torch.no_grad():
            replay[label] = kept.loss(learner.model(kept.inputs), data_size=1).item()
    weak, strong = matrices["weak"], matrices["strong"]
    assert weak[0][0] == strong[0][0]  # the same first task
    assert replay["strong"] < replay["weak"] / 2
    assert strong[0][1] > weak[0][1] + 0.2


def test_a_validation_run_never_reads_the_test_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the test images made NaN, a run on the test set is refused before its first step,
    naming the first test input; a run with [stream] validation finishes: it evaluates on
    held-out training examples."""
    real = continual._dataset

    def poisoned(name: str, root: str) -> Dataset:
        data = real(name, root)
        return dataclasses.replace(data, test_x=torch.full(data.test_x.shape, math.nan))

    monkeypatch.setattr(continual, "_dataset", poisoned)
    with pytest.raises(NonFiniteInputError, match="task 1 test input 0 holds NaN"):
        continual.run(continual.resolve(smoke(), "finetune", 0), tmp_path / "test")
    raw = smoke(stream={"validation": 1000})
    results = continual.run(continual.resolve(raw, "affine_memory", 0), tmp_path / "held")
    assert results["eval_set"] == "validation"
    digits = load_dataset("mnist5k").train_y
    assert sum(results["train_sizes"]) + sum(results["test_sizes"]) == int((digits < 4).sum())
    assert 300 < sum(results["test_sizes"]) < 500  # about 4/10 of the 1,000 held out


# ---------------------------------------------------------------------------- tuning
def tuning_config() -> dict[str, Any]:
    """The smoke stream on a validation split, a grid for EWC and one for the rule."""
    raw = smoke(stream={"validation": 1000})
    methods = raw["methods"]
    raw["methods"] = {
        "finetune": methods["finetune"],
        "ewc": {**methods["ewc"], "grid": {"ewc_lambda": [1.0, 1e4]}},
        "affine": {**methods["affine"], "grid": {"lr": [0.05, 1e-4], "temperature": [0.1, 1.0]}},
    }
    return raw


def test_tuning_trains_every_point_on_the_validation_split_and_chooses_the_best(
    tmp_path: Path,
) -> None:
    results = continual_tune.continual_tune(tuning_config(), tmp_path)
    assert [p["values"] for p in results["affine"]["points"]] == [
        {"lr": 0.05, "temperature": 0.1},
        {"lr": 0.05, "temperature": 1.0},
        {"lr": 1e-4, "temperature": 0.1},
        {"lr": 1e-4, "temperature": 1.0},
    ]
    for label, res in results.items():
        scores = []
        for i, point in enumerate(res["points"]):
            run = json.loads((tmp_path / f"{label}.{i}" / "seed0" / "results.json").read_text())
            assert run["eval_set"] == "validation"
            estimate = "average" if "average" in run else "point"
            assert point["score"] == pytest.approx(run[estimate]["final_accuracy"])
            scores.append(point["score"])
        assert res["points"][res["chosen"]]["score"] == max(scores)
        chosen = res["points"][res["chosen"]]["values"]
        method = {**res["method"], **res["method"]["optimizer"]}
        assert {k: method[k] for k in chosen} == chosen
    assert results["ewc"]["method"]["ewc_lambda"] in (1.0, 1e4)
    assert results["affine"]["method"]["optimizer"]["lr"] == 0.05  # 1e-4 learns nothing
    written = json.loads((tmp_path / "tuned.json").read_text())
    assert written["affine"]["method"] == results["affine"]["method"]
    assert (tmp_path / "tuning.md").read_text().count("| ← |") == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stream": {"validation": 0}}, r"must not see the test set; set \[stream\] validation"),
        ({"tune": {"metric": "ece"}}, r"unknown \[tune\].metric 'ece'"),
        ({"methods": {"x": {"strategy": "finetune", "grid": {"lr": 0.1}}}}, "lists"),
    ],
)
def test_bad_tuning_configs_are_clear_errors(
    change: dict[str, Any], message: str, tmp_path: Path
) -> None:
    raw = tuning_config()
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if key in raw else value
    with pytest.raises(ConfigError, match=message):
        continual_tune.continual_tune(raw, tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"stream": {"name": "rotated"}}, "unknown 'rotated'"),
        ({"stream": {"name": "permuted", "heads": "multi"}}, "use 'single'"),
        ({"stream": {"tasks": 0}}, r"\[stream\].tasks must be >= 1"),
        ({"train": {"warmup": 1}}, "warmup"),
        ({"methods": {"x": {"strategy": "replay"}}}, "unknown 'replay'"),
        (
            {"methods": {"x": {"strategy": "ewc", "optimizer": {"name": "adam", "lr": 0.1}}}},
            "ewc_lambda",
        ),
        (
            {"methods": {"x": {"strategy": "posterior", "optimizer": {"name": "adam", "lr": 0.1}}}},
            "takes one of",
        ),
        (
            {"methods": {"x": {"strategy": "joint", "optimizer": {"name": "affine"}}}},
            "takes one of",
        ),
        ({"methods": {"../x": {"strategy": "finetune"}}}, "plain folder name"),
        ({"methods": {}}, "at least one"),
        ({"epochs": 3}, "unknown top-level"),
        ({"stream": {"validation": -1}}, r"\[stream\].validation must be >= 0"),
        ({"threads": -1}, "threads must be >= 0"),
        (
            {"methods": {"x": {"strategy": "posterior", "prior": "nothing", **AFFINE}}},
            "unknown 'nothing'",
        ),
        (
            {"methods": {"x": {"strategy": "posterior", "memory_selection": "loss", **AFFINE}}},
            "memory_selection: unknown 'loss'",
        ),
        (
            {"methods": {"x": {"strategy": "posterior", "memory_strength": 0.0, **AFFINE}}},
            "memory_strength must be > 0",
        ),
        ({"methods": {"x": {"strategy": "joint", "memory": 5, **ADAM}}}, "'memory'"),
        (
            {
                "methods": {
                    "x": {"strategy": "ewc", "ewc_lambda": 1.0, "memory": 5, **ADAM}
                    | {"memory_selection": "sensitivity"}
                }
            },
            "memory_selection: 'sensitivity' needs a posterior",
        ),
        (
            {"methods": {"x": {"strategy": "posterior", "memory_use": "kl", **AFFINE}}},
            "memory_use: unknown 'kl'",
        ),
        (
            {
                "methods": {
                    "x": {"strategy": "finetune", "memory": 5, "memory_use": "fromp_logits"} | ADAM
                }
            },
            "memory_use: 'fromp_logits' needs a posterior",
        ),
        ({"train": {"schedule": "linear"}}, r"\[train\].schedule: unknown 'linear'"),
        ({"train": {"clip_norm": -1.0}}, r"\[train\].clip_norm must be >= 0"),
        (
            {
                "train": {"restart_optimizer": True},
                "methods": {"x": {"strategy": "posterior", **AFFINE}},
            },
            "restart_optimizer: a rule's state is its posterior",
        ),
        (
            {"methods": {"x": {"strategy": "finetune", "memory_prior_precision": 0.0, **ADAM}}},
            "memory_prior_precision must be > 0",
        ),
        (
            {"methods": {"x": {"strategy": "posterior", "prior_strength": 0.0, **AFFINE}}},
            "prior_strength must be finite and > 0",
        ),
        (
            {
                "methods": {
                    "x": {"strategy": "posterior", "prior": "initial", "prior_strength": 2.0}
                    | AFFINE
                }
            },
            "prior_strength: 2.0 weights the previous posterior",
        ),
    ],
)
def test_bad_configs_are_one_line_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        continual.run_configs(smoke(**change))


def test_a_batch_larger_than_a_task_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    cfg = continual.resolve(smoke(train={"batch_size": 5000}), "finetune", 0)
    with pytest.raises(ConfigError, match="batch_size 5000 exceeds"):
        continual.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("continual_*.toml")), ids=lambda p: p.stem)
def test_shipped_continual_configs_resolve(path: Path) -> None:
    raw = load(path)
    tuning = "tune" in raw
    if tuning:  # one run per grid point, on a validation split
        raw, points = tune.grid_points(raw, "methods", continual_tune.METHOD_KEYS)
        assert all(points.values())
    runs = continual.run_configs(raw)
    strategies = {next(iter(by_seed.values()))["method"]["strategy"] for by_seed in runs.values()}
    rules_only = path.stem.endswith("_rules_tuning")  # the rules' half of a stream's tuning
    baselines_only = path.stem.endswith("_baselines_tuning")  # a baselines' grid extended
    fromp_only = path.stem.endswith("_fromp")  # FROMP's code and its Adam controls
    expected = {"posterior"} if rules_only else {"finetune", "ewc", "posterior"}
    if baselines_only or fromp_only:
        expected = {"ewc"} if baselines_only else {"finetune"}
    assert strategies >= expected
    assert ("joint" in strategies) is not (tuning or fromp_only)
    for by_seed in runs.values():
        for cfg in by_seed.values():
            assert not Path(cfg["stream"]["root"]).is_absolute()
            assert (cfg["stream"]["validation"] > 0) is tuning
            assert math.isfinite(cfg["train"]["epochs"])


def test_non_finite_metrics_after_a_task_stop_the_run_as_diverged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task whose model average scores NaN (a diverged posterior whose steps were all
    skipped) ends the run as diverged, so a tuning grid counts the point as such, and no
    non-finite row is written."""
    metrics = continual._metrics

    def nan_nll(learner: Any, log_probs: list[torch.Tensor], t: int) -> dict[str, Any]:
        m = metrics(learner, log_probs, t)
        m["nll"][0] = math.nan
        return m

    monkeypatch.setattr(continual, "_metrics", nan_nll)
    cfg = continual.resolve(smoke(), "finetune", 0)
    with pytest.raises(DivergedError, match=r"non-finite metrics \['point.nll.0'"):
        continual.run(cfg, tmp_path / "run")
    assert read_rows(tmp_path / "run") == []  # the failed task's row is not written
    assert tune.train_point(continual.run, cfg, tmp_path / "again", False) is None


def test_final_bars_take_each_methods_estimate_per_seed() -> None:
    """A rule's bar is its model average, a method without a posterior its point estimate;
    every seed's final accuracy in percent, in the methods' order."""

    def leaf(*values: float) -> dict[str, Any]:
        return {"final_accuracy": {"mean": sum(values) / len(values), "sd": None, "values": values}}

    summary = {
        "ewc": {"point": leaf(0.9, 0.8)},
        "affine": {"point": leaf(0.5, 0.5), "average": leaf(0.7, 0.6)},
    }
    bars = continual_report.final_bars(summary, 32)
    affine = "affine, posterior as prior (average of 32)"  # labelled in words
    assert list(bars) == ["EWC", affine]
    assert bars["EWC"] == pytest.approx([90.0, 80.0])
    assert bars[affine] == pytest.approx([70.0, 60.0])


def test_a_diverged_run_is_reported_and_the_others_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A method and seed that diverge are a result of the comparison, not its end: the other
    runs train, the summary is over the seeds that trained, the report names the diverged
    seeds (a method that diverged on every seed has a row saying so), and a resume returns
    the recorded divergence without training again."""
    metrics = continual._metrics
    diverging = {("ewc", 1), ("joint", 0), ("joint", 1)}

    def nan_for_some(learner: Any, log_probs: list[torch.Tensor], t: int) -> dict[str, Any]:
        m = metrics(learner, log_probs, t)
        if (learner.cfg["method"]["strategy"], learner.cfg["seed"]) in diverging:
            m["nll"][0] = math.nan
        return m

    monkeypatch.setattr(continual, "_metrics", nan_for_some)
    raw = smoke()
    raw["methods"] = {k: raw["methods"][k] for k in ("finetune", "ewc", "joint")}
    raw["stream"]["tasks"] = 1
    out = tmp_path / "out"
    results = continual.continual(raw, out, seeds=[0, 1])
    assert [results[m]["diverged_seeds"] for m in ("finetune", "ewc", "joint")] == [[], [1], [0, 1]]
    assert len(results["ewc"]["summary"]["point"]["final_accuracy"]["values"]) == 1
    assert results["joint"]["summary"] == {}
    assert (out / "ewc" / "seed1" / continual.DIVERGED).exists()
    report = (out / "report.md").read_text()
    assert "| ewc (seed 1 diverged) | at g |" in report
    assert "| joint (diverged on every seed) | — |" in report
    started, run = [], continual.run

    def spy(cfg: dict[str, Any], folder: Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        started.append((cfg["method"]["strategy"], cfg["seed"]))
        return run(cfg, folder, *args, **kwargs)

    monkeypatch.setattr(continual, "run", spy)
    again = continual.continual(raw, out, resume=True, seeds=[0, 1])
    assert again == json.loads((out / "results.json").read_text()) == results
    assert not diverging & set(started)  # the recorded divergences are not trained again


def test_an_optimizer_that_stops_on_skipped_steps_is_a_diverged_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule whose gradients are never finite skips its steps until its
    ``max_consecutive_skips`` raises FloatingPointError: that run is recorded as diverged,
    naming the optimizer's reason, and the other methods train (the driver does not stop)."""
    closure_of = continual._closure

    def nan_gradients(learner: Any, *args: Any) -> Any:
        closure = closure_of(learner, *args)
        if learner.strategy != "posterior":
            return closure

        def broken() -> torch.Tensor:
            loss = closure()
            for p in learner.model.parameters():
                p.grad.fill_(math.nan)
            return loss

        return broken

    monkeypatch.setattr(continual, "_closure", nan_gradients)
    raw = smoke()
    raw["methods"] = {k: raw["methods"][k] for k in ("finetune", "affine")}
    out = tmp_path / "out"
    results = continual.continual(raw, out, seeds=[0])
    assert [results[m]["diverged_seeds"] for m in ("finetune", "affine")] == [[], [0]]
    error = json.loads((out / "affine" / "seed0" / continual.DIVERGED).read_text())
    assert "steps in a row skipped for non-finite values" in json.dumps(error)
    assert results["finetune"]["summary"]["point"]["final_accuracy"]["values"]


# ------------------------------------------------------------- FROMP as its code runs
FROMP_TRAIN = {"schedule": "constant", "clip_norm": 0.01, "restart_optimizer": True}


def fromp_config() -> dict[str, Any]:
    """Three tasks of the smoke stream, Adam with FROMP's memory (Σ from the summed GGN) at a
    constant lr, clipped gradients and Adam restarted per task."""
    raw = smoke(stream={"tasks": 3}, train=FROMP_TRAIN)
    memory = {"memory": 6, "memory_use": "fromp", "memory_strength": 50.0}
    raw["methods"] = {"adam_fromp_lambda": {"strategy": "finetune", **memory, **ADAM}}
    return raw


def test_fromp_s_memory_is_refreshed_at_every_boundary_from_the_summed_ggn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = continual.resolve(fromp_config(), "adam_fromp_lambda", 0)
    tasks = continual.build(cfg).tasks
    original, calls = lgb.MemorablePast.refresh, []

    def spy(memory: lgb.MemorablePast, model: nn.Module, **kwargs: Any) -> None:
        original(memory, model, **kwargs)
        with torch.no_grad():
            now = model(memory.inputs)
        calls.append(
            {
                "tasks": memory.num_tasks,
                "kernels": [k.clone() for k in memory.task_kernel_inverse],
                "targets": memory.outputs_old.clone(),
                "now": now,
                "covariance": {n: v.clone() for n, v in kwargs["covariance"].items()},
                "fisher": [
                    diagonal_fisher(model, tasks[t].train_x, column_mask(tasks[t].classes, 10))
                    for t in range(memory.num_tasks)
                ],
            }
        )

    monkeypatch.setattr(lgb.MemorablePast, "refresh", spy)
    result = continual.run(cfg, tmp_path)
    assert len(result["point"]["matrix"]) == 3  # it trained every task
    assert [c["tasks"] for c in calls] == [1, 2]  # at both boundaries, every stored task
    columns = [torch.tensor(task.classes) for task in tasks]
    for call in calls:
        assert len(call["kernels"]) == call["tasks"]
        assert all(k.shape == (2, 6, 6) for k in call["kernels"])  # a kernel per class
        for t in range(call["tasks"]):  # the targets: the current weights on the task's head
            rows = slice(6 * t, 6 * (t + 1))
            torch.testing.assert_close(call["targets"][rows], call["now"][rows][:, columns[t]])
    # the second refresh recomputed task 1's targets and kernels from the weights of then
    assert not torch.allclose(calls[1]["targets"][:6], calls[0]["targets"][:6])
    assert not torch.allclose(calls[1]["kernels"][0], calls[0]["kernels"][0])
    # Σ = 1/(GGN summed over the finished tasks' examples + 1e-5), each task's at its end
    N = [len(task.train_y) for task in tasks]
    first = {n: 1 / (N[0] * f + 1e-5) for n, f in calls[0]["fisher"][0].items()}
    for n, v in first.items():
        torch.testing.assert_close(calls[0]["covariance"][n], v, rtol=1e-4, atol=0)
        summed = 1 / calls[1]["covariance"][n] - 1e-5
        grew = summed - (1 / calls[0]["covariance"][n] - 1e-5)
        torch.testing.assert_close(grew, N[1] * calls[1]["fisher"][1][n], rtol=1e-3, atol=1e-3)
    state = torch.load(tmp_path / continual.CHECKPOINT, weights_only=True)
    assert set(state["ggn"]["ggn"]) == set(first)  # the summed GGN is checkpointed


def test_the_new_train_keys_keep_the_lr_clip_the_gradient_and_restart_adam() -> None:
    assert [continual._task_lr(e, 4, 0, "constant") for e in range(8)] == [1.0] * 8
    assert continual._task_lr(1, 4, 0) < 1.0  # the cosine default
    assert [continual._task_lr(e, 4, 2, "constant") for e in range(4)] == [0.5, 1.0, 1.0, 1.0]
    learner = continual.build(continual.resolve(fromp_config(), "adam_fromp_lambda", 0))
    task = learner.tasks[0]
    x, y = task.train_x[:32], task.train_y[:32]
    closure = continual._closure(learner, x, y, learner.masks[0].expand(32, -1), None, 100)
    closure()
    norm = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in learner.model.parameters()])
    )
    assert norm.item() == pytest.approx(0.01, rel=1e-5)  # clipped from above
    learner.optimizer.step(closure)
    assert learner.optimizer.state  # Adam's moments, until the boundary restarts them
    continual._next_task(learner, 0)
    assert not learner.optimizer.state and learner.memory is not None
    assert len(learner.memory.task_kernel_inverse) == 1
    unclipped = smoke(train={"clip_norm": 0.0})  # the default leaves the gradient as it is
    learner = continual.build(continual.resolve(unclipped, "finetune", 0))
    continual._closure(learner, x, y, learner.masks[0].expand(32, -1), None, 100)()
    norm = torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in learner.model.parameters()])
    )
    assert norm.item() > 0.1


def test_the_torch_init_is_nn_linear_s_default_and_the_default_is_the_reference_s() -> None:
    """``init = "torch"``: weights and biases within ±1/√fan_in (uniform, as nn.Linear's own);
    the default: biases 0.05 and weights N(0, 1/fan_in) truncated at ±2σ."""
    torch.manual_seed(0)
    theirs = continual.MLP((1, 28, 28), 10, [100, 100], "relu", "torch")
    torch.manual_seed(0)
    ours = continual.MLP((1, 28, 28), 10, [100, 100], "relu")
    for mine, other in zip(ours.net, theirs.net, strict=True):
        if not isinstance(mine, nn.Linear):
            continue
        bound = 1 / math.sqrt(mine.in_features)
        assert float(other.weight.abs().max()) <= bound and float(other.bias.abs().max()) <= bound
        assert float(other.weight.std()) == pytest.approx(bound / math.sqrt(3), rel=0.1)
        assert torch.all(mine.bias == 0.05)
        assert float(mine.weight.abs().max()) <= 2 * bound
        assert float(mine.weight.std()) == pytest.approx(0.88 * bound, rel=0.1)  # truncated
    with pytest.raises(ConfigError, match=r"\[model\].init: unknown 'xavier'"):
        continual.run_configs(smoke(model={"init": "xavier"}))


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_pass_sees_every_example_once_and_the_partial_batch_unless_dropped(
    drop_last: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The minibatches of a pass are disjoint; with ``drop_last = false`` they cover the task
    (the last one partial, as a torch DataLoader's), else the remainder is left out."""
    raw = smoke(train={"batch_size": 48, "drop_last": drop_last})
    learner = continual.build(continual.resolve(raw, "finetune", 0))
    task = learner.tasks[0]
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(
        continual, "_closure", lambda _l, x, y, *rest: seen.append(y.clone()) or (lambda: None)
    )
    ids = torch.arange(len(task.train_y))
    steps = list(continual._steps(learner, (task.train_x, ids, torch.zeros_like(ids))))
    full, rest = divmod(len(ids), 48)
    assert rest > 0  # the smoke task leaves a partial batch
    assert len(steps) == full + (not drop_last)
    got = torch.cat(seen)
    assert len(got) == len(set(got.tolist())) == (full * 48 if drop_last else len(ids))


@pytest.mark.parametrize("head", [(0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (2, 3)])
def test_the_fast_diagonal_ggn_is_diagonal_fisher(head: tuple) -> None:
    torch.manual_seed(0)
    model = continual.MLP((1, 28, 28), 10, [16, 8], "relu")
    x = torch.randn(50, 1, 28, 28)
    mask = column_mask(head, 10)
    fast, slow = diagonal_ggn(model, x, mask, chunk=20), diagonal_fisher(model, x, mask)
    assert set(fast) == set(slow)
    for n in slow:
        torch.testing.assert_close(fast[n], slow[n], rtol=1e-4, atol=1e-9)
