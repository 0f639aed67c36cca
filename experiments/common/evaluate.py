"""Final evaluation of a run: predictive metrics, calibration, first-layer sparsity,
out-of-distribution detection and figures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import liegroup_blr as lgb
from experiments.common import figures, ood
from experiments.common.sparsity import NEAR_ZERO, first_layer, init_scale, sparsity
from liegroup_blr import predictive

# file stem and title of the positive parts of a group element; m and b are the point estimate
PART_FIGURES = {
    "g+": ("excitatory", "excitatory filters g⁺"),
    "g-": ("inhibitory", "inhibitory filters g⁻"),
    "A": ("scale", "posterior scale A"),
}


def evaluate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    test: Sequence[tuple[Tensor, Tensor]],
    cfg: dict[str, Any],
    out: Path,
    *,
    title: str,
) -> dict[str, Any]:
    """Metrics at the point estimate g, at the posterior mean E[θ] where it is another point
    (``"mean"``: the multiplicative rule's E[ξ](g⁺ − g⁻)) and of the Bayesian model average;
    writes the figures, each titled ``title`` (the run: config, rule, seed) and what it shows.

    ``cfg`` is the resolved ``[eval]`` table: ``samples`` posterior samples for the model
    average, ``bins`` for the ECE, ``sparsity_samples`` for the sample-averaged sparsity.
    Deterministic optimizers (SGD, Adam) have no posterior: their "average" is the point
    estimate, flagged by ``has_posterior = False``.
    """
    inputs = [x for x, _ in test]
    labels = torch.cat([y for _, y in test])
    has_posterior = hasattr(optimizer, "sampled_params")
    point = predictive.predictive_log_probs(model, inputs)
    average = (
        predictive.predictive_log_probs(model, inputs, optimizer, cfg["samples"])
        if has_posterior
        else point
    )
    bins = cfg["bins"]
    results: dict[str, Any] = {
        "has_posterior": has_posterior,
        "point": predictive.metrics(point, labels, bins),
        "average": predictive.metrics(average, labels, bins),
    }
    mean = posterior_mean(model, optimizer)
    if mean is not None:
        with mean.at_point_estimate(model):
            results["mean"] = predictive.metrics(
                predictive.predictive_log_probs(model, inputs), labels, bins
            )
    averaged = f"model average, {cfg['samples']} samples" if has_posterior else "no posterior: at g"
    figures.reliability_diagram(
        {
            f"at g (ECE {results['point']['ece']:.4f})": predictive.reliability_bins(
                point, labels, bins
            ),
            f"{averaged} (ECE {results['average']['ece']:.4f})": predictive.reliability_bins(
                average, labels, bins
            ),
        },
        out / "reliability.png",
        f"{title}: reliability ({bins} confidence bins)",
    )
    results["sparsity"] = first_layer_sparsity(model, optimizer, cfg["sparsity_samples"])
    results["ood"] = out_of_distribution(model, optimizer, inputs, cfg["samples"], out, title)
    plot_first_layer(model, optimizer, inputs[0][0], out, title)
    plot_weight_magnitudes(model, optimizer, out / "weights.png", title)
    return results


def posterior_mean(model: nn.Module, optimizer: Any) -> lgb.Posterior | None:
    """The optimizer's posterior read at its mean, E[θ] = readout(g·E[ξ]), where that is not
    its point estimate at g (a base whose mean is not the group's reference point: the
    multiplicative rule's Rayleigh); ``None`` otherwise (also without a Lie-group
    posterior)."""
    if lgb.optim.unwrap(optimizer) is None:
        return None
    post = lgb.Posterior.from_optimizer(optimizer, model)
    if post.point_at == "mean":
        return None
    mean = post.with_point_at("mean")
    at_g, at_mean = post.point_estimates(), mean.point_estimates()
    same = all(torch.equal(at_g[k], at_mean[k]) for k in at_g)
    return None if same else mean


def out_of_distribution(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: Sequence[Tensor],
    samples: int,
    out: Path,
    title: str,
) -> dict[str, dict[str, float]]:
    """AUROC of the predictive entropy for test inputs vs each shift of
    :mod:`experiments.common.ood`, at g and for the model average of ``samples`` posterior samples;
    writes ``ood.png`` (titled ``title``, the run).

    The average uses the same posterior samples for the test inputs and the shifted ones.
    """
    shifted = ood.shifted_inputs(inputs)
    pooled = list(inputs) + [x for batches in shifted.values() for x in batches]
    sizes = [sum(len(x) for x in inputs)] + [sum(len(x) for x in b) for b in shifted.values()]
    names = ["test inputs", *shifted]
    estimates = {"point": predictive.predictive_log_probs(model, pooled)}
    mean = posterior_mean(model, optimizer)
    if mean is not None:
        with mean.at_point_estimate(model):
            estimates["mean"] = predictive.predictive_log_probs(model, pooled)
    if hasattr(optimizer, "sampled_params"):
        estimates["average"] = predictive.predictive_log_probs(model, pooled, optimizer, samples)
    entropies = {
        est: dict(zip(names, ood.entropy(log_p).split(sizes), strict=True))
        for est, log_p in estimates.items()
    }
    titles = {
        "point": "at g",
        "mean": "at the posterior mean E[θ]",
        "average": f"model average, {samples} samples",
    }
    figures.entropy_histograms(
        {titles[est]: ent for est, ent in entropies.items()},
        out / "ood.png",
        f"{title}: predictive entropy, test inputs and shifted ones",
    )
    average = entropies.get("average", entropies["point"])  # no posterior: the point estimate
    aurocs = {
        name: {
            "point": ood.auroc(entropies["point"]["test inputs"], entropies["point"][name]),
            "average": ood.auroc(average["test inputs"], average[name]),
        }
        for name in shifted
    }
    if "mean" in entropies:
        at_mean = entropies["mean"]
        for name in shifted:
            aurocs[name]["mean"] = ood.auroc(at_mean["test inputs"], at_mean[name])
    return aurocs


def plot_weight_magnitudes(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, title: str
) -> None:
    """Distribution of log₁₀|w| of the first layer at g (and at one posterior sample) of the
    run ``title``."""
    weight = first_layer(model)
    weights = {"at g": weight.detach().clone()}
    sampler = getattr(optimizer, "sampled_params", None)
    if sampler is not None:
        with sampler():
            weights["one posterior sample"] = weight.detach().clone()
    figures.weight_magnitudes(
        weights, path, f"{title}: first-layer weight magnitudes", NEAR_ZERO * init_scale(weight)
    )


def first_layer_sparsity(
    model: nn.Module, optimizer: torch.optim.Optimizer, samples: int
) -> dict[str, dict[str, float]]:
    """Sparsity measures (:func:`experiments.common.sparsity.sparsity`) of the first layer at g and
    averaged over samples.

    "averaged" is the mean of each measure over ``samples`` posterior samples θ = g·ξ
    (the point estimate again for deterministic optimizers).
    """
    weight = first_layer(model)
    at_g = sparsity(weight)
    sampler = getattr(optimizer, "sampled_params", None)
    if sampler is None:
        return {"point": at_g, "average": dict(at_g)}
    draws = []
    for _ in range(samples):
        with sampler():
            draws.append(sparsity(weight))
    return {"point": at_g, "average": {k: sum(d[k] for d in draws) / samples for k in at_g}}


def as_filters(weight: Tensor, input_shape: Sequence[int]) -> Tensor | None:
    """A layer's weight as images ``(F, C, H, W)``: conv kernels, or dense rows over the input."""
    if weight.ndim == 4:
        return weight
    if weight.ndim == 2 and weight.shape[1] == math.prod(input_shape):
        return weight.reshape(-1, *input_shape)
    return None


def plot_first_layer(
    model: nn.Module, optimizer: torch.optim.Optimizer, example: Tensor, out: Path, title: str
) -> list[Path]:
    """Filter grids of the first layer at g and of each part of its group element, titled
    with the run ``title``.

    Shows the 32 filters most activated (|⟨w, x⟩|) by the input ``example`` when the
    filters span the input (dense first layer), else the 32 of largest norm; every
    figure shows the same filters. Returns the written paths (none if not image-shaped).
    """
    weight = first_layer(model).detach()
    filters = as_filters(weight, example.shape)
    if filters is None:
        return []
    flat = filters.flatten(1)
    score = (flat @ example.flatten()).abs() if weight.ndim == 2 else flat.norm(dim=1)
    top = torch.argsort(score, descending=True)[: figures.FILTER_ROWS * figures.FILTER_COLS]
    paths = [out / "filters.png"]
    figures.filter_grid(filters[top], paths[0], f"{title}: first-layer filters at g")
    group_element = getattr(optimizer, "group_element", None)
    parts = group_element(first_layer(model)) if group_element is not None else {}
    for key, (stem, what) in PART_FIGURES.items():
        if key in parts:
            paths.append(out / f"filters_{stem}.png")
            part = parts[key].reshape(filters.shape)
            figures.filter_grid(part[top], paths[-1], f"{title}: {what}", signed=False)
    return paths
