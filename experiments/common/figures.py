"""PNG figures (matplotlib, Agg backend) with fixed pixel sizes: figure size × DPI."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from torch import Tensor

from liegroup_blr.memory_maps import REGIONS

DPI = 100
RELIABILITY_SIZE = (10.0, 5.0)  # inches: 1000 × 500 pixels
FILTERS_SIZE = (8.0, 4.5)  # 800 × 450 pixels
CURVES_SIZE = (10.0, 4.0)  # 1000 × 400 pixels
HISTOGRAM_WIDTH, HISTOGRAM_PANEL = 8.0, 1.5  # inches: 800 pixels wide, 150 high per panel
MEMORY_MAP_SIZE = (13.0, 7.0)  # 1300 × 700 pixels
SCATTER_SIZE = (10.0, 4.5)  # 1000 × 450 pixels
ERROR_VARIANCE_SIZE = (8.0, 7.0)  # 800 × 700 pixels
MEMORY_ROWS, MEMORY_COLS = 2, 8  # digits shown per block (most and least sensitive)
FILTER_ROWS, FILTER_COLS = 4, 8
ROBUST_QUANTILE = 0.99
STYLES: list[tuple[Any, str]] = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
STYLES += [((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "P"), ((0, (8, 2)), "X")]
"""Line styles (dash patterns) and markers of the series of one plot, in order: series that
overlap stay apart."""


def _save(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def reliability_diagram(panels: Mapping[str, Mapping[str, Tensor]], path: Path, title: str) -> None:
    """One panel per entry of ``panels``: panel title → output of
    ``predictive.reliability_bins``; ``title`` names the run.

    Bars: accuracy per confidence bin; a hatched bar spans the gap to the bin's mean
    confidence, red above the accuracy (overconfident), black over the bar below it
    (underconfident); the diagonal is perfect calibration; over each bin, its number of
    examples.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=RELIABILITY_SIZE, squeeze=False)
    accuracy: dict[str, Any] = {"color": "tab:blue", "linewidth": 0}
    over: dict[str, Any] = {
        "facecolor": "tab:red",
        "alpha": 0.35,
        "hatch": "//",
        "edgecolor": "tab:red",
    }
    under: dict[str, Any] = {"facecolor": "none", "hatch": "\\\\", "edgecolor": "k", "linewidth": 0}
    legend = [  # every mark, also one a panel happens not to draw
        Patch(**accuracy, label="accuracy"),
        Patch(**over, label="gap up to mean confidence (overconfident)"),
        Patch(**{**under, "facecolor": "tab:blue"}, label="gap down to it (underconfident)"),
        Line2D([], [], color="k", ls="--", lw=1, label="perfect calibration"),
    ]
    for ax, (name, hist) in zip(axes[0], panels.items(), strict=True):
        edges = hist["edges"].numpy()
        filled = hist["count"].numpy() > 0
        acc, conf = hist["accuracy"].numpy()[filled], hist["confidence"].numpy()[filled]
        left, width = edges[:-1][filled], np.diff(edges)[filled]
        ax.bar(left, acc, width, align="edge", **accuracy)
        up, down = conf > acc, conf < acc
        ax.bar(left[up], (conf - acc)[up], width[up], acc[up], align="edge", lw=0, **over)
        ax.bar(left[down], (acc - conf)[down], width[down], conf[down], align="edge", **under)
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        counts = hist["count"].numpy()[filled]
        for x, top, n in zip(left + width / 2, np.maximum(acc, conf), counts, strict=True):
            ax.text(x, top, f"{int(n)}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set(xlim=(0, 1), ylim=(0, 1.1), ylabel="accuracy", title=name)
        ax.set_xlabel("confidence (over each bin: its number of examples)")
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0.0, 0.06, 1.0, 1.0))
    _save(fig, path)


def robust_limit(values: np.ndarray, quantile: float = ROBUST_QUANTILE) -> float:
    """The ``quantile`` of |values|: a colour limit that a few outliers cannot stretch."""
    return max(float(np.quantile(np.abs(values), quantile)), 1e-12)


def _filter_image(f: np.ndarray, signed: bool) -> tuple[np.ndarray, dict[str, object]]:
    """An (H, W) or (H, W, 3) image of one filter ``(C, H, W)`` with its own robust limits.

    Colours saturate at the filter's 99th percentile of |w|, so a few large weights do not
    turn the rest of the filter into uniform background.
    """
    if f.shape[0] == 3:
        limit = robust_limit(f)
        return (np.clip(f / limit, -1.0, 1.0) + 1.0).transpose(1, 2, 0) / 2.0, {}
    img = f.mean(axis=0)
    limit = robust_limit(img)
    if signed:
        return img, {"cmap": "RdBu_r", "vmin": -limit, "vmax": limit}
    return img, {"cmap": "gray", "vmin": 0.0, "vmax": limit}


def filter_grid(filters: Tensor, path: Path, title: str, signed: bool = True) -> None:
    """Up to 32 filters ``(F, C, H, W)`` in a 4 × 8 grid, each with its own robust limits,
    and a colour bar of the scale they share.

    ``signed`` filters use a blue (negative) to red (positive) map symmetric about 0;
    unsigned ones (g⁺, g⁻) go from black (0) to white; RGB filters show each channel from
    dark (negative) to bright (positive). Each filter's colours saturate at its 99th
    percentile of |w| (:func:`robust_limit`), the ±1 of the colour bar.
    """
    fig, axes = plt.subplots(FILTER_ROWS, FILTER_COLS, figsize=FILTERS_SIZE)
    array = filters.detach().cpu().double().numpy()
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i < len(array):
            img, style = _filter_image(array[i], signed)
            ax.imshow(img, interpolation="nearest", **style)
    fig.suptitle(title)
    fig.subplots_adjust(left=0.01, right=0.84, bottom=0.01, top=0.9, wspace=0.05, hspace=0.05)
    rgb, low = array.shape[1] == 3, -1.0 if signed or array.shape[1] == 3 else 0.0
    scale = ScalarMappable(Normalize(low, 1.0), "gray" if rgb or not signed else "RdBu_r")
    bar = fig.colorbar(scale, cax=fig.add_axes((0.86, 0.05, 0.02, 0.8)))
    what = "each channel's w" if rgb else "w" if signed else "value"
    bar.set_label(f"{what} / the filter's\n99th percentile of |w|", fontsize=8)
    _save(fig, path)


def histogram_size(panels: int) -> tuple[float, float]:
    """Inches of :func:`weight_magnitudes` with ``panels`` panels."""
    return HISTOGRAM_WIDTH, HISTOGRAM_PANEL * panels + 1.0


def weight_magnitudes(
    weights: Mapping[str, Tensor], path: Path, title: str, near_zero: float | None = None
) -> None:
    """Histograms of log₁₀|w| of a layer, one panel per entry of ``weights`` (label → tensor)
    with the other entries in grey behind it (small multiples: histograms that coincide stay
    readable); ``near_zero`` marks the near-zero threshold as a dashed line."""
    logs = {
        label: np.log10(np.maximum(w.detach().abs().double().flatten().cpu().numpy(), 1e-12))
        for label, w in weights.items()
    }
    edges = np.linspace(
        min(v.min() for v in logs.values()), max(v.max() for v in logs.values()), 121
    )
    size = histogram_size(len(logs))
    fig, axes = plt.subplots(len(logs), 1, figsize=size, sharex=True, sharey=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, (label, values)) in enumerate(zip(axes[:, 0], logs.items(), strict=True)):
        others = [v for other, v in logs.items() if other != label]
        for j, v in enumerate(others):
            name = "the others" if j == 0 else None
            ax.hist(v, bins=edges, histtype="step", lw=0.8, color="0.7", density=True, label=name)
        colour = colours[i % len(colours)]
        ax.hist(
            values, bins=edges, histtype="step", lw=1.5, color=colour, density=True, label=label
        )
        if near_zero is not None:
            threshold = math.log10(near_zero)
            ax.axvline(threshold, color="k", ls="--", lw=1, label="near-zero threshold")
        ax.set_ylabel("density")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("log₁₀ |w|")
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)


def entropy_histograms(panels: Mapping[str, Mapping[str, Tensor]], path: Path, title: str) -> None:
    """One panel per entry of ``panels`` (panel title → {input set → predictive entropies}):
    a histogram of the predictive entropy per input set, each in its own colour and line
    style; ``title`` names the run."""
    fig, axes = plt.subplots(1, len(panels), figsize=RELIABILITY_SIZE, squeeze=False)
    for ax, (name, sets) in zip(axes[0], panels.items(), strict=True):
        top = max(float(e.max()) for e in sets.values())
        edges = np.linspace(0.0, max(top, 1e-6), 41)
        for (label, entropy), (dashes, _) in zip(sets.items(), STYLES, strict=False):
            values = entropy.cpu().numpy()
            ax.hist(values, bins=edges, histtype="step", lw=1.5, ls=dashes, label=label)
        ax.set(xlabel="predictive entropy (nats)", ylabel="inputs", title=name)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)


def mean_and_sd(curves: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Point-by-point mean and sample standard deviation (n − 1) of curves of equal length;
    the standard deviation of a single curve is 0."""
    lengths = {len(c) for c in curves}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"expected curves of equal, non-zero length, got lengths {lengths}")
    array = np.asarray(curves, dtype=float)
    sd = array.std(axis=0, ddof=1) if len(array) > 1 else np.zeros(array.shape[1])
    return array.mean(axis=0), sd


def curves_size(panels: int) -> tuple[float, float]:
    """The size of a row of ``panels`` learning-curve panels (two: :data:`CURVES_SIZE`)."""
    return CURVES_SIZE[0] * panels / 2, CURVES_SIZE[1]


def learning_curves(
    histories: Mapping[str, Sequence[Sequence[Mapping[str, float]]]],
    path: Path,
    title: str,
    eval_set: str = "test",
) -> None:
    """Accuracy and NLL on the ``eval_set`` (at the point estimate) per epoch, and the
    training loss (the epoch's mean minibatch loss, at the training samples; log scale) where
    the rows hold it: for each run label (label → one list of epoch rows per seed) the mean
    over seeds as a line and mean ± sample standard deviation as a band, one colour, line
    style and marker per label (so a line hidden under another still shows); ``title`` names
    the comparison."""
    every_row = [r for seeds in histories.values() for rows in seeds for r in rows]
    losses = bool(every_row) and all("train_loss" in r for r in every_row)
    panels = 3 if losses else 2
    fig, axes = plt.subplots(1, panels, figsize=curves_size(panels))
    ax_acc, ax_nll = axes[0], axes[1]
    plotted = [(ax_acc, "test_accuracy", 100.0), (ax_nll, "test_nll", 1.0)]
    if losses:
        plotted.append((axes[2], "train_loss", 1.0))
        axes[2].set(xlabel="epoch", ylabel="training loss (at the samples)", yscale="log")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # tab10
    curves: dict[str, list[tuple[list[float], np.ndarray]]] = {key: [] for _, key, _ in plotted}
    for i, (label, seeds) in enumerate(histories.items()):
        epochs = [r["epoch"] for r in seeds[0]]
        if any([r["epoch"] for r in rows] != epochs for rows in seeds):
            raise ValueError(f"the seeds of {label!r} have different epochs")
        name = f"{label} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
        colour, (dashes, marker) = colours[i % len(colours)], STYLES[i % len(STYLES)]
        every = max(1, len(epochs) // 8)
        for ax, key, factor in plotted:
            mean, sd = mean_and_sd([[factor * r[key] for r in rows] for rows in seeds])
            curves[key].append((epochs, mean))
            ax.plot(
                epochs,
                mean,
                color=colour,
                lw=1.5,
                ls=dashes,
                marker=marker,
                ms=4,
                markevery=(i % every, every),
                label=name,
            )
            ax.fill_between(epochs, mean - sd, mean + sd, color=colour, alpha=0.25, lw=0)
    ax_acc.set(xlabel="epoch", ylabel=f"{eval_set} accuracy (%) at g")
    ax_nll.set(xlabel="epoch", ylabel=f"{eval_set} NLL at g")
    for ax, key, _ in plotted[:2]:
        focus_on_later_epochs(ax, curves[key])
    ax_acc.legend()
    fig.suptitle(f"{title}: mean over the seeds; band: mean ± sample standard deviation")
    fig.tight_layout()
    _save(fig, path)


FOCUS_FROM = 0.25
"""The curves' panels are scaled to the epochs after this fraction of the run (the first
epochs, far from the rest, would flatten the region where the rules differ)."""


def focus_on_later_epochs(
    ax: plt.Axes, curves: Sequence[tuple[Sequence[float], np.ndarray]]
) -> None:
    """Scale ``ax``'s y-axis to the ``curves`` ((epochs, mean) per run) after the first
    :data:`FOCUS_FROM` of each, padded by a tenth, where their whole range is over 1.5 times
    that; the epochs where a mean falls outside are then named on the panel ("curves above
    the panel at epochs 1–6")."""
    if not curves:
        return
    every = np.concatenate([mean for _, mean in curves])
    later = np.concatenate([mean[math.ceil(FOCUS_FROM * len(mean)) :] for _, mean in curves])
    if later.size == 0 or np.ptp(every) <= 1.5 * np.ptp(later):
        return
    pad = 0.1 * max(np.ptp(later), 1e-12)
    low, high = later.min() - pad, later.max() + pad
    ax.set_ylim(low, high)
    outside = sorted(
        {e for epochs, m in curves for e, v in zip(epochs, m, strict=True) if not low <= v <= high}
    )
    where = "below" if every.max() <= high else "above" if every.min() >= low else "outside"
    ax.text(
        0.98,
        0.02 if where == "below" else 0.98,
        f"curves {where} the panel at epoch{'s' if len(outside) > 1 else ''} {_span(outside)}",
        transform=ax.transAxes,
        ha="right",
        va="bottom" if where == "below" else "top",
        fontsize=8,
        color="0.3",
    )


def _span(epochs: Sequence[float]) -> str:
    """``1–6`` for consecutive (whole) epochs, else the list: ``1, 2, 5``."""
    whole = [int(e) for e in epochs]
    if whole == list(range(whole[0], whole[-1] + 1)) and len(whole) > 2:
        return f"{whole[0]}–{whole[-1]}"
    return ", ".join(str(e) for e in whole)


def _digit(ax: plt.Axes, image: np.ndarray, caption: str, marked: bool) -> None:
    ax.imshow(image.mean(axis=0), cmap="gray_r", interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(caption, fontsize=8, color="tab:red" if marked else "k")
    for spine in ax.spines.values():
        spine.set(color="tab:red" if marked else "0.7", linewidth=2.5 if marked else 0.5)


def memory_map(
    images: Tensor,
    labels: Tensor,
    scores: Tensor,
    path: Path,
    title: str,
    marked: Mapping[int, int] | None = None,
) -> None:
    """The most and least sensitive training examples, and the scores per class.

    Left: the 16 highest-scored images ``(N, C, H, W)`` with label and score above the 16
    lowest-scored. Right: per class, a box plot of log₁₀ score (whiskers at the 1st and 99th
    percentiles). ``marked`` maps example indices to their original labels (e.g. flipped
    ones): those are framed in red and captioned with both labels.
    """
    marked = marked or {}
    n = MEMORY_ROWS * MEMORY_COLS
    order = scores.argsort(descending=True)
    fig = plt.figure(figsize=MEMORY_MAP_SIZE)
    grid = fig.add_gridspec(2 * MEMORY_ROWS, MEMORY_COLS + 5, hspace=0.6, wspace=0.3)
    arrays = images.detach().float().cpu().numpy()
    for block, picks in enumerate((order[:n], order[-n:].flip(0))):
        for k, i in enumerate(picks.tolist()):
            ax = fig.add_subplot(grid[block * MEMORY_ROWS + k // MEMORY_COLS, k % MEMORY_COLS])
            label = int(labels[i])
            caption = f"y={label}" + (f" (was {marked[i]})" if i in marked else "")
            _digit(ax, arrays[i], f"{caption}\n{float(scores[i]):.2g}", i in marked)
    fig.text(0.02, 0.95, "most sensitive", fontsize=11, weight="bold")
    fig.text(0.02, 0.48, "least sensitive", fontsize=11, weight="bold")
    ax = fig.add_subplot(grid[:, MEMORY_COLS + 1 :])
    logs = np.log10(np.maximum(scores.detach().double().cpu().numpy(), 1e-30))
    classes = sorted(int(c) for c in labels.unique())
    per_class = [logs[labels.cpu().numpy() == c] for c in classes]
    ax.boxplot(per_class, whis=(1, 99), showfliers=True, flierprops={"markersize": 2})
    ax.set_xticks(range(1, len(classes) + 1), [str(c) for c in classes])
    if marked:
        for i in marked:
            ax.plot(classes.index(int(labels[i])) + 1, logs[i], "x", color="tab:red", ms=6)
    ax.set(xlabel="label", ylabel="log₁₀ score", title="scores per class")
    fig.suptitle(title)
    _save(fig, path)


def sensitivity_scatter(panels: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> None:
    """Estimated against true change, log-log, one panel per entry of ``panels``: title →
    arrays ``truth``, ``estimate``, ``floor`` (the change retraining alone makes, drawn at
    the same estimates), the boolean ``top`` (highest-scored examples; the others are
    random), and ``xlabel``, the true change's name."""
    fig, axes = plt.subplots(1, len(panels), figsize=SCATTER_SIZE, squeeze=False)
    for ax, (name, p) in zip(axes[0], panels.items(), strict=True):
        top = p["top"]
        ax.scatter(
            p["floor"],
            p["estimate"],
            s=12,
            marker="x",
            color="0.6",
            label="retraining alone (nothing removed)",
        )
        ax.scatter(p["truth"][~top], p["estimate"][~top], s=18, label="random examples")
        ax.scatter(p["truth"][top], p["estimate"][top], s=18, label="highest-scored")
        values = np.concatenate([p["truth"], p["estimate"], p["floor"]])
        values = values[values > 0]
        low, high = values.min() / 2, values.max() * 2
        ax.plot([low, high], [low, high], "k--", lw=1, label="estimate = truth")
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), title=name)
        ax.set(xlabel=p["xlabel"], ylabel="estimated change (score)")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)


def error_variance_map(
    error: np.ndarray,
    variance: np.ndarray,
    scores: np.ndarray,
    regions: np.ndarray,
    bounds: tuple[float, float],
    path: Path,
    title: str,
    marked: Sequence[int] = (),
) -> None:
    """The two-axis memory map: every example at its prediction ``error`` (‖eᵢ‖₁) and total
    prediction ``variance``, log-log, coloured by its log₁₀ score (colour bar). The region
    boundaries ``bounds`` (error, variance) are drawn and each region named with its count
    (``regions``: indices into :data:`liegroup_blr.memory_maps.REGIONS`); ``marked`` examples are
    ringed in red."""
    error = np.maximum(error, error[error > 0].min() if (error > 0).any() else 1e-12)
    fig, ax = plt.subplots(figsize=ERROR_VARIANCE_SIZE)
    logs = np.log10(np.maximum(scores, 1e-30))
    points = ax.scatter(error, variance, c=logs, s=6, cmap="viridis", label="training examples")
    fig.colorbar(points, ax=ax, label="log₁₀ score")
    if len(marked):
        at = np.asarray(marked)
        ax.scatter(
            error[at],
            variance[at],
            s=60,
            facecolors="none",
            edgecolors="tab:red",
            label=f"flipped labels ({len(at)})",
        )
    e_bound, v_bound = bounds
    ax.axvline(e_bound, color="k", ls="--", lw=1, label=f"error boundary ({e_bound:g})")
    ax.axhline(v_bound, color="k", ls=":", lw=1, label=f"variance boundary ({v_bound:.3g})")
    ax.set(xscale="log", yscale="log", title=title)
    plain_log_labels(ax)
    ax.set(xlabel="prediction error ‖eᵢ‖₁", ylabel="prediction variance tr Vᵢ (untempered)")
    x0, x1 = ax.get_xlim()
    ax.set_xlim(min(x0, e_bound / 1.5), max(x1, e_bound * 1.5))  # both sides of the boundary
    counts = np.bincount(regions, minlength=len(REGIONS))
    for name, count in zip(REGIONS, counts, strict=True):
        x, y, ha, va = REGION_PLACES[name]
        ax.text(
            x,
            y,
            f"{name} ({count})",
            transform=ax.transAxes,
            ha=ha,
            va=va,
            weight="bold",
            bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
        )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    _save(fig, path)


class PlainLogFormatter(ticker.LogFormatterSciNotation):
    """matplotlib's choice of which ticks of a log axis to label, written as plain numbers
    (0.1, 1, 8, 9, 10) rather than a mix of 10ⁿ and m×10ⁿ."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def plain_log_labels(ax: plt.Axes) -> None:
    """Label both log axes of ``ax`` with :class:`PlainLogFormatter`, major and minor ticks."""
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(PlainLogFormatter())
        axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))


REGION_PLACES = {
    "regular": (0.02, 0.02, "left", "bottom"),
    "unpredictable": (0.98, 0.02, "right", "bottom"),
    "uncertain": (0.5, 0.98, "center", "top"),
}
"""Where each region's name goes, in axes coordinates: the corner of the map it holds."""


def pixel_size(figsize: tuple[float, float]) -> tuple[int, int]:
    """(height, width) in pixels of a figure of ``figsize`` inches saved by this module."""
    return math.floor(figsize[1] * DPI), math.floor(figsize[0] * DPI)


def final_accuracy(
    bars: Mapping[str, Sequence[float]],
    path: Path,
    title: str = "",
    diverged: Mapping[str, int] | None = None,
) -> None:
    """Final average accuracy (%) per method on an axis from 0 to 100: a horizontal bar at
    the mean over the seeds that trained, a dot per such seed and a red cross at 0 per
    diverged seed (``diverged``: label → count), the methods top to bottom in the order of
    ``bars`` (label → values; empty for a method that diverged on every seed)."""
    diverged = diverged or {}
    height = 1.5 + 0.3 * len(bars)
    fig, ax = plt.subplots(figsize=(CURVES_SIZE[0], height))
    rows = np.arange(len(bars))[::-1]
    for row, (label, values) in zip(rows, bars.items(), strict=True):
        if values:
            ax.barh(row, np.mean(values), color="tab:blue", alpha=0.35)
            ax.plot(values, [row] * len(values), "o", color="tab:blue", ms=3)
        lost = diverged.get(label, 0)
        ax.plot([0.0] * lost, [row] * lost, "x", color="tab:red", ms=7, mew=2, clip_on=False)
    ax.set_yticks(rows, list(bars), fontsize="small")
    ax.set_xlim(0.0, 100.0)
    ax.set(xlabel="final average accuracy over all tasks (%)")
    ax.set_title(title, fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    legend = [
        Patch(color="tab:blue", alpha=0.35, label="mean over the seeds that trained"),
        Line2D([], [], ls="", marker="o", color="tab:blue", ms=3, label="a seed"),
        Line2D([], [], ls="", marker="x", color="tab:red", mew=2, label="a diverged seed"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize="small")
    fig.tight_layout(rect=(0.0, 0.3 / height, 1.0, 1.0))
    _save(fig, path)


GREYS: list[tuple[str, Any, str]] = [
    ("0.15", "-", "s"),
    ("0.45", ":", "^"),
    ("0.3", "-.", "D"),
    ("0.55", (0, (5, 1, 1, 1)), "v"),
    ("0.35", (0, (1, 3)), "P"),
    ("0.6", (0, (8, 2)), "X"),
]
"""Colour (a grey), line style and marker of each line drawn in every panel of
:func:`average_accuracy` (the baselines), in order."""
COLOURS = [f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink")]
COLOURS += ["tab:olive", "tab:cyan"]
"""The colours of a panel's own curves in :func:`average_accuracy`: tab10 without its grey."""
PANEL_WIDTH, PANEL_HEIGHT, ZOOM_HEIGHT = 5.0, 4.5, 2.8  # inches, :func:`average_accuracy`
ZOOM, ZOOM_CLUSTER = 15.0, 4
"""How many points of accuracy the zoomed row of :func:`average_accuracy` spans, and how many
curves must end in it for the row to be drawn."""


def _accuracy_panel(
    ax: plt.Axes,
    curves: Mapping[str, Mapping[str, np.ndarray]],
    shared: Mapping[str, Mapping[str, np.ndarray]],
) -> None:
    """One panel of :func:`average_accuracy`: ``shared`` in grey under ``curves``."""
    for i, (label, c) in enumerate(shared.items()):
        grey, ls, marker = GREYS[i % len(GREYS)]
        tasks = np.arange(1, len(c["mean"]) + 1)
        (line,) = ax.plot(tasks, c["mean"], color=grey, ls=ls, marker=marker, ms=3, lw=1.2)
        line.set_gid(f"shared:{label}")
        if "dashed" in c:
            ax.plot(tasks, c["dashed"], ls="--", lw=0.8, color=grey, alpha=0.6)
    for i, (label, c) in enumerate(curves.items()):
        colour, marker = COLOURS[i % len(COLOURS)], STYLES[i % len(STYLES)][1]
        tasks = np.arange(1, len(c["mean"]) + 1)
        ax.plot(tasks, c["mean"], color=colour, marker=marker, ms=4, lw=1.6, label=label)
        ax.fill_between(tasks, c["low"], c["high"], color=colour, alpha=0.15, lw=0)
        if "dashed" in c:
            ax.plot(tasks, c["dashed"], ls="--", lw=0.9, color=colour)
    ax.grid(alpha=0.3)


def average_accuracy_size(panels: int, entries: int, zoom: bool) -> tuple[float, float]:
    """The size (inches) of :func:`average_accuracy`'s figure of ``panels`` columns, at most
    ``entries`` curves in one, with the zoomed row or without."""
    below = 1.0 + 0.17 * entries  # the x label, the columns' legends, the figure's legend
    height = 0.4 + PANEL_HEIGHT + (ZOOM_HEIGHT if zoom else 0.0) + below
    return max(CURVES_SIZE[0], PANEL_WIDTH * panels), height


def average_accuracy(
    panels: Mapping[str, Mapping[str, Mapping[str, np.ndarray]]],
    path: Path,
    title: str = "",
    shared: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    band: str = "band: mean ± sd over seeds",
    zoom: float | None = ZOOM,
) -> None:
    """Average accuracy (%) against the number of tasks learned, as small multiples: one
    column per entry of ``panels`` (panel title → its curves), side by side on one y axis
    from 0 to 100, its curves in colour with a legend in the panel, and the ``shared``
    curves (e.g. the baselines) in grey in every panel, named once in the figure's legend.
    A second row repeats the panels on the top ``zoom`` points of the axis, below the
    highest mean, when :data:`ZOOM_CLUSTER` curves or more end there (the best methods
    close together); ``zoom=None`` never draws it. Each column's legend lies under it.

    A curve is arrays over tasks: ``mean`` (a line), ``low`` and ``high`` (a band, drawn
    for the panels' curves only; ``band`` says what it is) and optionally ``dashed`` (a
    second line in the same colour, e.g. the point estimate beside the model average).
    Curves are keyed by their legend text.
    """
    shared = shared or {}
    if not panels:
        raise ValueError("average_accuracy: no panel to draw")
    every = [c for p in panels.values() for c in p.values()] + list(shared.values())
    top = min(100.0, math.ceil(max(float(np.nanmax(c["mean"])) for c in every) + 1.0))
    if zoom is not None and sum(c["mean"][-1] >= top - zoom for c in every) < ZOOM_CLUSTER:
        zoom = None
    n, rows = len(panels), 1 if zoom is None else 2
    entries = max(len(p) for p in panels.values())
    width, height = average_accuracy_size(n, entries, zoom is not None)
    fig, axes = plt.subplots(
        rows,
        n,
        figsize=(width, height),
        sharey="row",
        sharex=True,
        squeeze=False,
        height_ratios=[PANEL_HEIGHT, ZOOM_HEIGHT][:rows],
    )
    tasks_max = max(len(c["mean"]) for c in every)
    dashed = any("dashed" in c for c in every)
    for column, (name, curves) in enumerate(panels.items()):
        for row in range(rows):
            _accuracy_panel(axes[row][column], curves, shared)
        ax = axes[0][column]
        ax.set_title(name, fontsize="medium")
        axes[-1][column].set_xlabel("tasks learned")
        if curves:
            own, labels = ax.get_legend_handles_labels()
            axes[-1][column].legend(
                own,
                labels,
                loc="upper center",
                bbox_to_anchor=(0.5, -0.16),
                fontsize="small",
                frameon=False,
            )
    axes[0][0].set_xticks(np.arange(1, tasks_max + 1))
    axes[0][0].set_ylabel("average accuracy over tasks learned (%)")
    axes[0][0].set_ylim(0.0, 100.0)
    if zoom is not None:
        axes[1][0].set_ylim(top - zoom, top)
        axes[1][0].set_ylabel(f"zoom: the top {zoom:g} points (%)")
    handles: list[Any] = [
        Line2D([], [], color=g, ls=ls, marker=marker, ms=3, lw=1.2, label=label)
        for i, label in enumerate(shared)
        for g, ls, marker in [GREYS[i % len(GREYS)]]
    ]
    handles.append(Patch(color="grey", alpha=0.3, label=band))
    if dashed:
        handles.append(Line2D([], [], ls="--", lw=0.9, color="grey", label="dashed: at g"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize="small")
    fig.suptitle(title, fontsize="small")
    fig.tight_layout(rect=(0.0, 0.45 / height, 1.0, 1.0))
    _save(fig, path)
