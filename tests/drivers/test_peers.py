"""The peers driver (experiments/runs/peers.py) and posteriors' mean-field VI as an optimizer
(experiments/common/meanfield.py).

The parts that need laplace-torch or posteriors skip without them: they run in the peers'
environment (experiments/requirements-peers.txt), which the test extras never install.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from experiments.common import config as config_module
from experiments.common import optimizers, runfiles
from experiments.common import training as train
from experiments.common.config import ConfigError
from experiments.runs import peers
from tests.drivers.test_experiments import assert_same, train_interrupted, without_times
from tests.shared import tiny_config

CONFIGS = Path(__file__).parents[2] / "experiments" / "configs"
TINY = tiny_config(
    seeds=[0],
    threads=1,
    data={"shape": [1, 8, 8], "train_size": 48, "test_batch_size": 8},
    schedule={"epochs": 2},
    eval={"samples": 4},
    runs={
        "adam": {"optimizer": {"name": "adam", "lr": 0.01, "prior_precision": 1.0}},
        "vi": {"optimizer": {"name": "vi", "lr": 0.01, "prior_precision": 1.0}},
    },
    laplace={
        "networks": ["adam"],
        "fits": {
            "last_layer_kron": {"subset_of_weights": "last_layer", "hessian_structure": "kron"},
            "all_diag": {
                "subset_of_weights": "all",
                "hessian_structure": "diag",
                "backend": "AsdlGGN",
            },
        },
    },
)


def tiny(**laplace: Any) -> dict[str, Any]:
    raw = copy.deepcopy(TINY)
    raw["laplace"].update(laplace)
    return raw


# ------------------------------------------------------------ without the peers
def test_resolve_fills_the_laplace_table_and_resolves_the_runs() -> None:
    configs, laplace = peers.resolve(tiny(), [0, 1])
    assert set(configs) == {"adam", "vi"} and set(configs["adam"]) == {0, 1}
    assert configs["vi"][1]["optimizer"] == {
        "name": "vi",
        "lr": 0.01,
        "betas": [0.9, 0.999],
        "prior_precision": 1.0,
        "init_log_sd": -3.0,
        "mc_samples": 1,
    }
    assert laplace["link_approx"] == "probit" and laplace["batch_size"] == 50
    assert laplace["fits"]["last_layer_kron"]["backend"] is None
    assert laplace["fits"]["all_diag"]["backend"] == "AsdlGGN"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"networks": ["sgd"]}, r"\[laplace\]\.networks must name runs"),
        ({"networks": []}, r"\[laplace\]\.networks must name runs"),
        ({"fits": {}}, r"at least one \[laplace\.fits\.NAME\]"),
        ({"link_approx": "logit"}, r"unknown \[laplace\]\.link_approx 'logit'"),
        ({"batch_size": 0}, r"\[laplace\]\.batch_size must be >= 1"),
        ({"prior": "marglik"}, r"unknown key\(s\) \['prior'\] in \[laplace\]"),
        (
            {"fits": {"x": {"subset_of_weights": "first_layer", "hessian_structure": "kron"}}},
            r"unknown \[laplace\.fits\.x\]\.subset_of_weights 'first_layer'",
        ),
        (
            {"fits": {"x": {"subset_of_weights": "all", "hessian_structure": "lowrank"}}},
            r"unknown \[laplace\.fits\.x\]\.hessian_structure 'lowrank'",
        ),
        ({"fits": {"x": {"subset_of_weights": "all"}}}, r"missing required key 'hessian_struc"),
    ],
)
def test_resolve_refuses_a_bad_laplace_table(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        peers.resolve(tiny(**change))


def test_resolve_needs_a_laplace_table() -> None:
    raw = tiny()
    del raw["laplace"]
    with pytest.raises(ConfigError, match=r"needs a \[laplace\] table"):
        peers.resolve(raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": 0.0}, r"\[optimizer\]\.lr of vi must be > 0"),
        ({"prior_precision": -1.0}, r"prior_precision must be >= 0"),
        ({"mc_samples": 0}, r"mc_samples must be >= 1"),
        ({"betas": [0.9, 1.0]}, r"betas of vi must be two numbers in \[0, 1\)"),
        ({"init_sd": 0.1}, r"unknown key\(s\) \['init_sd'\]"),
    ],
)
def test_vi_config_is_checked(change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in TINY.items() if k not in ("runs", "laplace", "seeds")}
    raw["optimizer"] = {"name": "vi", "lr": 0.01, **change}
    with pytest.raises(ConfigError, match=message):
        config_module.resolve(raw)


def test_vi_without_posteriors_names_the_peers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "experiments.common.meanfield", None)  # import fails
    cfg = config_module.resolve(
        {
            **{k: v for k, v in TINY.items() if k not in ("runs", "laplace", "seeds")},
            "optimizer": {"name": "vi", "lr": 0.01},
        }
    )
    params = nn.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match=r"experiments/requirements-peers\.txt"):
        optimizers.build_optimizer(cfg["optimizer"], params, 10.0)


def test_the_driver_refuses_to_start_without_the_peers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(runfiles.RunError, match=r"needs laplace-torch, posteriors: .*requirements"):
        peers.peers(tiny(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_entropy_aurocs_separate_exactly_what_the_predictor_tells_apart() -> None:
    """A predictor certain on the canonical image (a 1 in the top-left corner, 0 elsewhere)
    and uniform on anything else separates every shift perfectly; a constant one not at all."""
    canonical = torch.zeros(1, 1, 6, 6)
    canonical[..., 0, 0] = 1.0
    inputs = [canonical.repeat(5, 1, 1, 1), canonical.repeat(3, 1, 1, 1)]

    def knowing(xs: list[Tensor]) -> Tensor:
        x = torch.cat(xs).flatten(1)
        logits = torch.zeros(len(x), 4)
        logits[(x == canonical.flatten()).all(dim=1), 0] = 20.0
        return torch.log_softmax(logits, dim=1)

    def constant(xs: list[Tensor]) -> Tensor:
        return torch.log_softmax(torch.zeros(sum(len(x) for x in xs), 4), dim=1)

    for predict, auroc in ((knowing, 1.0), (constant, 0.5)):
        aurocs = peers.entropy_aurocs(predict(inputs), predict, inputs)
        assert aurocs == {"rotated": auroc, "permuted": auroc, "noise": auroc}


def _result(values: dict[str, float], posterior: bool = True) -> dict[str, Any]:
    """A run's results whose every predictive metric and AUROC is set from ``values``."""
    metrics = {k: values[k] for k in ("accuracy", "nll", "ece", "brier")}
    return {
        "point": metrics,
        "average": {k: v / 2 for k, v in metrics.items()},
        "ood": {
            s: {"point": values["auroc"], "average": values["auroc"] / 2} for s in peers.ood.SHIFTS
        },
        "has_posterior": posterior,
        "prior_precision": 3.0,
        "fit_seconds": 1.5,
        "predict_seconds": 2.5,
        "train_seconds": 10.0,
        "fastest_pass_seconds": 4.0,
        "epochs": 2,
        "steps": 4,
        "train_size": 48,
        "test_size": 16,
        "eval_set": "test",
    }


def test_report_shows_mean_and_sd_of_each_row_and_every_seed() -> None:
    configs, laplace = peers.resolve(tiny(), [0, 1])
    seeds = [
        {"accuracy": 0.90, "nll": 0.30, "ece": 0.02, "brier": 0.10, "auroc": 0.80},
        {"accuracy": 0.92, "nll": 0.34, "ece": 0.04, "brier": 0.12, "auroc": 0.90},
    ]
    results: dict[str, Any] = {}
    for label, posterior in (("adam", False), ("vi", True), ("adam.last_layer_kron", False)):
        per_seed = {str(s): _result(v, posterior) for s, v in enumerate(seeds)}
        results[label] = {
            "seeds": [0, 1],
            "summary": peers.compare.summarise(list(per_seed.values())),
            "per_seed": per_seed,
        }
    results["adam.all_diag"] = copy.deepcopy(results["adam.last_layer_kron"])
    table = peers.rows(configs, laplace, results)
    assert [(label, est, name) for label, est, _, name in table] == [
        ("adam", "point", "at g"),
        ("vi", "point", "at the mean"),
        ("vi", "average", "average of 4"),
        ("adam.last_layer_kron", "average", "Laplace, GLM probit"),
        ("adam.all_diag", "average", "Laplace, GLM probit"),
    ]
    text = peers.report(configs, laplace, results)
    # accuracy 91.00 ± 1.41 (sd of 90 and 92), NLL 0.3200 ± 0.0283, AUROC 0.850 ± 0.071;
    # the average rows carry half of every value
    assert "| adam | at g | 91.00 ± 1.41 | 0.3200 ± 0.0283 | 0.0300 ± 0.0141 |" in text
    assert "| vi | average of 4 | 45.50 ± 0.71 | 0.1600 ± 0.0141 |" in text
    assert "| adam + last layer, kron | Laplace, GLM probit | 45.50 ± 0.71 |" in text
    assert "| adam + all weights, diag | AsdlGGN | 3.00 ± 0.00 | 1.5 ± 0.0 | 2.5 ± 0.0 |" in text
    assert "| adam | at g | 1 | 92.00 | 0.3400 | 0.0400 | 0.1200 | 0.900 | 0.900 | 0.900 |" in text
    assert "| vi | vi | lr=0.01, betas=[0.9, 0.999], prior_precision=1.0" in text
    # 2 seeds x 5 rows of per-seed values
    assert sum(line.count("| Laplace, GLM probit | ") for line in text.splitlines()) == 2 + 4


# ------------------------------------------------------------- with posteriors
def _vi(params: Any, **options: Any) -> Any:
    pytest.importorskip("posteriors")
    from experiments.common.meanfield import MeanFieldVI

    return MeanFieldVI(params, **options)


def test_vi_where_the_data_say_nothing_converges_to_the_prior() -> None:
    """The weights of a linear layer fed zeros get no likelihood gradient: the NELBO's
    optimum for them is q = p = N(0, 1/δ), so log σ → −½ log δ and μ → 0."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = _vi(model.parameters(), lr=0.05, data_size=50.0, prior_precision=4.0, init_log_sd=-2.0)
    x, y = torch.zeros(10, 3), torch.tensor([0, 1] * 5)
    for _ in range(300):
        opt.step(batch=(model, x, y))
    log_sd = opt.vi.log_sd_diag["0"]  # the weight's; the bias sees the labels
    torch.testing.assert_close(
        log_sd, torch.full_like(log_sd, -0.5 * math.log(4.0)), atol=1e-4, rtol=0
    )
    assert model.weight.abs().max().item() < 1e-3


def test_vi_samples_have_the_posterior_spread_and_the_mean_comes_back() -> None:
    torch.manual_seed(0)
    model = nn.Linear(40, 50)
    opt = _vi(model.parameters(), lr=0.01, data_size=10.0, init_log_sd=math.log(0.2))
    mean = model.weight.detach().clone()
    with opt.sampled_params():
        noise = model.weight.detach() - mean
    assert torch.equal(model.weight, mean)
    assert noise.std().item() == pytest.approx(0.2, rel=0.05)
    assert noise.mean().item() == pytest.approx(0.0, abs=0.01)


def test_a_vi_run_resumes_to_the_uninterrupted_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mean-field VI through experiments.runs.train: killed after its second pass, before that
    pass's checkpoint, it resumes to the same means, log σ, Adam state and metrics."""
    pytest.importorskip("posteriors")
    raw = {k: v for k, v in TINY.items() if k not in ("runs", "laplace", "seeds")}
    raw |= {"schedule": {"epochs": 3}, "optimizer": {"name": "vi", "lr": 0.01}}
    full = train.train(copy.deepcopy(raw), tmp_path / "full")
    train_interrupted(copy.deepcopy(raw), tmp_path / "resumed", monkeypatch)
    resumed = train.train(copy.deepcopy(raw), tmp_path / "resumed", resume=True)
    assert without_times(resumed) == without_times(full)
    assert full["has_posterior"] and full["average"]["nll"] != full["point"]["nll"]
    a, b = (
        torch.load(tmp_path / r / train.CHECKPOINT, weights_only=True) for r in ("full", "resumed")
    )
    assert_same(a["model"], b["model"])
    assert_same(a["optimizer"], b["optimizer"])


# ----------------------------------------------------------- with laplace-torch
def test_the_driver_fits_every_laplace_and_resumes_without_refitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("laplace")
    pytest.importorskip("posteriors")
    out = tmp_path / "out"
    results = peers.peers(tiny(), out)
    assert set(results) == {"adam", "vi", "adam.last_layer_kron", "adam.all_diag"}
    network = json.loads((out / "networks" / "adam" / "seed0" / train.RESULTS).read_text())
    for fit in ("last_layer_kron", "all_diag"):
        res = results[f"adam.{fit}"]["per_seed"]["0"]
        assert res["point"] == network["point"]  # the point estimate is the network's
        assert {s: v["point"] for s, v in res["ood"].items()} == {
            s: v["point"] for s, v in network["ood"].items()
        }
        assert res["average"] != res["point"] and res["prior_precision"] > 0
        assert res["test_size"] == 16
        saved = out / "laplace" / f"adam.{fit}" / "seed0" / train.RESULTS
        assert json.loads(saved.read_text()) == res
    assert json.loads((out / "results.json").read_text()) == results
    assert (out / "report.md").read_text().startswith("# Peers")

    def refit(*args: Any) -> dict[str, Any]:
        raise AssertionError("a finished fit was fitted again")

    monkeypatch.setattr(peers, "laplace_results", refit)
    with pytest.raises(FileExistsError, match="--resume"):
        peers.peers(tiny(), out)
    assert without_times(peers.peers(tiny(), out, resume=True)) == without_times(results)


def test_an_unknown_curvature_backend_is_refused_before_any_training(tmp_path: Path) -> None:
    pytest.importorskip("laplace")
    pytest.importorskip("posteriors")
    raw = tiny()
    raw["laplace"]["fits"]["all_diag"]["backend"] = "ExactGGN"
    with pytest.raises(ConfigError, match=r"unknown \[laplace\.fits\.all_diag\]\.backend 'Exa"):
        peers.peers(raw, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fit", ["last_layer_kron", "all_diag"])
def test_laplace_predictive_with_a_sharp_prior_is_the_network(tmp_path: Path, fit: str) -> None:
    """As the prior precision grows the GLM predictive's variance vanishes: probit and the
    log of the predictive give log softmax of the network's logits."""
    pytest.importorskip("laplace")
    configs, laplace = peers.resolve(tiny(batch_size=5))
    cfg = configs["adam"][0]
    train.train(copy.deepcopy(cfg), tmp_path)
    run = peers.trained_network(cfg, tmp_path)
    la, seconds = peers.fit_laplace(run, laplace["fits"][fit], laplace["batch_size"])
    assert seconds > 0 and float(la.prior_precision) > 0
    la.prior_precision = 1e12
    x = [run.data.normalize(run.data.to_unit(run.data.test_x))]
    log_probs = peers.laplace_log_probs(la, x, laplace, samples=4)
    with torch.no_grad():
        expected = torch.log_softmax(run.model(x[0]), dim=1)
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)


def test_the_shipped_config_trains_the_networks_of_the_like_for_like_page() -> None:
    """Laplace is fitted on the page's tuned Adam and SGD networks: the same data, network,
    passes, schedule, seeds, threads and hyperparameters."""
    configs, _ = peers.resolve(config_module.load(CONFIGS / "mnist5k_peers.toml"))
    page = config_module.run_configs(config_module.load(CONFIGS / "mnist5k_like_for_like.toml"))
    for label in ("adam", "sgd"):
        assert configs[label] == page[label]
    assert configs["vi"][0]["optimizer"]["mc_samples"] == 1
