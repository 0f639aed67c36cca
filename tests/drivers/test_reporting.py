"""What the reports say: sparsity measures, out-of-distribution AUROC, summaries over seeds,
robust filter colours, the Markdown tables, and compare over several seeds (issue 10)."""

from __future__ import annotations

import copy
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
import torch

from experiments.common import cli, config, figures, ood, sparsity, tables
from experiments.common.config import ConfigError
from experiments.runs import compare
from tests.shared import tiny_config


# ------------------------------------------------------------------- Markdown tables
def test_a_markdown_table_is_its_header_separator_and_rows() -> None:
    head = ["run", "seed", "NLL", ""]
    rows = iter([["sgd", "0", "0.3120", "←"], ["affine, t", "1", "n/a", ""]])
    lines = tables.markdown(head, rows, [tables.LEFT, tables.RIGHT, tables.RIGHT, tables.LEFT])
    assert lines == [
        "| run | seed | NLL |  |",
        "|---|---:|---:|---|",
        "| sgd | 0 | 0.3120 | ← |",
        "| affine, t | 1 | n/a |  |",
    ]
    assert tables.markdown(["a", "b"], [], tables.RIGHT) == ["| a | b |", "|---:|---:|"]
    assert tables.markdown(["a"], [("x",)]) == ["| a |", "|---|", "| x |"]  # left by default


# ------------------------------------------------------------------------- sparsity


def test_a_few_huge_weights_do_not_make_the_rest_near_zero() -> None:
    """90% of the weights are zero, 10% at the initial scale σ₀ and one is 10⁴ σ₀."""
    sigma = sparsity.init_scale(torch.empty(4, 100))
    assert sigma == pytest.approx(0.1)
    w = torch.zeros(4, 100)
    w[:, :10] = sigma
    w[0, 0] = 1000.0
    measures = sparsity.sparsity(w)
    assert measures["max_abs"] == pytest.approx(1000.0)
    assert measures["median_abs"] == 0.0
    assert measures["near_zero"] == pytest.approx(360 / 400)  # the zeros only
    assert measures["near_zero_max"] == pytest.approx(399 / 400)  # all but the huge one
    # three filters with 10 equal entries, one with 1000 and nine entries of 0.1
    ten_equal = (10 - math.sqrt(10)) / 9
    ratio = (1000 + 9 * 0.1) / math.sqrt(1000**2 + 9 * 0.1**2)
    assert measures["hoyer"] == pytest.approx((3 * ten_equal + (10 - ratio) / 9) / 4)


def test_dense_gaussian_layer_has_known_measures() -> None:
    """w ~ N(0, σ₀²): P(|w| < 0.01 σ₀) = 2Φ(0.01) − 1, median |w| = 0.6745 σ₀ and
    ‖w‖₁/‖w‖₂ → √(2n/π), so Hoyer → (√n − √(2n/π))/(√n − 1)."""
    n, filters = 784, 100
    sigma = sparsity.init_scale(torch.empty(filters, n))
    w = sigma * torch.randn(filters, n, generator=torch.Generator().manual_seed(0))
    measures = sparsity.sparsity(w)
    expected_share = math.erf(sparsity.NEAR_ZERO / math.sqrt(2))
    standard_error = math.sqrt(expected_share / w.numel())
    assert measures["near_zero"] == pytest.approx(expected_share, abs=4 * standard_error)
    assert measures["median_abs"] == pytest.approx(0.6745 * sigma, rel=0.02)
    hoyer = (math.sqrt(n) - math.sqrt(2 * n / math.pi)) / (math.sqrt(n) - 1)
    assert measures["hoyer"] == pytest.approx(hoyer, abs=0.01)


def test_sparse_layer_counts_its_zeros() -> None:
    """Each filter: k entries ±σ₀, the rest 10⁻⁴ σ₀ → near zero (n − k)/n, Hoyer by hand."""
    n, k = 64, 4
    sigma = sparsity.init_scale(torch.empty(8, n))
    w = torch.full((8, n), 1e-4 * sigma)
    w[:, :k] = sigma * torch.tensor([1.0, -1.0, 1.0, -1.0])
    measures = sparsity.sparsity(w)
    assert measures["near_zero"] == pytest.approx((n - k) / n)
    l1, l2 = sigma * (k + (n - k) * 1e-4), sigma * math.sqrt(k + (n - k) * 1e-8)
    assert measures["hoyer"] == pytest.approx((math.sqrt(n) - l1 / l2) / (math.sqrt(n) - 1))


# ----------------------------------------------------------------------------- OOD


def test_auroc_on_constructed_scores() -> None:
    a, b = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([5.0, 6.0])
    assert ood.auroc(a, b) == 1.0  # positives all above
    assert ood.auroc(b, a) == 0.0
    assert ood.auroc(a, a.clone()) == 0.5
    # positive 1 beats 0, ties 1, loses to 2: 1.5; positive 3 beats all: 3 → 4.5 / 6
    assert ood.auroc(a, torch.tensor([1.0, 3.0])) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="both"):
        ood.auroc(a, torch.tensor([]))


def test_auroc_matches_pair_counting() -> None:
    gen = torch.Generator().manual_seed(1)
    neg = torch.randint(0, 6, (40,), generator=gen).double()
    pos = torch.randint(2, 8, (30,), generator=gen).double()
    pairs = [(p > n) + 0.5 * (p == n) for p, n in itertools.product(pos.tolist(), neg.tolist())]
    assert ood.auroc(neg, pos) == pytest.approx(sum(pairs) / len(pairs))


def test_entropy_of_known_distributions() -> None:
    uniform = torch.full((2, 4), math.log(0.25))
    assert torch.allclose(ood.entropy(uniform), torch.full((2,), math.log(4.0)))
    one_hot = torch.log(torch.tensor([[1.0, 0.0, 0.0]]))  # log 0 = −inf must give 0
    assert ood.entropy(one_hot).item() == 0.0


def test_shifted_inputs_are_rotations_permutations_and_noise() -> None:
    x = torch.rand(2, 3, 1, 5, 5, generator=torch.Generator().manual_seed(0))
    batches = [x[0], x[1]]
    shifted = ood.shifted_inputs(batches)
    assert set(shifted) == set(ood.SHIFTS)
    assert torch.equal(shifted["rotated"][0][0, 0], batches[0][0, 0].T.flip(0))
    for orig, perm in zip(batches, shifted["permuted"], strict=True):
        assert perm.shape == orig.shape and not torch.equal(perm, orig)
        assert torch.equal(perm.flatten(1).sort().values, orig.flatten(1).sort().values)
    noise = torch.cat(shifted["noise"])
    assert noise.shape == x.flatten(0, 1).shape
    assert x.min() <= noise.min() and noise.max() <= x.max()


# --------------------------------------------------------------------------- figures


def test_filter_colours_saturate_at_a_robust_limit() -> None:
    """A 28×28 filter with weights in [−1, 1] and three outliers of 1000: the colour limit
    stays at about 1, so the outliers saturate instead of washing the filter out."""
    f = np.linspace(-1.0, 1.0, 784)
    f[[0, 300, 600]] = 1000.0
    assert figures.robust_limit(f) == pytest.approx(np.quantile(np.abs(f), 0.99))
    assert 0.9 < figures.robust_limit(f) < 1.0


def test_mean_and_sd_band_of_constructed_curves() -> None:
    """Three curves whose per-epoch values are known: mean (2, 4, 6), sample sd (1, 2, 0)."""
    curves = [[1.0, 2.0, 6.0], [2.0, 4.0, 6.0], [3.0, 6.0, 6.0]]
    mean, sd = figures.mean_and_sd(curves)
    assert mean.tolist() == [2.0, 4.0, 6.0]
    assert sd.tolist() == pytest.approx([1.0, 2.0, 0.0])
    assert figures.mean_and_sd([[1.0, 5.0]])[1].tolist() == [0.0, 0.0]  # one seed: no band
    with pytest.raises(ValueError, match="equal"):
        figures.mean_and_sd([[1.0, 2.0], [1.0]])


def test_learning_curves_draw_one_colour_and_band_per_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rules over three seeds: two mean lines, two bands, one colour each."""
    drawn: list[Any] = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: drawn.append(fig))

    def rows(offset: float) -> list[dict[str, float]]:
        return [
            {"epoch": e, "test_accuracy": 0.5 + offset + 0.1 * e, "test_nll": 1.0 - offset}
            for e in (1, 2, 3)
        ]

    histories = {"sgd": [rows(0.0), rows(0.01), rows(0.02)], "affine": [rows(0.1)] * 3}
    figures.learning_curves(histories, tmp_path / "curves.png", "constructed")
    ax_acc = drawn[0].axes[0]
    lines = ax_acc.get_lines()
    assert [line.get_label() for line in lines] == ["sgd (3 seeds)", "affine (3 seeds)"]
    assert lines[0].get_color() != lines[1].get_color()
    assert lines[0].get_ydata().tolist() == pytest.approx([61.0, 71.0, 81.0])  # mean
    bands = ax_acc.collections
    assert len(bands) == 2
    assert bands[0].get_facecolor()[0][:3] == pytest.approx(
        matplotlib.colors.to_rgb(lines[0].get_color())
    )
    top = bands[0].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(81.0 + 1.0)  # mean + sd of (80, 81, 82)
    with pytest.raises(ValueError, match="different epochs"):
        figures.learning_curves({"sgd": [rows(0.0), rows(0.0)[:2]]}, tmp_path / "bad.png", "x")


# --------------------------------------------------------------------- seeds summary


def test_summarise_gives_mean_sd_and_values() -> None:
    runs = [
        {"acc": 0.5, "nested": {"nll": 1.0}, "name": "sgd", "ok": True},
        {"acc": 0.7, "nested": {"nll": 2.0}, "name": "sgd", "ok": True},
        {"acc": 0.9, "nested": {"nll": 6.0}, "name": "sgd", "ok": True},
    ]
    summary = compare.summarise(runs)
    assert summary["acc"]["mean"] == pytest.approx(0.7)
    assert summary["acc"]["sd"] == pytest.approx(0.2)  # sample standard deviation
    assert summary["acc"]["values"] == [0.5, 0.7, 0.9]
    assert summary["nested"]["nll"]["mean"] == pytest.approx(3.0)
    assert summary["nested"]["nll"]["sd"] == pytest.approx(statistics.stdev([1.0, 2.0, 6.0]))
    assert summary["name"] == "sgd" and summary["ok"] is True
    assert compare.summarise(runs[:1])["acc"] == {"mean": 0.5, "sd": None, "values": [0.5]}
    with pytest.raises(ValueError, match="differ"):
        compare.summarise([{"name": "sgd"}, {"name": "adam"}])


def test_ms_per_step_is_of_the_fastest_pass() -> None:
    """4 passes of 5 steps, the fastest pass 0.05 s: 10 ms per step; over two seeds
    (10 and 20 ms) the summary is 15 ± 7.07."""
    run = {"epochs": 4, "steps": 20, "fastest_pass_seconds": 0.05, "train_seconds": 1.0}
    assert compare.ms_per_step(run) == pytest.approx(10.0)
    slower = {**run, "fastest_pass_seconds": 0.1}
    summary = compare.step_ms({"per_seed": {"0": run, "1": slower}})
    assert summary["mean"] == pytest.approx(15.0)
    assert summary["sd"] == pytest.approx(statistics.stdev([10.0, 20.0]))


def test_seed_list_from_config_or_flag() -> None:
    assert config.seed_list({}) == [0]
    assert config.seed_list({"seed": 3}) == [3]
    assert config.seed_list({"seeds": [1, 2]}) == [1, 2]
    assert config.seed_list({"seeds": [1, 2]}, seeds=[7]) == [7]
    for bad in ({"seed": 1, "seeds": [1]}, {"seeds": []}, {"seeds": [1, 1]}, {"seeds": "0"}):
        with pytest.raises(ConfigError, match="seed"):
            config.seed_list(bad)


TINY = tiny_config(
    seeds=[0, 1],
    data={"shape": [1, 8, 8], "test_batch_size": 8},
    runs={
        "sgd": {"optimizer": {"name": "sgd", "lr": 0.05}},
        "mult": {"optimizer": {"name": "multiplicative", "lr": 1.0, "mc_samples": 2}},
    },
)


def test_compare_over_seeds_reports_mean_sd_and_per_seed(tmp_path: Path) -> None:
    results = compare.compare(copy.deepcopy(TINY), tmp_path)
    assert set(results) == {"sgd", "mult"}
    for label, res in results.items():
        assert res["seeds"] == [0, 1]
        per_seed = [res["per_seed"][s] for s in ("0", "1")]
        for seed, run in zip((0, 1), per_seed, strict=True):
            folder = tmp_path / label / f"seed{seed}"
            assert json.loads((folder / "config.json").read_text())["seed"] == seed
            assert json.loads((folder / "results.json").read_text()) == run
            assert (folder / "ood.png").exists() and (folder / "weights.png").exists()
        for get in (
            lambda r: r["point"]["nll"],
            lambda r: r["average"]["accuracy"],
            lambda r: r["sparsity"]["point"]["near_zero"],
            lambda r: r["ood"]["noise"]["average"],
        ):
            leaf, values = get(res["summary"]), [get(r) for r in per_seed]
            assert leaf["values"] == values
            assert leaf["mean"] == pytest.approx(statistics.fmean(values))
            assert leaf["sd"] == pytest.approx(statistics.stdev(values))
    # the seeds give different runs: the multiplicative rule's NLL differs between them
    assert len(set(results["mult"]["summary"]["point"]["nll"]["values"])) == 2
    assert json.loads((tmp_path / "results.json").read_text()) == results
    report = (tmp_path / "report.md").read_text()
    nll = results["mult"]["summary"]["point"]["nll"]
    assert f"{nll['mean']:.4f} ± {nll['sd']:.4f}" in report
    for seed in ("0", "1"):
        value = results["mult"]["per_seed"][seed]["point"]["nll"]
        assert f"| mult | at g | {seed} | " in report and f"{value:.4f}" in report
    assert "average †" in report and "](mult/seed0/filters_excitatory.png)" in report
    assert "| mult | multiplicative |" in report and "| 2 |" in report  # gradient evaluations
    for png in ("learning_curves.png", "weight_magnitudes.png"):
        assert (tmp_path / png).exists()


def test_compare_figures_name_the_data_and_the_seeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every figure's title names the data set and model (not the output folder) and the
    seeds drawn: the learning curves all of them, the weight histograms the one shown."""
    titles: dict[str, str] = {}

    def record(name: str) -> Any:
        def draw(*args: Any, **kwargs: Any) -> None:
            titles[name] = args[2]

        return draw

    monkeypatch.setattr(compare.figures, "learning_curves", record("curves"))
    monkeypatch.setattr(compare.figures, "weight_magnitudes", record("weights"))
    compare.compare(copy.deepcopy(TINY), tmp_path / "some_folder")
    assert titles["curves"] == "synthetic, mlp, seeds 0, 1"
    assert titles["weights"].startswith("synthetic, mlp: ")
    assert titles["weights"].endswith("seed 0 (of seeds 0, 1)")
    assert all("some_folder" not in title for title in titles.values())


def test_compare_seeds_flag_overrides_the_config(tmp_path: Path) -> None:
    raw = copy.deepcopy(TINY)
    raw["runs"] = {"sgd": raw["runs"]["sgd"]}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    assert compare.main([str(path), "--out", str(tmp_path / "out"), "--seeds", "5"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["sgd"]["seeds"] == [5]
    assert compare.main([str(path), "--out", str(tmp_path / "bad"), "--seeds", "a"]) == 2


def test_per_sample_noise_repeats_the_reference_draws() -> None:
    """The reference code's noise: the s-th training sample of every step reads the same ξ,
    different samples differ, and samples outside training are fresh."""
    from experiments.rules.log_g_walk import PerSampleNoise
    from liegroup_blr.distributions import Rayleigh

    source, key, base = PerSampleNoise(), torch.zeros(5), Rayleigh(1.0)
    source.bind(3)

    def draw(train: bool) -> torch.Tensor:
        source.start_sample(train)
        return source.draw([torch.empty(2, 5)], base, [key], 0, predict=not train)[0].clone()

    steps = []
    for _ in range(3):
        steps.append([draw(True) for _ in range(2)])
        source.end_step()
    for later in steps[1:]:
        for first, again in zip(steps[0], later, strict=True):
            assert torch.equal(first, again)
    assert not torch.equal(steps[0][0], steps[0][1])
    fresh = [draw(False) for _ in range(2)]
    assert not any(torch.equal(f, s) for f in fresh for s in steps[0])
    assert not torch.equal(fresh[0], fresh[1])


@pytest.mark.filterwarnings("ignore:MultiplicativeBLR. non-finite:RuntimeWarning")
def test_log_g_walk_runs_each_noise_and_reports_final_metrics(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A width-8 network at α = 50 skips steps under one-draw noise (a tiny frozen ξ needs a
    huge g): the skips are expected, the report must still come out."""
    from experiments.rules import log_g_walk

    pytest.importorskip("mlxtend")
    assert log_g_walk.main(["--widths", "8", "--passes", "1", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    for noise in log_g_walk.NOISES:
        assert out.count(f"| {noise} |") == 2  # one walk row (pass 1), one final row
    assert "accuracy g" in out and "nll avg" in out and "hoyer" in out


def test_a_command_with_options_instead_of_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    """:func:`cli.run` with ``options``: the runner takes the parsed options as keywords and
    ``show`` its results alone; a ValueError is one line and exit status 2."""

    def options(parser: Any) -> None:
        parser.add_argument("--width", type=int, default=3)

    def runner(width: int) -> dict[str, Any]:
        if width < 1:
            raise ValueError("--width must be >= 1")
        return {"width": width}

    def show(results: dict[str, Any]) -> None:
        print(f"shown {results}")

    assert cli.run("prog", None, runner, show, ["--width", "5"], options=options) == 0
    assert capsys.readouterr().out == "shown {'width': 5}\n"
    assert cli.run("prog", None, runner, show, [], options=options) == 0
    assert capsys.readouterr().out == "shown {'width': 3}\n"
    assert cli.run("prog", None, runner, show, ["--width", "0"], options=options) == 2
    assert capsys.readouterr().err == "error: --width must be >= 1\n"
    with pytest.raises(SystemExit):  # no config, --out or --resume
        cli.run("prog", None, runner, show, ["config.toml"], options=options)


def test_log_g_walk_refuses_no_passes_before_it_trains(capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.rules import log_g_walk

    assert log_g_walk.main(["--passes", "0"]) == 2
    assert capsys.readouterr().err == "error: --passes and --samples must be >= 1\n"
