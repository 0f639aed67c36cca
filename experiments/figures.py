"""PNG figures (matplotlib, Agg backend) with fixed pixel sizes: figure size × DPI."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from torch import Tensor

DPI = 100
RELIABILITY_SIZE = (10.0, 5.0)  # inches: 1000 × 500 pixels
FILTERS_SIZE = (8.0, 4.5)  # 800 × 450 pixels
CURVES_SIZE = (10.0, 4.0)  # 1000 × 400 pixels
HISTOGRAM_SIZE = (8.0, 4.0)  # 800 × 400 pixels
MEMORY_MAP_SIZE = (13.0, 7.0)  # 1300 × 700 pixels
SCATTER_SIZE = (10.0, 4.5)  # 1000 × 450 pixels
MEMORY_ROWS, MEMORY_COLS = 2, 8  # digits shown per block (most and least sensitive)
FILTER_ROWS, FILTER_COLS = 4, 8
ROBUST_QUANTILE = 0.99


def _save(fig: plt.Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def reliability_diagram(panels: Mapping[str, Mapping[str, Tensor]], path: Path) -> None:
    """One panel per entry of ``panels``: title → output of ``predictive.reliability_bins``.

    Bars: accuracy per confidence bin; the hatched red part spans the gap to the bin's
    mean confidence; the diagonal is perfect calibration.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=RELIABILITY_SIZE, squeeze=False)
    for ax, (title, hist) in zip(axes[0], panels.items(), strict=True):
        edges = hist["edges"].numpy()
        width = np.diff(edges)
        filled = hist["count"].numpy() > 0
        acc, conf = hist["accuracy"].numpy(), hist["confidence"].numpy()
        left = edges[:-1][filled]
        ax.bar(
            left,
            acc[filled],
            width[filled],
            align="edge",
            color="tab:blue",
            edgecolor="k",
            label="accuracy",
        )
        ax.bar(
            left,
            np.abs(conf - acc)[filled],
            width[filled],
            bottom=np.minimum(conf, acc)[filled],
            align="edge",
            color="tab:red",
            alpha=0.35,
            hatch="//",
            label="gap to mean confidence",
        )
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy", title=title)
        ax.legend(loc="upper left")
    fig.tight_layout()
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
    """Up to 32 filters ``(F, C, H, W)`` in a 4 × 8 grid, each with its own robust limits.

    ``signed`` filters use a blue (negative) to red (positive) map symmetric about 0;
    unsigned ones (g⁺, g⁻) go from black (0) to white. Each filter's colours saturate at its
    99th percentile of |w| (:func:`robust_limit`).
    """
    fig, axes = plt.subplots(FILTER_ROWS, FILTER_COLS, figsize=FILTERS_SIZE)
    array = filters.detach().cpu().double().numpy()
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i < len(array):
            img, style = _filter_image(array[i], signed)
            ax.imshow(img, interpolation="nearest", **style)
    fig.suptitle(f"{title} (colours saturate at each filter's 99th percentile of |w|)")
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.9, wspace=0.05, hspace=0.05)
    _save(fig, path)


def weight_magnitudes(
    weights: Mapping[str, Tensor], path: Path, near_zero: float | None = None
) -> None:
    """Histogram of log₁₀|w| of a layer, one line per entry of ``weights`` (label → tensor).

    ``near_zero`` marks the near-zero threshold as a vertical line.
    """
    fig, ax = plt.subplots(figsize=HISTOGRAM_SIZE)
    for label, w in weights.items():
        mag = w.detach().abs().double().flatten().cpu().numpy()
        logs = np.log10(np.maximum(mag, 1e-12))
        ax.hist(logs, bins=120, histtype="step", lw=1.5, density=True, label=label)
    if near_zero is not None:
        ax.axvline(math.log10(near_zero), color="k", ls="--", lw=1, label="near-zero threshold")
    ax.set(xlabel="log₁₀ |w|", ylabel="density", title="first-layer weight magnitudes")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def entropy_histograms(panels: Mapping[str, Mapping[str, Tensor]], path: Path) -> None:
    """One panel per entry of ``panels`` (title → {input set → predictive entropies}):
    a histogram of the predictive entropy per input set."""
    fig, axes = plt.subplots(1, len(panels), figsize=RELIABILITY_SIZE, squeeze=False)
    for ax, (title, sets) in zip(axes[0], panels.items(), strict=True):
        top = max(float(e.max()) for e in sets.values())
        edges = np.linspace(0.0, max(top, 1e-6), 41)
        for name, entropy in sets.items():
            ax.hist(entropy.cpu().numpy(), bins=edges, histtype="step", lw=1.5, label=name)
        ax.set(xlabel="predictive entropy (nats)", ylabel="inputs", title=title)
        ax.legend()
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


def learning_curves(
    histories: Mapping[str, Sequence[Sequence[Mapping[str, float]]]],
    path: Path,
    eval_set: str = "test",
) -> None:
    """Accuracy and NLL on the ``eval_set`` (at the point estimate) per epoch: for each run
    label (label → one list of epoch rows per seed) the mean over seeds as a line and mean ±
    sample standard deviation as a band, one colour per label."""
    fig, (ax_acc, ax_nll) = plt.subplots(1, 2, figsize=CURVES_SIZE)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # tab10
    for i, (label, seeds) in enumerate(histories.items()):
        epochs = [r["epoch"] for r in seeds[0]]
        if any([r["epoch"] for r in rows] != epochs for rows in seeds):
            raise ValueError(f"the seeds of {label!r} have different epochs")
        name = f"{label} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
        for ax, key, factor in ((ax_acc, "test_accuracy", 100.0), (ax_nll, "test_nll", 1.0)):
            mean, sd = mean_and_sd([[factor * r[key] for r in rows] for rows in seeds])
            colour = colours[i % len(colours)]
            ax.plot(epochs, mean, color=colour, lw=1.5, label=name)
            ax.fill_between(epochs, mean - sd, mean + sd, color=colour, alpha=0.25, lw=0)
    ax_acc.set(xlabel="epoch", ylabel=f"{eval_set} accuracy (%) at g")
    ax_nll.set(xlabel="epoch", ylabel=f"{eval_set} NLL at g")
    ax_acc.legend()
    fig.suptitle("mean over the seeds; band: mean ± sample standard deviation")
    fig.tight_layout()
    _save(fig, path)


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


def sensitivity_scatter(panels: Mapping[str, Mapping[str, np.ndarray]], path: Path) -> None:
    """Estimated against true deviation, log-log, one panel per entry of ``panels``: title →
    arrays ``truth``, ``estimate``, ``floor`` (the noise of retraining, drawn at the same
    estimates) and the boolean ``top`` (highest-scored examples; the others are random)."""
    fig, axes = plt.subplots(1, len(panels), figsize=SCATTER_SIZE, squeeze=False)
    for ax, (title, p) in zip(axes[0], panels.items(), strict=True):
        top = p["top"]
        ax.scatter(
            p["floor"],
            p["estimate"],
            s=12,
            marker="x",
            color="0.6",
            label="nothing removed, other permutations",
        )
        ax.scatter(p["truth"][~top], p["estimate"][~top], s=18, label="random examples")
        ax.scatter(p["truth"][top], p["estimate"][top], s=18, label="highest-scored")
        values = np.concatenate([p["truth"], p["estimate"], p["floor"]])
        values = values[values > 0]
        low, high = values.min() / 2, values.max() * 2
        ax.plot([low, high], [low, high], "k--", lw=1, label="estimate = truth")
        if high > 2:
            ax.axhline(2.0, color="tab:red", lw=1, ls=":", label="largest possible change (2)")
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), title=title)
        ax.set(
            xlabel="true change ‖p(without i) − p‖₁ (retraining)", ylabel="estimated change (score)"
        )
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    _save(fig, path)


def pixel_size(figsize: tuple[float, float]) -> tuple[int, int]:
    """(height, width) in pixels of a figure of ``figsize`` inches saved by this module."""
    return math.floor(figsize[1] * DPI), math.floor(figsize[0] * DPI)


def average_accuracy(
    curves: Mapping[str, Mapping[str, np.ndarray]], path: Path, title: str = ""
) -> None:
    """Average accuracy (%) against the number of tasks learned, one colour per method.

    ``curves`` maps a method to arrays over tasks: ``mean`` (a line), ``low`` and ``high``
    (a band, e.g. the lowest and highest seed) and optionally ``dashed`` (a second line in
    the same colour, e.g. the point estimate beside the model average). The legend names
    every method, the band and the dashed lines.
    """
    fig, ax = plt.subplots(figsize=CURVES_SIZE)
    cmap = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
    for i, (label, c) in enumerate(curves.items()):
        colour = cmap(i % cmap.N)
        tasks = np.arange(1, len(c["mean"]) + 1)
        ax.plot(tasks, c["mean"], marker=".", color=colour, label=label)
        ax.fill_between(tasks, c["low"], c["high"], color=colour, alpha=0.2, lw=0)
        if "dashed" in c:
            ax.plot(tasks, c["dashed"], ls="--", lw=1, color=colour)
    ax.fill_between([], [], color="grey", alpha=0.2, lw=0, label="band: lowest to highest seed")
    if any("dashed" in c for c in curves.values()):
        ax.plot([], [], ls="--", lw=1, color="grey", label="dashed: point estimate (at g)")
    ax.set(xlabel="tasks learned", ylabel="average accuracy over tasks learned (%)")
    ax.set_title(title, fontsize="small")
    ax.set_xticks(np.arange(1, max(len(c["mean"]) for c in curves.values()) + 1))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize="x-small", ncol=1 if len(curves) <= 6 else 2)
    fig.tight_layout()
    _save(fig, path)
