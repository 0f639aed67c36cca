"""Figures that stand alone: each names its run (config, rule, seed), every mark is in its
legend, colour that carries a value has a colour bar, and series that coincide stay apart
(issue 32). The saved figures' artists are inspected."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.collections import PolyCollection

from experiments.common import figures
from experiments.common import training as train
from experiments.continual import report as continual_report
from experiments.runs import compare
from tests.drivers.test_experiments import tiny_config


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """file name → the figure that would have been saved there."""
    saved: dict[str, Any] = {}

    def keep(fig: Any, path: Path) -> None:
        saved[path.name] = fig

    monkeypatch.setattr(figures, "_save", keep)
    yield saved
    matplotlib.pyplot.close("all")


def legend_labels(ax: Any) -> list[str]:
    legend = ax.get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def hatched(ax: Any, hatch: str) -> list[Any]:
    return [p for p in ax.patches if p.get_hatch() == hatch]


def test_reliability_diagram_puts_every_mark_in_its_legend(drawn: dict[str, Any]) -> None:
    """Bins over-, under- and exactly calibrated: the red hatched gaps rise above the bars
    where the confidence is higher, the black ones lie over them where it is lower."""
    hist = {
        "edges": torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]),
        "count": torch.tensor([0, 4, 5, 6]),
        "accuracy": torch.tensor([0.0, 0.25, 0.8, 0.875]),
        "confidence": torch.tensor([0.0, 0.4, 0.6, 0.875]),
    }
    figures.reliability_diagram({"at g": hist, "average": hist}, Path("r.png"), "cfg: rule")
    fig = drawn["r.png"]
    assert fig._suptitle.get_text() == "cfg: rule"
    (legend,) = fig.legends  # one for both panels, below them
    assert [t.get_text() for t in legend.get_texts()] == [
        "accuracy",
        "gap up to mean confidence (overconfident)",
        "gap down to it (underconfident)",
        "perfect calibration",
    ]
    handles = legend.legend_handles
    assert [h.get_hatch() for h in handles[:3]] == [None, "//", "\\\\"]
    for ax in fig.axes:
        (over,), (under,) = hatched(ax, "//"), hatched(ax, "\\\\")
        assert (over.get_x(), over.get_y(), over.get_height()) == pytest.approx((0.25, 0.25, 0.15))
        assert (under.get_x(), under.get_y(), under.get_height()) == pytest.approx((0.5, 0.6, 0.2))
        assert len(ax.patches) == 3 + 2  # three filled bins, one gap each way


@pytest.mark.parametrize(
    ("channels", "signed", "cmap", "limits"),
    [(1, True, "RdBu_r", (-1.0, 1.0)), (1, False, "gray", (0.0, 1.0)), (3, True, "gray", (-1, 1))],
)
def test_filter_grid_has_a_colour_bar_of_its_scale(
    channels: int, signed: bool, cmap: str, limits: tuple[float, float], drawn: dict[str, Any]
) -> None:
    filters = torch.randn(5, channels, 4, 4, generator=torch.Generator().manual_seed(0))
    figures.filter_grid(filters.abs() if not signed else filters, Path("f.png"), "t", signed)
    fig = drawn["f.png"]
    assert fig._suptitle.get_text() == "t"
    bar = fig.axes[-1]  # the colour bar's axes, after the 4 × 8 grid
    assert len(fig.axes) == figures.FILTER_ROWS * figures.FILTER_COLS + 1
    assert "99th percentile of |w|" in bar.get_ylabel()
    mappable = bar._colorbar.mappable
    assert mappable.get_cmap().name == cmap
    assert (mappable.norm.vmin, mappable.norm.vmax) == pytest.approx(limits)
    if channels == 1:  # each panel's image uses the bar's map, scaled to its own limit
        image = fig.axes[0].images[0]
        assert image.get_cmap().name == cmap
        assert image.norm.vmax == pytest.approx(figures.robust_limit(filters[0].abs().numpy()))


def test_weight_magnitudes_are_small_multiples_that_coincide_readably(
    drawn: dict[str, Any],
) -> None:
    """Four of five layers equal: one panel each, its own outline in colour over the others
    in grey, so no rule hides under another."""
    same = torch.randn(200, generator=torch.Generator().manual_seed(1))
    weights = {name: same.clone() for name in ("sgd", "additive", "affine", "ivon")}
    weights["multiplicative"] = 10 * same
    figures.weight_magnitudes(weights, Path("w.png"), "cfg: weights, seed 0", 1e-3)
    fig = drawn["w.png"]
    assert fig._suptitle.get_text() == "cfg: weights, seed 0"
    assert len(fig.axes) == 5
    assert tuple(fig.get_size_inches()) == pytest.approx(figures.histogram_size(5))
    for ax, name in zip(fig.axes, weights, strict=True):
        assert legend_labels(ax) == ["the others", name, "near-zero threshold"]
        outlines = [p for p in ax.patches if p.get_label() == name]
        assert len(outlines) == 1 and outlines[0].get_edgecolor()[:3] != (0.7, 0.7, 0.7)
        assert len(ax.patches) == 5  # its own and the four others'


def test_learning_curves_of_coinciding_rules_differ_in_style(drawn: dict[str, Any]) -> None:
    rows = [{"epoch": e, "test_accuracy": 0.5, "test_nll": 1.0} for e in range(1, 27)]
    histories = {name: [rows, rows] for name in ("sgd", "additive", "multiplicative")}
    figures.learning_curves(histories, Path("c.png"), "cpu_default, seeds 0, 1")
    fig = drawn["c.png"]
    assert fig._suptitle.get_text().startswith("cpu_default, seeds 0, 1: mean over the seeds")
    for ax in fig.axes:
        lines = ax.get_lines()
        styles = {(line.get_linestyle(), line.get_marker()) for line in lines}
        assert len(lines) == len(styles) == 3  # the same numbers, three distinct lines
    assert legend_labels(fig.axes[0]) == [f"{n} (2 seeds)" for n in histories]
    assert all(isinstance(band, PolyCollection) for band in fig.axes[0].collections)


def test_learning_curves_show_the_training_loss_on_a_log_scale_where_rows_hold_it(
    drawn: dict[str, Any],
) -> None:
    rows = [
        {"epoch": e, "test_accuracy": 0.5, "test_nll": 1.0, "train_loss": 2.0**-e}
        for e in range(1, 5)
    ]
    figures.learning_curves({"sgd": [rows]}, Path("t.png"), "cnn, seed 0")
    fig = drawn["t.png"]
    assert len(fig.axes) == 3
    loss = fig.axes[2]
    assert loss.get_yscale() == "log" and "training loss" in loss.get_ylabel()
    assert loss.get_lines()[0].get_ydata().tolist() == [0.5, 0.25, 0.125, 0.0625]


def test_entropy_histograms_name_the_run_and_differ_in_style(drawn: dict[str, Any]) -> None:
    entropy = torch.rand(50, generator=torch.Generator().manual_seed(2))
    sets = {"test inputs": entropy, "rotated": entropy, "noise": entropy}
    figures.entropy_histograms({"at g": sets}, Path("o.png"), "cfg: sgd, seed 3")
    fig = drawn["o.png"]
    assert fig._suptitle.get_text() == "cfg: sgd, seed 3"
    (ax,) = fig.axes
    assert legend_labels(ax) == list(sets)
    assert len({p.get_linestyle() for p in ax.patches}) == 3


def test_every_figure_of_a_run_names_its_data_rule_and_seed(
    tmp_path: Path, drawn: dict[str, Any]
) -> None:
    cfg = {**tiny_config(optimizer="multiplicative"), "seed": 3}
    train.train(cfg, tmp_path / "tiny_cfg")
    assert set(drawn) == {
        "reliability.png",
        "ood.png",
        "weights.png",
        "filters.png",
        "filters_excitatory.png",
        "filters_inhibitory.png",
    }
    for name, fig in drawn.items():
        title = fig._suptitle.get_text()
        assert title.startswith("synthetic, mlp: multiplicative, seed 3: "), name


def test_every_figure_of_a_comparison_names_it(tmp_path: Path, drawn: dict[str, Any]) -> None:
    raw = tiny_config(schedule={"epochs": 1, "warmup": 0})
    del raw["optimizer"], raw["seed"]
    raw["seeds"] = [4]
    raw["runs"] = {"plain": {"optimizer": {"name": "sgd", "lr": 0.05}}}
    raw["runs"]["gauss"] = {"optimizer": {"name": "affine", "lr": 0.5, "scale_lr": 0.05}}
    compare.compare(copy.deepcopy(raw), tmp_path / "my_config")
    titles = {name: fig._suptitle.get_text() for name, fig in drawn.items()}
    assert titles["learning_curves.png"].startswith("synthetic, mlp, seed 4: ")
    weights = "synthetic, mlp: first-layer weight magnitudes at g, seed 4 (of seed 4)"
    assert titles["weight_magnitudes.png"] == weights
    assert titles["reliability.png"].startswith("synthetic, mlp: gauss (affine), seed 4: ")
    assert not any("my_config" in title for title in titles.values())


def test_final_accuracy_starts_at_zero_and_draws_diverged_seeds(drawn: dict[str, Any]) -> None:
    """A method that diverged on every seed keeps its row, with a cross at 0 per seed; one
    with a diverged seed has a dot per seed that trained and a cross for the other."""
    results = {
        "sgd": {"point": {"final_accuracy": {"values": [0.19, 0.2, 0.21]}}},
        "affine": {"point": {}, "average": {"final_accuracy": {"values": [0.8, 0.82]}}},
        "lost": {},
    }
    diverged = {"sgd": [], "affine": [2], "lost": [0, 1, 2]}
    continual_report.final_accuracy_figure(results, 32, Path("a.png"), "t", [0, 1, 2], diverged)
    (ax,) = drawn["a.png"].axes
    assert ax.get_xlim() == (0.0, 100.0)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [  # in words (continual_report.label_words)
        "SGD",
        "affine, posterior as prior (average of 32; seed 2 diverged)",
        "lost (diverged on every seed)",
    ]
    dots = [line for line in ax.get_lines() if line.get_marker() == "o"]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert [list(d.get_xdata()) for d in dots] == [pytest.approx([19, 20, 21]), [80, 82]]
    assert [list(c.get_xdata()) for c in crosses] == [[], [0.0], [0.0] * 3]
    (legend,) = drawn["a.png"].legends
    assert "a diverged seed" in [t.get_text() for t in legend.get_texts()]


def test_average_accuracy_axis_runs_from_zero(drawn: dict[str, Any]) -> None:
    curve = {
        "mean": np.array([90.0, 80.0]),
        "low": np.array([89.0, 79.0]),
        "high": np.array([91.0, 81.0]),
    }
    figures.average_accuracy({"": {"sgd": curve}}, Path("c.png"), "permuted mnist5k")
    (ax,) = drawn["c.png"].axes
    assert ax.get_ylim() == (0.0, 100.0)


@pytest.mark.parametrize(
    ("label", "words"),
    [
        ("affine", "affine, posterior as prior"),
        ("affine_no_prior", "affine, prior removed"),
        ("affine_kprior_lambda", "affine, K-prior, λ points"),
        ("additive_fromp_lambda", "additive, FROMP, λ points"),
        ("multiplicative_replay_random", "multiplicative, replay, random points"),
        ("affine_kprior_score", "affine, K-prior, memory-map score points"),
        ("affine_kprior_delta_lambda", "affine, K-prior, δ-prior at the previous mean, λ points"),
        ("affine_delta", "affine, δ-prior at the previous mean"),
        ("affine_fromp_logits_lambda", "affine, FROMP on the logits, λ points"),
        ("affine_fromp_probabilities", "affine, FROMP, on the probabilities"),
        ("affine_posterior_kprior_random", "affine, posterior as prior, K-prior, random points"),
        ("ewc_fromp_logits_lambda", "EWC + FROMP on the logits, λ points"),
        ("finetune", "fine-tuning"),
        ("ewc", "EWC"),
        ("ewc_replay_random", "EWC + replay, random points"),
        ("joint", "joint"),
        ("fromp_adam", "FROMP, Adam"),
        ("affine_mystery_part", "affine, mystery, part"),  # unknown parts read as themselves
    ],
)
def test_a_methods_label_reads_as_words_from_its_parts(label: str, words: str) -> None:
    assert continual_report.label_words(label) == words


def test_a_rules_panel_leaves_the_rules_name_out() -> None:
    assert continual_report.label_words("affine_kprior_lambda", rule=False) == "K-prior, λ points"
    assert continual_report.label_words("affine", rule=False) == "posterior as prior"


def _stream(values: dict[str, list[list[float]]], averaged: bool) -> dict[str, Any]:
    """A continual summary: per method its average accuracy per task, one list of seeds'
    values each; ``averaged``: the rules have a model average too."""
    summary: dict[str, Any] = {}
    for method, per_task in values.items():
        leaves = [{"values": v} for v in per_task]
        summary[method] = {"point": {"average_accuracy": leaves}}
        if averaged and continual_report.rule_of(method):
            summary[method]["average"] = {"average_accuracy": leaves}
    return summary


def _shared(ax: Any) -> list[str]:
    return [line.get_gid() for line in ax.get_lines() if (line.get_gid() or "").startswith("s")]


def test_the_average_accuracy_has_a_panel_per_rule_and_the_baselines_in_each(
    drawn: dict[str, Any],
) -> None:
    """Two rules, two baselines: a column per rule with its own rows in colour (in words,
    without the rule's name), the baselines in grey in both and named once in the figure's
    legend; one y axis; the band is the mean ± sd over the seeds."""
    task = [[0.8, 0.9, 1.0], [0.5, 0.6, 0.7]]  # mean 90 and 60, sd 10
    summary = _stream(
        {
            "finetune": task,
            "affine": task,
            "ewc": task,
            "affine_no_prior": task,
            "additive": task,
            "additive_kprior_lambda": task,
        },
        averaged=True,
    )
    continual_report.average_accuracy_figure(summary, 32, Path("a.png"), "permuted", [0, 1, 2])
    fig = drawn["a.png"]
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [
        "affine rule (model average of 32)",
        "additive rule (model average of 32)",
    ]  # fewer than ZOOM_CLUSTER curves end near the top: no zoomed row
    for ax in axes:
        assert _shared(ax) == ["shared:fine-tuning", "shared:EWC"]
        assert all(
            matplotlib.colors.to_hex(line.get_color()) in {"#262626", "#737373"}
            for line in ax.get_lines()
            if line.get_gid()
        )
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])
    assert axes[0].get_ylim() == axes[1].get_ylim() == (0.0, 100.0)
    assert legend_labels(axes[0]) == ["posterior as prior", "prior removed"]
    assert legend_labels(axes[1]) == ["posterior as prior", "K-prior, λ points"]
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[:2] == ["fine-tuning", "EWC"] and "band: mean ± sd over seeds" in texts
    (band, *_) = [c for c in axes[0].collections if isinstance(c, PolyCollection)]
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(50.0) and max(ys) == pytest.approx(100.0)


def test_a_stream_without_rules_is_one_panel_in_words(drawn: dict[str, Any]) -> None:
    task = [[0.8, 0.9], [0.7, 0.8]]
    summary = _stream({"finetune": task, "ewc_replay_random": task}, averaged=False)
    continual_report.average_accuracy_figure(summary, 32, Path("a.png"))
    (ax,) = drawn["a.png"].axes
    assert legend_labels(ax) == ["fine-tuning", "EWC + replay, random points"]
    assert _shared(ax) == []


def test_the_average_accuracy_zooms_on_the_top_when_curves_crowd_there(
    drawn: dict[str, Any],
) -> None:
    """Four curves end within the top 15 points below the highest (94 → 95): a second row
    of the same panels spans 80 to 95; a diverged seed is named in its row."""
    ends = {"affine": 0.94, "affine_kprior_lambda": 0.92, "ewc": 0.90, "joint": 0.93}
    summary = _stream({m: [[0.9, 0.9], [e, e]] for m, e in ends.items()}, averaged=False)
    summary["finetune"] = {"point": {"average_accuracy": [{"values": [0.5]}] * 2}}
    continual_report.average_accuracy_figure(
        summary, 32, Path("z.png"), seeds=[0, 1, 2], diverged={"affine_kprior_lambda": [2]}
    )
    top, zoom = drawn["z.png"].axes
    assert top.get_ylim() == (0.0, 100.0) and zoom.get_ylim() == pytest.approx((80.0, 95.0))
    assert _shared(zoom) == ["shared:EWC", "shared:joint", "shared:fine-tuning"]
    assert "K-prior, λ points (seed 2 diverged)" in legend_labels(zoom)


def test_reliability_diagram_writes_each_bins_count(drawn: dict[str, Any]) -> None:
    hist = {
        "edges": torch.tensor([0.0, 0.5, 1.0]),
        "count": torch.tensor([0, 7]),
        "accuracy": torch.tensor([0.0, 0.75]),
        "confidence": torch.tensor([0.0, 0.7]),
    }
    figures.reliability_diagram({"at g": hist}, Path("r.png"), "mnist5k: rule")
    (ax,) = drawn["r.png"].axes
    (text,) = ax.texts
    assert text.get_text() == "7" and text.get_position() == pytest.approx((0.75, 0.75))


def test_the_lifelong_figures_come_from_the_docs_summaries(
    tmp_path: Path, drawn: dict[str, Any]
) -> None:
    """Every method of the committed permuted summary has a row, the diverged ones too."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "results" / "continual_permuted.json"
    summary = json.loads(docs.read_text())
    cfg = {
        "stream": {"name": "permuted", "dataset": "mnist5k", "tasks": 10},
        "train": {"epochs": 10},
        "model": {"widths": [100, 100]},
        "eval": {"samples": 32},
    }
    continual_report.docs_figures(summary, cfg, tmp_path)
    (ax,) = drawn["final_accuracy.png"].axes
    assert len(ax.get_yticklabels()) == len(summary["labels"])
    assert (
        ax.get_title().startswith("permuted mnist5k, 10 tasks")
        and "seeds 0, 1, 2" in ax.get_title()
    )


def test_learning_curves_scale_to_the_later_epochs_and_name_those_outside(
    drawn: dict[str, Any],
) -> None:
    """First epochs far above the rest (NLL 3 and 0.5 against 0.26–0.33) would flatten the
    region where the runs differ: the panel covers the epochs after the first quarter and
    says which lie above it."""
    nll = [3.0, 0.5, 0.33, 0.31, 0.30, 0.28, 0.27, 0.26]
    rows = [{"epoch": e, "test_accuracy": 0.9, "test_nll": v} for e, v in enumerate(nll, 1)]
    figures.learning_curves({"sgd": [rows]}, Path("c.png"), "cfg, seed 0")
    accuracy, panel = drawn["c.png"].axes
    low, high = panel.get_ylim()
    assert low < 0.26 and 0.33 < high < 0.4  # the later epochs fill the panel
    assert [t.get_text() for t in panel.texts] == ["curves above the panel at epochs 1, 2"]
    assert list(accuracy.texts) == []  # a flat curve: nothing to focus on


def test_learning_curves_keep_the_whole_range_when_no_epoch_stands_apart(
    drawn: dict[str, Any],
) -> None:
    nll = np.linspace(1.0, 0.5, 8)
    rows = [{"epoch": e, "test_accuracy": 0.9, "test_nll": v} for e, v in enumerate(nll, 1)]
    figures.learning_curves({"sgd": [rows]}, Path("c.png"), "cfg, seed 0")
    panel = drawn["c.png"].axes[1]
    low, high = panel.get_ylim()
    assert low <= 0.5 and high >= 1.0 and list(panel.texts) == []


def test_error_variance_map_labels_its_log_ticks_in_one_plain_format(
    drawn: dict[str, Any],
) -> None:
    """Variances within one decade (7.5–16) get minor tick labels: 8, 9, 10, not 8×10⁰, 10¹."""
    n = 40
    error, variance = np.geomspace(0.06, 2.0, n), np.geomspace(7.5, 16.0, n)
    regions = np.arange(n) % 3
    figures.error_variance_map(
        error, variance, np.ones(n), regions, (1.0, 12.0), Path("m.png"), "digits, seed 0"
    )
    ax = drawn["m.png"].axes[0]
    drawn["m.png"].canvas.draw()

    def shown(labels: list[Any], limits: tuple[float, float], along: int) -> list[str]:
        inside = [t for t in labels if limits[0] <= t.get_position()[along] <= limits[1]]
        return sorted((t.get_text() for t in inside if t.get_text()), key=float)

    ticks = ax.get_yticklabels() + ax.get_yticklabels(minor=True)
    assert shown(ticks, ax.get_ylim(), 1) == ["8", "9", "10"]
    ticks = ax.get_xticklabels() + ax.get_xticklabels(minor=True)
    assert shown(ticks, ax.get_xlim(), 0) == ["0.1", "1"]


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """file name → the figure a driver saved there with ``Figure.savefig`` (not written)."""
    out: dict[str, Any] = {}

    def keep(fig: Any, path: Path, **_: Any) -> None:
        out[Path(path).name] = fig

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    yield out
    matplotlib.pyplot.close("all")


def _retrain_rows() -> list[dict[str, Any]]:
    """The retraining rows of three examples, two classes: a control, the same retraining
    again and a removal of each."""
    logits = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]
    moved = [[1.2, 0.0], [0.0, 1.3], [0.5, 0.9]]
    run = {"objective": [1.0, 0.1, 0.01], "iterations": 20}
    rows = [
        {
            "kind": "control",
            "examples": [0, 1, 2],
            "start": moved,
            "logits": logits,
            "previous": logits,
            **run,
        },
        {"kind": "again", "logits": [[v + 1e-5 for v in r] for r in logits], **run},
    ]
    rows += [
        {"kind": "removed", "index": i, "logits": m, "previous": m, **run}
        for i, m in enumerate(moved)
    ]
    return rows


def test_the_converged_figure_names_the_removals_and_the_floors_axis(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    """The removals' curves have a legend entry beside the control's, and the floor and the
    drift points, whose x is not the truth, have an axis label of their own."""
    from experiments.memory import converged as memory_converged

    estimates = {"logits": torch.tensor([0.2, 0.3, 0.4]), "probabilities": torch.tensor([0.1] * 3)}
    memory_converged.figure(estimates, _retrain_rows(), tmp_path / "c.png", "digits, seed 0")
    settle, *scatters = saved["c.png"].axes[:3]
    assert legend_labels(settle) == [
        "control (nothing removed)",
        memory_converged.REMOVALS_LABEL,
    ]
    for ax in scatters:
        (top,) = ax.child_axes
        assert top.get_xlabel().startswith("floor (red ×) and drift (grey +)")
        assert "true change" in ax.get_xlabel()


def _loo_results() -> dict[str, Any]:
    """Two seeds, three δ, every criterion the same NLL at the largest δ (as on the digits
    at δ = 256), the corrected estimate undefined at the smallest."""

    def summary(delta: float, loo: float | None) -> dict[str, Any]:
        v = 2.0 if delta == 256 else 1.0 / (1 + delta)
        nll = {"nll": v}
        return {
            "loo": {"corrected": loo, "first_order": v},
            "train": v,
            "validation": {"point": nll, "average": nll},
            "test": {"point": nll, "average": nll},
        }

    seed = {
        "delta1": summary(1.0, None),
        "delta16": summary(16.0, 0.2),
        "delta256": summary(256.0, 2.0),
    }
    return {"affine": {"per_seed": {"seed0": seed, "seed1": copy.deepcopy(seed)}}}


def test_no_line_of_the_loo_figure_hides_another(saved: dict[str, Any], tmp_path: Path) -> None:
    """Every criterion has its own marker and its own (marker, line style), and at one δ
    the criteria are drawn at distinct x: where their values coincide none covers another."""
    from experiments.memory import loo as memory_loo

    memory_loo.figure(_loo_results(), tmp_path / "m.png", "digits, mlp")
    (ax,) = saved["m.png"].axes
    lines = {c.get_label(): c.lines[0] for c in ax.containers}
    assert list(lines) == list(memory_loo.STYLES)  # the criteria the summaries hold
    markers = [line.get_marker() for line in lines.values()]
    assert len(set(markers)) == len(markers)
    styles = {(line.get_marker(), str(line.get_linestyle())) for line in lines.values()}
    assert len(styles) == len(lines)
    at_256 = [float(line.get_xdata()[-1]) for line in lines.values()]
    assert len(set(at_256)) == len(at_256)
    assert all(abs(np.log10(x / 256)) < 0.15 for x in at_256)  # still read as δ = 256
    assert legend_labels(ax) == list(memory_loo.STYLES)


def test_criteria_beyond_the_named_styles_still_get_a_marker_each() -> None:
    from experiments.memory import loo as memory_loo

    names = [*memory_loo.STYLES, *(f"loo source{k}" for k in range(10))]
    chosen = memory_loo.styles(names)
    markers = [marker for _, _, marker in chosen.values()]
    assert len(set(markers)) == len(names) and "*" not in markers  # ★ marks the picks


def test_the_loo_figure_comes_from_the_docs_summary(saved: dict[str, Any], tmp_path: Path) -> None:
    """The committed summary's per-seed values give back the summaries the figure reads: the
    corrected estimate undefined (None) at the small δ, the picks those of the summary."""
    from experiments.memory import loo as memory_loo

    docs = Path(__file__).resolve().parents[2] / "docs" / "results" / "memory_digits_loo.json"
    summary = json.loads(docs.read_text())
    results = memory_loo.results_from_docs(summary)
    per_seed = results["affine"]["per_seed"]
    assert list(per_seed) == ["seed0", "seed1", "seed2"]
    metrics = summary["labels"]["affine"]["metrics"]
    for i, seed in enumerate(per_seed.values()):
        assert seed["delta0.01"]["loo"]["corrected"] is None
        chosen = {c: memory_loo.value(seed["delta1"], c) for c in memory_loo.STYLES}
        assert all(not np.isnan(v) for c, v in chosen.items() if c != "loo corrected")
        for criterion in memory_loo.STYLES:
            best = min(
                (d for d in seed if not np.isnan(memory_loo.value(seed[d], criterion))),
                key=lambda d, c=criterion: memory_loo.value(seed[d], c),
            )
            picked = metrics[f"picks.{criterion}"]["values"][i]
            assert float(best.removeprefix("delta")) == picked
    memory_loo.docs_figure(summary, tmp_path / "m.png")
    assert saved["m.png"].axes[0].get_title().startswith("digits, mlp, affine rule")
