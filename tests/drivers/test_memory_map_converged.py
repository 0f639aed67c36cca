"""The converged leave-one-out check (``experiments.memory.converged``) on tiny synthetic
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

from experiments.common import config as config_module
from experiments.common import runfiles
from experiments.memory import converged as mc
from experiments.memory.maps import trained
from tests.shared import digits_affine, tiny_config

MULTIPLICATIVE = {
    "optimizer": {
        "name": "multiplicative",
        "lr": 5.0,
        "temperature": 0.01,
        "prior_precision": 10.0,
        "base": "rayleigh",
    }
}


def tiny(run: dict[str, Any] | None = None, **converged: Any) -> dict[str, Any]:
    """An affine run (or ``run``, under the label ``m``) on 3-class 1×8×8 synthetic images,
    48 train."""
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
        runs={"affine": digits_affine()} if run is None else {"m": run},
    )


@pytest.fixture(scope="module")
def retrainer(tmp_path_factory) -> mc.ShiftRetrainer:
    configs, table = mc.resolve(tiny())
    run = trained(configs["affine"][0], tmp_path_factory.mktemp("run") / "train")
    return mc.ShiftRetrainer(run, table, 0)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> mc.ScaleRetrainer:
    configs, table = mc.resolve(tiny(MULTIPLICATIVE, samples=8))
    run = trained(configs["m"][0], tmp_path_factory.mktemp("run") / "train")
    return mc.ScaleRetrainer(run, table, 0)


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


def test_the_multiplicative_objective_is_the_rules_over_the_fixed_draws(scaled):
    r = scaled
    S, N = r.table["samples"], r.size
    g = {n: log_g.exp() for n, log_g in r.start.items()}
    thetas = [
        {n: v[0] * r.noise[n][s, 0] - v[1] * r.noise[n][s, 1] for n, v in g.items()}
        for s in range(S)
    ]
    with torch.no_grad():
        nll = [
            cross_entropy(torch.func.functional_call(r.model, t, (r.x,)), r.y, reduction="none")
            for t in thetas
        ]
        square = sum(sum(float(v.square().sum()) for v in t.values()) for t in thetas) / S
        entropy = sum(float(v.log().sum()) for v in g.values())
        expected = float(torch.stack(nll).mean(0).sum()) / N
        expected += 0.5 * r.delta * square / N - r.tau * entropy / N
        torch.testing.assert_close(float(r.objective(r.start, None)), expected, rtol=1e-12, atol=0)
        without = float(r.objective(r.start, torch.arange(N) != 5))
    torch.testing.assert_close(
        expected - without, float(torch.stack(nll)[:, 5].mean()) / N, rtol=1e-10, atol=1e-14
    )
    # the logits read are those at the posterior mean Eξ·(g⁺ − g⁻)
    mean = {n: r.centre[n] * (v[0] - v[1]) for n, v in g.items()}
    torch.testing.assert_close(
        r.logits(r.start, torch.arange(3)),
        torch.func.functional_call(r.model, mean, (r.x[:3],)),
        rtol=1e-12,
        atol=0,
    )


def test_multiplicative_retraining_moves_nothing_unless_an_example_is_removed(scaled):
    r = scaled
    index = torch.arange(4)
    control = r.retrain(None, index)
    assert control["converged"] and control["objective"][-1] <= control["objective"][0]
    again = r.retrain(None, index, r.last)
    removed = r.retrain(1, index, r.last)
    floor = (torch.tensor(again["logits"]) - torch.tensor(control["logits"])).abs().sum(-1)
    truth = (torch.tensor(removed["logits"]) - torch.tensor(control["logits"])).abs().sum(-1)
    assert float(floor.max()) < 1e-4
    assert float(truth[1]) > 30 * float(floor.max())
    assert float(truth[1]) == float(truth.max())


@pytest.mark.parametrize("which", ["retrainer", "scaled"])
def test_the_posterior_at_the_starting_parameters_is_the_trained_one(which, request):
    r = request.getfixturevalue(which)
    post = r.posterior(r.start)
    assert list(post) == list(r.post) and post.point_at == r.post.point_at
    for key, entry in r.post.items():
        assert post[key].element.dtype == entry.element.dtype
        torch.testing.assert_close(post[key].element, entry.element, rtol=1e-6, atol=1e-7)


def test_the_command_writes_its_files_and_resumes_without_redoing_a_retraining(tmp_path):
    out = tmp_path / "conv"
    results = mc.converged(tiny(), out)
    seed = out / "affine" / "seed0"
    written = (mc.ESTIMATES, mc.ESTIMATES_AT_CONTROL, mc.INFLUENCE, mc.RETRAIN, mc.SUMMARY)
    for name in (*written, mc.CONTROL_MEAN, "influence.png"):
        assert (seed / name).exists(), name
    assert (seed / "converged.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = runfiles.read_json(out / "config.json")
    assert config["converged"]["examples"] == 2 and "affine" in config["runs"]
    rows = runfiles.read_jsonl(seed / mc.RETRAIN)
    assert [r["kind"] for r in rows] == ["control", "again", "removed", "removed"]
    s = results["affine"]["per_seed"]["seed0"]
    assert s["examples"] == 2 and s["converged"] == 1.0
    assert s["f"]["above_floor"] == 1.0 and s["p"]["truth_over_floor"] > 10
    # the estimate at the converged control differs from the one at the trained posterior
    assert s["at_control"]["f"]["ratio_median"] != s["f"]["ratio_median"]
    assert set(s["influence"]) >= {"newton", "full", "diagonal", "mean_field"}
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
            {"runs": {"m": {"optimizer": {"name": "additive", "lr": 5.0}}}},
            "retrains name = 'affine'",
        ),
        (
            {"runs": {"m": {"optimizer": {"name": "multiplicative", "lr": 5.0}}}},
            "prior_precision = 0: .* set prior_precision > 0",
        ),
        (
            {"runs": {"m": {"optimizer": {**MULTIPLICATIVE["optimizer"], "signed": False}}}},
            "signed = true",
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
